"""Edge fluxes between velocity evaluations: polynomial extrapolation with an adaptive interval.

The attention velocity changes on the time scale of the flow (O(1)), the Courant-limited step
on the scale of a cell (h/|v|), so at fine meshes nearly all the work of the exact scheme goes
into evaluating a velocity that has barely moved since the previous stage. With a velocity
tolerance ε > 0 the Eulerian solver evaluates the field exactly only at refresh points and uses,
at every stage time τ after the latest refresh t_c until the next one, the interpolating
polynomial of the latest two or three refreshes (Newton form, divided differences [·]):

    un(τ) = un_c + (τ − t_c)[un_c, un_b] + (τ − t_c)(τ − t_b)[un_c, un_b, un_a].

Transport with these fluxes is the same finite-volume scheme (conservative, and positive under
the same Courant bound, which the stepper checks on the fluxes it is given); only the velocity
lags. Degree-p extrapolation errs by un^{(p+1)}/(p+1)!·Π(τ − t_i), largest at the end of the
interval, which is where the next exact evaluation measures it:

    e = max |un_exact − un_extrapolated| / max |un_exact|      (relative, in edge-flux units)

The interval Δ_p between refreshes is steered per degree so that e ≈ ε/2 (e ∝ Δ^{p+1}):
Δ_p ← clip(s·(ε/(2e))^{1/(p+1)}, Δ_p/4, 2Δ_p), with s the time elapsed since the previous
refresh. The quadratic (p = 2) is the steady state: on a smooth flow e ∝ Δ³ lets it take about
(ε/2)^{−1/6} ≈ 3× (ε = 1e-3) longer intervals than the linear one for the same error. The linear
one bridges a cold start. A refresh comes at the end of the last step that stays within Δ; if Δ
falls below a step, the stages are evaluated exactly (the scheme is then the exact-stage one)
while e is still measured. The measured e is reported per snapshot, so the lag error of a run is
on record, not assumed.

Cold start (the history restarts at every snapshot, so that a resumed run repeats the
uninterrupted one): with one refresh held, the first exact stage evaluation after it (the
predictor stage of the step, at t + dt) is taken into the history (`record_stage`), so the
linear extrapolation starts after one step instead of after a second full refresh; its error,
O(dt²) in the state, enters the slope as O(dt) and is measured at the next refresh like any other.
The next refresh replaces that stage point, so the quadratic only ever uses refreshes.

The history may hold another state than the fluxes, from which the fluxes follow (the Eulerian
solver with atoms keeps the mesh density's softmax moments, spherepde.summation.points): the
same polynomials extrapolate that state, and the error e is measured on the fluxes it gives.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["ExtrapolatedFlux"]

# growth and shrink limits of the refresh interval per refresh
MAX_GROWTH = 2.0
MIN_SHRINK = 0.25
# extrapolate up to this multiple of the interval (steps vary in length); beyond, exact stages
OVERSHOOT = 1.25


class ExtrapolatedFlux:
    """History of exact edge fluxes and the polynomial extrapolation between refreshes.

    tolerance: ε above. intervals: (Δ₁, Δ₂), the current refresh intervals of the linear and the
    quadratic extrapolation (time units; 0: not yet known: the quadratic then starts from Δ₁,
    and with Δ₁ unknown the stages are exact until the first error measurement sets it).
    degree: the highest extrapolation degree (1 or 2). After reset() the history holds one
    point; with fewer than two, `predict` is not available (the caller then evaluates exactly,
    and hands the first such stage to record_stage).
    """

    def __init__(self, tolerance: float, shape, intervals=(0.0, 0.0), degree: int = 2):
        if not (math.isfinite(tolerance) and tolerance > 0):
            raise ValueError(f"velocity tolerance must be a positive number, got {tolerance!r}")
        if degree not in (1, 2):
            raise ValueError(f"extrapolation degree must be 1 or 2, got {degree!r}")
        self.tolerance = float(tolerance)
        self.max_degree = degree
        self.intervals = [float(intervals[0]), float(intervals[1])]
        self._times = []     # at most max_degree + 1 refresh times, oldest first
        self._fluxes = []    # the exact fluxes at those times (owned copies)
        self._out = np.empty(shape)
        self._work = np.empty(shape)
        self.max_error = 0.0  # largest measured error of used extrapolations since clear_error()
        self._used = False    # whether predict() served a stage since the last refresh
        self._stage_point = False  # whether the latest point is a cold start's stage (record_stage)

    @property
    def warm(self) -> bool:
        """At least two refresh points are held: the fluxes between refreshes can be extrapolated."""
        return len(self._times) >= 2

    @property
    def degree(self) -> int:
        """The degree of the extrapolation from the history held (0: cold)."""
        return len(self._times) - 1

    @property
    def interval(self) -> float:
        """The refresh interval of the current degree (0 when cold or not yet known)."""
        p = self.degree
        if p < 1:
            return 0.0
        own = self.intervals[p - 1]
        return own if own > 0.0 or p == 1 else self.intervals[0]

    @property
    def last_time(self) -> float:
        return self._times[-1]

    @property
    def latest(self):
        """The exact fluxes of the last refresh (do not modify)."""
        return self._fluxes[-1]

    def due(self, t: float, dt: float) -> bool:
        """Whether to refresh at the end of a step at t, the next step expected to be dt long:
        cold history, or that step would extrapolate beyond the interval."""
        return not self.warm or t + dt - self._times[-1] > self.interval * (1.0 + 1e-12)

    def usable(self, tau: float) -> bool:
        """Whether un(τ) may be extrapolated: warm, and τ not far beyond the interval (a step that
        grew). When the controller wants refreshes more often than once per step, the stages are
        evaluated exactly, and the extrapolation error is only measured until it may be used again."""
        return self.warm and tau - self._times[-1] <= OVERSHOOT * self.interval

    def predict(self, tau: float, out=None):
        """un(τ) by extrapolation from the latest refreshes (degree self.degree)."""
        self._used = True
        return self._extrapolate(tau, out)

    def _extrapolate(self, tau, out=None):
        out = self._out if out is None else out
        times, fluxes = self._times, self._fluxes
        tc, tb = times[-1], times[-2]
        uc, ub = fluxes[-1], fluxes[-2]
        slope = self._work
        np.subtract(uc, ub, out=slope)
        slope /= tc - tb  # [un_c, un_b]
        if self.degree == 2:
            ta, ua = times[0], fluxes[0]
            # [un_c, un_b, un_a] = ([un_c, un_b] − [un_b, un_a])/(t_c − t_a), into out
            np.subtract(ub, ua, out=out)
            out *= -1.0 / (tb - ta)
            out += slope
            out *= (tau - tc) * (tau - tb) / (tc - ta)
            slope *= tau - tc
            out += slope
        else:
            np.multiply(slope, tau - tc, out=out)
        out += uc
        return out

    def refresh(self, t: float, exact, to_flux=None, unmeasured=None) -> float:
        """Record the exact fluxes at t. Warm: measure the extrapolation error at t, adapt the
        interval of the degree used and return the error (0 when cold). to_flux: when the history
        holds another state than the fluxes (the mesh part of split sums, spherepde.solvers.eulerian), the
        map from a state to its edge fluxes (its result may be a reused buffer); the error is then
        that of the fluxes, as defined above. unmeasured: None, or a boolean mask of the edges (first
        axis of the fluxes) left out of e: fluxes whose result the solver overwrites after every
        step (between two tail cells that follow g, spherepde.solvers.tails)."""
        error = 0.0
        if self.warm and t > self._times[-1]:
            predicted = self._extrapolate(t)
            if to_flux is None:
                exact_flux = exact
            else:
                predicted = np.array(to_flux(predicted))
                exact_flux = to_flux(exact)
            if unmeasured is not None and unmeasured.any():
                predicted, exact_flux = predicted[~unmeasured], exact_flux[~unmeasured]
            scale = float(np.max(np.abs(exact_flux)))
            diff = float(np.max(np.abs(predicted - exact_flux)))
            error = diff / scale if scale > 0 else 0.0
            if self._used:  # the error of fluxes the solver actually used
                self.max_error = max(self.max_error, error)
            self._adapt(self.degree, t - self._times[-1], error)
        self._used = False
        if self._stage_point and t > self._times[-1]:
            # the stage served the linear bridge only: a quadratic through it and a point one
            # step away would amplify its O(dt²) error by (Δ/dt)²
            self._times.pop()
            self._fluxes.pop()
        self._stage_point = False
        self._append(t, exact)
        return error

    def record_stage(self, t: float, exact):
        """Cold start: take the exact fluxes of a stage at t > the only refresh held into the
        history (module docstring). Ignored unless exactly one point is held."""
        if len(self._times) == 1 and t > self._times[-1]:
            self._append(t, exact)
            self._stage_point = True

    def _adapt(self, p, elapsed, error):
        """Steer Δ_p from an error measured after `elapsed` (e ∝ elapsed^{p+1})."""
        current = self.interval
        wanted = math.inf if error == 0.0 else elapsed * (0.5 * self.tolerance / error) ** (1.0 / (p + 1))
        if current <= 0.0:  # first measurement: no interval to grow from
            self.intervals[p - 1] = min(MAX_GROWTH * elapsed, wanted)
        else:
            # an interval cut short by a save time must not inflate the next one
            self.intervals[p - 1] = min(MAX_GROWTH * current, max(MIN_SHRINK * current, wanted))

    def _append(self, t, exact):
        if self._times and t == self._times[-1]:
            self._fluxes[-1][...] = exact
            return
        full = len(self._times) == self.max_degree + 1
        buf = self._fluxes.pop(0) if full else np.empty_like(self._out)
        if full:
            self._times.pop(0)
        buf[...] = exact
        self._times.append(float(t))
        self._fluxes.append(buf)

    def reset(self):
        """Forget all but the latest refresh (a cold start that a resumed run repeats exactly)."""
        del self._times[:-1]
        del self._fluxes[:-1]
        self._stage_point = False

    def forget(self):
        """Drop the whole history (a new run starts)."""
        self._times.clear()
        self._fluxes.clear()
        self._stage_point = False

    def clear_error(self):
        self.max_error = 0.0
