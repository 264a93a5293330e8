"""The snapshot loop of the Eulerian solver: from save time to save time, with an explicit run state.

`EulerianController(solver).snapshots(f0, times, start)` integrates through the save times
(PyClaw's evolve_to_time, py-pde's Controller) and yields a record per snapshot. After every
accepted step (`after_step`): the Courant guard; the atom update; with extrapolated velocities, a
refresh of the exact fluxes when it is due, at a save time, at a switch of layer or when the
atoms changed; the density guards; sup_x div_S v and its time integral (trapezoidal rule over
the steps, or over the exact evaluations when the velocity is extrapolated), which give the
a-posteriori density bound ℓ₀·exp(−∫₀ᵗ sup div v ds); and at a switch of layer the new layer's
summation objects and its sup div v (the right limit, which starts the next trapezoid).
With tails from log f (spherepde.solvers.tails) a step lands on every coupling time, where the
tail cells are substituted right after the atom update (a change of the source measure); a run
with tails continues from a snapshot at a coupling time (log_density_time = time).

A run can be continued from any snapshot: the record of a snapshot holds all the state besides
the density (SolverState.from_record), so `snapshots(f0, times, start=state)` continues exactly
as the uninterrupted run did.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..storage.schema import ATOM_ARRAYS
from ..transport.stepping import StepSizeCollapse
from .guards import RunFailure
from .tails import coupling_schedule
from .timeline import segments

TAIL_RECORDS = ("tail_cells", "tail_mass_moved", "tail_drift", "tail_retraced")  # LogTails.last: of the last coupling

__all__ = ["EulerianController", "RunState", "SolverState"]


@dataclass(frozen=True)
class SolverState:
    """The solver state at snapshot `index` of a run: with it, snapshots() continues exactly as
    the uninterrupted run did (the density and every number the next steps depend on)."""

    index: int
    density: np.ndarray
    safety: float
    steps: int
    rejected: int
    sup_div: float
    integral: float
    max_sup_div: float
    velocity_interval: float = 0.0
    velocity_interval_linear: float = 0.0
    atoms: dict | None = None  # Atoms.state() (arrays and counters), when atoms are on
    heat_products: int = 0  # sparse products of the heat flow so far, with noise
    log_density: np.ndarray | None = None  # g = log f at the centroids, with tails
    log_density_rate: np.ndarray | None = None  # g's rate over the last coupling interval, with tails
    tail_record: dict | None = None  # the last coupling's TAIL_META records (tail_cells, …), with tails
    peak_log_density: np.ndarray | None = None  # the atoms' peak log densities, with tail_reference "clusters"

    @classmethod
    def from_record(cls, index, density, record, arrays=None):
        """The state of a snapshot from its density, its SNAPSHOT_META (and ATOM_META) record and,
        with atoms, its arrays atom_position, atom_mass, atom_created (and log_density with tails)."""
        atoms = None
        if arrays is not None and "atom_mass" in arrays:
            atoms = {name: np.array(arrays[name], dtype=float) for name in ATOM_ARRAYS}
            atoms.update(created=int(record["atoms_created"]), merged=int(record["atoms_merged"]),
                         refused=int(record["atoms_refused"]))
        return cls(index, np.array(density, dtype=float), float(record["step_safety"]),
                   int(record["steps"]), int(record["steps_rejected"]), float(record["sup_div"]),
                   float(record["integrated_sup_div"]), float(record["max_sup_div"]),
                   float(record["velocity_interval"]), float(record["velocity_interval_linear"]), atoms,
                   int(record.get("heat_products", 0)),
                   *(None if arrays is None or name not in arrays else np.array(arrays[name], dtype=float)
                     for name in ("log_density", "log_density_rate")),
                   {name: record[name] for name in TAIL_RECORDS if name in record} or None,
                   None if arrays is None or "atom_peak_log_density" not in arrays
                   else np.array(arrays["atom_peak_log_density"], dtype=float))


@dataclass
class RunState:
    """What the loop carries from step to step (times in units of the dynamics, sup div v in
    1/time). t, sup_div: the last evaluation of sup div v (the start of the next trapezoid);
    integral: ∫₀ᵗ sup div v ds; t_step: the end of the last accepted step; t_save: the save time
    being integrated to; f: the density at the start of the step being taken (the atoms feed on
    it); ell0 = min f₀ and mass0 (of the whole measure at t = 0); rejected: rejected steps since
    t = 0."""

    t: float
    sup_div: float
    integral: float
    max_sup_div: float
    t_step: float
    ell0: float
    mass0: float
    t_save: float = math.nan
    f: np.ndarray | None = None
    rejected: int = 0
    couplings: tuple = ()  # the tails' coupling times in the save interval being integrated


class EulerianController:
    """Drives an EulerianSolver from save time to save time (module docstring); after a run,
    `state` is its RunState."""

    def __init__(self, solver):
        self.solver = solver
        self.state = None

    def snapshots(self, f0, times, start: SolverState | None = None, log_f0=None):
        """Integrate through the increasing times (times[0] = 0 is the start), yielding
        (k, t, f, record) at each: record holds the per-snapshot quantities of SNAPSHOT_META.
        start: continue from the state saved at snapshot start.index (f0 is still the t = 0
        density, for ℓ₀ and the mass); the snapshots after it are yielded. log_f0: with tails,
        log f₀ at the centroids (default: the log of f0).
        Raises RunFailure when a guard fires."""
        solver = self.solver
        mesh, atoms, velocity, stepper = solver.mesh, solver.atoms, solver.velocity, solver.stepper
        f = np.array(f0, dtype=float)
        if f.shape != (mesh.npix,):
            raise ValueError(f"f0 must have shape ({mesh.npix},), got {f.shape}")
        ell0, mass0 = float(f.min()), float(mesh.integrate(f))
        velocity.use(times[0] if start is None else times[start.index])  # no switch: the state is given
        if atoms is not None:
            solver.restore_atoms(None if start is None else start.atoms)
            if start is not None and start.index == 0:
                mass0 += atoms.total_mass  # a start with atoms given at t = 0
        if start is None:
            start = SolverState(index=0, density=f, safety=1.0, steps=0, rejected=0,
                                sup_div=solver.checked_sup_divergence(times[0], f, mass0), integral=0.0,
                                max_sup_div=-math.inf)
            first = 0
        else:
            f = np.array(start.density, dtype=float)
            first = start.index + 1
        tails = solver.tails
        couplings = coupling_schedule(times, tails.interval) if tails is not None else None
        if tails is not None:
            if start.index > 0 and start.log_density is None:
                raise ValueError("a run with tails continues from a state with its log_density")
            rate = None
            if start.index > 0:
                if times[start.index] not in couplings[start.index - 1]:
                    raise ValueError(f"a run with tails continues from a snapshot at a coupling time, not "
                                     f"t = {times[start.index]:g} (its log_density is of the last coupling)")
                g, rate = start.log_density, start.log_density_rate
                if tails.follow and rate is None:
                    raise ValueError("a run whose tails follow g continues from a state with its log_density_rate")
                if tails.reference == "clusters" and start.peak_log_density is None:
                    raise ValueError("a run whose tail level is relative to the clusters continues from a state "
                                     "with its atom_peak_log_density")
            else:
                with np.errstate(divide="ignore"):
                    g = np.log(f) if log_f0 is None else log_f0
            tails.start(times[start.index], g, f, atoms, rate, last=start.tail_record if start.index > 0 else None,
                        peaks=start.peak_log_density if start.index > 0 else None)
        # the stepper counts over its lifetime; report the counts since t = 0
        steps_before = stepper.steps - start.steps
        rejected_before = stepper.rejected - start.rejected
        products_before = 0 if solver.diffusion is None else solver.diffusion.products - start.heat_products
        stepper.safety = start.safety  # the step-size controller has state
        self.state = state = RunState(t=times[start.index], sup_div=start.sup_div, integral=start.integral,
                                      max_sup_div=max(start.max_sup_div, start.sup_div), t_step=times[start.index],
                                      ell0=ell0, mass0=mass0)
        lag = velocity.lag
        velocity.forget_routes()
        if lag is not None:
            lag.intervals = [start.velocity_interval_linear, start.velocity_interval]
            lag.forget()
            velocity.refresh(times[start.index], f)
            lag.clear_error()
            velocity.forget_routes()

        for k in range(first, len(times)):
            state.t_save = times[k]
            state.f = f
            if k > 0:
                breaks = tuple(solver.schedule.switch_times)
                if tails is not None:
                    state.couplings = couplings[k - 1]
                    breaks += tuple(c for c in state.couplings if c != state.t_save)
                try:
                    # a step lands on every switch time (spherepde.models.schedule) and coupling time
                    for t0, t1 in segments(times[k - 1], state.t_save, breaks):
                        f = stepper.advance(f, t0, t1, callback=self.after_step)
                except StepSizeCollapse as exc:
                    raise RunFailure(f"time step collapsed to {exc.dt:.3e} < dt_floor {stepper.dt_floor:g}",
                                     exc.t, f"cell {exc.cell} (fastest outflow)", density=exc.density) from None
            state.rejected = stepper.rejected - rejected_before
            velocity.forget_routes()
            lag_error = 0.0
            if lag is not None:
                lag_error = lag.max_error
                lag.clear_error()
                if k > 0:
                    lag.reset()
            yield k, state.t_save, f, self.record(f, stepper.steps - steps_before, lag_error, products_before)

    def after_step(self, t, fnew):
        """After every accepted step, ending at t with the density fnew (module docstring)."""
        solver, state = self.solver, self.state
        velocity, lag = solver.velocity, solver.velocity.lag
        stepper = solver.stepper
        solver.guards.courant(t, fnew, stepper.last_courant, stepper.last_courant_cell, solver.courant_limit)
        dt, state.t_step = t - state.t_step, t  # the step just taken
        changed = False
        if solver.atoms is not None:
            changed = solver.update_atoms(t, state.f, fnew, dt)
            state.f = fnew
            if changed and solver.tails is not None:
                solver.tails.forget_anchor()
        if t in state.couplings:  # exactly: the step was cut to land there
            changed = solver.couple_tails(t, fnew) or changed
        elif solver.tails is not None:  # a smooth change of tiny values: the flux history goes on
            solver.follow_tails(t, fnew)
        # the next step starts at t: a new layer there is a switch (treated like a save time)
        switching = solver.schedule.key_at(t) != velocity.key
        if lag is not None:
            solver.guards.density(t, fnew, solver.total_mass(fnew), state.mass0)
            boundary = t == state.t_save or switching
            if not boundary and not lag.due(t, dt) and not changed:
                return
            if changed:  # a new source measure: the flux history restarts from here
                lag.forget()
            if boundary:
                velocity.forget_routes()  # a resumed run evaluates this refresh afresh
            # the extrapolation error is not measured where the followed tails overwrite the fluxes' result
            velocity.unmeasured = None if solver.tails is None else solver.tails.followed_edges
            velocity.refresh(t, fnew)
            div = velocity.at_cells(fnew)[1]
            solver.guards.divergence(t, fnew, div)
            s = float(div.max())
        else:
            s = solver.checked_sup_divergence(t, fnew, state.mass0)
        state.integral += 0.5 * (state.sup_div + s) * (t - state.t)
        state.t, state.sup_div = t, s
        state.max_sup_div = max(state.max_sup_div, s)
        if switching:
            self.switch(t, fnew)

    def switch(self, t, f):
        """After a step that ended at a switch time t: the new layer's summation objects and exact
        fluxes (EulerianVelocity.switch), and its sup div v at t (guarded), which starts the next
        trapezoid of ∫ sup div v."""
        solver, state = self.solver, self.state
        solver.velocity.switch(t, f)
        solver.switches += 1
        div = solver.velocity.at_cells(f)[1]
        solver.guards.divergence(t, f, div)
        state.sup_div = float(div.max())
        state.max_sup_div = max(state.max_sup_div, state.sup_div)

    def record(self, f, steps, lag_error, products_before) -> dict:
        """The per-snapshot record (SNAPSHOT_META, ATOM_META, NOISE_META) of the state at its
        save time."""
        solver, state = self.solver, self.state
        lag, atoms, mesh = solver.velocity.lag, solver.atoms, solver.mesh
        t_save = state.t_save
        record = {
            "time": t_save,
            "mass": solver.total_mass(f),
            "min_density": float(f.min()),
            "max_density": float(f.max()),
            "sup_div": state.sup_div,
            "integrated_sup_div": state.integral,
            "lower_bound_aposteriori": state.ell0 * math.exp(-state.integral),
            "steps": steps,
            "steps_rejected": state.rejected,
            "step_safety": solver.stepper.safety,
            "max_sup_div": state.max_sup_div,
            "velocity_interval": 0.0 if lag is None else lag.intervals[1],
            "velocity_interval_linear": 0.0 if lag is None else lag.intervals[0],
            "velocity_lag_error": lag_error,
        }
        if atoms is not None:
            share = solver.background_share(f)
            record.update({"atom_background_share": share,
                           "background_share_max": float(np.nanmax(share)) if np.isfinite(share).any() else math.nan})
            record.update({"atom_count": atoms.count, "atom_mass_total": atoms.total_mass,
                           "mesh_mass": mesh.integrate(f), "atoms_created": atoms.created_count,
                           "atoms_merged": atoms.merged_count, "atoms_refused": atoms.refused_count})
        if solver.tails is not None:
            record.update(solver.tails.last, log_density_time=solver.tails.t,
                          log_density_anchor=solver.tails.anchor_time)
        if solver.noise is not None:
            record.update({"noise": solver.noise(t_save), "noise_integral": solver.noise.integral(0.0, t_save),
                           "heat_products": solver.diffusion.products - products_before})
        return record
