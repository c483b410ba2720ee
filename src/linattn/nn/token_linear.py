"""The linear layers of a decoding token in a native kernel: :class:`TokenLinear`, and :func:`lean_linears` to
switch a model's ``nn.Linear`` layers to it.

A decoding token multiplies one vector by every weight matrix of the model: for SmolLM2-135M in fp32, 538 MB read
to do 0.27 GFLOP, so a token's time is the time to stream the weights. torch's BLAS call for one row
(``F.linear`` with M = 1) streams them at well under the machine's read bandwidth and gains little from a second
thread; the native kernel ``linear_token`` (decode.cpp) splits the output rows over torch's threads and reads each
row of W once against the token's inputs (``benchmarks/token_linear.py`` compares the two side by side).

:class:`TokenLinear` is ``nn.Linear`` with that one difference, and only where it applies: no gradient to record,
a CPU tensor of the weight's dtype, fp32 or fp64, at most :data:`MAX_TOKENS` rows, a contiguous weight, the native
kernels built. Everywhere else (training, a prompt's prefill, a GPU) it is ``nn.Linear`` itself. The results agree
with ``F.linear`` up to the order of the sums (a dot product of ``in_features`` terms; tests/test_token_linear.py
bounds it against float64).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..backends import native

# rows up to which the kernel runs: a decoding step of a small batch; a prompt's rows are a GEMM, BLAS's domain
MAX_TOKENS = 8
_DTYPES = (torch.float32, torch.float64)


def _kernel() -> Any:
    """The native ``linear_token``, or None where the kernels are not built (looked up at each call: it is a dict
    lookup, and a test or ``LINATTN_NATIVE`` may change it)."""
    kernels = native.module()
    return None if kernels is None else kernels.linear_token


class TokenLinear(nn.Linear):
    """``nn.Linear`` whose few-token calls without gradients run the native ``linear_token`` kernel (module
    docstring); the same parameters, state dict and results up to the order of the sums."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's argument name
        weight, bias = self.weight, self.bias
        # the checks cost about a microsecond (a token's smallest product here takes ~20): cheapest first
        if (input.numel() <= MAX_TOKENS * weight.shape[1] and input.is_cpu and input.dtype == weight.dtype
                and input.dtype in _DTYPES and input.dim() and input.shape[-1] == weight.shape[1]
                and not (torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad
                                                      or (bias is not None and bias.requires_grad)))
                and (bias is None or bias.dtype == weight.dtype) and weight.is_contiguous() and input.numel()):
            kernel = _kernel()
            if kernel is not None:
                return kernel(input, weight, bias)
        return F.linear(input, weight, bias)


def lean_linears(model: nn.Module) -> int:
    """Make every plain ``nn.Linear`` in ``model`` a :class:`TokenLinear` (in place: the same module objects,
    parameters and hooks); returns how many were switched. Subclasses (a LoRA wrapper's own layers, quantized
    layers) are left as they are."""
    switched = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = TokenLinear
            switched += 1
    return switched
