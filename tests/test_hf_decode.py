"""A decoding token through the native decoder layers (linattn.hf_decode): the same logits as transformers' forward
of the same linearized model, token after token across the sparse cache's boundaries, in float64 to 1e-10 of the
logits' scale (the same arithmetic, sums in another order) and in float32 to 1e-4 (the projections' sums run in the
kernels' vector order, never bit-identical with BLAS's); and transformers' forward, untouched, wherever the route
does not apply.

transformers' RMSNorm computes in float32 whatever the model's dtype; the float64 comparisons take it in float64
(``float64_norms``), as the native layers compute it, so that they compare float64 with float64."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import linattn.hf as hf  # noqa: E402
from linattn import hf_decode  # noqa: E402
from linattn.feature_maps import create  # noqa: E402
from linattn.hf_cache import LinearAttentionCache  # noqa: E402
from linattn.nn import KeyGates  # noqa: E402
from linattn.state import SparseCache  # noqa: E402
from test_decoder_generate import tiny_llama  # noqa: E402
from test_key_gates import _randomised  # noqa: E402
from test_native_decode import kernels  # noqa: E402,F401 - the fixture: the built module, or a skip

pytestmark = pytest.mark.usefixtures("kernels")

PROMPT, STEPS = 20, 14  # the sparse cache's boundaries every 8 tokens: 24 and 32 fall among the steps


def linearized(dtype: torch.dtype = torch.float32, layers: int = 2):
    """A tiny Llama with per-head Hedgehog maps, key gates with a read-out weight and the delta rule beside a window
    of 16 tokens, 2 sinks and the sparse cache (4 pairs a head, a boundary every 8 tokens)."""
    maps = [create("hedgehog", head_dim=8, num_heads=4, init="random", seed=i) for i in range(layers)]
    gates = [_randomised(KeyGates(2, 8, readout=True), 5 + i) for i in range(layers)]
    model = hf.linearize(tiny_llama(layers), maps, gates=gates, update="delta", window=16, sinks=2,
                         sparse_cache=SparseCache(size=4, block=8))
    return model.to(dtype)


@pytest.fixture(autouse=True)
def float64_norms(monkeypatch):
    """transformers' LlamaRMSNorm in the input's dtype (for float32, what it computes anyway)."""
    from transformers.models.llama import modeling_llama

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", forward)


@pytest.fixture
def routed(monkeypatch):
    """How many calls the native route answered."""
    taken = {"tokens": 0}
    original = hf_decode._token

    def counted(*args, **kwargs):
        out = original(*args, **kwargs)
        taken["tokens"] += out is not None
        return out

    monkeypatch.setattr(hf_decode, "_token", counted)
    return taken


def decode(model, ids: torch.Tensor, steps: int = STEPS, lean: bool = True, **call) -> torch.Tensor:
    """The logits (steps, B, vocab) of greedy tokens after the prompt ``ids``, each token one call of the model."""
    model.linattn_lean_decoding = lean
    cache = LinearAttentionCache()
    out = []
    with torch.no_grad():
        logits = model(input_ids=ids, cache=cache, use_cache=True).logits[:, -1]
        for _ in range(steps):
            token = logits.argmax(-1, keepdim=True)
            logits = model(input_ids=token, cache=cache, use_cache=True, **call).logits[:, -1]
            out.append(logits)
    return torch.stack(out)


def prompt(rows: int = 1, length: int = PROMPT) -> torch.Tensor:
    return torch.randint(1, 60, (rows, length), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float64, 1e-10), (torch.float32, 1e-4)])
@pytest.mark.parametrize("rows", [1, 2])
def test_a_token_through_the_native_layers_equals_transformers_forward(routed, dtype, tolerance, rows):
    model = linearized(dtype)
    ids = prompt(rows)
    ours = decode(model, ids)
    assert routed["tokens"] == STEPS  # every step took the route (boundaries included: their attention is Python's)
    theirs = decode(model, ids, lean=False)
    assert routed["tokens"] == STEPS
    scale = theirs.abs().max()
    assert (ours - theirs).abs().max() <= tolerance * scale
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_generate_takes_the_route_and_gives_transformers_tokens(routed):
    model = linearized()
    ids = prompt()
    with torch.no_grad():
        ours = model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0)
        assert routed["tokens"] == 9  # the first new token comes with the prompt
        model.linattn_lean_decoding = False
        theirs = model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert routed["tokens"] == 9 and torch.equal(ours, theirs)


def test_position_ids_given_with_the_token_are_the_ones_rotated(routed):
    model = linearized(torch.float64)
    ids = prompt()
    with torch.no_grad():
        for lean in (True, False):
            model.linattn_lean_decoding = lean
            cache = LinearAttentionCache()
            model(input_ids=ids, cache=cache, use_cache=True)
            out = model(input_ids=ids[:, :1], cache=cache, use_cache=True, position_ids=torch.tensor([[PROMPT + 5]]))
            if lean:
                ours = out.logits
    assert routed["tokens"] == 1
    torch.testing.assert_close(ours, out.logits, rtol=0, atol=1e-10 * out.logits.abs().max().item())


def test_a_weight_changed_after_the_first_token_is_read_as_it_now_is(routed):
    """In place (its version moves) and replaced (another tensor): the next token follows the new weight."""
    model = linearized(torch.float64)
    ids = prompt()
    layer = model.model.layers[1]
    outputs = {}
    with torch.no_grad():
        for lean in (True, False):
            model.linattn_lean_decoding = lean
            cache = LinearAttentionCache()
            logits = model(input_ids=ids, cache=cache, use_cache=True).logits[:, -1:]
            token = logits.argmax(-1)
            model(input_ids=token, cache=cache, use_cache=True)
            layer.mlp.down_proj.weight.mul_(1.5)
            first = model(input_ids=token, cache=cache, use_cache=True).logits
            original = layer.self_attn.o_proj.weight
            layer.self_attn.o_proj.weight = torch.nn.Parameter(original * -1.0)
            second = model(input_ids=token, cache=cache, use_cache=True).logits
            layer.self_attn.o_proj.weight = original
            layer.mlp.down_proj.weight.div_(1.5)
            outputs[lean] = torch.cat([first, second])
    assert routed["tokens"] == 3
    torch.testing.assert_close(outputs[True], outputs[False], rtol=0,
                               atol=1e-10 * outputs[False].abs().max().item())


def test_a_hook_gradients_a_prompt_or_the_switch_leave_transformers_forward(routed):
    model = linearized()
    ids = prompt()
    seen = []
    handle = model.model.layers[0].mlp.register_forward_hook(lambda *args: seen.append(1))
    decode(model, ids, steps=3)
    handle.remove()
    assert routed["tokens"] == 0 and len(seen) == 4  # the hook ran for the prompt and every token
    decode(model, ids, steps=3, lean=False)
    assert routed["tokens"] == 0
    cache = LinearAttentionCache()
    model.linattn_lean_decoding = True
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
    model(input_ids=ids[:, :1], cache=cache, use_cache=True)  # gradients on
    with torch.no_grad():
        model(input_ids=ids[:, :2], cache=cache, use_cache=True)  # two tokens
        model(input_ids=ids[:, :1], cache=cache, use_cache=True, output_hidden_states=True)
        model(input_ids=ids[:, :1], use_cache=True)  # no cache: transformers' forward makes one
    assert routed["tokens"] == 0
    with torch.no_grad():
        model(input_ids=ids[:, :1], cache=cache, use_cache=True)
    assert routed["tokens"] == 1


def test_another_architecture_or_activation_is_not_routed(routed):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=60, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, hidden_act="gelu")
    model = hf.linearize(LlamaForCausalLM(config).eval(), "elu", window=4, sinks=1)
    decode(model, prompt(), steps=2)
    assert routed["tokens"] == 0

    class Subclass(LlamaForCausalLM):
        pass

    config.hidden_act = "silu"
    model = hf.linearize(Subclass(config).eval(), "elu", window=4, sinks=1)
    decode(model, prompt(), steps=2)
    assert routed["tokens"] == 0
    model = hf.linearize(LlamaForCausalLM(config).eval(), "elu", window=4, sinks=1)
    decode(model, prompt(), steps=2)
    assert routed["tokens"] == 2  # the same model, of transformers' own class


def test_a_copied_model_decodes_with_its_own_weights(routed):
    import copy

    model = linearized(torch.float64)
    ids = prompt()
    decode(model, ids, steps=2)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.model.layers[0].mlp.up_proj.weight.mul_(-1.0)
    ours = decode(twin, ids, steps=3)
    theirs = decode(twin, ids, steps=3, lean=False)
    assert routed["tokens"] == 5
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-10 * theirs.abs().max().item())
    assert not torch.allclose(ours, decode(model, ids, steps=3, lean=False))


def test_a_left_padded_batch_rotates_each_row_at_its_own_position(routed):
    """generate passes each row's position (its mask's count) with the token: rows of other lengths rotate
    differently, as transformers' forward rotates them."""
    model = linearized(torch.float64)
    ids = prompt(3, 12)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :9] = 0
    with torch.no_grad():
        ours = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                              output_logits=True, return_dict_in_generate=True)
        assert routed["tokens"] == 5
        model.linattn_lean_decoding = False
        theirs = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                                output_logits=True, return_dict_in_generate=True)
    assert torch.equal(ours.sequences, theirs.sequences)
    for a, b in zip(ours.logits, theirs.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10 * b.abs().max().item())


