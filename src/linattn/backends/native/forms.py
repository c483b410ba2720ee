"""The native forward (causal.cpp) from Python: features made in torch one block of tokens at a time, the causal
recurrence in C++ with each (batch, head) row's state in cache, and non-causal attention in two passes. No
gradients: calls that need them, and sizes the kernels do not take, run the torch forms (:func:`grad_reasons` and
:func:`value_reasons` say why). For those calls, the chunked delta rule's and KDA's two loops over the chunks (the
state's sweep forward and its adjoint's backward) run here (:data:`SWEEPS`), inside the torch forms' autograd
Functions.

The feature stage is linattn's own (:func:`linattn.features.query_features`, :func:`~linattn.features.key_features`,
:func:`~linattn.features.delta_inputs`), called on slices of BLOCK tokens: any feature map works, the maps' checks
run as on the torch backend, and no (N, F) feature tensor is ever whole (at N = 16,384 and F = 64 one would be
32 MiB of fresh pages for each of q and k).
"""

from __future__ import annotations

from typing import Any

import torch

from ... import _validate
from ...feature_maps.elementwise import EluFeatureMap
from ...feature_maps.learned import HedgehogFeatureMap
from ...features import check_feature_dims, delta_inputs, key_features, map_features, query_features
from ...kinds.delta.forms import Sweeps, _batch_rows, _state_sweep
from ...kinds.delta.forms import adjoint_sweep as _adjoint_sweep
from ...state import DeltaRuleState, LinearAttentionState
from . import module

BLOCK = 1024  # tokens of features made at a time: (8 heads, 1024, 64) fp32 is 2 MiB
WIDTHS = (1, 2, 4, 8, 16)  # Dv in 64-byte vectors the kernels are compiled for


def value_reasons(dv: int, dtype: torch.dtype) -> list[str]:
    """Why the kernels do not take values of width ``dv`` in ``dtype``; [] when they do."""
    if dtype not in (torch.float32, torch.float64):
        return [f"dtype {dtype}: the native kernels compute in fp32 or fp64"]
    lanes = 16 if dtype == torch.float32 else 8
    if dv % lanes or dv // lanes not in WIDTHS:
        return [f"value dim {dv}: the native kernels take {', '.join(str(w * lanes) for w in WIDTHS)} in {dtype}"]
    return []


def grad_reasons(*tensors: torch.Tensor | None) -> list[str]:
    """Why the call cannot run natively because it needs gradients; [] when none is needed."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return ["gradients: the native kernels compute the forward only; the torch backend runs calls that need "
                "gradients (or run under torch.no_grad() / torch.inference_mode())"]
    return []


def _rows(x: torch.Tensor) -> torch.Tensor:
    """(..., n, d) → (R, n, d), a view where the batch dims allow, the last dim contiguous."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    return x.reshape(-1, x.shape[-2], x.shape[-1])


def _kernels() -> Any:
    found = module("causal")
    assert found is not None, "checked by the capability table"
    return found


