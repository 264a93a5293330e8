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
cell and the state at failure. A run can be continued from any snapshot: the record of a
snapshot holds all the solver state besides the density (SolverState.from_record), so
`snapshots(f0, times, start=state)` continues exactly as the uninterrupted run did.

With atoms (spherepde.solvers.atoms) the state is the measure f dA + Σ m_k δ_{x_k}: the atoms are point
sources of every velocity evaluation, move with the Runge–Kutta stages of the mesh, and after
every step are fed, created and merged (in that order) on the new density. The mass guard and
the record `mass` are those of the whole measure; min f and the density bounds stay on f.
With atoms and ε > 0 the sums are split: the extrapolation history holds, per head, the softmax
mean and log-partition of the mesh density alone at the edge points, and the atoms are added to
them exactly at every stage (spherepde.summation.points). The atoms move, and at large β the
softmax weights between them change fast, while the background changes slowly; the mesh part
is then extrapolated over intervals as long as without atoms. The error e is still measured on
the edge fluxes. (Split only when every head has finite β and every layer as many heads: else
the whole fluxes are extrapolated.)

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import xarray as xr

from ..models.checks import check_model
from ..models.schedule import schedule_of
from ..storage.runfile import (
    CELL_DIM,
    CELL_INDEX_ATTRS,
    TIME_ATTRS,
    attr_value,
    crs_attrs,
    xdggs_attrs,
)
from ..summation import (
    DEFAULT_TOL,
    NearField,
    attention_field,
    mesh_sources,
    table_bytes,
)
from ..summation.field import NEAR_FIELD_MAX_BYTES
from ..summation.heads import HeadsField, heads_field
from ..summation.kernels import unnormalise
from ..summation.points import add_point_sources, point_log_partition
from ..transport import FluxDivergence, SSPStepper, kernels
from ..transport.diffusion import MeshDiffusion
from ..transport.extrapolated import ExtrapolatedFlux
from ..transport.stepping import StepSizeCollapse
from .atoms import ATOM_ARRAYS, ATOM_META, Atoms
from .guards import Guards, RunFailure
from .timeline import progress_bar, save_times, segments

__all__ = ["EulerianSolver", "SNAPSHOT_META", "ATOM_META", "NOISE_META", "SolverState"]

# per-snapshot records of a run: name → (long_name, units)
SNAPSHOT_META = {
    "mass": ("total mass ∫f dA (+ Σ m_k of the atoms, when on)", "1"),
    "min_density": ("min over cells of f_t", "sr-1"),
    "max_density": ("max over cells of f_t", "sr-1"),
    "sup_div": ("sup over cell centroids of div_S v", "1"),
    "integrated_sup_div": ("∫_0^t sup_x div_S v ds (trapezoidal over steps, or over exact velocity evaluations)", "1"),
    "lower_bound_aposteriori": ("ℓ₀ exp(−∫_0^t sup div_S v ds): a-posteriori density lower bound", "sr-1"),
    "steps": ("time steps taken since t = 0", "1"),
    # the rest of the solver state, so that a run can continue from any snapshot (--resume)
    "steps_rejected": ("rejected time steps since t = 0", "1"),
    "step_safety": ("factor of the step-size controller after the last step", "1"),
    "max_sup_div": ("largest sup div v over all steps so far", "1"),
    "velocity_interval": ("time between exact velocity evaluations, quadratic extrapolation "
                          "(0: every Runge–Kutta stage)", "1"),
    "velocity_interval_linear": ("time between exact velocity evaluations, linear extrapolation (the "
                                 "cold start after each snapshot)", "1"),
    "velocity_lag_error": ("largest measured relative error of the extrapolated edge fluxes since the "
                           "previous snapshot (0: exact velocity at every stage)", "1"),
}

