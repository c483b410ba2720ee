"""The delta rule with a per-feature gate (KDA, Kimi Delta Attention): S_t = (I − β_t k̂_t k̂_tᵀ)·diag(a_t)·S_{t−1} +
β_t·k̂_t v_tᵀ. Forms (recurrent, chunked) on the delta rule's solver and sweeps; its decoding goes through the delta
step, its context parallelism through the delta rule's slice maps."""
