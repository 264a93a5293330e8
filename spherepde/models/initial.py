"""Initial laws on S²: densities w.r.t. surface measure (1/steradian) and samplers of the same law.

Every law has ``density(x)`` at unit vectors x (n, 3), ``sample(n, rng)`` → (n, 3), and
``cell_averages(mesh)``: exact-area cell averages renormalised so that Σ_c A f_c = 1 to round-off
(the renormalisation corrects only the quadrature error of the cell rule).
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import erfcx

__all__ = ["Uniform", "VonMisesFisher", "Mixture", "ProjectedNormal", "InitialLaw"]


def _unit(v, name):
    v = np.asarray(v, dtype=float)
    if v.shape != (3,) or not np.all(np.isfinite(v)) or np.linalg.norm(v) == 0:
        raise ValueError(f"{name} must be a non-zero finite 3-vector")
    return v / np.linalg.norm(v)


class InitialLaw:
    """Base class: subclasses define density(x) and sample(n, rng)."""

    def density(self, x):  # pragma: no cover - abstract
        raise NotImplementedError

    def sample(self, n, rng=None):  # pragma: no cover - abstract
        raise NotImplementedError

    def log_density(self, x):
        """log f(x); −inf where f vanishes. Subclasses give it without underflow where they can."""
        with np.errstate(divide="ignore"):
            return np.log(self.density(x))

    def cell_averages(self, mesh, order: int = 4):
        """Cell averages of f on the mesh's cell quadrature, normalised to mass 1. The density
        is evaluated as exp(log f − c), c its maximum over the quadrature points: a law far
        narrower than the cells (vMF κ = 1.3e5 at nside 1) would otherwise underflow to 0 or
        to subnormal averages with a few significant bits, and no normalisation would be exact."""
        top = -np.inf

        def scan(x):
            nonlocal top
            top = max(top, float(np.max(self.log_density(x))))
            return np.zeros(len(x))

        mesh.cell_average(scan, order=order)
        if not np.isfinite(top):
            raise ValueError("the initial density is zero or not finite at every quadrature point of the mesh")
        f = mesh.cell_average(lambda x: np.exp(self.log_density(x) - top), order=order)
        return f / mesh.integrate(f)


class Uniform(InitialLaw):
    """The uniform law, density 1/(4π)."""

    def density(self, x):
        return np.full(np.asarray(x).shape[0], 1.0 / (4.0 * math.pi))

    def sample(self, n, rng=None):
        rng = np.random.default_rng(rng)
        x = rng.normal(size=(n, 3))
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    def __repr__(self):
        return "Uniform()"


class VonMisesFisher(InitialLaw):
    """von Mises–Fisher law: f(y) = κ/(4π sinh κ) e^{κ⟨μ,y⟩} (κ ≥ 0; κ = 0 is uniform).

    Evaluated as κ/(2π(1 − e^{−2κ})) e^{κ(⟨μ,y⟩ − 1)}, which neither overflows nor cancels.
    """

    def __init__(self, mu, kappa):
        self.mu = _unit(mu, "mu")
        kappa = float(kappa)
        if not (math.isfinite(kappa) and kappa >= 0):
            raise ValueError(f"kappa must be a finite number >= 0, got {kappa!r}")
        self.kappa = kappa

    def log_normaliser(self):
        """log of κ/(2π(1 − e^{−2κ})); 1/(4π) at κ = 0."""
        k = self.kappa
        if k < 1e-8:
            return -math.log(4.0 * math.pi) + k  # κ/(2π·2κ(1 − κ + …)) ≈ (1 + κ)/(4π)
        return math.log(k) - math.log(2.0 * math.pi) - math.log(-math.expm1(-2.0 * k))

    def density(self, x):
        return np.exp(self.log_density(x))

    def log_density(self, x):
        x = np.asarray(x, dtype=float)
        return self.log_normaliser() + self.kappa * (x @ self.mu - 1.0)

    def sample(self, n, rng=None):
        """Exact sampler: W = ⟨μ, y⟩ has density ∝ e^{κw} on [−1, 1], inverted in closed form."""
        rng = np.random.default_rng(rng)
        u = rng.random(n)
        k = self.kappa
        if k < 1e-8:
            w = 2.0 * u - 1.0
        else:
            w = 1.0 + np.log(u + (1.0 - u) * math.exp(-2.0 * k)) / k
        w = np.clip(w, -1.0, 1.0)
        phi = rng.uniform(0.0, 2.0 * math.pi, n)
        e1 = np.cross(self.mu, [1.0, 0.0, 0.0] if abs(self.mu[0]) < 0.9 else [0.0, 1.0, 0.0])
        e1 /= np.linalg.norm(e1)
        e2 = np.cross(self.mu, e1)
        r = np.sqrt(np.clip(1.0 - w * w, 0.0, None))
        return (w[:, None] * self.mu + r[:, None] * (np.cos(phi)[:, None] * e1
                                                     + np.sin(phi)[:, None] * e2))

    def __repr__(self):
        return f"VonMisesFisher(mu={self.mu.tolist()}, kappa={self.kappa})"


class Mixture(InitialLaw):
    """Finite mixture Σ_k π_k law_k (π_k ≥ 0, normalised to sum 1)."""

    def __init__(self, weights, laws):
        weights = np.asarray(weights, dtype=float)
        if weights.ndim != 1 or len(weights) != len(laws) or len(laws) == 0:
            raise ValueError("mixture needs one weight per component and at least one component")
        if not np.all(np.isfinite(weights)) or np.any(weights < 0) or weights.sum() <= 0:
            raise ValueError("mixture weights must be finite, >= 0 and not all zero")
        self.weights = weights / weights.sum()
        self.laws = list(laws)

    def density(self, x):
        return sum(w * law.density(x) for w, law in zip(self.weights, self.laws))

    def log_density(self, x):
        from scipy.special import logsumexp

        with np.errstate(divide="ignore"):
            terms = [np.log(w) + law.log_density(x) for w, law in zip(self.weights, self.laws)]
        return logsumexp(np.array(terms), axis=0)

    def cell_averages(self, mesh, order: int = 4):
        """Σ_k π_k (cell averages of law k, each of mass 1): every component keeps its weight even
        where one is far narrower than the cells and the others dominate the quadrature points."""
        return sum(w * law.cell_averages(mesh, order) for w, law in zip(self.weights, self.laws))

    def sample(self, n, rng=None):
        rng = np.random.default_rng(rng)
        component = rng.choice(len(self.laws), size=n, p=self.weights)
        out = np.empty((n, 3))
        for k, law in enumerate(self.laws):
            idx = np.nonzero(component == k)[0]
            if idx.size:
                out[idx] = law.sample(idx.size, rng)
        return out

    def __repr__(self):
        return f"Mixture(weights={self.weights.tolist()}, laws={self.laws})"


class ProjectedNormal(InitialLaw):
    """Law of X/|X| for X ~ N(mean, cov) in R³ (angular central Gaussian when mean = 0).

    f(y) = e^{−c/2} / ((2π)^{3/2} |Σ|^{1/2} a^{3/2}) · [(1 + α²) √(2π) e^{α²/2} Φ(α) + α],
    a = yᵀΣ⁻¹y, b = yᵀΣ⁻¹m, c = mᵀΣ⁻¹m, α = b/√a: the radial integral ∫₀^∞ r² φ(r y) dr in
    closed form. α² ≤ c (Cauchy–Schwarz), so e^{(α² − c)/2} is evaluated without overflow.
    """

    def __init__(self, mean=(0.0, 0.0, 0.0), cov=np.eye(3)):
        self.mean = np.asarray(mean, dtype=float)
        self.cov = np.asarray(cov, dtype=float)
        if self.mean.shape != (3,) or not np.all(np.isfinite(self.mean)):
            raise ValueError("mean must be a finite 3-vector")
        if self.cov.shape != (3, 3) or not np.all(np.isfinite(self.cov)):
            raise ValueError("cov must be a finite 3×3 matrix")
        if not np.allclose(self.cov, self.cov.T):
            raise ValueError("cov must be symmetric")
        try:
            self._chol = np.linalg.cholesky(self.cov)
        except np.linalg.LinAlgError:
            raise ValueError("cov must be positive definite") from None
        self._prec = np.linalg.inv(self.cov)
        self._logdet = 2.0 * np.sum(np.log(np.diag(self._chol)))

    def density(self, x):
        x = np.asarray(x, dtype=float)
        a = np.einsum("ni,ij,nj->n", x, self._prec, x)
        b = x @ (self._prec @ self.mean)
        c = float(self.mean @ self._prec @ self.mean)
        alpha = b / np.sqrt(a)
        log_pre = -1.5 * math.log(2 * math.pi) - 0.5 * self._logdet - 1.5 * np.log(a)
        # √(2π) e^{α²/2} Φ(α) = √(π/2) erfcx(−α/√2); for α → −∞ the bracket cancels to
        # 2/t³ − 12/t⁵ + 90/t⁷ (t = −α), used beyond t = 100 (both forms agree to ~1e-9 there)
        with np.errstate(over="ignore"):
            bracket = (1 + alpha**2) * math.sqrt(math.pi / 2) * erfcx(-alpha / math.sqrt(2)) + alpha
        far = alpha < -100.0
        t = np.where(far, -alpha, 100.0)
        bracket = np.where(far, 2 / t**3 - 12 / t**5 + 90 / t**7, bracket)
        return np.exp(log_pre - 0.5 * c) * bracket

    def sample(self, n, rng=None):
        rng = np.random.default_rng(rng)
        x = self.mean + rng.normal(size=(n, 3)) @ self._chol.T
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    def __repr__(self):
        return f"ProjectedNormal(mean={self.mean.tolist()}, cov={self.cov.tolist()})"
