"""Lagrangian particle solver: weighted points moving in the attention field of the points.

For particles x_i with weights w_i (a measure ρ = Σ w_i δ_{x_i}) the velocity is the attention
field of ρ itself, v(x_i) = P_x(V m_β(x_i)), computed by spherepde.summation.attention_field
(the same summation as the Eulerian solver, sources = targets = the particles). Two uses:

- tokens: n points sampled i.i.d. from ρ₀ with weights 1/n, as in the paper's experiments. At
  β = ∞ the softmax becomes the hardmax over tokens: m(x_i) = x_j*, j* = argmax_j ⟨Bᵀx_i, x_j⟩.
- quadrature particles: one per HEALPix cell with weight f₀·A, each carrying its log-density
  along its characteristic, d/dt log f = −div_S v (docs/theory.md#formulas-and-exact-solutions): the exact pointwise density
  along trajectories, up to time stepping and the quadrature of the sum. At β = ∞ they move in
  the local mean-field limit P_x(Mx)/|Bᵀx| (full-support density).

Several heads and layers (spherepde.models.heads): the model may be a MultiHeadModel (the field and its
divergence are the sums over the heads; at β = ∞ each head follows the rule above: hardmax for
tokens, the local limit for quadrature particles), a Schedule or a callable t ↦ (B, V, β).
Each step uses the model of its start time for all its stages, and a step lands on every switch
time of a Schedule (as on the save times).

Time steppers (fixed dt, shortened to land on every save time and every switch time):
- "euler": the paper's scheme x ← (x + Δt v)/|x + Δt v|, log f ← log f − Δt div v;
- "rk4": classical Runge–Kutta on (x, log f), stages evaluated at normalised points, the update
  normalised (a projection method: fourth order on the sphere).

Adaptive steps (spherepde.solvers.adaptive): "dopri5" (Dormand–Prince 5(4)) and "bs32"
(Bogacki–Shampine 3(2)) are embedded pairs applied in the same projected way, with error control:
a step is accepted when the largest chordal distance between the two solutions (and |Δ log f| for
carried densities) is at most atol + rtol, and a PI controller picks the next step. dt is the
first step; steps land exactly on every save and switch time. Each system of a batch has its own
steps (system k repeats the single run of its tokens bitwise); the controller's state after a
snapshot (step_state()) is what a resumed run needs. Noise is refused with them (the error
estimate would be the drift's alone), and so are hardmax tokens at β = ∞ (their field jumps
where the argmax switches, and where it chatters between tokens the steps fall to ~1e-5:
measured, 100 vMF tokens, paper matrices, rtol 1e-6).

Noise (a spherepde.models.noise.NoiseSchedule ν(t)): the tokens follow dX = v dt + √(2ν) dW on S² (generator
νΔ_S plus the drift), whose law solves ∂_t f + div_S(f v) = νΔ_S f. Each step is the drift step of
the scheme above followed by a geodesic random walk step (Lie splitting):

    x ← cos(s|η|) x + sin(s|η|) η/|η|,   η = P_x ξ, ξ ~ N(0, I₃), s = √(2 N(t, t + dt)),

N = ∫ν over the step: x moves along the great circle in the direction of a tangent Gaussian, so
it stays on S² to round-off. Weak order 1: for pure noise E[x_{n+1} | x_n] = m(s) x_n exactly, with
m(s) = E[cos(sR)] = 1 − √2 s D(s/√2) (R Rayleigh, D Dawson's integral) = 1 − s² + s⁴/3 − …,
against e^{−2ν dt} = 1 − s² + s⁴/2 − … for the Brownian motion: the scheme's E[x_t] is
m(s)^{t/dt} x₀ = e^{−2νt}(1 − (2/3)ν²t dt + …) x₀, a bias of order dt (spherepde/validation/noise.py measures
it). The random numbers of step j after snapshot k come from SeedSequence(seed, spawn_key =
(NOISE_STREAM, k, j)): no generator state to store, so a run resumed at snapshot k draws what
the uninterrupted run drew, and the noise is independent of the stream that sampled the tokens
(SeedSequence(seed), no spawn key).
Carried densities do not survive noise (along a noisy path d log f/dt ≠ −div v): carry_density
with noise is refused; quadrature particles with noise are weighted Brownian particles.

Any dimension and batched systems. Tokens live on S^{d−1} for any d ≥ 2, d the size of the
model's B and V: positions (n, d). Positions (M, n, d) are M independent systems advanced together
(each token attends to the tokens of its own system; the weights (n,) are shared). Both use the
batched direct sum spherepde.summation.batched (one kernel call per head and field evaluation over
all systems, streaming log-sum-exp, exact to rounding, O(n²) per system), and its hardmax at
β = ∞; the local β = ∞ limit (hardmax=False) is P_x(Mx)/|Bᵀx| in any d. Everything else
generalises as written: P_x = I − xxᵀ in R^d, the normalised Euler and RK4 steps, and the
geodesic noise step with ξ ~ N(0, I_d) (then E[x_{n+1} | x_n] = m_d(s)x_n with another factor
m_d for d ≠ 3; noise_mean_factor is that of S²). System k of a batch draws its noise from the
streams of seed + k, so it repeats the single run with seed + k. A single system on S² (n, 3)
keeps the summation of spherepde.summation.attention_field (clustered sums, trees, harmonic
expansions; summation="auto"); summation="batched" sends it through the batched sum too.
Systems on S² of at least PER_SYSTEM_N tokens each also keep that summation with summation="auto",
one system at a time: once tokens concentrate, the clustered sums cost O(n) per evaluation where
the direct sum costs O(n²). Measured on whole runs of 8 systems (projected normal of the paper,
one thread; batched time / per-system time): β = 10 (RK4 dt 0.05, t ≤ 20) 0.96 / 1.34 / 2.07 at
n = 500 / 1000 / 2000, β = 1000 (dt 0.01, t ≤ 2) 0.66 / 0.91 / 1.26; for two tight clusters at
n = 8 000 (2 threads) 3.4 (β = 10) and 2.0 (β = 1000).
Carried densities (quadrature particles) exist on S² for one system only.
"""

