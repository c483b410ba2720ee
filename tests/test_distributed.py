"""linattn.distributed against single-process linear attention, with real processes (spawn, gloo).

The processes start once per world size (2 and 4) and run every case inside; each rank writes its results to a
JSON file and the tests below read them. Every rank computes the single-process result on the whole sequence
itself (same seed), so each compares its own slice of the output and of the input gradients. fp64 throughout
unless a case says otherwise: the split changes only the order of additions (slice sums combined, instead of one
running sum), so 1e-10 bounds rounding with a wide margin for values of order 1. One case also checks the
quadratic float64 reference of tests/reference.py, independent of the library.
"""

from __future__ import annotations

import copy
import datetime
import json
import math
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import linattn
from linattn.distributed import ContextParallel, combine_others, combine_prefix, context_parallel_attention
from linattn.feature_maps import create
from linattn.nn import LinearAttention

TOL = 1e-10
# the process group of the cases being run (set in each worker process): a pair of ranks, or the default group
GROUP: Any = None
EXAMPLE_GROUPS: Any = None
# per world size: slice lengths of a sequence of 23 tokens, uneven on purpose (and one of length 1)
SPLITS = {2: [9, 14], 4: [5, 1, 9, 8]}


def _inputs(seed: int, heads: int = 4, kv_heads: int = 4, n: int = 23, dk: int = 8, dv: int = 6,
            dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, n, dk, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(2, kv_heads, n, dk, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(2, kv_heads, n, dv, generator=g, dtype=torch.float64).to(dtype)
    weight = torch.randn(2, heads, n, dv, generator=g, dtype=torch.float64)  # loss = Σ out ⊙ weight
    return q, k, v, weight


def _bounds(split: list[int], rank: int) -> tuple[int, int]:
    start = sum(split[:rank])
    return start, start + split[rank]


def _compare(rank: int, world: int, *, causal: bool, feature_map: Any, split: list[int] | None = None,
             mask: torch.Tensor | None = None, kv_heads: int = 4, validate: bool = True, seed: int = 0,
             gate: torch.Tensor | None = None, **options: Any) -> dict[str, float]:
    """Max abs differences (output, dq, dk, dv, map parameters, the log-gate) between this rank's slice and
    single-process. ``gate``: per-token log-decays (..., N) of the whole sequence, sliced like the tokens."""
    split = split or SPLITS[world]
    q, k, v, weight = _inputs(seed, kv_heads=kv_heads, n=sum(split))
    start, end = _bounds(split, rank)
    fmap_ref = copy.deepcopy(feature_map) if isinstance(feature_map, torch.nn.Module) else feature_map
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    gate_leaf = gate.clone().requires_grad_() if gate is not None else None
    ref = linattn.linear_attention(*leaves, causal=causal, feature_map=fmap_ref, key_padding_mask=mask,
                                   log_gate=gate_leaf, **options)
    (ref * weight).sum().backward()
    parts = [x[..., start:end, :].clone().requires_grad_() for x in (q, k, v)]
    part_gate = gate[..., start:end].clone().requires_grad_() if gate is not None else None
    part_mask = mask[..., start:end] if mask is not None else None
    out = context_parallel_attention(*parts, group=GROUP, causal=causal, feature_map=feature_map,
                                     key_padding_mask=part_mask, validate=validate, log_gate=part_gate, **options)
    (out * weight[..., start:end, :]).sum().backward()
    errors = {"out": (out - ref[..., start:end, :]).abs().max().item()}
    if part_gate is not None and gate_leaf is not None:
        assert part_gate.grad is not None and gate_leaf.grad is not None
        errors["d_gate"] = (part_gate.grad - gate_leaf.grad[..., start:end]).abs().max().item()
    for name, part, leaf in zip("qkv", parts, leaves, strict=True):
        assert part.grad is not None and leaf.grad is not None
        errors[f"d{name}"] = (part.grad - leaf.grad[..., start:end, :]).abs().max().item()
    if isinstance(feature_map, torch.nn.Module):
        for (name, param), param_ref in zip(feature_map.named_parameters(), fmap_ref.parameters(), strict=True):
            assert param.grad is not None and param_ref.grad is not None
            total = param.grad.clone()
            dist.all_reduce(total, group=GROUP)  # each rank holds its share of the map's gradient
            errors[f"d_map.{name}"] = (total - param_ref.grad).abs().max().item()
    return errors


def _gate(world: int, heads: int | None = None, seed: int = 5) -> torch.Tensor:
    """Per-token log-decays ≤ 0 of the whole sequence: (2, 1, N) shared by the heads, or (2, H, N) per head."""
    shape = (2, heads or 1, sum(SPLITS[world]))
    return -torch.nn.functional.softplus(torch.randn(*shape, generator=torch.Generator().manual_seed(seed),
                                                     dtype=torch.float64))


RATES = torch.tensor([0.9, 0.5, 0.99, 0.75], dtype=torch.float64)  # one decay per query head


def _mask(world: int, seed: int = 1) -> torch.Tensor:
    keep = torch.rand(2, sum(SPLITS[world]), generator=torch.Generator().manual_seed(seed)) > 0.3  # (B, N)
    keep[0, : SPLITS[world][0]] = False  # batch row 0: the whole first slice is padding
    return keep


def _favor(seed: int = 0) -> torch.nn.Module:
    return create("favor+", head_dim=8, num_features=12, seed=seed).double()


def _hedgehog() -> torch.nn.Module:
    fmap = create("hedgehog", head_dim=8, num_features=5, num_heads=4, init="random", seed=3).double()
    with torch.no_grad():
        fmap.gate.normal_(0, 0.5, generator=torch.Generator().manual_seed(4))  # a non-trivial key gate
    return fmap


def _reference_case(rank: int, world: int) -> dict[str, float]:
    """The causal slice against the independent quadratic fp64 reference (no library code on that side)."""
    from reference import elu_plus_one, reference_attention

    q, k, v, _ = _inputs(7, kv_heads=2)
    start, end = _bounds(SPLITS[world], rank)
    out = context_parallel_attention(q[..., start:end, :], k[..., start:end, :], v[..., start:end, :], causal=True,
                                     group=GROUP)
    full = reference_attention(q, k, v, elu_plus_one, causal=True)
    return {"out": (out - full[..., start:end, :]).abs().max().item()}


def _low_precision_case(rank: int, world: int, dtype: torch.dtype) -> dict[str, float]:
    """fp16/bf16: error against fp64 at most 2× (+ 1 ulp) single-process linear_attention's in the same dtype."""
    q, k, v, _ = _inputs(5, dtype=dtype)
    start, end = _bounds(SPLITS[world], rank)
    exact = linattn.linear_attention(q.double(), k.double(), v.double(), causal=True)[..., start:end, :]
    single = linattn.linear_attention(q, k, v, causal=True)[..., start:end, :]
    out = context_parallel_attention(q[..., start:end, :], k[..., start:end, :], v[..., start:end, :], causal=True,
                                     group=GROUP)
    assert out.dtype == dtype
    err, err_single = (out.double() - exact).abs().max().item(), (single.double() - exact).abs().max().item()
    return {"excess": max(0.0, err - 2 * err_single - torch.finfo(dtype).eps * exact.abs().max().item())}


def _layer_case(rank: int, world: int, causal: bool, **options: Any) -> dict[str, float]:
    """ContextParallel(LinearAttention) against the unwrapped layer on the whole sequence, with GQA."""
    torch.manual_seed(11)
    layer = LinearAttention(16, 4, num_kv_heads=2, causal=causal, dtype=torch.float64, **options)
    wrapped = ContextParallel(copy.deepcopy(layer), GROUP)
    x = torch.randn(2, sum(SPLITS[world]), 16, dtype=torch.float64)
    start, end = _bounds(SPLITS[world], rank)
    ref = layer(x)
    ref.square().sum().backward()
    out = wrapped(x[:, start:end])
    out.square().sum().backward()
    errors = {"out": (out - ref[:, start:end]).abs().max().item()}
    for (name, param), param_ref in zip(wrapped.layer.named_parameters(), layer.parameters(), strict=True):
        assert param.grad is not None and param_ref.grad is not None
        total = param.grad.clone()
        dist.all_reduce(total, group=GROUP)
        errors[f"d_{name}"] = (total - param_ref.grad).abs().max().item()
    return errors


def _count_collectives(rank: int, world: int) -> dict[str, float]:
    """Collectives per call: forward 1 (validate=False) or 2 (validate=True), backward 1."""
    counts: dict[str, int] = {}
    names = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor",
             "all_reduce", "all_gather", "broadcast", "send", "recv", "all_to_all_single")
    originals = {name: getattr(dist, name) for name in names if hasattr(dist, name)}

    def counting(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[name] = counts.get(name, 0) + 1
            return fn(*args, **kwargs)
        return wrapper

    q, k, v, _ = _inputs(2)
    start, end = _bounds(SPLITS[world], rank)
    parts = [x[..., start:end, :].clone().requires_grad_() for x in (q, k, v)]
    result = {}
    try:
        for name, fn in originals.items():
            setattr(dist, name, counting(name, fn))
        for causal in (True, False):  # non-causal with elu: an all-reduce instead of the all-gather
            for validate in (False, True):
                counts.clear()
                out = context_parallel_attention(*parts, group=GROUP, causal=causal, validate=validate)
                result[f"causal_{causal}_forward_validate_{validate}"] = float(sum(counts.values()))
                counts.clear()
                out.sum().backward()
                result[f"causal_{causal}_backward_validate_{validate}"] = float(sum(counts.values()))
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return result


def _raises(rank: int, world: int, kind: str) -> dict[str, float]:
    """A bad input on one rank: every rank must raise LinearAttentionError (returned as its message)."""
    q, k, v, _ = _inputs(3)
    start, end = _bounds(SPLITS[world], rank)
    part = [x[..., start:end, :] for x in (q, k, v)]
    options: dict[str, Any] = {"causal": True}
    bad = rank == 1
    if kind == "empty" and bad:
        part = [x[..., :0, :] for x in part]
    elif kind == "value_dim" and bad:
        part[2] = part[2][..., :4]
    elif kind == "feature_map":
        options["feature_map"] = _favor(seed=rank)  # a different random draw on every rank
    elif kind == "local_error" and bad:
        options["key_padding_mask"] = torch.ones(3, dtype=torch.long)  # not a bool mask: rejected locally
    elif kind in ("eps_inline", "eps_inline_noncausal") and bad:  # validate=False: sizes agree, options not
        options["eps"] = 1e-3
    elif kind == "per_feature_gate":  # (..., N, F): not split across ranks
        options["log_gate"] = torch.zeros(*part[0].shape[:-1], 8, dtype=torch.float64)
    elif kind == "decay_differs" and bad:  # one rank without the decay the others use
        options["decay"] = None
    elif kind == "decay_differs":
        options["decay"] = 0.9
    if kind == "eps_inline_noncausal":
        options["causal"] = False  # the all-reduce path: the header travels as summed pieces and squares
    validate = not kind.startswith("eps_inline")
    context_parallel_attention(*part, group=GROUP, validate=validate, **options)
    raise AssertionError(f"{kind}: no error raised")


def _example_case(rank: int, world: int) -> dict[str, float]:
    """examples/context_parallel_train.py: the 2-rank loss curve (DDP + ContextParallel) equals single-process."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "examples", "context_parallel_train.py")
    spec = importlib.util.spec_from_file_location("context_parallel_train", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    losses = example.train_context_parallel(rank, world, steps=4, dtype=torch.float64, groups=EXAMPLE_GROUPS)
    single = example.train_single(steps=4, dtype=torch.float64)
    return {"loss_curve": max(abs(a - b) for a, b in zip(losses, single, strict=True))}


def cases(world: int) -> dict[str, Callable[[int, int], dict[str, float]]]:
    elu, favor, signed = "elu", _favor(), create("identity", head_dim=8)
    table: dict[str, Callable[[int, int], dict[str, float]]] = {
        "causal_elu": lambda r, w: _compare(r, w, causal=True, feature_map=elu),
        "causal_elu_inline_header": lambda r, w: _compare(r, w, causal=True, feature_map=elu, validate=False),
        "causal_elu_even_slices_small_chunks": lambda r, w: _compare(
            r, w, causal=True, feature_map=elu, split=[6] * w, chunk_size=4),
        "noncausal_elu": lambda r, w: _compare(r, w, causal=False, feature_map=elu),
        "noncausal_elu_chunked": lambda r, w: _compare(r, w, causal=False, feature_map=elu, chunk_size=4),
        "noncausal_elu_mask_gqa_inline_header": lambda r, w: _compare(
            r, w, causal=False, feature_map=elu, mask=_mask(w), kv_heads=2, validate=False),
        "causal_favor_mask_gqa": lambda r, w: _compare(
            r, w, causal=True, feature_map=favor, mask=_mask(w), kv_heads=2),
        "noncausal_favor_mask": lambda r, w: _compare(r, w, causal=False, feature_map=favor, mask=_mask(w)),
        "causal_favor_large_norms": lambda r, w: _compare(r, w, causal=True, feature_map=favor, seed=9, eps=0.1),
        "causal_hedgehog_learned": lambda r, w: _compare(r, w, causal=True, feature_map=_hedgehog()),
        "noncausal_hedgehog_learned_mask": lambda r, w: _compare(
            r, w, causal=False, feature_map=_hedgehog(), mask=_mask(w, seed=2)),
        "causal_signed_unnormalised": lambda r, w: _compare(
            r, w, causal=True, feature_map=signed, normalize=False),
        "causal_elu_min_denom": lambda r, w: _compare(r, w, causal=True, feature_map=elu, min_denom=0.5, eps=0.0),
        "reference_quadratic": _reference_case,
        "bfloat16": lambda r, w: _low_precision_case(r, w, torch.bfloat16),
        "float16": lambda r, w: _low_precision_case(r, w, torch.float16),
        "layer_causal": lambda r, w: _layer_case(r, w, True),
        "layer_noncausal": lambda r, w: _layer_case(r, w, False),
        # per-head decays, gates computed from each slice's tokens, the per-head output norm
        "layer_causal_decay_token_gate_norm": lambda r, w: _layer_case(
            r, w, True, decay="retnet", gate="token", output_norm=True),
        # the Gated DeltaNet layer: β and gates from each slice's tokens, the delta summaries, the output gate
        "layer_gated_delta_output_gate": lambda r, w: _layer_case(
            r, w, True, update="delta", gate="token", decay="retnet", output_gate=True, feature_map="identity"),
        "layer_kda_output_gate": lambda r, w: _layer_case(
            r, w, True, update="delta", gate="feature", decay="retnet", output_gate=True, feature_map="identity"),
        "collectives": _count_collectives,
        # decays: each slice's decayed sums and its total log-decay cross the ranks
        "causal_elu_decay_per_head_mask_gqa": lambda r, w: _compare(
            r, w, causal=True, feature_map=elu, decay=RATES, mask=_mask(w), kv_heads=2),
        "causal_favor_log_gate_and_decay_inline_header": lambda r, w: _compare(
            r, w, causal=True, feature_map=favor, gate=_gate(w), decay=0.95, validate=False),
        "causal_hedgehog_log_gate_per_head_small_chunks": lambda r, w: _compare(
            r, w, causal=True, feature_map=_hedgehog(), gate=_gate(w, heads=4), chunk_size=4),
    }
    for kind in ("empty", "value_dim", "feature_map", "local_error", "eps_inline", "eps_inline_noncausal",
                 "per_feature_gate", "decay_differs"):
        table[f"raises_{kind}"] = lambda r, w, kind=kind: _raises(r, w, kind)
    # the group must still work after the errors above
    table["causal_elu_after_errors"] = lambda r, w: _compare(r, w, causal=True, feature_map=elu, seed=4)
    if world == 2:
        table["example_loss_curve"] = _example_case
    return table


def _worker(rank: int, directory: str) -> None:
    """All 4 processes run the 4-rank cases; ranks 0 and 1 first run the 2-rank cases in a group of their own."""
    global GROUP, EXAMPLE_GROUPS
    torch.set_num_threads(1)
    # every collective raises after 300 s instead of blocking. Ranks 2 and 3 wait in their first collective until 0
    # and 1 finish the 2-rank cases: ~30 s on a quiet machine, but over 60 s on a first run in a fresh clone (a
    # shorter limit there made ranks 2 and 3 time out, move on and tear down under ranks 0 and 1: gloo aborted)
    dist.init_process_group("gloo", init_method=f"file://{directory}/rendezvous", rank=rank, world_size=4,
                            timeout=datetime.timedelta(seconds=300))
    pairs = [dist.new_group([0, 1]) for _ in range(3)]  # collective: every rank creates them, in the same order
    try:
        for world in (2, 4):
            if rank >= world:
                continue
            GROUP = pairs[0] if world == 2 else None
            EXAMPLE_GROUPS = (pairs[1], pairs[2]) if world == 2 else None
            results: dict[str, Any] = {}
            for name, case in cases(world).items():
                started = time.perf_counter()
                try:
                    results[name] = {"errors": case(rank, world)}
                except linattn.LinearAttentionError as error:
                    results[name] = {"raised": str(error)}
                except Exception:  # recorded, so the test names the case (a failed collective also lands here)
                    results[name] = {"crashed": traceback.format_exc()}
                results[name]["seconds"] = time.perf_counter() - started
            with open(os.path.join(directory, f"world{world}_rank{rank}.json"), "w") as handle:
                json.dump(results, handle)
    finally:
        try:
            dist.barrier()  # no rank tears its connections down while another still uses them
        finally:
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def spawned_once(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One spawn of 4 processes for both world sizes: process start-up is most of the time."""
    directory = str(tmp_path_factory.mktemp("context_parallel"))
    mp.spawn(_worker, args=(directory,), nprocs=4, join=True)
    return directory


@pytest.fixture(params=[2, 4], ids=lambda w: f"world{w}")
def spawned(request: pytest.FixtureRequest, spawned_once: str) -> tuple[int, list[dict]]:
    world = request.param
    ranks = []
    for rank in range(world):
        with open(os.path.join(spawned_once, f"world{world}_rank{rank}.json")) as handle:
            ranks.append(json.load(handle))
    return world, ranks


EXACT = [name for name in cases(2) if not name.startswith("raises_") and name != "collectives"]
RAISES = {
    "raises_empty": "empty slice",
    "raises_value_dim": "value_dim differs",
    "raises_feature_map": "feature_map differs",
    "raises_local_error": "key_padding_mask",
    "raises_eps_inline": "eps differs",
    "raises_eps_inline_noncausal": "eps differs",
    "raises_per_feature_gate": "per-feature gates",
    "raises_decay_differs": "decay differs",
}


@pytest.mark.parametrize("case", EXACT)
def test_equals_single_process(spawned: tuple[int, list[dict]], case: str) -> None:
    world, ranks = spawned
    if case not in ranks[0]:
        pytest.skip(f"not run at world size {world}")
    for rank, results in enumerate(ranks):
        result = results[case]
        assert "errors" in result, f"rank {rank}: {result}"
        for name, error in result["errors"].items():
            assert math.isfinite(error) and error <= TOL, f"rank {rank}, {name}: {error:.3g} > {TOL}"


@pytest.mark.parametrize("case", sorted(RAISES))
def test_bad_input_raises_on_every_rank(spawned: tuple[int, list[dict]], case: str) -> None:
    _, ranks = spawned
    for rank, results in enumerate(ranks):
        assert "raised" in results[case], f"rank {rank}: {results[case]}"
        message = results[case]["raised"]
        assert RAISES[case] in message or "rejected their inputs" in message, f"rank {rank}: {message}"
    # the rank whose input was bad (rank 1 for the one-rank cases) names its own problem
    assert RAISES[case] in ranks[1][case]["raised"]


def test_one_collective_each_way(spawned: tuple[int, list[dict]]) -> None:
    _, ranks = spawned
    for results in ranks:
        assert results["collectives"]["errors"] == {
            f"causal_{causal}_{way}_validate_{validate}": 2.0 if way == "forward" and validate else 1.0
            for causal in (True, False) for validate in (False, True) for way in ("forward", "backward")
        }


def test_combine_prefix_with_decay_matches_the_recurrence() -> None:
    """The per-slice log-decay slot, in true (unshifted) sums, fp64: the state entering slice j+1 is
    P_{j+1} = P_j·e^{g_j} + S_j·e^{m_j} (slice j decays what came before it by its total log-decay g_j)."""
    g = torch.Generator().manual_seed(0)
    world, rows, features, values = 5, 3, 4, 2
    kv = torch.rand(world, rows, features, values, generator=g, dtype=torch.float64)
    k_sum = torch.rand(world, rows, features, generator=g, dtype=torch.float64)
    shift = torch.randn(world, rows, generator=g, dtype=torch.float64) * 3
    shift[1, 0] = -math.inf  # a slice with no visible key
    log_decay = -torch.rand(world, rows, generator=g, dtype=torch.float64) * 2
    true_kv = torch.zeros(rows, features, values, dtype=torch.float64)
    true_k = torch.zeros(rows, features, dtype=torch.float64)
    for rank in range(world):
        got_kv, got_k, got_shift = combine_prefix(kv, k_sum, shift, rank, log_decay=log_decay)
        factor = torch.exp(got_shift)  # (rows,); 0 for rank 0 (nothing before it)
        assert torch.allclose(got_kv * factor[:, None, None], true_kv, rtol=1e-12, atol=0)
        assert torch.allclose(got_k * factor[:, None], true_k, rtol=1e-12, atol=0)
        scale = torch.exp(shift[rank])  # (rows,)
        true_kv = true_kv * torch.exp(log_decay[rank])[:, None, None] + kv[rank] * scale[:, None, None]
        true_k = true_k * torch.exp(log_decay[rank])[:, None] + k_sum[rank] * scale[:, None]
    kv_all, _, shift_all = combine_others(kv, k_sum, shift, 2)
    expect = sum(kv[j] * torch.exp(shift[j])[:, None, None] for j in range(world) if j != 2)
    assert torch.allclose(kv_all * torch.exp(shift_all)[:, None, None], expect, rtol=1e-12, atol=0)


def test_combine_prefix_fp32_states_at_large_scales() -> None:
    """fp32 summaries at log-scales ≈ 640 with decays: the combined sums are exact to fp32 rounding at the scale
    the result records (the scale is rounded to fp32 before the weights are formed against it)."""
    g = torch.Generator().manual_seed(1)
    world, rows, features, values = 4, 64, 3, 2
    kv = torch.rand(world, rows, features, values, generator=g, dtype=torch.float64)
    k_sum = torch.rand(world, rows, features, generator=g, dtype=torch.float64)
    shift = (640 + torch.randn(world, rows, generator=g, dtype=torch.float64)).float().double()
    log_decay = (-torch.rand(world, rows, generator=g, dtype=torch.float64)).float().double()
    exact_kv, _, exact_shift = combine_prefix(kv, k_sum, shift, world - 1, log_decay=log_decay)  # fp64
    got_kv, _, got_shift = combine_prefix(kv.float(), k_sum.float(), shift.float(), world - 1,
                                          log_decay=log_decay.float())
    assert got_kv.dtype == torch.float32
    # both as true sums relative to the fp64 scale: e^{got_shift − exact_shift} brings the fp32 result over
    rescaled = got_kv.double() * torch.exp(got_shift.double() - exact_shift)[:, None, None]
    relative = ((rescaled - exact_kv).abs() / exact_kv.abs()).max().item()
    assert relative < 1e-6, relative  # a few fp32 ulps; an unrounded scale gives ~3e-5 here


def test_summed_header_pieces_detect_any_disagreement() -> None:
    """The all-reduce header: sums of pieces and squares expose one differing field; slice lengths may differ
    and their total comes back exact (large values, negative bit patterns included)."""
    from linattn.distributed import _exchange

    base = {name: 7 for name in _exchange.FIELDS}
    base.update(eps=_exchange.float_bits(1e-6), min_denom=_exchange.float_bits(-1.0), k_tokens=3_000_000)
    headers = []
    for rank in range(5):
        values: dict[str, Any] = dict(base, k_tokens=3_000_000 + rank, q_tokens=rank + 1)
        values["feature_map"] = torch.tensor(12.5, dtype=torch.float64)
        headers.append(_exchange.make_header(values))
    summed = sum(_exchange.header_moments(h, torch.float32, torch.device("cpu")) for h in headers)
    assert isinstance(summed, torch.Tensor)
    assert _exchange.check_moments(summed, headers[0], 5, 0) == 5 * 3_000_000 + 10
    headers[3] = headers[3].clone()
    headers[3][_exchange.FIELDS.index("eps")] = _exchange.float_bits(1e-6 * (1 + 2**-52))  # one bit apart
    summed = sum(_exchange.header_moments(h, torch.float32, torch.device("cpu")) for h in headers)
    with pytest.raises(linattn.LinearAttentionError, match="eps differs"):
        _exchange.check_moments(summed, headers[0], 5, 0)


@pytest.mark.parametrize(("options", "match"), [({"window": 4}, "window"), ({"gate": "feature"}, "per-feature"),
                                                ({"short_conv": 4}, "short convolution")],
                         ids=["window", "feature-gate", "short-conv"])
def test_context_parallel_refuses_what_it_does_not_split(options: dict, match: str) -> None:
    with pytest.raises(linattn.LinearAttentionError, match=match):
        ContextParallel(LinearAttention(16, 4, causal=True, **options))
