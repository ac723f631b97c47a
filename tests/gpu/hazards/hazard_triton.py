"""A one-line Triton kernel whose `SALT` constexpr makes each value a new compiled module, so
that the block probe can time a first launch that loads a module (compiled beforehand)."""

import triton
import triton.language as tl


@triton.jit
def add_salt(x_ptr, SALT: tl.constexpr):
    tl.store(x_ptr, tl.load(x_ptr) + SALT)