def additive(job: Any) -> tuple[torch.Tensor, LinearAttentionState]:
    """Causal linear attention of a job of an ordinary map (no decay, no packing): as
    kinds/additive/forms/recurrent.py, the state continued in place of a copy. The elu map without padding is made
    in the kernel from q and k (the default map: no feature tensor at all, as the Triton kernels do)."""
    kernels = _kernels()
    q, k, v, keep, state = job.q, job.k, job.v, job.keep, job.state
    batch, n, dv = q.shape[:-2], q.shape[-2], v.shape[-1]
    out = v.new_empty(*batch, n, dv)
    kv = k_sum = None
    elu = type(job.fmap) is EluFeatureMap and keep is None
    for start in range(0, n, BLOCK):
        end = min(n, start + BLOCK)
        if elu:
            qf, kf = q[..., start:end, :], k[..., start:end, :]
        else:
            qf = query_features(job.fmap, q[..., start:end, :], False, **job.checks())
            block_keep = keep[..., start:end] if keep is not None else None
            kf, _ = key_features(job.fmap, k[..., start:end, :], block_keep, False, True, None, **job.checks())
        if kv is None or k_sum is None:  # the first block: the map's width is known now
            check_feature_dims(qf.shape[-1], kf.shape[-1], job.fmap)
            _validate.check_state_features(state, kf.shape[-1], job.map_name)
            shape = (*batch, kf.shape[-1])
            kv = state.kv.clone() if state is not None else v.new_zeros(*shape, dv)
            k_sum = state.k_sum.clone() if state is not None else v.new_zeros(shape)
            kv, k_sum = kv.contiguous(), k_sum.contiguous()
        kernels.additive_block(_rows(qf), _rows(kf), _rows(v[..., start:end, :]), kv.view(-1, *kv.shape[-2:]),
                               k_sum.view(-1, k_sum.shape[-1]), out.view(-1, n, dv)[:, start:end],
                               job.normalize, job.eps, float("nan") if job.min_denom is None else job.min_denom, elu)
    assert kv is not None and k_sum is not None
    seen = state.num_tokens if state is not None else 0
    return out, LinearAttentionState(kv, k_sum, q.new_zeros(batch), seen + n)


def noncausal(job: Any) -> tuple[torch.Tensor, LinearAttentionState]:
    """Non-causal linear attention of a job of an ordinary map (no decay, no packing), as
    kinds/additive/forms/global.py: the keys' sums S = Σ φ(k) vᵀ and z = Σ φ(k) first (continuing a state passed
    in), then every query reads them; one block of tokens' features at a time. Nq may differ from Nk. The elu map
    without padding is made in the kernel."""
    kernels = _kernels()
    q, k, v, keep, state = job.q, job.k, job.v, job.keep, job.state
    batch, nq, nk, dv = q.shape[:-2], q.shape[-2], k.shape[-2], v.shape[-1]
    elu = type(job.fmap) is EluFeatureMap and keep is None
    kv = k_sum = None

    def start_sums(features: int) -> tuple[torch.Tensor, torch.Tensor]:
        _validate.check_state_features(state, features, job.map_name)
        return ((state.kv.clone() if state is not None else v.new_zeros(*batch, features, dv)).contiguous(),
                (state.k_sum.clone() if state is not None else v.new_zeros(*batch, features)).contiguous())

    block = max(nk, nq, 1) if elu else BLOCK  # the kernel's elu: no feature tensor, one call for all tokens
    for start in range(0, nk, block):
        end = min(nk, start + block)
        if elu:
            kf = k[..., start:end, :]
        else:  # masked keys' features are 0 (and their values, by the caller)
            block_keep = keep[..., start:end] if keep is not None else None
            kf, _ = key_features(job.fmap, k[..., start:end, :], block_keep, False, True, None, **job.checks())
        if kv is None or k_sum is None:
            kv, k_sum = start_sums(kf.shape[-1])
        kernels.noncausal_accumulate(_rows(kf), _rows(v[..., start:end, :]), kv.view(-1, *kv.shape[-2:]),
                                     k_sum.view(-1, k_sum.shape[-1]), elu)
    out = v.new_empty(*batch, nq, dv)
    for start in range(0, nq, block):
        end = min(nq, start + block)
        qf = q[..., start:end, :] if elu else query_features(job.fmap, q[..., start:end, :], False, **job.checks())
        if kv is None or k_sum is None:  # no key in this call: the state's sums (or none) alone
            kv, k_sum = start_sums(qf.shape[-1])
        if start == 0:
            check_feature_dims(qf.shape[-1], kv.shape[-2], job.fmap)
        kernels.noncausal_read(_rows(qf), kv.view(-1, *kv.shape[-2:]), k_sum.view(-1, k_sum.shape[-1]),
                               out.view(-1, nq, dv)[:, start:end], job.normalize, job.eps,
                               float("nan") if job.min_denom is None else job.min_denom, elu)
    if kv is None or k_sum is None:  # no query either
        kv, k_sum = start_sums(q.shape[-1] if elu else map_features(job.fmap, q[..., :1, :], is_query=True).shape[-1])
    seen = state.num_tokens if state is not None else 0
    return out, LinearAttentionState(kv, k_sum, q.new_zeros(batch), seen + nk)


