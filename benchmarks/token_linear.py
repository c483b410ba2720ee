"""A decoding token's linear layers: torch's ``F.linear`` against linattn's ``TokenLinear`` kernel, side by side.

One token of a decoder multiplies one row by every weight matrix, so its speed is the speed at which the weights
stream from memory. The script builds the weight matrices of a model's layers (SmolLM2-135M's shapes by default:
30 layers of q, k, v, o (576 x 576, 192 x 576 twice, 576 x 576), gate and up (1536 x 576), down (576 x 1536), and
the 49,152 x 576 LM head; distinct tensors, 538 MB in fp32, far beyond any cache), and times one pass of one
token through all of them with each implementation, alternating in rounds. It prints the milliseconds, the read
rate in GB/s, a plain read of the same bytes (``sum``) as the machine's reachable rate, and the ratio; it checks
that the two agree against float64 first.

    .venv/bin/python benchmarks/token_linear.py [--threads 2] [--rounds 9] [--out docs/results/token_linear.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from linattn.backends import native
from linattn.nn.token_linear import TokenLinear, lean_linears

# (out, in) of one SmolLM2-135M layer's matrices, then the layer count and the LM head
LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
LAYERS, VOCAB, WIDTH = 30, 49152, 576


def weights(layers: int, vocab: int) -> list[TokenLinear]:
    """The model's linear layers as TokenLinear modules (no bias, as SmolLM2's)."""
    shapes = [shape for _ in range(layers) for shape in LAYER] + [(vocab, WIDTH)]
    modules = []
    for out, inp in shapes:
        module = torch.nn.Linear(inp, out, bias=False)
        lean_linears(module)
        modules.append(module)
    return modules  # type: ignore[return-value]


def one_token(modules: list[TokenLinear], inputs: dict[int, torch.Tensor], plain: bool) -> None:
    for module in modules:
        x = inputs[module.in_features]
        if plain:
            F.linear(x, module.weight)
        else:
            module(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--out", default=None, help="a JSON file for the results")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if native.module() is None:
        raise SystemExit(f"the native kernels are not built here: {native.status()}")
    torch.manual_seed(0)
    modules = weights(args.layers, args.vocab)
    inputs = {width: torch.randn(1, width) for width in (576, 1536)}
    with torch.no_grad():
        for module in modules[:8]:
            x = inputs[module.in_features]
            exact = F.linear(x.double(), module.weight.double())
            bound = (module.in_features + 1) * 2.0**-24 * F.linear(x.double().abs(), module.weight.double().abs())
            assert ((module(x).double() - exact).abs() <= bound).all(), "TokenLinear outside the rounding bound"
        total = sum(module.weight.numel() * module.weight.element_size() for module in modules)
        flat = torch.cat([module.weight.reshape(-1) for module in modules[: len(modules) // 2]])
        times: dict[str, list[float]] = {"F.linear": [], "TokenLinear": [], "read (sum)": []}
        for round_ in range(args.rounds + 1):
            for name in times:
                begin = time.perf_counter()
                if name == "read (sum)":
                    flat.sum()
                else:
                    one_token(modules, inputs, plain=name == "F.linear")
                seconds = time.perf_counter() - begin
                if name == "read (sum)":
                    seconds *= total / (flat.numel() * flat.element_size())
                if round_:  # the first round warms up
                    times[name].append(seconds)
    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, {threads} threads, {platform.processor() or platform.machine()}, "
          f"{torch.backends.cpu.get_cpu_capability()}, load {os.getloadavg()[0]:.1f}; one token through "
          f"{len(modules)} matrices, {total / 1e6:.0f} MB fp32; median of {args.rounds} rounds")
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, seconds in medians.items():
        print(f"  {name:<12} {seconds * 1e3:8.2f} ms  {total / seconds / 1e9:6.1f} GB/s")
    ratio = medians["F.linear"] / medians["TokenLinear"]
    print(f"  TokenLinear is {ratio:.2f}x F.linear")
    if args.out:
        payload = {"torch": torch.__version__, "threads": threads,
                   "capability": torch.backends.cpu.get_cpu_capability(), "processor": platform.processor(),
                   "bytes": total, "rounds": args.rounds,
                   "ms": {name: [1e3 * s for s in values] for name, values in times.items()},
                   "median_ms": {name: 1e3 * s for name, s in medians.items()}, "speedup": ratio}
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump(payload, handle, indent=2)
            handle.write("\n")


if __name__ == "__main__":
    main()
