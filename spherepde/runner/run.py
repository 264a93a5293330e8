"""One run of a resolved config: Eulerian solve, diagnostics per snapshot, NetCDF output.

`execute(config, path)` builds the mesh, model and initial density, runs the EulerianSolver and,
as soon as each snapshot exists, computes its diagnostics (spherepde.analysis.diagnostics, on the cell
quadrature measure Σ_c Σ_q f_c A w_q δ_{x_cq}, plus the atoms Σ_k m_k δ_{x_k} when [eulerian]
atoms is on) and appends it to the NetCDF file (spherepde.storage).
Quantities that depend on the paper constant C₀ use the user's C₀ or, by default, the largest
sup div v seen so far; at the end of the run they are rewritten with the final C₀.

When things go wrong (docs/running.md, "Failure behaviour"):
- a guard fires (spherepde.solvers.guards.RunFailure): the state at failure is appended as a last
  snapshot with snapshot_kind = 1, the global attribute `failure` holds the message, and the
  RunFailure is raised again;
- the file system refuses a write (spherepde.storage.WriteError): the file is left readable with
  every complete snapshot and the WriteError is raised again;
- `execute(..., resume=True)` continues an interrupted run from the last complete snapshot of
  its file: every piece of solver state is read back (the density and the stepper's state from
  the Eulerian record, positions and carried log-densities of the particles), so the result
  equals the uninterrupted run's.

With [model] noise > 0 both solvers get the noise schedule (spherepde.models.noise): the mesh diffuses,
tokens take Brownian steps from streams derived from [particles] seed (nothing to store for
--resume), quadrature particles become weighted Brownian particles without a carried density.

Several heads and layers (spherepde.models.heads; docs/variants_heads_layers.md): the diagnostics of E,
F and Π use spherepde.models.heads.theory_objects of the model, NaN where the theory does not define them
(several heads at finite β: E, F, Π; several heads at all: F), and the attributes say so
(E_defined, F_defined, theory_objects). With layers, every layer start is a snapshot time
(run_times), and the diagnostics of a snapshot are those of its layer's model, relative to the
measure at the layer's start: alignment with that layer's E and F, W₂(ρ_t, Π_k#ρ_{s_k}),
V_p(ρ_t) and the bound √(2V_p(ρ_{s_k})) e^{−pγ_k(t − s_k)/σ_max}. A resumed run reads the
measure at the start of its layer back from the file.
"""

from __future__ import annotations

import json
import math
import sys
import time as _time
from typing import NamedTuple

import numpy as np

from ..analysis.diagnostics import (
    MeasureDiagnostics,
    lyapunov,
    lyapunov_cell_averages,
    theory_curves,
    w2_binned,
)
from ..analysis.systems import CLUSTER_SLOTS, CLUSTER_THRESHOLD, SystemDiagnostics
from ..geometry.mesh import HealpixMesh
from ..models.heads import CONVENTION, theory_objects
from ..solvers.adaptive import STEP_STATE
from ..solvers.controller import SolverState
from ..solvers.eulerian import EulerianSolver
from ..solvers.guards import Guards, RunFailure
from ..solvers.particles import ParticleSolver, quadrature_particles, token_systems, tokens_from_law
from ..solvers.timeline import progress_bar, save_times, with_breaks
from ..storage.runfile import (
    SNAPSHOT_FAILURE,
    RunFileError,
    RunWriter,
    WriteError,
    open_run,
    read_resume_point,
    timestamp,
)
from ..storage.schema import (
    ADAPTIVE_META,
    ATOM_ARRAYS,
    ATOM_DIAGNOSTICS,
    ATOM_META,
    CARRIED_ARRAYS,
    CARRIED_META,
    DIAGNOSTIC_META,
    NOISE_META,
    PARTICLE_ARRAYS,
    PARTICLE_META,
    PARTICLE_WEIGHTS,
    SOLVER_META,
    SYSTEM_DIM,
    TAIL_ARRAYS,
    TAIL_PEAK_ARRAYS,
    TAIL_META,
    TOKEN_CLUSTER_MASS,
    TOKEN_META,
    component_dim,
    particle_arrays,
)
from .build import build_initial_law, build_model, build_noise
from .config import difference

__all__ = ["execute", "build_run", "RunSetup", "run_times"]

QUADRATURE_ORDER = 2  # 8 points per cell for the diagnostics integrals


def tail_records(eul: dict) -> dict:
    """The scalar records of log-density tails. With g interpolated at every coupling
    (tail_anchor = 0) the anchor is the last coupling, log_density_time: no variable of its own,
    so the files written before the key resume; the retraced centroids only with the selective and the
    backtracked paths."""
    return {k: v for k, v in TAIL_META.items() if (k != "log_density_anchor" or eul["tail_anchor"] > 0)
            and (k != "tail_retraced" or eul["tail_paths"] in ("selective", "backtrack"))}


