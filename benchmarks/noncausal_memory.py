"""Peak extra memory of non-causal linear attention against N: the chunked form stays flat, the global form
(and the source document's code, which maps all of K first) grows with N.

Each (form, N) runs in a fresh process; the peak resident set size is read before and after the call, so the
figure is the call's own high-water mark, minus the output it must return (N·Dv values).

    .venv/bin/python benchmarks/noncausal_memory.py            # table, and out/bench/noncausal_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

CHILD = r"""
import resource, sys, json, torch, linattn
form, n, heads, dim, features, chunk = sys.argv[1], *map(int, sys.argv[2:7])
torch.manual_seed(0)
q, k, v = (torch.randn(1, heads, n, dim) for _ in range(3))
doubled = lambda x: torch.cat([torch.nn.functional.elu(x) + 1, torch.nn.functional.elu(-x) + 1], -1)
fmap = "elu" if features == dim else doubled
linattn.linear_attention(q[..., :8, :], k[..., :8, :], v[..., :8, :], feature_map=fmap)  # warm the allocator
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with torch.no_grad():
    size = chunk if form == "chunked" else None
    out = linattn.linear_attention(q, k, v, feature_map=fmap, form=form, chunk_size=size)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"extra_kib": after - before, "output_kib": out.numel() * out.element_size() // 1024}))
"""


def measure(form: str, n: int, heads: int, dim: int, features: int, chunk: int) -> dict[str, float]:
    result = subprocess.run(
        [sys.executable, "-c", CHILD, form, str(n), str(heads), str(dim), str(features), str(chunk)],
        capture_output=True, text=True, check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[16384, 65536, 262144, 1048576])
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--features", type=int, default=128, help="F: 2·dim uses [elu(x)+1, elu(-x)+1]")
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--out", default="out/bench/noncausal_memory.json")
    args = parser.parse_args()
    rows = []
    print(f"non-causal, H={args.heads}, D={args.dim}, F={args.features}, fp32, chunk={args.chunk}; "
          "extra = peak RSS growth during the call minus the returned output")
    print(f"{'N':>9} {'form':>8} {'extra MiB':>10} {'output MiB':>11} {'q+k+v MiB':>10}")
    for n in args.sizes:
        for form in ("chunked", "global"):
            m = measure(form, n, args.heads, args.dim, args.features, args.chunk)
            extra = max(m["extra_kib"] - m["output_kib"], 0) / 1024
            inputs = 3 * args.heads * n * args.dim * 4 / 2**20
            rows.append({"n": n, "form": form, "extra_mib": extra, "output_mib": m["output_kib"] / 1024,
                         "inputs_mib": inputs})
            print(f"{n:>9} {form:>8} {extra:>10.1f} {m['output_kib'] / 1024:>11.1f} {inputs:>10.1f}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump({"rows": rows, "args": vars(args), "maxrss_unit": "KiB",
                   "page_size": resource.getpagesize()}, handle, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
