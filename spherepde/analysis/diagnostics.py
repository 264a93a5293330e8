"""Diagnostics of the theory for any weighted measure on S² (Eulerian cells or particles).

A measure is given as points x_i (n, 3) on the unit sphere and weights w_i ≥ 0; every quantity
below is normalised by the total weight, so it applies to probability measures. Distances are
chordal (Euclidean in R³), the metric of the W₂ bounds of the theory. Tokens on S^{d−1}, d ≠ 3
(points (n, d)): the alignments, V_p and the exact two-atom W₂ hold as written; the binned W₂
(dim E > 1) needs HEALPix bins and is NaN there.

- alignment with E: ∫ |Q_E x|² dρ, Q_E the ORTHOGONAL projector onto the principal eigenspace E
  of M = VBᵀ (equal to the spectral projector P_E when M is symmetric). In [0, 1], and 1 exactly
  when ρ lives on E. Alignment with F: the same with the principal eigenspace F of V.
- Π#ρ₀, Π(x) = P_E x/|P_E x| (P_E spectral): when dim E = 1 two atoms ±e with masses
  p± = ρ₀{±⟨P_E x, e⟩ > 0} (mass on ker P_E split evenly).
- W₂(ρ, Π#ρ₀): for two antipodal atoms the optimal plan is a threshold problem, solved exactly:
  |x − e|² − |x + e|² = −4⟨x, e⟩, so the mass p₊ with the largest ⟨x, e⟩ goes to +e. When
  dim E > 1, both measures are binned on a coarse HEALPix grid (bin barycentres, w2_nside) and the
  discrete problem is solved exactly with POT (ot.emd2); binning moves mass by at most a bin
  diameter, which bounds the error. With two atoms the part of W₂² paid by the mass that has
  crossed E⊥ (at least 2 per unit of mass) is recorded apart (`w2_across_E_perp`): a W₂ of 0.04
  needs only 4e-4 of it.
- Lyapunov functional V_p(ρ) = ∫ (|(I − P_E)x|² / |P_E x|²)^p dρ (P_E spectral; +∞ if ρ charges
  ker P_E). Finite for p < ½ when dim E = 1 and the density is positive near E⊥. For a point
  measure it is the weighted sum; for a cell-average density use lyapunov_cell_averages, which
  integrates the singular integrand over each cell (a plain cell rule converges like √h only).
- Theory curves (functions of t): √(2V_p(ρ₀)) e^{−pγt/σ_max(B)} (β = ∞ bound on W₂(ρ_t, Π#ρ₀));
  2√(log(β+1)/β)(e^{C₁t} − e^{C₀t}) (bound on W₂(ρ_t^β, ρ_t^∞), only with C₁ given);
  the time scale log β.

Models for which the theory does not define E, F or Π (several heads at finite β,
spherepde.models.heads.theory_objects): MeasureDiagnostics(None, ...) gives NaN for every quantity that
needs E (alignment with E, W₂ to Π#ρ₀, V_p and the W₂ bound), has_F=False NaN for the alignment
with F: no number is printed that the theory does not define.
"""

from __future__ import annotations

import math

import numpy as np

from ..storage.schema import DIAGNOSTIC_META

__all__ = ["alignment", "projection_atoms", "w2_to_two_atoms", "w2_parts_two_atoms", "w2_binned", "lyapunov",
           "lyapunov_integrand", "lyapunov_cell_averages", "MeasureDiagnostics",
           "theory_curves"]

def _normalised(weights):
    w = np.asarray(weights, dtype=float)
    total = w.sum()
    if not (total > 0 and np.isfinite(total)):
        raise ValueError("the measure has no positive finite mass")
    return w / total


