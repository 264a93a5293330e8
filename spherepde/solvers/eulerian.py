"""The Eulerian mean-field solver: finite-volume transport in the attention velocity of f itself.

∂_t f + div_S(f v[f]) = 0 with v[f] the attention field (spherepde.summation). By default the
velocity is recomputed from the current stage density at every Runge–Kutta stage, at the edge
quadrature points. With velocity_tolerance ε > 0 it is evaluated exactly only every Δ in time and
extrapolated linearly in between (spherepde.transport.extrapolated), Δ steered so that the measured
relative extrapolation error stays near ε/2; after each snapshot the history restarts (one step
with exact stages), so that a resumed run repeats the uninterrupted one exactly.
Along the way the solver records the quantities of the density lower bound:
ℓ₀ = min f₀, min f_t, sup_x div_S v (evaluated at the cell centroids after every step, or at
every exact velocity evaluation when ε > 0) and its time integral (trapezoidal rule), which give
the a-posteriori bound ℓ₀·exp(−∫₀ᵗ sup div v ds) and the paper's form ½ℓ₀e^{−C₀t}.

With noise (a spherepde.models.noise.NoiseSchedule ν(t)) the equation is ∂_t f + div_S(f v[f]) = ν(t)Δ_S f:
the Laplace–Beltrami operator of spherepde.transport.diffusion, integrated exactly inside the
SSP-RK2 stages in integrating-factor form (spherepde.transport.stepping): second order in time,
positive and conservative for any ν dt, no extra velocity evaluations. Diffusion only raises
the minimum of f, so the density lower bound above still holds. Atoms are refused with noise:
a point mass under Brownian motion is no longer a point (the exact solution has none for t > 0),
and a sub-cell cluster that diffusion spreads out would stay an atom.

Every step passes the run guards (spherepde.solvers.guards), which raise RunFailure with the time, the
cell and the state at failure. The loop over the save times is spherepde.solvers.controller (a
run continues exactly from any snapshot); the velocity, exact, extrapolated or split, is
spherepde.solvers.velocity; an in-memory run is laid out by spherepde.storage (one schema with
the run file).

With atoms (spherepde.solvers.atoms) the state is the measure f dA + Σ m_k δ_{x_k}: the atoms are point
sources of every velocity evaluation, move with the Runge–Kutta stages of the mesh, and after
every step are fed, created and merged (in that order) on the new density. The mass guard and
the record `mass` are those of the whole measure; min f and the density bounds stay on f.
With atoms and ε > 0 the sums are split: the mesh part is extrapolated, the atoms are added
exactly at every stage (spherepde.solvers.velocity).

Several heads and layers (spherepde.models.heads): the model may be a MultiHeadModel (the velocity and
div_S v are sums over the heads, each head with its own summation tables, spherepde.summation.heads;
atoms are sources and targets of every head), a Schedule (spherepde.models.schedule: weights piecewise constant in
depth) or a callable t ↦ (B, V, β). Every step uses the model of its start time: the integration
is cut at the switch times of a Schedule (spherepde.solvers.timeline.segments), so that a step lands
on each, and the model of the next step is taken after every accepted step. When it changes (a
switch) the field jumps, so: the summation objects are rebuilt for the new model; the step's
end is treated like a save time (exact fluxes of the old model, which close its extrapolation
error measurement and the trapezoid of ∫ sup div v); then the extrapolation history is dropped
and restarted with the new model's exact fluxes, and sup div v is re-evaluated with the new model
(the right limit, which starts the next trapezoid). A run resumed from a snapshot therefore repeats
the uninterrupted one across switches, and layers of equal weights give the single-layer run.

With tails (spherepde.solvers.tails, `tails={...}`) the state also holds g = log f at the centroids,
carried along characteristics: at every coupling time (as far apart as tails["interval"] allows,
whatever the saves: spherepde.solvers.tails.coupling_schedule; a step lands on each) the tail
cells of f take the cell averages of e^g, the bulk and the atoms are scaled to keep the mass, and the source measure has changed (the
extrapolated fluxes restart, as after an atom event). It needs atoms, one head and no noise.
"""

