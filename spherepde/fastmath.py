"""Vectorisable exp kernels for numba; the code lives in spherepde.summation.fastmath."""

from .summation.fastmath import LOG2E, exp2_fast, exp2_weight, exp_fast, maxnum

__all__ = ["exp_fast", "exp2_fast", "exp2_weight", "maxnum", "LOG2E"]
