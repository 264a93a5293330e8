"""One run of a resolved config: Eulerian solve, diagnostics per snapshot, NetCDF output.

`execute(config, path)` builds the mesh, model and initial density, runs the EulerianSolver and,
as soon as each snapshot exists, computes its diagnostics (spherepde.diagnostics, on the cell
quadrature measure Σ_c Σ_q f_c A w_q δ_{x_cq}) and appends it to the NetCDF file (spherepde.io).
Quantities that depend on the paper constant C₀ use the user's C₀ or, by default, the largest
sup div v seen so far; at the end of the run they are rewritten with the final C₀.
"""

from __future__ import annotations

import math
import sys
import time as _time

import numpy as np

from .config import build_initial_law, build_model
from .diagnostics import DIAGNOSTIC_META, MeasureDiagnostics, lyapunov_cell_averages, w2_binned
from .eulerian import SNAPSHOT_META, EulerianSolver
from .io import RunWriter
from .mesh import HealpixMesh
from .particles import ParticleSolver, quadrature_particles, tokens_from_law
from .timeline import progress_bar, save_times

__all__ = ["execute", "SOLVER_META"]

SOLVER_META = dict(SNAPSHOT_META,
                   lower_bound_paper=("½ ℓ₀ exp(−C₀ t): the paper's density lower bound", "sr-1"))

QUADRATURE_ORDER = 2  # 8 points per cell for the diagnostics integrals


class _CellMeasure:
    """The Eulerian density as a weighted point measure on the cell quadrature points, with the
    singular Lyapunov integrand integrated per cell (lyapunov_cell_averages)."""

    def __init__(self, mesh, model, p):
        pts, w = mesh.cell_quadrature(QUADRATURE_ORDER)
        self.points = pts.reshape(-1, 3)
        self._w = w * mesh.area
        self._lyapunov_cells = lyapunov_cell_averages(mesh, model, p)

    def weights(self, f):
        return (np.asarray(f)[:, None] * self._w[None, :]).ravel()

    def lyapunov(self, f):
        """V_p of the piecewise-constant density: Σ f_c G_c / Σ f_c (inf·0 counts as 0)."""
        f = np.asarray(f)
        charged = f > 0
        return float(f[charged] @ self._lyapunov_cells[charged] / f.sum())


def _particle_setup(config, model, law, mesh):
    """(solver, x0, weights, log_f0) of the [particles] section, or None."""
    pt = config["particles"]
    if not pt:
        return None
    if pt["mode"] == "tokens":
        x0, weights = tokens_from_law(law, pt["n"], pt["seed"])
        log_f0 = None
    else:
        x0, weights, log_f0 = quadrature_particles(mesh, law)
    solver = ParticleSolver(model, pt["scheme"], pt["dt"], carry_density=pt["mode"] == "quadrature")
    return solver, x0, weights, log_f0


PARTICLE_META = {f"particle_{k}": (f"particles: {v[0]}", v[1]) for k, v in DIAGNOSTIC_META.items()}
PARTICLE_META["w2_eulerian_particles"] = (
    "W₂ between the Eulerian and the particle measures (discrete OT on HEALPix bins)", "1")
CARRIED_META = {
    "particle_min_density": ("min over quadrature particles of the carried density", "sr-1"),
    "particle_max_density": ("max over quadrature particles of the carried density", "sr-1"),
}