from __future__ import annotations

import math

import numpy as np
import xarray as xr
from numba import njit, prange

from ..models.checks import check_model
from ..models.schedule import schedule_of
from ..storage.memory import memory_dataset
from ..storage.schema import CARRIED_ARRAYS, PARTICLE_WEIGHTS, particle_arrays
from ..summation import attention_field, project_velocity, zero_temperature_field
from ..summation.batched import batched_hardmax, batched_softmax, log2_masses, source_rows
from .adaptive import PAIRS, AdaptiveStepper
from .guards import Guards
from .timeline import save_times, segments

__all__ = ["ParticleSolver", "hardmax_field", "tokens_from_law", "quadrature_particles", "SCHEMES",
           "FIXED_SCHEMES", "ADAPTIVE_SCHEMES",
           "geodesic_noise_step", "noise_mean_factor", "NOISE_STREAM", "SUMMATIONS", "PER_SYSTEM_N", "token_systems",
           "local_limit_field"]

FIXED_SCHEMES = ("euler", "rk4")
ADAPTIVE_SCHEMES = tuple(PAIRS)  # embedded pairs with error control (spherepde.solvers.adaptive)
SCHEMES = FIXED_SCHEMES + ADAPTIVE_SCHEMES
SUMMATIONS = ("auto", "batched")
PER_SYSTEM_N = 1000  # systems on S² this large take attention_field one at a time (module docstring)
NOISE_STREAM = 0x6E6F6973  # first spawn-key word of the noise streams ("nois")


