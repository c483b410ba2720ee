"""The ``linattn`` command: ``info``, ``demo``, ``bench``, ``compare``, ``generate`` and ``linearize``."""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from collections.abc import Sequence

import torch

from . import __version__, feature_maps
from .allocator import ENVIRONMENT, malloc_from_environment
from .backends import native
from .data import check_text_file
from .errors import LinearAttentionError
from .evaluate.arguments import add_compare_arguments, add_lm_arguments
from .evaluate.models import check_model_name, looks_causal
from .forms import FORMS
from .functional import linear_attention
from .linearized.arguments import add_generate_arguments, add_linearize_arguments


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each option's default, where it has one worth showing (not None, not a flag's False) and
    its help does not state it already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text or (
                not action.option_strings and action.nargs not in ("?", "*")):
            return text
        return f"{text} (default: %(default)s)".lstrip()


def _info(args: argparse.Namespace) -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"linattn {__version__}")
    print(f"python {platform.python_version()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"device: {device}" + (f" ({torch.cuda.get_device_name()})" if device == "cuda" else ""))
    print(f"forms: {', '.join(f for f in FORMS if f != 'auto')}")
    print(f"feature maps: {', '.join(feature_maps.available())}")
    print(native.status())  # the C++ kernels: built here on first use if `make` has not built them
    kept = "freed memory kept for reuse" if args.malloc == "keep" else "as the system has it"
    print(f"malloc: {args.malloc} ({kept}; {ENVIRONMENT}=keep|system)")
    return 0


def _softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _demo(args: argparse.Namespace) -> int:
    """Error against softmax attention and time per form at a few N, on random inputs."""
    torch.manual_seed(0)
    heads, dim = 4, 32
    print(f"linear attention (elu+1) against softmax attention, B=1, H={heads}, D={dim}, fp32, "
          f"{torch.get_num_threads()} threads")
    print("  rel.err vs softmax: ‖linear output − softmax output‖ / ‖softmax output‖ (random inputs: another "
          "kernel, not an approximation error to drive to 0)\n  vs parallel: the same against the quadratic "
          "form (N ≤ 4096): the forms agree to rounding\n  ms: one call's wall time, first call included")
    print(f"{'N':>6} {'form':>10} {'causal':>6} {'rel.err vs softmax':>19} {'vs parallel':>12} {'ms':>9}")
    for n in args.sizes:
        q = torch.randn(1, heads, n, dim) / dim**0.25
        k = torch.randn(1, heads, n, dim) / dim**0.25
        v = torch.randn(1, heads, n, dim)
        for causal in (False, True):
            exact = _softmax_attention(q, k, v, causal)
            reference = linear_attention(q, k, v, causal=causal, form="parallel") if n <= 4096 else None
            forms = ["chunked", "recurrent"] if causal else ["global", "chunked"]
            for form in forms:
                if form == "recurrent" and n > 4096:
                    continue
                start = time.perf_counter()
                out = linear_attention(q, k, v, causal=causal, form=form)
                elapsed = (time.perf_counter() - start) * 1e3
                err = float((out - exact).norm() / exact.norm())
                agree = float((out - reference).norm() / reference.norm()) if reference is not None else math.nan
                print(f"{n:>6} {form:>10} {causal!s:>6} {err:>19.3f} {agree:>12.1e} {elapsed:>9.1f}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    if args.model:  # a linearized causal LM against its original
        from .linearized import speed

        return speed.cli(args)
    from . import bench  # each verb's job is imported when it runs: `linattn info` and `--help` load none of them

    return bench.cli(args)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="time, memory and FLOPs against softmax attention; writes CSV/JSON/PNG")
    bench.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 16384], help="sequence lengths N")
    bench.add_argument("--batch", type=int, default=1, help="batch size B")
    bench.add_argument("--heads", type=int, default=8, help="heads H")
    bench.add_argument("--dim", type=int, default=64, help="head dimension D")
    bench.add_argument("--forms", nargs="+", default=["auto", "chunked", "global"],
                       help="linattn forms to time (auto: the default call; on CPU without gradients the native "
                       "kernels)")
    bench.add_argument("--maps", nargs="+", default=["elu"], help="registered feature maps")
    bench.add_argument("--causal", choices=["both", "causal", "noncausal"], default="both",
                       help="which attention to time")
    bench.add_argument("--repeats", type=int, default=5, help="timed runs after one warm-up")
    bench.add_argument("--max-seconds", type=float, default=30.0, help="stop an implementation beyond this")
    bench.add_argument("--decode-contexts", type=int, nargs="+", default=[1024, 4096, 16384, 65536],
                       help="context lengths of the one-token decoding timings")
    bench.add_argument("--dtype", default="float32", help="torch dtype of the inputs")
    bench.add_argument("--device", default="cpu", help="torch device (cuda for a GPU)")
    bench.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    bench.add_argument("--out", default="out/bench", help="folder for bench.csv, bench.json, bench.png (with "
                       "--model: bench_model.*)")
    model = bench.add_argument_group("a linearized model against its original (--model)")
    model.add_argument("--model", default=None, help="a causal LM (smollm2): time its prefill and decoding against "
                       "the linearized folder shipped for it, side by side (the options above but --threads, "
                       "--out and --no-* are then unused)")
    model.add_argument("--linearized", default=None, help="with --model: a folder of `linattn linearize` instead "
                       "of the shipped one")
    model.add_argument("--contexts", type=int, nargs="+", default=[512, 1536, 4096, 8192], help="prompt lengths")
    model.add_argument("--new-tokens", type=int, default=32, help="decoding steps timed after each prompt")
    model.add_argument("--rounds", type=int, default=2, help="rounds, the two models alternating in each")
    model.add_argument("--floor", action="store_true", help="also time the original without its attention (the "
                       "projections, MLPs and head alone, as the linearized model runs them): the most any "
                       "attention could gain, as bound columns")
    model.add_argument("--same-linears", action="store_true", help="also time the original with the linearized "
                       "model's one-token linear layers (TokenLinear) and decoding route (linattn.hf_decode): the "
                       "decoding ratio against it is the attention's alone")
    bench.add_argument("--decays", nargs="*", default=[], choices=["decay", "gate", "gla"],
                       help="also time causal attention with a RetNet decay, a per-token or a per-feature gate")
    for flag, what in (("backward", "the backward pass"), ("sdpa", "torch's SDPA beside linattn"),
                       ("peers", "other linear-attention libraries"), ("memory", "the peak-memory runs"),
                       ("decode", "the decoding timings"), ("plot", "bench.png")):
        bench.add_argument(f"--no-{flag}", action="store_true", help=f"skip {what}")
    bench.set_defaults(run=_bench)


