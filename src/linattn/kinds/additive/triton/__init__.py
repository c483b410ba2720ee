"""The additive state's Triton kernels and their autograd Function (loaded by :mod:`linattn.backends.triton`)."""