class _CellMeasure:
    """The Eulerian density as a weighted point measure on the cell quadrature points, with the
    singular Lyapunov integrand integrated per cell (lyapunov_cell_averages)."""

    def __init__(self, mesh, model, p):
        pts, w = mesh.cell_quadrature(QUADRATURE_ORDER)
        self.points = pts.reshape(-1, 3)
        self._w = w * mesh.area
        # model None: E not defined (spherepde.models.heads.theory_objects), V_p is NaN
        self._lyapunov_cells = None if model is None else lyapunov_cell_averages(mesh, model, p)
        self._model, self._p, self._area = model, p, float(mesh.area)

    def weights(self, f):
        return (np.asarray(f)[:, None] * self._w[None, :]).ravel()

    def lyapunov(self, f, atom_points=None, atom_masses=None):
        """V_p of the piecewise-constant density: Σ f_c G_c / Σ f_c (inf·0 counts as 0); with
        atoms, of the whole measure (Σ f_c A G_c + Σ m_k g(x_k)) / (Σ f_c A + Σ m_k)."""
        if self._model is None:
            return math.nan
        f = np.asarray(f)
        charged = f > 0
        num = float(f[charged] @ self._lyapunov_cells[charged])
        den = float(f.sum())
        if atom_masses is not None and len(atom_masses):
            point_value = lyapunov(self._model, atom_points, atom_masses, self._p)  # per unit mass
            total = float(np.sum(atom_masses))
            return (num * self._area + point_value * total) / (den * self._area + total)
        return num / den

    def measure(self, f, atom_points=None, atom_masses=None):
        """(points, weights) of the whole measure: the cell quadrature and the atoms."""
        weights = self.weights(f)
        if atom_masses is None or not len(atom_masses):
            return self.points, weights
        return np.concatenate([self.points, atom_points]), np.concatenate([weights, atom_masses])


class _Particles(NamedTuple):
    """The [particles] section built: the rng record (seed and bit-generator state after
    sampling, tokens only) lets a stochastic scheme resume."""

    solver: ParticleSolver
    x0: np.ndarray
    weights: np.ndarray
    log_f0: np.ndarray | None
    rng: dict | None


def _atom_options(eul):
    """The Atoms options of an [eulerian] section, or None when atoms are off."""
    if not eul["atoms"]:
        return None
    return {"capacity": eul["max_atoms"], "width": eul["atom_width"], "min_mass": eul["atom_min_mass"],
            "merge": eul["atom_merge"], "feeding": eul["atom_feeding"], "stalled_width": eul["atom_stalled_width"],
            "cut": eul["atom_cut"], "shape": eul["atom_shape"],
            "join": eul["atom_join"]}


def _tail_options(eul):
    """The LogTails options of an [eulerian] section, or None when the tails are the finite volumes'."""
    if eul["tails"] != "log":
        return None
    return {"interval": eul["tail_interval"], "level": eul["tail_level"], "exclusion": eul["tail_exclusion"],
            "exclusion_width": eul["tail_exclusion_width"],
            "follow": eul["tail_follow"], "anchor": eul["tail_anchor"], "path_step": eul["tail_path_step"],
            "path_tolerance": eul["tail_path_tolerance"], "mass_correction": eul["tail_mass_correction"],
            "paths": eul["tail_paths"], "substeps": eul["tail_substeps"],
            "reference": eul["tail_reference"],
            "retrace_tolerance": eul["tail_retrace_tolerance"], "follow_bounds": eul["tail_follow_bounds"],
            "path_scheme": eul["tail_path_scheme"], "step_states": eul["tail_step_states"],
            "between": eul["tail_field_between"]}


def run_times(config) -> list[float]:
    """The snapshot times of a resolved config: every save_every to t_end, and every layer start
    (the measure there is the reference of the layer's diagnostics)."""
    times = save_times(config["time"]["t_end"], config["time"]["save_every"])
    layers = config["model"].get("layers")
    return with_breaks(times, [layer["start"] for layer in layers[1:]]) if layers else times


def _combined_attrs(config, schedule, theory):
    """The attributes of a run with several heads or layers (none for one head): the convention,
    the heads and layers (matrices, β, starts as in the config), and what E, F, Π refer to."""
    spec = config["model"]
    if spec.get("heads") is None and spec.get("layers") is None:
        return {}
    attrs = {"head_convention": CONVENTION, "theory_objects": theory[0].note,
             "E_defined": int(theory[0].has_E), "F_defined": int(theory[0].has_F)}
    if spec.get("heads") is not None:
        attrs["heads"] = spec["heads"]
    else:
        attrs["layers"] = [dict(layer, theory_objects=th.note, E_defined=int(th.has_E), F_defined=int(th.has_F),
                                dim_E=th.model.E.dim if th.has_E else None,
                                gap=th.model.gap if th.has_E and math.isfinite(th.model.gap) else None)
                           for layer, th in zip(spec["layers"], theory)]
        attrs["diagnostics_reference"] = ("per layer: E, F, Π of the layer's model; W₂ to Π_k of the measure "
                                          "at the layer's start s_k, V_p bound from V_p(ρ_{s_k}) at t − s_k; "
                                          "a snapshot at every layer start")
    return attrs


def _particle_setup(config, model, law, mesh, noise):
    """The _Particles of the [particles] section, or None. With noise, quadrature particles carry
    no density (spherepde.solvers.particles)."""
    pt = config["particles"]
    if not pt:
        return None
    carry = pt["mode"] == "quadrature" and noise is None
    systems = pt.get("systems", 1)
    if pt["mode"] == "tokens" and systems > 1:  # system k from default_rng(seed + k)
        x0, weights = token_systems(law, pt["n"], systems, pt["seed"])
        log_f0 = None
        rng_record = {"seed": pt["seed"], "systems": systems}
    elif pt["mode"] == "tokens":
        rng = np.random.default_rng(pt["seed"])
        x0, weights = tokens_from_law(law, pt["n"], rng)
        log_f0 = None
        rng_record = {"seed": pt["seed"], "bit_generator_state": rng.bit_generator.state}
    else:
        x0, weights, log_f0 = quadrature_particles(mesh, law)
        rng_record = None
        if not carry:
            log_f0 = None
    solver = ParticleSolver(model, pt["scheme"], pt["dt"], carry_density=carry, noise=noise, seed=pt["seed"],
                            summation=pt.get("summation", "auto"), backend=pt.get("backend", "cpu"),
                            precision=pt.get("precision", "fp64"), rtol=pt.get("rtol", 1e-6), atol=pt.get("atol", 0.0))
    if solver.backend == "cuda":  # the GPU's arrays now, before the file is opened (DeviceMemoryError)
        solver.reserve_device(x0.shape, weights)
    return _Particles(solver, x0, weights, log_f0, rng_record)