def test_a_softmax_model_takes_the_route_with_its_own_attention(routed):
    """The original (SDPA over transformers' DynamicCache) with the same linear layers and route: its logits are
    transformers' forward's, and so are a masked call's."""
    from linattn.hf_decode import install
    from linattn.nn.token_linear import lean_linears

    model = tiny_llama().to(torch.float64)
    lean_linears(model)
    install(model)
    ids = prompt(2)
    mask = torch.ones(2, PROMPT + 1, dtype=torch.long)
    mask[1, :3] = 0
    outputs = {}
    with torch.no_grad():
        for lean in (True, False):
            model.linattn_lean_decoding = lean
            from transformers import DynamicCache

            cache = DynamicCache(config=model.config)
            model(input_ids=ids, cache=cache, use_cache=True, attention_mask=mask[:, :-1])
            steps = [model(input_ids=ids[:, -1:], cache=cache, use_cache=True).logits]
            steps.append(model(input_ids=ids[:, :1], cache=cache, use_cache=True,
                               attention_mask=torch.cat([mask, mask[:, -1:]], 1)).logits)
            steps.append(model(input_ids=ids[:, :1], use_cache=False, position_ids=torch.tensor([[3]])).logits)
            outputs[lean] = torch.stack(steps)
    assert routed["tokens"] == 3
    torch.testing.assert_close(outputs[True], outputs[False], rtol=0, atol=1e-10 * outputs[False].abs().max().item())
