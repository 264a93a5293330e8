"""Noise: the diffusion coefficient ν(t) of ∂_t f + div_S(f v[f]) = ν(t) Δ_S f, and its time integral.

With noise each token moves by the attention velocity plus a Brownian motion on S² whose
generator is ν(t)Δ_S (dX = v dt + √(2ν) dW on the sphere); the density then obeys the
equation above (docs/theory.md#formulas-and-exact-solutions: the Funk–Hecke growth rates about the uniform state lose νℓ(ℓ+1),
and pure noise gives E[x_t] = e^{−2∫ν} x₀).

Both solvers need only ν(t) and N(t₀, t₁) = ∫_{t₀}^{t₁} ν(s) ds: Δ_S does not depend on time, so
the heat flow over [t₀, t₁] is exactly exp(N(t₀, t₁) Δ_S) whatever the schedule, and a Brownian
increment over that interval has the variance of 2N(t₀, t₁) per tangent direction. Every schedule
below therefore has its integral in closed form.

Schedules ([model] noise_schedule), with ν₀ = [model] noise:

- "constant": ν(t) = ν₀;
- "exponential": ν(t) = ν₀ e^{−t/τ}, τ = noise_time. The continuous-time form of the annealing
  rule of the consensus-based particle codes (CBXpy's `multiply` scheduler multiplies a
  parameter by a fixed factor every step: ν_k = ν₀ q^k with q = e^{−Δt/τ});
- "linear": ν(t) = ν₀ max(0, 1 − t/τ): noise switched off over a time τ, zero after;
- "piecewise": ν(t) = ν₀ s(t), s linear between breakpoints [[0, s₀], [t₁, s₁], …] (noise_breakpoints,
  times strictly increasing from 0, factors ≥ 0), constant s_last after the last one. Any other
  annealing curve can be given this way.
"""

from __future__ import annotations

import math

__all__ = ["NoiseSchedule", "SCHEDULES"]

SCHEDULES = ("constant", "exponential", "linear", "piecewise")


