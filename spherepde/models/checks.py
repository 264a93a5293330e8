"""Model guards: the matrices and β that the kernels evaluate in floating point.

`check_model` refuses B, V or β outside the range the kernels evaluate without overflow or
underflow; every solver calls it for every head of every layer before its first step.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["check_model", "MATRIX_RANGE", "BETA_B_MAX"]

# The largest |entry| of B and of V must lie in this range (or the matrix be zero): the kernels
# multiply up to four entries (|Bᵀx|³ at β = ∞), which then stays within double precision.
MATRIX_RANGE = (1e-50, 1e50)
# β·max|B_ij| bounds the softmax exponents; beyond it they overflow.
BETA_B_MAX = 1e100


def check_model(B, V, beta):
    """Raise ValueError naming the matrix when B, V or β are outside the range the kernels
    evaluate without overflow or underflow (MATRIX_RANGE, BETA_B_MAX)."""
    low, high = MATRIX_RANGE
    scale = {}
    for name, matrix in (("B", B), ("V", V)):
        a = np.asarray(matrix, dtype=float)
        if not np.all(np.isfinite(a)):
            raise ValueError(f"{name} has non-finite entries")
        scale[name] = float(np.abs(a).max())
        if scale[name] != 0 and not low <= scale[name] <= high:
            raise ValueError(f"{name}: largest entry magnitude {scale[name]:g}, must be in [{low:g}, {high:g}] "
                             f"(or {name} = 0): the field multiplies several entries")
    beta = float(beta)
    if math.isfinite(beta) and beta * scale["B"] > BETA_B_MAX:
        raise ValueError(f"beta·max|B| = {beta * scale['B']:g}: must be <= {BETA_B_MAX:g} "
                         "(the softmax exponents overflow)")
