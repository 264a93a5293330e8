"""Exact solutions used by the tests and the validation suite (docs/theory.md#formulas-and-exact-solutions)."""

from __future__ import annotations

import math

import numpy as np
import scipy.linalg
from scipy.special import spherical_in

__all__ = ["langevin", "vmf_softmax_mean", "zero_temperature_density", "linear_pushforward_density",
           "linear_growth_rate"]


def langevin(k):
    """A₃(k) = coth k − 1/k (mean resultant length of a vMF law on S²), stable near 0."""
    k = np.asarray(k, dtype=float)
    small = k < 1e-3
    ks = np.where(small, 1.0, k)
    return np.where(small, k / 3.0 - k**3 / 45.0, 1.0 / np.tanh(ks) - 1.0 / ks)


def vmf_softmax_mean(model, mu, kappa, x):
    """m_β(x) for the vMF density ∝ e^{κ⟨μ,y⟩}: A₃(|w|) w/|w|, w = βBᵀx + κμ."""
    w = model.beta * np.asarray(x) @ model.B + kappa * np.asarray(mu)
    nw = np.linalg.norm(w, axis=1, keepdims=True)
    return langevin(nw) * w / np.where(nw > 0, nw, 1.0)


def zero_temperature_density(model, law, t):
    """β = ∞ density at time t: push-forward of law by x ↦ Ax/|Ax|, A = e^{tM}.

    f_t(y) = f₀(A⁻¹y/|A⁻¹y|) |det A|⁻¹ |A⁻¹y|⁻³. Valid when |Bᵀx| = 1 on S² (B orthogonal),
    where the clock s of the trajectories equals t.
    """
    if not np.allclose(model.B @ model.B.T, np.eye(3), atol=1e-12):
        raise ValueError("the closed form needs an orthogonal B (then s = t)")
    A_inv = scipy.linalg.expm(-t * model.M)
    det_inv = math.exp(-t * np.trace(model.M))  # det A⁻¹ = e^{−t tr M}
    return _pushforward(law, A_inv, det_inv)


def linear_pushforward_density(law, A):
    """The density of the push-forward of law by x ↦ Ax/|Ax| (A invertible 3×3):
    f(y) = f₀(A⁻¹y/|A⁻¹y|) |det A|⁻¹ |A⁻¹y|⁻³. With A a product of e^{τ_k M_k} it is the exact
    β = ∞ solution of layers of local linear fields (spherepde.models.heads), composed."""
    A = np.asarray(A, dtype=float)
    return _pushforward(law, np.linalg.inv(A), 1.0 / abs(np.linalg.det(A)))


def _pushforward(law, A_inv, det_inv):
    def density(y):
        z = np.asarray(y) @ A_inv.T
        nz = np.linalg.norm(z, axis=1)
        return law.density(z / nz[:, None]) * det_inv / nz**3

    return density


def linear_growth_rate(beta, ell):
    """Growth rate of a degree-ℓ perturbation of the uniform state for V = B = I:
    ℓ(ℓ+1) i_ℓ(β) / (β i₀(β)), with i_ℓ the modified spherical Bessel functions."""
    return ell * (ell + 1) * spherical_in(ell, beta) / (beta * spherical_in(0, beta))