# per-snapshot records of a run with noise (only then: files without noise keep their layout)
NOISE_META = {
    "noise": ("diffusion coefficient ν(t) of the noise at the snapshot", "1"),
    "noise_integral": ("∫_0^t ν ds: the heat flow so far is exp(∫ν · Δ_S)", "1"),
    "heat_products": ("sparse products of the heat flow (uniformisation) since t = 0", "1"),
}


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

    @classmethod
    def from_record(cls, index, density, record, arrays=None):
        """The state of a snapshot from its density, its SNAPSHOT_META (and ATOM_META) record and,
        with atoms, its arrays atom_position, atom_mass, atom_created."""
        atoms = None
        if arrays is not None and "atom_mass" in arrays:
            atoms = {name: np.array(arrays[name], dtype=float) for name in ATOM_ARRAYS}
            atoms.update(created=int(record["atoms_created"]), merged=int(record["atoms_merged"]),
                         refused=int(record["atoms_refused"]))
        return cls(index, np.array(density, dtype=float), float(record["step_safety"]),
                   int(record["steps"]), int(record["steps_rejected"]), float(record["sup_div"]),
                   float(record["integrated_sup_div"]), float(record["max_sup_div"]),
                   float(record["velocity_interval"]), float(record["velocity_interval_linear"]), atoms,
                   int(record.get("heat_products", 0)))