def alignment(points, weights, basis) -> float:
    """Alignment of a measure with a subspace: ∫ |Qᵀx|² dρ (ρ normalised), dimensionless.

    Args:
        points: (n, 3) unit vectors x_i.
        weights: (n,) weights w_i ≥ 0 (normalised here).
        basis: (3, dim) orthonormal basis Q of the subspace (e.g. `model.E.basis`, `model.F.basis`).

    Returns:
        A number in [0, 1]: 1 exactly when ρ lives on the subspace; 1/3 per dimension for the
        uniform law.
    """
    w = _normalised(weights)
    coords = np.asarray(points) @ np.asarray(basis)
    return float(w @ np.sum(coords * coords, axis=1))


def projection_atoms(model, points0, weights0):
    """Π#ρ₀ for dim E = 1: atoms (2, 3) = (e, −e) and their masses (p₊, p₋)."""
    if model.E.dim != 1:
        raise ValueError("Π#ρ₀ is two atoms only when dim E = 1")
    w = _normalised(weights0)
    e = model.E.basis[:, 0]
    c = np.asarray(points0) @ (model.E.projector.T @ e)  # ⟨P_E x, e⟩
    p_plus = float(w[c > 0].sum() + 0.5 * w[c == 0].sum())
    return np.array([e, -e]), np.array([p_plus, 1.0 - p_plus])


def w2_to_two_atoms(points, weights, e, p_plus) -> float:
    """Exact W₂ (chordal distance) between ρ and p₊δ_e + (1 − p₊)δ_{−e}, ρ normalised.

    The optimal plan is monotone in ⟨x, e⟩ (|x − e|² − |x + e|² = −4⟨x, e⟩): it fills +e with the
    mass p₊ of largest ⟨x, e⟩. This is W₂(ρ_t, Π#ρ₀) when dim E = 1 (`projection_atoms`).

    Args:
        points: (n, 3) unit vectors.
        weights: (n,) weights ≥ 0.
        e: the unit vector of the atom +e.
        p_plus: its mass p₊, in [0, 1].

    Returns:
        W₂ in [0, 2] (dimensionless: unit sphere).
    """
    return w2_parts_two_atoms(points, weights, e, p_plus)[0]


def w2_parts_two_atoms(points, weights, e, p_plus) -> tuple[float, float]:
    """(W₂, W₂ across) for the plan of `w2_to_two_atoms`: W₂ across = √(the part of W₂² paid by the
    mass sent to the atom on the other side of the hyperplane ⟨x, e⟩ = 0). That mass is the net mass
    ρ has moved across the hyperplane since Π#ρ₀'s law (|ρ{⟨x, e⟩ > 0} − p₊|), and each unit of it
    costs 2 + 2|⟨x, e⟩| ≥ 2: 1e-4 of it alone gives W₂ ≥ 0.014, whatever the transport within
    each side (W₂ within = √(W₂² − W₂ across²))."""
    w = _normalised(weights)
    s = np.asarray(points) @ np.asarray(e)
    order = np.argsort(-s, kind="stable")
    s, w = s[order], w[order]
    cum = np.cumsum(w)
    # mass of each point sent to +e: all of it before the threshold, a fraction at it, none after
    to_plus = np.clip(p_plus - (cum - w), 0.0, w)
    sq = np.sum(np.asarray(points)[order] ** 2, axis=1)  # |x|² (1 on the sphere)
    to_e, to_minus_e = to_plus * (sq - 2 * s + 1), (w - to_plus) * (sq + 2 * s + 1)
    cost = to_e.sum() + to_minus_e.sum()
    across = to_e[s < 0].sum() + to_minus_e[s > 0].sum()
    return math.sqrt(max(float(cost), 0.0)), math.sqrt(max(float(across), 0.0))


def _bin(points, weights, nside):
    import healpy as hp

    pts = np.asarray(points, dtype=float)
    pix = hp.vec2pix(nside, pts[:, 0], pts[:, 1], pts[:, 2], nest=True)
    npix = 12 * nside * nside
    mass = np.bincount(pix, weights=weights, minlength=npix)
    centre = np.stack([np.bincount(pix, weights=weights * pts[:, k], minlength=npix) for k in range(3)], axis=1)
    keep = mass > 0
    return centre[keep] / mass[keep, None], mass[keep]