def delta(job: Any) -> tuple[torch.Tensor, DeltaRuleState]:
    """The delta rule of a job, with its per-token log-decay (..., N) and per-feature log-gates (..., N, F) if any:
    as kinds/delta/forms.py's ``delta_recurrent`` and kinds/kda/forms.py's ``kda_recurrent``. The kernel divides
    each row by its norm as it reads it; the elu map without padding it makes itself."""
    kernels = _kernels()
    q, k, v, keep, state = job.q, job.k, job.v, job.keep, job.state
    batch, n, dv = q.shape[:-2], q.shape[-2], v.shape[-1]
    out = v.new_empty(*batch, n, dv)
    kv = None
    beta = job.beta.expand(*batch, n)
    gates = None  # fp64 log-gates (R, N, 1) or (R, N, F)
    if job.feature_gate is not None:  # KDA; a decay adds to every feature's gate
        gates = job.feature_gate.to(torch.float64)
        gates = gates + job.log_decay.unsqueeze(-1) if job.log_decay is not None else gates
    elif job.log_decay is not None:
        gates = job.log_decay.to(torch.float64).unsqueeze(-1)
    if gates is not None:
        gates = _rows(gates.expand(*batch, n, gates.shape[-1]))
    elu = type(job.fmap) is EluFeatureMap and keep is None
    for start in range(0, n, BLOCK):
        end = min(n, start + BLOCK)
        if elu:
            qf, kf, strengths = q[..., start:end, :], k[..., start:end, :], beta[..., start:end]
        else:  # masked keys write nothing (β = 0) and the kernel never reads their features: no masking pass here
            qf, kf, strengths = delta_inputs(job.fmap, q[..., start:end, :], k[..., start:end, :], None,
                                             beta[..., start:end], log_space=job.log_space,
                                             finite=job.check_finite, nonnegative=job.nonnegative, normalized=False)
            if keep is not None:
                strengths = strengths * keep[..., start:end].to(strengths.dtype)
        if kv is None:
            _validate.check_state_features(state, kf.shape[-1], job.map_name)
            if job.feature_gate is not None:
                _validate.check_gate_features(job.feature_gate, kf.shape[-1])
            kv = (state.kv.clone() if state is not None else v.new_zeros(*batch, kf.shape[-1], dv)).contiguous()
        strengths = strengths.to(v.dtype).expand(*batch, end - start).reshape(-1, end - start)
        kernels.delta_block(_rows(qf), _rows(kf), _rows(v[..., start:end, :]), strengths,
                            gates[:, start:end] if gates is not None else None, kv.view(-1, *kv.shape[-2:]),
                            out.view(-1, n, dv)[:, start:end], elu, True)
    assert kv is not None
    seen = state.num_tokens if state is not None else 0
    return out, DeltaRuleState(kv, seen + n)


def delta_carry(kf: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, log_gates: torch.Tensor | None,
                state: DeltaRuleState) -> DeltaRuleState | None:
    """The delta rule's state after M writes that nothing reads (the sparse cache's carry between two boundaries):
    kf (..., M, F) unit rows (0 where nothing is written), v (..., M, Dv), beta (..., M), log_gates (..., M, 1 | F)
    fp64 or None, from ``state``; each slot decays, then writes, as ``delta_recurrent`` steps. None where the kernels
    do not take it (no build, the dtype or value width, gradients)."""
    found = delta_stream(kf, kf, v, beta, log_gates, state)  # the kernel reads every slot; nothing keeps it
    return found[1] if found is not None else None