class EulerianSolver:
    """Solve the mean-field continuity equation on a HealpixMesh for an AttentionModel (or a
    MultiHeadModel, a Schedule, a callable t ↦ (B, V, β): module docstring; turned into a schedule once).

    scheme "muscl" or "upwind"; cfl the outflow Courant number; rk_order 2 or 3; guards the
    tolerances of the run guards (spherepde.solvers.guards.Guards; defaults never fire on a healthy run).
    summation ("auto" | "direct" | "tree") and tolerance: the attention sums (attention_field);
    near_field: exact kernel integrals over the cells around the peak (AttentionField).
    velocity_tolerance: 0 (exact velocity at every stage) or ε > 0, the relative error allowed
    to the edge fluxes extrapolated between exact evaluations (ExtrapolatedFlux).
    atoms: None (density only) or a dict of Atoms options (capacity, width, min_mass, merge):
    the state becomes density plus atoms (module docstring); self.atoms is the Atoms.
    noise: None or a spherepde.models.noise.NoiseSchedule (module docstring); with ν ≢ 0 it needs
    rk_order 2 and no atoms (ValueError otherwise); self.diffusion is then the MeshDiffusion.
    self.switches counts the model switches taken (spherepde.models.heads).
    """

    def __init__(self, mesh, model, scheme: str = "muscl", cfl: float = 0.5, rk_order: int = 2,
                 guards: Guards | None = None, summation: str = "auto", tolerance: float = DEFAULT_TOL,
                 near_field: bool = True, velocity_tolerance: float = 0.0, atoms: dict | None = None,
                 noise=None):
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
        self.model = model
        self.scheme = scheme
        self.cfl = cfl
        self.rk_order = rk_order
        self.guards = Guards() if guards is None else guards
        self.operator = FluxDivergence(mesh, scheme)
        # the guard's own copy of the stepper's bound: it checks the stepper, not itself
        self.courant_limit = max(cfl, self.operator.positivity_courant)
        self.summation, self.tolerance, self.near_field = summation, tolerance, near_field
        self._field_options = dict(method=summation, tol=tolerance, near_field=near_field)
        self._key = None
        self.switches = 0
        self._use(0.0)  # the summation objects of the model at t = 0
        # whether any target gets near-field corrections (recorded in the output file)
        later = {(h.B.tobytes(), h.beta): h for layer in (self.schedule.layers or ())[1:] for h in layer.heads}
        self.near_field_active = (self._edge_field.near is not None or self._cell_field.near is not None
                                  or any(self._needs_near(h) for h in later.values()))
        self._un = np.empty(mesh.edge_weights.shape)
        self.velocity_tolerance = float(velocity_tolerance)
        self._lag = None
        stage_flux = self.edge_flux
        if self.velocity_tolerance > 0:
            self._lag = ExtrapolatedFlux(self.velocity_tolerance, mesh.edge_weights.shape)
            stage_flux = self._stage_flux
        self.atoms = None if atoms is None else Atoms(mesh, **atoms)
        self._split = None
        if self._lag is not None and self.atoms is not None:
            self._split = self._split_buffers()
            if self._split is not None:
                self._lag = ExtrapolatedFlux(self.velocity_tolerance, self._split["part"].shape)
        self.diffusion = None if self.noise is None else MeshDiffusion(mesh)
        self.stepper = SSPStepper(self.operator, stage_flux, order=rk_order, cfl=cfl,
                                  dt_floor=self.guards.dt_floor,
                                  point_velocity=None if atoms is None else self.atom_velocity,
                                  diffusion=self.diffusion, noise=self.noise)

    def _use(self, t) -> bool:
        """Take the model of a step starting at t (spherepde.models.heads): rebuild the summation objects
        when it is not the current one; True then."""
        key = self.schedule.key_at(t)
        if key == self._key:
            return False
        model = self.schedule.model_at(t)
        self._key, self._active = key, model
        self._heads = model.heads
        self._edge_field = heads_field(model, self.mesh, self.mesh.edge_points.reshape(-1, 3),
                                       **self._field_options)
        # one AttentionField per head (the split sums take each head's mesh part), and what the
        # split sums need of each head: B, Bᵀ, β, V, and the log field scale if unnormalised
        self._edge_heads = (self._edge_field.fields if isinstance(self._edge_field, HeadsField)
                            else [self._edge_field])
        self._split_heads = [(np.ascontiguousarray(h.B, dtype=float), np.ascontiguousarray(h.B.T, dtype=float),
                              float(h.beta), np.ascontiguousarray(h.V, dtype=float),
                              float(h.log_field_scale) if h.unnormalised else None) for h in self._heads]
        self._cell_field = heads_field(model, self.mesh, self.mesh.centroids, **self._field_options)
        return True

    def _needs_near(self, head) -> bool:
        """Whether the summation objects of a head would carry near-field tables (they depend on
        its B and β only)."""
        if not self.near_field or head.zero_temperature:
            return False
        return any(0 < table_bytes(self.mesh, head, targets) <= NEAR_FIELD_MAX_BYTES
                   for targets in (self.mesh.edge_points.reshape(-1, 3), self.mesh.centroids))

    def _switch(self, t, f, state):
        """After a step that ended at a switch time t (module docstring): the new model's
        summation objects, its exact fluxes starting a new extrapolation history, and its sup div v
        at t (guarded), which starts the next trapezoid of ∫ sup div v."""
        self._use(t)
        self.switches += 1
        if self._lag is not None:
            self._lag.forget()
            self._refresh(t, f)
        div = self.velocity_at_cells(f)[1]
        self.guards.divergence(t, f, div)
        state["sup_div"] = float(div.max())
        state["max_sup_div"] = max(state["max_sup_div"], state["sup_div"])

    def _point_sources(self, points):
        """(positions, masses) of the atoms as point sources: at the stage positions `points`
        when given, else where the atoms are; (None, None) without atoms."""
        if self.atoms is None or self.atoms.count == 0:
            return None, None
        x, m = self.atoms.points()
        return (x if points is None else points), m

    def edge_flux(self, t, f, points=None):
        """Edge fluxes un = w (v[ρ]·n) at the edge quadrature points for ρ = f dA (+ the atoms,
        at the stage positions points) (the flow is autonomous)."""
        x, m = self._point_sources(points)
        v, _, _ = self._edge_field(f) if x is None else self._edge_field(f, False, x, m)
        kernels.edge_normal_flux(v.reshape(self.mesh.edge_points.shape), self.mesh.edge_normals,
                                 self.mesh.edge_weights, self._un)
        return self._un

    def atom_velocity(self, t, f, points):
        """Tangent velocities (n, 3) of atoms at points in the field of f dA + Σ m_k δ_{points_k}:
        the atoms are point sources and targets (the local field at β = ∞). The mesh part gets
        the near-field corrections where the kernel is narrower than a cell."""
        x, m = self._point_sources(points)
        sources, masses = mesh_sources(self.mesh, f, x, m)
        total = None
        for head in self._heads:  # every head's field at the atoms, summed (spherepde.models.heads)
            near = None
            if self.near_field and not head.zero_temperature:
                if table_bytes(self.mesh, head, points) > 0:
                    near = NearField(self.mesh, head, points)
            v, _, _ = attention_field(head, sources, masses, points, method=self.summation,
                                      tol=self.tolerance, near=near)
            total = v if total is None else total + v
        return total

    def _stage_flux(self, t, f, points=None):
        """Stage fluxes when the velocity is extrapolated: the stored exact fluxes at the last
        refresh, the extrapolation where it is usable, else the exact fluxes (cold: they start
        the history, ExtrapolatedFlux.record_stage). Split sums: the same for the mesh part,
        the atoms at their stage positions added exactly."""
        lag = self._lag
        flux = (lambda state: state) if self._split is None else (lambda part: self._split_flux(part, points))
        if t == lag.last_time:
            return flux(lag.latest)
        if lag.usable(t):
            return flux(lag.predict(t))
        if self._split is None:
            un = self.edge_flux(t, f, points)
            lag.record_stage(t, un)
            return un
        part = self._mesh_part(f)
        lag.record_stage(t, part)
        return flux(part)

    def _refresh(self, t, f) -> float:
        """Exact edge fluxes (split sums: the mesh part) at (t, f) into the extrapolation history."""
        if self._split is None:
            return self._lag.refresh(t, self.edge_flux(t, f))
        return self._lag.refresh(t, self._mesh_part(f), to_flux=lambda part: self._split_flux(part, None))

    def _split_buffers(self):
        """The work arrays of the split sums (module docstring), or None where they do not apply:
        a head at β = ∞ (its field is local: nothing to split), layers with different head
        counts, or weights from a callable (not known in advance)."""
        layers = self.schedule.layers
        if layers is None:
            return None
        counts = {layer.count for layer in layers}
        if len(counts) != 1 or any(h.zero_temperature for h in self.schedule.heads):
            return None
        targets = np.ascontiguousarray(self.mesh.edge_points.reshape(-1, 3))
        n = targets.shape[0]
        return {"part": np.empty((counts.pop(), n, 4)), "velocity": np.empty((n, 3)), "head": np.empty((n, 3)),
                "targets": targets,
                "mean": np.empty((n, 3)), "logz": np.empty(n), "added": np.empty(n), "no_div": np.empty(0),
                "no_points": (np.empty((0, 3)), np.empty(0))}

    def _mesh_part(self, f):
        """Every head's softmax mean and log-partition of the mesh density alone at the edge
        points: part[h, :, 0:3] = m, part[h, :, 3] = ln Z (a buffer, copied by the history).

        Held to the summation tolerance relative to the whole measure, mesh and atoms: the
        atoms' partition function at each edge point goes with the sums (added_log_partition of
        attention_field), so that where the atoms dominate (around them: late, most targets) the
        mesh part needs no costly re-summing. Half of it, since the atoms move until the next
        refresh; the extrapolation's own error ε ≫ the summation tolerance anyway."""
        work = self._split
        part = work["part"]
        x, m = self._point_sources(None)
        added = None
        if x is not None:
            x = np.ascontiguousarray(x, dtype=float)
            log_m = np.log(m) - math.log(2.0)
            added = work["added"]
        for h, field in enumerate(self._edge_heads):
            if added is not None:
                _, BT, beta, _, _ = self._split_heads[h]
                point_log_partition(work["targets"], BT, beta, x, log_m, added)
            _, _, mean = field(f, False, log_partition=work["logz"], added_log_partition=added)
            part[h, :, :3] = mean
            part[h, :, 3] = work["logz"]
        return part

    def _split_flux(self, part, points):
        """Edge fluxes of the mesh part (from _mesh_part or extrapolated) plus the atoms at points
        (None: where they are), summed exactly (spherepde.summation.points); every head's
        velocity, unnormalised where the head is, summed over the heads."""
        work = self._split
        x, m = self._point_sources(points)
        if x is None:
            x, log_m = work["no_points"]
        else:
            x = np.ascontiguousarray(x, dtype=float)
            log_m = np.log(m)
        total = work["velocity"]
        for h, (B, BT, beta, V, scale) in enumerate(self._split_heads):
            v = total if h == 0 else work["head"]
            add_point_sources(work["targets"], BT, beta, V, part[h], x, log_m, v, work["mean"], work["logz"])
            if scale is not None:  # an unnormalised head
                unnormalise(B, beta, scale, work["logz"], False, v, work["no_div"], work["mean"])
            if h:
                total += v
        kernels.edge_normal_flux(total.reshape(self.mesh.edge_points.shape), self.mesh.edge_normals,
                                 self.mesh.edge_weights, self._un)
        return self._un

    def _forget_routes(self):
        """Snapshot boundary: the summation's routing restarts (AttentionField), like the
        extrapolation history, so that a run resumed here repeats the uninterrupted one."""
        self._edge_field.forget_route()
        self._cell_field.forget_route()

    def velocity_at_cells(self, f):
        """(v, div_S v, m_β) at the cell centroids for the density f (and the atoms)."""
        x, m = self._point_sources(None)
        return self._cell_field(f, want_div=True) if x is None else self._cell_field(f, True, x, m)

    def total_mass(self, f) -> float:
        """∫f dA plus the mass of the atoms."""
        mass = self.mesh.integrate(f)
        return mass if self.atoms is None else mass + self.atoms.total_mass

    def _atom_step(self, t, f_old, f_new, dt) -> bool:
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
        self._sync_points()
        return changed

    def _sync_points(self):
        """The stepper carries the living atoms (None when there are none)."""
        if self.atoms is not None:
            self.stepper.points = self.atoms.points()[0].copy() if self.atoms.count else None

    def sup_divergence(self, f) -> float:
        return float(self.velocity_at_cells(f)[1].max())

    def _checked_sup_divergence(self, t, f, mass0) -> float:
        """The guards on f, then sup div v (guarded too)."""
        self.guards.density(t, f, self.total_mass(f), mass0)
        div = self.velocity_at_cells(f)[1]
        self.guards.divergence(t, f, div)
        return float(div.max())

    def snapshots(self, f0, times, start: SolverState | None = None):
        """Integrate through the increasing times (times[0] = 0 is the start), yielding
        (k, t, f, record) at each: record holds the per-snapshot quantities of SNAPSHOT_META.
        start: continue from the state saved at snapshot start.index (f0 is still the t = 0
        density, for ℓ₀ and the mass); the snapshots after it are yielded.
        After the last, self.last_run has ell0, max_sup_div and this run's rejected steps.
        Raises RunFailure when a guard fires."""
        f = np.array(f0, dtype=float)
        mesh = self.mesh
        if f.shape != (mesh.npix,):
            raise ValueError(f"f0 must have shape ({mesh.npix},), got {f.shape}")
        ell0, mass0 = float(f.min()), float(mesh.integrate(f))
        atoms = self.atoms
        self._use(times[0] if start is None else times[start.index])  # no switch: the state is given
        if atoms is not None:
            if start is not None and start.atoms is not None:
                a = start.atoms
                atoms.restore(a["atom_position"], a["atom_mass"], a["atom_created"], a["created"],
                              a["merged"], a["refused"])
            else:
                atoms.restore(np.full((atoms.capacity, 3), np.nan), np.zeros(atoms.capacity),
                              np.full(atoms.capacity, np.nan))
            self._sync_points()
            if start is not None and start.index == 0:
                mass0 += atoms.total_mass  # a start with atoms given at t = 0
        if start is None:
            start = SolverState(index=0, density=f, safety=1.0, steps=0, rejected=0,
                                sup_div=self._checked_sup_divergence(times[0], f, mass0), integral=0.0,
                                max_sup_div=-math.inf)
            first = 0
        else:
            f = np.array(start.density, dtype=float)
            first = start.index + 1
        # the stepper counts over its lifetime; report the counts since t = 0
        steps_before = self.stepper.steps - start.steps
        rejected_before = self.stepper.rejected - start.rejected
        products_before = 0 if self.diffusion is None else self.diffusion.products - start.heat_products
        self.stepper.safety = start.safety  # the step-size controller has state
        state = {"t": times[start.index], "sup_div": start.sup_div, "integral": start.integral,
                 "max_sup_div": max(start.max_sup_div, start.sup_div), "t_step": times[start.index]}
        self.last_run = state
        lag = self._lag
        self._forget_routes()
        if lag is not None:
            lag.intervals = [start.velocity_interval_linear, start.velocity_interval]
            lag.forget()
            self._refresh(times[start.index], f)
            lag.clear_error()
            self._forget_routes()

        def after_step(t, fnew):
            self.guards.courant(t, fnew, self.stepper.last_courant, self.stepper.last_courant_cell,
                                self.courant_limit)
            dt, state["t_step"] = t - state["t_step"], t  # the step just taken
            changed = False
            if atoms is not None:
                changed = self._atom_step(t, state["f"], fnew, dt)
                state["f"] = fnew
            # the next step starts at t: a new model there is a switch (treated like a save time)
            switching = self.schedule.key_at(t) != self._key
            if lag is not None:
                self.guards.density(t, fnew, self.total_mass(fnew), mass0)
                boundary = t == state["t_save"] or switching
                if not boundary and not lag.due(t, dt) and not changed:
                    return
                if changed:  # a new source measure: the flux history restarts from here
                    lag.forget()
                if boundary:
                    self._forget_routes()  # a resumed run evaluates this refresh afresh
                self._refresh(t, fnew)
                div = self.velocity_at_cells(fnew)[1]
                self.guards.divergence(t, fnew, div)
                s = float(div.max())
            else:
                s = self._checked_sup_divergence(t, fnew, mass0)
            state["integral"] += 0.5 * (state["sup_div"] + s) * (t - state["t"])
            state["t"], state["sup_div"] = t, s
            state["max_sup_div"] = max(state["max_sup_div"], s)
            if switching:
                self._switch(t, fnew, state)

        for k in range(first, len(times)):
            t_save = times[k]
            state["t_save"] = t_save
            state["f"] = f
            if k > 0:
                try:
                    # a step lands on every switch time (spherepde.models.heads)
                    for t0, t1 in segments(times[k - 1], t_save, self.schedule.switch_times):
                        f = self.stepper.advance(f, t0, t1, callback=after_step)
                except StepSizeCollapse as exc:
                    raise RunFailure(f"time step collapsed to {exc.dt:.3e} < dt_floor {self.stepper.dt_floor:g}",
                                     exc.t, f"cell {exc.cell} (fastest outflow)", density=exc.density) from None
            state["rejected"] = self.stepper.rejected - rejected_before
            state["ell0"] = ell0
            self._forget_routes()
            lag_error = 0.0
            if lag is not None:
                lag_error = lag.max_error
                lag.clear_error()
                if k > 0:
                    lag.reset()
            record = {
                "time": t_save,
                "mass": self.total_mass(f),
                "min_density": float(f.min()),
                "max_density": float(f.max()),
                "sup_div": state["sup_div"],
                "integrated_sup_div": state["integral"],
                "lower_bound_aposteriori": ell0 * math.exp(-state["integral"]),
                "steps": self.stepper.steps - steps_before,
                "steps_rejected": state["rejected"],
                "step_safety": self.stepper.safety,
                "max_sup_div": state["max_sup_div"],
                "velocity_interval": 0.0 if lag is None else lag.intervals[1],
                "velocity_interval_linear": 0.0 if lag is None else lag.intervals[0],
                "velocity_lag_error": lag_error,
            }
            if atoms is not None:
                record.update({"atom_count": atoms.count, "atom_mass_total": atoms.total_mass,
                               "mesh_mass": mesh.integrate(f), "atoms_created": atoms.created_count,
                               "atoms_merged": atoms.merged_count, "atoms_refused": atoms.refused_count})
            if self.noise is not None:
                record.update({"noise": self.noise(t_save), "noise_integral": self.noise.integral(0.0, t_save),
                               "heat_products": self.diffusion.products - products_before})
            yield k, t_save, f, record

    def run(self, f0, t_end: float, save_every: float, C0: float | None = None,
            progress: bool = False, on_snapshot=None) -> xr.Dataset:
        """Integrate from t = 0 to t_end, keeping snapshots every save_every (and at t_end).

        C0: constant of the paper's bound ½ℓ₀e^{−C₀t}; default the largest sup div v seen.
        on_snapshot(index, time, f, record): called as soon as each snapshot exists.
        Returns an xarray.Dataset with density(time, cell) and per-snapshot diagnostics (with
        atoms: their records and atom_position(time, atom, xyz), atom_mass, atom_created).
        """
        times = save_times(t_end, save_every)
        bar = progress_bar(t_end) if progress else None
        records, densities, atom_states = [], [], []
        for k, t, f, rec in self.snapshots(f0, times):
            records.append(rec)
            densities.append(f.copy())
            if self.atoms is not None:
                atom_states.append(self.atoms.state())
            if on_snapshot is not None:
                on_snapshot(k, t, f, rec)
            if bar is not None:
                bar.update(t - bar.n)
        if bar is not None:
            bar.close()
        state = self.last_run
        c0 = state["max_sup_div"] if C0 is None else float(C0)
        return self._dataset(records, densities, state["ell0"], c0, C0 is None, state["rejected"], atom_states)

    def _dataset(self, records, densities, ell0, c0, c0_default, rejected, atom_states=()):
        """The snapshots as a Dataset laid out as a run file (docs/file_format.md):
        the cell index coordinate, the xdggs cell_ids, the CF grid mapping crs, 32-bit integer
        attributes; ds.to_netcdf(path) gives a file that xdggs, cf-python and CDO read."""
        mesh = self.mesh
        time = np.array([r["time"] for r in records])
        data = {
            "density": (("time", CELL_DIM), np.array(densities),
                        {"long_name": "density f_t w.r.t. surface measure (cell average)", "units": "sr-1",
                         "grid_mapping": "crs"}),
            "crs": ((), np.int32(0), crs_attrs(mesh.level)),
        }
        meta = dict(SNAPSHOT_META, **(ATOM_META if self.atoms is not None else {}),
                    **(NOISE_META if self.noise is not None else {}))
        for name, (long_name, units) in meta.items():
            data[name] = ("time", np.array([r[name] for r in records]), {"long_name": long_name, "units": units})
        if atom_states:
            for name, (dims, long_name, units) in ATOM_ARRAYS.items():
                data[name] = (("time", *dims), np.array([a[name] for a in atom_states]),
                              {"long_name": long_name, "units": units})
        data["lower_bound_paper"] = ("time", 0.5 * ell0 * np.exp(-c0 * time),
                                     {"long_name": "½ ℓ₀ exp(−C₀ t)", "units": "sr-1"})
        ds = xr.Dataset(data, coords={
            "time": ("time", time, dict(TIME_ATTRS)),
            CELL_DIM: (CELL_DIM, mesh.cell_ids.astype(np.int64), dict(CELL_INDEX_ATTRS)),
            "cell_ids": (CELL_DIM, mesh.cell_ids.astype(np.uint64), xdggs_attrs(mesh.level)),
        })
        ds.attrs.update({k: attr_value(v) for k, v in {
            "Conventions": "CF-1.13",
            "nside": mesh.nside, "scheme": self.scheme, "cfl": self.cfl, "rk_order": self.rk_order,
            "velocity_tolerance": self.velocity_tolerance, "beta": _beta_attr(self.schedule.beta), "ell0": ell0, "C0": c0,
            "C0_source": "largest sup div v seen in the run" if c0_default else "user",
            "rejected_steps": rejected,
        }.items()})
        if self.noise is not None:
            ds.attrs["noise"] = self.noise.describe()
        return ds


def _beta_attr(beta):
    """β of the run for its attributes: the common β of every head (None: they differ), else "mixed"."""
    return "mixed" if beta is None else beta
