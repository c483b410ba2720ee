"""Context parallelism on torch.distributed: one sequence split across processes, exact, with gradients.

Each rank holds a contiguous slice of the sequence. A call all-gathers one fixed-size summary per slice
(world × B·H·(F·Dv + F + 1) numbers, independent of N), combines those before it (causal) or all others
(non-causal) into an initial state, and runs its slice through :func:`linattn.linear_attention`. Backward is
exact and costs one reduce-scatter. See docs/distributed.md.

>>> import linattn.distributed as cp
>>> # out = cp.context_parallel_attention(q_part, k_part, v_part, causal=True)        # functional
>>> # layer = cp.ContextParallel(linattn.nn.LinearAttention(256, 8, causal=True))     # a layer
"""

from __future__ import annotations

from .attention import combine_others, combine_prefix, context_parallel_attention
from .layer import ContextParallel

__all__ = ["ContextParallel", "combine_others", "combine_prefix", "context_parallel_attention"]
