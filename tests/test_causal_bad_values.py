"""Causality as a property, over the whole capability table: a NaN or inf in a key or value at token t leaves every
output row before t bit for bit as finite values there would, and a NaN or inf in masked-out padding never reaches
a valid row.

Every route of :data:`linattn.capabilities.ROUTES` is run with the options of its kind (``KIND_OPTIONS``: the plain
additive update, decays and gates, FAVOR+, packed sequences, the window, the sparse cache, the composed routes, the
delta rule and KDA); the route that ran is recorded, so each case checks the route it names. A route added later
is covered as it is added; a kind added later fails :func:`test_every_kind_of_the_table_has_options_here` until its
options are listed here. A route that could not keep the promise would refuse such inputs with
``check_finite=True``, which every route does (:func:`test_check_finite_refuses_bad_values_on_every_route`).

The lean decoding steps the table chooses (plain, window, sparse, delta, composed) take a masked token with NaN
or inf in its key and value without a change in any output.

Compared against the same call (same shapes) on finite inputs: BLAS may round calls of different shapes
differently, a truncated input is not the same computation.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import linattn.functional as functional
from linattn import LinearAttentionError, linear_attention
from linattn.capabilities import ROUTES
from linattn.feature_maps import create
from linattn.state import SparseCache

BATCH, HEADS, N, DIM, CHUNK, WINDOW = 1, 2, 37, 8, 8, 6  # N not a multiple of the chunk, several chunks
PACKED = [0, 13, 37]
FAVOR = create("favor+", head_dim=DIM, seed=0)  # its random projection fixed, whatever ran before


def _token_gate() -> torch.Tensor:
    return F.logsigmoid(torch.randn(BATCH, HEADS, N, generator=torch.Generator().manual_seed(1)))


def _feature_gate() -> torch.Tensor:  # elu's features: F = Dk
    return F.logsigmoid(torch.randn(BATCH, HEADS, N, DIM, generator=torch.Generator().manual_seed(2)))


# the options that make a call of each kind: (name, options)
KIND_OPTIONS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "plain": [
        ("elu", {}),
        ("favor+", {"feature_map": FAVOR}),
        ("decay", {"decay": 0.9}),
        ("token-gate", {"log_gate": "token"}),
        ("packed", {"cu_seqlens": PACKED}),
        ("packed-favor+", {"cu_seqlens": PACKED, "feature_map": FAVOR}),
    ],
    "gated": [
        ("feature-gate", {"log_gate": "feature"}),
        ("feature-gate-decay", {"log_gate": "feature", "decay": 0.95}),
    ],
    "window": [
        ("window-sinks", {"window": WINDOW, "sinks": 2}),
        ("window-favor+", {"window": WINDOW, "feature_map": FAVOR}),
        ("window-factor", {"window": WINDOW, "sinks": 1, "window_factor": 0.5}),
    ],
    "sparse": [
        ("recall", {"window": WINDOW, "sinks": 1, "sparse_cache": SparseCache(4, block=4)}),
        ("attention", {"window": WINDOW, "sparse_cache": SparseCache(3, block=3, score="attention")}),
    ],
    "composed": [
        ("window-decay", {"window": WINDOW, "sinks": 1, "decay": 0.9}),
        ("window-feature-gate", {"window": WINDOW, "log_gate": "feature"}),
        ("window-delta", {"window": WINDOW, "update": "delta", "beta": 0.5}),
        ("window-kda", {"window": WINDOW, "update": "delta", "log_gate": "feature"}),
        ("window-decay-favor+", {"window": WINDOW, "sinks": 1, "decay": 0.9, "feature_map": FAVOR}),
        ("window-delta-favor+", {"window": WINDOW, "sinks": 1, "update": "delta", "feature_map": FAVOR}),
    ],
    "delta": [
        ("delta", {"update": "delta"}),
        ("gated-delta", {"update": "delta", "decay": 0.9, "beta": 0.7}),
        ("kda", {"update": "delta", "log_gate": "feature"}),
        ("delta-favor+", {"update": "delta", "feature_map": FAVOR}),
        ("delta-packed", {"update": "delta", "cu_seqlens": PACKED}),
    ],
}
CASES = [(route, name, options) for route in ROUTES for name, options in KIND_OPTIONS.get(route.kind, [])]
IDS = [f"{route.name}-{name}" for route, name, _ in CASES]
# (which input, bad value, token): inside a chunk, at a chunk's start, in the last (partial) chunk
BAD = [("k", float("nan"), 3), ("k", float("inf"), 16), ("v", float("nan"), 21), ("v", float("-inf"), 34),
       ("k", float("-inf"), 29), ("v", float("inf"), 8)]


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(BATCH, HEADS, N, DIM, generator=generator) for _ in range(3))  # type: ignore[return-value]


def _run(route, options, q, k, v, causal=True, **extra):
    """The call on ``route`` (its form forced), and the route that ran it."""
    given = dict(options)
    gate = given.get("log_gate")
    if gate is not None:
        given["log_gate"] = _token_gate() if gate == "token" else _feature_gate()
    ran = []
    choose = functional.choose_route

    def recording(call):
        chosen = choose(call)
        ran.append(chosen)
        return chosen

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(functional, "choose_route", recording)
        out = linear_attention(q, k, v, causal=causal, form=route.form, chunk_size=CHUNK, **given, **extra)
    assert ran and all(chosen == route for chosen in ran), (route.name, [chosen.name for chosen in ran])
    return out


def _covered(route, options, causal=True) -> bool:
    try:
        _run(route, options, *_inputs(), causal=causal)
    except LinearAttentionError:  # the route refuses such calls (e.g. the causal global form): nothing to check
        return False
    return True


def _sequence_end(t: int, options: dict[str, Any]) -> int:
    """The end of t's packed sequence (N without packing): rows from there on see none of t's sequence."""
    return next(end for end in options.get("cu_seqlens", [0, N])[1:] if end > t)


def test_every_kind_of_the_table_has_options_here():
    assert {route.kind for route in ROUTES} <= set(KIND_OPTIONS), "a new kind of route: list its options here"


@pytest.mark.parametrize("route,name,options", CASES, ids=IDS)
def test_a_bad_key_or_value_leaves_earlier_rows_bitwise_unchanged(route, name, options):
    if not _covered(route, options):
        pytest.skip(f"{route.name} does not run causal calls")
    q, k, v = _inputs()
    clean = _run(route, options, q, k, v)
    assert bool(torch.isfinite(clean).all())
    for which, bad, t in BAD:
        k_bad, v_bad = k.clone(), v.clone()
        (k_bad if which == "k" else v_bad)[..., t, 1] = bad
        out = _run(route, options, q, k_bad, v_bad)
        assert torch.equal(out[..., :t, :], clean[..., :t, :]), f"{which}[{t}] = {bad} reached rows before {t}"
        end = _sequence_end(t, options)  # packed: the later sequences do not see it either
        assert torch.equal(out[..., end:, :], clean[..., end:, :]), f"{which}[{t}] = {bad} left its sequence"
        if bad != bad:  # a NaN reaches row t (an infinite key may map to finite features: elu(−inf) + 1 = 0)
            assert not bool(torch.isfinite(out[..., t, :]).all()), "the NaN vanished"


CONTINUED = [(route, name, options) for route, name, options in CASES if not {"cu_seqlens", "log_gate"} & set(options)]


@pytest.mark.parametrize("route,name,options", CONTINUED, ids=[f"{r.name}-{name}" for r, name, _ in CONTINUED])
def test_a_continuation_keeps_its_earlier_rows_too(route, name, options):
    """The same after a state: the call that continues it runs twice when a bad value shows, from the same state."""
    if not _covered(route, options):
        pytest.skip(f"{route.name} does not run causal calls")
    q, k, v = _inputs()
    _, state = linear_attention(q[..., :10, :], k[..., :10, :], v[..., :10, :], causal=True, return_state=True,
                                **options)
    rest = [x[..., 10:, :] for x in (q, k, v)]
    clean = _run(route, options, *rest, initial_state=state)
    for which, bad, t in BAD[:3]:
        k_bad, v_bad = rest[1].clone(), rest[2].clone()
        (k_bad if which == "k" else v_bad)[..., t, 1] = bad
        out = _run(route, options, rest[0], k_bad, v_bad, initial_state=state)
        assert torch.equal(out[..., :t, :], clean[..., :t, :]), f"{which}[{t}] = {bad} reached rows before {t}"


@pytest.mark.parametrize("route,name,options", CASES, ids=IDS)
def test_finite_changes_leave_earlier_rows_bitwise_unchanged(route, name, options):
    """What the repair of bad values rests on: each form is causal to the bit for finite inputs (same shapes), also
    when later keys move a log-space map's running maximum."""
    if not _covered(route, options):
        pytest.skip(f"{route.name} does not run causal calls")
    q, k, v = _inputs()
    clean = _run(route, options, q, k, v)
    for t, scale in ((5, 4.0), (24, 0.0)):
        for which in ("k", "v"):
            k_new, v_new = k.clone(), v.clone()
            changed = k_new if which == "k" else v_new
            changed[..., t:, :] = changed[..., t:, :] * scale + 1.5
            out = _run(route, options, q, k_new, v_new)
            assert torch.equal(out[..., :t, :], clean[..., :t, :]), f"{which}[{t}:] changed rows before {t}"


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("route,name,options", CASES, ids=IDS)
def test_bad_values_in_padding_never_reach_valid_rows(route, name, options, causal):
    if not _covered(route, options, causal):
        pytest.skip(f"{route.name} does not run {'causal' if causal else 'non-causal'} calls")
    q, k, v = _inputs(1)
    keep = torch.ones(BATCH, N, dtype=torch.bool)
    keep[:, 9:12] = False  # padding inside the sequence (inside a window, a chunk, a block of the cache)
    keep[:, -2:] = False  # and at its end
    clean = _run(route, options, q, k, v, causal, key_padding_mask=keep)
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[..., 9, :], v_bad[..., 10, :] = float("nan"), float("inf")
    k_bad[..., 11, 0], v_bad[..., 11, 0] = float("-inf"), float("nan")
    k_bad[..., -1, :], v_bad[..., -2, :] = float("inf"), float("nan")
    out = _run(route, options, q, k_bad, v_bad, causal, key_padding_mask=keep)
    assert bool(torch.isfinite(out).all())
    assert torch.equal(out, clean)


