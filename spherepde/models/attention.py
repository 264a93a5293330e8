"""The attention model: matrices B (query–key), V (value), inverse temperature β, spectral data.

Convention (docs/theory.md#the-equation-and-its-conventions): attention weights e^{β⟨x, By⟩} = e^{β⟨Bᵀx, y⟩}, velocity
v(x) = P_x(V m_β(x)), M = VBᵀ. E is the principal eigenspace of M (eigenvalue of largest real
part), P_E its spectral projector (orthogonal when M is symmetric), γ the spectral gap in real
parts, F the principal eigenspace of V, Π(x) = P_E x / |P_E x|.

Normalisation (issue 20): "softmax" (the default) divides by the partition function
Z(x) = ∫ e^{β⟨x, By⟩} dρ(y); "unnormalised" does not, v(x) = P_x(V ∫ e^{β⟨x, By⟩} y dρ(y)) =
P_x(V Z(x) m_β(x)), optionally divided by e^{β‖B‖₂} (unnormalised_scale = "exp_beta": a constant
rescaling of time, which also keeps the field ≤ ‖V‖₂·(total mass) since ⟨Bᵀx, y⟩ ≤ ‖B‖₂).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import scipy.linalg

__all__ = ["AttentionModel", "SpectralData", "spectral_data", "NORMALISATIONS", "UNNORMALISED_SCALES",
           "UNSCALED_EXPONENT_MAX"]

NORMALISATIONS = ("softmax", "unnormalised")
UNNORMALISED_SCALES = ("none", "exp_beta")
# unnormalised_scale = "none": the field carries e^{β⟨Bᵀx, y⟩} ≤ e^{β‖B‖₂}, which must stay far
# below the double range (e^709.8) for unit total mass and the products of the divergence
UNSCALED_EXPONENT_MAX = 600.0


@dataclass(frozen=True)
class SpectralData:
    """Principal eigenspace of a real d×d matrix A (d ≥ 2).

    eigenvalues: all eigenvalues, sorted by decreasing real part.
    dominant: the eigenvalue(s) of largest real part; dim: their number (the dimension of the
    real invariant subspace, 2 for a complex pair). projector: the spectral projector
    Σ r_i l_iᴴ / (l_iᴴ r_i) over the dominant eigenvalues (real). basis: orthonormal basis of its
    range, shape (d, dim). gap: Re λ_dominant − the largest real part of the others (∞ if none).
    """

    eigenvalues: np.ndarray
    dominant: np.ndarray
    dim: int
    projector: np.ndarray
    basis: np.ndarray
    gap: float
    complex_pair: bool
    defective: bool


def spectral_data(A, rtol: float = 1e-10) -> SpectralData:
    A = np.asarray(A, dtype=float)
    w, vl, vr = scipy.linalg.eig(A, left=True, right=True)
    order = np.argsort(-w.real, kind="stable")
    w, vl, vr = w[order], vl[:, order], vr[:, order]
    scale = max(np.abs(w).max(), 1e-300)
    top = np.abs(w.real - w.real[0]) <= rtol * scale
    dominant = w[top]
    rest = w[~top]
    gap = float(w.real[0] - rest.real.max()) if rest.size else math.inf
    complex_pair = bool(np.any(np.abs(dominant.imag) > rtol * scale))
    P = np.zeros(A.shape, dtype=complex)
    defective = False
    for i in np.nonzero(top)[0]:
        denom = np.vdot(vl[:, i], vr[:, i])
        if abs(denom) < 1e-8:  # left and right eigenvectors orthogonal: a Jordan block
            defective = True
            continue
        P += np.outer(vr[:, i], vl[:, i].conj()) / denom
    P = P.real
    u, s, _ = np.linalg.svd(P)
    dim = int(np.sum(s > 1e-8 * max(s[0], 1e-300)))
    return SpectralData(w, dominant, dim, P, u[:, :dim], gap, complex_pair, defective)


def _as_matrix(name, value):
    """A real square d×d matrix, d ≥ 2 (d = 3 on S²; tokens on S^{d−1} take any d)."""
    try:
        arr = np.array(value, dtype=float)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a real square matrix (d×d, d >= 2)") from None
    if arr.ndim != 2 or arr.shape[0] != arr.shape[1] or arr.shape[0] < 2:
        raise ValueError(f"{name} must be a real square matrix (d×d, d >= 2), got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} has non-finite entries")
    return arr


@dataclass
class AttentionModel:
    """Single-head attention dynamics on S^{d−1}: B, V (d×d, real, the same d ≥ 2; d = 3 is S²,
    the only dimension of the mesh, the Eulerian solver and the quadrature particles; tokens take
    any d), beta > 0 or math.inf.

    normalisation: "softmax" (v = P_x(V m_β)) or "unnormalised" (v = P_x(V Z m_β), finite β
    only); unnormalised_scale: "none" or "exp_beta" (the unnormalised field divided by
    e^{β‖B‖₂}; "none" is refused when β‖B‖₂ > UNSCALED_EXPONENT_MAX, where it would overflow).
    Derived attributes: M = VBᵀ; E (SpectralData of M: P_E = E.projector, dim E = E.dim);
    F (SpectralData of V); gap γ; sigma_max = σ_max(B); assumption flags.
    """

    B: np.ndarray
    V: np.ndarray
    beta: float
    normalisation: str = "softmax"
    unnormalised_scale: str = "none"
    M: np.ndarray = field(init=False)
    E: SpectralData = field(init=False)
    F: SpectralData = field(init=False)

    def __post_init__(self):
        self.B = _as_matrix("B", self.B)
        self.V = _as_matrix("V", self.V)
        if self.V.shape != self.B.shape:
            raise ValueError(f"V must have the shape of B {self.B.shape}, got {self.V.shape}")
        try:
            beta = float(self.beta)
        except (TypeError, ValueError):
            raise ValueError(f"beta must be a positive number or inf, got {self.beta!r}") from None
        if math.isnan(beta) or beta <= 0 or beta == -math.inf:
            raise ValueError(f"beta must be a positive number or inf, got {self.beta!r}")
        self.beta = beta
        if np.linalg.matrix_rank(self.B) < self.dim and math.isinf(beta):
            # the zero-temperature field divides by |Bᵀx|, which vanishes on ker Bᵀ
            raise ValueError("beta = inf needs an invertible B (the field divides by |Bᵀx|)")
        if self.normalisation not in NORMALISATIONS:
            raise ValueError(f"normalisation must be one of {NORMALISATIONS}, got {self.normalisation!r}")
        if self.unnormalised_scale not in UNNORMALISED_SCALES:
            raise ValueError(f"unnormalised_scale must be one of {UNNORMALISED_SCALES}, "
                             f"got {self.unnormalised_scale!r}")
        if self.unnormalised:
            if math.isinf(beta):
                raise ValueError('normalisation = "unnormalised" has no beta = inf limit (the field grows '
                                 'like e^{β}): give a finite beta or normalisation = "softmax"')
            exponent = beta * float(np.linalg.norm(self.B, 2))
            if self.unnormalised_scale == "none" and exponent > UNSCALED_EXPONENT_MAX:
                raise ValueError(f'unnormalised_scale = "none" overflows: beta·‖B‖₂ = {exponent:.4g} > '
                                 f'{UNSCALED_EXPONENT_MAX:g}; use unnormalised_scale = "exp_beta"')
        self.M = self.V @ self.B.T
        self.E = spectral_data(self.M)
        self.F = spectral_data(self.V)

    # -------------------------------------------------------------- derived quantities
    @property
    def dim(self) -> int:
        """d: the tokens live on S^{d−1} ⊂ R^d."""
        return int(self.B.shape[0])

    @property
    def zero_temperature(self) -> bool:
        """β = ∞: the field is local, v(x) = P_x(Mx)/|Bᵀx|."""
        return math.isinf(self.beta)

    @property
    def unnormalised(self) -> bool:
        """normalisation = "unnormalised": no division by the partition function."""
        return self.normalisation == "unnormalised"

    @property
    def log_field_scale(self) -> float:
        """The unnormalised field is P_x(V n(x))·e^{−c}, n = ∫ e^{β⟨x, By⟩} y dρ, with this c:
        β‖B‖₂ for unnormalised_scale = "exp_beta", else 0 (and 0 for softmax)."""
        if self.unnormalised and self.unnormalised_scale == "exp_beta":
            return self.beta * float(np.linalg.norm(self.B, 2))
        return 0.0

    @property
    def gap(self) -> float:
        """Spectral gap γ of M = VBᵀ (difference of real parts)."""
        return self.E.gap

    @property
    def sigma_max(self) -> float:
        """Largest singular value of B."""
        return float(np.linalg.svd(self.B, compute_uv=False)[0])

    @property
    def m_symmetric(self) -> bool:
        """M = VBᵀ symmetric (to 1e-12): then P_E is the orthogonal projector."""
        return bool(np.allclose(self.M, self.M.T, rtol=1e-12, atol=1e-12 * np.abs(self.M).max()))

    @property
    def assumption_flags(self) -> dict:
        """Where the theory's assumptions fail (True = fails)."""
        return {
            "M_not_symmetric": not self.m_symmetric,
            "complex_dominant_pair": self.E.complex_pair,
            "defective_dominant_eigenvalue": self.E.defective,
            "no_spectral_gap": not (self.E.gap > 0),
        }

    def project_E(self, x):
        """Π(x) = P_E x / |P_E x| for points x (n, d); NaN where P_E x = 0 (x ∈ ker P_E)."""
        y = np.asarray(x, dtype=float) @ self.E.projector.T
        norm = np.linalg.norm(y, axis=-1, keepdims=True)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(norm > 0, y / norm, np.nan)

    def describe(self) -> str:
        """One line: β, the eigenvalues of VBᵀ, dim E, the gap, dim F, σ_max(B)."""
        lam = ", ".join(f"{z.real:.4g}{z.imag:+.4g}i" if abs(z.imag) > 0 else f"{z.real:.4g}"
                        for z in self.E.eigenvalues)
        unnorm = ""
        if self.unnormalised:  # softmax keeps the description it always had
            unnorm = (", unnormalised attention" + (" divided by e^{β‖B‖₂}" if self.unnormalised_scale == "exp_beta"
                                                     else ""))
        return (f"AttentionModel(beta={self.beta:g}): eig(VBᵀ) = [{lam}], dim E = {self.E.dim}, "
                f"gap = {self.gap:.4g}, dim F = {self.F.dim}, σ_max(B) = {self.sigma_max:.4g}{unnorm}")