def w2_binned(points, weights, target_points, target_weights, nside=8) -> float:
    """W₂ (chordal) between two weighted point measures, after binning both on HEALPix(nside).

    Each measure becomes its bins' masses at their barycentres, and the discrete problem is
    solved exactly (POT's `ot.emd2`). Binning moves mass by at most a bin diameter, so the error
    is at most 2 × the largest bin diameter (≈ 2·1.2/nside). Cost O(bins²): keep nside small.

    Args:
        points: the first measure's points, (n, 3) unit vectors.
        weights: its weights, (n,), ≥ 0.
        target_points: the second measure's points, (m, 3).
        target_weights: its weights, (m,).
        nside: HEALPix level of the bins (power of two).

    Returns:
        W₂ of the two normalised binned measures.
    """
    import ot

    x, a = _bin(points, _normalised(weights), nside)
    y, b = _bin(target_points, _normalised(target_weights), nside)
    cost = np.sum(x * x, axis=1)[:, None] + np.sum(y * y, axis=1)[None, :] - 2 * x @ y.T
    np.maximum(cost, 0.0, out=cost)
    value = ot.emd2(a / a.sum(), b / b.sum(), cost, numItermax=10_000_000)
    return math.sqrt(max(float(value), 0.0))


def lyapunov(model, points, weights, p) -> float:
    """The Lyapunov functional V_p(ρ) = ∫ (|(I − P_E)x|² / |P_E x|²)^p dρ of a point measure.

    Args:
        model: an AttentionModel (its spectral projector P_E = `model.E.projector`).
        points: (n, 3) unit vectors.
        weights: (n,) weights ≥ 0 (normalised here).
        p: the exponent, in (0, 1].

    Returns:
        V_p(ρ) ≥ 0, 0 exactly when ρ lives on E; +∞ if ρ charges ker P_E. For a cell-average
        density use `lyapunov_cell_averages`, which integrates the singular integrand per cell.
    """
    w = _normalised(weights)
    x = np.asarray(points, dtype=float)
    pe = x @ model.E.projector.T
    num = np.sum((x - pe) ** 2, axis=1)
    den = np.sum(pe * pe, axis=1)
    charged = w > 0
    if np.any(den[charged] == 0):
        return math.inf
    ratio = np.zeros_like(num)
    ratio[charged] = num[charged] / den[charged]
    return float(w @ ratio**p)


