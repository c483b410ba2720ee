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

**Weights that are blocks of integer codes.** A model read from a GGUF file of the Q4_1 or Q8_0 kind (SmolLM2's
shipped file) has fp32 weights that are exactly w = d·q + m per block of 32 along a row: q a 4-bit code with a scale
d and an offset m (Q4_1), or an 8-bit signed code with a scale alone (Q8_0), d and m fp16 values. :func:`block_weights`
finds those codes where every block of a matrix is such a block (and returns None otherwise), and a
:class:`TokenLinear` that holds them streams 4.5 or 8.5 bits a weight instead of 32 (``linear_token_blocks``): the
same weights, formed in fp32 as the model's copy has them, so the results differ from the fp32 kernel's by the
order of the sums alone. For SmolLM2-135M a token reads 111 MB instead of 538. The fp32 weights stay (a prompt's
rows are BLAS's); a weight changed in place or replaced after the codes were found turns them off.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..backends import native

# rows up to which the kernel runs: a decoding step of a small batch; a prompt's rows are a GEMM, BLAS's domain
MAX_TOKENS = 8
_DTYPES = (torch.float32, torch.float64)
BLOCK = 32  # weights per block along a row in GGUF's Q4_1 and Q8_0
# the block kinds block_weights looks for: (lowest code, highest code, with an offset m)
_KINDS = ((0, 15, True), (-127, 127, False))
_FP16_STEPS = (0, 1, -1, 2, -2)  # the scales tried, in fp16 steps from the nearest fp16 to span / highest code


class BlockWeights:
    """A weight matrix (out, in) as blocks of :data:`BLOCK` along its rows, w = d·q + m for every weight (module
    docstring): ``codes`` (uint8 (out, in/2), two 4-bit codes a byte in the words the kernel reads
    (:func:`_pack_nibbles`), when ``nibbles``; else int8 (out, in/32, 32)), ``scales`` d and ``mins`` m
    (out, in/32) fp32 (``mins`` None: m = 0),
    and (weakly) the weight they were found in, with its version."""

    __slots__ = ("codes", "scales", "mins", "nibbles", "_source", "_version")

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, nibbles: bool,
                 weight: torch.Tensor) -> None:
        self.codes, self.scales, self.mins, self.nibbles = codes, scales, mins, nibbles
        # the weight itself, weakly (not its address, which a new tensor may take once the weight is freed)
        self._source: Callable[[], torch.Tensor | None] = weakref.ref(weight)
        self._version = weight._version

    def current(self, weight: torch.Tensor) -> bool:
        """Whether ``weight`` is still the tensor these codes were found in, unchanged."""
        return self._source() is weight and weight._version == self._version

    def __getstate__(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, bool]:
        return self.codes, self.scales, self.mins, self.nibbles  # a copy belongs to no weight: never current

    def __setstate__(self, state: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, bool]) -> None:
        self.codes, self.scales, self.mins, self.nibbles = state
        self._source, self._version = (lambda: None), -1

    @property
    def nbytes(self) -> int:
        """The bytes a token reads: codes, scales and offsets."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.mins) if t is not None)

    def weight(self) -> torch.Tensor:
        """The fp32 weights (out, in) the codes stand for (for a check; the kernel forms them block by block)."""
        codes = _unpack_nibbles(self.codes, self.scales.shape[1]) if self.nibbles else self.codes
        w = self.scales.unsqueeze(-1) * codes.to(torch.float32)
        if self.mins is not None:
            w = w + self.mins.unsqueeze(-1)
        return w.reshape(codes.shape[0], -1)


def block_weights(weight: torch.Tensor) -> BlockWeights | None:
    """The codes of ``weight`` (out, in) fp32 where every block of 32 along its rows is exactly d·q + m with q in
    0…15 (Q4_1) or d·q with q in −127…127 (Q8_0), d and m fp16 values; None where some block is not (any weight a
    model learnt or was given in fp32) or the weight is not a contiguous fp32 CPU matrix with rows of whole blocks.
    The offset m of a Q4_1 block is its least weight (code 0) and d is within two fp16 steps of its span / 15; a
    Q8_0 block's d likewise of its largest magnitude / 127; a candidate counts where it rebuilds the block's
    weights exactly."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu" or not weight.numel() \
            or weight.shape[1] % BLOCK or not weight.is_contiguous():
        return None
    with torch.no_grad():
        w = weight.detach()
        for low, high, offset in _KINDS:
            # a few rows first: a matrix that is not of this kind fails there, without a pass over all of it
            if _codes(w[:8], low, high, offset) is None:
                continue
            found = _codes(w, low, high, offset)
            if found is None:
                continue
            codes, scales, mins = found
            if offset:
                return BlockWeights(_pack_nibbles(codes), scales, mins, True, weight)
            return BlockWeights(codes.to(torch.int8).contiguous(), scales, None, False, weight)
    return None


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (rows, blocks, 32) as the kernel reads them (decode.cpp): per group of two blocks (64 weights)
    eight 32-bit words, word i holding the code of weight 8k + i of the group in its bits 4k…4k+3; an odd last
    block as eight 16-bit words (k < 4). uint8 (rows, blocks · 16), the words in the machine's byte order."""
    rows, blocks = codes.shape[:2]
    flat = codes.reshape(rows, -1).to(torch.int64)
    whole = blocks // 2
    parts = []
    if whole:
        groups = flat[:, : whole * 64].reshape(rows, whole, 8, 8)  # (group, k, i)
        shifts = (4 * torch.arange(8)).reshape(1, 1, 8, 1)
        words = (groups << shifts).sum(2)  # (rows, whole, 8) in 0 … 2^32 − 1: disjoint bits, the sum an OR
        parts.append(words.to(torch.uint32).view(torch.uint8).reshape(rows, -1))
    if blocks % 2:
        tail = flat[:, whole * 64 :].reshape(rows, 4, 8)
        words = (tail << (4 * torch.arange(4)).reshape(1, 4, 1)).sum(1)
        parts.append(words.to(torch.uint16).view(torch.uint8).reshape(rows, -1))
    return torch.cat(parts, dim=1).contiguous()


