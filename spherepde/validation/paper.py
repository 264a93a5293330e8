"""Reproduction of the seed paper's experiments (`spherepde validate paper --out DIR [--quick]`).

Sweeps (spherepde sweep files), the paper's matrices V = diag(−1, 1, −2), B = diag(−1, −1, 1):

- solvers/paper_beta.toml: β ∈ {10, 30, 1000, ∞} × initial laws {uniform, projected normal,
  vMF}: the mean field, by the Eulerian solver with atoms and the quadrature particles of the
  same mesh in lockstep, t ≤ 20; run on nside 16 and 8 (half the resolution: every Eulerian
  number is reported with its difference to it), and 32 with slow (observed orders);
- solvers/sweeps/paper_tokens.toml (β = 10, 30) and paper_tokens_sharp.toml (β = 1000, ∞): n = 2000
  tokens alone for the same cases over 8 seeds (the ensembles: mean ± 95 % interval,
  spherepde.validation.ensembles), each case one batched run (`[particles] systems = 8`, seeds
  1 … 8: one run file with a `system` dimension, read here as 8 cases, one per seed);
- solvers/sweeps/paper_tokens_n.toml: the tokens' F-onset against n (500 … 8000, 8 seeds batched
  per n), for one case whose mean field has an onset; solvers/sweeps/paper_tokens_n_large.toml
  continues it to n = 16 000 and 32 000: run with slow, otherwise read where its runs exist;
- solvers/paper_ablation.toml: five (V, B) settings at β = 30 (data/ablation_matrices.md);
- solvers/sweeps/beta_phase.toml: ~12 β from 3 to 3000 (nside 16, t ≤ 20), the (t, β) phase
  diagram.

Complete run files already in the output folders are reused (same config: nothing is
recomputed). The report DIR/report.md (figures beside it) holds the paper's table beside ours,
per β and initial law the metrics below for both mean-field discretisations with their
resolution differences and for the token ensembles, the theory curves on the same axes, the
tokens against n, the ablation table with Mollweide maps, the phase diagram, and where we
disagree with the paper and why.

Metrics (plain functions of a run Dataset, `prefix="particle_"` for the particles or tokens):

- `max_alignment`: max over save times of the alignment with E, ∫|Q_E x|² dρ_t
  (spherepde.analysis.diagnostics), and the first save time where it is reached;
- `f_phase_onset`: the first time after that maximum at which the alignment with F exceeds the
  alignment with E (zero of the difference, linear between save times); NaN if never by t_end;
- `u_curve_minimum`: min over save times of W₂(ρ_t, Π#ρ₀) and its time (the bottom of the
  U-curve: concentration on Π#ρ₀, then departure from it).

`quick=True` runs the same machinery on CI-sized runs (nside 4 and 8, 300 tokens over 3 seeds
batched as 3 systems, t ≤ 8, fewer β); the report says so. `nsides` replaces the meshes of
paper_beta (one sweep per nside; the ablation uses the finest).
"""

from __future__ import annotations

import csv
import json
import math
import time
import tomllib
from pathlib import Path

import numpy as np

from ..analysis.metrics import (
    cell_quadrature_measure,
    f_phase_onset,
    max_alignment,
    principal_axis,
    regular_snapshots,
    u_curve_minimum,
    value_at,
    zero_temperature_push,
    zero_temperature_reference,
)
from ..runner.sweep import base_config
from ..runner.toml_text import toml_document
from .common import REPO, beta_text
from .convergence import METRICS, by_law_and_beta, convergence_cells
from .ensembles import group_by, interval, interval_text, onset_text

__all__ = ["max_alignment", "f_phase_onset", "u_curve_minimum", "value_at", "principal_axis",
           "cell_quadrature_measure", "zero_temperature_push",
           "zero_temperature_reference", "derive_sweep", "expand_sweep", "run_sweep_files", "run_suite",
           "PAPER_BETA", "PAPER_ABLATION", "BETA_PHASE", "PAPER_TABLE"]

PAPER_BETA = REPO / "solvers" / "paper_beta.toml"
PAPER_ABLATION = REPO / "solvers" / "paper_ablation.toml"
BETA_PHASE = REPO / "solvers" / "sweeps" / "beta_phase.toml"
PAPER_TABLE = REPO / "data" / "paper_table.csv"
ABLATION_MATRICES = REPO / "data" / "ablation_matrices.toml"

PAPER_TOKENS = REPO / "solvers" / "sweeps" / "paper_tokens.toml"  # β = 10, 30 (dt 0.05)
PAPER_TOKENS_SHARP = REPO / "solvers" / "sweeps" / "paper_tokens_sharp.toml"  # β = 1000, ∞ (dt 0.01)
PAPER_TOKENS_N = REPO / "solvers" / "sweeps" / "paper_tokens_n.toml"
PAPER_TOKENS_N_LARGE = REPO / "solvers" / "sweeps" / "paper_tokens_n_large.toml"  # n = 16 000, 32 000
# the meshes of paper_beta: the resolution of the report and half of it (and, slow, twice it)
FULL_NSIDES, SLOW_NSIDES, QUICK_NSIDES = (8, 16), (8, 16, 32), (4, 8)

# CI-sized runs of --quick
QUICK_BASE = {"particles.dt": 0.05, "time.t_end": 8.0, "time.save_every": 0.2}
QUICK_SYSTEMS = 3  # seeds 1, 2, 3 as one batched run per case
QUICK_TOKENS = {"particles.n": 300, "particles.seed": 1, "particles.systems": QUICK_SYSTEMS}
QUICK_N = [100, 300]
QUICK_BETAS = [10.0, "inf"]
QUICK_PHASE_RUNS = 4


# ====================================================================== sweep files
def _load_toml(path):
    with open(path, "rb") as fh:
        return tomllib.load(fh)


def derive_sweep(path, out_dir, base_overrides=None, grid=None, name=None):
    """A copy of the sweep file at path, written into out_dir with its base run config beside it,
    with base values replaced ({"section.key": value}) and grid axes replaced or restricted
    ({grid key: list}). Returns the path of the new sweep file. The run grid and everything else
    of the original sweep are kept."""
    raw = _load_toml(path)
    base = json.loads(json.dumps(base_config(path, raw["sweep"], raw)))  # a copy: changed below
    grid_table = dict(raw["sweep"].get("grid", {}))
    for key, value in (base_overrides or {}).items():
        section, _, item = key.partition(".")
        if section not in base and section == "particles":
            continue  # no particles in this sweep: nothing to shrink
        base.setdefault(section, {})[item] = value
        if key in grid_table:  # a grid axis would set it again
            grid_table[key] = [value]
    sweep = {k: v for k, v in raw["sweep"].items() if k not in ("grid", "base")}
    if name:
        sweep["name"] = name
    grid_table.update(grid or {})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = sweep.get("name", Path(path).stem)
    base_path = out / f"{stem}.base.toml"
    base_path.write_text(f"# base run config of {stem}, derived from {path}\n" + toml_document(base))
    sweep["base"] = base_path.name
    sweep_path = out / f"{stem}.sweep.toml"
    sweep_path.write_text(f"# derived from {path}\n" + toml_document({"sweep": sweep, "sweep.grid": grid_table}))
    return sweep_path


def expand_sweep(path, out_dir=None):
    """The runs (spherepde.runner.sweep.RunSpec) of a sweep file, their files in out_dir."""
    from ..runner.sweep import expand

    return expand(path, out_dir)


def _run_file(out_dir, spec):
    return Path(out_dir) / f"{spec.run_id}.nc"


def run_sweep_files(path, out_dir, workers=2, say=print, scheduler=None):
    """Run a sweep file into out_dir with spherepde.runner.sweep.run_sweep (complete run files with the
    same config are skipped, interrupted ones continued), on a LocalCluster of `workers` or on the
    running scheduler at `scheduler` (spherepde.runner.sweep.local_cluster). Returns (specs, combined
    dataset path or None, failures [(run id, reason)])."""
    from ..runner.sweep import SweepFailure, run_sweep

    out = Path(out_dir)
    specs = expand_sweep(path, out)
    try:
        combined = run_sweep(path, out_dir=out, scheduler=scheduler, workers=workers, progress=False, log=say)
        failures = []
    except SweepFailure as exc:
        combined, failures = exc.combined, exc.failures
    return specs, combined, failures


