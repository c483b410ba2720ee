"""The additive state: S = Σ φ(k)vᵀ and z = Σ φ(k), read as φ(q)·S / φ(q)·z. Forms (parallel, global, chunked,
recurrent, and the causal chunked autograd Function), the lean decoding step, the Triton kernels."""
