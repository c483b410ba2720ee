"""How far the native causal forward's fp32 output drifts from float64 over a long sequence, beside the torch chunked
form's, in one run: the native kernels add each token's φ(k)vᵀ to the state in turn (sequential fp32 sums), the
chunked form sums within chunks of 64 and then across chunks.

    python benchmarks/native_long_error.py                    # N = 2^20, B = H = 1, D = 16, elu
    python benchmarks/native_long_error.py --log2n 18 --dim 64

The float64 reference is the native kernel in float64 (it agrees with the torch chunked form in float64 to ~1e-10,
printed first).
"""

from __future__ import annotations

import argparse

import torch

import linattn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log2n", type=int, default=20)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n, dim = 1 << args.log2n, args.dim
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, n, dim, generator=gen, dtype=torch.float64) for _ in range(3))
    with torch.no_grad():
        reference = linattn.linear_attention(q, k, v, causal=True, backend="native")
        chunked = linattn.linear_attention(q, k, v, causal=True, backend="torch")
        print(f"N = {n}, D = {dim}: float64 native against float64 chunked: "
              f"{float((reference - chunked).abs().max()):.1e}")
        for name, backend in (("native fp32", "native"), ("torch chunked fp32", "torch")):
            error = (linattn.linear_attention(q.float(), k.float(), v.float(), causal=True, backend=backend).double()
                     - reference).abs()
            print(f"{name:>20}: max {float(error.max()):.2e}, mean {float(error.mean()):.2e}, "
                  f"max over the last 1,024 tokens {float(error[..., -1024:, :].max()):.2e}")


if __name__ == "__main__":
    main()
