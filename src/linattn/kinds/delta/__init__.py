"""The delta rule and the gated delta rule (DeltaNet, Gated DeltaNet): S_t = a_t·S_{t−1} + β_t·k̂_t(v_t −
a_t·S_{t−1}ᵀk̂_t)ᵀ. Forms (recurrent, chunked), the decoding step, the Triton kernels, the affine slice maps of
context parallelism."""
