"""KDA's Triton kernels (chunks of 16, pairwise gate factors in registers) and their autograd Function, with the delta
rule's adjoint and step kernels (loaded by :mod:`linattn.backends.triton`)."""