class MeasureDiagnostics:
    """The per-snapshot diagnostics of a model, relative to the initial measure ρ₀.

    points0, weights0: ρ₀. p: Lyapunov exponent. w2_nside: bin level of the discrete OT used when
    dim E > 1 (and when Π#ρ₀ is not two atoms). model None: E and Π not defined (NaN for every
    quantity that needs them); has_F False: F not defined (alignment with F NaN).
    """

    def __init__(self, model, points0, weights0, p: float = 0.25, w2_nside: int = 8, lyapunov0=None,
                 has_F: bool = True):
        self.model = model
        self.has_F = bool(has_F) and model is not None
        self.p = float(p)
        self.w2_nside = int(w2_nside)
        if model is None:
            self.lyapunov0 = math.nan
            self.atoms = self.atom_masses = self._target = None
            return
        self.lyapunov0 = lyapunov(model, points0, weights0, self.p) if lyapunov0 is None else float(lyapunov0)
        if model.E.dim == 1:
            self.atoms, self.atom_masses = projection_atoms(model, points0, weights0)
            self._target = None
        elif model.dim != 3:  # the binned OT needs HEALPix bins: S² only
            self.atoms = self.atom_masses = None
            self._target = "not defined"
        else:
            self.atoms = self.atom_masses = None
            proj = model.project_E(points0)
            ok = np.all(np.isfinite(proj), axis=1)
            self._target = (proj[ok], np.asarray(weights0, dtype=float)[ok])

    @property
    def w2_method(self) -> str:
        if self.model is None:
            return "not defined (E and Π are not defined for this model)"
        if self._target is None:
            return "exact (two atoms: threshold plan)"
        if isinstance(self._target, str):
            return "not defined (dim E > 1 off S²: the binned OT needs the HEALPix bins of S²)"
        return f"discrete OT (POT emd) on HEALPix nside {self.w2_nside} bins"

    def __call__(self, points, weights, lyapunov_value=None) -> dict:
        """The diagnostics of ρ = Σ w_i δ_{x_i} (points (n, 3), weights (n,)).

        lyapunov_value: V_p(ρ) computed by a better rule than the point sum (e.g.
        lyapunov_cell_averages for a cell density). Returns {"alignment_E", "alignment_F",
        "w2_to_projection" (W₂(ρ, Π#ρ₀)), "w2_across_E_perp" (its part paid by mass that crossed
        E⊥, dim E = 1: w2_parts_two_atoms), "lyapunov" (V_p(ρ))}, NaN where the model does not
        define them."""
        m = self.model
        if m is None:
            return {name: math.nan for name in DIAGNOSTIC_META}
        across = math.nan  # the split is defined for two antipodal atoms only
        if self._target is None:
            w2, across = w2_parts_two_atoms(points, weights, self.atoms[0], self.atom_masses[0])
        elif isinstance(self._target, str):
            w2 = math.nan
        else:
            w2 = w2_binned(points, weights, *self._target, nside=self.w2_nside)
        return {
            "alignment_E": alignment(points, weights, m.E.basis),
            "alignment_F": alignment(points, weights, m.F.basis) if self.has_F else math.nan,
            "w2_to_projection": w2,
            "w2_across_E_perp": across,
            "lyapunov": (lyapunov(m, points, weights, self.p) if lyapunov_value is None
                         else float(lyapunov_value)),
        }

    def theory_curves(self, times, C0=None, C1=None) -> dict:
        """name → (values over times, long_name); the W₂(ρ^β, ρ^∞) bound only with C₁ given."""
        return theory_curves(self.model, self.p, self.lyapunov0, times, C0, C1)


def theory_curves(model, p, lyapunov0, times, C0=None, C1=None) -> dict:
    """The theory's bounds as functions of time, for a model and its initial measure.

    - `w2_bound_zero_temperature`: √(2V_p(ρ₀)) e^{−pγt/σ_max(B)}, the bound on W₂(ρ_t, Π#ρ₀)
      that the theory states at β = ∞;
    - `w2_bound_finite_beta`: 2√(log(β+1)/β)(e^{C₁t} − e^{C₀t}), the bound on W₂(ρ_t^β, ρ_t^∞),
      only with C₀ and C₁ given, at finite β.

    Args:
        model: an AttentionModel (None: E not defined, the curves are NaN).
        p: the Lyapunov exponent.
        lyapunov0: V_p(ρ₀).
        times: times t after ρ₀ (array-like).
        C0: the constant C₀ of the finite-β bound (the theory does not publish it).
        C1: the constant C₁ of the finite-β bound.

    Returns:
        name → (values over times, long_name).
    """
    t = np.asarray(times, dtype=float)
    m = model
    zero_bound = "√(2V_p(ρ₀)) exp(−pγt/σ_max(B)): bound on W₂(ρ_t, Π#ρ₀) at β = ∞"
    if m is None:
        return {"w2_bound_zero_temperature": (np.full(t.shape, math.nan), zero_bound)}
    rate = p * m.gap / m.sigma_max
    with np.errstate(invalid="ignore", over="ignore"):
        decay = np.where(t > 0, np.exp(-rate * t), 1.0)
    curves = {"w2_bound_zero_temperature": (math.sqrt(2 * lyapunov0) * decay, zero_bound)}
    if C1 is not None and C0 is not None and not m.zero_temperature:
        beta = m.beta
        curves["w2_bound_finite_beta"] = (
            2 * math.sqrt(math.log(beta + 1) / beta) * (np.exp(C1 * t) - np.exp(C0 * t)),
            "2√(log(β+1)/β)(e^{C₁t} − e^{C₀t}): bound on W₂(ρ_t^β, ρ_t^∞)")
    return curves


