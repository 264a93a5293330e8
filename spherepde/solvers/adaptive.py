"""Adaptive time steps for particles: embedded Runge–Kutta pairs on the sphere with error control.

The pair advances the state y = (x, log f) (positions on S^{d−1}, the carried log-density when
there is one) as the fixed-step schemes of spherepde.solvers.particles do: a projection method.
Stage i is evaluated at the normalised point

    X_i = N(x + h Σ_j a_ij k_j),   k_i = v(X_i),   N(y) = y/|y|,

the solution of order p and the embedded one of order q = p − 1 are

    x₁ = N(x + h Σ b_i k_i),   x̂₁ = N(x + h Σ b̂_i k_i),
    g₁ = g − h Σ b_i div v(X_i),   ĝ₁ = g − h Σ b̂_i div v(X_i)    (g = log f).

This is the pair applied to the smooth extension v(y/|y|) of the field off the sphere followed by
a projection onto it, so both keep their orders (Hairer, Lubich & Wanner, Geometric Numerical
Integration, §IV.4). The model of a step's start time is held for all its stages.

Error norm (one number per system): the largest, over the particles of the system, of the chordal
distance |x₁ − x̂₁| and of |g₁ − ĝ₁| = h|Σ (b_i − b̂_i) div v(X_i)| (an error in log f is a
relative error of f), divided by atol + rtol·|x| = atol + rtol (dimensionless: lengths on the
unit sphere). A step is accepted when err ≤ 1; err is O(h^{q+1}) (local error of the embedded
solution).

Controller (per system): the PI controller of Hairer's DOPRI5 (Gustafsson 1991; Hairer, Nørsett
& Wanner, Solving ODEs I, §II.4): after an accepted step of size h with error err,

    h_new = h · clip(safety · err^{−α} · err_prev^{β}, fac_min, fac_max),
    β = 0.2/(q+1), α = 1/(q+1) − 0.75β, safety 0.9, fac_min 0.2, fac_max 10,

err_prev = max(err of the last accepted step, 1e-4) (its memory). After a rejected step
h_new = h · max(fac_min, safety · err^{−1/(q+1)}), and the next accepted step does not grow. A
step lands exactly on the end of its interval (a save time or a switch of layer): when the rest
is at most 1.01 h it is taken whole; a step shortened to land keeps the proposed h for the next
one. The controller's state (h, err_prev, step counts) is what a resumed run needs
(StepControl.state()).

Both pairs have the FSAL property (the last stage is the field at x₁): the next step reuses it
unless the model changed at its start (a switch of layer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .guards import RunFailure

__all__ = ["EmbeddedPair", "PAIRS", "StepControl", "AdaptiveStepper", "embedded_step", "STEP_STATE", "STEP_FLOOR"]

# the controller's state per system, saved per snapshot (spherepde.storage.schema.ADAPTIVE_META)
STEP_STATE = ("step_size", "error_memory", "steps", "steps_rejected")
# relative to max(1, |t|): a step below this is a collapse (a RunFailure), not a tiny step
STEP_FLOOR = 1e-12


@dataclass(frozen=True)
class EmbeddedPair:
    """Butcher tableau of an explicit embedded pair: a (s × s, strictly lower), c, b (order p),
    b_hat (order q = p − 1); fsal: the last row of a is b (the last stage is the field at x₁)."""

    name: str
    order: int
    a: tuple
    b: tuple
    b_hat: tuple

    @property
    def stages(self) -> int:
        return len(self.b)

    @property
    def embedded_order(self) -> int:
        return self.order - 1

    @property
    def fsal(self) -> bool:
        return tuple(self.a[-1]) == tuple(self.b[:-1]) and self.b[-1] == 0.0

    @property
    def evaluations_per_step(self) -> int:
        return self.stages - 1 if self.fsal else self.stages


# Dormand & Prince 1980, RK5(4)7FM
DOPRI5 = EmbeddedPair(
    "dopri5", 5,
    a=((),
       (1 / 5,),
       (3 / 40, 9 / 40),
       (44 / 45, -56 / 15, 32 / 9),
       (19372 / 6561, -25360 / 2187, 64448 / 6561, -212 / 729),
       (9017 / 3168, -355 / 33, 46732 / 5247, 49 / 176, -5103 / 18656),
       (35 / 384, 0.0, 500 / 1113, 125 / 192, -2187 / 6784, 11 / 84)),
    b=(35 / 384, 0.0, 500 / 1113, 125 / 192, -2187 / 6784, 11 / 84, 0.0),
    b_hat=(5179 / 57600, 0.0, 7571 / 16695, 393 / 640, -92097 / 339200, 187 / 2100, 1 / 40),
)

# Bogacki & Shampine 1989, RK3(2)
BS32 = EmbeddedPair(
    "bs32", 3,
    a=((),
       (1 / 2,),
       (0.0, 3 / 4),
       (2 / 9, 1 / 3, 4 / 9)),
    b=(2 / 9, 1 / 3, 4 / 9, 0.0),
    b_hat=(7 / 24, 1 / 4, 1 / 3, 1 / 8),
)

PAIRS = {pair.name: pair for pair in (DOPRI5, BS32)}

SAFETY, FAC_MIN, FAC_MAX = 0.9, 0.2, 10.0
ERROR_MEMORY_FLOOR = 1e-4  # err_prev never below it (Hairer's facold)
LAND = 1.01  # a rest of at most LAND·h is taken in one step


def _normalise(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _combine(coefficients, stages):
    """Σ_j c_j k_j over the nonzero coefficients, in index order (the same arithmetic for every
    system); None when all are zero."""
    total = None
    for c, k in zip(coefficients, stages):
        if c != 0.0:
            total = c * k if total is None else total + c * k
    return total


def embedded_step(pair: EmbeddedPair, x, log_f, dt, field, first=None):
    """One step of the pair from positions x (m, n, d) (log-densities log_f (m, n) or None) with
    steps dt (m,): (x₁, x̂₁, g₁ or None, g₁ − ĝ₁ or None, (k_s, div_s) the last stage) as in the
    module docstring. field(X) → (v (m, n, d), div (m, n) or None) at stage points X; first: the
    first stage (k₁, div₁) when known (FSAL), else evaluated at x."""
    v, div = field(x) if first is None else first
    ks, divs = [v], [div]
    scale = dt[:, None, None]
    x_new = None
    for i in range(1, pair.stages):
        stage = _normalise(x + scale * _combine(pair.a[i], ks))
        if pair.fsal and i == pair.stages - 1:
            x_new = stage  # the last stage is the solution (a_s = b): the same arithmetic
        v, div = field(stage)
        ks.append(v)
        divs.append(div)
    if x_new is None:
        x_new = _normalise(x + scale * _combine(pair.b, ks))
    x_hat = _normalise(x + scale * _combine(pair.b_hat, ks))
    g_new = g_diff = None
    if log_f is not None:  # d log f/dt = −div v(x(t)): no stages of log f itself
        g_new = log_f - dt[:, None] * _combine(pair.b, divs)
        g_diff = -dt[:, None] * _combine([b - bh for b, bh in zip(pair.b, pair.b_hat)], divs)
    return x_new, x_hat, g_new, g_diff, (ks[-1], divs[-1])


class StepControl:
    """The step-size controller of M systems (module docstring): arrays (M,) of the next step h,
    err_prev, accepted and rejected steps since t = 0."""

    def __init__(self, pair: EmbeddedPair, systems: int, h0: float):
        self.pair = pair
        q1 = pair.embedded_order + 1
        self.beta = 0.2 / q1
        self.alpha = 1.0 / q1 - 0.75 * self.beta
        self.exponent = 1.0 / q1
        self.h = np.full(systems, float(h0))
        self.error_memory = np.full(systems, ERROR_MEMORY_FLOOR)
        self.steps = np.zeros(systems, dtype=np.int64)
        self.rejected = np.zeros(systems, dtype=np.int64)

    def state(self) -> dict:
        """{name: array (M,)} of STEP_STATE: what a run file stores per snapshot."""
        return {"step_size": self.h.copy(), "error_memory": self.error_memory.copy(),
                "steps": self.steps.copy(), "steps_rejected": self.rejected.copy()}

    def restore(self, state: dict):
        """Take a state() back (arrays (M,) or scalars for one system)."""
        m = self.h.size
        self.h = np.broadcast_to(np.asarray(state["step_size"], dtype=float), (m,)).copy()
        self.error_memory = np.broadcast_to(np.asarray(state["error_memory"], dtype=float), (m,)).copy()
        self.steps = np.broadcast_to(np.asarray(state["steps"]), (m,)).astype(np.int64)
        self.rejected = np.broadcast_to(np.asarray(state["steps_rejected"]), (m,)).astype(np.int64)

    def update(self, idx, dt, err, accepted, after_rejection, shortened):
        """New h of systems idx after steps of sizes dt (arrays over idx) with errors err;
        accepted, after_rejection (the last try of the system was rejected), shortened (the step
        was cut to land, below the proposed h) are boolean arrays over idx."""
        h_prop = self.h[idx]
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            finite = np.isfinite(err)
            grow = err ** self.alpha / self.error_memory[idx] ** self.beta
            factor = np.clip(SAFETY / np.where(finite, grow, np.inf), FAC_MIN, FAC_MAX)
            shrink = np.maximum(FAC_MIN, SAFETY * np.where(finite & (err > 0), err, np.inf) ** -self.exponent)
        h_acc = dt * factor
        h_acc = np.where(after_rejection, np.minimum(h_acc, dt), h_acc)
        h_acc = np.where(shortened, np.maximum(h_acc, h_prop), h_acc)
        self.h[idx] = np.where(accepted, h_acc, dt * np.minimum(shrink, 1.0))
        self.error_memory[idx] = np.where(accepted, np.maximum(err, ERROR_MEMORY_FLOOR), self.error_memory[idx])
        self.steps[idx] += accepted
        self.rejected[idx] += ~accepted


class AdaptiveStepper:
    """Advances M systems of particles over a time interval with an embedded pair (module
    docstring), each system with its own steps. Positions (M, n, d), log-densities (M, n) or None.

    field(xs, ts, count) → (v (m, n, d), div (m, n) or None): the field of the systems xs (m, n, d)
    with the models of the step start times ts (m,); count: whether the evaluation counts as a new
    one. key(t): the model's key at t (equal keys: the same model; the FSAL stage is reused only
    under the key it was evaluated with)."""

    def __init__(self, pair: EmbeddedPair, rtol: float, atol: float, systems: int, h0: float):
        if not (math.isfinite(rtol) and math.isfinite(atol) and rtol >= 0 and atol >= 0 and rtol + atol > 0):
            raise ValueError(f"rtol and atol must be >= 0 and not both 0, got rtol={rtol!r}, atol={atol!r}")
        if not (math.isfinite(h0) and h0 > 0):
            raise ValueError(f"the initial step must be a positive number, got {h0!r}")
        self.pair, self.rtol, self.atol = pair, float(rtol), float(atol)
        self.control = StepControl(pair, systems, h0)
        self._k1 = self._div1 = None  # the FSAL stage per system
        self._k1_key = [None] * systems  # the model key of each valid stage; None: none
        self._uncounted = False  # the next first stages were counted by the uninterrupted run

    def forget(self, counted_before: bool = False):
        """Drop the FSAL stages. counted_before: the uninterrupted run had them (a run resumed at
        a snapshot that is no switch of layer), so evaluating them again does not count."""
        self._k1_key = [None] * len(self._k1_key)
        self._uncounted = bool(counted_before)

    def advance(self, x, log_f, t0, t1, field, key):
        """x, log_f advanced in place from t0 to t1 (every system lands exactly on t1).
        Raises RunFailure when a system's step collapses (below STEP_FLOOR·max(1, |t|))."""
        m = x.shape[0]
        if self._k1 is None or self._k1.shape != x.shape:
            self._k1 = np.empty_like(x)
            self._div1 = None if log_f is None else np.empty_like(log_f)
        t = np.full(m, float(t0))
        after_rejection = np.zeros(m, dtype=bool)
        while True:
            idx = np.flatnonzero(t < t1)
            if idx.size == 0:
                return
            self._try(x, log_f, t, t1, idx, after_rejection, field, key)

    def _first_stage(self, x, log_f, t, idx, field, key):
        """k₁ (and div v there) of systems idx: the FSAL stage where it is valid, else evaluated."""
        keys = [key(t[i]) for i in idx]
        stale = np.array([self._k1_key[i] is None or self._k1_key[i] != k for i, k in zip(idx, keys)])
        if stale.any():
            s = idx[stale]
            v, div = field(x[s], t[s], not self._uncounted)
            self._k1[s] = v
            if log_f is not None:
                self._div1[s] = div
            for i in s:
                self._k1_key[i] = key(t[i])
        self._uncounted = False
        return self._k1[idx], (None if log_f is None else self._div1[idx])

    def _try(self, x, log_f, t, t1, idx, after_rejection, field, key):
        """One step attempt of the systems idx (accepted or rejected per system)."""
        pair, control = self.pair, self.control
        h_prop = control.h[idx]
        rest = t1 - t[idx]
        lands = rest <= LAND * h_prop
        dt = np.where(lands, rest, h_prop)
        ts = t[idx]
        first = self._first_stage(x, log_f, t, idx, field, key)
        x_new, x_hat, g_new, g_diff, last = embedded_step(pair, x[idx], None if log_f is None else log_f[idx], dt,
                                                          lambda stage: field(stage, ts, True), first)
        err = np.max(np.linalg.norm(x_new - x_hat, axis=-1), axis=-1)
        if log_f is not None:
            err = np.maximum(err, np.max(np.abs(g_diff), axis=-1))
        err = err / (self.atol + self.rtol)
        accepted = err <= 1.0  # NaN: rejected
        shortened = lands & (dt < h_prop)
        control.update(idx, dt, err, accepted, after_rejection[idx], shortened)
        after_rejection[idx] = ~accepted
        done = idx[accepted]
        if done.size:
            x[done] = x_new[accepted]
            if log_f is not None:
                log_f[done] = g_new[accepted]
            t[done] = np.where(lands[accepted], t1, t[done] + dt[accepted])
            if pair.fsal:  # the last stage is the field at the new x, under the step's model
                self._k1[done] = last[0][accepted]
                if log_f is not None:
                    self._div1[done] = last[1][accepted]
                # (its key stays that of the step's start: a switch at t1 makes it stale)
            else:
                for i in done:
                    self._k1_key[i] = None
        floor = STEP_FLOOR * np.maximum(1.0, np.abs(t[idx]))
        small = np.flatnonzero(control.h[idx] < floor)
        if small.size:
            i = idx[small[0]]
            raise RunFailure(f"particle step size collapsed to {control.h[i]:.3e} (error control, rtol {self.rtol:g})",
                             t[i], f"system {i}" if x.shape[0] > 1 else None, positions=x[i])