@pytest.mark.parametrize("route,name,options", CASES, ids=IDS)
def test_check_finite_refuses_bad_values_on_every_route(route, name, options):
    if not _covered(route, options):
        pytest.skip(f"{route.name} does not run causal calls")
    q, k, v = _inputs()
    k[..., 7, 0] = float("nan")
    with pytest.raises(LinearAttentionError, match="non-finite"):
        _run(route, options, q, k, v, check_finite=True)


# ---- the decoding steps: a masked token's NaN or inf never reaches an output ----------------------------------------

STEP_CASES = [(name, options) for route, name, options in CASES if route.form == "recurrent"
              and not {"cu_seqlens", "log_gate"} & set(options)]  # gates come with each step's call


def _with_map(options: dict[str, Any]) -> dict[str, Any]:
    """The options with the feature map made once (one object for the prefill and the step)."""
    from linattn.features import resolve_feature_map

    return {**options, "feature_map": resolve_feature_map(options.get("feature_map", "elu"), DIM)}


def _step_for(options: dict[str, Any], state: Any) -> Any:
    from linattn.capabilities import choose_step
    from linattn.decode import lean_step

    given = {key: value for key, value in options.items() if key != "feature_map"}
    fmap = options["feature_map"]
    return choose_step(fmap, state, given), lean_step(fmap, state, given, HEADS)