def lyapunov_integrand(model, p):
    """g(x) = (|(I − P_E)x|² / |P_E x|²)^p as a function of points (..., 3) (+∞ on ker P_E)."""
    P = model.E.projector

    def g(x):
        pe = x @ P.T
        num = np.sum((x - pe) ** 2, axis=-1)
        den = np.sum(pe * pe, axis=-1)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(den > 0, (num / np.where(den > 0, den, 1.0)) ** p, np.inf)

    return g


def lyapunov_cell_averages(mesh, model, p, order=4, h_min=1e-3, chunk=100_000):
    """Cell averages G_c = (1/A)∫_cell g dA of the Lyapunov integrand, so that for a cell-average
    density V_p(ρ_h) = Σ_c f_c A G_c / Σ_c f_c A up to quadrature error.

    g is singular (∝ dist(x, ker P_E)^{−2p}) on ker P_E ∩ S², where a fixed rule converges like
    √h only. Sub-squares within two square sizes of that set are split in four, recursively,
    down to an angular size h_min (radians); every other square gets the exact-area rule of
    `order` (even: an odd rule puts points exactly on symmetry planes, where g is infinite).
    The error of the band left at the finest level is ∝ h^q, q = codim − 2p (codim 1 for the
    great circle ker P_E ∩ S² when dim E = 1, 2 for the two points when dim E = 2), so the result
    is extrapolated from stopping at 4 h_min and at h_min: G = (4^q G(h_min) − G(4h_min))/(4^q − 1)
    (measured, uniform law, p = ¼: relative error 5e-3 → 4e-7). If q ≤ 0 the integral diverges
    and the cells touching the singular set get +∞.
    """
    g = lyapunov_integrand(model, p)
    fine = np.zeros(mesh.npix)
    coarse = np.zeros(mesh.npix)
    if model.E.dim == 3:
        return fine
    # orthonormal basis of (ker P_E)^⊥: dist(x, ker P_E) = |Qᵀx|
    _, sing, vt = np.linalg.svd(model.E.projector)
    Q = vt[sing > 1e-12 * sing[0]].T
    cells, a0, b0, size = mesh.cell_ids, np.zeros(mesh.npix), np.zeros(mesh.npix), 1.0
    cell_width = math.sqrt(mesh.area)
    coarse_active = True  # the coarse estimate still collects
    while cells.size:
        width = size * cell_width
        coarse_stops = coarse_active and width / 2 < 4 * h_min  # last level of the coarse estimate
        fine_stops = width / 2 < h_min
        keep = []
        for s in range(0, cells.size, chunk):
            sl = slice(s, s + chunk)
            pts, w = mesh.square_quadrature(cells[sl], a0[sl], b0[sl], size, order)
            near = np.linalg.norm(pts @ Q, axis=-1).min(axis=1) < 2 * width
            values = (g(pts) @ w) * size * size
            far = ~near
            np.add.at(fine, cells[sl][far], values[far])
            if coarse_active:
                np.add.at(coarse, cells[sl][far], values[far])
            if coarse_stops:
                np.add.at(coarse, cells[sl][near], values[near])
            if fine_stops:
                np.add.at(fine, cells[sl][near], values[near])
            else:
                keep.append(np.nonzero(near)[0] + s)
        coarse_active = coarse_active and not coarse_stops
        idx = np.concatenate(keep) if keep else np.zeros(0, dtype=int)
        half = size / 2
        cells = np.repeat(cells[idx], 4)
        a0 = np.repeat(a0[idx], 4) + np.tile([0.0, half, 0.0, half], idx.size)
        b0 = np.repeat(b0[idx], 4) + np.tile([0.0, 0.0, half, half], idx.size)
        size = half
    q = model.E.dim - 2 * p  # codimension of ker P_E ∩ S² is dim E
    if q <= 0:
        fine[coarse != fine] = math.inf  # squares that reached the singular band
        return fine
    return (4**q * fine - coarse) / (4**q - 1)