def build_run(config: dict) -> "RunSetup":
    """Everything a resolved config (spherepde.runner.config.resolve) builds before the first
    step: model, mesh, f0, solvers, diagnostics and the layout of the run file (RunSetup)."""
    return RunSetup(config)


class RunSetup:
    """What a run builds before its first step: model, mesh, f0, solvers, diagnostics, and the
    layout of the file (variables, attrs, dims, arrays, static). With [eulerian] enabled = false
    there is no Eulerian solver (solver, f0, measure and diagnostics are None): the particles
    alone, in a file without cells."""

    def __init__(self, config):
        eul, dg, pt = config["eulerian"], config["diagnostics"], config["particles"]
        self.config = config
        self.schedule = schedule = build_model(config["model"])  # the one shape (spherepde.models.schedule)
        self.noise = noise = build_noise(config["model"])
        # heads and layers (spherepde.models.heads): what E, F, Π mean, per layer
        self.theory = [theory_objects(layer) for layer in schedule.layers]
        theory0 = self.theory[0]
        law = build_initial_law(config["initial"], config["model"].get("dimension", 3))
        self.eulerian = eul["enabled"]
        quadrature = pt is not None and pt["mode"] == "quadrature"
        self.mesh = HealpixMesh(eul["nside"]) if self.eulerian or quadrature else None
        self.C0_user, self.C1 = dg["C0"], dg["C1"]
        self.variables, self.dims, self.arrays, self.static = {}, {}, {}, {}
        self.attrs = {**_beta_attrs(schedule), "model": schedule.describe(), **_spectral_attrs(theory0),
                      "initial_law": repr(law), "lyapunov_p": dg["p"]}
        self.attrs.update(_combined_attrs(config, schedule, self.theory))
        self._measures, self._diags, self._pdiags, self._lyapunov0 = {}, {}, {}, {}
        self.batched = self.token_layout = False  # tokens batched / in d ≠ 3 (_particle_layout)
        if noise is not None:
            self.attrs.update({"noise": noise.level, "noise_schedule": noise.schedule, "noise_law": noise.describe()})
        self.f0 = self.solver = self.measure = self.diagnostics = self.log_f0 = None
        if self.eulerian:
            self._eulerian_layout(law, eul, dg)
        self.particles = _particle_setup(config, schedule, law, self.mesh, noise)
        if self.particles:
            self._particle_layout(config["particles"], dg)
        # the attributes of the end of the run, with placeholder values of the final types: set
        # at the end, they then replace existing ones instead of growing the file
        self.attrs["wall_seconds"] = math.nan
        if self.eulerian:
            self.attrs.update({"C0": math.nan if self.C0_user is None else self.C0_user,
                               "C0_source": "user" if self.C0_user is not None else "largest sup div v seen in the run",
                               "C1": self.C1, "steps": 0, "rejected_steps": 0})
        if self.particles:
            self.attrs["particle_field_evaluations"] = 0

    def _eulerian_layout(self, law, eul, dg):
        mesh = self.mesh
        self.f0 = f0 = law.cell_averages(mesh)
        self.solver = EulerianSolver(mesh, self.schedule, scheme=eul["scheme"], cfl=eul["cfl"],
                                     rk_order=eul["rk_order"], guards=Guards(**self.config["guards"]),
                                     summation=eul["summation"], tolerance=eul["tolerance"],
                                     near_field=eul["near_field"],
                                     velocity_tolerance=eul["velocity_tolerance"],
                                     atoms=_atom_options(eul), noise=self.noise, tails=_tail_options(eul),
                                     near_field_profile=eul["near_field_profile"])
        # with tails: log f₀ at the centroids, from the law's own density (exact, not a cell average)
        self.log_f0 = np.log(law.density(mesh.centroids)) if self.solver.tails is not None else None
        theory0 = self.theory[0]
        self.measure = measure = _CellMeasure(mesh, theory0.model, dg["p"])
        self.diagnostics = MeasureDiagnostics(theory0.model, measure.points, measure.weights(f0), p=dg["p"],
                                              w2_nside=dg["w2_nside"], lyapunov0=measure.lyapunov(f0),
                                              has_F=theory0.has_F)
        # per layer: its cell measure (V_p of its E), its diagnostics relative to the measure at
        # its start (built at that snapshot), V_p there (the bound's constant)
        self._measures[0], self._diags[0] = measure, self.diagnostics
        self._lyapunov0[0] = self.diagnostics.lyapunov0
        self.ell0 = float(f0.min())
        self.variables.update(SOLVER_META)
        self.variables.update(DIAGNOSTIC_META)
        self.variables["w2_bound_zero_temperature"] = (
            "√(2V_p(ρ₀)) exp(−pγt/σ_max(B)): bound on W₂(ρ_t, Π#ρ₀) at β = ∞", "1")
        head = self.schedule.single_head
        if self.C1 is not None and head is not None and not head.zero_temperature:
            self.variables["w2_bound_finite_beta"] = (
                "2√(log(β+1)/β)(e^{C₁t} − e^{C₀t}): bound on W₂(ρ_t^β, ρ_t^∞)", "1")
        self.attrs.update({
            "nside": mesh.nside, "scheme": eul["scheme"], "cfl": eul["cfl"], "rk_order": eul["rk_order"],
            "summation": eul["summation"], "tolerance": eul["tolerance"],
            "near_field": int(self.solver.near_field_active),
            "velocity_tolerance": eul["velocity_tolerance"],
            "ell0": self.ell0, "lyapunov_initial": self.diagnostics.lyapunov0,
            "w2_method": self.diagnostics.w2_method,
            "diagnostics_measure": (f"cell averages on an exact-area rule of order {QUADRATURE_ORDER} per cell; "
                                    "V_p with the singular integrand integrated adaptively per cell"),
        })
        if self.noise is not None:
            self.variables.update(NOISE_META)
            self.attrs["noise_scheme"] = ("Laplace-Beltrami on the mesh: symmetric positive 8-neighbour rates, "
                                          "exact heat flow (uniformisation) in integrating-factor SSP-RK2")
        if self.solver.atoms is not None:
            self.variables.update(ATOM_META)
            self.dims.update(atom=self.solver.atoms.capacity, xyz=3)
            self.arrays.update(ATOM_ARRAYS)
            self.arrays.update(ATOM_DIAGNOSTICS)
            self.attrs.update({"atom_width": eul["atom_width"], "atom_min_mass": eul["atom_min_mass"],
                               "atom_merge": eul["atom_merge"], "atom_stalled_width": eul["atom_stalled_width"],
                               "atom_join": eul["atom_join"], "atom_cut": eul["atom_cut"],
                               "atom_shape": eul["atom_shape"], "near_field_profile": eul["near_field_profile"]})
        if self.solver.tails is not None:
            self.variables.update(tail_records(eul))
            self.arrays.update(TAIL_ARRAYS)
            self.attrs.update({"tails": "log", "tail_interval": eul["tail_interval"], "tail_level": eul["tail_level"],
                               "tail_exclusion": eul["tail_exclusion"], "tail_exclusion_width": eul["tail_exclusion_width"],
                               "tail_follow": int(eul["tail_follow"]),
                               "tail_anchor": eul["tail_anchor"], "tail_path_step": eul["tail_path_step"],
                               "tail_path_tolerance": eul["tail_path_tolerance"],
                               "tail_mass_correction": eul["tail_mass_correction"], "tail_paths": eul["tail_paths"],
                               "tail_substeps": eul["tail_substeps"],
                               "tail_reference": eul["tail_reference"],
                               "tail_retrace_tolerance": eul["tail_retrace_tolerance"],
                               "tail_follow_bounds": eul["tail_follow_bounds"],
                               "tail_path_scheme": eul["tail_path_scheme"],
                               "tail_step_states": eul["tail_step_states"],
                               "tail_field_between": eul["tail_field_between"]})
            if eul["tail_reference"] == "clusters":
                self.arrays.update(TAIL_PEAK_ARRAYS)

    def _particle_layout(self, pt, dg):
        psolver, x0, pweights, log_f0, rng_record = self.particles
        theory0 = self.theory[0]
        # tokens in d ≠ 3 or batched: per-system diagnostics with energy and clusters
        # (spherepde.analysis.systems); one system on S² keeps the layout it always had
        self.batched = x0.ndim == 3
        self.token_layout = self.batched or x0.shape[-1] != 3
        if self.token_layout:
            self.pdiag = self._system_diagnostics(0, x0)
            self._token_layout(x0)
        else:
            self.pdiag = MeasureDiagnostics(theory0.model, x0, pweights, p=dg["p"], w2_nside=dg["w2_nside"],
                                            has_F=theory0.has_F)
            self.variables.update(PARTICLE_META)
            self.dims.update(particle=x0.shape[0], xyz=3)
            self.arrays.update(PARTICLE_ARRAYS)
        self._pdiags[0] = self.pdiag
        if not self.eulerian:
            self.variables.pop("w2_eulerian_particles", None)
        name, dims, long_name, units = PARTICLE_WEIGHTS
        self.static[name] = (dims, pweights, long_name, units)
        if log_f0 is not None:
            self.variables.update(CARRIED_META)
            self.arrays.update(CARRIED_ARRAYS)
        self.attrs.update({"particle_mode": pt["mode"], "particle_scheme": psolver.scheme,
                           "particle_dt": psolver.dt, "particle_hardmax": int(psolver.hardmax),
                           "particle_lyapunov_initial": self.pdiag.lyapunov0})
        self.attrs["particle_backend"] = psolver.backend  # the one used ([particles] backend: the one asked for)
        if psolver.backend == "cuda":
            self.attrs["particle_device"] = psolver.device_name
        if self.token_layout:
            summation = (f"fused direct sum on the GPU (spherepde.summation.cuda, {psolver.precision})"
                         if psolver.backend == "cuda"
                         else "batched direct sum (spherepde.summation.batched)")
            self.attrs.update({"particle_dimension": x0.shape[-1], "particle_systems": len(self.pdiag.systems),
                               "particle_summation": summation,
                               "cluster_rule": f"connected components of <x_i, x_j> >= {CLUSTER_THRESHOLD} "
                                               f"(the {CLUSTER_SLOTS} largest masses recorded)"})
        if psolver.adaptive:  # the controller's state per snapshot (per system when batched)
            if self.batched:
                self.arrays.update({k: ((SYSTEM_DIM,), f"per system: {ln}", u) for k, (ln, u) in ADAPTIVE_META.items()})
            else:
                self.variables.update(ADAPTIVE_META)
            self.attrs.update({"particle_rtol": psolver.rtol, "particle_atol": psolver.atol,
                               "particle_step_control": ("embedded pair, error = max over particles of the chordal "
                                                         "distance (and |Δ log f|) / (atol + rtol), PI controller; "
                                                         "particle_dt is the first step")})
        if self.noise is not None:
            # its random streams come from [particles] seed, in the config attribute
            self.attrs["particle_noise_scheme"] = ("geodesic random walk after each drift step (weak order 1), "
                                                   "streams from [particles] seed")
        if rng_record is not None:
            self.attrs["particle_rng"] = rng_record

    def _system_diagnostics(self, k, x):
        """The per-system diagnostics of layer k relative to the positions x ((n, d) or (M, n, d))
        at its start; the energy is that of the layer's head when it has one."""
        dg, th = self.config["diagnostics"], self.theory[k]
        layer = self.schedule.layers[k]
        energy_model = layer.heads[0] if layer.count == 1 else None
        xs = x if x.ndim == 3 else x[None]
        return SystemDiagnostics(th.model, th.has_F, energy_model, xs, self.particles.weights, p=dg["p"],
                                 w2_nside=dg["w2_nside"])

    def _token_layout(self, x0):
        """Variables, dimensions and arrays of tokens in d ≠ 3 or batched: a system dimension (batched
        only), the coordinates as xyz (d = 3) or component, the diagnostics per system."""
        d = x0.shape[-1]
        self.dims.update(particle=x0.shape[-2], **{component_dim(d): d}, cluster=CLUSTER_SLOTS)
        self.arrays.update(particle_arrays(d, self.batched))
        meta = {**{k: v for k, v in PARTICLE_META.items() if k.removeprefix("particle_") in DIAGNOSTIC_META},
                **TOKEN_META}
        name, long_name, units = TOKEN_CLUSTER_MASS
        if self.batched:
            self.dims[SYSTEM_DIM] = x0.shape[0]
            self.arrays.update({k: ((SYSTEM_DIM,), f"per system: {ln}", u) for k, (ln, u) in meta.items()})
            self.arrays[name] = ((SYSTEM_DIM, "cluster"), long_name, units)
        else:
            self.variables.update(meta)
            self.arrays[name] = (("cluster",), long_name, units)
        self.variables["particle_field_evaluations"] = PARTICLE_META["particle_field_evaluations"]

    def writer(self, path, n_snapshots):
        rewritten = tuple(self.paper_curves([0.0], 0.0)) if self.eulerian else ()
        return RunWriter(path, self.mesh if self.eulerian else None, self.config, self.variables, self.attrs,
                         dims=self.dims, arrays=self.arrays, static=self.static, n_snapshots=n_snapshots,
                         rewritten=rewritten)

    def paper_curves(self, times, c0):
        times = np.asarray(times, dtype=float)
        out = {"lower_bound_paper": 0.5 * self.ell0 * np.exp(-c0 * times)}
        if len(self.theory) == 1:
            curves = self.diagnostics.theory_curves(times, C0=c0, C1=self.C1)
            out.update({k: v for k, (v, _) in curves.items() if k in self.variables})
            return out
        # layers: each layer's curves from V_p at its start, at t − s_k
        layer = np.array([self.schedule.layer_at(t) for t in times], dtype=int)
        for k in sorted(set(layer.tolist())):
            sel = layer == k
            curves = theory_curves(self.theory[k].model, self.config["diagnostics"]["p"],
                                   self._lyapunov0.get(k, math.nan), times[sel] - self.schedule.starts[k],
                                   C0=c0, C1=self.C1)
            for name, (values, _) in curves.items():
                if name in self.variables:
                    out.setdefault(name, np.full(times.shape, math.nan))[sel] = values
        return out

    def _measure_of(self, k):
        """The cell measure of layer k (its Lyapunov integrand), built once."""
        if k not in self._measures:
            self._measures[k] = _CellMeasure(self.mesh, self.theory[k].model, self.config["diagnostics"]["p"])
        return self._measures[k]

    def enter_layer(self, k, points, weights, lyap):
        """The Eulerian diagnostics of layer k relative to the measure (points, weights) at its
        start, V_p there = lyap."""
        dg, th = self.config["diagnostics"], self.theory[k]
        self._diags[k] = MeasureDiagnostics(th.model, points, weights, p=dg["p"], w2_nside=dg["w2_nside"],
                                            lyapunov0=lyap, has_F=th.has_F)
        self._lyapunov0[k] = self._diags[k].lyapunov0

    def enter_particle_layer(self, k, x):
        """The particles' diagnostics of layer k relative to their positions x at its start."""
        if self.token_layout:
            self._pdiags[k] = self._system_diagnostics(k, x)
            return
        dg, th = self.config["diagnostics"], self.theory[k]
        self._pdiags[k] = MeasureDiagnostics(th.model, x, self.particles.weights, p=dg["p"],
                                             w2_nside=dg["w2_nside"], has_F=th.has_F)

    def resume_layers(self, path, point, times):
        """A run resumed in layer k ≥ 1: V_p at the start of every layer so far (from the records)
        and layer k's diagnostics from the measure at its start, read back from the file (the
        density and atoms of the Eulerian solver, the particles' positions)."""
        if len(self.theory) == 1:
            return
        k = self.schedule.layer_at(times[point.index])
        if self.eulerian:
            for j in range(1, k + 1):
                self._lyapunov0[j] = point.records[times.index(self.schedule.starts[j])]["lyapunov"]
        if k == 0:
            return
        index = times.index(self.schedule.starts[k])
        ds = open_run(path).isel(time=index)
        if float(ds["time"]) != times[index]:
            raise RunFileError(f"{path}: cannot resume, no snapshot at the start of layer {k} "
                               f"(t = {times[index]:g})")
        if self.eulerian:
            f = np.asarray(ds["density"].values, dtype=float)
            xa = ma = None
            if "atom_mass" in ds:
                masses = np.asarray(ds["atom_mass"].values, dtype=float)
                alive = masses > 0  # slot order, as Atoms.points()
                xa, ma = np.asarray(ds["atom_position"].values, dtype=float)[alive], masses[alive]
            measure = self._measure_of(k)
            points, weights = measure.measure(f, xa, ma)
            self.enter_layer(k, points, weights, measure.lyapunov(f, xa, ma))
        if self.particles:
            self.enter_particle_layer(k, np.asarray(ds["positions"].values, dtype=float))

    def snapshot(self, t, f, rec, c0, particle_state):
        """(values, arrays) of a regular snapshot: the solver record and every diagnostic, on the
        whole measure (density and atoms), and those of the particles (f, rec: None without the
        Eulerian solver)."""
        values, arrays = {}, {}
        k = self.schedule.layer_at(t)  # 0 without layers
        if self.eulerian:
            points, weights = self._eulerian_snapshot(t, k, f, rec, c0, values, arrays)
        if particle_state is not None:
            psolver, pweights = self.particles.solver, self.particles.weights
            x, log_f = particle_state
            if k not in self._pdiags:  # the layer's first snapshot, at its start (run_times)
                self.enter_particle_layer(k, x)
            if self.token_layout:
                per_system = self._pdiags[k](x if self.batched else x[None])
                if self.batched:
                    arrays.update(per_system)
                else:
                    arrays[TOKEN_CLUSTER_MASS[0]] = per_system.pop(TOKEN_CLUSTER_MASS[0])[0]
                    values.update({n: float(v[0]) for n, v in per_system.items()})
            else:
                values.update({f"particle_{n}": v for n, v in self._pdiags[k](x, pweights).items()})
            if self.eulerian:
                values["w2_eulerian_particles"] = w2_binned(points, weights, x, pweights,
                                                            nside=self.config["diagnostics"]["w2_nside"])
            values["particle_field_evaluations"] = psolver.evaluations
            state = psolver.step_state()
            if state is not None:
                for name, value in state.items():
                    if self.batched:
                        arrays[f"particle_{name}"] = value.astype(float)
                    else:
                        values[f"particle_{name}"] = float(value[0])
            arrays["positions"] = x
            if log_f is not None:
                density = np.exp(log_f)
                arrays.update(particle_density=density, particle_log_density=log_f)
                values["particle_min_density"] = float(density.min())
                values["particle_max_density"] = float(density.max())
        return values, arrays

    def _eulerian_snapshot(self, t, k, f, rec, c0, values, arrays):
        """The Eulerian part of a snapshot in layer k into values and arrays; returns the whole
        measure."""
        values.update(rec)
        atoms = self.solver.atoms
        xa = ma = None
        if atoms is not None:
            xa, ma = atoms.points()
            state = atoms.state()
            arrays.update({name: state[name] for name in ATOM_ARRAYS})
            arrays.update({name: rec[name] for name in ATOM_DIAGNOSTICS})
        if self.solver.tails is not None:
            arrays["log_density"] = self.solver.tails.g
            arrays["log_density_rate"] = self.solver.tails.rate
            if self.solver.tails.reference == "clusters":
                arrays["atom_peak_log_density"] = self.solver.tails.peak_state()
        measure = self._measure_of(k)
        points, weights = measure.measure(f, xa, ma)
        lyap = measure.lyapunov(f, xa, ma)
        if k not in self._diags:  # the layer's first snapshot, at its start (run_times)
            self.enter_layer(k, points, weights, lyap)
        values.update(self._diags[k](points, weights, lyapunov_value=lyap))
        values.update({name: float(v[0]) for name, v in self.paper_curves([t], c0).items()})
        return points, weights

    def failure_snapshot(self, failure):
        """(density, values, arrays) of the state at failure; what the failing solver did not
        have is NaN."""
        f, values = None, {}
        if self.eulerian:
            f = failure.density if failure.density is not None else np.full(self.mesh.npix, math.nan)
            values = {"mass": self.mesh.integrate(f), "min_density": float(np.min(f)),
                      "max_density": float(np.max(f))}
        arrays = {}
        if failure.positions is not None:
            arrays["positions"] = failure.positions
        if failure.log_density is not None:
            with np.errstate(all="ignore"):
                arrays.update(particle_log_density=failure.log_density, particle_density=np.exp(failure.log_density))
        return f, values, arrays


