"""One folder per state kind: each holds its definition and forms, its decoding step, its capability rules, its
Triton kernels and its context-parallel pieces, as far as the kind has them.

- :mod:`.additive`: the additive state S = Σ φ(k)vᵀ, z = Σ φ(k) (plain linear attention) in every form, with the
  scalar decay folded into its causal forms; the lean decoding step; the Triton kernels.
- :mod:`.gated`: per-feature gates (GLA), S_t = diag(a_t)·S_{t−1} + φ(k_t)v_tᵀ.
- :mod:`.delta`: the delta rule and the gated delta rule (DeltaNet, Gated DeltaNet); step, Triton kernels, context
  parallelism.
- :mod:`.kda`: the delta rule with a per-feature gate (KDA), built on :mod:`.delta`'s solver and sweeps.

The exact part (the window, its sinks and the sparse cache) is the folder beside them, :mod:`linattn.exact`. A kind
builds only on kinds below it (kda on delta and gated, gated on additive): the contract in pyproject.toml holds it.
Adding an update rule is a folder here plus its registration: its rows in :mod:`linattn.capabilities` (collected
from the folder's ``rules.py``) and its runner in :mod:`linattn._dispatch` (docs/architecture.md, "Adding an update
rule").
"""
