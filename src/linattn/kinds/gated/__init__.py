"""Per-feature gates (GLA): S_t = diag(a_t)·S_{t−1} + φ(k_t)v_tᵀ, every feature of the sums decaying at its own
rate. Forms: parallel, chunked, recurrent (the decoding of a gated state goes through the composed step or the
recurrent form)."""
