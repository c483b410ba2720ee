"""Command-line options of ``linattn generate`` and ``linattn linearize`` (kept apart from the jobs so that
``--help`` imports neither: :mod:`linattn.linearized.generate`, :mod:`linattn.linearized.job`)."""

from __future__ import annotations

import argparse

from ..evaluate.defaults import LM_SINKS, LM_WINDOW

STUDENT_NAMES = ("hedgehog", "gated-delta", "kda")  # linattn.linearized.students defines them
DEFAULT_STUDENT_NAME = "gated-delta"  # measured best on SmolLM2 (docs/linearize.md, "Students"): the shipped folder
# the delta-rule students' exact pairs, the shipped SmolLM2's layout: a window of 64 + 4 sinks and a sparse cache of
# 2·64 pairs per head on average, all of it given to the 20 heads of highest retrieval score (196 exact pairs per
# head on average, SmolLM2's measured budget of equal memory); the additive student keeps LoLCATs' 64 and no cache
DELTA_WINDOW = 64
DELTA_CACHE_PER_WINDOW = 2  # the cache's mean pairs per head, in windows
DELTA_CACHE_TOP = 20  # the heads that share the cache (every head, on a model with fewer)
# the training text beside the samples in the end-to-end stage: on SmolLM2 with the shipped layout, 8 orders moved
# held-out perplexity from 40.03 to 38.89 at about the same recall (docs/linearize.md, the shipped folder)
CORPUS_ORDERS = 8
# the copying sequences' gaps: out to the longest distance measured (3,072). On SmolLM2 with the default student,
# the same fit and samples trained 80 steps with gaps of 128-768 read a passage 1,536 / 3,072 tokens back at
# 4.58 / 47.1, with 128-3,072 at 2.85 / 23.2 (plain text 38.90 / 38.58; 512 back 2.25 / 3.79): docs/linearize.md
COPY_GAP_TOKENS = (128, 3072)
# then the long gaps alone: on SmolLM2 with the default student, the default run (--budget 90) read a passage 3,072
# tokens back at 24.43; 40 more steps on copies 2,048-3,072 apart, samples only, at 5.79 (1,536 back 2.86 -> 3.39,
# perplexity 38.67 -> 38.70): docs/linearize.md, "Long gaps only, continuing the default run"
LONG_GAP_TOKENS, LONG_GAP_STEPS = (2048, 3072), 40
# key-retrieval sequences' fillers: out to the longest copying gap, from a few windows on
KEY_FILLER_TOKENS = (256, 3072)


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``linattn generate`` (:mod:`linattn.linearized.generate`)."""
    parser.add_argument("model", help="a folder written by `linattn linearize`, or a causal LM (smollm2, a folder, "
                        "a GGUF file, a model in the local Hugging Face cache)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the text to continue")
    prompt.add_argument("--prompt-file", help="a UTF-8 text file whose text to continue (a long prompt: the "
                        "softmax cache grows with it, the linear states do not)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate after the prompt")
    parser.add_argument("--linear", action="store_true", help="linearize a plain model first: with the maps "
                        "shipped for it (smollm2), else elu+1 beside a softmax window")
    parser.add_argument("--untrained", action="store_true", help="with --linear: elu+1 beside the window even where "
                        "fitted maps ship")
    parser.add_argument("--window", type=int, default=LM_WINDOW, help="with --linear and elu+1: the softmax window")
    parser.add_argument("--sinks", type=int, default=LM_SINKS, help="with --linear and elu+1: the sink tokens")
    parser.add_argument("--sparse-cache", type=int, default=None, help="add a sparse exact cache of this many pairs "
                        "per head beside the window (docs/sparse_cache.md)")
    parser.add_argument("--compare-softmax", action="store_true", help="also generate with the original model")
    parser.add_argument("--plot", default=None, help="a PNG file: ms/token and cache bytes against position")
    parser.add_argument("--threads", type=int, default=0, help="torch threads for the prompt (0: torch's default)")
    parser.add_argument("--decode-threads", type=int, default=1, help="torch threads for the tokens after the "
                        "prompt: one token's work is small, and more threads than free cores make each step wait "
                        "for the slowest (0: as for the prompt)")


def add_linearize_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``linattn linearize`` (:mod:`linattn.linearized.job`)."""
    add = parser.add_argument
    add("model", help="a causal LM: smollm2, a folder, a GGUF file, a model in the local Hugging Face cache")
    add("text", nargs="?", default=None, help="training text file (default: the shipped corpus)")
    add("--out", required=True, help="the folder to write (stages, maps, results, card); a rerun continues it")
    add("--budget", type=float, default=None, help="minutes: time a few steps of each stage, then choose the step "
        "counts that fit (replaces --end-to-end-steps and --end-to-end-long-steps, where 0 still skips a stage; "
        "--fit-steps becomes the most fitting steps, the rest of the "
        "training time going end to end) and as many samples as those steps use (up to --end-to-end-samples)")
    add("--heldout", default=None, help="held-out text file for the measuring stage (default: the shipped corpus)")
    add("--student", choices=STUDENT_NAMES, default=DEFAULT_STUDENT_NAME, help="what replaces each attention "
        "layer beside the window and sinks: hedgehog (Hedgehog maps, the additive state), gated-delta (a gated "
        "delta-rule memory, β and the gate from the model's keys; the shipped SmolLM2), kda (the same with a gate "
        "per feature); docs/linearize.md")
    add("--window", type=int, default=None, help=f"softmax window beside the linear part (default: {LM_WINDOW} for "
        f"hedgehog, {DELTA_WINDOW} for the delta-rule students)")
    add("--sinks", type=int, default=LM_SINKS, help="sink tokens (the first tokens, always attended)")
    add("--sparse-cache", type=int, default=None, help="a sparse exact cache of N pairs per head beside the window "
        "(docs/sparse_cache.md): in place while the fit and the end-to-end stage train and in the measured row, and "
        "saved with the folder; the softmax window row then has W + N keys (equal memory). 0: none. Default: none "
        f"for hedgehog; for the delta-rule students {DELTA_CACHE_PER_WINDOW}·W pairs per head on average, split by "
        f"retrieval score with no floor among the {DELTA_CACHE_TOP} highest-scoring heads (every head on a model with "
        "fewer): the shipped SmolLM2's layout")
    add("--sparse-cache-heads", choices=("uniform", "retrieval"), default=None, help="how the cache's "
        "pairs are spread over the heads: N for every head, or N per head on average, split in proportion to each "
        "head's retrieval score (the attention it puts beyond the window when a passage repeats, under softmax, on "
        "the end-to-end stage's sampled training texts, sampled even without its steps; --sparse-cache-floor pairs "
        "at least). Default: uniform for a --sparse-cache N given, retrieval for the students' own cache")
    add("--sparse-cache-floor", type=int, default=None, help="with --sparse-cache-heads retrieval: the fewest pairs "
        "a head keeps (default N/2)")
    add("--sparse-cache-top", type=int, default=None, help="with --sparse-cache-heads retrieval: what the floor "
        "leaves goes in equal parts to the K highest-scoring heads alone, so that they keep every pair as far back as "
        "their share reaches (default: every head, in proportion to its score)")
    add("--sparse-cache-linear-weight", type=float, default=1.0, help="with --sparse-cache: the linear part's sums "
        "times this weight β ≥ 0 beside the cache, while fitting, training end to end and measuring, and saved "
        "with the folder: the map's mass for far keys grows with the context and drowns the cached pairs "
        "(docs/sparse_cache.md)")
    add("--fit-steps", type=int, default=150, help="steps of the Hedgehog fit")
    add("--num-features", type=int, default=None, help="m of the Hedgehog maps (default: the fit's)")
    add("--fit-max-tokens", type=int, default=None, help="longest captured piece for the fit (default 1024)")
    add("--fit-orders", type=int, default=4, help="paragraph orders of the train text captured for the fit")
    add("--end-to-end-steps", type=int, default=240, help="steps of the end-to-end stage (0: skip it)")
    add("--end-to-end-samples", type=int, default=32, help="texts sampled from the model (the last 2 held out)")
    add("--end-to-end-tokens", type=int, default=1536, help="tokens sampled per text")
    add("--end-to-end-corpus-orders", type=int, default=CORPUS_ORDERS, help="the training text in this many "
        "paragraph orders (each cut as a sample is), and their copying sequences, trained on beside the samples: "
        "the model's own samples are not the kind of text it is measured on (0: the samples alone)")
    add("--end-to-end-copy-gap", type=int, nargs=2, default=list(COPY_GAP_TOKENS), metavar=("LOW", "HIGH"),
        help="the copying sequences' gaps: a passage is repeated after LOW to HIGH other tokens (uniform draws); a "
        "student trained on gaps up to G is measured beyond G by the repeated passage at --repeat-gaps. Gaps longer "
        "than a sample join the next samples to it (held-out ones apart)")
    add("--end-to-end-long-steps", type=int, default=None, metavar="N", help="then N more end-to-end steps on the "
        "samples' copying sequences alone, their gaps drawn from --end-to-end-long-gap (the stage long_gaps: what "
        "the first steps teach at every distance, these hold at the longest). Default: "
        f"{LONG_GAP_STEPS}, or with --budget 60 %% of the end-to-end time; 0 with --lora (not taken there). 0: none")
    add("--end-to-end-long-gap", type=int, nargs=2, default=list(LONG_GAP_TOKENS), metavar=("LOW", "HIGH"),
        help="the long_gaps stage's copying gaps (uniform draws)")
    add("--end-to-end-keys", type=int, default=0, metavar="N", help="N key-retrieval sequences of the training text "
        "join the long_gaps stage's training set: a number stated once in one of a few phrasings (never the passkey "
        "probe's), --end-to-end-key-filler tokens of the text, a question the number answers, the positions that "
        "predict it weighted to half the sequence's loss; 2 more are held out. 0: none")
    add("--end-to-end-key-filler", type=int, nargs=2, default=list(KEY_FILLER_TOKENS), metavar=("LOW", "HIGH"),
        help="the key-retrieval sequences' filler tokens (uniform draws)")
    add("--init-from", default=None, metavar="RUN", help="start from another finished run's trained student instead "
        "of fitting one: RUN is the --out of a linearize run of the same model, student and exact part; its "
        "trained maps and gates (after its long_gaps stage, when it had one), its samples and its cache split are "
        "taken, then trained --end-to-end-steps and --end-to-end-long-steps more with this run's end-to-end options "
        "(other copying gaps, say) and measured. Not with --budget")
    add("--lora", type=int, default=0, help="train rank-R LoRA adapters of the attention projections in the "
        "end-to-end stage instead of the maps (fine-tuning: the card says so); 0: none")
    add("--passkey-lengths", type=int, nargs="+", default=[1024, 2048, 4096], help="passkey filler tokens")
    add("--passkey-trials", type=int, default=20, help="passkey trials per filler length (the card gives each "
        "rate with its 95 %% Wilson interval)")
    add("--repeat-gaps", type=int, nargs="+", default=[512, 1536, 3072], help="the repeated passage measured this "
        "many tokens back too, on --probe-text (a memory that must hold at any context: each is a column)")
    add("--probe-text", default=None, help="text for the repeated passage at --repeat-gaps (default: the shipped "
        "long held-out text, written for the project and seen by no model)")
    add("--repeat-trials", type=int, default=4, help="repeated passages")
    add("--passage-tokens", type=int, default=128, help="tokens of the repeated passage")
    add("--gap-tokens", type=int, default=512, help="tokens between the passage and its repeat")
    add("--quiet", action="store_true", help="no progress lines or bars")
