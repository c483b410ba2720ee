"""The delta rule across ranks (linattn.distributed, update="delta") against single-process linear_attention.

As in test_distributed.py, real processes (spawn, gloo) run every case and write their results to JSON files; each
rank computes the single-process result on the whole sequence itself (same seed) and compares its own slice of the
output and of the gradients. Three processes start once: ranks 0 and 1 run the 2-rank cases in a group of their
own, then all three run the 3-rank cases.

fp64 throughout. The split changes only the order of operations (each slice's map [A | B] formed chunk by chunk and
the maps folded, instead of one pass), every factor of which has norm ≤ 1, so with values of order 1 and 23
tokens 1e-10 bounds the rounding with a wide margin; single-process linear_attention itself is checked against a
token-by-token float64 recurrence written here (1e-12: the same arithmetic, another order).
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
import torch.nn.functional as F

import linattn
from linattn.distributed import context_parallel_attention
from linattn.feature_maps import create
from linattn.kinds.delta.distributed import prefix_state
from linattn.kinds.delta.forms import delta_transition

TOL = 1e-10
GROUP: Any = None
# slice lengths of a sequence of 23 tokens, uneven on purpose (a slice of one token, one longer than a chunk of 4)
SPLITS = {2: [9, 14], 3: [6, 1, 16]}


def delta_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                    log_decay: torch.Tensor | None = None, keep: torch.Tensor | None = None) -> torch.Tensor:
    """The delta rule token by token in float64, from the definition: elu + 1 features, L2-normalised;
    S_t = a_t·S_{t−1} + β_t·k_t(v_t − a_t·S_{t−1}ᵀk_t)ᵀ, o_t = S_tᵀq_t. q, k, v (B, H, N, D) with equal heads,
    beta and log_decay (B, H, N), keep (B, N) (masked tokens write nothing; the decay still applies)."""
    q, k, v, beta = q.double(), k.double(), v.double(), beta.double()
    qf, kf = (F.normalize(F.elu(x) + 1, dim=-1) for x in (q, k))
    if keep is not None:
        beta = beta * keep[:, None, :].double()
    state = torch.zeros(*q.shape[:-2], kf.shape[-1], v.shape[-1], dtype=torch.float64)
    outs = []
    for t in range(q.shape[-2]):
        a = torch.exp(log_decay[..., t, None, None].double()) if log_decay is not None else 1.0
        k_t = kf[..., t, :, None]  # (B, H, F, 1)
        state = a * state
        state = state + beta[..., t, None, None] * k_t @ (v[..., t, None, :] - k_t.mT @ state)
        outs.append((qf[..., t, None, :] @ state).squeeze(-2))
    return torch.stack(outs, dim=-2)


def _inputs(seed: int, n: int, heads: int = 4, kv_heads: int = 4, dk: int = 8, dv: int = 6) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "q": torch.randn(2, heads, n, dk, generator=g, dtype=torch.float64),
        "k": torch.randn(2, kv_heads, n, dk, generator=g, dtype=torch.float64),
        "v": torch.randn(2, kv_heads, n, dv, generator=g, dtype=torch.float64),
        "beta": 2 * torch.sigmoid(torch.randn(2, kv_heads, n, generator=g, dtype=torch.float64)),  # (0, 2)
        "log_gate": -F.softplus(torch.randn(2, heads, n, generator=g, dtype=torch.float64)),
        "weight": torch.randn(2, heads, n, dv, generator=g, dtype=torch.float64),  # loss = Σ out ⊙ weight
        "keep": torch.rand(2, n, generator=g) > 0.3,
    }


def _hedgehog() -> torch.nn.Module:
    fmap = create("hedgehog", head_dim=8, num_features=5, num_heads=4, init="random", seed=3).double()
    with torch.no_grad():
        fmap.gate.normal_(0, 0.5, generator=torch.Generator().manual_seed(4))
    return fmap


def _compare(rank: int, world: int, *, seed: int = 0, kv_heads: int = 4, gate: bool = False, mask: bool = False,
             feature_map: Any = "elu", validate: bool = True, per_feature: bool = False, **options: Any
             ) -> dict[str, float]:
    """Max abs differences (output; gradients of q, k, v, β, the log-gate and the map's parameters summed over
    ranks) between this rank's slice and single-process linear_attention(..., update="delta"). ``per_feature``:
    the log-gate (..., N, F) per feature (KDA)."""
    split = SPLITS[world]
    start = sum(split[:rank])
    end = start + split[rank]
    x = _inputs(seed, sum(split), kv_heads=kv_heads)
    if per_feature:
        x["log_gate"] = -F.softplus(torch.randn(*x["log_gate"].shape, 8, dtype=torch.float64,
                                                generator=torch.Generator().manual_seed(seed)))
    names = ["q", "k", "v", "beta"] + (["log_gate"] if gate else [])
    fmap_ref = copy.deepcopy(feature_map) if isinstance(feature_map, torch.nn.Module) else feature_map
    leaves = {name: x[name].clone().requires_grad_() for name in names}
    keep = x["keep"] if mask else None
    ref = linattn.linear_attention(leaves["q"], leaves["k"], leaves["v"], causal=True, update="delta",
                                   beta=leaves["beta"], log_gate=leaves.get("log_gate"), key_padding_mask=keep,
                                   feature_map=fmap_ref, **options)
    (ref * x["weight"]).sum().backward()
    parts = {name: x[name][..., start:end, :] if x[name].dim() == 4 else x[name][..., start:end]
             for name in names}
    parts = {name: part.clone().requires_grad_() for name, part in parts.items()}
    out = context_parallel_attention(parts["q"], parts["k"], parts["v"], group=GROUP, causal=True, update="delta",
                                     beta=parts["beta"], log_gate=parts.get("log_gate"), feature_map=feature_map,
                                     key_padding_mask=keep[:, start:end] if keep is not None else None,
                                     validate=validate, **options)
    (out * x["weight"][..., start:end, :]).sum().backward()
    errors = {"out": (out - ref[..., start:end, :]).abs().max().item()}
    for name in names:
        grad, full = parts[name].grad, leaves[name].grad
        assert grad is not None and full is not None
        errors[f"d_{name}"] = (grad - full[..., start:end, :] if grad.dim() == 4 else grad - full[..., start:end]
                               ).abs().max().item()
    if isinstance(feature_map, torch.nn.Module):
        for (name, param), param_ref in zip(feature_map.named_parameters(), fmap_ref.parameters(), strict=True):
            assert param.grad is not None and param_ref.grad is not None
            total = param.grad.clone()
            dist.all_reduce(total, group=GROUP)  # each rank holds its share of the map's gradient
            errors[f"d_map.{name}"] = (total - param_ref.grad).abs().max().item()
    return errors


def _against_recurrence(rank: int, world: int) -> dict[str, float]:
    """The slice's output against the float64 recurrence above (no library code on that side), decay and mask."""
    split = SPLITS[world]
    start = sum(split[:rank])
    end = start + split[rank]
    x = _inputs(8, sum(split))
    expected = delta_reference(x["q"], x["k"], x["v"], x["beta"], log_decay=x["log_gate"] + math.log(0.9),
                               keep=x["keep"])
    out = context_parallel_attention(
        *(x[name][..., start:end, :] for name in "qkv"), group=GROUP, causal=True, update="delta",
        beta=x["beta"][..., start:end], log_gate=x["log_gate"][..., start:end], decay=0.9,
        key_padding_mask=x["keep"][:, start:end], chunk_size=4,
    )
    return {"out": (out - expected[..., start:end, :]).abs().max().item()}


