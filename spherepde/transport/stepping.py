"""Strong-stability-preserving Runge–Kutta time stepping with an adaptive Courant step.

Shu–Osher form: u⁽⁰⁾ = uⁿ, u⁽ⁱ⁾ = aᵢ uⁿ + bᵢ (u⁽ⁱ⁻¹⁾ + dt L(u⁽ⁱ⁻¹⁾, tⁿ + cᵢ dt)). Every stage is
a convex combination of forward-Euler steps (SSP coefficient 1), so the positivity of one Euler
step under the outflow Courant bound carries over to the whole step.

Carried points (the atoms of spherepde.solvers.atoms): points P on S² that move with the same stages,
P⁽ⁱ⁾ = N(aᵢ Pⁿ + bᵢ (P⁽ⁱ⁻¹⁾ + dt w(P⁽ⁱ⁻¹⁾))), N(p) = p/|p| and w their tangent velocity at the
stage state (u⁽ⁱ⁻¹⁾, P⁽ⁱ⁻¹⁾). The normalisation only rescales (its change of direction is
O(dt³) per step), so the stepper keeps its order for the points.

Diffusion (noise, ∂_t f + div_S(f v) = ν(t) Δ_S f): with a MeshDiffusion D and a schedule ν(t),
the steps are the integrating-factor (Lawson) form of the same Shu–Osher method. With
E(s₀, s₁) = exp(N(t + s₀dt, t + s₁dt) L) the exact heat flow over a part of the step (N the
integral of ν, spherepde.models.noise) and τᵢ the time fraction that stage i represents
(τ₀ = 0, τᵢ = bᵢ(τᵢ₋₁ + 1)),

    u⁽ⁱ⁾ = aᵢ E(0, τᵢ) uⁿ + bᵢ E(τᵢ₋₁, τᵢ)(u⁽ⁱ⁻¹⁾ + dt L_T(u⁽ⁱ⁻¹⁾)),

L_T the transport operator. This is the Runge–Kutta method applied to w(t) = E(t, 0)⁻¹ f(t), so it
keeps the method's order (2 for SSP-RK2) for the coupled transport–diffusion equation, with the
diffusion integrated exactly; no extra velocity evaluations; E is positive, conservative and
contractive in L¹ and L^∞, so every stage is still a convex combination of forward-Euler
transport steps followed by positive heat flows: positivity and conservation hold under the same
Courant bound, for any ν dt. It needs non-decreasing τᵢ (a backward heat flow is not defined):
true for SSP-RK2 (τ = 0, 1, 1), false for SSP-RK3 (τ = 0, 1, ½, 1), which is therefore refused
with diffusion (Isherwood, Grant & Gottlieb 2018 on SSP integrating-factor methods).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["SSP_RK", "SSPStepper", "StepSizeCollapse", "stage_fractions"]

# (a_i, b_i, c_i) per stage, c_i the time fraction at which L is evaluated in stage i.
SSP_RK = {
    2: ((0.0, 1.0, 0.0), (0.5, 0.5, 1.0)),
    3: ((0.0, 1.0, 0.0), (0.75, 0.25, 1.0), (1.0 / 3.0, 2.0 / 3.0, 0.5)),
}


def stage_fractions(tableau):
    """τ₀ = 0, τᵢ = bᵢ(τᵢ₋₁ + 1): the fraction of the step that stage i of a Shu–Osher tableau
    represents (its aᵢ part is uⁿ, at fraction 0)."""
    tau = [0.0]
    for _, b, _ in tableau:
        tau.append(b * (tau[-1] + 1.0))
    return tuple(tau)


class StepSizeCollapse(FloatingPointError):
    """The Courant-limited step fell below dt_floor. Carries where: t, dt, the cell of the fastest
    outflow (the one that limits dt) and the density f at t (the state the step started from)."""

    def __init__(self, t, dt, cell, density):
        super().__init__(f"time step collapsed to {dt:.3e} at t = {t:.6g}, cell {cell}")
        self.t, self.dt, self.cell, self.density = t, dt, cell, density


class SSPStepper:
    """Advance f by SSP-RK steps whose size follows the outflow Courant number.

    operator: a FluxDivergence; edge_flux(t, f) → un (nedges, nq), the velocity's edge fluxes at
    time t for state f (the state enters for nonlocal velocities). dt = cfl / max_c outflow_c at
    the start of the step, times a safety factor ≤ 1. A later stage whose Courant number
    exceeds max(cfl, positivity bound) rejects the step, which is retried with a smaller dt.

    In a concentrating nonlocal flow the outflow rate grows during the step, so with cfl at the
    positivity bound nearly every step would be rejected. The safety factor is a proportional
    controller that aims the largest stage Courant number at 95 % of the stage limit: it shrinks
    after a rejection or a step close to the limit and recovers (≤ 5 % per step, at most 1).

    point_velocity: None, or w(t, f, points) → (n, 3) tangent velocities of carried points; then
    edge_flux is called as edge_flux(t, f, points), and self.points (n, 3), set by the caller,
    moves with the stages (module docstring) and is replaced after every accepted step.

    diffusion, noise: a spherepde.transport.diffusion.MeshDiffusion and a schedule with
    integral(t0, t1) = ∫ν (spherepde.models.noise.NoiseSchedule): the steps then solve
    ∂_t f + div_S(f v) = ν(t) Δ_S f in integrating-factor form (module docstring; rk order 2 only,
    no carried points). A step over which ν vanishes is the plain step, bit for bit.

    State carried from step to step: safety (and the counters steps, rejected); a run restored
    with the same safety continues exactly as it would have. After each accepted step,
    last_courant is its largest stage Courant number and last_courant_cell the cell where it
    occurred. A Courant-limited dt below dt_floor raises StepSizeCollapse (a dt cut short to land
    on a save time is not a collapse).
    """

    def __init__(self, operator, edge_flux, order: int = 2, cfl: float = 0.5,
                 dt_floor: float = 1e-12, point_velocity=None, diffusion=None, noise=None):
        if order not in SSP_RK:
            raise ValueError(f"rk order must be one of {sorted(SSP_RK)}, got {order!r}")
        if (diffusion is None) != (noise is None):
            raise ValueError("diffusion and noise go together: give both or neither")
        self.fractions = stage_fractions(SSP_RK[order])
        if diffusion is not None:
            if any(b < a for a, b in zip(self.fractions, self.fractions[1:])):
                raise ValueError(f"rk order {order} has stage times {self.fractions} that go back: the "
                                 "integrating-factor step with diffusion needs rk order 2")
            if point_velocity is not None:
                raise ValueError("carried points (atoms) do not combine with diffusion")
        self.diffusion, self.noise = diffusion, noise
        if not (math.isfinite(cfl) and cfl > 0):
            raise ValueError(f"cfl must be a positive number, got {cfl!r}")
        self.operator = operator
        self.edge_flux = edge_flux
        self.point_velocity = point_velocity
        self.points = None
        self.order = order
        self.tableau = SSP_RK[order]
        self.cfl = float(cfl)
        self.stage_limit = max(self.cfl, operator.positivity_courant)
        self.dt_floor = dt_floor
        n = operator.mesh.npix
        self._stage = np.empty(n)
        self._rhs = np.empty(n)
        self.steps = 0
        self.rejected = 0
        self.max_courant = 0.0
        self.last_courant = 0.0
        self.last_courant_cell = -1
        self.safety = 1.0

    def step(self, f, t: float, dt_max: float):
        """One step from (t, f), not longer than dt_max. Returns (f_new, dt); f is not modified."""
        op = self.operator
        # copy: providers may reuse one buffer, and later stages would overwrite it before a
        # rejected step is retried from un0
        points = self.points if self.point_velocity is not None else None
        un0 = np.array(self._flux(t, f, points), copy=True)
        w0 = None if points is None else self.point_velocity(t, f, points)
        rate0 = op.max_outflow_rate(un0)  # also leaves op's per-cell rates for un0 in place
        dt = dt_max if rate0 <= 0.0 else min(dt_max, self.safety * self.cfl / rate0)
        while True:
            if dt < self.dt_floor and dt < dt_max:
                raise StepSizeCollapse(t, dt, int(np.argmax(op.outflow)), f)
            new, stage_rate = self._attempt(f, t, dt, un0, points, w0)
            if new is not None:
                self.steps += 1
                if points is not None:
                    new, self.points = new
                if self._step_courant > 0 and dt * rate0 >= 0.5 * self.safety * self.cfl:
                    # only steps sized by the Courant number (not cut by dt_max) steer the factor
                    factor = 0.95 * self.stage_limit / self._step_courant
                    self.safety = min(1.0, self.safety * min(1.05, max(0.7, factor)))
                return new, dt
            self.rejected += 1
            self.safety = max(0.1, 0.9 * self.safety * self.stage_limit / (dt * stage_rate))
            dt = 0.9 * self.stage_limit / stage_rate
            op.flow_rates(un0)  # the first stage reuses un0's rates

    def _flux(self, t, f, points):
        return self.edge_flux(t, f) if points is None else self.edge_flux(t, f, points)

    def _heat_amounts(self, t, dt):
        """N over [t + τᵢ₋₁dt, t + τᵢdt] per stage i and N over [t, t + τᵢdt] (None without
        diffusion, or when ν = 0 over the whole step: then the plain stages run)."""
        if self.diffusion is None:
            return None
        tau = self.fractions
        parts = [self.noise.integral(t + a * dt, t + b * dt) for a, b in zip(tau, tau[1:])]
        whole = [self.noise.integral(t, t + b * dt) for b in tau[1:]]
        return None if not any(parts) and not any(whole) else (parts, whole)

    def _attempt(self, f, t, dt, un0, points=None, w0=None):
        """Run the stages; (f_new, None), or (None, offending outflow rate) if a stage is too fast.
        With carried points, f_new is the pair (f_new, points_new)."""
        heat = self._heat_amounts(t, dt)
        if heat is not None:
            return self._attempt_diffusive(f, t, dt, un0, heat)
        op = self.operator
        prev = f
        prev_points = points
        courant, courant_cell = 0.0, -1
        last = len(self.tableau) - 1
        for i, (a, b, c) in enumerate(self.tableau):
            if i == 0:
                un, w = un0, w0
            else:
                un = self._flux(t + c * dt, prev, prev_points)
                if points is not None:
                    w = self.point_velocity(t + c * dt, prev, prev_points)
                op.flow_rates(un)
            cell = int(np.argmax(op.outflow))
            rate = float(op.outflow[cell])
            if dt * rate > self.stage_limit * (1.0 + 1e-12):
                return None, rate
            if dt * rate > courant:
                courant, courant_cell = dt * rate, cell
            op(prev, un, self._rhs, rates_ready=True)
            # stage = a·f + b·(prev + dt·L(prev)); prev may be self._stage itself: the update
            # goes through self._rhs first, so overwriting the stage buffer is safe.
            stage = np.empty_like(f) if i == last else self._stage
            np.multiply(self._rhs, dt, out=self._rhs)
            np.add(self._rhs, prev, out=self._rhs)
            np.multiply(self._rhs, b, out=stage)
            if a != 0.0:
                stage += a * f
            if points is not None:
                moved = b * (prev_points + dt * w)
                if a != 0.0:
                    moved += a * points
                prev_points = moved / np.linalg.norm(moved, axis=1, keepdims=True)
            prev = stage
        self.max_courant = max(self.max_courant, courant)
        self._step_courant = courant
        self.last_courant, self.last_courant_cell = courant, courant_cell
        return (prev if points is None else (prev, prev_points)), None

    def _attempt_diffusive(self, f, t, dt, un0, heat):
        """The stages in integrating-factor form (module docstring); (f_new, None) or (None, rate)."""
        op = self.operator
        parts, whole = heat
        flow = self.diffusion.propagate
        prev = f
        courant, courant_cell = 0.0, -1
        flowed_f = {}  # E(0, τ) f, by τ (SSP-RK2 needs it once)
        for i, (a, b, c) in enumerate(self.tableau):
            if i == 0:
                un = un0
            else:
                un = self._flux(t + c * dt, prev, None)
                op.flow_rates(un)
            cell = int(np.argmax(op.outflow))
            rate = float(op.outflow[cell])
            if dt * rate > self.stage_limit * (1.0 + 1e-12):
                return None, rate
            if dt * rate > courant:
                courant, courant_cell = dt * rate, cell
            op(prev, un, self._rhs, rates_ready=True)
            np.multiply(self._rhs, dt, out=self._rhs)
            np.add(self._rhs, prev, out=self._rhs)
            stage = flow(self._rhs, parts[i])  # a new array: prev stays readable until replaced
            stage *= b
            if a != 0.0:
                tau = self.fractions[i + 1]
                if tau not in flowed_f:
                    flowed_f[tau] = flow(f, whole[i])
                stage += a * flowed_f[tau]
            prev = stage
        self.max_courant = max(self.max_courant, courant)
        self._step_courant = courant
        self.last_courant, self.last_courant_cell = courant, courant_cell
        return prev, None

    def advance(self, f, t0: float, t1: float, callback=None):
        """Integrate from t0 to exactly t1. callback(t, f) after every step (it sees the new state
        first, so a caller's checks can name the bad cell). Returns f(t1)."""
        t = t0
        while t < t1:
            remaining = t1 - t
            f, dt = self.step(f, t, remaining)
            # land exactly on t1 instead of leaving a round-off sliver
            t = t1 if dt >= remaining or t1 - (t + dt) < 1e-12 * max(1.0, abs(t1)) else t + dt
            if callback is not None:
                callback(t, f)
            if not np.all(np.isfinite(f)):
                raise FloatingPointError(f"non-finite density at t = {t:.6g}")
        return f