# ====================================================================== collecting runs
def _label(value):
    if isinstance(value, dict):
        return str(value.get("label", json.dumps(value)))
    return str(value)


def _beta(value):
    return math.inf if isinstance(value, str) and value.strip().lower() in ("inf", "infinity") else float(value)


def _fmt(x, digits=3):
    return "—" if x is None or not np.isfinite(x) else f"{x:.{digits}f}"


def _fmt_t(x):
    return "none" if x is None or not np.isfinite(x) else f"{x:.1f}"


class Case:
    """One run of a sweep, or one system of a batched run: its spec, β, initial-law label, case
    label, metrics per solver ("eulerian": the density with atoms; "particles": the particles in
    the run, tokens or quadrature particles, `particle_mode`). A run of tokens alone has nside None.

    series: the per-snapshot diagnostics (regular snapshots only), from the run file or from the
    sweep's combined file (one row of it; then complete and wall come from run_complete and
    run_wall_seconds). ds: the whole run file (fields included), read on first use, so a report
    that needs the fields of a few runs reads only those files.

    system: None for a run of one system; k for system k of a batched run (`[particles] systems`
    = M > 1): its seed is `seed + k`, series and ds are that system's (`isel(system=k)`), and
    complete and wall are the batch's (one file, one wall time for all M systems).
    """

    def __init__(self, spec, path, ds=None, series=None, complete=None, wall=None, system=None):
        from ..runner.build import build_initial_law, build_model

        self.spec, self.path, self._ds, self.system = spec, Path(path), ds, system
        cfg = spec.config
        self.beta = _beta(cfg["model"]["beta"])
        self.law = _label(spec.params["initial"]) if "initial" in spec.params else cfg["initial"]["kind"]
        self.case = _label(spec.params["model"]) if "model" in spec.params else None
        eulerian = cfg["eulerian"].get("enabled", True)
        self.nside = int(cfg["eulerian"]["nside"]) if eulerian else None
        pt = cfg.get("particles")
        self.particle_mode = pt["mode"] if pt else None
        self.n_tokens = int(pt["n"]) if pt and pt["mode"] == "tokens" else 0
        self.seed = int(pt["seed"]) + (system or 0) if pt and pt["mode"] == "tokens" else None
        self.model = build_model(cfg["model"]).single_head  # the paper's cases: one head
        self.initial_law = build_initial_law(cfg["initial"])
        if series is None:
            series = _diagnostics(ds)
            complete, wall = ds.attrs.get("complete", 0), ds.attrs.get("wall_seconds", math.nan)
        self.series = series
        self.complete = int(complete) == 1
        self.wall = float(wall)
        self.t_end = float(series["time"].values[-1])
        self.t_planned = float(cfg["time"]["t_end"])
        self.metrics = {}
        for who, prefix in (("eulerian", ""), ("particles", "particle_")):
            if prefix + "alignment_E" not in series:
                continue
            self.metrics[who] = {"max_E": max_alignment(series, prefix), "onset": f_phase_onset(series, prefix),
                                 "w2_min": u_curve_minimum(series, prefix)}

    @property
    def ds(self):
        """The whole run file (spherepde.open_run: checksums verified), read once; of a batched
        run, this case's system."""
        if self._ds is None:
            from ..storage.runfile import open_run

            ds = open_run(self.path)
            self._ds = ds if self.system is None else ds.isel(system=self.system)
        return self._ds

    @property
    def particle_label(self):
        return {"tokens": f"tokens (n = {self.n_tokens})", "quadrature": "quadrature particles"}.get(
            self.particle_mode, "particles")


def _diagnostics(ds):
    """The per-snapshot diagnostics ((time,) variables) of a run Dataset, regular snapshots only."""
    ds = regular_snapshots(ds)
    return ds[[n for n, v in ds.data_vars.items() if v.dims == ("time",)]]


def _systems(spec):
    """The number of token systems batched in a run (`[particles] systems`; 1 without particles)."""
    return int((spec.config.get("particles") or {}).get("systems", 1))


def _cases_from_combined(specs, out_dir, combined_path):
    """Cases from a sweep's combined file, or None when it cannot stand in for the run files (not
    current for these specs, written before it carried snapshot_kind and run_complete, or a
    sweep of batched runs: the combined file keeps (time,) variables only, so it lacks their
    per-system diagnostics (system, time))."""
    import xarray as xr

    from ..runner.sweep import combined_is_current

    if combined_path is None or any(_systems(spec) > 1 for spec in specs):
        return None
    if not combined_is_current(combined_path, specs):
        return None
    with xr.open_dataset(combined_path, engine="netcdf4") as handle:
        if "snapshot_kind" not in handle or "run_complete" not in handle:
            return None
        combined = handle.load()
    drop = [n for n, v in combined.data_vars.items() if "time" not in v.dims]
    cases = []
    for i, spec in enumerate(specs):
        row = combined.isel(run=i)
        kind = row["snapshot_kind"].values
        series = row.drop_vars(drop).isel(time=np.nonzero(kind == 0)[0])
        series = series.drop_vars([n for n in series.coords if n != "time"])
        if series.sizes["time"] >= 2:
            cases.append(Case(spec, _run_file(out_dir, spec), series=series,
                              complete=int(row["run_complete"]), wall=float(row["run_wall_seconds"])))
    return cases


def _system_cases(spec, path, ds):
    """The cases of a batched run file (a `system` dimension): one per system k, seed + k, with
    that system's diagnostics. The run's fields are not kept (a case reads them again if asked):
    8 systems of 2000 tokens saved 201 times are 77 MB of positions per file."""
    complete, wall = ds.attrs.get("complete", 0), ds.attrs.get("wall_seconds", math.nan)
    return [Case(spec, path, series=_diagnostics(ds.isel(system=k)), complete=complete, wall=wall, system=k)
            for k in range(ds.sizes["system"])]


def collect(specs, out_dir, combined=None):
    """Cases of the run files of a sweep that exist (complete or not): one per run, or one per
    system of a batched run (`[particles] systems` > 1). combined: the sweep's combined file;
    when it is current for these specs (spherepde.runner.sweep.combined_is_current) and they are
    not batched, the diagnostics come from it and no run file is read until a case's fields are
    needed."""
    from ..storage.runfile import RunFileError, open_run

    cases = _cases_from_combined(specs, out_dir, combined)
    if cases is not None:
        return cases
    cases = []
    for spec in specs:
        path = _run_file(out_dir, spec)
        try:
            ds = open_run(path)
        except RunFileError:
            continue
        if ds.sizes.get("time", 0) < 2:
            continue
        cases += _system_cases(spec, path, ds) if "system" in ds.dims else [Case(spec, path, ds=ds)]
    return cases


def _combined_from_cases(cases):
    """A `run`-dimension dataset of the (time,) diagnostics (when no sweep combined file exists)."""
    import xarray as xr

    parts = []
    for c in cases:
        ds = c.series
        names = [n for n, v in ds.data_vars.items() if v.dims == ("time",)]
        part = ds[names].expand_dims("run")
        part = part.assign_coords(run_id=("run", [c.spec.run_id]), model_beta=("run", [c.beta]))
        parts.append(part)
    return xr.concat(parts, dim="run", join="outer") if parts else None


# ====================================================================== figures
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _log_density(values, floor=1e-5):
    v = np.asarray(values, dtype=float)
    top = np.nanmax(v)
    return np.log10(np.maximum(v, top * floor))