def _low_precision(rank: int, world: int, dtype: torch.dtype) -> dict[str, float]:
    """fp32/bf16 inputs (fp32 summaries and state): the slice's error against fp64 at most 2× single-process
    linear_attention's in the same dtype, plus one ulp of the output's scale (the rounding of the cast back)."""
    split = SPLITS[world]
    start = sum(split[:rank])
    end = start + split[rank]
    x = _inputs(6, sum(split))
    options = {"causal": True, "update": "delta", "decay": 0.95, "chunk_size": 4}
    exact = linattn.linear_attention(x["q"], x["k"], x["v"], beta=x["beta"], log_gate=x["log_gate"], **options)
    low = {name: x[name].to(dtype) for name in ("q", "k", "v", "beta", "log_gate")}
    single = linattn.linear_attention(low["q"], low["k"], low["v"], beta=low["beta"], log_gate=low["log_gate"],
                                      **options)
    out = context_parallel_attention(*(low[name][..., start:end, :] for name in "qkv"), group=GROUP,
                                     beta=low["beta"][..., start:end], log_gate=low["log_gate"][..., start:end],
                                     **options)
    assert out.dtype == dtype
    exact = exact[..., start:end, :]
    err = (out.double() - exact).abs().max().item()
    err_single = (single[..., start:end, :].double() - exact).abs().max().item()
    return {"excess": max(0.0, err - 2 * err_single - torch.finfo(dtype).eps * exact.abs().max().item())}


