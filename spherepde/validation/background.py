"""The background at large β: is the mesh density where the tokens are not a transport artefact?

At β = 30 the two clusters (atoms) weigh each other with e^{β(⟨Bᵀz, y⟩ − |Bᵀz|)} ≈ e^{−1.3β}, so a
background density 10⁻¹⁵ below the clusters competes with them in the softmax and moves them
(docs/atoms.md). The quadrature particles carry no background there (no particle stays near
Bᵀz/|Bᵀz|), the mesh does. This check asks whether the mesh's background is the one its own flow
carries, or numerical diffusion:

- the run's own field at any time s is that of its saved measure (cell densities and atoms),
  linear in time between snapshots saved every `save_every`;
- from every cell centroid y at time t the characteristic is integrated backwards to 0 (RK4 on
  the sphere, step dt), with ∫ div_S v along it: f_char(y, t) = f₀(X₀(y)) exp(−∫₀ᵗ div_S v ds)
  is the density the continuity equation carries in that field (docs/theory.md#formulas-and-exact-solutions), with no
  numerical diffusion;
- the table compares f_mesh with f_char cell by cell (log₁₀ of the ratio, by decade of f_char),
  gives the mesh mass where f_mesh > 10 f_char (what diffusion put there), and the share of the
  softmax weight at the heavier atom that comes from the mesh, from f_char and from the
  particles (none).

    python -m spherepde.validation.background [--nside 16 32] [--t 2 4 6 8] [--out DIR]

writes DIR/background.md (default validation/reports/atoms/). The runs (β = 30, projected-normal
law of solvers/atoms_base.toml, snapshots every 0.05) go to DIR/background_run_nside<N>.nc and
are reused.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

from .common import REPO

# the background: cells farther than this from every atom (rad; 4 cells at nside 16). Nearer ones
# hold, in f_char, mass that the mesh has already handed to the atoms.
AWAY = 0.25
SAVE_EVERY = 0.05  # the runs' snapshot interval: the reference's time step (f_char's field is linear between snapshots)
# f_char's RK4 step: 0.007 decades from its limit at t = 8 in the defaults' run, 0.06 where atoms are
# made and merged at t ≈ 7 (docs/numerics.md, "What is left at t = 8 with the field of the measure")
REFERENCE_STEP = 0.025
BETA = 30.0  # the runs' inverse temperature unless `--beta` says otherwise


def _saves_tag(save_every):
    """The suffix of the run and report files of runs saved other than every SAVE_EVERY."""
    return "" if save_every == SAVE_EVERY else f"_saves{save_every:g}"


def _beta_tag(beta):
    """The infix of the run and report files of runs at β other than BETA."""
    return "" if beta == BETA else f"beta{beta:g}_"


def _step_tag(reference_step):
    """The suffix of the report files whose f_char takes RK4 steps other than REFERENCE_STEP."""
    return "" if reference_step == REFERENCE_STEP else f"_step{reference_step:g}"


class SavedField:
    """The attention field of a run's saved measure (cells + atoms), linear in time between
    snapshots. An atom created within an interval enters with its mass ramped from 0, one merged
    away leaves with its mass ramped to 0, so the measure's mass is linear in time too.

    Where the kernel is narrower than a cell (β = 1000 below nside 64: solvers.tails.subcells_for)
    each cell is the k × k sources of its children with the log-linear profile of ln f, as g's
    paths take it (solvers.tails.log_linear_masses), summed by the tree (certified to 1e-10 of Z);
    else the cell centres, summed directly. The sums' sources are built once per time (the RK4
    stages meet each time twice or more)."""

    def __init__(self, ds, mesh, model):
        from ..solvers.tails import subcell_centres, subcells_for
        from ..transport.semi_lagrangian import PolynomialInterpolant

        self.mesh, self.model = mesh, model
        self.times = ds["time"].values
        self.density = ds["density"].values
        self.atom_position = ds["atom_position"].values if "atom_position" in ds else None
        self.atom_mass = ds["atom_mass"].values if "atom_mass" in ds else None
        self.subcells = subcells_for(mesh, model)
        if self.subcells > 1:
            self._interpolant = PolynomialInterpolant(mesh)
            self._children = subcell_centres(mesh.nside, self.subcells)
        self._prepared = {}  # s → PreparedSources of the measure at s (the last few times only)

    def _cells(self, f):
        """(sources, masses) of the cells with densities f."""
        if self.subcells == 1:
            return self.mesh.centroids, f * self.mesh.area
        from ..solvers.tails import log_linear_masses

        return self._children, log_linear_masses(self._interpolant, self._children, self.subcells, f, self.mesh.area)

    def measure(self, s):
        t = self.times
        i = int(np.clip(np.searchsorted(t, s, side="right") - 1, 0, len(t) - 2))
        a = (s - t[i]) / (t[i + 1] - t[i])
        cells = self._cells((1 - a) * self.density[i] + a * self.density[i + 1])
        sources = [cells[0]]
        masses = [cells[1]]
        if self.atom_mass is not None:
            m0, m1 = self.atom_mass[i], self.atom_mass[i + 1]
            both = (m0 > 0) & (m1 > 0)
            p = (1 - a) * self.atom_position[i][both] + a * self.atom_position[i + 1][both]
            sources.append(p / np.linalg.norm(p, axis=1, keepdims=True))
            masses.append((1 - a) * m0[both] + a * m1[both])
            born = (m1 > 0) & ~(m0 > 0)
            sources.append(self.atom_position[i + 1][born])
            masses.append(a * m1[born])
            # an atom merged into another within the interval hands its mass over linearly too
            # (dropping it at once would take up to a third of the mass out of the field there)
            died = (m0 > 0) & ~(m1 > 0)
            sources.append(self.atom_position[i][died])
            masses.append((1 - a) * m0[died])
        return np.concatenate(sources), np.concatenate(masses)

    def __call__(self, y, s):
        from spherepde.summation import PreparedSources, attention_field

        if s not in self._prepared:
            if len(self._prepared) >= 4:  # an RK4 step meets three times, the next step starts at its last
                self._prepared.pop(next(iter(self._prepared)))
            self._prepared[s] = PreparedSources(*self.measure(s))
        p = self._prepared[s]
        v, div, _ = attention_field(self.model, p.sources, p.masses, y, want_div=True,
                                    method="direct" if self.subcells == 1 else "auto", prepared=p)
        return v, div


def _far_from_atoms(mesh, positions, masses):
    """The cells farther than AWAY from every atom with mass (all cells when there is none)."""
    alive = masses > 0
    if not alive.any():
        return np.ones(mesh.npix, bool)
    return (mesh.centroids @ positions[alive].T).max(axis=1) < np.cos(AWAY)


def _unit(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def characteristic_density(field, law, points, t, dt=REFERENCE_STEP):
    """f₀(X₀(y)) exp(−∫₀ᵗ div_S v ds) along the backward characteristics from points at time t
    (RK4 with normalised stages, ∫ div by the same weights: _backward)."""
    feet, integral = _backward(field, points, t, dt)
    return law.density(feet) * np.exp(-integral)


def weight_share(model, mesh, f, atom_position, atom_mass, away=0.0):
    """Share of the softmax weight at the heaviest atom z that comes from the cells (masses f·A)
    farther than `away` (rad) from every atom, against the atoms:
    Σ_c f_c A e^{β⟨Bᵀz, y_c⟩} / (that + Σ_k m_k e^{β⟨Bᵀz, x_k⟩})."""
    alive = atom_mass > 0
    z = atom_position[np.argmax(atom_mass)]
    a = model.beta * (model.B.T @ z)
    far = (mesh.centroids @ atom_position[alive].T).max(axis=1) < np.cos(away)
    with np.errstate(divide="ignore"):
        cells = (mesh.centroids @ a + np.log(f * mesh.area))[far]
    atoms = atom_position[alive] @ a + np.log(atom_mass[alive])
    top = max(cells.max(), atoms.max())
    wc, wa = np.exp(cells - top).sum(), np.exp(atoms - top).sum()
    return wc / (wc + wa)


def _subcells(nside, beta):
    """Children per cell side of SavedField for the runs at nside and β (solvers.tails.subcells_for)."""
    from ..geometry.mesh import HealpixMesh
    from ..runner import config as C
    from ..runner.build import build_model
    from ..solvers.tails import subcells_for

    model = C.resolve(C.apply_overrides(C.load(REPO / "solvers" / "atoms_base.toml"), [f"model.beta={float(beta)!r}"]))["model"]
    return subcells_for(HealpixMesh(nside), build_model(model).single_head)


def ensure_run(path, nside, t_end, say=print, tails=False, save_every=SAVE_EVERY, beta=BETA):
    """The run of solvers/atoms_base.toml at β (default 30) and nside to t_end, snapshots every
    save_every (reused when complete and of the same config; an interrupted one resumed); tails:
    with `[eulerian] tails = "log"` (True: its defaults; a list: those overrides too, e.g.
    `eulerian.tail_anchor=0.0`)."""
    from ..runner import config as C
    from ..runner.run import execute
    from ..storage.runfile import open_run

    over = [f"eulerian.nside={nside}", f"model.beta={float(beta)!r}", f"time.t_end={t_end}",
            f"time.save_every={save_every}"]
    if save_every < 0.05:  # the quadrature particles' RK4 step (0.05) may not exceed the save interval
        over.append(f"particles.dt={save_every}")
    if tails is not False:
        over.append('eulerian.tails="log"')
        over += [] if tails is True else list(tails)
    cfg = C.resolve(C.apply_overrides(C.load(REPO / "solvers" / "atoms_base.toml"), over))
    resume = False
    if path.exists():
        ds = open_run(path)
        same = C.difference(json.loads(ds.attrs["config"]), json.loads(json.dumps(cfg)), ignore=()) is None
        if same and int(ds.attrs.get("complete", 0)) == 1 and float(ds.time[-1]) >= t_end - 1e-9:
            return cfg, ds
        ds.close()
        resume = same  # an interrupted run of this config goes on from its last snapshot (or anchor)
        if not same:
            path.unlink()
    t0 = time.perf_counter()
    execute(cfg, str(path), progress=False, log=None, resume=resume)
    say(f"  run: nside {nside}, β = {beta:g}, t ≤ {t_end:g} in {time.perf_counter() - t0:.0f} s")
    return cfg, open_run(path)


def measure(nside, times, out, say=print, tails=False, label=None, save_every=SAVE_EVERY, tag="",
            reference_step=REFERENCE_STEP, beta=BETA):
    """Table rows (per t) of the comparison at one mesh: cells per band with the quantiles of
    log₁₀(f_mesh / f_char), the leaked mass, and the weight shares; tails (False, True or a list of
    overrides, as ensure_run's): of the run with the
    tails from log f (then every row starts with `label`, the state's name, and ends with the
    90th percentile of |log₁₀(f_mesh / f_char)| over the background cells, farther than AWAY
    from every atom, whose f_char is below 10⁻⁴); tag: the run file's name after
    "background_run_" (RUN_FILE_TAGS); reference_step: f_char's RK4 step; beta: the runs' β
    (the file name says it when not 30)."""
    from ..geometry.mesh import HealpixMesh
    from ..runner.build import build_initial_law, build_model

    name = f"background_run_{tag}{_beta_tag(beta)}nside{nside}{_saves_tag(save_every)}.nc"
    cfg, ds = ensure_run(out / name, nside, max(times), say, tails, save_every, beta)
    model, law = build_model(cfg["model"]).single_head, build_initial_law(cfg["initial"])
    mesh = HealpixMesh(nside)
    field = SavedField(ds, mesh, model)
    rows, shares = [], []
    for t in times:
        k = int(np.argmin(np.abs(ds.time.values - t)))
        f_mesh = ds.density.values[k]
        f_char = characteristic_density(field, law, mesh.centroids, float(ds.time[k]), reference_step)
        ratio = np.log10(f_mesh / f_char)
        level = np.log10(f_char)
        cells = []
        for lo, hi in BANDS:
            sel = (level >= lo) & (level < hi)
            if sel.any():
                p10, p50, p90 = np.percentile(ratio[sel], [10, 50, 90])
                cells.append(f"{sel.sum()}: {p50:+.2f} ({p10:+.2f}, {p90:+.2f})")
            else:
                cells.append("—")
        excess = f_mesh > 10 * f_char
        leaked = float(np.sum((f_mesh - f_char)[excess]) * mesh.area)
        pos, mass = ds.atom_position.values[k], ds.atom_mass.values[k]
        head = f"| {label} " if label else ""
        row = head + f"| {nside} | {t:g} | {float(ds.mesh_mass[k]):.1e} | " + " | ".join(cells) + f" | {leaked:.1e} |"
        if label:
            deep = _far_from_atoms(mesh, pos, mass) & (f_char < 1e-4)
            row += f" {np.percentile(np.abs(ratio[deep]), 90):.3f} ({deep.sum()}) |" if deep.any() else " — |"
            # point against point: g at the centroid (with tails; of the last coupling) against f_char there
            if "log_density" in ds and deep.any() and float(ds["log_density_time"][k]) == float(ds.time[k]):
                g = ds["log_density"].values[k] / math.log(10)
                row += f" {np.percentile(np.abs(g[deep] - level[deep]), 90):.3f} |"
            else:
                row += " — |"
            # the reference's own time error: f_char from every other snapshot (saves twice as far apart)
            coarse = ds.isel(time=slice(0, k + 1, 2))
            if deep.any() and float(coarse.time[-1]) == float(ds.time[k]):
                f_half = characteristic_density(SavedField(coarse, mesh, model), law, mesh.centroids, float(ds.time[k]),
                                                reference_step)
                row += f" {np.percentile(np.abs(np.log10(f_half[deep]) - level[deep]), 90):.3f} |"
            else:
                row += " — |"
        rows.append(row)
        if (mass > 0).any():
            shares.append(f"| {nside} | {t:g} | {weight_share(model, mesh, f_mesh, pos, mass, AWAY):.3g} | "
                          f"{weight_share(model, mesh, f_char, pos, mass, AWAY):.3g} | 0 |")
        say(f"  nside {nside}, t = {t:g} done")
    return rows, shares


BANDS = [(-99, -12), (-12, -8), (-8, -4), (-4, 0), (0, 9)]


def particle_field_rows(nside, times, out, say=print):
    """Table rows (per t): where the quadrature particles have left (cells with no particle within
    AWAY), the density the continuity equation carries there in the mesh run's field and in the
    particles' own field (both saved in the same run file), and how far apart the feet of the two
    backward characteristics are."""
    from ..geometry.mesh import HealpixMesh
    from ..runner.build import build_initial_law, build_model

    cfg, ds = ensure_run(out / f"background_run_nside{nside}.nc", nside, max(times), say)
    model, law = build_model(cfg["model"]).single_head, build_initial_law(cfg["initial"])
    mesh = HealpixMesh(nside)
    mesh_field = SavedField(ds, mesh, model)
    particle_field = SavedParticleField(ds.time.values, ds.positions.values, ds.particle_weights.values, model)
    rows = []
    for t in times:
        k = int(np.argmin(np.abs(ds.time.values - t)))
        empty = np.abs(mesh.centroids @ ds.positions.values[k].T).max(axis=1) < np.cos(AWAY)
        y, s = mesh.centroids[empty], float(ds.time[k])
        feet_m, int_m = _backward(mesh_field, y, s)
        feet_p, int_p = _backward(particle_field, y, s)
        log_m = np.log10(law.density(feet_m)) - int_m / np.log(10)
        log_p = np.log10(law.density(feet_p)) - int_p / np.log(10)
        d = log_p - log_m
        apart = np.arccos(np.clip(np.sum(feet_m * feet_p, axis=1), -1, 1))
        rows.append(f"| {nside} | {t:g} | {empty.sum()} of {mesh.npix} | {np.median(log_m):.2f} | {np.median(log_p):.2f} | "
                    f"{np.percentile(d, 10):+.2f} / {np.median(d):+.2f} / {np.percentile(d, 90):+.2f} | {np.median(apart):.2f} |")
        say(f"  particle field, nside {nside}, t = {t:g} done")
    return rows


def report(nsides=(16, 32), times=(2.0, 4.0, 6.0, 8.0), out=None, say=print, particle_nsides=(16,)):
    out = Path(out) if out else REPO / "validation" / "reports" / "atoms"
    out.mkdir(parents=True, exist_ok=True)
    rows, shares, fields = [], [], []
    for nside in nsides:
        r, sh = measure(nside, times, out, say)
        rows += r
        shares += sh
    for nside in particle_nsides:
        fields += particle_field_rows(nside, times, out, say)
    head = " | ".join(f"f_char in 1e[{lo}, {hi})" for lo, hi in BANDS)
    lines = [
        "# The background at β = 30: the mesh density against its own characteristics", "",
        "Written by `python -m spherepde.validation.background` (module docstring). Projected-normal law of "
        f"solvers/atoms_base.toml, β = 30, nside {' and '.join(map(str, nsides))}, atoms on, snapshots "
        "every 0.05. f_char is the density carried along the backward characteristics of the run's own "
        "field (cells and atoms, linear in time between snapshots; RK4, dt = 0.025): what the continuity "
        "equation transports in that field without numerical diffusion.", "",
        "Per band of f_char: number of cells, then the median of log₁₀(f_mesh / f_char) and, in "
        "brackets, its 10th and 90th percentiles. Last column: the mesh mass in cells where "
        "f_mesh > 10 f_char (what the scheme's diffusion put there).", "",
        f"| nside | t | mesh mass | {head} | mass with f_mesh > 10 f_char |",
        "|---|---|---|" + "---|" * len(BANDS) + "---|", *rows, "",
        f"Share of the softmax weight at the heavier atom z that comes from the background (cells "
        f"farther than {AWAY} rad from every atom; the rest from the atoms): with the mesh density, "
        "with f_char in every cell, and for the quadrature particles, which have no particle near "
        "Bᵀz/|Bᵀz| after t ≈ 6 (docs/atoms.md).", "",
        "| nside | t | mesh density | f_char | particles |", "|---|---|---|---|---|", *shares, "",
        "Why the particles cannot carry it: where they have left (cells with no quadrature particle within "
        f"{AWAY} rad), the density along the backward characteristics in the mesh run's field and in the "
        "particles' own field (saved in the same run file, RK4, dt = 0.025): log₁₀ f_char, median over those "
        "cells; the difference particles − mesh (10th / 50th / 90th percentile, decades); the median distance "
        "between the two feet X₀(y) (rad). Both fields agree where the particles are; where they have left, "
        "the mean field's background attends to itself (at β = 30 a density 10⁻¹⁵ below the clusters "
        "competes with them), the particles' field has nothing there and expands the region far faster.", "",
        "| nside | t | cells left by the particles | log₁₀ f_char, mesh field | log₁₀ f_char, particles' field "
        "| particles − mesh (decades) | feet apart (rad) |", "|---|---|---|---|---|---|---|", *fields, "",
    ]
    path = out / "background.md"
    path.write_text("\n".join(lines))
    say(f"  wrote {path}")
    return path


class SavedParticleField:
    """The attention field of a particle run's saved measure Σ w_i δ_{x_i(s)}, positions linear
    in time (normalised) between snapshots."""

    def __init__(self, times, positions, masses, model):
        self.times, self.positions, self.masses, self.model = np.asarray(times), positions, masses, model

    def __call__(self, y, s):
        from spherepde.summation import attention_field

        t = self.times
        i = int(np.clip(np.searchsorted(t, s, side="right") - 1, 0, len(t) - 2))
        a = (s - t[i]) / (t[i + 1] - t[i])
        x = _unit((1 - a) * self.positions[i] + a * self.positions[i + 1])
        v, div, _ = attention_field(self.model, x, self.masses, y, want_div=True, method="direct")
        return v, div


# state → tails of ensure_run: the finite volumes; the tails with the solver's defaults (couplings
# every 0.2, level relative to the mesh, anchors every 1.0, composed maps); couplings every 0.05 with
# the level relative to the clusters' peaks; and the same with g's paths retraced to anchors 5.0
# apart, so that g is interpolated once by t = 8 (docs/numerics.md#the-self-consistency-at-β--30-interpolations-of-g-across-the-fronts)
# the tail level relative to the clusters' peaks, couplings every 0.05 (docs/numerics.md#a-tail-level-relative-to-the-clusters-peaks-and-the-coupling-interval)
CLUSTERS = ('eulerian.tail_reference="clusters"', "eulerian.tail_interval=0.05")
RETRACED = ('eulerian.tail_paths="retrace"', "eulerian.tail_anchor=5.0")
# the composed maps, retraced to the anchor where they bend (tail_paths = "selective"), anchors 5.0 apart
SELECTIVE = ('eulerian.tail_paths="selective"', "eulerian.tail_anchor=5.0")
# the followed tail cells as these states were first run, before the bound by the neighbours became
# the default (docs/numerics.md#selective-paths-the-maps-retraced-where-their-error-budget-runs-out)
UNBOUNDED = 'eulerian.tail_follow_bounds="none"'
# the neighbourhood the finite volumes keep in cells only, as the defaults' state was run, before one
# kernel width became the default (at nside 16 the same cells: 3 cells are 1.07 kernel widths)
CELLS_ONLY = "eulerian.tail_exclusion_width=0.0"
# g's paths through the states after every finite-volume step, 4 RK4 steps per path step
# (docs/numerics.md#a-reference-that-resolves-the-field-between-couplings)
SUBSTEPS = "eulerian.tail_substeps=4"
# the same, only in the coupling intervals where an atom was made or merged (the field linear between
# the couplings' states elsewhere)
EVENTS = 'eulerian.tail_step_states="atom_events"'
# g's paths between the couplings' states through the field of the measure the solver holds then
# (the followed tails exponential in time) instead of the two fields linear in time
MEASURE = 'eulerian.tail_field_between="measure"'
# g's paths through the measure the solver held after its steps (recorded 0.0125 apart at least), linear
# in time between them
STEPS = 'eulerian.tail_field_between="steps"'
# the composed maps traced on through the coupling before where a map does not resolve the path
# (tail_paths = "backtrack"), anchors 5.0 apart, RK4 steps of 0.05
BACKTRACK = ('eulerian.tail_paths="backtrack"', "eulerian.tail_anchor=5.0", "eulerian.tail_path_step=0.05")
# g's paths by Heun's trapezoidal rule: the field at each step's ends only (2n + 1 sums for n steps, RK4
# 5n + 1), second order as the field linear in time between recorded states is
HEUN = 'eulerian.tail_path_scheme="heun"'
TAIL_STATES = {"finite volumes + atoms": False,
               "tails from log f, couplings every 0.2, followed unbounded": [UNBOUNDED],
               "tails from log f, couplings every 0.05, level relative to the clusters' peaks": [*CLUSTERS, UNBOUNDED],
               "the same, paths retraced to anchors every 5.0": [*CLUSTERS, *RETRACED, UNBOUNDED],
               "tails from log f, the defaults (couplings every 0.2, followed within the neighbours)": [CELLS_ONLY],
               "the defaults with selective paths, anchors every 5.0": list(SELECTIVE),
               "the retraced paths through the states after every step (4 substeps)": [*CLUSTERS, *RETRACED, SUBSTEPS,
                                                                                      UNBOUNDED],
               "the same, through every step's state where atoms changed only": [*CLUSTERS, *RETRACED, SUBSTEPS, EVENTS,
                                                                                  UNBOUNDED],
               "the defaults, through every step's state where atoms changed (4 substeps)": [SUBSTEPS, EVENTS],
               "couplings every 0.05 at the clusters' peaks, through every step's state where atoms changed":
                   [*CLUSTERS, SUBSTEPS, EVENTS],
               "the retraced paths through every step's state where atoms changed, one RK4 step between each two":
                   [*CLUSTERS, *RETRACED, EVENTS, UNBOUNDED],
               "the retraced paths in RK4 steps of 0.025": [*CLUSTERS, *RETRACED, "eulerian.tail_path_step=0.025",
                                                            UNBOUNDED],
               "the retraced paths in RK4 steps of 0.05 (one per coupling interval)":
                   [*CLUSTERS, *RETRACED, "eulerian.tail_path_step=0.05", UNBOUNDED],
               "the retraced paths through the field of the measure between couplings": [*CLUSTERS, *RETRACED, MEASURE,
                                                                                        UNBOUNDED],
               "the defaults, through the field of the measure between couplings": [CELLS_ONLY, MEASURE],
               "couplings every 0.05 at the clusters' peaks, through the field of the measure between couplings":
                   [*CLUSTERS, MEASURE, UNBOUNDED],
               "the defaults (field of the measure), backtracked maps to anchors every 5.0, RK4 steps of 0.05":
                   [CELLS_ONLY, MEASURE, *BACKTRACK],
               "the backtracked maps through the states after the steps": [CELLS_ONLY, STEPS, *BACKTRACK],
               "the same, couplings every 0.05 at the clusters' peaks": [*CLUSTERS, STEPS, *BACKTRACK],
               "the same, couplings every 0.2 at the clusters' peaks": [CLUSTERS[0], STEPS, *BACKTRACK],
               "the same, the paths by the trapezoidal rule (Heun)": [CLUSTERS[0], STEPS, *BACKTRACK, HEUN],
               "the couplings every 0.2 at the clusters' peaks (state 19), in RK4 steps of 0.1":
                   [CLUSTERS[0], STEPS, *BACKTRACK, "eulerian.tail_path_step=0.1"],
               "the same, each step halved on the paths where Simpson − trapezoid on div v exceeds 0.03 decades "
               "per unit time": [CLUSTERS[0], STEPS, *BACKTRACK, "eulerian.tail_path_step=0.1",
                                 "eulerian.tail_path_tolerance=0.03"]}
# the states made before the field of the measure became the default keep the fields linear between
# couplings, as they were run (states 13 on name their field)
LINEAR = 'eulerian.tail_field_between="linear"'
TAIL_STATES = {label: tails if tails is False or k > 12 else [*tails, LINEAR]
               for k, (label, tails) in enumerate(TAIL_STATES.items())}
# every state on top of the defaults `tails = "log"` had when the states were run, before the
# backtracked maps through the steps' states (state 19) became the default (2026-12-07); "the
# defaults" in a state's label are those
FORMER_DEFAULTS = ('eulerian.tail_reference="mesh"', 'eulerian.tail_paths="maps"', "eulerian.tail_anchor=1.0",
                   "eulerian.tail_path_step=0.1", 'eulerian.tail_field_between="measure"')
TAIL_STATES = {label: tails if tails is False else [*FORMER_DEFAULTS, *tails] for label, tails in TAIL_STATES.items()}
# each state's run file, background_run_<tag>nside<N>[_saves<S>].nc: the names the runs were first written under
RUN_FILE_TAGS = dict(zip(TAIL_STATES, ("", "tails_anchored_", "tails_clusters_", "tails_retraced_", "tails_defaults_",
                                       "tails_defaults_selective_", "tails_retraced_substeps_", "tails_retraced_events_",
                                       "tails_defaults_events_", "tails_clusters_events_", "tails_retraced_events1_",
                                       "tails_retraced_step0.025_", "tails_retraced_step0.05_",
                                       "tails_retraced_measure_", "tails_defaults_measure_", "tails_clusters_measure_",
                                       "tails_backtrack_", "tails_backtrack_steps_",
                                       "tails_backtrack_clusters_", "tails_backtrack_peaks_",
                                       "tails_backtrack_peaks_heun_", "tails_backtrack_peaks_step0.1_",
                                       "tails_backtrack_peaks_step0.1_tol0.03_")))


def tails_report(nsides=(16, 32), times=(2.0, 4.0, 6.0, 8.0), out=None, say=print, states=None, save_every=SAVE_EVERY,
                 reference_step=REFERENCE_STEP, beta=BETA):
    """OUT/background_tails.md (default validation/reports/tails/): the same comparison for the
    finite volumes and for `[eulerian] tails = "log"` side by side (issue 37's finite-β
    self-consistency: the target is a 90th percentile of |log₁₀(f_mesh / f_char)| ≤ 0.05). states:
    indices into TAIL_STATES (default all); save_every other than 0.05 writes
    background_tails_saves<save_every>.md from runs saved that often; reference_step (f_char's RK4
    step) other than 0.025 adds _step<reference_step> to the report's name; beta other than 30
    puts beta<β>_ before the nside in the names of the report and the runs."""
    out = Path(out) if out else REPO / "validation" / "reports" / "tails"
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for nside in nsides:
        for k, (label, tails) in enumerate(TAIL_STATES.items()):
            if states is None or k in states:
                rows += measure(nside, times, out, say, tails=tails, label=label, save_every=save_every,
                                tag=RUN_FILE_TAGS[label], reference_step=reference_step, beta=beta)[0]
    head = " | ".join(f"f_char in 1e[{lo}, {hi})" for lo, hi in BANDS)
    lines = [
        f"# The background at β = {beta:g} against its own characteristics: finite volumes and tails from log f", "",
        f"Written by `python -m spherepde.validation.background --tails --nside {' '.join(map(str, nsides))}"
        + ("" if not states else f" --states {' '.join(map(str, states))}")
        + ("" if tuple(times) == (2.0, 4.0, 6.0, 8.0) else f" --t {' '.join(f'{t:g}' for t in times)}")
        + ("" if save_every == SAVE_EVERY else f" --save-every {save_every:g}")
        + ("" if reference_step == REFERENCE_STEP else f" --reference-step {reference_step:g}")
        + ("" if beta == BETA else f" --beta {beta:g}") + "` "
        f"({time.strftime('%Y-%m-%d')}). The run of validation/reports/atoms/background.md (projected-normal law "
        f"of solvers/atoms_base.toml, β = {beta:g}, atoms, snapshots every {save_every:g}) with the finite volumes alone and with "
        "`[eulerian] tails = \"log\"`: couplings every 0.2 (level relative to the mesh's largest f, "
        "g interpolated at anchors every 1.0 with the composed maps between them), couplings every 0.05 with the "
        "level relative to the clusters' peaks (`tail_interval = 0.05`, `tail_reference = \"clusters\"`), and "
        "the same with g's paths retraced to anchors every 5.0 (`tail_paths = \"retrace\"`, `tail_anchor = 5.0`: "
        "g interpolated at t = 5 only before t = 8), these three with the followed tail cells unbounded "
        "(`tail_follow_bounds = \"none\"`, as first run); and the defaults, whose followed cells stay within the "
        "range of f over their neighbours at the last coupling; and the defaults with the selective paths to anchors "
        "every 5.0 (`tail_paths = \"selective\"`: the composed maps, retraced where their error budget exceeds 0.01 "
        "decades); and the retraced paths through the states after every finite-volume step (`tail_substeps = 4`); "
        "the later states as their first column names them (`tail_step_states = \"atom_events\"`: through every step's state only "
        "in the coupling intervals where an atom was made or merged; `tail_path_step`: the paths' RK4 step). f_char: the density carried along the backward "
        "characteristics of each run's own field (cells and atoms, linear in time between snapshots; "
        + ("" if not _subcells(min(nsides), beta) > 1 else
           "each cell summed as the sub-cell sources with the log-linear profile of ln f that g's paths use where "
           "the kernel is narrower than a cell, by the tree to 1e-10 of the partition function; ")
        + "RK4, "
        f"dt = {reference_step:g}). Per band of f_char: cells, median of log₁₀(f_mesh / f_char) (10th, 90th percentile); "
        "the mesh mass where f_mesh > 10 f_char; then the 90th percentile of |log₁₀(f_mesh / f_char)| "
        f"over the background cells (farther than {AWAY} rad from every atom) with f_char < 10⁻⁴, and their "
        "number (a cell average against a point value: about 0.2 decades apart where f falls a decade per cell, "
        "for any state); the column after it: the same over g = log f of the tails at the centroids (point "
        "against point: the target's quantity); the last: the reference's own time error, f_char from every "
        f"other snapshot (saves every {2 * save_every:g}) against f_char, same cells (to t = 6 it falls about 4× per "
        "halving; later, atoms made or merged within a save interval make it an O(Δt) error, docs/numerics.md).", "",
        f"| state | nside | t | mesh mass | {head} | mass with f_mesh > 10 f_char | background p90 (cells) | g p90 | f_char, saves {2 * save_every:g} against {save_every:g}, p90 |",
        "|---|---|---|---|" + "---|" * len(BANDS) + "---|---|---|---|", *rows, ""]
    path = out / f"background_tails{'_' + _beta_tag(beta)[:-1] if beta != BETA else ''}{_saves_tag(save_every)}{_step_tag(reference_step)}.md"
    path.write_text("\n".join(lines))
    say(f"  wrote {path}")
    return path


def _backward(field, points, t, dt=REFERENCE_STEP):
    """(X₀(y), ∫₀ᵗ div_S v ds) along the backward characteristics from points at time t."""
    y = np.array(points, dtype=float)
    integral = np.zeros(len(y))
    steps = max(1, int(round(t / dt)))
    h = -t / steps
    s = t
    for _ in range(steps):
        k1, d1 = field(y, s)
        k2, d2 = field(_unit(y + 0.5 * h * k1), s + 0.5 * h)
        k3, d3 = field(_unit(y + 0.5 * h * k2), s + 0.5 * h)
        k4, d4 = field(_unit(y + h * k3), s + h)
        y = _unit(y + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4))
        integral += -h / 6 * (d1 + 2 * d2 + 2 * d3 + d4)
        s += h
    return y, integral


SAMPLING_STRIDES = (8, 4, 2, 1)  # every 8th / 4th / other / every snapshot
SAMPLING_DT = 0.0125  # the characteristics' RK4 step in reference_sampling (converged to 0.004 decades at t = 8)


def reference_sampling(ds, mesh, model, law, t, strides=SAMPLING_STRIDES, dt=SAMPLING_DT):
    """How f_char at t depends on the snapshots its field is sampled from, in one run (Dataset ds).

    f_char from every k-th snapshot (k in strides, the last the finest) along RK4 characteristics
    of step dt; over the deep background (cells farther than AWAY from every atom whose finest
    f_char is below 10⁻⁴): the 90th percentile of |log₁₀| between each coarser f_char and the
    finest, and between g = log f of the tails (when the snapshot holds it) and each f_char
    (decades). g's own paths see the field linear in time between couplings: a reference sampled
    at the couplings agrees with g by construction there, and only a finer one can show the
    error of that linearisation. Returns {"cells", "against_finest": {k: p90}, "g": {k: p90}}."""
    k = int(np.argmin(np.abs(ds.time.values - t)))
    t_k = float(ds.time[k])
    ref = {}
    for stride in strides:
        sub = ds.isel(time=slice(0, k + 1, stride))
        if float(sub.time[-1]) != t_k:
            raise ValueError(f"every {stride}th snapshot does not reach t = {t_k:g}")
        ref[stride] = np.log10(characteristic_density(SavedField(sub, mesh, model), law, mesh.centroids, t_k, dt))
    finest = strides[-1]
    deep = _far_from_atoms(mesh, ds.atom_position.values[k], ds.atom_mass.values[k]) & (ref[finest] < -4)

    def p90(a, b):
        return float(np.percentile(np.abs(a[deep] - b[deep]), 90)) if deep.any() else math.nan

    out = {"cells": int(deep.sum()), "against_finest": {s: p90(ref[s], ref[finest]) for s in strides[:-1]}, "g": {}}
    if "log_density" in ds and float(ds["log_density_time"][k]) == t_k:
        g = ds["log_density"].values[k] / math.log(10)
        out["g"] = {s: p90(g, ref[s]) for s in strides}
    return out


def sampling_report(path, times=(4.0, 6.0, 7.0, 8.0), strides=SAMPLING_STRIDES, say=print):
    """The markdown table of reference_sampling for a run file (`--sampling RUNFILE`)."""
    from ..geometry.mesh import HealpixMesh
    from ..runner.build import build_initial_law, build_model
    from ..storage.runfile import open_run

    ds = open_run(path)
    cfg = json.loads(ds.attrs["config"])
    model, law = build_model(cfg["model"]).single_head, build_initial_law(cfg["initial"])
    mesh = HealpixMesh(int(cfg["eulerian"]["nside"]))
    step = float(ds.time[1] - ds.time[0])
    every = [f"{s * step:g}" for s in strides]
    lines = [f"f_char of `{Path(path).name}` from snapshots every {' / '.join(every)} (RK4 step {SAMPLING_DT:g}), "
             f"90th percentile of |log₁₀| over the deep background (decades):", "",
             "| t | cells | " + " | ".join(f"every {e} against every {every[-1]}" for e in every[:-1]) + " | "
             + " | ".join(f"g against every {e}" for e in every) + " |",
             "|---|---|" + "---|" * (2 * len(strides) - 1)]
    for t in times:
        r = reference_sampling(ds, mesh, model, law, t, strides)
        g = [f"{r['g'][s]:.3f}" if s in r["g"] else "—" for s in strides]
        lines.append(f"| {t:g} | {r['cells']} | " + " | ".join(f"{r['against_finest'][s]:.3f}" for s in strides[:-1])
                     + " | " + " | ".join(g) + " |")
        say(lines[-1])
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nside", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--t", type=float, nargs="+", default=[2.0, 4.0, 6.0, 8.0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--tails", action="store_true",
                        help="instead: finite volumes and tails from log f side by side (background_tails.md)")
    parser.add_argument("--states", type=int, nargs="+", default=None,
                        help="with --tails: these states only (indices into TAIL_STATES, from 0)")
    parser.add_argument("--save-every", type=float, default=SAVE_EVERY,
                        help="with --tails: the runs' snapshot interval (the reference's time step; default 0.05)")
    parser.add_argument("--reference-step", type=float, default=REFERENCE_STEP,
                        help="with --tails: f_char's RK4 step (default 0.025; 0.0125 to certify t = 8 where atoms "
                             "are made and merged late)")
    parser.add_argument("--beta", type=float, default=BETA,
                        help="with --tails: the runs' β (default 30; the file names say it otherwise)")
    parser.add_argument("--sampling", metavar="RUNFILE", default=None,
                        help="instead: how the reference of RUNFILE (a --tails run) depends on the snapshots "
                             "its field is sampled from, at the times --t (reference_sampling)")
    args = parser.parse_args(argv)
    if args.sampling:
        print(sampling_report(args.sampling, tuple(args.t)))
    elif args.tails:
        if not args.reference_step > 0:
            parser.error(f"--reference-step must be > 0, got {args.reference_step:g}")
        if not args.beta > 0:
            parser.error(f"--beta must be > 0, got {args.beta:g}")
        tails_report(tuple(args.nside), tuple(args.t), args.out, states=args.states, save_every=args.save_every,
                     reference_step=args.reference_step, beta=args.beta)
    else:
        report(tuple(args.nside), tuple(args.t), args.out)


if __name__ == "__main__":
    main()
