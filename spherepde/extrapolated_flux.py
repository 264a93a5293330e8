"""Edge fluxes between velocity evaluations: linear extrapolation with an adaptive interval.

The attention velocity changes on the time scale of the flow (O(1)), the Courant-limited step
on the scale of a cell (h/|v|), so at fine meshes nearly all the work of the exact scheme goes
into evaluating a velocity that has barely moved since the previous stage. With a velocity
tolerance ε > 0 the Eulerian solver evaluates the field exactly only at refresh points t_a < t_b
and uses, at every stage time τ ≥ t_b until the next refresh,

    un(τ) = un_b + (τ − t_b)·(un_b − un_a)/(t_b − t_a).

Transport with these fluxes is the same finite-volume scheme (conservative, and positive under
the same Courant bound, which the stepper checks on the fluxes it is given); only the velocity
lags. Linear extrapolation errs by ½ü·s(s + t_b − t_a) at τ = t_b + s, largest at the end of the
interval, which is where the next exact evaluation measures it:

    e = max |un_exact − un_extrapolated| / max |un_exact|      (relative, in edge-flux units)

The interval Δ between refreshes is steered so that e ≈ ε/2 (e ∝ Δ²):
Δ ← clip(s·√(ε/(2e)), Δ/4, 2Δ), with s the time elapsed since the previous refresh. A refresh
comes at the end of the last step that stays within Δ; if Δ falls below a step, the stages are
evaluated exactly (the scheme is then the exact-stage one) while e is still measured.
The measured e is reported per snapshot, so the lag error of a run is on record, not assumed.
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
    """History of exact edge fluxes and the linear extrapolation between refreshes.

    tolerance: ε above. interval: the current refresh interval Δ (time units; 0: not yet known,
    then the stages are exact until the first error measurement sets it). After reset() the
    history holds one point; with fewer than two, `predict` is not available (the caller then
    evaluates exactly at every stage, which is the cold start after a snapshot).
    """

    def __init__(self, tolerance: float, interval: float, shape):
        if not (math.isfinite(tolerance) and tolerance > 0):
            raise ValueError(f"velocity tolerance must be a positive number, got {tolerance!r}")
        self.tolerance = float(tolerance)
        self.interval = float(interval)
        self._times = []     # at most two refresh times, oldest first
        self._fluxes = []    # the exact fluxes at those times (owned copies)
        self._out = np.empty(shape)
        self.max_error = 0.0  # largest measured error of used extrapolations since clear_error()
        self._used = False    # whether predict() served a stage since the last refresh

    @property
    def warm(self) -> bool:
        """Two refresh points are held: the fluxes between refreshes can be extrapolated."""
        return len(self._times) == 2

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
        """un(τ) by linear extrapolation from the two latest refreshes."""
        self._used = True
        return self._extrapolate(tau, out)

    def _extrapolate(self, tau, out=None):
        (ta, tb), (ua, ub) = self._times, self._fluxes
        out = self._out if out is None else out
        s = (tau - tb) / (tb - ta)
        np.subtract(ub, ua, out=out)
        out *= s
        out += ub
        return out

    def refresh(self, t: float, exact) -> float:
        """Record the exact fluxes at t. Warm: measure the extrapolation error at t, adapt the
        interval and return the error (0 when cold)."""
        error = 0.0
        if self.warm and t > self._times[-1]:
            scale = float(np.max(np.abs(exact)))
            diff = float(np.max(np.abs(self._extrapolate(t) - exact)))
            error = diff / scale if scale > 0 else 0.0
            if self._used:  # the error of fluxes the solver actually used
                self.max_error = max(self.max_error, error)
            # the interval that would have given ε/2 (e ∝ elapsed²); an interval cut short by a
            # save time must not inflate the next one
            elapsed = t - self._times[-1]
            wanted = math.inf if error == 0.0 else elapsed * math.sqrt(0.5 * self.tolerance / error)
            if self.interval <= 0.0:  # first measurement: no interval to grow from
                self.interval = min(MAX_GROWTH * elapsed, wanted)
            else:
                self.interval = min(MAX_GROWTH * self.interval, max(MIN_SHRINK * self.interval, wanted))
        self._used = False
        if self._times and t == self._times[-1]:
            self._fluxes[-1][...] = exact
            return error
        buf = self._fluxes.pop(0) if self.warm else np.empty_like(self._out)
        if self.warm:
            self._times.pop(0)
        buf[...] = exact
        self._times.append(float(t))
        self._fluxes.append(buf)
        return error

    def reset(self):
        """Forget all but the latest refresh (a cold start that a resumed run repeats exactly)."""
        del self._times[:-1]
        del self._fluxes[:-1]

    def forget(self):
        """Drop the whole history (a new run starts)."""
        self._times.clear()
        self._fluxes.clear()

    def clear_error(self):
        self.max_error = 0.0
