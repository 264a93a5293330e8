"""Initial laws on S^{d−1}: densities w.r.t. surface measure (1/steradian on S²) and samplers of
the same law.

Every law has a dimension ``dim`` = d (the length of mu / mean; 3 by default: S²),
``density(x)`` at unit vectors x (n, d), ``sample(n, rng)`` → (n, d), and, on S² only,
``cell_averages(mesh)``: exact-area cell averages renormalised so that Σ_c A f_c = 1 to round-off
(the renormalisation corrects only the quadrature error of the cell rule).

Any d ≥ 2 (tokens on S^{d−1}): the uniform law, von Mises–Fisher (sampled with Wood's rejection
algorithm for d ≠ 3, the exact inversion on S²), mixtures of them and the projected normal
(sampled as X/|X|; its density is implemented for d = 3 only, where the mesh needs it). The draws
on S² are those of the code before any d was supported.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import erfcx, gammaln, ive

__all__ = ["Uniform", "VonMisesFisher", "Mixture", "ProjectedNormal", "InitialLaw"]


def _unit(v, name):
    v = np.asarray(v, dtype=float)
    if v.ndim != 1 or v.size < 2 or not np.all(np.isfinite(v)) or np.linalg.norm(v) == 0:
        raise ValueError(f"{name} must be a non-zero finite vector of length d >= 2")
    return v / np.linalg.norm(v)


def log_sphere_area(d: int) -> float:
    """ln |S^{d−1}| = ln(2π^{d/2}/Γ(d/2)) (4π for d = 3)."""
    return math.log(2.0) + 0.5 * d * math.log(math.pi) - float(gammaln(0.5 * d))


def _log_bessel_i(nu, k):
    """ln I_ν(k), k > 0: from the scaled ive, or its leading series term where ive underflows
    (large ν, small k)."""
    value = float(ive(nu, k))
    if value > 0 and math.isfinite(value):
        return math.log(value) + k
    return nu * math.log(0.5 * k) - float(gammaln(nu + 1.0))


class InitialLaw:
    """Base class: subclasses define density(x) and sample(n, rng); dim is d (S^{d−1})."""

    dim = 3

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
        if self.dim != 3:
            raise ValueError(f"cell averages need the mesh of S² (d = 3), this law has d = {self.dim}")
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
    """The uniform law on S^{d−1}, density 1/|S^{d−1}| (1/(4π) on S²); sampled as X/|X|,
    X ~ N(0, I_d)."""

    def __init__(self, dim: int = 3):
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim < 2:
            raise ValueError(f"dimension must be an integer >= 2, got {dim!r}")
        self.dim = int(dim)

    def density(self, x):
        value = 1.0 / (4.0 * math.pi) if self.dim == 3 else math.exp(-log_sphere_area(self.dim))
        return np.full(np.asarray(x).shape[0], value)

    def sample(self, n, rng=None):
        rng = np.random.default_rng(rng)
        x = rng.normal(size=(n, self.dim))
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    def __repr__(self):
        return "Uniform()" if self.dim == 3 else f"Uniform(dim={self.dim})"


class VonMisesFisher(InitialLaw):
    """von Mises–Fisher law on S^{d−1}, d = len(mu): f(y) = C_d(κ) e^{κ⟨μ,y⟩} (κ ≥ 0; κ = 0 is
    uniform), C_d(κ) = κ^{d/2−1}/((2π)^{d/2} I_{d/2−1}(κ)); on S² C_3 = κ/(4π sinh κ).

    Evaluated as C_d(κ)e^{κ} · e^{κ(⟨μ,y⟩ − 1)} (on S²: κ/(2π(1 − e^{−2κ})) e^{κ(⟨μ,y⟩ − 1)}), which
    neither overflows nor cancels.
    """

    def __init__(self, mu, kappa):
        self.mu = _unit(mu, "mu")
        self.dim = self.mu.size
        kappa = float(kappa)
        if not (math.isfinite(kappa) and kappa >= 0):
            raise ValueError(f"kappa must be a finite number >= 0, got {kappa!r}")
        self.kappa = kappa

    def log_normaliser(self):
        """log of C_d(κ)e^{κ}: κ/(2π(1 − e^{−2κ})) on S²; 1/|S^{d−1}| at κ = 0."""
        k, d = self.kappa, self.dim
        if d != 3:
            if k < 1e-8:
                return -log_sphere_area(d)
            nu = 0.5 * d - 1.0
            return nu * math.log(k) - 0.5 * d * math.log(2.0 * math.pi) - (_log_bessel_i(nu, k) - k)
        if k < 1e-8:
            return -math.log(4.0 * math.pi) + k  # κ/(2π·2κ(1 − κ + …)) ≈ (1 + κ)/(4π)
        return math.log(k) - math.log(2.0 * math.pi) - math.log(-math.expm1(-2.0 * k))

    def density(self, x):
        return np.exp(self.log_density(x))

    def log_density(self, x):
        x = np.asarray(x, dtype=float)
        return self.log_normaliser() + self.kappa * (x @ self.mu - 1.0)

    def sample(self, n, rng=None):
        """Exact sampler. On S²: W = ⟨μ, y⟩ has density ∝ e^{κw} on [−1, 1], inverted in closed
        form. Other d: Wood's rejection sampler for W (density ∝ e^{κw}(1 − w²)^{(d−3)/2}), then
        y = Wμ + √(1 − W²) u, u uniform on the unit sphere of μ⊥."""
        rng = np.random.default_rng(rng)
        if self.dim != 3:
            return self._sample_wood(int(n), rng)
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

    def _sample_wood(self, n, rng):
        """Wood (1994), Commun. Statist. Simul. 23, 157: with b = (d−1)/(2κ + √(4κ² + (d−1)²)),
        x₀ = (1 − b)/(1 + b), c = κx₀ + (d−1) ln(1 − x₀²), draw Z ~ Beta((d−1)/2, (d−1)/2),
        U ~ U(0, 1), W = (1 − (1+b)Z)/(1 − (1−b)Z), and accept when κW + (d−1) ln(1 − x₀W) − c ≥ ln U.
        (b in this form does not cancel at large κ.)"""
        d, k = self.dim, self.kappa
        b = (d - 1.0) / (2.0 * k + math.sqrt(4.0 * k * k + (d - 1.0) ** 2))
        x0 = (1.0 - b) / (1.0 + b)
        c = k * x0 + (d - 1.0) * math.log1p(-x0 * x0)
        w = np.empty(n)
        todo = np.arange(n)
        while todo.size:
            z = rng.beta(0.5 * (d - 1.0), 0.5 * (d - 1.0), size=todo.size)
            u = rng.random(todo.size)
            cand = (1.0 - (1.0 + b) * z) / (1.0 - (1.0 - b) * z)
            with np.errstate(divide="ignore"):
                ok = k * cand + (d - 1.0) * np.log1p(-x0 * cand) - c >= np.log(u)
            w[todo[ok]] = cand[ok]
            todo = todo[~ok]
        w = np.clip(w, -1.0, 1.0)
        g = rng.normal(size=(n, d))
        g -= np.outer(g @ self.mu, self.mu)  # uniform direction in μ⊥
        g /= np.linalg.norm(g, axis=1, keepdims=True)
        y = w[:, None] * self.mu + np.sqrt(1.0 - w * w)[:, None] * g
        return y / np.linalg.norm(y, axis=1, keepdims=True)  # unit to round-off (g ⊥ μ only to ~ε)

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
        self.dim = self.laws[0].dim
        if any(law.dim != self.dim for law in self.laws):
            raise ValueError("mixture components must all have the same dimension d")

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
        out = np.empty((n, self.dim))
        for k, law in enumerate(self.laws):
            idx = np.nonzero(component == k)[0]
            if idx.size:
                out[idx] = law.sample(idx.size, rng)
        return out

    def __repr__(self):
        return f"Mixture(weights={self.weights.tolist()}, laws={self.laws})"


class ProjectedNormal(InitialLaw):
    """Law of X/|X| for X ~ N(mean, cov) in R^d, d = len(mean) (angular central Gaussian when
    mean = 0). The density below is that of d = 3 (the mesh's); for other d only sample.

    f(y) = e^{−c/2} / ((2π)^{3/2} |Σ|^{1/2} a^{3/2}) · [(1 + α²) √(2π) e^{α²/2} Φ(α) + α],
    a = yᵀΣ⁻¹y, b = yᵀΣ⁻¹m, c = mᵀΣ⁻¹m, α = b/√a: the radial integral ∫₀^∞ r² φ(r y) dr in
    closed form. α² ≤ c (Cauchy–Schwarz), so e^{(α² − c)/2} is evaluated without overflow.
    """

    def __init__(self, mean=(0.0, 0.0, 0.0), cov=None):
        self.mean = np.asarray(mean, dtype=float)
        if self.mean.ndim != 1 or self.mean.size < 2 or not np.all(np.isfinite(self.mean)):
            raise ValueError("mean must be a finite vector of length d >= 2")
        self.dim = d = self.mean.size
        self.cov = np.eye(d) if cov is None else np.asarray(cov, dtype=float)
        if self.cov.shape != (d, d) or not np.all(np.isfinite(self.cov)):
            raise ValueError(f"cov must be a finite {d}×{d} matrix (d = len(mean))")
        if not np.allclose(self.cov, self.cov.T):
            raise ValueError("cov must be symmetric")
        try:
            self._chol = np.linalg.cholesky(self.cov)
        except np.linalg.LinAlgError:
            raise ValueError("cov must be positive definite") from None
        self._prec = np.linalg.inv(self.cov)
        self._logdet = 2.0 * np.sum(np.log(np.diag(self._chol)))

    def density(self, x):
        if self.dim != 3:
            raise NotImplementedError(f"the projected-normal density is implemented for d = 3, not d = {self.dim}")
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
        x = self.mean + rng.normal(size=(n, self.dim)) @ self._chol.T
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    def __repr__(self):
        return f"ProjectedNormal(mean={self.mean.tolist()}, cov={self.cov.tolist()})"