def _resume_point(setup, path, times):
    """The file's resume point, checked against this config; RunFileError if it does not fit."""
    config = json.loads(json.dumps(setup.config))  # as the file stores it
    point = read_resume_point(path)
    diff = difference(point.config, config)
    if diff is not None:
        raise RunFileError(f"{path}: cannot resume with a different config ({diff})")
    stored = [r["time"] for r in point.records]
    if stored != times[: len(stored)]:
        raise RunFileError(f"{path}: cannot resume, its snapshot times differ from the config's")
    if setup.particles and setup.particles.rng is not None:
        if json.loads(point.attrs.get("particle_rng", "null")) != json.loads(json.dumps(setup.particles.rng)):
            raise RunFileError(f"{path}: cannot resume, the particles' random stream differs from the file's")
    return point


class _Start(NamedTuple):
    """Where the solvers start: index None for t = 0, else the snapshot index and the state read
    from the file."""

    index: int | None = None
    eulerian: SolverState | None = None
    positions: np.ndarray | None = None
    log_density: np.ndarray | None = None
    step_state: dict | None = None  # of an adaptive particle scheme


def _reopen(setup, path, point, times):
    """(writer, records, start) continuing the run in the file from its resume point."""
    writer = RunWriter.reopen(path, setup.variables, setup.arrays, point.index + 1)  # checks the layout
    records = point.records
    start = _Start(point.index)
    try:
        setup.resume_layers(path, point, times)
    except BaseException:
        writer.abort()
        raise
    if setup.eulerian:
        start = start._replace(eulerian=SolverState.from_record(point.index, point.density, records[-1],
                                                                point.arrays))
    if setup.particles:
        setup.particles.solver.evaluations = int(records[-1]["particle_field_evaluations"])
        start = start._replace(positions=point.arrays["positions"],
                               log_density=point.arrays.get("particle_log_density"))
        if setup.particles.solver.adaptive:  # the step-size controller's state at the snapshot
            saved = point.arrays if setup.batched else records[-1]
            start = start._replace(step_state={name: saved[f"particle_{name}"] for name in STEP_STATE})
    entry = f"{timestamp()}: resumed from snapshot {point.index} (t = {times[point.index]:g})"
    if setup.config["guards"] != point.config.get("guards"):  # the one section that may change
        entry += f" with [guards] {json.dumps(setup.config['guards'])}"
    if setup.particles:  # backend = "auto" may pick another one on another machine (same numbers to rounding)
        used, before = setup.attrs["particle_backend"], point.attrs.get("particle_backend", "cpu")
        if used != before:
            entry += f" on the {used} backend (particle_backend = {before!r} before)"
    history = point.attrs.get("history", "")
    # a failure is forgotten; a file damaged where only a write reads it is refused here
    writer.begin_resume({"history": (history + "\n" if history else "") + entry}, delete=("failure", "failure_time"))
    return writer, records, start