def _raises(rank: int, world: int, kind: str) -> dict[str, float]:
    """A call that cannot run: every rank must raise LinearAttentionError (returned as its message)."""
    split = SPLITS[world]
    start = sum(split[:rank])
    x = _inputs(3, sum(split))
    part = [x[name][..., start : start + split[rank], :] for name in "qkv"]
    options: dict[str, Any] = {"causal": True, "update": "delta"}
    if kind == "noncausal":
        options["causal"] = False
    elif kind == "gate_width":
        options["log_gate"] = torch.zeros(*part[0].shape[:-1], 5, dtype=torch.float64)  # F = 8
    elif kind == "beta_range" and rank == 1:
        options["beta"] = 3.0  # rejected locally on one rank only
    elif kind == "update_differs" and rank == 1:
        options.update(update="add", normalize=False)  # the same sizes and options, another update rule
    context_parallel_attention(*part, group=GROUP, **options)
    raise AssertionError(f"{kind}: no error raised")


def cases() -> dict[str, Callable[[int, int], dict[str, float]]]:
    table: dict[str, Callable[[int, int], dict[str, float]]] = {
        "plain": lambda r, w: _compare(r, w),
        "plain_small_chunks_inline_header": lambda r, w: _compare(r, w, chunk_size=4, validate=False),
        "gated_small_chunks": lambda r, w: _compare(r, w, gate=True, chunk_size=4),
        "decay_per_head_mask_gqa": lambda r, w: _compare(
            r, w, seed=1, kv_heads=2, mask=True, decay=torch.tensor([0.9, 0.5, 0.99, 0.75], dtype=torch.float64)),
        "gated_favor_log_space": lambda r, w: _compare(
            r, w, seed=2, gate=True, feature_map=create("favor+", head_dim=8, num_features=12, seed=0).double()),
        "gated_hedgehog_learned_small_chunks": lambda r, w: _compare(
            r, w, seed=3, gate=True, feature_map=_hedgehog(), chunk_size=4),
        "kda_decay_mask_small_chunks": lambda r, w: _compare(
            r, w, seed=5, gate=True, per_feature=True, mask=True, decay=0.9, chunk_size=4),
        "recurrence": _against_recurrence,
        "float32": lambda r, w: _low_precision(r, w, torch.float32),
        "bfloat16": lambda r, w: _low_precision(r, w, torch.bfloat16),
    }
    for kind in ("noncausal", "gate_width", "beta_range", "update_differs"):
        table[f"raises_{kind}"] = lambda r, w, kind=kind: _raises(r, w, kind)
    table["plain_after_errors"] = lambda r, w: _compare(r, w, seed=4)
    return table


def _worker(rank: int, directory: str) -> None:
    global GROUP
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{directory}/rendezvous", rank=rank, world_size=3,
                            timeout=datetime.timedelta(seconds=300))
    pair = dist.new_group([0, 1])  # collective: every rank creates it
    try:
        for world in (2, 3):
            if rank >= world:
                continue
            GROUP = pair if world == 2 else None
            results: dict[str, Any] = {}
            for name, case in cases().items():
                started = time.perf_counter()
                try:
                    results[name] = {"errors": case(rank, world)}
                except linattn.LinearAttentionError as error:
                    results[name] = {"raised": str(error)}
                except Exception:  # recorded, so that the test names the case
                    results[name] = {"crashed": traceback.format_exc()}
                results[name]["seconds"] = time.perf_counter() - started
            with open(os.path.join(directory, f"world{world}_rank{rank}.json"), "w") as handle:
                json.dump(results, handle)
    finally:
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def spawned_once(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = str(tmp_path_factory.mktemp("context_parallel_delta"))
    mp.spawn(_worker, args=(directory,), nprocs=3, join=True)
    return directory


@pytest.fixture(params=[2, 3], ids=lambda w: f"world{w}")
def spawned(request: pytest.FixtureRequest, spawned_once: str) -> list[dict]:
    ranks = []
    for rank in range(request.param):
        with open(os.path.join(spawned_once, f"world{request.param}_rank{rank}.json")) as handle:
            ranks.append(json.load(handle))
    return ranks


EXACT = [name for name in cases() if not name.startswith("raises_")]
RAISES = {
    "raises_noncausal": "causal=True",
    "raises_gate_width": "per-feature gate with 5 features",
    "raises_beta_range": "beta",
    "raises_update_differs": "update differs",
}


@pytest.mark.slow  # the processes start in ~25–40 s on 2 busy cores; the cases themselves take < 1 s
@pytest.mark.parametrize("case", EXACT)
def test_equals_single_process(spawned: list[dict], case: str) -> None:
    for rank, results in enumerate(spawned):
        result = results[case]
        assert "errors" in result, f"rank {rank}: {result}"
        for name, error in result["errors"].items():
            assert math.isfinite(error) and error <= TOL, f"rank {rank}, {name}: {error:.3g} > {TOL}"


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(RAISES))
def test_bad_input_raises_on_every_rank(spawned: list[dict], case: str) -> None:
    for rank, results in enumerate(spawned):
        assert "raised" in results[case], f"rank {rank}: {results[case]}"
        message = results[case]["raised"]
        assert RAISES[case] in message or "rejected their inputs" in message, f"rank {rank}: {message}"
    assert RAISES[case] in spawned[1][case]["raised"]  # rank 1 (the bad one, where only one is) names the problem


