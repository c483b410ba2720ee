"""Every public name and import path that users had keeps working after the package's restructuring: the names
below were read off the package before it (each module's ``__all__`` or its public functions and classes), and the
CLI verbs and flags from its ``--help``."""

from __future__ import annotations

import importlib

import pytest

OLD_PATHS = {
    "linattn": [
        "FORMS", "FeatureMap", "LinearAttentionError", "LinearAttentionState", "WindowAttentionState", "__version__",
        "chunked_linear_attention", "feature_maps", "linear_attention", "nn", "stable_linear_attention",
    ],
    "linattn.nn": ["LayerDecoder", "LinearAttention"],
    "linattn.functional": ["linear_attention", "map_features", "resolve_feature_map"],
    "linattn.state": ["LinearAttentionState", "WindowAttentionState"],
    "linattn.feature_maps": [
        "CallableFeatureMap", "DpfpFeatureMap", "EluFeatureMap", "FavorPlusFeatureMap", "FavorPlusPlusFeatureMap",
        "FeatureMap", "HedgehogFeatureMap", "IdentityFeatureMap", "LearnedProjectionMap", "RandomFeatureMap",
        "RebasedFeatureMap", "ReluFeatureMap", "T2RFeatureMap", "TaylorFeatureMap", "TrigFeatureMap", "available",
        "create", "redraw_random_features", "register",
    ],
    "linattn.decode": ["DecodeStep", "WindowDecodeStep", "lean_step", "supports", "supports_window", "window_step"],
    "linattn.distributed": ["ContextParallel", "combine_others", "combine_prefix", "context_parallel_attention"],
    "linattn.backends": ["causal_attention", "select_backend"],
    "linattn.hf": [
        "attention_modules", "by_rows", "left_pads", "linattn_attention_forward", "linattn_mask", "linearize",
        "register", "sentence_embeddings",
    ],
    "linattn.distill": [
        "FittedFeatureMaps", "check_head_mask", "fit_feature_map", "fit_model_feature_maps", "load_feature_maps",
    ],
    "linattn.evaluate": [
        "AttentionCapture", "Perplexity", "SoftmaxReference", "attention_metrics", "capture_attention",
        "capture_metrics", "capture_references", "default_model_path", "is_causal_lm", "linear_weights", "load_model",
        "long_range_probes", "passkey_accuracy", "passkeys", "perplexity", "repeat_perplexity", "repeated_passages",
        "softmax_reference", "softmax_weights", "split_sequences",
    ],
    "linattn.evaluate.metrics": [
        "SoftmaxReference", "attention_metrics", "capture_metrics", "capture_references", "linear_weights",
        "map_output_dim", "scale_for_map", "softmax_reference", "softmax_weights",
    ],
    "linattn.evaluate.end_to_end": [
        "coarse_kl", "copying_sequences", "copying_weights", "fit_end_to_end", "retrieval_scores", "sample_texts",
        "top_heads",
    ],
    "linattn.evaluate.lora": ["LoRA", "add_lora", "load_lora"],
    "linattn.evaluate.compare": ["CompareResult", "PerHead", "Row", "cli", "run_compare", "time_per_token"],
    "linattn.evaluate.lm_compare": [
        "add_lm_arguments", "cli", "looks_causal", "run_lm_compare", "use_window_softmax", "window_sink_attention",
    ],
    # the product's modules before it moved to linattn.linearized
    "linattn.evaluate.linearized": [
        "INDEX", "SHIPPED", "atomic_write", "fingerprint", "is_linearized", "load_linearized", "read_index",
        "save_linearized", "shipped",
    ],
    "linattn.evaluate.linearize_job": ["Job", "Stages", "check_disk", "cli", "prepare_out"],
    "linattn.evaluate.arguments": [
        "add_compare_arguments", "add_generate_arguments", "add_linearize_arguments", "add_lm_arguments",
    ],
    "linattn.evaluate.linearize_budget": ["calibrate", "plan_steps", "training_sequences_of"],
    "linattn.evaluate.card": ["card_lines", "perplexity_by_position", "wilson_interval", "write_card"],
    "linattn.evaluate.generate": ["Generation", "cache_bytes", "cli", "generate_measured", "plot"],
    "linattn.linearized": [
        "fingerprint", "is_linearized", "load_linearized", "read_index", "save_linearized", "shipped",
    ],
}
NEEDS_TRANSFORMERS = ("linattn.hf_cache",)


def test_the_old_product_paths_are_the_same_objects() -> None:
    from linattn.evaluate import card, linearize_job, linearized
    from linattn.linearized import card as new_card
    from linattn.linearized import folder, job

    assert linearized.load_linearized is folder.load_linearized
    assert linearize_job.cli is job.cli
    assert card.wilson_interval is new_card.wilson_interval


@pytest.mark.parametrize("module", sorted(OLD_PATHS))
def test_every_old_public_name_still_imports(module: str) -> None:
    loaded = importlib.import_module(module)
    missing = [name for name in OLD_PATHS[module] if not hasattr(loaded, name)]
    assert not missing, f"{module} lost {missing}"


def test_the_transformers_cache_keeps_its_names() -> None:
    pytest.importorskip("transformers")
    cache = importlib.import_module("linattn.hf_cache")
    for name in ("LinearAttentionCache", "RowSteps", "StateLayer", "attend", "install", "pending_layer"):
        assert hasattr(cache, name), name


@pytest.mark.parametrize(
    ("verb", "flags"),
    [
        ("info", []),
        ("demo", ["--sizes"]),
        ("bench", [
            "--batch", "--causal", "--decays", "--decode-contexts", "--device", "--dim", "--dtype", "--forms",
            "--heads",
            "--maps", "--max-seconds", "--no-backward", "--no-decode", "--no-memory", "--no-peers", "--no-plot",
            "--no-sdpa", "--out", "--repeats", "--sizes", "--threads",
        ]),
        ("compare", [
            "--end-to-end-copies", "--end-to-end-corpus-orders", "--end-to-end-lora", "--end-to-end-lora-lr",
            "--end-to-end-repeat-weight", "--end-to-end-samples", "--end-to-end-steps", "--end-to-end-texts",
            "--end-to-end-tokens", "--fit-max-tokens", "--fit-orders", "--fitted-maps", "--gamma", "--gap-tokens",
            "--heldout", "--lm", "--long-n", "--maps", "--max-tokens", "--no-baselines", "--no-end-to-end-copies",
            "--no-metrics", "--num-features", "--out", "--passage-tokens", "--passkey-lengths", "--passkey-trials",
            "--quiet", "--repeat-trials", "--retrieval-heads", "--retrieval-maps", "--save-maps", "--seeds", "--sinks",
            "--steps", "--sweep", "--train-other-heads", "--window",
        ]),
    ],
)
def test_cli_verbs_and_flags_keep_working(verb: str, flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from linattn.cli import main

    with pytest.raises(SystemExit) as done:
        main([verb, "--help"])
    assert done.value.code == 0
    shown = capsys.readouterr().out
    missing = [flag for flag in flags if flag not in shown]
    assert not missing, f"linattn {verb} lost {missing}"