def _advance(setup, writer, times, records, start, bar, snapshot_log):
    """Both solvers in lockstep from the start to the end, each snapshot appended to the file and
    to records as soon as it exists."""
    particle_iter = None
    if setup.particles:
        psolver, x0, weights, log_f0, _ = setup.particles
        if start.index is None:
            particle_iter = psolver.snapshots(x0, weights, times, log_f0)
        else:
            particle_iter = psolver.snapshots(start.positions, weights, times, start.log_density,
                                              resume_from=start.index, step_state=start.step_state)
    if setup.eulerian:
        states = ((t, f, rec, next(particle_iter)[2:] if particle_iter is not None else None)
                  for _, t, f, rec in setup.solver.snapshots(setup.f0, times, start=start.eulerian,
                                                                   log_f0=setup.log_f0))
    else:
        states = ((t, None, None, (x, log_f)) for _, t, x, log_f in particle_iter)
    max_sup_div = max((r["sup_div"] for r in records if "sup_div" in r), default=-math.inf)
    for t, f, rec, particle_state in states:
        c0 = None
        if rec is not None:
            max_sup_div = max(max_sup_div, rec["sup_div"])
            c0 = setup.C0_user if setup.C0_user is not None else max_sup_div
        values, arrays = setup.snapshot(t, f, rec, c0, particle_state)
        index = writer.append(t, f, values, arrays)
        records.append(values)
        if bar is not None:
            bar.update(t - bar.n)
        if snapshot_log is not None:
            alignment = values.get("particle_alignment_E", np.mean(arrays.get("particle_alignment_E", math.nan)))
            what = (f"min f = {rec['min_density']:.4e}, alignment E = {values['alignment_E']:.4f}" if rec is not None
                    else f"particles' alignment E = {alignment:.4f}")
            print(f"snapshot {index} t = {t:.6g} written: {what}", file=snapshot_log, flush=True)