def execute(config: dict, path, progress: bool | None = None, log=print, snapshot_log=None) -> dict:
    """Run a resolved config, writing the NetCDF file at path. Returns a summary dict.

    The Eulerian solver and, with a [particles] section, the particle solver advance in lockstep
    from save time to save time; each snapshot (both solvers and all diagnostics) is appended to
    the file as soon as it exists.
    progress: tqdm bar on simulation time (default: when stderr is a terminal). log: where the
    one-line summary goes. snapshot_log: a text stream that gets a line per written snapshot.
    """
    start = _time.perf_counter()
    eul, tm, dg = config["eulerian"], config["time"], config["diagnostics"]
    model = build_model(config["model"])
    law = build_initial_law(config["initial"])
    mesh = HealpixMesh(eul["nside"])
    f0 = law.cell_averages(mesh)
    solver = EulerianSolver(mesh, model, scheme=eul["scheme"], cfl=eul["cfl"], rk_order=eul["rk_order"])
    measure = _CellMeasure(mesh, model, dg["p"])
    diagnostics = MeasureDiagnostics(model, measure.points, measure.weights(f0), p=dg["p"],
                                     w2_nside=dg["w2_nside"], lyapunov0=measure.lyapunov(f0))
    particles = _particle_setup(config, model, law, mesh)
    C0_user, C1 = dg["C0"], dg["C1"]
    variables = dict(SOLVER_META)
    variables.update(DIAGNOSTIC_META)
    variables["w2_bound_zero_temperature"] = (
        "√(2V_p(ρ₀)) exp(−pγt/σ_max(B)): bound on W₂(ρ_t, Π#ρ₀) at β = ∞", "1")
    if C1 is not None and not model.zero_temperature:
        variables["w2_bound_finite_beta"] = ("2√(log(β+1)/β)(e^{C₁t} − e^{C₀t}): bound on W₂(ρ_t^β, ρ_t^∞)", "1")
    ell0 = float(f0.min())
    attrs = {
        "nside": mesh.nside, "scheme": eul["scheme"], "cfl": eul["cfl"], "rk_order": eul["rk_order"],
        "beta": "inf" if model.zero_temperature else model.beta,
        "log_beta": "inf" if model.zero_temperature else math.log(model.beta),
        "model": model.describe(), "dim_E": model.E.dim, "dim_F": model.F.dim, "gap": model.gap,
        "sigma_max_B": model.sigma_max, "assumption_flags": model.assumption_flags,
        "initial_law": repr(law), "ell0": ell0, "lyapunov_p": dg["p"],
        "lyapunov_initial": diagnostics.lyapunov0, "w2_method": diagnostics.w2_method,
        "diagnostics_measure": (f"cell averages on an exact-area rule of order {QUADRATURE_ORDER} per cell; "
                                "V_p with the singular integrand integrated adaptively per cell"),
    }
    dims, arrays, static = {}, {}, {}
    if particles:
        psolver, x0, pweights, log_f0 = particles
        pdiag = MeasureDiagnostics(model, x0, pweights, p=dg["p"], w2_nside=dg["w2_nside"])
        variables.update(PARTICLE_META)
        dims = {"particle": x0.shape[0], "xyz": 3}
        arrays["positions"] = (("particle", "xyz"), "particle positions on the unit sphere", "1")
        static["particle_weights"] = (("particle",), pweights, "particle weights (mass)", "1")
        if log_f0 is not None:
            variables.update(CARRIED_META)
            arrays["particle_density"] = (("particle",), "density carried along the characteristic", "sr-1")
        attrs.update({"particle_mode": config["particles"]["mode"], "particle_scheme": psolver.scheme,
                      "particle_dt": psolver.dt, "particle_hardmax": int(psolver.hardmax),
                      "particle_lyapunov_initial": pdiag.lyapunov0})

    def paper_curves(times, c0):
        times = np.asarray(times, dtype=float)
        out = {"lower_bound_paper": 0.5 * ell0 * np.exp(-c0 * times)}
        curves = diagnostics.theory_curves(times, C0=c0, C1=C1)
        out.update({k: v for k, (v, _) in curves.items()})
        return out

    times = save_times(tm["t_end"], tm["save_every"])
    if progress is None:
        progress = sys.stderr.isatty()
    bar = progress_bar(tm["t_end"]) if progress else None
    records = []
    max_sup_div = -math.inf
    writer = RunWriter(path, mesh, config, variables, attrs, dims=dims, arrays=arrays, static=static,
                       n_snapshots=len(times))
    try:
        particle_iter = psolver.snapshots(x0, pweights, times, log_f0) if particles else None
        for k, t, f, rec in solver.snapshots(f0, times):
            max_sup_div = max(max_sup_div, rec["sup_div"])
            c0 = C0_user if C0_user is not None else max_sup_div
            values = dict(rec)
            cell_weights = measure.weights(f)
            values.update(diagnostics(measure.points, cell_weights, lyapunov_value=measure.lyapunov(f)))
            values.update({name: float(v[0]) for name, v in paper_curves([t], c0).items()})
            snapshot_arrays = {}
            if particle_iter is not None:
                _, _, x, log_f = next(particle_iter)
                values.update({f"particle_{n}": v for n, v in pdiag(x, pweights).items()})
                values["w2_eulerian_particles"] = w2_binned(measure.points, cell_weights, x, pweights,
                                                            nside=dg["w2_nside"])
                snapshot_arrays["positions"] = x
                if log_f is not None:
                    density = np.exp(log_f)
                    snapshot_arrays["particle_density"] = density
                    values["particle_min_density"] = float(density.min())
                    values["particle_max_density"] = float(density.max())
            index = writer.append(t, f, values, snapshot_arrays)
            records.append(values)
            if bar is not None:
                bar.update(t - bar.n)
            if snapshot_log is not None:
                print(f"snapshot {index} t = {t:.6g} written: min f = {rec['min_density']:.4e}, "
                      f"alignment E = {values['alignment_E']:.4f}", file=snapshot_log, flush=True)
        if bar is not None:
            bar.close()
        c0 = max_sup_div if C0_user is None else C0_user
        for name, values in paper_curves([r["time"] for r in records], c0).items():
            writer.set_variable(name, values)
        wall = _time.perf_counter() - start
        mass = np.array([r["mass"] for r in records])
        summary = {
            "path": str(path), "t_end": times[-1], "snapshots": len(records),
            "steps": int(records[-1]["steps"]), "rejected_steps": int(solver.last_run["rejected"]),
            "mass_drift": float(np.abs(mass - mass[0]).max()),
            "min_density": min(r["min_density"] for r in records), "wall_seconds": wall,
        }
        writer.set_attrs({"C0": c0, "C0_source": "user" if C0_user is not None else "largest sup div v seen in the run",
                          "C1": C1, "steps": summary["steps"], "rejected_steps": summary["rejected_steps"],
                          "wall_seconds": wall})
        if particles:
            writer.set_attrs({"particle_field_evaluations": psolver.evaluations})
        writer.close(complete=True)
    except BaseException:
        writer.close(complete=False)
        raise
    if log is not None:
        extra = f", {x0.shape[0]} particles" if particles else ""
        log(f"spherepde run: t = {summary['t_end']:g} in {wall:.1f} s, {summary['steps']} steps "
            f"({summary['rejected_steps']} rejected){extra}, {summary['snapshots']} snapshots, "
            f"mass drift {summary['mass_drift']:.1e}, min density {summary['min_density']:.3e} → {path}")
    return summary
