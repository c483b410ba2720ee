"""Backends: which implementation runs a form. ``"torch"`` (the forms, any device) or ``"triton"`` (GPU kernels).

:mod:`linattn.capabilities` decides which backend covers a call (``"auto"``: triton for covered calls on CUDA
tensors when it is importable, else torch; a forced ``"triton"`` raises listing every reason, as xformers' dispatch
does); :func:`select_backend` gives the runner of the chosen one, taking a :class:`~linattn._dispatch.Job` like
every torch runner. Nothing here imports triton until a triton run is chosen.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from .. import _validate
from ..errors import LinearAttentionError
from ..feature_maps.elementwise import EluFeatureMap
from ..features import delta_inputs, key_features, query_features
from ..state import DeltaRuleState, LinearAttentionState
from . import triton as triton_backend

# the fused token-by-token kernel serves inference calls of at most this many tokens (decoding, short prompts);
# longer ones, and any call that needs gradients, take the chunk kernels
RECURRENT_MAX_TOKENS = 16

Runner = Callable[[Any], tuple[torch.Tensor, Any]]


def select_backend(
    backend: str, *, dtype: torch.dtype, forced: bool, torch_run: Runner, kind: str = "plain"
) -> Runner:
    """The runner of ``backend`` ("torch" or "triton", as :func:`linattn.capabilities.choose_backend` picked it)
    for a job of route kind ``kind`` ("plain" or "delta": the kinds the kernels cover) whose caller's input dtype
    is ``dtype``; ``torch_run`` runs the route on the torch forms."""
    if backend == "torch":
        return torch_run
    if kind == "delta":
        return _triton_delta_run(dtype, forced=forced, torch_run=torch_run)
    return _triton_run(dtype, forced=forced, torch_run=torch_run)


def _triton_run(dtype: torch.dtype, *, forced: bool, torch_run: Runner) -> Runner:
    """Plain causal attention of a :class:`~linattn._dispatch.Job` on the kernels; sizes the kernels do not take
    (known once the features exist) raise when ``forced``, else go to ``torch_run``."""

    def run(job: Any) -> tuple[torch.Tensor, LinearAttentionState | None]:
        fmap, q, k, v, keep, state = job.fmap, job.q, job.k, job.v, job.keep, job.state
        options = {"normalize": job.normalize, "eps": job.eps, "min_denom": job.min_denom}
        # q, k, v arrive in the caller's dtype: elu + 1 is made in the kernels from them (no feature tensor is
        # written); any other map runs here in fp32, as on the torch backend
        if type(fmap) is EluFeatureMap and keep is None and q.dtype == dtype:
            if not triton_backend.shape_reasons(q.shape[-1], v.shape[-1], dtype):
                _validate.check_state_features(state, q.shape[-1], job.map_name)
                return causal_attention(q, k.to(dtype), v.to(dtype), state=state, dtype=dtype, elu=True, **options)
        job = replace(job, q=q.float(), k=k.float(), v=v.float())
        qf = query_features(fmap, job.q, False, **job.checks())
        kf, _ = key_features(fmap, job.k, keep, False, True, None, **job.checks())  # masked keys are zeroed
        found = triton_backend.shape_reasons(kf.shape[-1], v.shape[-1], dtype)
        if found:
            if forced:
                raise triton_backend.refusal(found)
            return torch_run(job)
        _validate.check_state_features(state, kf.shape[-1], job.map_name)
        return causal_attention(qf, kf, job.v, state=state, dtype=dtype, **options)

    return run


def _triton_delta_run(dtype: torch.dtype, *, forced: bool, torch_run: Runner) -> Runner:
    """The delta rule of a :class:`~linattn._dispatch.Job` on the kernels (kinds/delta/triton/function.py; per-feature
    gates, KDA: kinds/kda/triton/function.py): the features made and L2-normalised here in fp32 (any map; the step
    kernel normalises them itself); inference calls of at most RECURRENT_MAX_TOKENS tokens take the step kernel, the
    rest the chunk kernels. Sizes the kernels do not take raise when ``forced``, else go to ``torch_run``."""

    def run(job: Any) -> tuple[torch.Tensor, DeltaRuleState]:
        job = replace(job, q=job.q.float(), k=job.k.float(), v=job.v.float())
        state, n = job.state, job.q.shape[-2]
        assert job.beta is not None and (state is None or isinstance(state, DeltaRuleState))
        inputs = (job.q, job.k, job.v, job.beta, job.log_decay, job.feature_gate,
                  state.kv if state is not None else None)
        tracking = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs)
        stepping = not tracking and n <= RECURRENT_MAX_TOKENS
        qf, kf, beta = delta_inputs(job.fmap, job.q, job.k, job.keep, job.beta, log_space=job.log_space,
                                    finite=job.check_finite, nonnegative=job.nonnegative, normalized=not stepping)
        found = triton_backend.delta_shape_reasons(kf.shape[-1], job.v.shape[-1])
        if found:
            if forced:
                raise triton_backend.refusal(found)
            return torch_run(job)
        _validate.check_state_features(state, kf.shape[-1], job.map_name)
        initial = state.kv if state is not None else kf.new_zeros(*kf.shape[:-2], kf.shape[-1], job.v.shape[-1])
        host = triton_backend.load_delta()
        gate = job.log_decay
        if job.feature_gate is not None:  # KDA; a per-token decay adds to every feature's gate (as kinds/kda/forms.py)
            _validate.check_gate_features(job.feature_gate, kf.shape[-1])
            gate = job.feature_gate
            if job.log_decay is not None:
                gate = gate.to(torch.float64) + job.log_decay.unsqueeze(-1)
        common = {"beta": beta, "initial": initial, "dtype": dtype}
        if stepping:  # one step kernel: per-token or per-feature gates
            out, kv = host.delta_recurrent(qf, kf, job.v, log_decay=gate, **common)
        elif job.feature_gate is not None:
            out, kv = triton_backend.load_kda().kda_chunked(qf, kf, job.v, log_gate=gate, **common)
        else:
            size = job.chunk_size or next(c for c in triton_backend.DELTA_CHUNKS if c >= min(n, 64))
            out, kv = host.delta_chunked(qf, kf, job.v, log_decay=gate, chunk_size=size, **common)
        return out, DeltaRuleState(kv, (state.num_tokens if state is not None else 0) + n)

    return run


def causal_attention(
    qf: torch.Tensor,
    kf: torch.Tensor,
    v: torch.Tensor,
    *,
    state: LinearAttentionState | None,
    dtype: torch.dtype,
    normalize: bool,
    eps: float,
    min_denom: float | None,
    elu: bool = False,
) -> tuple[torch.Tensor, LinearAttentionState]:
    """Causal linear attention on ordinary features with the triton kernels; the state as the torch forms give it.
    ``elu``: ``qf``, ``kf`` are the raw projections, the kernels make the elu + 1 features."""
    if qf.shape != kf.shape or v.shape[:-1] != kf.shape[:-1]:  # the kernels index all three with one (R, N)
        raise LinearAttentionError(
            f"query features {tuple(qf.shape)}, key features {tuple(kf.shape)} and values {tuple(v.shape)}: the "
            "feature map must give queries and keys the same F, and every key a value"
        )
    host = triton_backend.load()
    batch, n = qf.shape[:-2], qf.shape[-2]
    if state is None:
        kv0 = torch.zeros(*batch, kf.shape[-1], v.shape[-1], device=qf.device)  # (..., F, Dv), fp32 sums
        k_sum0 = torch.zeros(*batch, kf.shape[-1], device=qf.device)  # (..., F)
        seen = 0
    else:
        kv0, k_sum0, seen = state.kv, state.k_sum, state.num_tokens
    tensors = (qf, kf, v, kv0, k_sum0)
    tracking = torch.is_grad_enabled() and any(x.requires_grad for x in tensors)
    if not tracking and n <= RECURRENT_MAX_TOKENS:
        out, kv, k_sum = host.recurrent_step(*tensors, dtype, normalize, eps, min_denom, elu)
    else:
        out, kv, k_sum = host.TritonCausalFunction.apply(*tensors, dtype, normalize, eps, min_denom, elu)
    shift = torch.zeros(batch, dtype=kv.dtype, device=kv.device)
    return out, LinearAttentionState(kv, k_sum, shift, seen + n)