def _record_failure(setup, writer, failure, records, wall):
    """The state at failure as the last snapshot, the message as the attribute `failure`."""
    density, values, arrays = setup.failure_snapshot(failure)
    try:
        writer.append(failure.time, density, values, arrays, kind=SNAPSHOT_FAILURE)
        writer.set_run_attrs({"failure": str(failure), "failure_time": failure.time, "wall_seconds": wall})
        writer.close(complete=False)
    except WriteError as exc:
        raise WriteError(f"a guard stopped the run ({failure}), then {exc}") from exc
    failure.kept = len(records)


def _summary(path, times, records, wall, particles):
    summary = {"path": str(path), "t_end": times[-1], "snapshots": len(records), "wall_seconds": wall,
               "particles": particles.x0.shape[-2] if particles else 0,
               "systems": particles.x0.shape[0] if particles and particles.x0.ndim == 3 else 1}
    if "mass" in records[-1]:  # the Eulerian solver ran
        mass = np.array([r["mass"] for r in records])
        summary.update({"steps": int(records[-1]["steps"]), "rejected_steps": int(records[-1]["steps_rejected"]),
                        "mass_drift": float(np.abs(mass - mass[0]).max()),
                        "min_density": min(r["min_density"] for r in records)})
    return summary


def _finish(setup, writer, path, times, records, wall):
    """The quantities known only at the end (C₀ and the curves that depend on it, the step
    counts), then `complete` = 1. Returns the summary."""
    summary = _summary(path, times, records, wall, setup.particles)
    end = {"wall_seconds": wall}
    if setup.eulerian:
        c0 = max(r["sup_div"] for r in records) if setup.C0_user is None else setup.C0_user
        for name, values in setup.paper_curves([r["time"] for r in records], c0).items():
            writer.set_variable(name, values)
        end.update({"C0": c0, "steps": summary["steps"], "rejected_steps": summary["rejected_steps"]})
    if setup.particles:
        end["particle_field_evaluations"] = setup.particles.solver.evaluations
    writer.set_run_attrs(end)
    writer.close(complete=True)
    return summary


