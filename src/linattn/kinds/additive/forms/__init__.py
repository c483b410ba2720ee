"""The additive state's forms: parallel, global, chunked (with the causal autograd Function), recurrent."""
