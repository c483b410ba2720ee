"""An independent float64 reference: the quadratic definition written directly from the math, with loops over
nothing but the formula. The library's forms are tested against this, never against each other alone."""

from __future__ import annotations

from collections.abc import Callable

import torch

Phi = Callable[[torch.Tensor], torch.Tensor]


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi: Phi,
    *,
    causal: bool = False,
    keep: torch.Tensor | None = None,
    normalize: bool = True,
    eps: float = 1e-6,
    min_denom: float | None = None,
    prefix_k: torch.Tensor | None = None,
    prefix_v: torch.Tensor | None = None,
    phi_q: Phi | None = None,
) -> torch.Tensor:
    """out_t = Σ_j w_tj v_j / (Σ_j w_tj + eps) with w_tj = φ(q_t)·φ(k_j), over allowed keys j.

    ``prefix_k/prefix_v`` are keys that come before ``k`` (what an initial state summarises): every query sees them.
    GQA: k/v heads are repeated to q's head count.
    """
    q, k, v = q.double(), k.double(), v.double()
    if q.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k = torch.repeat_interleave(k, group, dim=-3)
        v = torch.repeat_interleave(v, group, dim=-3)
    phi_q = phi_q or phi
    weights = torch.einsum("...tf,...jf->...tj", phi_q(q), phi(k))  # (..., Nq, Nk)
    allowed = torch.ones(weights.shape[-2:], dtype=torch.bool, device=weights.device)
    if causal:
        allowed = torch.tril(allowed)
    allowed = allowed.expand(weights.shape)
    if keep is not None:
        allowed = allowed & keep.unsqueeze(-2)
    weights = torch.where(allowed, weights, weights.new_zeros(()))
    num = torch.einsum("...tj,...jd->...td", weights, v)
    den = weights.sum(-1)
    if prefix_k is not None:
        assert prefix_v is not None
        prefix_weights = torch.einsum("...tf,...jf->...tj", phi_q(q), phi(prefix_k.double()))
        num = num + torch.einsum("...tj,...jd->...td", prefix_weights, prefix_v.double())
        den = den + prefix_weights.sum(-1)
    if not normalize:
        return num
    den = den + eps
    if min_denom is not None:
        den = torch.clamp(den, min=min_denom)
    # the library's documented convention: no visible weight at all (den exactly 0) gives output 0, not 0/0
    den = torch.where(den == 0, torch.ones_like(den), den)
    return num / den.unsqueeze(-1)


def elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.elu(x) + 1


def relu(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x)


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-300))


# Calls of different shapes (12 tokens against 18, one row against a batch) may take different BLAS kernels, whose
# reduction orders differ by CPU (AVX2/AVX-512, Intel/AMD), thread count and shape: their results can differ in the
# last bits, so "the same result" across shapes means agreement within a few rounding errors of the output's own
# scale. Each output here is a normalised weighted average (or a sum) over at most a few dozen terms, and a
# different summation order moves it by a few ulps of that scale. Measured: at most 0.5 ulp over every map and form
# of tests/test_feature_maps.py under ATEN_CPU_CAPABILITY=default/avx2/avx512 with 1 and 2 threads; 4 ulp leaves 8×
# margin and stays ~10^6 below the change a sequence-wide (non-causal) stabiliser causes.
SHAPE_ULPS = 4.0


def ulps_of_scale(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual − expected| in units of eps(dtype) · max |expected|: rounding errors of the output's scale."""
    actual, expected = actual.detach(), expected.detach()
    scale = torch.finfo(expected.dtype).eps * expected.abs().max().double().clamp(min=1e-300)
    return float((actual.double() - expected.double()).abs().max() / scale)


# Half precision: bf16/fp16 inputs are computed in fp32 and the output is rounded to the input dtype once, at the
# end. The least error any output in that dtype can have is that of rounding the exact (float64) result; the fp32
# computation before the rounding is ~2^-24 relative, 2^-16 of a bf16 (2^-13 of an fp16) ulp, so it changes the
# rounded value only next to a rounding tie and the error stays at that least error: measured ratio 1.000 (three
# digits) over every half-precision test. Computing in the input dtype itself (state and sums included) gives
# 2.0–2.7× (bf16) and 2.4–4700× (fp16): 1.1 separates the two with room on both sides.
HALF_ROUNDING_FACTOR = 1.1


def rounding_error(exact: torch.Tensor, dtype: torch.dtype) -> float:
    """rel_error of the exact result rounded once to ``dtype``: the yardstick of HALF_ROUNDING_FACTOR."""
    return rel_error(exact.to(dtype), exact)


def plain_dtype_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi: Phi,
    log_decay: torch.Tensor,
    *,
    feature_decay: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """The decayed recurrence of tests/decay_reference.py computed in q's own dtype, state and sums included: what
    the library would return without its fp32 accumulation (the negative control of the half-precision bounds)."""
    dtype = q.dtype
    fq, fk = phi(q), phi(k)
    g = torch.broadcast_to(log_decay.to(dtype), q.shape[:-1])
    s = q.new_zeros(*q.shape[:-2], fk.shape[-1], v.shape[-1])
    z = q.new_zeros(*q.shape[:-2], fk.shape[-1])
    outs = []
    for t in range(q.shape[-2]):
        a = torch.exp(g[..., t]).unsqueeze(-1)
        if feature_decay is not None:
            a = a * torch.exp(feature_decay[..., t, :].to(dtype))
        s = a[..., None] * s + fk[..., t, :, None] * v[..., t, None, :]
        z = a * z + fk[..., t, :]
        num = torch.einsum("...f,...fd->...d", fq[..., t, :], s)
        den = (fq[..., t, :] * z).sum(-1) + eps
        outs.append(num / den.unsqueeze(-1))
    return torch.stack(outs, dim=-2)
