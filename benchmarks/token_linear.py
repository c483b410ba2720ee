"""A decoding token's linear layers: torch's ``F.linear`` against linattn's ``TokenLinear`` kernel, side by side,
and the same kernel on weights that are blocks of integer codes (GGUF's Q4_1 and Q8_0, as SmolLM2's file holds them).

One token of a decoder multiplies one row by every weight matrix, so its speed is the speed at which the weights
stream from memory. The script builds the weight matrices of a model's layers (SmolLM2-135M's shapes by default:
30 layers of q, k, v, o (576 x 576, 192 x 576 twice, 576 x 576), gate and up (1536 x 576), down (576 x 1536), and
the 49,152 x 576 LM head; distinct tensors, 538 MB in fp32, far beyond any cache), and times one pass of one
token through all of them with each implementation, alternating in rounds. It prints the milliseconds, the read
rate in GB/s, a plain read of the same bytes (``sum``) as the machine's reachable rate, and the ratio; it checks
that the two agree against float64 first. ``TokenLinear (blocks)`` runs on a second set of matrices of the same
shapes whose weights lie on the block grids (Q4_1 for the layers, Q8_0 for the head, as in SmolLM2's GGUF file), so
that each layer reads its codes (``linattn.nn.token_linear.block_weights``): 111 MB a token instead of 538.

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


def on_grid(w: torch.Tensor, head: bool) -> torch.Tensor:
    """w rounded to GGUF's blocks of 32 as llama.cpp's reference quantizers do: Q8_0 for the head (d = fp16 of the
    largest magnitude / 127, codes round(w / d)), Q4_1 for the layers (m = fp16(min), d = fp16((max − min) / 15),
    codes ⌊(w − min) / d + ½⌋ ≤ 15); what a reader's fp32 copy then holds, d·q (+ m)."""
    blocks = w.reshape(w.shape[0], -1, 32)
    if head:
        d = (blocks.abs().amax(-1, keepdim=True) / 127).half().float()
        return (d * torch.round(blocks / d).clamp(-127, 127)).reshape(w.shape)
    low = blocks.amin(-1, keepdim=True)
    d = ((blocks.amax(-1, keepdim=True) - low) / 15).half().float()
    q = torch.floor((blocks - low) / d + 0.5).clamp(max=15)
    return (d * q + low.half().float()).reshape(w.shape)


def weights(layers: int, vocab: int, blocks: bool = False) -> list[TokenLinear]:
    """The model's linear layers as TokenLinear modules (no bias, as SmolLM2's); ``blocks``: their weights on the
    block grids, each module holding its codes."""
    shapes = [shape for _ in range(layers) for shape in LAYER] + [(vocab, WIDTH)]
    modules = []
    for index, (out, inp) in enumerate(shapes):
        module = torch.nn.Linear(inp, out, bias=False)
        if blocks:
            with torch.no_grad():
                module.weight.copy_(on_grid(module.weight, head=index == len(shapes) - 1))
        lean_linears(module)
        assert (module.blocks is not None) == blocks  # type: ignore[attr-defined]
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
    coded = weights(args.layers, args.vocab, blocks=True)
    coded_bytes = sum(module.blocks.nbytes for module in coded if module.blocks is not None)
    inputs = {width: torch.randn(1, width) for width in (576, 1536)}
    with torch.no_grad():
        for module in modules[:8] + coded[:8] + coded[-1:]:
            x = inputs[module.in_features]
            exact = F.linear(x.double(), module.weight.double())
            bound = (module.in_features + 1) * 2.0**-24 * F.linear(x.double().abs(), module.weight.double().abs())
            assert ((module(x).double() - exact).abs() <= bound).all(), "TokenLinear outside the rounding bound"
        total = sum(module.weight.numel() * module.weight.element_size() for module in modules)
        flat = torch.cat([module.weight.reshape(-1) for module in modules[: len(modules) // 2]])
        times: dict[str, list[float]] = {"F.linear": [], "TokenLinear": [], "TokenLinear (blocks)": [],
                                         "read (sum)": []}
        for round_ in range(args.rounds + 1):
            for name in times:
                begin = time.perf_counter()
                if name == "read (sum)":
                    flat.sum()
                else:
                    one_token(coded if name == "TokenLinear (blocks)" else modules, inputs, plain=name == "F.linear")
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
        read = coded_bytes if name == "TokenLinear (blocks)" else total
        print(f"  {name:<20} {seconds * 1e3:8.2f} ms  {read / 1e6:5.0f} MB  {read / seconds / 1e9:6.1f} GB/s")
    ratio = medians["F.linear"] / medians["TokenLinear"]
    blocks_ratio = medians["F.linear"] / medians["TokenLinear (blocks)"]
    print(f"  TokenLinear is {ratio:.2f}x F.linear; on the blocks {blocks_ratio:.2f}x")
    if args.out:
        payload = {"torch": torch.__version__, "threads": threads,
                   "capability": torch.backends.cpu.get_cpu_capability(), "processor": platform.processor(),
                   "bytes": total, "rounds": args.rounds,
                   "ms": {name: [1e3 * s for s in values] for name, values in times.items()},
                   "median_ms": {name: 1e3 * s for name, s in medians.items()}, "speedup": ratio,
                   "block_bytes": coded_bytes, "blocks_speedup": blocks_ratio}
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump(payload, handle, indent=2)
            handle.write("\n")


if __name__ == "__main__":
    main()