def test_every_kind_of_decoding_step_is_run_below():
    q, k, v = _inputs()
    kinds = set()
    for _, options in STEP_CASES:
        options = _with_map(options)
        _, state = linear_attention(q, k, v, causal=True, return_state=True, **options)
        kinds.add(_step_for(options, state)[0])
    assert kinds >= {"plain", "window", "sparse", "delta", "composed"}


@pytest.mark.parametrize("name,options", STEP_CASES, ids=[name for name, _ in STEP_CASES])
def test_a_masked_bad_token_leaves_every_step_output_unchanged(name, options):
    q, k, v = _inputs(2)
    prefill, options = 5, _with_map(options)
    _, state = linear_attention(q[..., :prefill, :], k[..., :prefill, :], v[..., :prefill, :], causal=True,
                                return_state=True, **options)
    if _step_for(options, state)[1] is None:
        pytest.skip(f"no lean step continues {name}")
    runs = []
    for bad in (False, True):
        step, outs = _step_for(options, state)[1], []
        for t in range(prefill, N):
            token = [x[..., t : t + 1, :].clone() for x in (q, k, v)]
            keep = torch.tensor([[t not in (9, 12)]])  # two masked tokens
            if bad and not keep:
                token[1][..., 0] = float("nan") if t == 9 else float("inf")
                token[2][..., 1] = float("-inf") if t == 9 else float("nan")
            outs.append(step(*token, keep))
        runs.append(torch.cat(outs, dim=-2))
    assert bool(torch.isfinite(runs[1]).all()) and torch.equal(runs[1], runs[0])


def test_the_chunked_function_reads_no_later_scale():
    """The chunked Function's rows before t do not move by a bit when the log-scales from t on do (a log-space
    map's running maximum rises at a large key): its within-chunk factors are re-based to the scale entering the
    chunk, not to the chunk's end. Scales near 1000 in fp64, so a re-basing to another point rounds differently."""
    from linattn.kinds.additive.forms.chunked import causal_chunked_attention

    generator = torch.Generator().manual_seed(3)
    qf, kf, v = (torch.rand(2, N, DIM, generator=generator) for _ in range(3))
    # non-decreasing fp64 scales, as decays and packing make them (their differences do not fit fp32 exactly)
    ref = 1000.0 + torch.rand(2, N, generator=generator, dtype=torch.float64).cumsum(-1) * 0.37
    options = {"state": None, "chunk_size": CHUNK, "normalize": True, "eps": 1e-6, "min_denom": None}
    clean, _ = causal_chunked_attention(qf, kf, v, ref=ref, **options)
    for t in (3, 13, 22, 30):  # inside chunks
        later = ref.clone()
        later[:, t:] += 0.731  # the maximum rises at t
        keys = kf.clone()
        keys[:, t] *= 0.5
        out, _ = causal_chunked_attention(qf, keys, v, ref=later, **options)
        assert torch.equal(out[:, :t], clean[:, :t]), t