def execute(config: dict, path, progress: bool | None = None, log=print, snapshot_log=None,
            resume: bool = False) -> dict:
    """Run a resolved config and write its run file: what `spherepde run` does after the checks.

    The Eulerian solver and, with a [particles] section, the particle solver advance in lockstep
    from save time to save time (`run_times`); each snapshot (both solvers and all diagnostics
    of the theory) is appended to the NetCDF file as soon as it exists, so an interrupted run
    keeps every snapshot it reached. Open the file with `spherepde.open_run`.

    Args:
        config: a resolved config (`spherepde.runner.config.resolve`); its [output] path is
            not used, `path` is.
        path: the run file to write (str or Path; its folder must exist). An existing file is
            replaced (unless resume); unlike `spherepde run`, no lock is taken and nothing is
            refused.
        progress: show a tqdm bar over simulated time (default: when stderr is a terminal).
        log: called with the one-line summary at the end (`print` by default; None: silent).
        snapshot_log: a text stream that gets one line per written snapshot (None: none).
        resume: continue the run in the existing file at path from its last complete
            snapshot, to the same result as an uninterrupted run (a finished run is left
            alone: summary["already_complete"]).

    Returns:
        A summary dict: `path`, `t_end`, `snapshots`, `wall_seconds` (s), `particles` (their
        number, 0 without) and, with the Eulerian solver, `steps`, `rejected_steps`,
        `mass_drift` (largest |mass(t) − mass(0)|, the initial mass being 1) and `min_density`
        (smallest cell average over the snapshots, sr⁻¹).

    Raises:
        RunFailure: a run guard fired (spherepde.solvers.guards); the state at failure is the
            file's last snapshot (snapshot_kind = 1), `failure.kept` the regular snapshots before it.
        WriteError: the file system refused a write; the file keeps every complete snapshot.
        RunFileError: with resume, the file does not fit the config or cannot be read.
    """
    clock = _time.perf_counter()
    setup = build_run(config)
    times = run_times(config)
    if resume:
        point = _resume_point(setup, path, times)
        if point.complete:
            if log is not None:
                log(f"spherepde run: {path} is already complete ({len(point.records)} snapshots, "
                    f"t = {point.records[-1]['time']:g}); nothing to do")
            return _summary(path, times, point.records, 0.0, setup.particles) | {"already_complete": True}
        writer, records, start = _reopen(setup, path, point, times)
    else:
        writer, records, start = setup.writer(path, len(times)), [], _Start()
    if progress is None:
        progress = sys.stderr.isatty()
    bar = progress_bar(times[-1]) if progress else None
    try:
        try:
            _advance(setup, writer, times, records, start, bar, snapshot_log)
        except RunFailure as failure:
            _record_failure(setup, writer, failure, records, _time.perf_counter() - clock)
            raise
        if bar is not None:
            bar.close()
        summary = _finish(setup, writer, path, times, records, _time.perf_counter() - clock)
    except WriteError as exc:
        writer.abort()
        raise WriteError(f"{exc}; complete snapshots kept in the file: {len(records)} "
                         "(continue with --resume once the cause is fixed)") from exc
    except BaseException:
        writer.abort()
        raise
    if log is not None:
        extra = f", {summary['particles']} particles" if setup.particles else ""
        if setup.eulerian:
            log(f"spherepde run: t = {summary['t_end']:g} in {summary['wall_seconds']:.1f} s, {summary['steps']} steps "
                f"({summary['rejected_steps']} rejected){extra}, {summary['snapshots']} snapshots, "
                f"mass drift {summary['mass_drift']:.1e}, min density {summary['min_density']:.3e} → {path}")
        else:
            log(f"spherepde run: t = {summary['t_end']:g} in {summary['wall_seconds']:.1f} s, particles alone"
                f"{extra}, {summary['snapshots']} snapshots → {path}")
    return summary


def _beta_attrs(schedule):
    """beta and log_beta: of every head when they share it, else "mixed" (heads, layers)."""
    beta = schedule.beta
    if beta is None:
        return {"beta": "mixed", "log_beta": "mixed"}
    if math.isinf(beta):
        return {"beta": "inf", "log_beta": "inf"}
    return {"beta": beta, "log_beta": math.log(beta)}


def _spectral_attrs(theory):
    """dim_E, dim_F, gap, σ_max(B), assumption flags of the model the diagnostics use (at t = 0):
    NaN and "not defined" where the theory does not define them (spherepde.models.heads)."""
    m = theory.model
    if m is None:
        return {"dim_E": math.nan, "dim_F": math.nan, "gap": math.nan, "sigma_max_B": math.nan,
                "assumption_flags": "not defined"}
    return {"dim_E": m.E.dim, "dim_F": m.F.dim if theory.has_F else math.nan, "gap": m.gap,
            "sigma_max_B": m.sigma_max, "assumption_flags": m.assumption_flags}