from __future__ import annotations

import numpy as np
import xarray as xr

from ..models.checks import check_model
from ..models.schedule import schedule_of
from ..storage.memory import memory_dataset
from ..storage.schema import (ATOM_ARRAYS, ATOM_DIAGNOSTICS, ATOM_META, NOISE_META, SNAPSHOT_META, TAIL_ARRAYS,
                              TAIL_META, TAIL_PEAK_ARRAYS)
from ..summation import DEFAULT_TOL
from ..transport import FluxDivergence, SSPStepper
from ..transport.diffusion import MeshDiffusion
from .atoms import Atoms
from .controller import EulerianController, SolverState
from .guards import Guards
from .tails import LogTails
from .timeline import progress_bar, save_times
from .velocity import EulerianVelocity

__all__ = ["EulerianSolver"]


class EulerianSolver:
    """Solve the mean-field continuity equation on a HealpixMesh for an AttentionModel (or a
    MultiHeadModel, a Schedule, a callable t ↦ (B, V, β): module docstring; turned into a schedule once).

    scheme "muscl" or "upwind"; cfl the outflow Courant number; rk_order 2 or 3; guards the
    tolerances of the run guards (spherepde.solvers.guards.Guards; defaults never fire on a healthy run).
    summation ("auto" | "direct" | "tree") and tolerance: the attention sums (attention_field);
    near_field: exact kernel integrals over the cells around the peak (AttentionField);
    near_field_profile: "constant" | "log_linear", the density inside the near cells of the sums at
    the atoms (EulerianVelocity); None: "log_linear" with tails (their slopes are accurate),
    else "constant".
    velocity_tolerance: 0 (exact velocity at every stage) or ε > 0, the relative error allowed
    to the edge fluxes extrapolated between exact evaluations (self.velocity, EulerianVelocity).
    atoms: None (density only) or a dict of Atoms options (capacity, width, min_mass, merge):
    the state becomes density plus atoms (module docstring); self.atoms is the Atoms.
    noise: None or a spherepde.models.noise.NoiseSchedule (module docstring); with ν ≢ 0 it needs
    rk_order 2 and no atoms (ValueError otherwise); self.diffusion is then the MeshDiffusion.
    tails: None or a dict of LogTails options (interval, level, exclusion): the tails from log f
    (module docstring; needs atoms, one head, no noise); self.tails is the LogTails.
    self.switches counts the layer switches taken (spherepde.models.schedule).
    """

    def __init__(self, mesh, model, scheme: str = "muscl", cfl: float = 0.5, rk_order: int = 2,
                 guards: Guards | None = None, summation: str = "auto", tolerance: float = DEFAULT_TOL,
                 near_field: bool = True, velocity_tolerance: float = 0.0, atoms: dict | None = None,
                 noise=None, tails: dict | None = None, near_field_profile: str | None = None):
        self.schedule = schedule_of(model)  # the one conversion (spherepde.models.schedule)
        for head in self.schedule.heads or ():
            check_model(head.B, head.V, head.beta)
        self.noise = None if noise is None or noise.is_zero else noise
        if self.noise is not None and atoms is not None:
            raise ValueError("atoms do not combine with noise: a point mass under Brownian motion spreads "
                             "(run with atoms off)")
        if self.noise is not None and rk_order != 2:
            raise ValueError(f"noise needs rk_order 2 (the integrating-factor step), got {rk_order!r}")
        self.mesh = mesh
        self.scheme = scheme
        self.cfl = cfl
        self.rk_order = rk_order
        self.guards = Guards() if guards is None else guards
        self.operator = FluxDivergence(mesh, scheme)
        # the guard's own copy of the stepper's bound: it checks the stepper, not itself
        self.courant_limit = max(cfl, self.operator.positivity_courant)
        self.switches = 0
        self.atoms = None if atoms is None else Atoms(mesh, **atoms)
        if near_field_profile is None:
            near_field_profile = "constant" if tails is None else "log_linear"
        self.velocity = EulerianVelocity(mesh, self.schedule, self.atoms, summation=summation, tolerance=tolerance,
                                         near_field=near_field, velocity_tolerance=velocity_tolerance,
                                         near_field_profile=near_field_profile)
        self.diffusion = None if self.noise is None else MeshDiffusion(mesh)
        self.stepper = SSPStepper(self.operator, self.velocity.stage_flux, order=rk_order, cfl=cfl,
                                  dt_floor=self.guards.dt_floor,
                                  point_velocity=None if atoms is None else self.velocity.atom_velocity,
                                  diffusion=self.diffusion, noise=self.noise)
        self.tails = None if tails is None else self._log_tails({"profile": near_field_profile, **tails})
        self.controller = None

    def _log_tails(self, options):
        head = self.schedule.single_head
        if self.atoms is None or self.noise is not None or head is None:
            raise ValueError("tails from log f need atoms, one head and no noise")
        return LogTails(self.mesh, head, **options)

    @property
    def velocity_tolerance(self) -> float:
        return self.velocity.velocity_tolerance

    @property
    def near_field_active(self) -> bool:
        """Whether any target of any layer gets near-field corrections (recorded in the run file)."""
        return self.velocity.near_field_active

    # ------------------------------------------------------------------ the measure
    def total_mass(self, f) -> float:
        """∫f dA plus the mass of the atoms."""
        mass = self.mesh.integrate(f)
        return mass if self.atoms is None else mass + self.atoms.total_mass

    def restore_atoms(self, state=None):
        """The atoms of a SolverState (None: no atom), and the stepper carries them."""
        atoms = self.atoms
        if state is not None:
            atoms.restore(state["atom_position"], state["atom_mass"], state["atom_created"], state["created"],
                          state["merged"], state["refused"])
        else:
            atoms.restore(np.full((atoms.capacity, 3), np.nan), np.zeros(atoms.capacity),
                          np.full(atoms.capacity, np.nan))
        self.sync_points()

    def update_atoms(self, t, f_old, f_new, dt) -> bool:
        """After an accepted step of size dt: the atoms take the stepper's positions, then feeding,
        creation and merging on f_new (in place). True when a peak moved to an atom or atoms
        merged (the source measure changed by more than a feed)."""
        atoms = self.atoms
        if atoms.count:
            atoms.set_points(self.stepper.points)
        divergence = self.operator.divergence  # of the last stage's edge fluxes
        atoms.feed(f_old, f_new, divergence)
        changed = atoms.create(t, f_new, divergence, f_old, dt) > 0
        changed = atoms.merge() > 0 or changed
        self.sync_points()
        return changed

    def background_share(self, f):
        """Per atom slot, the mesh density's share of the softmax weight at the atom
        (EulerianVelocity.background_share; NaN in an empty slot)."""
        share = np.full(self.atoms.capacity, np.nan)
        share[self.atoms.alive] = self.velocity.background_share(f)
        return share

    def couple_tails(self, t, f) -> bool:
        """At a coupling time: g advanced to t and the tail cells of f taken from it (LogTails.couple,
        in place on f and the atoms' masses). True when the measure changed."""
        return self.tails.couple(t, f, self.atoms)

    def follow_tails(self, t, f):
        """Between coupling times: the tail cells follow g's rate (LogTails.follow_tail, in place
        on f and the atoms' masses)."""
        self.tails.follow_tail(t, f, self.atoms)

    def sync_points(self):
        """The stepper carries the living atoms (None when there are none)."""
        if self.atoms is not None:
            self.stepper.points = self.atoms.points()[0].copy() if self.atoms.count else None

    def sup_divergence(self, f) -> float:
        return float(self.velocity.at_cells(f)[1].max())

    def checked_sup_divergence(self, t, f, mass0) -> float:
        """The guards on f, then sup div v (guarded too)."""
        self.guards.density(t, f, self.total_mass(f), mass0)
        div = self.velocity.at_cells(f)[1]
        self.guards.divergence(t, f, div)
        return float(div.max())

    # ------------------------------------------------------------------ runs
    def snapshots(self, f0, times, start: SolverState | None = None, log_f0=None):
        """Integrate through the increasing times (times[0] = 0 is the start), yielding
        (k, t, f, record) at each (spherepde.solvers.controller.EulerianController.snapshots).
        log_f0: with tails, log f₀ at the centroids (default log of the cell averages f0).
        After the last, self.controller.state is the RunState (ell0, max_sup_div, rejected)."""
        self.controller = EulerianController(self)
        return self.controller.snapshots(f0, times, start, log_f0)

    def run(self, f0, t_end: float, save_every: float, C0: float | None = None,
            progress: bool = False, on_snapshot=None, log_f0=None) -> xr.Dataset:
        """Integrate from t = 0 to t_end, keeping snapshots every save_every (and at t_end).

        C0: constant of the paper's bound ½ℓ₀e^{−C₀t}; default the largest sup div v seen.
        on_snapshot(index, time, f, record): called as soon as each snapshot exists.
        log_f0: with tails, log f₀ at the centroids (default: the log of f0).
        Returns an xarray.Dataset laid out as a run file (spherepde.storage.memory): density(time,
        cell) and the per-snapshot records (with atoms: their records and atom_position(time,
        atom, xyz), atom_mass, atom_created; with tails: their records and log_density(time, cell)).
        """
        times = save_times(t_end, save_every)
        bar = progress_bar(t_end) if progress else None
        records, densities, atom_states = [], [], []
        for k, t, f, rec in self.snapshots(f0, times, log_f0=log_f0):
            records.append(rec)
            densities.append(f.copy())
            if self.atoms is not None:
                atom_states.append(dict(self.atoms.state(), **{name: rec[name] for name in ATOM_DIAGNOSTICS}))
                if self.tails is not None:
                    atom_states[-1]["log_density"] = self.tails.g.copy()
                    atom_states[-1]["log_density_rate"] = self.tails.rate.copy()
                    if self.tails.reference == "clusters":
                        atom_states[-1]["atom_peak_log_density"] = self.tails.peak_state()
            if on_snapshot is not None:
                on_snapshot(k, t, f, rec)
            if bar is not None:
                bar.update(t - bar.n)
        if bar is not None:
            bar.close()
        state = self.controller.state
        c0 = state.max_sup_div if C0 is None else float(C0)
        time = np.array([r["time"] for r in records])
        meta = dict(SNAPSHOT_META, **(ATOM_META if self.atoms is not None else {}),
                    **(NOISE_META if self.noise is not None else {}), **(TAIL_META if self.tails is not None else {}))
        series = {name: (np.array([r[name] for r in records]), long_name, units)
                  for name, (long_name, units) in meta.items()}
        series["lower_bound_paper"] = (0.5 * state.ell0 * np.exp(-c0 * time), "½ ℓ₀ exp(−C₀ t)", "sr-1")
        layout = dict(ATOM_ARRAYS, **ATOM_DIAGNOSTICS, **(TAIL_ARRAYS if self.tails is not None else {}),
                      **(TAIL_PEAK_ARRAYS if self.tails is not None and self.tails.reference == "clusters" else {}))
        arrays = {name: (dims, np.array([a[name] for a in atom_states]), long_name, units)
                  for name, (dims, long_name, units) in layout.items()} if atom_states else {}
        attrs = {"nside": self.mesh.nside, "scheme": self.scheme, "cfl": self.cfl, "rk_order": self.rk_order,
                 "velocity_tolerance": self.velocity_tolerance,
                 "beta": "mixed" if self.schedule.beta is None else self.schedule.beta, "ell0": state.ell0,
                 "C0": c0, "C0_source": "largest sup div v seen in the run" if C0 is None else "user",
                 "rejected_steps": state.rejected}
        if self.noise is not None:
            attrs["noise"] = self.noise.describe()
        return memory_dataset(time, self.mesh, np.array(densities), series, arrays, attrs=attrs)