def delta_stream(qf: torch.Tensor, kf: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                 log_gates: torch.Tensor | None, state: DeltaRuleState) -> tuple[torch.Tensor, DeltaRuleState] | None:
    """The delta rule over M slots of a write stream from ``state`` (the sparse cache's linear part): qf (..., M, F)
    unit query rows read at each slot after its write, kf (..., M, F) unit rows (0 where nothing is written),
    v (..., M, Dv), beta (..., M), log_gates (..., M, 1 | F) fp64 or None; as ``delta_recurrent``. Returns the read-outs
    (..., M, Dv) and the state after the slots; None where the kernels do not take it (no build, the dtype or value
    width, gradients)."""
    kernels = module("causal")
    if kernels is None or value_reasons(v.shape[-1], v.dtype) or len({qf.dtype, kf.dtype, v.dtype}) > 1 \
            or grad_reasons(qf, kf, v, beta, state.kv):
        return None
    batch, m, dv = kf.shape[:-2], kf.shape[-2], v.shape[-1]
    kv = state.kv.to(v.dtype).expand(*batch, *state.kv.shape[-2:]).clone(memory_format=torch.contiguous_format)
    out = v.new_empty(*batch, m, dv)
    gates = None
    if log_gates is not None:
        gates = _rows(log_gates.to(torch.float64).expand(*batch, m, log_gates.shape[-1]))
    kernels.delta_block(_rows(qf.expand(*batch, m, qf.shape[-1])), _rows(kf), _rows(v),
                        beta.to(v.dtype).expand(*batch, m).reshape(-1, m), gates, kv.view(-1, *kv.shape[-2:]),
                        out.view(-1, m, dv), False, False)
    return out, DeltaRuleState(kv, state.num_tokens + m)


def hedgehog_features(fmap: HedgehogFeatureMap, x: torch.Tensor, is_query: bool) -> torch.Tensor | None:
    """The Hedgehog map's features of x (..., H, N, d) as ``fmap.features`` gives them: the projection z = Wx + b
    and the activation (the two softmaxes of z and −z, the keys' weight, the floor) in one C++ pass where m is a
    width the kernels take (16·2^i fp32, 8·2^i fp64), else the projection in torch and the activation in C++; None
    where the kernels do not take it (no build, a dtype other than fp32/fp64, gradients needed)."""
    kernels = module("causal")
    if kernels is None or x.dtype not in (torch.float32, torch.float64) or grad_reasons(x, *fmap.parameters()):
        return None
    floor = torch.finfo(x.dtype).tiny
    heads = fmap.num_heads or 1
    if not value_reasons(fmap.num_features, x.dtype) and x.dim() >= 3 and x.shape[-1] == fmap.head_dim \
            and (fmap.num_heads is None or x.shape[-3] == heads):
        # projection and activation in one pass: z = Wx + b of a tile of tokens never leaves the registers, and a
        # key's weight e^{clamp(u·k)} is made from its row there
        index = 0 if is_query or fmap.tied else 1
        weight_t = fmap.weight[index].to(x.dtype).transpose(-1, -2).contiguous()  # (H, d, m)
        bias = fmap.bias[index].to(x.dtype).contiguous()  # (H, m)
        gate = None if is_query else fmap.gate[0].to(x.dtype).contiguous()  # (H, d)
        return kernels.hedgehog_map(_rows(x), weight_t, bias, gate, fmap.GATE_LIMIT,
                                    floor).view(*x.shape[:-1], 2 * fmap.num_features)
    weight = None if is_query else fmap.key_weight(x).squeeze(-1).contiguous()  # e^{clamp(u·k)} (..., N)
    z = fmap.project(x, is_query=is_query, mirror=False).contiguous()  # (..., m): Wx + b; the kernel makes −z
    return kernels.hedgehog_activation(z, weight, floor)