def _unpack_nibbles(packed: torch.Tensor, blocks: int) -> torch.Tensor:
    """:func:`_pack_nibbles` undone: the codes (rows, blocks, 32), uint8."""
    rows, whole = packed.shape[0], blocks // 2
    parts = []
    if whole:
        words = packed[:, : whole * 32].contiguous().view(torch.uint32).to(torch.int64).reshape(rows, whole, 1, 8)
        shifts = (4 * torch.arange(8)).reshape(1, 1, 8, 1)
        parts.append(((words >> shifts) & 15).reshape(rows, -1))  # (group, k, i) → weight 64g + 8k + i
    if blocks % 2:
        words = packed[:, whole * 32 :].contiguous().view(torch.uint16).to(torch.int64).reshape(rows, 1, 8)
        parts.append(((words >> (4 * torch.arange(4)).reshape(1, 4, 1)) & 15).reshape(rows, -1))
    return torch.cat(parts, dim=1).reshape(rows, blocks, BLOCK).to(torch.uint8)


def _codes(w: torch.Tensor, low: int, high: int, offset: bool
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """(codes uint8 or int16 (rows, blocks, 32), scales (rows, blocks), offsets or None) that rebuild every weight of
    w exactly as d·q + m in fp32, or None."""
    blocks = w.reshape(w.shape[0], -1, BLOCK)
    if offset:
        mins, most = torch.aminmax(blocks, dim=-1)
        span = most - mins
    else:
        mins, span = None, blocks.abs().amax(-1)
    nearest = (span / high).to(torch.float16)
    if not bool(torch.isfinite(nearest).all()):
        return None
    bits = nearest.view(torch.int16).to(torch.int32)  # span ≥ 0: the next fp16 up is the next bit pattern
    base = blocks - mins.unsqueeze(-1) if mins is not None else blocks
    codes: torch.Tensor | None = None
    scales = span
    done = torch.zeros(span.shape, dtype=torch.bool)
    for step in _FP16_STEPS:
        scale = (bits + step).clamp(0, 0x7BFF).to(torch.int16).view(torch.float16).to(torch.float32)
        q = (base / scale.unsqueeze(-1)).nan_to_num_(0.0).round_().clamp_(low, high)  # a 0 scale: 0/0 → code 0
        rebuilt = scale.unsqueeze(-1) * q  # exact: an fp16 scale times a code of at most 8 bits
        if mins is not None:
            rebuilt += mins.unsqueeze(-1)
        fits = (rebuilt == blocks).all(-1)
        if codes is None:  # the nearest fp16 scale: every block of SmolLM2's matrices
            codes, scales = q, scale
        else:
            new = fits & ~done
            codes = torch.where(new.unsqueeze(-1), q, codes)
            scales = torch.where(new, scale, scales)
        done |= fits
        if bool(done.all()):
            return codes.to(torch.uint8 if low >= 0 else torch.int16), scales, mins
    return None


class TokenLinear(nn.Linear):
    """``nn.Linear`` whose few-token calls without gradients run the native ``linear_token`` kernel (module
    docstring); the same parameters, state dict and results up to the order of the sums."""

    blocks: BlockWeights | None = None  # the weight's codes where it is blocks of them (module docstring)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's argument name
        weight, bias = self.weight, self.bias
        # the checks cost about a microsecond (a token's smallest product here takes ~20): cheapest first
        if (input.numel() <= MAX_TOKENS * weight.shape[1] and input.is_cpu and input.dtype == weight.dtype
                and input.dtype in _DTYPES and input.dim() and input.shape[-1] == weight.shape[1]
                and not (torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad
                                                      or (bias is not None and bias.requires_grad)))
                and (bias is None or bias.dtype == weight.dtype) and weight.is_contiguous() and input.numel()):
            kernels = native.module()
            if kernels is not None:
                blocks = self.blocks
                if blocks is not None and blocks.current(weight):  # fp32, as block_weights found them
                    return kernels.linear_token_blocks(input, blocks.codes, blocks.scales, blocks.mins, bias,
                                                       blocks.nibbles)
                return kernels.linear_token(input, weight, bias)
        return F.linear(input, weight, bias)


def lean_linears(model: nn.Module, blocks: bool = True) -> int:
    """Make every plain ``nn.Linear`` in ``model`` a :class:`TokenLinear` (in place: the same module objects,
    parameters and hooks); returns how many were switched. Subclasses (a LoRA wrapper's own layers, quantized
    layers) are left as they are. ``blocks``: each switched layer also takes its weight's codes where the weight
    is blocks of them (:func:`block_weights`; a GGUF model's Q4_1 and Q8_0 matrices), which its decoding tokens
    then read instead of the fp32 weights."""
    switched = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = TokenLinear
            switched += 1
        if blocks and type(module) is TokenLinear and module.blocks is None:
            module.blocks = block_weights(module.weight)
    return switched