# ---- single process: the reference, the slice map and the fold ----------------------------------------------------


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_single_process_equals_the_recurrence(gated: bool) -> None:
    """Outputs and the gradients of q, k, v, β and g (autograd through the recurrence above) in fp64, 1e-12."""
    x = _inputs(5, 23)
    names = ["q", "k", "v", "beta"] + (["log_gate"] if gated else [])
    leaves = {name: x[name].clone().requires_grad_() for name in names}
    expected = delta_reference(leaves["q"], leaves["k"], leaves["v"], leaves["beta"],
                               log_decay=leaves.get("log_gate"), keep=x["keep"])
    expected_grads = torch.autograd.grad((expected * x["weight"]).sum(), list(leaves.values()))
    for chunk in (4, 64):
        out = linattn.linear_attention(*(leaves[name] for name in "qkv"), causal=True, update="delta",
                                       beta=leaves["beta"], log_gate=leaves.get("log_gate"),
                                       key_padding_mask=x["keep"], chunk_size=chunk)
        assert (out - expected).abs().max().item() < 1e-12
        grads = torch.autograd.grad((out * x["weight"]).sum(), list(leaves.values()))
        for name, grad, want in zip(names, grads, expected_grads, strict=True):
            assert (grad - want).abs().max().item() < 1e-12, name


@pytest.mark.parametrize(("n", "chunk"), [(1, 4), (8, 4), (23, 4), (23, 5), (23, 64)])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_transition_is_the_product_and_the_state_from_zero(n: int, chunk: int, gated: bool) -> None:
    """A = Π_t a_t(I − β_t k_t k_tᵀ) written out, B = the recurrence's state from 0, and A·S + B = the state from
    S (fp64; 1e-12: the same products in another order)."""
    g = torch.Generator().manual_seed(n + chunk)
    kf = F.normalize(torch.randn(2, 3, n, 5, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(2, 3, n, 4, generator=g, dtype=torch.float64)
    beta = 2 * torch.rand(2, 3, n, generator=g, dtype=torch.float64)
    log_decay = -torch.rand(2, 3, n, generator=g, dtype=torch.float64) if gated else None
    a, b = delta_transition(kf, v, beta=beta, log_decay=log_decay, chunk_size=chunk)
    eye = torch.eye(5, dtype=torch.float64)
    product = eye.expand(2, 3, 5, 5)
    start = torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64)
    from_zero, from_start = torch.zeros_like(start), start
    for t in range(n):
        decay = torch.exp(log_decay[..., t, None, None]) if log_decay is not None else 1.0
        k_t = kf[..., t, :, None]
        step = decay * (eye - beta[..., t, None, None] * k_t @ k_t.mT)  # (2, 3, F, F)
        product = step @ product
        write = beta[..., t, None, None] * k_t @ v[..., t, None, :]
        from_zero, from_start = step @ from_zero + write, step @ from_start + write
    assert (a - product).abs().max().item() < 1e-12
    assert (b - from_zero).abs().max().item() < 1e-12
    assert (a @ start + b - from_start).abs().max().item() < 1e-12


def test_transition_gradients() -> None:
    """Autograd through the chunk solution and the pairwise products, against finite differences (fp64)."""
    g = torch.Generator().manual_seed(0)
    kf = F.normalize(torch.randn(1, 7, 3, generator=g, dtype=torch.float64), dim=-1).requires_grad_()
    v = torch.randn(1, 7, 2, generator=g, dtype=torch.float64, requires_grad=True)
    beta = (0.2 + 1.5 * torch.rand(1, 7, generator=g, dtype=torch.float64)).requires_grad_()
    log_decay = (-torch.rand(1, 7, generator=g, dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda *x: delta_transition(x[0], x[1], beta=x[2], log_decay=x[3], chunk_size=2), (kf, v, beta, log_decay))


def test_prefix_state_folds_the_slices_in_order() -> None:
    """The fold of [A_j | B_j] for j < rank equals running the slices one after the other; rank 0 gets zeros."""
    g = torch.Generator().manual_seed(1)
    world, features, values = 4, 3, 2
    maps = torch.randn(world, 2, features, features + values, generator=g, dtype=torch.float64)
    state = torch.zeros(2, features, values, dtype=torch.float64)
    for rank in range(world):
        got = prefix_state(maps, rank, features)
        assert (got - state).abs().max().item() < 1e-13
        state = maps[rank, ..., :features] @ state + maps[rank, ..., features:]