def sparse_delta_decide(lin: torch.Tensor, values: torch.Tensor, beta: torch.Tensor, valid: torch.Tensor,
                        pos: torch.Tensor, carried: torch.Tensor, entry: torch.Tensor, log_gates: torch.Tensor | None,
                        state: DeltaRuleState, sizes: torch.Tensor, *, n0: int, end: int, window: int, sinks: int,
                        block: int, base: int, ring_start: int) -> tuple[torch.Tensor, ...] | None:
    """The sparse cache's boundaries of one call beside the delta rule, scored by the memory's recall error, in one
    C++ call (causal.cpp, ``sparse_delta_decide``; exact/forms/sparse_composed.py's ``_decide`` is the reference):
    the rows X of the call (:class:`~linattn.exact.forms.sparse_stream.Pairs`: lin (..., X, F) unit rows, values
    (..., X, Dv), beta and valid (..., X), positions (..., X)), the carried cache's positions (..., L), the entry
    times before the call's decisions (..., X), log_gates (..., N, 1 | F) fp64 per call token or None, the memory at
    the call's start and the budgets (...). Returns the caches chosen at the boundaries (..., b, L), the entry times
    after them (..., X) and the write stream's rows (..., M), gate token, read token and step token (M,); None where
    the kernels do not take it (no build, the dtype or value width)."""
    kernels = module("causal")
    if kernels is None or value_reasons(values.shape[-1], values.dtype) or lin.dtype != values.dtype:
        return None
    batch = pos.shape[:-1]

    def flat(x: torch.Tensor, tail: int) -> torch.Tensor:
        """x (..., *t) with ``tail`` trailing dims t, broadcast to the call's batch dims → (R, *t) contiguous."""
        shape = x.shape[x.dim() - tail:] if tail else ()
        return x.expand(*batch, *shape).reshape(-1, *shape).contiguous()

    entry = flat(entry, 1).clone()
    kv = flat(state.kv.to(values.dtype), 2).clone()
    gates = flat(log_gates.to(torch.float64), 2) if log_gates is not None else None
    chosen, stream, gate_at, read, step = kernels.sparse_delta_decide(
        flat(lin, 2), flat(values, 2), flat(beta.to(values.dtype), 1), flat(valid, 1), flat(pos, 1),
        flat(carried, 1), entry, gates, kv, flat(sizes, 0), n0, end, window, sinks, block, base, ring_start)
    return (chosen.view(*batch, *chosen.shape[1:]), entry.view(*batch, entry.shape[-1]),
            stream.view(*batch, stream.shape[-1]), gate_at, read, step)