@njit(cache=True, parallel=True)
def hardmax_field(targets, BT, sources, weights, V, velocity):
    """β = ∞ token rule: m(x) = y_j*, j* = argmax_{j: w_j > 0} ⟨Bᵀx, y_j⟩ (first index on ties),
    v = P_x(V m). targets (T, 3), BT = Bᵀ, sources (N, 3), weights (N,); writes velocity (T, 3)."""
    for i in prange(targets.shape[0]):
        x0 = targets[i, 0]
        x1 = targets[i, 1]
        x2 = targets[i, 2]
        a0 = BT[0, 0] * x0 + BT[0, 1] * x1 + BT[0, 2] * x2
        a1 = BT[1, 0] * x0 + BT[1, 1] * x1 + BT[1, 2] * x2
        a2 = BT[2, 0] * x0 + BT[2, 1] * x1 + BT[2, 2] * x2
        best = -np.inf
        arg = 0
        for j in range(sources.shape[0]):
            if weights[j] > 0.0:
                s = a0 * sources[j, 0] + a1 * sources[j, 1] + a2 * sources[j, 2]
                if s > best:
                    best = s
                    arg = j
        project_velocity(V, sources[arg, 0], sources[arg, 1], sources[arg, 2], x0, x1, x2, velocity[i])