class NoiseSchedule:
    """ν(t) = level · shape(t) for one of SCHEDULES; see the module docstring.

    level ≥ 0 (finite); time τ > 0 for "exponential" and "linear"; breakpoints a sequence of
    (t, factor) pairs for "piecewise", t₀ = 0, times strictly increasing, factors ≥ 0. Raises
    ValueError naming the argument otherwise.
    """

    def __init__(self, level: float, schedule: str = "constant", time: float | None = None,
                 breakpoints=None):
        level = float(level)
        if not (math.isfinite(level) and level >= 0):
            raise ValueError(f"noise level must be a finite number >= 0, got {level!r}")
        if schedule not in SCHEDULES:
            raise ValueError(f"noise schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
        self.level, self.schedule = level, schedule
        self.time = None
        self.breakpoints = None
        if schedule in ("exponential", "linear"):
            if time is None or not (math.isfinite(float(time)) and float(time) > 0):
                raise ValueError(f"noise time must be a finite number > 0 for the {schedule} schedule, got {time!r}")
            self.time = float(time)
        elif schedule == "piecewise":
            if breakpoints is None or len(breakpoints) < 1:
                raise ValueError("noise breakpoints: the piecewise schedule needs at least one [t, factor] pair")
            pts = [(float(t), float(s)) for t, s in breakpoints]
            if pts[0][0] != 0.0:
                raise ValueError(f"noise breakpoints: the first time must be 0, got {pts[0][0]!r}")
            for (t0, _), (t1, _) in zip(pts, pts[1:]):
                if not t1 > t0:
                    raise ValueError(f"noise breakpoints: times must increase strictly, got {t0!r} then {t1!r}")
            for t, s in pts:
                if not (math.isfinite(t) and math.isfinite(s) and s >= 0):
                    raise ValueError(f"noise breakpoints: times and factors must be finite, factors >= 0, got [{t!r}, {s!r}]")
            self.breakpoints = tuple(pts)

    # ------------------------------------------------------------------ values
    @property
    def is_zero(self) -> bool:
        """ν(t) = 0 for every t ≥ 0: no noise at all (the solvers then take their noiseless path)."""
        if self.level == 0.0:
            return True
        return self.schedule == "piecewise" and all(s == 0.0 for _, s in self.breakpoints)

    def __call__(self, t: float) -> float:
        """ν(t) for t ≥ 0."""
        t = float(t)
        if self.schedule == "constant":
            return self.level
        if self.schedule == "exponential":
            return self.level * math.exp(-t / self.time)
        if self.schedule == "linear":
            return self.level * max(0.0, 1.0 - t / self.time)
        return self.level * self._factor(t)

    def integral(self, t0: float, t1: float) -> float:
        """N(t₀, t₁) = ∫_{t₀}^{t₁} ν(s) ds (t₁ ≥ t₀ ≥ 0), in closed form."""
        t0, t1 = float(t0), float(t1)
        if t1 < t0:
            raise ValueError(f"integral needs t1 >= t0, got [{t0!r}, {t1!r}]")
        if self.level == 0.0 or t1 == t0:
            return 0.0
        if self.schedule == "constant":
            return self.level * (t1 - t0)
        if self.schedule == "exponential":
            tau = self.time
            # τ e^{−t₀/τ}(1 − e^{−(t₁−t₀)/τ}), without cancellation for short intervals
            return self.level * tau * math.exp(-t0 / tau) * -math.expm1(-(t1 - t0) / tau)
        if self.schedule == "linear":
            tau = self.time
            b = min(t1, tau)
            if b <= t0:
                return 0.0
            # ∫ (1 − s/τ) ds from t₀ to b = (b − t₀)(1 − (t₀ + b)/(2τ))
            return self.level * (b - t0) * (1.0 - (t0 + b) / (2.0 * tau))
        return self.level * self._factor_integral(t0, t1)

    def _factor(self, t):
        pts = self.breakpoints
        if t >= pts[-1][0]:
            return pts[-1][1]
        for (ta, sa), (tb, sb) in zip(pts, pts[1:]):
            if t < tb:
                return sa + (sb - sa) * (t - ta) / (tb - ta)
        return pts[-1][1]  # not reached

    def _factor_integral(self, t0, t1):
        """∫ s(t) dt over [t₀, t₁]: trapezoids on the pieces the interval meets (exact: s is
        linear on each), the constant tail after the last breakpoint."""
        pts = self.breakpoints
        total = 0.0
        for (ta, _), (tb, _) in zip(pts, pts[1:]):
            a, b = max(t0, ta), min(t1, tb)
            if b > a:
                total += 0.5 * (self._factor(a) + self._factor(b)) * (b - a)
        a = max(t0, pts[-1][0])
        if t1 > a:
            total += pts[-1][1] * (t1 - a)
        return total

    # ------------------------------------------------------------------ records
    def describe(self) -> str:
        """One line for the run file: the formula with its numbers."""
        if self.schedule == "constant":
            return f"nu(t) = {self.level:g}"
        if self.schedule == "exponential":
            return f"nu(t) = {self.level:g} exp(-t/{self.time:g})"
        if self.schedule == "linear":
            return f"nu(t) = {self.level:g} max(0, 1 - t/{self.time:g})"
        pts = ", ".join(f"[{t:g}, {s:g}]" for t, s in self.breakpoints)
        return f"nu(t) = {self.level:g} s(t), s piecewise linear through {pts}, constant after the last"

    def __repr__(self):
        return f"NoiseSchedule({self.describe()})"

    @classmethod
    def from_config(cls, model: dict):
        """The schedule of a resolved [model] section, or None when there is no noise (absent keys:
        a config written before noise existed)."""
        schedule = cls(model.get("noise", 0.0), model.get("noise_schedule", "constant"),
                       model.get("noise_time"), model.get("noise_breakpoints"))
        return None if schedule.is_zero else schedule