def cache_exact(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, ls: torch.Tensor, rows: torch.Tensor,
                positions: torch.Tensor, *, first: int, block: int, window: int,
                scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The sparse cache's exact term of a call's query blocks in one C++ call (causal.cpp, ``cache_exact``;
    exact/forms/cache_term.py's ``CacheTerm`` is the reference): q (R, P, D) padded to whole blocks, the rows X'
    keys (R, X, D) and values (R, X, Dv), the window's row max ls (R, P), each block's cache as rows and positions
    (R, blocks, L) (−1: none), ``first`` the position of padded query 0. Returns (Σ e^{s−top} v (R, P, Dv),
    Σ e^{s−top} (R, P), top (R, P)); None where the kernels do not take it (no build, the dtype or value width,
    gradients)."""
    kernels = module("causal")
    if kernels is None or value_reasons(values.shape[-1], values.dtype) or \
            len({q.dtype, keys.dtype, values.dtype, ls.dtype}) > 1 or grad_reasons(q, keys, values, ls):
        return None
    num, den, top = kernels.cache_exact(q.contiguous(), keys.contiguous(), values.contiguous(), ls.contiguous(),
                                        rows.contiguous(), positions.contiguous(), first, block, window, scale)
    return num, den, top


def _sweepable(values: torch.Tensor, *tensors: torch.Tensor | None) -> Any:
    """The kernels, where they take a sweep over these chunked tensors (one float dtype, a value width they are
    compiled for, CPU); else None."""
    kernels = module("causal")
    present = [t for t in (values, *tensors) if t is not None]
    if kernels is None or value_reasons(values.shape[-1], values.dtype) or len({t.dtype for t in present}) > 1 \
            or any(t.device.type != "cpu" for t in present):
        return None
    return kernels


def _last_rows(last: torch.Tensor | None, rows: int, chunks: int) -> torch.Tensor | None:
    """A chunk's decay of the state, (R, nc, L, 1) with L = 1 or F → (R, nc, L) contiguous."""
    return None if last is None else last.reshape(rows, chunks, -1).contiguous()


def state_sweep(state: torch.Tensor, w_k: torch.Tensor, written: torch.Tensor, k_out: torch.Tensor,
                last: torch.Tensor | None, states: torch.Tensor) -> torch.Tensor:
    """:func:`linattn.kinds.delta.forms._state_sweep` on the kernel (the same arguments, effects and result: U over
    ``written`` in place, the entering states into ``states``, the final state returned), or that function where
    the kernels do not take the call. Used with gradients too: the chunked forms' autograd Functions call it."""
    kernels = _sweepable(written, state, w_k, k_out, last, states)
    if kernels is None or not (written.is_contiguous() and states.is_contiguous()):
        return _state_sweep(state, w_k, written, k_out, last, states)
    rows, chunks = w_k.shape[0], w_k.shape[1]
    final = state.clone(memory_format=torch.contiguous_format)
    kernels.delta_state_sweep(final, w_k.contiguous(), written, k_out.contiguous(), _last_rows(last, rows, chunks),
                              states)
    return final


def adjoint_sweep(bq: torch.Tensor, k_out: torch.Tensor, w_k: torch.Tensor, p_do: torch.Tensor, d_o: torch.Tensor,
                  last: torch.Tensor | None, d_final: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """:func:`linattn.kinds.delta.forms.adjoint_sweep` on the kernel (the same arguments and results: the adjoint of
    the state leaving each chunk, dU, the adjoint of the state entering the first chunk), or that function where the
    kernels do not take the call."""
    kernels = _sweepable(p_do, bq, k_out, w_k, d_o, last, d_final)
    if kernels is None:
        return _adjoint_sweep(bq, k_out, w_k, p_do, d_o, last, d_final)
    lead = bq.dim() - 2
    chunked = [_batch_rows(x, lead).contiguous() for x in (bq, k_out, w_k, d_o)]
    d_written = _batch_rows(p_do, lead).contiguous()  # p_do itself where it is contiguous: dU written over it
    rows, chunks, features, dv = d_written.shape[0], d_written.shape[1], w_k.shape[-1], p_do.shape[-1]
    d_state = d_final.reshape(-1, features, dv).clone(memory_format=torch.contiguous_format)
    d_leaving = p_do.new_empty(rows, chunks, features, dv)
    kernels.delta_adjoint_sweep(*chunked[:3], d_written, chunked[3], _last_rows(last, rows, chunks), d_state,
                                d_leaving)
    return (d_leaving.view(*bq.shape[:-2], features, dv), d_written.view(p_do.shape),
            d_state.view(d_final.shape))


SWEEPS = Sweeps(state_sweep, adjoint_sweep)  # the chunked delta family's loops over the chunks, in C++


def band_average(
    q: torch.Tensor, keys: tuple[torch.Tensor, torch.Tensor], values: tuple[torch.Tensor, torch.Tensor],
    scale: float, width: int, front: int, sinks: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The window's band average and log-sum-exp in one C++ call (causal.cpp, ``band_average``), with
    :func:`linattn.exact.forms.flash_band.band_average`'s arguments and results; None where the kernels do not
    take the call (a gradient needed, another device or dtype, a value width not compiled)."""
    tensors = (q, *keys, *values, *(sinks[:2] if sinks is not None else ()))
    if (module("causal") is None or any(t.device.type != "cpu" for t in tensors) or grad_reasons(*tensors)
            or value_reasons(values[1].shape[-1], q.dtype) or any(t.dtype != q.dtype for t in tensors)):
        return None
    rows, n = q.shape[0], q.shape[1]
    if sinks is None:
        sink_keys, sink_values = keys[1][:, :0], values[1][:, :0]
        mask = torch.zeros(rows, n, 0, dtype=torch.bool, device=q.device)
    else:
        sink_keys, sink_values, mask = sinks
    rows_of = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, keys[0], keys[1], values[0], values[1]))
    small = (x.contiguous() for x in (sink_keys, sink_values, mask))
    a, lse = _kernels().band_average(*rows_of, *small, width, front, scale)
    return a, lse