def _normalise(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def local_limit_field(x, B, M):
    """The local β = ∞ field P_x(Mx)/|Bᵀx| in any d, x (..., d) (M = VBᵀ)."""
    mx = x @ M.T
    v = mx - np.sum(x * mx, axis=-1, keepdims=True) * x
    return v / np.linalg.norm(x @ B, axis=-1, keepdims=True)


def geodesic_noise_step(x, s, xi):
    """The geodesic random walk step of the module docstring: exp_x(s P_x ξ) for positions x (n, d)
    and standard normal ξ (n, d); s ≥ 0 the step scale √(2∫ν). Returns new unit vectors."""
    eta = xi - np.einsum("nd,nd->n", xi, x)[:, None] * x
    r = np.linalg.norm(eta, axis=1)
    safe = np.where(r > 0, r, 1.0)
    angle = s * r
    out = np.cos(angle)[:, None] * x + (np.sin(angle) / safe)[:, None] * eta
    return _normalise(out)


def noise_mean_factor(s):
    """m(s) = E[cos(sR)], R the norm of a standard 2-d Gaussian: E[x_{n+1} | x_n] = m(s) x_n for a
    pure-noise step of geodesic_noise_step. Closed form 1 − √2 s D(s/√2), D Dawson's integral."""
    from scipy.special import dawsn

    s = np.asarray(s, dtype=float)
    return 1.0 - math.sqrt(2.0) * s * dawsn(s / math.sqrt(2.0))


def tokens_from_law(law, n, seed=None):
    """n tokens sampled i.i.d. from an initial law, weights 1/n."""
    if not (isinstance(n, (int, np.integer)) and n >= 1):
        raise ValueError(f"n must be a positive integer, got {n!r}")
    x = law.sample(int(n), np.random.default_rng(seed))
    return x, np.full(int(n), 1.0 / n)


def token_systems(law, n, systems, seed):
    """M = systems independent draws of n tokens, (M, n, d): system k sampled from
    default_rng(seed + k), so that it equals tokens_from_law(law, n, seed + k); weights 1/n."""
    if isinstance(systems, bool) or not isinstance(systems, (int, np.integer)) or systems < 1:
        raise ValueError(f"systems must be a positive integer, got {systems!r}")
    x = np.stack([tokens_from_law(law, n, seed + k)[0] for k in range(int(systems))])
    return x, np.full(int(n), 1.0 / n)


def quadrature_particles(mesh, law):
    """One particle per cell at its centroid: weight = cell mass f̄₀·A (cell average, so the total
    is exactly 1) and log-density log f₀(centroid) (the point value the particle carries)."""
    f_bar = law.cell_averages(mesh)
    with np.errstate(divide="ignore"):
        log_f = np.log(law.density(mesh.centroids))
    return mesh.centroids.copy(), f_bar * mesh.area, log_f


class ParticleSolver:
    """Move weighted particles in their own attention field.

    model: an AttentionModel, a MultiHeadModel, a Schedule or a callable t ↦ (B, V, β)
    (module docstring). scheme "euler" | "rk4" (fixed step dt) | "dopri5" | "bs32" (adaptive: dt the
    first step, rtol and atol the tolerance of the error norm); carry_density: also integrate log f
    along the paths (needs the divergence: not available for hardmax tokens). hardmax: at β = ∞
    use the token hardmax rule (True) or the local mean-field limit (False, required with
    carry_density), for every head at β = ∞.
    noise: None or a spherepde.models.noise.NoiseSchedule; seed (integer ≥ 0) of its random streams
    (module docstring; system k of a batch uses seed + k). Noise refuses carry_density.
    summation: "auto" (one system on S²: spherepde.summation.attention_field; otherwise the
    batched direct sum) or "batched" (always the batched direct sum).
    backend: "cpu", "cuda" (the tokens stay on the GPU between snapshots, spherepde.solvers.device;
    the fused direct sum in precision "fp64" | "fp32"; ValueError without a GPU or for noise,
    carried densities, the local β = ∞ limit) or "auto" (the GPU when numba sees one and the run
    can use it); self.backend is the one used.
    Positions are (n, d) for one system or (M, n, d) for M systems (module docstring).
    """

    def __init__(self, model, scheme: str = "rk4", dt: float = 0.01, carry_density: bool = False,
                 hardmax: bool | None = None, noise=None, seed: int = 0, summation: str = "auto",
                 backend: str = "cpu", precision: str = "fp64", rtol: float = 1e-6, atol: float = 0.0):
        if scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
        if not (math.isfinite(rtol) and math.isfinite(atol) and rtol >= 0 and atol >= 0 and rtol + atol > 0):
            raise ValueError(f"rtol and atol must be >= 0 and not both 0, got rtol={rtol!r}, atol={atol!r}")
        self.rtol, self.atol = float(rtol), float(atol)
        if summation not in SUMMATIONS:
            raise ValueError(f"summation must be one of {SUMMATIONS}, got {summation!r}")
        self.summation = summation
        if not (math.isfinite(dt) and dt > 0):
            raise ValueError(f"dt must be a positive number, got {dt!r}")
        self.model = model
        self.schedule = schedule_of(model)  # the one conversion (spherepde.models.schedule)
        self.scheme = scheme
        self.dt = float(dt)
        self.carry_density = bool(carry_density)
        known = self.schedule.heads or ()
        # whether a head at β = ∞ may occur (always possible for a callable)
        zero_temperature = any(h.zero_temperature for h in known) if self.schedule.layers else True
        if hardmax is None:
            hardmax = zero_temperature and not carry_density
        if hardmax and carry_density:
            raise ValueError("hardmax tokens have no divergence: carry_density needs the mean-field limit")
        for head in known:
            check_model(head.B, head.V, head.beta)
        self.hardmax = bool(hardmax) and zero_temperature
        if self.hardmax and self.adaptive:  # measured: steps of ~1e-5 where the argmax chatters
            raise ValueError(f"the adaptive scheme {scheme!r} needs a smooth field: hardmax tokens (argmax switches) "
                             "are refused; use hardmax=False (the local β = ∞ limit) or \"rk4\"")
        self.evaluations = 0
        self.noise = None if noise is None or noise.is_zero else noise
        if self.noise is not None and self.adaptive:
            raise ValueError(f"the adaptive scheme {scheme!r} takes no noise (its error estimate is that of "
                             "the drift alone): use \"euler\" or \"rk4\" with noise")
        if self.noise is not None and self.carry_density:
            raise ValueError("carried densities do not survive noise (d log f/dt = −div v holds only along "
                             "noiseless paths): use carry_density=False with noise")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        self.seed = int(seed)
        if precision not in ("fp64", "fp32"):
            raise ValueError(f"precision must be 'fp64' or 'fp32', got {precision!r}")
        self.backend, self.precision, self._device = "cpu", precision, None
        if backend != "cpu":  # the GPU (spherepde.solvers.device), imported only when asked for
            from .device import backend_for, device_problem

            local_limit = zero_temperature and not self.hardmax
            problem = device_problem(self.noise is not None, self.carry_density, local_limit, self.scheme)
            self.backend = backend_for(backend, problem)
        self._masses = None  # (weights, λ, ln max μ) of the batched sum
        self._key = None
        self._use(0.0)
        self.stepper = None  # the AdaptiveStepper of the last snapshots() of an adaptive scheme

    @property
    def adaptive(self) -> bool:
        """Whether the scheme is an embedded pair with error control (dt is then the first step)."""
        return self.scheme in ADAPTIVE_SCHEMES

    def _use(self, t):
        """Take the model of a step starting at t (spherepde.models.heads)."""
        key = self.schedule.key_at(t)
        if key != self._key:
            self._key, self._heads = key, self.schedule.model_at(t).heads

    # ------------------------------------------------------------------ the field
    def batched_for(self, x) -> bool:
        """Whether positions of this shape go through the batched direct sum (module docstring)."""
        x = np.asarray(x)
        return (x.ndim == 3 or x.shape[-1] != 3 or self.summation == "batched") and not self.per_system_for(x)

    def per_system_for(self, x) -> bool:
        """Whether positions (M, n, 3) go one system at a time through attention_field: summation
        "auto" and n ≥ PER_SYSTEM_N (module docstring)."""
        x = np.asarray(x)
        return x.ndim == 3 and x.shape[-1] == 3 and self.summation == "auto" and x.shape[1] >= PER_SYSTEM_N

    def field(self, x, weights):
        """(v (n, d), div_S v (n,) or None) at the particles, for the measure Σ w_i δ_{x_i}
        (the sum over the heads of the current model); (M, n, d) positions: each system's own
        field, divergence None."""
        self.evaluations += 1
        if self.batched_for(x):
            return self._batched_field(x, weights), None
        if x.ndim == 3:  # per_system_for(x): each system's own summation
            return np.stack([self._system_field(xk, weights)[0] for xk in x]), None
        return self._system_field(x, weights)

    def _system_field(self, x, weights):
        """(v, div) of one system on S² (n, 3): the sum over the heads of attention_field."""
        velocity = divergence = None
        for m in self._heads:
            v, div = self._head_field(m, x, weights)
            if velocity is None:
                velocity, divergence = v, div
            else:
                velocity = velocity + v
                divergence = None if div is None else divergence + div
        return velocity, divergence

    def _head_field(self, m, x, weights):
        """One head's field and divergence (None when not carried)."""
        n = x.shape[0]
        if self.hardmax and m.zero_temperature:
            v = np.empty((n, 3))
            hardmax_field(x, np.ascontiguousarray(m.B.T), x, weights, m.V, v)
            return v, None
        if m.zero_temperature:
            v, div = np.empty((n, 3)), np.empty(n)
            zero_temperature_field(x, m.B, m.M, self.carry_density, v, div)
            return v, (div if self.carry_density else None)
        v, div, _ = attention_field(m, x, weights, x, want_div=self.carry_density, may_cluster=True)
        return v, div

    def _batched_field(self, x, weights):
        """The field of every system by the batched direct sum (spherepde.summation.batched);
        positions (n, d) are one system."""
        single = x.ndim == 2
        xs = np.ascontiguousarray(x[None] if single else x, dtype=float)
        if self._masses is None or self._masses[0] is not weights:
            self._masses = (weights, *log2_masses(weights))
        _, lam, ln_top = self._masses
        soa = source_rows(xs)
        velocity = np.zeros(xs.shape)
        v = np.empty(xs.shape)
        for m in self._heads:
            if m.dim != xs.shape[-1]:
                raise ValueError(f"positions in R^{xs.shape[-1]} but the model's matrices are {m.dim}×{m.dim}")
            BT = np.ascontiguousarray(m.B.T)
            if m.zero_temperature and self.hardmax:
                batched_hardmax(xs, soa, lam, BT, m.V, v)
            elif m.zero_temperature:
                v = local_limit_field(xs, m.B, m.M)
            else:
                logz = np.empty(xs.shape[:2]) if m.unnormalised else np.empty((0, 0))
                batched_softmax(xs, soa, lam, BT, float(m.beta), m.V, v, logz, ln_top)
                if m.unnormalised:  # v = P_x(V Z m_β)·e^{−c} (spherepde.models.attention)
                    v *= np.exp(logz - m.log_field_scale)[..., None]
            velocity += v
        return velocity[0] if single else velocity

    def reserve_device(self, shape, weights):
        """The GPU arrays for positions of this shape ((n, d) or (M, n, d)) with these weights,
        allocated now (a run calls it before its file is opened: no room on the GPU is then a
        DeviceMemoryError before anything is written). backend "cuda" only."""
        from .device import DeviceTokens

        shape = tuple(shape) if len(shape) == 3 else (1, *shape)
        weights = np.asarray(weights, dtype=float)
        self._device = DeviceTokens(shape, weights, self.scheme, self.precision)
        self._device_weights = weights

    @property
    def device_name(self) -> str:
        """The GPU's name ("none" on the CPU backend)."""
        from ..summation.cuda import device_name

        return device_name() if self.backend == "cuda" else "none"

    def _device_snapshots(self, x, w, times, first):
        """Snapshots of the tokens advanced on the GPU (spherepde.solvers.device), as snapshots()."""
        if (self._device is None or self._device.shape[1:] != x.shape[-2:]
                or self._device.shape[0] != (x.shape[0] if x.ndim == 3 else 1)
                or not np.array_equal(self._device_weights, w)):
            self.reserve_device(x.shape, w)
        device = self._device
        before = device.evaluations
        for k, t, positions in device.snapshots(x if x.ndim == 3 else x[None], self.schedule, self.dt, times, first):
            self.evaluations += device.evaluations - before
            before = device.evaluations
            yield k, t, (positions if x.ndim == 3 else positions[0]), None

    # ------------------------------------------------------------------ steps
    def step(self, x, log_f, weights, dt):
        """One step of size dt; returns (x, log_f) (log_f None when not carried)."""
        if self.scheme == "euler":
            v, div = self.field(x, weights)
            x_new = _normalise(x + dt * v)
            return x_new, (None if log_f is None else log_f - dt * div)
        k_x, k_f = [], []
        stage_x = x  # d(log f)/dt = −div v(x(t)) does not depend on log f: no stages of it
        for c in (0.0, 0.5, 0.5, 1.0):
            if c > 0:
                stage_x = _normalise(x + c * dt * k_x[-1])
            v, div = self.field(stage_x, weights)
            k_x.append(v)
            k_f.append(div)
        x_new = _normalise(x + dt / 6 * (k_x[0] + 2 * k_x[1] + 2 * k_x[2] + k_x[3]))
        if log_f is None:
            return x_new, None
        return x_new, log_f - dt / 6 * (k_f[0] + 2 * k_f[1] + 2 * k_f[2] + k_f[3])

    def noise_step(self, x, t0, t1, k, j):
        """The noise of the step from t0 to t1 (step j after snapshot k - 1, i.e. toward snapshot
        k): a geodesic random walk step drawn from its own stream (module docstring)."""
        if self.noise is None:
            return x
        amount = self.noise.integral(t0, t1)
        if amount == 0.0:
            return x
        s = math.sqrt(2.0 * amount)
        if x.ndim == 3:  # system q draws from the streams of seed + q (module docstring)
            return np.stack([geodesic_noise_step(x[q], s, self._noise_draw(self.seed + q, k, j, x.shape[1:]))
                             for q in range(x.shape[0])])
        return geodesic_noise_step(x, s, self._noise_draw(self.seed, k, j, x.shape))

    @staticmethod
    def _noise_draw(seed, k, j, shape):
        """ξ ~ N(0, I) of step j toward snapshot k from the stream of seed."""
        stream = np.random.SeedSequence(seed, spawn_key=(NOISE_STREAM, int(k), int(j)))
        return np.random.Generator(np.random.PCG64(stream)).standard_normal(shape)

    def _systems_field(self, single):
        """The field callback of the AdaptiveStepper: (v, div) of the systems xs (m, n, d) with the
        model of each step start time ts (m,), grouped by model; count=False: not counted again."""
        def field(xs, ts, count):
            before = self.evaluations
            keys = [self.schedule.key_at(t) for t in ts]
            groups = {}
            for i, key in enumerate(keys):
                groups.setdefault(key, []).append(i)
            if len(groups) == 1:
                parts = [(slice(None), ts[0])]
            else:
                parts = [(np.array(members), ts[members[0]]) for members in groups.values()]
            v_all = np.empty(xs.shape)
            div_all = None if not self.carry_density else np.empty(xs.shape[:2])
            for where, t in parts:
                self._use(t)
                if single:  # one system (n, d): its own summation (module docstring)
                    v, div = self.field(xs[0], self._weights)
                    v, div = v[None], (None if div is None else div[None])
                else:
                    v, div = self.field(xs[where], self._weights)
                v_all[where] = v
                if div_all is not None:
                    div_all[where] = div
            if not count:
                self.evaluations = before
            return v_all, div_all
        return field

    def step_state(self) -> dict | None:
        """The step-size controller's state after the last snapshot, {name: array (M,)} of
        spherepde.solvers.adaptive.STEP_STATE (M = 1 for one system); None for a fixed step."""
        return None if self.stepper is None else self.stepper.control.state()

    def snapshots(self, x0, weights, times, log_f0=None, resume_from: int | None = None, step_state=None):
        """Yield (k, t, x, log_f) at each of the increasing times (times[0] is the start).

        resume_from: x0 (and log_f0) are the state saved at times[resume_from], taken as they
        are (not normalised again, so the continuation is exact); the snapshots after it are
        yielded; step_state: with an adaptive scheme, the controller's state saved there
        (step_state()). Raises RunFailure (spherepde.solvers.guards) on a non-finite position or
        log-density, or a collapse of the adaptive step.
        """
        x = np.array(x0, dtype=float)
        if resume_from is None:
            x = _normalise(x)
        w = np.asarray(weights, dtype=float)
        if x.ndim not in (2, 3) or x.shape[-1] < 2 or w.shape != (x.shape[-2],):
            raise ValueError("positions must be (n, d) or (M, n, d), d >= 2, and weights (n,)")
        dim = self.schedule.dim
        if dim is not None and x.shape[-1] != dim:
            raise ValueError(f"positions in R^{x.shape[-1]} but the model's matrices are {dim}×{dim}")
        if self.carry_density and self.batched_for(x):
            raise ValueError("carried densities need one system on S² (positions (n, 3)) and summation 'auto'")
        if not (np.all(np.isfinite(x)) and np.all(np.isfinite(w)) and np.all(w >= 0) and w.sum() > 0):
            raise ValueError("positions and weights must be finite, weights >= 0 and not all zero")
        if self.carry_density and log_f0 is None:
            raise ValueError("carry_density needs the initial log-density log_f0")
        log_f = None if not self.carry_density else np.array(log_f0, dtype=float)
        first = 0 if resume_from is None else resume_from
        if self.adaptive:
            yield from self._adaptive_snapshots(x, log_f, w, times, first, resume_from is not None, step_state)
            return
        if resume_from is None:
            yield 0, float(times[0]), x, log_f
        if self.backend == "cuda":
            yield from self._device_snapshots(x, w, times, first)
            return
        t = float(times[first])
        for k in range(first + 1, len(times)):
            j = 0  # the step's index within the snapshot interval: its noise stream
            for _, t_next in segments(t, times[k], self.schedule.switch_times):
                while t < t_next:
                    remaining = t_next - t
                    # take the fixed dt, but never leave a sliver shorter than dt/1000 before a
                    # save or switch time
                    dt = remaining if remaining <= self.dt * 1.001 else self.dt
                    self._use(t)  # the model of the step's start, for all its stages
                    x, log_f = self.step(x, log_f, w, dt)
                    t_new = t_next if dt == remaining else t + dt
                    x = self.noise_step(x, t, t_new, k, j)
                    t, j = t_new, j + 1
                    Guards.particles(t, x, log_f)
            yield k, t, x, log_f

    def _adaptive_snapshots(self, x, log_f, w, times, first, resumed, step_state):
        """snapshots() with an embedded pair: every system advanced by its own steps from save
        time to save time, landing on each switch time (spherepde.solvers.adaptive)."""
        single = x.ndim == 2
        xs = x[None] if single else x  # views: the stepper updates x and log_f in place
        gs = None if log_f is None else log_f[None]
        self.stepper = stepper = AdaptiveStepper(PAIRS[self.scheme], self.rtol, self.atol, xs.shape[0], self.dt)
        self._weights = w
        t = float(times[first])
        if resumed:
            if step_state is None:
                raise ValueError("resuming an adaptive scheme needs the step-size controller's state (step_state)")
            stepper.control.restore(step_state)
            # the uninterrupted run evaluated the first stage at t already, unless a layer starts there
            stepper.forget(counted_before=t not in self.schedule.switch_times)
        else:
            yield 0, t, x.copy(), None if log_f is None else log_f.copy()
        field = self._systems_field(single)
        for k in range(first + 1, len(times)):
            for t0, t1 in segments(t, times[k], self.schedule.switch_times):
                stepper.advance(xs, gs, t0, t1, field, self.schedule.key_at)
                Guards.particles(t1, x, log_f)
            t = float(times[k])
            yield k, t, x.copy(), None if log_f is None else log_f.copy()  # x is updated in place

    def run(self, x0, weights, t_end: float, save_every: float, log_f0=None) -> xr.Dataset:
        """Integrate to t_end; a Dataset laid out as a run file's particles (spherepde.storage.memory):
        positions(time, [system,] particle, xyz) (component instead of xyz for d ≠ 3; system for
        (M, n, d) positions), particle_weights(particle) and, if carried,
        particle_density(time, particle) = exp(log f)."""
        times = save_times(t_end, save_every)
        positions, densities = [], []
        for _, _, x, log_f in self.snapshots(x0, weights, times, log_f0):
            positions.append(x.copy())
            if log_f is not None:
                densities.append(np.exp(log_f))
        x_shape = np.shape(x0)
        arrays = {name: (dims, np.array(positions), long_name, units)
                  for name, (dims, long_name, units) in
                  particle_arrays(x_shape[-1], len(x_shape) == 3).items()}
        if densities:
            dims, long_name, units = CARRIED_ARRAYS["particle_density"]
            arrays["particle_density"] = (dims, np.array(densities), long_name, units)
        name, dims, long_name, units = PARTICLE_WEIGHTS
        static = {name: (dims, np.asarray(weights, dtype=float), long_name, units)}
        attrs = {"scheme": self.scheme, "dt": self.dt, "hardmax": int(self.hardmax), "field_evaluations": self.evaluations}
        if self.adaptive:
            state = self.step_state()
            attrs.update({"rtol": self.rtol, "atol": self.atol, "steps": int(state["steps"].sum()),
                          "steps_rejected": int(state["steps_rejected"].sum())})
        if self.noise is not None:
            attrs.update({"noise": self.noise.describe(), "noise_seed": self.seed})
        return memory_dataset(times, arrays=arrays, static=static, attrs=attrs)

