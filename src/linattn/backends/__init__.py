"""Backends: which implementation runs a form. ``"torch"`` (the forms, any device) or ``"triton"`` (GPU kernels).

:func:`select_backend` is the one call ``linear_attention`` makes: it returns a function with the signature of
``functional._run_form`` (features, form, state) that runs on the chosen backend. ``"auto"`` picks triton for CUDA
tensors when it is importable and the case is covered, else torch; ``"triton"`` raises a
:class:`LinearAttentionError` listing every reason a case is not covered (as xformers' dispatch does).
Nothing here imports triton until a triton run is chosen.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import LinearAttentionError
from ..state import LinearAttentionState
from . import triton as triton_backend

BACKENDS = ("auto", "torch", "triton")
# the fused token-by-token kernel serves inference calls of at most this many tokens (decoding, short prompts);
# longer ones, and any call that needs gradients, take the chunk kernels
RECURRENT_MAX_TOKENS = 16

RunForm = Callable[..., tuple[torch.Tensor, "LinearAttentionState | None"]]


def _refuse(found: list[str]) -> LinearAttentionError:
    listed = "".join(f"\n  - {reason}" for reason in found)
    return LinearAttentionError(f"backend='triton' does not cover this call:{listed}\nuse backend='torch' or 'auto'")


def select_backend(
    backend: str,
    q: torch.Tensor,
    *,
    causal: bool,
    form: str,
    log_space: bool,
    chunk_size: int | None,
    dtype: torch.dtype,
    torch_run: RunForm,
) -> RunForm:
    """The run function for ``backend`` on this call; ``dtype`` is the caller's input dtype (q arrives in fp32)."""
    if backend not in BACKENDS:
        raise LinearAttentionError(f"backend: unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "torch" or (backend == "auto" and q.device.type != "cuda"):
        return torch_run
    found = triton_backend.reasons(
        q, causal=causal, form=form, log_space=log_space, chunk_size=chunk_size, dtype=dtype
    )
    if found:
        if backend == "triton":
            raise _refuse(found)
        return torch_run
    return _triton_run(dtype, forced=backend == "triton", torch_run=torch_run)


def _triton_run(dtype: torch.dtype, *, forced: bool, torch_run: RunForm) -> RunForm:
    def run(
        fmap: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        keep: torch.Tensor | None,
        state: LinearAttentionState | None,
        return_state: bool,
        options: dict[str, Any],
        **rest: Any,
    ) -> tuple[torch.Tensor, LinearAttentionState | None]:
        from .. import _validate
        from ..feature_maps.elementwise import EluFeatureMap
        from ..functional import _key_features, _query_features

        # arguments and options the kernels do not know (added to the core later) make a call uncovered unless None
        known = {"form", "causal", "chunk_size", "log_space", "map_name"}
        extra = {name: value for name, value in rest.items() if name not in known}
        kernel_options = {name: options[name] for name in ("normalize", "eps", "min_denom")}
        extra.update({name: value for name, value in options.items() if name not in kernel_options})
        # q, k, v arrive in the caller's dtype: elu + 1 is made in the kernels from them (no feature tensor is
        # written); any other map runs here in fp32, as on the torch backend
        if type(fmap) is EluFeatureMap and keep is None and q.dtype == dtype:
            found = triton_backend.shape_reasons(q.shape[-1], v.shape[-1], dtype, extra)
            if not found:
                _validate.check_state_features(state, q.shape[-1], rest["map_name"])
                return causal_attention(q, k.to(dtype), v.to(dtype), state=state, dtype=dtype, elu=True,
                                        **kernel_options)
        q, k, v = q.float(), k.float(), v.float()
        qf = _query_features(fmap, q, False)
        kf, _ = _key_features(fmap, k, keep, False, True, None)  # ordinary map: masked keys are zeroed
        found = triton_backend.shape_reasons(kf.shape[-1], v.shape[-1], dtype, extra)
        if found:
            if forced:
                raise _refuse(found)
            return torch_run(
                fmap, q, k, v, keep=keep, state=state, return_state=return_state, options=options, **rest
            )
        _validate.check_state_features(state, kf.shape[-1], rest["map_name"])
        return causal_attention(qf, kf, v, state=state, dtype=dtype, **kernel_options)

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