def _compare(args: argparse.Namespace) -> int:
    check_model_name(args.model)  # before anything loads: a name that needs a download fails at once
    check_text_file(args.text, "text")
    check_text_file(args.heldout, "--heldout")
    # the jobs are imported when they run: they load the training code (linattn.train, linattn.hf), which the
    # other verbs never need; transformers and matplotlib they import only when a model is loaded or a plot drawn
    if args.lm or looks_causal(args.model):  # causal LMs: perplexity and long-range probes per row
        from .evaluate import lm_compare

        return lm_compare.cli(args)
    from .evaluate import compare

    return compare.cli(args)


def _add_compare(sub: argparse._SubParsersAction) -> None:
    compare = sub.add_parser(
        "compare", help="every feature map against softmax attention on a real model (encoders: attention metrics; "
        "causal LMs such as smollm2: perplexity and long-range probes); Markdown report and plots"
    )
    add_compare_arguments(compare)
    add_lm_arguments(compare.add_argument_group("causal LMs only (perplexity, long-range probes, training stages)"))
    compare.set_defaults(run=_compare)


def _generate(args: argparse.Namespace) -> int:
    from .linearized import generate

    return generate.cli(args)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    generate = sub.add_parser("generate", help="stream text from a linearized model (a `linattn linearize` folder, "
                              "or a causal LM with --linear); tokens/s, cache bytes, peak memory")
    add_generate_arguments(generate)
    generate.set_defaults(run=_generate)


def _linearize(args: argparse.Namespace) -> int:
    from .linearized import job

    return job.cli(args)


def _add_linearize(sub: argparse._SubParsersAction) -> None:
    linearize = sub.add_parser("linearize", help="make a causal LM linear (fit, end to end, measure) into a folder "
                               "that `linattn generate` and load_linearized() read; reruns continue")
    add_linearize_arguments(linearize)
    linearize.set_defaults(run=_linearize)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="linattn", description="Linear attention for PyTorch and NumPy.",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show the Python traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="version, torch, device, forms, feature maps").set_defaults(run=_info)
    demo = sub.add_parser("demo", help="a small end-to-end example: error and time per form")
    demo.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 4096], help="sequence lengths N")
    demo.set_defaults(run=_demo)
    _add_bench(sub)
    _add_compare(sub)
    _add_generate(sub)
    _add_linearize(sub)
    for verb in sub.choices.values():
        verb.formatter_class = HelpFormatter
    args = parser.parse_args(argv)
    try:
        args.malloc = malloc_from_environment()  # large tensors without page faults (linattn.allocator)
        return int(args.run(args))
    except (LinearAttentionError, OSError, UnicodeDecodeError) as error:
        if args.debug:
            raise
        # a bad input or file, already explained: one line, as argparse reports a bad flag (exit code 2)
        print(f"linattn {args.command}: error: {error} (--debug shows the traceback)", file=sys.stderr)
        return 2