def _token_map(points, weights, nside=8):
    """The particles' mass per HEALPix cell over its area (sr⁻¹)."""
    import healpy as hp

    pts = np.asarray(points)
    pix = hp.vec2pix(nside, pts[:, 0], pts[:, 1], pts[:, 2], nest=True)
    npix = 12 * nside * nside
    return np.bincount(pix, weights=weights, minlength=npix) / (4 * math.pi / npix)


def figure_law(cases, law, nside, references, path):
    """Rows β; columns: alignment (Eulerian), alignment (particles), W₂ to Π#ρ₀ (Eulerian), (particles);
    theory on the same axes: β = ∞ exact curves, the bound √(2V_p(ρ₀))e^{−pγt/σ_max}, t = log β."""
    plt = _plt()
    rows = sorted([c for c in cases if c.law == law and c.nside == nside], key=lambda c: c.beta)
    if not rows:
        return None
    fig, axes = plt.subplots(len(rows), 4, figsize=(13, 2.3 * len(rows) + 0.6), squeeze=False, sharex=True)
    for r, c in enumerate(rows):
        ds = c.series
        t = ds.time.values
        ref = references.get(law)
        for j, (who, prefix) in enumerate((("Eulerian", ""), (c.particle_label, "particle_"))):
            ax = axes[r, j]
            if prefix + "alignment_E" in ds:
                ax.plot(t, ds[prefix + "alignment_E"], "C0", label="alignment with E")
                ax.plot(t, ds[prefix + "alignment_F"], "C1", label="alignment with F")
                onset = c.metrics["eulerian" if not prefix else "particles"]["onset"]
                if np.isfinite(onset):
                    ax.axvline(onset, color="C1", lw=0.8, ls=":", label=f"F-onset {onset:.1f}")
            if ref is not None:
                ax.plot(ref["t"], ref["alignment_E"], "k--", lw=0.8, label="E, β = ∞ exact")
            ax.set_ylim(-0.02, 1.02)
            ax.set_title(f"β = {beta_text(c.beta)}: alignment ({who})", fontsize=8)
            ax = axes[r, 2 + j]
            if prefix + "w2_to_projection" in ds:
                ax.semilogy(t, ds[prefix + "w2_to_projection"], "C0", label="W₂(ρ_t, Π#ρ₀)")
            ax.semilogy(t, ds["w2_bound_zero_temperature"], "C3--", lw=0.8, label="bound √(2V_p)e^{−pγt/σ}")
            if ref is not None:
                ax.semilogy(ref["t"], np.maximum(ref["w2_to_projection"], 1e-6), "k--", lw=0.8, label="β = ∞ exact")
            ax.set_ylim(1e-3, 3)
            ax.set_title(f"β = {beta_text(c.beta)}: W₂ to Π#ρ₀ ({who})", fontsize=8)
        for ax in axes[r]:
            if math.isfinite(c.beta) and c.beta > 1:
                ax.axvline(math.log(c.beta), color="grey", lw=0.8, ls="-.", label="t = log β")
            ax.grid(True, alpha=0.3)
            ax.tick_params(labelsize=7)
        if r == 0:
            for ax in axes[r]:
                ax.legend(fontsize=6, loc="best")
    for ax in axes[-1]:
        ax.set_xlabel("t", fontsize=8)
    fig.suptitle(f"initial law {law}, Eulerian + atoms nside {nside} | {rows[0].particle_label}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return path


def figure_ablation(cases, path):
    """Per case: alignment time series (Eulerian solid, particles dashed), Eulerian density at
    t = log β and at the end, the particles' density (HEALPix-8 histogram) at the end; log₁₀ colour."""
    from ..visualization.plots import mollweide

    plt = _plt()
    if not cases:
        return None
    fig, axes = plt.subplots(len(cases), 4, figsize=(14, 2.4 * len(cases)), squeeze=False,
                             gridspec_kw={"width_ratios": [1.0, 1.3, 1.3, 1.3]})
    for r, c in enumerate(cases):
        ds = regular_snapshots(c.ds)
        t = ds.time.values
        ax = axes[r, 0]
        ax.plot(t, ds.alignment_E, "C0", label="E")
        ax.plot(t, ds.alignment_F, "C1", label="F")
        if "particle_alignment_E" in ds:
            ax.plot(t, ds.particle_alignment_E, "C0--", label="E particles")
            ax.plot(t, ds.particle_alignment_F, "C1--", label="F particles")
        if math.isfinite(c.beta):
            ax.axvline(math.log(c.beta), color="grey", lw=0.8, ls="-.")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(c.case, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, alpha=0.3)
        if r == 0:
            ax.legend(fontsize=6)
        t_early = math.log(c.beta) if math.isfinite(c.beta) else 2.0
        k_early = int(np.abs(t - t_early).argmin())
        for j, k in ((1, k_early), (2, t.size - 1)):
            mollweide(_log_density(ds.density.values[k]), ax=axes[r, j], colorbar=False, xsize=300,
                      title=f"log₁₀ f (Eulerian), t = {t[k]:.1f}")
        if "positions" in ds:
            particles = _token_map(ds.positions.values[-1], ds.particle_weights.values)
            mollweide(_log_density(particles, floor=1e-3), ax=axes[r, 3], colorbar=False, xsize=300,
                      title=f"log₁₀ particle density (HEALPix-8 bins), t = {t[-1]:.1f}")
        else:
            axes[r, 3].set_axis_off()
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return path


def figure_phase(combined, onsets, path):
    """(t, β) maps of the alignment with E and with F (finite β), t = log β and the measured
    F-onsets overlaid."""
    plt = _plt()
    betas = np.array([_beta(b) for b in np.atleast_1d(combined["model_beta"].values)])
    keep = np.isfinite(betas)
    order = np.argsort(betas[keep])
    idx = np.nonzero(keep)[0][order]
    if idx.size < 2:
        return None
    b = betas[idx]
    t = np.asarray(combined["time"].values, dtype=float)
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    for ax, name in zip(axes, ("alignment_E", "alignment_F")):
        z = np.asarray(combined[name].values, dtype=float)[idx]
        mesh = ax.pcolormesh(t, b, z, shading="nearest", vmin=0, vmax=1, cmap="viridis")
        ax.plot(np.log(b), b, "w-.", lw=1, label="t = log β")
        ob = [(o, bb) for bb, o in onsets if np.isfinite(o) and np.isfinite(bb)]
        if ob:
            ax.plot([o for o, _ in ob], [bb for _, bb in ob], "r^", ms=5, label="F-onset (Eulerian)")
        ax.set_yscale("log")
        ax.set_xlim(t[0], t[-1])
        ax.set_xlabel("t")
        ax.set_title(name.replace("_", " with "), fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
        fig.colorbar(mesh, ax=ax)
    axes[0].set_ylabel("β")
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return path


# ====================================================================== the report
def read_paper_table(path=PAPER_TABLE):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def _abl_description():
    try:
        return {k: v.get("description", "") for k, v in _load_toml(ABLATION_MATRICES).items()}
    except OSError:
        return {}


def _ablation_rows(cases):
    """Per case: spectra and flags, early behaviour (t ≤ log β) and terminal behaviour."""
    rows = []
    for c in cases:
        ds = regular_snapshots(c.ds)
        t_early = math.log(c.beta) if math.isfinite(c.beta) else 2.0
        m = c.model
        axis, frac = principal_axis(*_eulerian_measure(ds, -1, c.nside))
        row = {
            "case": c.case, "eig": ", ".join(_complex_text(z) for z in m.E.eigenvalues),
            "dimE": m.E.dim, "E": _basis_text(m.E.basis), "F": _basis_text(m.F.basis), "gap": m.gap,
            "flags": ", ".join(k for k, v in m.assumption_flags.items() if v) or "none",
            "E_at_logb": value_at(ds, "alignment_E", t_early), "w2_min": u_curve_minimum(ds),
            "E_end": float(ds.alignment_E.values[-1]), "F_end": float(ds.alignment_F.values[-1]),
            "axis": axis, "axis_frac": frac, "t_end": c.t_end, "t_early": t_early,
        }
        if "particle_alignment_E" in ds:
            paxis, pfrac = principal_axis(ds.positions.values[-1], ds.particle_weights.values)
            row.update(pE_at_logb=value_at(ds, "alignment_E", t_early, "particle_"),
                       pE_end=float(ds.particle_alignment_E.values[-1]),
                       pF_end=float(ds.particle_alignment_F.values[-1]), paxis=paxis, paxis_frac=pfrac)
        rows.append(row)
    return rows


def _complex_text(z):
    z = complex(z)
    if abs(z.imag) < 1e-12:
        return f"{z.real:.4g}"
    return f"{z.real:.3g}{z.imag:+.3g}i"


def _basis_text(basis):
    return " ⊕ ".join("(" + ", ".join(f"{v:.3g}" for v in col) + ")" for col in np.asarray(basis).T)


def _axis_text(axis, frac):
    return "±(" + ", ".join(f"{v:.2f}" for v in axis) + f") [{frac:.2f}]"


def _metric(case, who, name):
    """One of the three metrics of a case's solver ("eulerian" | "particles"), NaN if absent."""
    m = case.metrics.get(who) if case is not None else None
    if m is None:
        return math.nan
    return {"onset": m["onset"], "max_E": m["max_E"][0], "w2_min": m["w2_min"][0]}[name]


def _with_difference(fine, coarse, digits=3):
    """'value [Δ d]': the value on the finest mesh and its difference to the mesh of half the
    resolution (the resolution error a reader should read the value with)."""
    if not np.isfinite(fine):
        return "none" if coarse is not None and not np.isfinite(coarse) else "—"
    if coarse is None:
        return f"{fine:.{digits}f}"
    if not np.isfinite(coarse):
        return f"{fine:.{digits}f} [none at half the resolution]"
    return f"{fine:.{digits}f} [Δ {fine - coarse:+.1e}]"


def token_groups(token_cases):
    """{(law, β, n): [cases]} of the token ensembles (runs of tokens alone)."""
    return group_by(token_cases, lambda c: (c.law, c.beta, c.n_tokens))


def _token_cell(groups, law, beta, name, n=None, digits=3):
    """mean ± 95 % of a metric over the seeds of (law, β[, n]); the F-onset with its count."""
    runs = [c for (lw, b, k), cs in groups.items() if lw == law and b == beta and (n is None or k == n) for c in cs]
    if not runs:
        return "not run"
    values = [_metric(c, "particles", name) for c in runs]
    if name == "onset":
        return onset_text(values)
    return interval_text(interval(values), digits)


def _main_table(cases_by_nside, groups, paper_rows, law="uniform"):
    """The paper's rows beside ours: Eulerian + atoms on the finest mesh with its difference to
    half the resolution, the quadrature particles of that mesh, the token ensemble."""
    with_law = sorted(n for n, cs in cases_by_nside.items() if any(c.law == law for c in cs))
    if not with_law:
        return [f"No {law}-law run."]
    fine, coarse = with_law[-1], (with_law[-2] if len(with_law) > 1 else None)
    n_tok = sorted({k for (lw, _, k) in groups if lw == law})
    tok_head = f"tokens n = {n_tok[0]}, mean ± 95 %" if len(n_tok) == 1 else "tokens, mean ± 95 %"
    lines = [f"| β | paper: max alignment E | Eulerian + atoms, nside {fine} [Δ to nside {coarse}] "
             f"| quadrature particles, nside {fine} | {tok_head} | paper: F-phase onset "
             f"| Eulerian + atoms [Δ] | quadrature particles | {tok_head} (seeds with an onset) |",
             "|---|---|---|---|---|---|---|---|---|"]

    def find(nside, beta):
        match = [c for c in cases_by_nside.get(nside, []) if c.law == law and c.beta == beta]
        return match[0] if match else None

    for prow in paper_rows:
        beta = _beta(prow["beta"])
        c, cc = find(fine, beta), (find(coarse, beta) if coarse else None)
        cells = []
        for name, paper in (("max_E", prow["max_alignment_E"]), ("onset", prow["f_phase_onset"])):
            digits = 4 if name == "max_E" else 2
            e = _with_difference(_metric(c, "eulerian", name), _metric(cc, "eulerian", name) if cc else None,
                                 digits) if c else "not run"
            part = _fmt(_metric(c, "particles", name), digits) if c else "not run"
            if name == "onset" and c is not None and not np.isfinite(_metric(c, "particles", name)):
                part = "none"
            cells += [paper, e, part, _token_cell(groups, law, beta, name, digits=digits)]
        lines.append(f"| {beta_text(beta)} | " + " | ".join(cells) + " |")
    return lines


def _convergence_table(beta_cases, groups):
    """Per law, β and metric: the Eulerian solver with atoms and the quadrature particles over the
    meshes (differences, observed order), and the token ensemble."""
    nsides = sorted({c.nside for c in beta_cases})
    mesh_text = " / ".join(map(str, nsides))
    lines = [f"| law | β | quantity | Eulerian + atoms (nside {mesh_text}) | differences | order "
             f"| quadrature particles (nside {mesh_text}) | differences | order | tokens, mean ± 95 % (n; seeds) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (law, beta), runs in sorted(by_law_and_beta(beta_cases).items()):
        for (label, _), name in zip(METRICS, ("onset", "max_E", "w2_min")):
            eul = {n: _metric(c, "eulerian", name) for n, c in runs.items()}
            part = {n: _metric(c, "particles", name) for n, c in runs.items()}
            ns = sorted({k for (lw, b, k) in groups if lw == law and b == beta})
            tok = "; ".join(f"{_token_cell(groups, law, beta, name, n)} (n = {n}; "
                            f"{len(groups[(law, beta, n)])})" for n in ns) or "not run"
            lines.append(f"| {law} | {beta_text(beta)} | {label} | " + " | ".join(convergence_cells(eul)) + " | "
                         + " | ".join(convergence_cells(part)) + f" | {tok} |")
    return lines


def _n_table(n_cases, mean_field):
    """The token F-onset (and max alignment, min W₂) against n, over seeds; the mean-field value
    beside it. mean_field: [(label, Case, solver)] of mean-field runs of the same law and β."""
    if not n_cases:
        return []
    groups = token_groups(n_cases)
    (law, beta, _), *_ = groups
    lines = [f"{law} law, β = {beta_text(beta)}: each row is an ensemble of seeds, mean ± its 95 % interval "
             "(Student t) and the standard deviation of one sample's F-onset.", "",
             "| n | seeds | F-onset: mean ± 95 % (seeds with an onset) | std of one sample | max alignment E "
             "| min W₂(ρ_t, Π#ρ₀) |", "|---|---|---|---|---|---|"]
    for (_, _, n), cs in sorted(groups.items(), key=lambda kv: kv[0][2]):
        onsets = [_metric(c, "particles", "onset") for c in cs]
        iv = interval(onsets)
        lines.append(f"| {n} | {len(cs)} | {onset_text(onsets)} | {_fmt(iv.std, 2)} | "
                     f"{interval_text(interval([_metric(c, 'particles', 'max_E') for c in cs]), 4)} | "
                     f"{interval_text(interval([_metric(c, 'particles', 'w2_min') for c in cs]), 4)} |")
    for label, c, who in mean_field:
        lines.append(f"| mean field: {label} | — | {_fmt(_metric(c, who, 'onset'), 2)} | — "
                     f"| {_fmt(_metric(c, who, 'max_E'), 4)} | {_fmt(_metric(c, who, 'w2_min'), 4)} |")
    return lines


_MESHES = {}


def _centroids(nside):
    from ..geometry.mesh import HealpixMesh

    if nside not in _MESHES:
        _MESHES[nside] = HealpixMesh(nside).centroids
    return _MESHES[nside]


def _eulerian_measure(ds, k, nside):
    """(points, weights) of the Eulerian measure of snapshot k: the cell centroids with f·A, and
    the atoms with their masses."""
    points, weights = _centroids(nside), ds.density.values[k] * (4 * math.pi / (12 * nside**2))
    if "atom_mass" in ds:
        masses = ds.atom_mass.values[k]
        live = masses > 0
        points = np.concatenate([points, ds.atom_position.values[k][live]])
        weights = np.concatenate([weights, masses[live]])
    return points, weights


def _axes_table(cases):
    """Where the mass is: the principal axis of ∫xxᵀdρ_t [its eigenvalue] of the Eulerian measure
    (density and atoms) and of the particles at t_end/4, t_end/2, 3t_end/4, t_end (uniform law,
    each β)."""
    rows = sorted([c for c in cases if c.law == "uniform"], key=lambda c: (c.nside, c.beta))
    if not rows:
        return []
    fracs = (0.25, 0.5, 0.75, 1.0)
    lines = ["| β | nside | " + " | ".join(f"t = {f:g}·t_end: Eulerian; particles" for f in fracs) + " |",
             "|---|---|" + "---|" * len(fracs)]
    for c in rows:
        ds = regular_snapshots(c.ds)
        t = ds.time.values
        cells = []
        for f in fracs:
            k = int(np.abs(t - f * c.t_planned).argmin())
            e = _axis_text(*principal_axis(*_eulerian_measure(ds, k, c.nside)))
            tok = (_axis_text(*principal_axis(ds.positions.values[k], ds.particle_weights.values))
                   if "positions" in ds else "—")
            cells.append(f"{e}; {tok} (t = {t[k]:.1f})")
        lines.append(f"| {beta_text(c.beta)} | {c.nside} | " + " | ".join(cells) + " |")
    return lines


def _references(cases, quick):
    """β = ∞ exact curves per initial law (paper matrices, B orthogonal)."""
    refs = {}
    for c in cases:
        if c.law in refs:
            continue
        t = c.series.time.values
        from ..models.attention import AttentionModel

        model = AttentionModel(c.model.B, c.model.V, math.inf)
        ref = zero_temperature_reference(model, c.initial_law, t, nside=16 if quick else 32)
        if ref is not None:
            ref["t"] = t
        refs[c.law] = ref
    return refs


def _law_lines(cases_by_nside, groups):
    """Per initial law, on the finest mesh: max alignment with E / F-onset per β of the Eulerian
    solver, the quadrature particles and the token ensemble (means)."""
    if not cases_by_nside:
        return []
    nside = max(cases_by_nside)
    lines = []
    for law in sorted({c.law for c in cases_by_nside[nside]}):
        cs = sorted([c for c in cases_by_nside[nside] if c.law == law], key=lambda c: c.beta)
        parts = []
        for who, label in (("eulerian", "Eulerian + atoms"), ("particles", "quadrature particles")):
            parts.append(label + " " + ", ".join(f"{beta_text(c.beta)}: {_fmt(_metric(c, who, 'max_E'), 3)} / "
                                                 f"{_fmt_t(_metric(c, who, 'onset'))}" for c in cs))
        tok = ", ".join(f"{beta_text(c.beta)}: {_token_cell(groups, law, c.beta, 'max_E', digits=3)} / "
                        f"{_token_cell(groups, law, c.beta, 'onset')}" for c in cs
                        if any(lw == law and b == c.beta for lw, b, _ in groups))
        if tok:
            parts.append("tokens " + tok)
        partial = "" if all(c.complete for c in cs) else " (some runs not finished)"
        lines.append(f"  - {law}, nside {nside}{partial} — max alignment E / F-onset per β: " + "; ".join(parts) + ".")
    return lines


def _ordering_lines(cases_by_nside, groups):
    """Does our β-ordering agree with the paper's (max alignment with E and the F-onset both grow
    with β; no onset at β = ∞)? Per nside, law and solver, and for the token ensembles (means)."""
    series = []
    for nside in sorted(cases_by_nside):
        for law in sorted({c.law for c in cases_by_nside[nside]}):
            cs = sorted([c for c in cases_by_nside[nside] if c.law == law], key=lambda c: c.beta)
            for who, label in (("eulerian", "Eulerian + atoms"), ("particles", "quadrature particles")):
                if all(who in c.metrics for c in cs):
                    series.append((law, str(nside), label, [_metric(c, who, "max_E") for c in cs],
                                   [_metric(c, who, "onset") for c in cs]))
    for law in sorted({lw for lw, _, _ in groups}):
        for n in sorted({k for lw, _, k in groups if lw == law}):
            keys = sorted((key for key in groups if key[0] == law and key[2] == n), key=lambda key: key[1])
            peaks = [interval([_metric(c, "particles", "max_E") for c in groups[key]]).mean for key in keys]
            onsets = [interval([_metric(c, "particles", "onset") for c in groups[key]]).mean for key in keys]
            series.append((law, "—", f"tokens n = {n} (means over seeds)", peaks, onsets))
    lines = []
    for law, nside, label, peak, onset in series:
        if len(peak) < 2:
            continue
        onset = [o if np.isfinite(o) else math.inf for o in onset]
        up_peak = all(b >= a - 5e-4 for a, b in zip(peak, peak[1:]))
        up_onset = all(b >= a for a, b in zip(onset, onset[1:]))
        some = any(np.isfinite(o) for o in onset)
        lines.append(f"| {law} | {nside} | {label} | {'yes' if up_peak else 'no'} | "
                     f"{('yes' if up_onset else 'no') if some else 'no onset at any β'} |")
    if not lines:
        return []
    return (["| law | nside | solver | max alignment E grows with β (±5e-4) | F-onset grows with β (none = ∞) |",
             "|---|---|---|---|---|"] + lines)


def _resolution_summary(beta_cases):
    """The largest F-onset change between the two finest meshes and the largest gap between the
    Eulerian solver and the quadrature particles on the finest, over the cases."""
    worst_mesh, worst_gap = (0.0, None), (0.0, None)
    for (law, beta), runs in by_law_and_beta(beta_cases).items():
        ns = sorted(runs)
        fine = runs[ns[-1]]
        e = _metric(fine, "eulerian", "onset")
        if len(ns) > 1:
            d = abs(e - _metric(runs[ns[-2]], "eulerian", "onset")) / e if np.isfinite(e) else math.nan
            if np.isfinite(d) and d > worst_mesh[0]:
                worst_mesh = (d, f"{law}, β = {beta_text(beta)}, nside {ns[-2]} → {ns[-1]}")
        g = abs(e - _metric(fine, "particles", "onset")) / e if np.isfinite(e) else math.nan
        if np.isfinite(g) and g > worst_gap[0]:
            worst_gap = (g, f"{law}, β = {beta_text(beta)}, nside {ns[-1]}")
    lines = []
    if worst_mesh[1]:
        lines.append(f"  Measured: the largest change of a finite Eulerian F-onset between the two finest meshes is "
                     f"{100 * worst_mesh[0]:.1f} % ({worst_mesh[1]}); the largest gap between the Eulerian solver and "
                     f"the quadrature particles on the finest mesh is {100 * worst_gap[0]:.1f} % ({worst_gap[1]}).")
    return lines


def _disagreement(cases_by_nside, groups, n_groups, paper_rows, ablation_rows, quick):
    with_uniform = [n for n, cs in cases_by_nside.items() if any(c.law == "uniform" for c in cs)]
    finest = max(with_uniform) if with_uniform else None
    uni = sorted([c for c in cases_by_nside.get(finest, []) if c.law == "uniform"], key=lambda c: c.beta)
    lines = ["## Where we disagree with the paper and why", ""]
    if quick:
        lines += ["This is a quick (CI-sized) run: the numbers below are not a reproduction.", ""]
    lines += [
        "- **The metric.** The paper's alignment metric is not published in our sources. Ours is "
        "∫|Q_E x|² dρ_t (the mean squared cosine between a token and E = span e₁); a metric such as "
        "the mean |⟨x, e₁⟩| or the fraction of tokens within some angle of ±e₁ gives other numbers "
        "for the same state (for two atoms of width ε about ±e₁ ours is ≈ 1 − ε², the mean cosine "
        "≈ 1 − ε²/2). Our maxima are therefore not comparable digit for digit with ~0.72 / ~0.89 / >0.98; "
        "what can be compared is the ordering in β and the times.",
        "- **Mean field versus n tokens: the F-phase starts from a broken symmetry.** For two antipodal "
        "atoms pδ_z + (1 − p)δ_{−z} the softmax mean at z is m(z) = tanh(β zᵀBz + ½log(p/(1 − p))) z, so the "
        "atoms move with v(z) = tanh(β zᵀBz + ½log(p/(1 − p))) P_z(Vz). At z = e₁, zᵀBz = −1 and the factor "
        "is ≈ −1 once β ≳ 3: the pair follows −∇_S(½zᵀVz), and zᵀVz (−1 at e₁, −2 at e₃) decreases towards e₃, "
        "so ±e₁ is unstable — an offset δ along e₃ grows like e^{t}, at a rate ≈ 1 for every such β. The pair "
        "stops where the factor vanishes, zᵀBz ≈ 0, i.e. at ±(e₁ ± e₃)/√2 when p ≈ ½ (alignment with E ½, "
        "with F 0); F is reached only after that, driven by p − ½ and the spread of the atoms. The uniform "
        "law, the paper's diagonal matrices and the HEALPix mesh are symmetric under x₃ → −x₃ (and x₂ → −x₂), "
        "so the mean field keeps that symmetry: its clusters at ±e₁ have no offset to grow, and it stays on "
        "E (no F-onset for the uniform law in either mean-field column). n tokens carry a sampling offset "
        "∝ 1/√n and leave E after ≈ log(1/offset) time units: their F-onset is a random variable, given here "
        "as a mean over seeds with its 95 % interval, and it grows with n (about ½ log n / rate). At β = ∞ the "
        "tokens follow the hardmax rule (one selected token instead of a softmax average: the factor above "
        "does not apply). The paper's n and law are not published in our sources.",
    ]
    if uni:
        lines.append("  Measured here (uniform law): F-onset of the Eulerian solver with atoms (nside " + str(finest) + ") "
                     + ", ".join(f"β = {beta_text(c.beta)}: {_fmt_t(_metric(c, 'eulerian', 'onset'))}" for c in uni)
                     + "; tokens " + ", ".join(f"β = {beta_text(c.beta)}: {_token_cell(groups, 'uniform', c.beta, 'onset')}"
                                               for c in uni) + ".")
    if n_groups:
        rows = sorted(n_groups.items(), key=lambda kv: kv[0][2])
        (law, beta, _), _ = rows[0]
        lines.append(f"  For the {law} law at β = {beta_text(beta)} (no symmetry: the mean field has an F-onset) the "
                     "tokens' onset against n: " + ", ".join(
                         f"n = {n}: {onset_text([_metric(c, 'particles', 'onset') for c in cs])}"
                         for (_, _, n), cs in rows) + " (table \"Tokens against n\").")
    lines += [
        "- **The initial law.** The paper's token law is not published in our sources. We report "
        "three (uniform, a projected normal, a vMF, chosen before any run); the projected normal and the "
        "vMF have no reflection symmetry, so the mean field can leave E too, and the onsets depend on the law:",
    ]
    lines += _law_lines(cases_by_nside, groups)
    lines += [
        "- **Resolution.** The clusters shrink like e^{−ct} and fall below any cell; the Eulerian solver "
        "carries them as atoms, point masses at exact positions (docs/atoms.md, validated in "
        "validation/reports/atoms/). Every Eulerian number above is given with its difference to the same run "
        "at half the resolution, and beside it the quadrature particles of the same mesh (one per cell, no "
        "numerical diffusion): two discretisations of the same mean-field limit.",
    ]
    lines += _resolution_summary([c for cs in cases_by_nside.values() for c in cs])
    lines += [
        "  Where the two disagree at β ≥ 30 neither is settled. The mean field keeps a background density "
        "between the clusters that the particles cannot carry (they all flow into the clusters), and at large β "
        "that background weighs on the clusters (validation/reports/atoms/background.md). But the Eulerian "
        "onset is not mesh-converged there either: for the projected normal at β = 30 it moves "
        "14.14 → 14.04 → 13.04 at nside 16 / 32 / 64, towards the particles' 11.7 (docs/atoms.md). With the mesh "
        "density scaled by 10⁻¹² at t = 4 (its mass given to the atoms) the Eulerian onsets at β = 30 become "
        "11.57 (projected normal) and 7.46 (vMF) at nside 16, 0.9 % and 0.3 % from the particles at nside 32; "
        "for the projected normal 11.11 / 11.57 / 11.70 at nside 8 / 16 / 32 (order 1.8; 11.70 is 0.3 % from "
        "the particles; validation/reports/atoms/background_scaling.md): "
        "the background is what separates the two columns at β = 30, not the atoms. The Eulerian column here is "
        "the finite volumes alone (`tails = \"finite_volume\"`, the default), whose tails are wrong at β ≥ 30; "
        "with the tails from log f the mean field converges with the mesh: the section \"The mean field at "
        "β ≥ 30 with the tails from log f\" and validation/reports/tails/paper.md.",
        "- **Time stepping and β.** Tokens use RK4 with a fixed dt (full set: 0.05 at β = 10 and 30, where one "
        "sample's F-onset moves by 5e-6 and 9e-5 between dt 0.05 and 0.01; 0.01 at β = 1000 and ∞); the paper "
        "uses its normalised Euler step with an unpublished step. At β = 1000 the softmax is nearly discontinuous "
        "and the tokens' step error is first order in dt (one sample's F-onset moved by 0.08 from dt 0.02 to 0.01). "
        "At β = ∞ our tokens use the hardmax rule over tokens and the Eulerian solver the local limit field. "
        "The quadrature particles use RK4 with dt 0.05: against dt 0.02 their F-onsets move by at most 4e-4 at "
        "β = 10 and 30 and by 0.16 (projected normal) and 0.08 (vMF) at β = 1000, where nside 8 → 16 moves them "
        "by 0.69; min W₂ moves by at most 1 % (docs/validation.md).",
        "- **Nothing was tuned to match:** the matrices and β are the paper's, the laws and n are "
        "stated above, the metrics are those of spherepde.analysis.diagnostics.",
    ]
    if ablation_rows:
        lines += ["- **Ablation matrices.** The paper's non-baseline matrices are not in our sources; "
                  "ours have the stated spectra (data/ablation_matrices.md), but other matrices with the "
                  "same spectra have other eigenvectors, so the terminal states may differ from the "
                  "paper's figures."]
    return lines + [""]


def write_report(out, beta_cases, ablation_cases, phase, quick, runs_info, paper_rows, token_cases=(),
                 n_cases=()):
    """DIR/report.md and its figures from the collected cases (token_cases: the token ensembles of
    paper_tokens; n_cases: those of paper_tokens_n)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cases_by_nside = {}
    for c in beta_cases:
        cases_by_nside.setdefault(c.nside, []).append(c)
    groups, n_groups = token_groups(token_cases), token_groups(n_cases)
    lines = ["# Reproducing the seed paper: concentration on E, then the F-phase", ""]
    if quick:
        lines += ["> **Quick run** (`--quick`): CI-sized runs (nside 4 and 8, 300 tokens over 3 seeds, t ≤ 8, "
                  f"β ∈ {{10, ∞}} and {QUICK_PHASE_RUNS} β of the phase diagram). They exercise the report "
                  "machinery; they are not a reproduction of the paper.", ""]
    lines += ["Paper: \"Quantifying Concentration Phenomena of Mean-Field Transformers in the Low-Temperature "
              "Regime\" (arXiv 2605.10931), V = diag(−1, 1, −2), B = diag(−1, −1, 1): M = VBᵀ = diag(1, −1, −2), "
              "E = span e₁, F = span e₂, Π#ρ₀ = p₊δ_{e₁} + p₋δ_{−e₁}.", "",
              "## What was run", ""]
    lines += runs_info + [""]
    lines += ["## Metrics (our definitions)", "",
              "- **alignment with E** (resp. F): ∫|Q_E x|² dρ_t, Q_E the orthogonal projector onto the principal "
              "eigenspace E of VBᵀ (resp. F of V) — `alignment_E`, `alignment_F` of the run files "
              "(spherepde.analysis.diagnostics). Eulerian: the cell averages on an 8-point exact-area rule per cell, and "
              "the atoms; particles and tokens: the empirical measure.",
              "- **max alignment with E (t)**: the maximum over the save times and the first time it is reached.",
              "- **F-phase onset**: the first time after that maximum at which the alignment with F exceeds the "
              "alignment with E (linear between save times); *none* if not by the end of the run.",
              "- **min W₂ (t)**: the minimum over the save times of W₂(ρ_t, Π#ρ₀) (chordal; exact threshold plan "
              "for two atoms) and its time: the bottom of the U-curve.",
              "- Theory on the same axes: the β = ∞ exact solution (push-forward of ρ₀ by x ↦ e^{tM}x/|e^{tM}x|, "
              "our diagnostics on a HEALPix quadrature), the bound √(2V_p(ρ₀))e^{−pγt/σ_max(B)} on W₂ at β = ∞ "
              "(p = ¼), and t = log β.", ""]
    lines += ["## The paper's table beside ours (uniform initial law)", ""]
    lines += _main_table(cases_by_nside, groups, paper_rows)
    lines += ["", "Paper values from `data/paper_table.csv` (as quoted in docs/theory.md#the-equation-and-its-conventions; the paper's metric, n and "
              "initial law are not published in our sources). Eulerian + atoms: the mean field on the finest mesh, "
              "[Δ] its change from the mesh of half the resolution; quadrature particles: the same mean field "
              "discretised by one particle per cell of that mesh; tokens: n i.i.d. samples of ρ₀ over seeds, the "
              "mean and its 95 % interval (Student t), the F-onset over the seeds that had one by t = 20.", ""]
    order = _ordering_lines(cases_by_nside, groups)
    if order:
        lines += ["The paper's trend — the higher β, the higher the maximal alignment with E and the later the "
                  "F-phase, none at β = ∞ — checked on each of our series:", ""] + order + [""]
    lines += ["## Every β and initial law: resolution, the two mean-field discretisations, the tokens", "",
              "Orders are log₂ of the ratio of successive differences (three meshes needed; *not monotone* when "
              "the differences change sign).", ""] + _convergence_table(beta_cases, groups) + [""]
    if n_groups:
        fine = max(cases_by_nside) if cases_by_nside else None
        (law, beta, _), *_ = n_groups
        twins = [c for c in cases_by_nside.get(fine, []) if c.law == law and c.beta == beta]
        mean_field = [(f"{label}, nside {fine}", twins[0], who) for who, label in
                      (("eulerian", "Eulerian + atoms"), ("particles", "quadrature particles"))] if twins else []
        lines += ["## Tokens against n", ""] + _n_table(n_cases, mean_field) + [""]
    axes = _axes_table(beta_cases)
    if axes:
        lines += ["### Where the mass is (uniform law)", "",
                  "Principal axis ±a of the second moment ∫xxᵀdρ_t and [its eigenvalue]: [1.00] means all mass on "
                  "±a (two antipodal atoms, or one). E = ±e₁ = ±(1, 0, 0), F = ±e₂ = ±(0, 1, 0).", ""] + axes + [""]
    refs = _references(beta_cases, quick)
    for nside in sorted(cases_by_nside):
        for law in sorted({c.law for c in cases_by_nside[nside]}):
            name = f"beta_{law}_nside{nside}.png"
            if figure_law(cases_by_nside[nside], law, nside, refs, out / name):
                lines += [f"![{law}, nside {nside}]({name})", ""]
    abl_rows = _ablation_rows(ablation_cases) if ablation_cases else []
    lines += ["## Ablation: the matrices", ""]
    if abl_rows:
        c0 = ablation_cases[0]
        desc = _abl_description()
        lines += [f"β = {beta_text(c0.beta)}, uniform start, Eulerian + atoms nside {c0.nside} and the "
                  f"{c0.particle_label} of the same mesh, "
                  f"t ≤ {c0.t_end:g}. Matrices and why: data/ablation_matrices.md. Early: t = log β; "
                  "terminal: the last save time; axis: principal axis of ∫xxᵀdρ at the end [its eigenvalue: 1 "
                  "when all mass is on ±axis].", "",
                  "| case | eig(VBᵀ) | dim E | E | F | γ | flags (assumption fails) |", "|---|---|---|---|---|---|---|"]
        for r in abl_rows:
            lines.append(f"| {r['case']} ({desc.get(r['case'], '')}) | {r['eig']} | {r['dimE']} | {r['E']} | {r['F']} "
                         f"| {r['gap']:.3g} | {r['flags']} |")
        lines += ["", "| case | early: align E at log β, Eul. / particles | min W₂ to Π#ρ₀ Eul. (t) "
                  "| end: align E, F (Eul.) | end: align E, F (particles) | end: axis Eul. | end: axis particles |",
                  "|---|---|---|---|---|---|---|"]
        for r in abl_rows:
            tok = (f"{_fmt(r['pE_end'])}, {_fmt(r['pF_end'])}" if "pE_end" in r else "—")
            lines.append(f"| {r['case']} | {_fmt(r['E_at_logb'])} / {_fmt(r.get('pE_at_logb'))} | "
                         f"{_fmt(r['w2_min'][0])} ({_fmt_t(r['w2_min'][1])}) | {_fmt(r['E_end'])}, {_fmt(r['F_end'])} | "
                         f"{tok} | {_axis_text(r['axis'], r['axis_frac'])} | "
                         + (_axis_text(r['paxis'], r['paxis_frac']) if 'paxis' in r else "—") + " |")
        lines.append("")
        if figure_ablation(ablation_cases, out / "ablation.png"):
            lines += ["![ablation](ablation.png)", ""]
    else:
        lines += ["Not run.", ""]
    lines += ["## Phase diagram in (t, β)", ""]
    if phase is not None:
        combined, onsets, source = phase
        if figure_phase(combined, onsets, out / "phase_diagram.png"):
            lines += [f"Alignment with E and with F of the Eulerian solution, uniform start ({source}). "
                      "White: t = log β; red: the F-onset.", "", "![phase diagram](phase_diagram.png)", "",
                      "| β | " + " | ".join(beta_text(b) for b, _ in onsets) + " |",
                      "|---|" + "---|" * len(onsets),
                      "| F-onset (Eulerian) | " + " | ".join(_fmt_t(o) for _, o in onsets) + " |", ""]
    else:
        lines += ["Not run (no run files of solvers/sweeps/beta_phase.toml).", ""]
    lines += _disagreement(cases_by_nside, groups, n_groups, paper_rows, abl_rows, quick)
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return out / "report.md"


# ====================================================================== the suite
def _quick_phase_grid(path):
    raw = _load_toml(path)
    grid = raw["sweep"].get("grid", {})
    key = next((k for k in grid if k.endswith("beta")), None)
    if key is None:
        return {}
    values = list(grid[key])
    idx = np.unique(np.linspace(0, len(values) - 1, QUICK_PHASE_RUNS).round().astype(int))
    return {key: [values[i] for i in idx]}


def _sweep_into(path, out_dir, label, workers, say, info, run=True):
    """Run one (derived) sweep file into out_dir (run=False: only read the run files there);
    append a line to info; returns (cases, combined dataset path or None)."""
    t0 = time.perf_counter()
    if run:
        specs, combined, failures = run_sweep_files(path, out_dir, workers=workers, say=say)
    else:
        specs, failures = expand_sweep(path, out_dir), []
        name = _load_toml(path)["sweep"]["name"]
        combined = Path(out_dir) / f"{name}.nc"
        combined = combined if combined.is_file() else None
    cases = collect(specs, out_dir, combined)
    failed = f"; failed: {', '.join(f'{r} ({why})' for r, why in failures)}" if failures else ""
    run_ids = list(dict.fromkeys(c.spec.run_id for c in cases))  # a batched run gives several cases
    partial = list(dict.fromkeys(c.spec.run_id for c in cases if not c.complete))
    partial = f"; not finished: {', '.join(partial)}" if partial else ""
    batched = f" ({len(cases)} seeds as batched systems)" if len(cases) > len(run_ids) else ""
    how = (f"spherepde.runner.sweep.run_sweep with {workers} workers, {time.perf_counter() - t0:.0f} s for this call "
           "(runs already complete are reused)" if run else "run files read, not run by this call")
    info.append(f"- {label}: {len(run_ids)} of {len(specs)} runs{batched}, {how}{failed}{partial}")
    say(f"  {label}: {len(run_ids)} runs ({time.perf_counter() - t0:.0f} s)")
    return cases, combined


def machine() -> str:
    """The machine a report was made on: CPU model, cores, memory (Linux /proc where available)."""
    import os
    import platform

    model = platform.processor() or platform.machine()
    memory = ""
    try:
        with open("/proc/cpuinfo") as fh:
            model = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), model)
        with open("/proc/meminfo") as fh:
            kib = int(next(line.split()[1] for line in fh if line.startswith("MemTotal")))
        memory = f", {kib / 2**20:.0f} GiB"
    except (OSError, StopIteration, ValueError):
        pass
    return f"{os.cpu_count()} cores ({model}){memory}"


def _token_sweeps(runs, quick, base_over, workers, say, info, run, slow=False):
    """The token ensembles: paper_tokens and paper_tokens_sharp (every law and β, 8 seeds batched
    in one run per case; the step each β needs) and paper_tokens_n (one case, n = 500 … 8000),
    continued to n = 16 000 and 32 000 by paper_tokens_n_large when slow (without slow its runs
    are read if its folder exists, never started). quick: 300 tokens, QUICK_SYSTEMS seeds batched.
    Returns (token cases, n cases): one case per seed."""
    tag = "quick" if quick else "full"
    token_over = dict(base_over, **QUICK_TOKENS) if quick else {}
    tokens = []
    for sweep in (PAPER_TOKENS, PAPER_TOKENS_SHARP):
        grid = None
        if quick:
            betas = [b for b in _load_toml(sweep)["sweep"]["grid"]["model.beta"] if b in QUICK_BETAS]
            grid = {"model.beta": betas}
        path = derive_sweep(sweep, runs / f"{sweep.stem}_{tag}", token_over, grid)
        tokens += _sweep_into(path, path.parent, f"{sweep.stem} (token ensembles)", workers, say, info, run)[0]
    grid = {"particles.n": QUICK_N} if quick else None
    path = derive_sweep(PAPER_TOKENS_N, runs / f"paper_tokens_n_{tag}", token_over, grid)
    n_cases = _sweep_into(path, path.parent, "paper_tokens_n (tokens against n)", workers, say, info, run)[0]
    if not quick:
        large = runs / "paper_tokens_n_large"
        label = "paper_tokens_n_large (tokens against n, n = 16 000 and 32 000)"
        if slow or large.is_dir():
            path = derive_sweep(PAPER_TOKENS_N_LARGE, large, token_over)
            n_cases += _sweep_into(path, large, label, workers, say, info, run and slow)[0]
        else:
            info.append(f"- {label}: not run (`--slow` runs it, ~35 min on 2 cores)")
    return tokens, n_cases


def run_suite(out, quick=False, slow=False, nsides=None, sweep_out=None, workers=2, progress=True, run=True,
              ablation_nside=None, notes=()):
    """Run (or reuse) the sweeps and write OUT/report.md with its figures.

    paper_beta (Eulerian with atoms and quadrature particles in lockstep) on each mesh of nsides
    (default 8 and 16, with slow also 32; quick 4 and 8), the ablation on the finest, the token
    ensembles (paper_tokens, paper_tokens_n, and with slow paper_tokens_n_large) and beta_phase.
    quick: CI-sized runs (QUICK_BASE, β ∈ QUICK_BETAS, 3 seeds, a few β of the phase diagram).
    sweep_out: where the run files go (default OUT/runs; complete run files there are reused).
    run=False: write the report from the run files that exist, without running anything.
    ablation_nside: the ablation's mesh (default the finest of nsides). notes: lines added to
    "What was run" (e.g. how the runs read with run=False were made).
    Returns the report path.
    """
    say = (lambda msg: print(msg, flush=True)) if progress else (lambda msg: None)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs = Path(sweep_out) if sweep_out else out / "runs"
    start_all = time.perf_counter()
    if nsides:
        nsides = sorted(set(int(n) for n in nsides))
    else:
        nsides = list(QUICK_NSIDES if quick else (SLOW_NSIDES if slow else FULL_NSIDES))
    base_over = dict(QUICK_BASE) if quick else {}
    tag = "quick" if quick else "full"
    info = [f"- mode: **{tag}**; Eulerian nside {', '.join(map(str, nsides))} for paper_beta, "
            f"{ablation_nside or max(nsides)} for the ablation; run files under `{runs}` (not part of the report)"]
    beta_cases = []
    for nside in nsides:
        over = dict(base_over, **{"eulerian.nside": nside})
        grid = {"model.beta": QUICK_BETAS} if quick else None
        path = derive_sweep(PAPER_BETA, runs / f"paper_beta_{tag}_n{nside}", over, grid)
        beta_cases += _sweep_into(path, path.parent, f"paper_beta at nside {nside}", workers, say, info, run)[0]
    ablation_nside = int(ablation_nside or max(nsides))
    over = dict(base_over, **{"eulerian.nside": ablation_nside})
    path = derive_sweep(PAPER_ABLATION, runs / f"paper_ablation_{tag}_n{ablation_nside}", over)
    ablation_cases = _sweep_into(path, path.parent, f"paper_ablation at nside {ablation_nside}", workers, say, info,
                                 run)[0]
    token_cases, n_cases = _token_sweeps(runs, quick, base_over, workers, say, info, run, slow)
    phase = None
    if BETA_PHASE.is_file():
        if quick:
            path = derive_sweep(BETA_PHASE, runs / "beta_phase_quick", dict(base_over, **{"eulerian.nside": 8}),
                                _quick_phase_grid(BETA_PHASE))
        else:
            path = derive_sweep(BETA_PHASE, runs / "beta_phase")
        cases, combined_path = _sweep_into(path, path.parent, "beta_phase", workers, say, info, run)
        if cases:
            import xarray as xr

            combined = xr.load_dataset(combined_path) if combined_path else _combined_from_cases(cases)
            source = (f"the sweep's combined dataset `{Path(combined_path).name}`" if combined_path
                      else "run files combined here")
            onsets = sorted(((c.beta, c.metrics["eulerian"]["onset"]) for c in cases), key=lambda x: x[0])
            phase = (combined, onsets, source)
            info.append(f"  (beta_phase: nside {cases[0].nside}, t ≤ {cases[0].t_end:g}, no tokens)")
    else:
        info.append("- beta_phase: solvers/sweeps/beta_phase.toml not available, not run")
    info += list(notes)
    walls = [c.wall for c in beta_cases + ablation_cases if np.isfinite(c.wall)]
    info.append(f"- sum of the run wall times (each run file's `wall_seconds`, 2 shared cores) of paper_beta and "
                f"the ablation: {sum(walls):.0f} s")
    flags = " --quick" if quick else (" --slow" if slow else "")
    info.insert(0, f"- command: `spherepde validate paper{flags} --out DIR`; this call took "
                   f"{time.perf_counter() - start_all:.0f} s before the report was written "
                   f"({'running the runs it lacked' if run else 'reading existing runs only'}), on {machine()}")
    report = write_report(out, beta_cases, ablation_cases, phase, quick, info, read_paper_table(), token_cases,
                          n_cases)
    say(f"  report {report} ({time.perf_counter() - start_all:.0f} s)")
    return report
