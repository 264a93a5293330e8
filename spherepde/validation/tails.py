"""The tails of the density, relative to f (`spherepde validate tails`; issue 37, first part).

At β ≥ 20 the mean field is steered by densities 10⁻¹⁰–10⁻¹⁵ below the clusters
(docs/theory.md#tails-at-large-β), so the Eulerian density must be accurate relative to f where
f is tiny. The exact test: β = ∞, the paper's matrices (B orthogonal, so the clock is t), uniform
start, whose solution is f_t(y) = e^{2t} / (4π |e^{−tM}y|³) (docs/theory.md#formulas-and-exact-solutions).
Over the tail cells (exact cell average below 10⁻³ of the largest), per time and mesh: the
median and 90th percentile of |f_h/f − 1| of the cell averages, the largest, and min f_h / min f.
Exact cell averages by adaptive quadrature: a cell (or sub-square) whose order-8 and order-12
rules differ by more than 1e-10 relative is split in four, down to 4⁻¹⁴ of a cell; cells above
1 % of the largest average (the clusters: never tail cells, their peaks ~e^{−2t} wide) keep the
order-12 value; a cell with a sub-square still unresolved at the largest depth (next to the
clusters, where the ridge narrows to e^{−3t}) is NaN and left out of the statistics, which say
how many. Adaptivity is needed: at t = 8 the density has ridges e^{−t} ≈ 3·10⁻⁴ rad wide (the great circle x₃ = 0, on
which the mass gathers before it reaches ±e₁), where a fixed order-8 rule is off by 37 % (nside 16).

The candidate that follows: semi-Lagrangian transport of g = log f along characteristics,
g(x, t + Δt) = g(X, t) − ∫ div_S v along the path from the departure point X to x
(`semi_lagrangian_run`: point values at the centroids, g at X by a local quadratic fit in the
tangent plane over the cell holding X and its 8 neighbours, the exact β = ∞ paths). A prototype
in NumPy, measured here against the same exact solution, point values against point values.

    python -m spherepde.validation.tails [--nside 16 32 64] [--schemes muscl log_muscl ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from pathlib import Path

import numpy as np
import scipy.linalg
import xarray as xr

from ..analysis.diagnostics import alignment
from ..analysis.exact import zero_temperature_density
from ..analysis.metrics import f_phase_onset, max_alignment, u_curve_minimum
from ..geometry.mesh import HealpixMesh
from ..models.attention import AttentionModel
from ..models.initial import ProjectedNormal, Uniform, VonMisesFisher
from ..solvers.eulerian import EulerianSolver
from ..solvers.log_density import LogDensitySolver
from ..solvers.particles import ParticleSolver, quadrature_particles
from ..summation import attention_field, mesh_sources
from ..transport.semi_lagrangian import PolynomialInterpolant, advance_log_density, compose_paths, trace_back
from .common import REPO

__all__ = ["tail_errors", "exact_cell_averages", "zero_temperature_run", "semi_lagrangian_run", "zero_temperature_field_of", "coupled_f_onset", "log_state_f_onset", "SL_STEPS", "run_suite", "TAIL_LEVEL", "TIMES", "PAPER_B", "PAPER_V"]

PAPER_V = np.diag([-1.0, 1.0, -2.0])
PAPER_B = np.diag([-1.0, -1.0, 1.0])
TAIL_LEVEL = 1e-3  # tail cells: exact cell average below this fraction of the largest
TIMES = (2.0, 4.0, 6.0, 8.0)
EXACT_ORDER = 8
EXACT_RTOL = 1e-10
EXACT_DEPTH = 14


def exact_cell_averages(mesh, func, rtol=EXACT_RTOL, max_depth=EXACT_DEPTH, bulk=1e-2):
    """Cell averages (1/A)∫_cell func dA by adaptive quadrature (module docstring), relative to
    rtol in every cell below `bulk` × the largest; NaN in a cell with a sub-square still
    unresolved at the largest depth."""
    def rule(cells, a0, b0, size, order):
        pts, w = mesh.square_quadrature(cells, a0, b0, size, order)
        return np.asarray(func(pts.reshape(-1, 3)), dtype=float).reshape(pts.shape[:2]) @ w

    out = rule(np.arange(mesh.npix), 0.0, 0.0, 1.0, 12)
    cells = np.flatnonzero(out < bulk * out.max())
    out[cells] = 0.0
    a0 = b0 = np.zeros(len(cells))
    size = 1.0
    for _ in range(max_depth + 1):
        low, high = rule(cells, a0, b0, size, EXACT_ORDER), rule(cells, a0, b0, size, 12)
        done = np.abs(low - high) <= rtol * np.abs(high)
        np.add.at(out, cells[done], high[done] * size * size)
        if done.all():
            return out
        cells, a0, b0 = cells[~done], a0[~done], b0[~done]
        size *= 0.5
        cells = np.repeat(cells, 4)
        a0 = np.repeat(a0, 4) + np.tile([0.0, size, 0.0, size], len(a0))
        b0 = np.repeat(b0, 4) + np.tile([0.0, 0.0, size, size], len(b0))
    out[cells] = np.nan
    return out


def tail_errors(mesh, f_mesh, f_exact, level=TAIL_LEVEL) -> dict:
    """Relative errors of the cell averages f_mesh against f_exact over the tail cells
    (f_exact < level · max f_exact): count, median, 90th percentile and largest of |f_mesh/f_exact − 1|,
    min f_mesh / min f_exact (over all cells), and how many cells have no exact value (NaN)."""
    f_mesh, f_exact = np.asarray(f_mesh, dtype=float), np.asarray(f_exact, dtype=float)
    known = np.isfinite(f_exact)
    tail = known & (f_exact < level * np.nanmax(f_exact))
    rel = np.abs(f_mesh[tail] / f_exact[tail] - 1.0)
    return {"cells": int(tail.sum()), "median": float(np.median(rel)) if rel.size else math.nan,
            "p90": float(np.percentile(rel, 90)) if rel.size else math.nan,
            "max": float(rel.max()) if rel.size else math.nan,
            "min_ratio": float(f_mesh.min() / np.nanmin(f_exact)), "unresolved": int((~known).sum())}


def zero_temperature_run(nside, scheme="muscl", times=TIMES, atoms=True, **options):
    """{t: tail_errors} of the Eulerian solver at β = ∞ from the uniform law (module docstring),
    and the wall time. atoms: True (the solver's default atoms), False (none) or Atoms options
    (e.g. {"shape": "sigma", "cut": "tail"}); options: EulerianSolver's (tails={}: the tails from
    log f, spherepde.solvers.tails)."""
    mesh = HealpixMesh(nside)
    model = AttentionModel(PAPER_B, PAPER_V, math.inf)
    law = Uniform()
    atom_options = dict(atoms) if isinstance(atoms, dict) else {} if atoms else None
    solver = EulerianSolver(mesh, model, scheme=scheme, atoms=atom_options, **options)
    all_times = [0.0, *times]
    start = time.perf_counter()
    out = {}
    for _, t, f, _ in solver.snapshots(law.cell_averages(mesh), all_times):
        if t == 0.0:
            continue
        out[t] = tail_errors(mesh, f, exact_cell_averages(mesh, zero_temperature_density(model, law, t)))
    return out, time.perf_counter() - start


SL_STEPS = (0.025, 0.05, 0.1, 0.2, 0.4)  # Δt of the semi-Lagrangian transport alone: its error against Δt


def zero_temperature_field_of(M):
    """(s, x) ↦ (v, div_S v) of the exact β = ∞ field for B orthogonal: v = P_x(Mx),
    div_S v = tr M − 3xᵀMx (docs/theory.md#formulas-and-exact-solutions), written out, not summed."""
    def field(s, x):
        u = x @ M.T
        return u - np.sum(u * x, axis=1, keepdims=True) * x, np.trace(M) - 3.0 * np.sum(x * u, axis=1)

    return field


def semi_lagrangian_run(nside, dt, times=TIMES, degree=2, anchor=0.0, path_step=None, maps=False):
    """{t: statistics} of the semi-Lagrangian transport of log f (spherepde.transport.semi_lagrangian)
    at β = ∞ from the uniform law, with the exact local field v = P_x(Mx), div_S v = tr M − 3xᵀMx
    (B orthogonal): point values of f at the centroids against the exact ones over the tail
    (exact f below 10⁻³ of the largest), and the wall time. The same keys as tail_errors.
    degree: of the interpolant (2: over the cell and its 8 neighbours; 3: over two rings).
    g is computed every dt; anchor, path_step: as LogTails' (g interpolated only at the times
    at least `anchor` apart, the paths from there in RK4 steps of at most path_step; 0 and None:
    from the last step, in one RK4 step); maps: the paths of each step composed with the last
    step's (LogTails' paths "maps") instead of retraced from the anchor."""
    mesh = HealpixMesh(nside)
    M = PAPER_V @ PAPER_B.T
    interpolant = PolynomialInterpolant(mesh, degree=degree)
    field = zero_temperature_field_of(M)
    g = g_anchor = np.full(mesh.npix, -math.log(4 * math.pi))
    t_anchor = 0.0
    start = time.perf_counter()
    out = {}
    earlier = None  # maps: (departure points at the anchor, divergence integral) of the last step
    for n in range(1, int(round(max(times) / dt)) + 1):
        span = n * dt - t_anchor
        if maps:
            steps = 1 if path_step is None else max(1, math.ceil(dt / path_step - 1e-9))
            here = trace_back(interpolant.centroids, field, (n - 1) * dt, dt, steps)
            earlier = departure, integral = compose_paths(interpolant, *here, earlier)
            g = interpolant(g_anchor, departure) - integral
        else:
            steps = 1 if path_step is None else max(1, math.ceil(span / path_step - 1e-9))
            g = advance_log_density(interpolant, g_anchor, field, t_anchor, span, steps)
        if span >= anchor - 1e-9:
            g_anchor, t_anchor, earlier = g, n * dt, None
        match = [s for s in times if abs(s - n * dt) < 1e-9]
        if match:
            t = match[0]
            z = mesh.centroids @ scipy.linalg.expm(-t * M).T
            exact = 2 * t - math.log(4 * math.pi) - 3 * np.log(np.linalg.norm(z, axis=1))
            out[t] = tail_errors(mesh, np.exp(g), np.exp(exact))
    return out, time.perf_counter() - start


def _table(results, nsides, schemes, times, key, fmt):
    lines = ["| t | " + " | ".join(f"{s}, nside {n}" for s in schemes for n in nsides) + " |",
             "|---|" + "---|" * (len(schemes) * len(nsides))]
    for t in times:
        cells = [fmt(results[(s, n)][0][t][key]) for s in schemes for n in nsides]
        lines.append(f"| {t:g} | " + " | ".join(cells) + " |")
    return lines


def _orders(results, nsides, schemes, times, key):
    """Observed orders log₂(e(h)/e(h/2)) of a tail statistic between successive meshes."""
    lines = ["| t | " + " | ".join(f"{s}, {a} → {b}" for s in schemes for a, b in zip(nsides, nsides[1:])) + " |",
             "|---|" + "---|" * (len(schemes) * (len(nsides) - 1))]
    for t in times:
        cells = []
        for s in schemes:
            for a, b in zip(nsides, nsides[1:]):
                ea, eb = results[(s, a)][0][t][key], results[(s, b)][0][t][key]
                cells.append(f"{math.log2(ea / eb):.2f}" if ea > 0 and eb > 0 else "—")
        lines.append(f"| {t:g} | " + " | ".join(cells) + " |")
    return lines


# the states compared: name → EulerianSolver options (atoms on in all)
STATES = {"muscl": {"scheme": "muscl"}, "log_muscl": {"scheme": "log_muscl"},
          "muscl + tails from log f": {"scheme": "muscl", "tails": {}},
          "the same, level relative to the atoms too": {"scheme": "muscl", "tails": {"reference": "measure"}},
          # as before the anchors (docs/numerics.md#anchors-g-interpolated-every-10)
          "the same, g interpolated at every coupling": {"scheme": "muscl", "tails": {"anchor": 0.0, "path_step": None}},
          # the paths between anchors composed, not retraced (docs/numerics.md#composed-maps-tail_paths--maps)
          "the same, composed maps between anchors": {"scheme": "muscl", "tails": {"paths": "maps"}},
          # and sigma atoms with the tail cut, the atoms `tails = "log"` makes by default
          # (docs/numerics.md#atoms-that-keep-their-clusters-spread-atom_shape--sigma)
          "composed maps, sigma atoms, tail cut": {"scheme": "muscl", "tails": {"paths": "maps"},
                                                   "atoms": {"shape": "sigma", "cut": "tail"}},
          "composed maps, sigma atoms, tail cut, level relative to the atoms too":
              {"scheme": "muscl", "tails": {"paths": "maps", "reference": "measure"},
               "atoms": {"shape": "sigma", "cut": "tail"}},
          "composed maps, sigma atoms, tail cut, level relative to the clusters' peaks":
              {"scheme": "muscl", "tails": {"paths": "maps", "reference": "clusters"},
               "atoms": {"shape": "sigma", "cut": "tail"}}}
# (anchor, path step, maps) of the semi-Lagrangian transport alone with couplings every 0.2: its
# error against the number of interpolations of g; last: the paths composed between anchors (maps)
SL_ANCHORS = ((0.2, None, False), (0.6, 0.2, False), (1.0, 0.2, False), (1.0, 0.1, False), (2.0, 0.1, False),
              (1.0, 0.1, True))


def run_suite(out, quick=False, slow=False, nsides=None, schemes=tuple(STATES), progress=True):
    """Write OUT/tails.md: the β = ∞ tail errors of each scheme on each mesh, with orders."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    nsides = list(nsides or ([8, 16] if quick else [16, 32, 64] if slow else [16, 32]))
    times = TIMES[:2] if quick else TIMES
    say = (lambda m: print(m, flush=True)) if progress else (lambda m: None)
    results = {}
    for s in schemes:
        for n in nsides:
            results[(s, n)] = zero_temperature_run(n, times=times, **STATES[s])
            say(f"  tails: {s}, nside {n}: {results[(s, n)][1]:.0f} s")
    e = lambda x: f"{x:.2g}"  # noqa: E731
    lines = ["# Tails of the density relative to f (β = ∞, exact solution)", "",
             f"`spherepde validate tails{' --quick' if quick else ' --slow' if slow else ''}`. {__doc__.split(chr(10) + chr(10))[1]}", "",
             f"Tail cells: exact cell average below {TAIL_LEVEL:g} of the largest; atoms on (the default).", "",
             "## Median relative error of the tail cells", "", *_table(results, nsides, schemes, times, "median", e),
             "", "## 90th percentile", "", *_table(results, nsides, schemes, times, "p90", e),
             "", "## Observed order of the 90th percentile", "", *_orders(results, nsides, schemes, times, "p90"),
             "", "## min f_h / min f", "", *_table(results, nsides, schemes, times, "min_ratio", lambda x: f"{x:.4f}"),
             "", "## Tail cells, and cells left out (no converged exact value)", "",
             *_table(results, nsides, schemes, times, "cells", str), "",
             *_table(results, nsides, schemes, times, "unresolved", str),
             "", "## Wall time (s)", "",
             "| scheme | " + " | ".join(f"nside {n}" for n in nsides) + " |", "|---|" + "---|" * len(nsides),
             *[f"| {s} | " + " | ".join(f"{results[(s, n)][1]:.1f}" for n in nsides) + " |" for s in schemes]]
    sl = {(dt, n): semi_lagrangian_run(n, dt, times) for dt in SL_STEPS for n in nsides}
    labels = [f"Δt = {dt:g}" for dt in SL_STEPS]
    sl_results = {(label, n): sl[(dt, n)] for label, dt in zip(labels, SL_STEPS) for n in nsides}
    lines += ["", "## The candidate: semi-Lagrangian transport of log f (point values at the centroids)", "",
              "Point values of f at the cell centroids against the exact point values, over the tail (exact "
              f"f below {TAIL_LEVEL:g} of the largest), spherepde.transport.semi_lagrangian in the exact β = ∞ "
              "field, alone: no mass, no atoms. In the solver it is the column \"muscl + tails from log f\" "
              "above ([eulerian] tails = \"log\", spherepde.solvers.tails: the tail cells of the finite volumes "
              "taken from g every 0.2, cell averages of e^g). Median:", "",
              *_table(sl_results, nsides, labels, times, "median", e), "", "90th percentile:", "",
              *_table(sl_results, nsides, labels, times, "p90", e), "", "Observed order of the 90th percentile:", "",
              *_orders(sl_results, nsides, labels, times, "p90"), "", "min f_h / min f:", "",
              *_table(sl_results, nsides, labels, times, "min_ratio", lambda x: f"{x:.5f}"), "",
              "Below Δt ≈ 0.2 the error grows as the step shrinks: every step interpolates g once (an error "
              "of about h³ per step, the stencil's third derivatives), and those errors add up over t/Δt steps, "
              "while the error of the paths falls as Δt⁴. So the solver couples the tails every 0.2 "
              "(`tail_interval`), whatever the saves."]
    anchored_labels = [f"every {a:g}, steps of {s or 0.2:g}" + (", composed maps" if m else "") for a, s, m in SL_ANCHORS]
    anchored = {(label, n): semi_lagrangian_run(n, 0.2, times, anchor=a, path_step=s, maps=m)
                for label, (a, s, m) in zip(anchored_labels, SL_ANCHORS) for n in nsides}
    lines += ["", "The same transport with g computed every 0.2 but interpolated only at anchors at least A "
              "apart (`tail_anchor`, the solver's default A = 1.0): the paths from the last anchor in RK4 steps "
              "of at most s (`tail_path_step`, default 0.1); \"every 0.2, steps of 0.2\" is Δt = 0.2 above. "
              "90th percentile:", "", *_table(anchored, nsides, anchored_labels, times, "p90", e), "",
              "Observed order of the 90th percentile:", "", *_orders(anchored, nsides, anchored_labels, times, "p90"),
              "", "Fewer interpolations, smaller errors, as long as the paths are accurate: with anchors every 1.0 "
              "and steps of 0.1 the 90th percentile is 10⁻³ or less on both meshes. \"composed maps\" "
              "(`tail_paths = \"maps\"`): each step traces its own interval only and interpolates the last "
              "step's departure points and divergence integral there (smooth maps) instead of retracing the "
              "paths to the anchor: 2–4× the retraced error, a fraction of the cost."]
    cubic = {(f"degree 3, Δt = {dt:g}", n): semi_lagrangian_run(n, dt, times, degree=3) for dt in (0.1, 0.2)
             for n in nsides}
    cubic_labels = [f"degree 3, Δt = {dt:g}" for dt in (0.1, 0.2)]
    lines += ["", "A cubic fit over two rings of neighbours (25 cells) instead of the quadratic over 9, the "
              "same transport, 90th percentile:", "", *_table(cubic, nsides, cubic_labels, times, "p90", e), "",
              "Worse than the quadratic: the wider stencil reaches across the ridges where g bends by units per "
              "cell, which no polynomial over 25 cells follows. A higher order needs a compact stencil."]
    path = out / "tails.md"
    path.write_text("\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------------- coupling (prototype)
PROJECTED_NORMAL = ProjectedNormal([0.3, 0.2, 0.1], [[1.0, 0.2, 0.0], [0.2, 0.8, 0.0], [0.0, 0.0, 0.6]])
COUPLING_TAIL = 1e-3  # cells whose finite-volume density is below this × the mesh's largest take e^{g}
COUPLING_EXCLUSION = 3.0  # cell sizes around an atom where g follows the finite volumes
SHARE_AFTER = 1e-3  # the background's share at the atoms is reported once the mesh holds less mass than this


def _measure_of(mesh, f, atoms):
    """(points, masses) of f dA + the atoms (spherepde.summation.mesh_sources)."""
    return mesh_sources(mesh, f, *(atoms.points() if atoms is not None else (None, None)))


def _onset_summary(mesh, model, series, start):
    ds = xr.Dataset({"alignment_E": ("time", [s[1] for s in series]), "alignment_F": ("time", [s[2] for s in series])},
                    coords={"time": [s[0] for s in series]})
    e_max, t_max = max_alignment(ds)
    return f_phase_onset(ds), e_max, t_max, time.perf_counter() - start


def coupled_f_onset(nside, beta=30.0, dt=0.1, t_end=20.0, coupled=True, level=COUPLING_TAIL,
                    exclusion=COUPLING_EXCLUSION, atoms=None, shadow=False, say=None):
    """F-onset of the paper's matrices at β from the projected-normal law of solvers/paper_beta.toml
    (Eulerian + atoms, velocity_tolerance 1e-3), with or without the tails from semi-Lagrangian
    log f. After every interval dt, g = log f at the centroids is advanced (limited interpolant)
    in the field of the state (the attention sums of f dA + atoms, linear in time between the
    interval's ends); every cell whose finite-volume density is below `level` × the mesh's
    largest and that lies farther than `exclusion` cell sizes from every atom takes the cell
    average of e^{g}; the bulk (the other cells and the atoms) is scaled to keep the mass; and in
    the bulk g is reset to log f, so that g never carries mass the atoms already hold. A
    prototype of the coupling, to measure whether it makes the answer converge. atoms: Atoms
    options. shadow (with coupled=False): g is advanced and reset in the bulk all the same, but
    never substituted: the finite volumes' tails against their own characteristics.
    Returns (onset, max alignment with E, its time, wall seconds, the largest share of the
    background in the softmax weight at an atom over the snapshots where the mesh holds less than
    SHARE_AFTER of the atoms' mass, and its time, the atoms at t = 5 and t = 8:
    {t: [(mass, position)]}, and {t: the 90th percentile over the tail cells of |log₁₀(f / ⟨e^g⟩)|
    before the substitution} at t = 4 and 8: the finite volumes' drift from the characteristics,
    over one interval when coupled, since t = 0 in the shadow)."""
    mesh = HealpixMesh(nside)
    model = AttentionModel(PAPER_B, PAPER_V, beta)
    solver = EulerianSolver(mesh, model, velocity_tolerance=1e-3, atoms={} if atoms is None else atoms)
    interpolant = PolynomialInterpolant(mesh, limited=True)
    g = np.log(PROJECTED_NORMAL.density(mesh.centroids))
    times = [round(k * dt, 12) for k in range(int(round(t_end / dt)) + 1)]
    reach = exclusion * math.sqrt(mesh.area)

    def field_of(f):
        sources, masses = _measure_of(mesh, f, solver.atoms)
        return lambda points: attention_field(model, sources, masses, points, want_div=True)[:2]

    start, previous, series, share, clusters, drift = time.perf_counter(), None, [], (0.0, math.nan), {}, {}
    advancing = coupled or shadow
    for k, t, f, _ in solver.snapshots(PROJECTED_NORMAL.cell_averages(mesh), times):
        atoms_now = solver.atoms
        if advancing and k > 0:
            now, t0 = field_of(f), times[k - 1]

            def field(s, x, a=previous, b=now, t0=t0):
                theta = min(max((s - t0) / dt, 0.0), 1.0)
                if theta == 0.0 or theta == 1.0:  # an end of the interval: one state's sums only
                    return (b if theta else a)(x)
                (va, da), (vb, db) = a(x), b(x)
                return (1 - theta) * va + theta * vb, (1 - theta) * da + theta * db

            g = advance_log_density(interpolant, g, field, t0, dt)
            f_sl = interpolant.cell_averages_of_exp(g)
            near = np.zeros(mesh.npix, dtype=bool)
            if atoms_now.count:  # ≤ capacity atoms: a (npix, atoms) distance table is small
                x = atoms_now.points()[0]
                near = (np.linalg.norm(mesh.centroids[:, None, :] - x[None], axis=2) < reach).any(axis=1)
            tail = (f < level * f.max()) & ~near & (f_sl > 0)
            if any(abs(t - c) < 1e-9 for c in (4.0, 8.0)):
                both = tail & (f > 0)
                drift[round(t)] = float(np.percentile(np.abs(np.log10(f[both] / f_sl[both])), 90))
            if coupled:
                gained = (f_sl[tail] - f[tail]).sum() * mesh.area
                scale = 1.0 - gained / (f[~tail].sum() * mesh.area + atoms_now.masses.sum())
                f[tail] = f_sl[tail]  # in place: the solver continues from this density
                f[~tail] *= scale
                atoms_now.masses *= scale
            bulk = ~tail & (f > 0)
            g[bulk] = np.log(f[bulk])
        if advancing:
            previous = field_of(f)
        points, weights = _measure_of(mesh, f, atoms_now)
        series.append((t, alignment(points, weights, model.E.basis), alignment(points, weights, model.F.basis)))
        if atoms_now.count and mesh.integrate(f) < SHARE_AFTER * atoms_now.total_mass:  # the bulk is in atoms
            s = float(np.nanmax(solver.velocity.background_share(f)))
            share = max(share, (s, t))
        if any(abs(t - c) < 1e-9 for c in (5.0, 8.0)):
            clusters[round(t)] = list(zip(*atoms_now.points()[::-1]))
        if say is not None and k % int(round(2.0 / dt)) == 0:
            say(f"    nside {nside}, {'coupled' if coupled else 'finite volumes'}: t = {t:g}, "
                f"E {series[-1][1]:.3f}, F {series[-1][2]:.3f}, {time.perf_counter() - start:.0f} s")
    return (*_onset_summary(mesh, model, series, start), *share, clusters, drift)


def log_state_f_onset(nside, beta=30.0, dt=0.1, t_end=20.0, say=None):
    """The same question with the whole density carried as log f (spherepde.solvers.log_density:
    semi-Lagrangian g plus atoms, the measure rescaled to its mass after every step). Returns
    (onset, max alignment with E, its time, wall seconds, the atoms at t = 5: [(mass, position)])."""
    mesh = HealpixMesh(nside)
    model = AttentionModel(PAPER_B, PAPER_V, beta)
    solver = LogDensitySolver(mesh, model, dt=dt, atoms={"stalled_width": 0.0})
    times = [round(k * 0.1, 12) for k in range(int(round(t_end / 0.1)) + 1)]
    start, series, at5 = time.perf_counter(), [], None
    for k, t, _, F, _ in solver.snapshots(np.log(PROJECTED_NORMAL.density(mesh.centroids)), times):
        points, weights = _measure_of(mesh, F, solver.atoms)
        series.append((t, alignment(points, weights, model.E.basis), alignment(points, weights, model.F.basis)))
        if abs(t - 5.0) < 1e-9:
            at5 = list(zip(*solver.atoms.points()[::-1]))
        if say is not None and k % 20 == 0:
            say(f"    nside {nside}, log state dt {dt:g}: t = {t:g}, E {series[-1][1]:.3f}, F {series[-1][2]:.3f}")
    return (*_onset_summary(mesh, model, series, start), at5)


def quadrature_particle_clusters(nside, beta=30.0, t=5.0, dt=0.05):
    """The two clusters (mass, unit centre) of quadrature particles (one per cell of HEALPix(nside),
    RK4) from the projected-normal law at time t, split by the sign of x₁: the bulk reference of
    a second method, before the tails steer anything."""
    mesh = HealpixMesh(nside)
    x0, w, _ = quadrature_particles(mesh, PROJECTED_NORMAL)
    *_, (_, _, x, _) = ParticleSolver(AttentionModel(PAPER_B, PAPER_V, beta), dt=dt).snapshots(x0, w, [0.0, t])
    out = []
    for side in (1, -1):
        sel = side * x[:, 0] > 0
        centre = w[sel] @ x[sel]
        out.append((float(w[sel].sum()), centre / np.linalg.norm(centre)))
    return out


def _clusters_text(clusters):
    return "; ".join(f"{m:.4f} at ({c[0]:+.4f}, {c[1]:+.4f}, {c[2]:+.4f})" for m, c in clusters if m > 0.01)


def coupling_report(out, nsides, say=print):
    """validation/reports/tails/coupling.md: the F-onset at β = 30 of the finite volumes, of the
    coupled tails (dt 0.1 and 0.05, and the tail level 1e-2 and 1e-4 at the finest nside), and of
    the log-density state; the bulk at t = 5 against quadrature particles."""
    rows, bulk = [], []
    for n in nsides:
        variants = [("finite volumes + atoms", dict(coupled=False)), ("coupled, dt 0.1", dict(dt=0.1)),
                    ("coupled, dt 0.05", dict(dt=0.05))]
        if n == max(nsides):
            variants += [("coupled, dt 0.1, tail level 1e-2", dict(dt=0.1, level=1e-2)),
                         ("coupled, dt 0.1, tail level 1e-4", dict(dt=0.1, level=1e-4)),
                         ('coupled, dt 0.1, atom_cut "tail"', dict(dt=0.1, atoms={"cut": "tail"}))]
        for name, options in variants:
            onset, e_max, t_max, wall, share, t_share, clusters, _ = coupled_f_onset(n, say=say, **options)
            rows.append(f"| {n} | {name} | {onset:.3f} | {e_max:.4f} at {t_max:g} | {share:.2g} at {t_share:g} | "
                        f"{wall:.0f} |")
            if name in ("finite volumes + atoms", "coupled, dt 0.1"):
                for c in (5, 8):
                    bulk.append(f"| {n} | {c} | {name} | {_clusters_text(clusters.get(c, []))} |")
        for dt in (0.1, 0.05):
            onset, e_max, t_max, wall, at5 = log_state_f_onset(n, dt=dt, say=say)
            rows.append(f"| {n} | log-density state, dt {dt:g} | {onset:.3f} | {e_max:.4f} at {t_max:g} | | "
                        f"{wall:.0f} |")
            bulk.append(f"| {n} | 5 | log-density state, dt {dt:g} | {_clusters_text(at5)} |")
        for c in (5, 8):
            bulk.append(f"| {n} | {c} | quadrature particles (RK4, dt 0.05) | "
                        f"{_clusters_text(quadrature_particle_clusters(n, t=float(c)))} |")
    path = Path(out) / "coupling.md"
    path.write_text(
        "# F-onset at β = 30: coupled tails and the log-density state (prototypes)\n\n"
        f"`python -m spherepde.validation.tails --coupling --nside {' '.join(map(str, nsides))}` "
        f"({time.strftime('%Y-%m-%d')}). β = 30, the paper's matrices, the projected-normal law of "
        "`solvers/paper_beta.toml`, t ≤ 20. Coupled: `coupled_f_onset` (finite volumes + atoms, "
        "velocity_tolerance 1e-3, with the tail cells taken from semi-Lagrangian log f after every dt). "
        "Log-density state: `log_state_f_onset` (spherepde.solvers.log_density).\n\n"
        "| nside | state | F-onset | max alignment with E | largest background share at an atom (mesh mass < 10⁻³) "
        "| wall (s) |\n"
        "|---|---|---|---|---|---|\n"
        + "\n".join(rows) + "\n\n## The bulk: clusters heavier than 0.01 (mass at unit centre)\n\n"
        "| nside | t | state | clusters |\n|---|---|---|---|\n" + "\n".join(bulk) + "\n")
    return path


# ---------------------------------------------------------------------- the tails in the solver
# the default coupling every 0.2 (saves every 0.2) from a run file of solvers/sweeps/tails_convergence.toml
# (resumable, for the long runs): imported by import_runs, never started by hybrid_report
RUN_FILE_VARIANT = "tails from log f, coupling every 0.2 (saves every 0.2), spherepde run"
# the same with the default anchors, from a run file of solvers/sweeps/tails_anchored.toml
RUN_FILE_ANCHORED = "tails from log f, coupling every 0.2 (saves every 0.2), g interpolated every 1.0, spherepde run"
# and with the composed maps between anchors, from a run file of solvers/sweeps/tails_maps.toml
RUN_FILE_MAPS = "tails from log f, coupling every 0.2 (saves every 0.2), g interpolated every 1.0, composed maps, spherepde run"
# and with atoms that keep their cluster's spread and a cut that keeps the tail beside them, from a run
# file of solvers/sweeps/tails_sigma.toml (`atom_shape = "sigma"`, `atom_cut = "tail"`)
RUN_FILE_SIGMA = RUN_FILE_MAPS.replace(", spherepde run", ", sigma atoms, tail cut, spherepde run")
# and with the level relative to the clusters' peaks and couplings every 0.05, from a run file of
# solvers/sweeps/tails_clusters.toml (`tail_reference = "clusters"`, `tail_interval = 0.05`)
RUN_FILE_CLUSTERS = RUN_FILE_SIGMA.replace("coupling every 0.2 (saves every 0.2)", "coupling every 0.05 (saves every 0.2)").replace(
    ", spherepde run", ", level relative to the clusters' peaks, spherepde run")
# and with the followed tail cells bounded by their neighbours, from a run file of
# solvers/sweeps/tails_bounded.toml (`tail_follow_bounds = "neighbours"`)
RUN_FILE_BOUNDED = RUN_FILE_CLUSTERS.replace(", spherepde run", ", followed within the neighbours, spherepde run")
# and with g's composed maps retraced to anchors 5.0 apart where their error budget runs out, the
# followed tail cells bounded by their neighbours, from a run file of solvers/sweeps/tails_selective.toml
# (`tail_paths = "selective"`, `tail_anchor = 5.0`, `tail_follow_bounds = "neighbours"`)
RUN_FILE_SELECTIVE = RUN_FILE_CLUSTERS.replace(", spherepde run", ", selective paths to anchors every 5.0, followed "
                                                                   "within the neighbours, spherepde run")
# what `[eulerian] tails = "log"` ran by default when these variants were measured (until 2026-12-07):
# g interpolated at anchors 1.0 apart with the composed maps between them, sigma atoms and the tail cut
DEFAULT_TAILS = {"anchor": 1.0, "path_step": 0.1, "paths": "maps", "atoms": {"shape": "sigma", "cut": "tail", "capacity": 128}}
DEFAULTS_VARIANT = "tails from log f, coupling every 0.2 (saves every 0.2), the defaults (composed maps, sigma atoms, tail cut)"
# g interpolated at every coupling (LogTails(anchor=0)), as before the anchors: the variants measured then
EVERY_COUPLING = {"anchor": 0.0, "path_step": None}
HYBRID_VARIANTS = {
    "finite volumes + atoms": None,
    "tails from log f, coupling every 0.2 (saves every 0.1)": {**EVERY_COUPLING},
    "tails from log f, coupling every 0.2 (saves every 0.2)": {"interval": 0.2, "save_every": 0.2, **EVERY_COUPLING},
    "tails from log f, coupling every 0.4 (saves every 0.4)": {"interval": 0.4, "save_every": 0.4, **EVERY_COUPLING},
    RUN_FILE_VARIANT: {"interval": 0.2, "save_every": 0.2, "from_run": True, **EVERY_COUPLING},
    RUN_FILE_ANCHORED: {"interval": 0.2, "save_every": 0.2, "from_run": True, "anchor": 1.0, "path_step": 0.1},
    RUN_FILE_MAPS: {"interval": 0.2, "save_every": 0.2, "from_run": True, "anchor": 1.0, "path_step": 0.1,
                    "paths": "maps"},
    RUN_FILE_SIGMA: {"interval": 0.2, "save_every": 0.2, "from_run": True, **DEFAULT_TAILS},
    RUN_FILE_CLUSTERS: {"interval": 0.05, "save_every": 0.2, "from_run": True, **DEFAULT_TAILS, "reference": "clusters"},
    RUN_FILE_BOUNDED: {"interval": 0.05, "save_every": 0.2, "from_run": True, **DEFAULT_TAILS, "reference": "clusters",
                       "follow_bounds": "neighbours"},
    RUN_FILE_SELECTIVE: {"interval": 0.05, "save_every": 0.2, "from_run": True, **DEFAULT_TAILS, "reference": "clusters",
                         "paths": "selective", "anchor": 5.0, "follow_bounds": "neighbours"},
    # how a new atom is made (docs/numerics.md#atoms-that-keep-their-clusters-spread-atom_shape--sigma):
    # its patch keeps the e^{linear} fit of its outer ring (`atom_cut = "tail"`), and/or it is four points
    # with the cluster's covariance (`atom_shape = "sigma"`; 128 slots, four per atom until they merge)
    "tails from log f, coupling every 0.2 (saves every 0.2), tail cut":
        {"interval": 0.2, "save_every": 0.2, "atoms": {"cut": "tail"}, **EVERY_COUPLING},
    "tails from log f, coupling every 0.2 (saves every 0.2), sigma atoms":
        {"interval": 0.2, "save_every": 0.2, "atoms": {"shape": "sigma", "capacity": 128}, **EVERY_COUPLING},
    "tails from log f, coupling every 0.2 (saves every 0.2), sigma atoms, tail cut":
        {"interval": 0.2, "save_every": 0.2, "atoms": {"shape": "sigma", "cut": "tail", "capacity": 128},
         **EVERY_COUPLING},
    # where the kernel is narrower than a cell (β = 1000 at nside ≤ 32): f constant in the near cells
    # at the atoms, as before the log-linear profile (docs/numerics.md#near-field-in-the-tails-near_field_profile)
    "tails from log f, coupling every 0.2 (saves every 0.2), f constant in the near cells":
        {"interval": 0.2, "save_every": 0.2, "near_field_profile": "constant", **EVERY_COUPLING},
    # g's paths in the cell-centre sums, as before the sub-cell sources (LogTails.field_of)
    "tails from log f, coupling every 0.2 (saves every 0.2), paths of g in cell-centre sums":
        {"interval": 0.2, "save_every": 0.2, "profile": "constant", **EVERY_COUPLING},
    # the cells around an atom left to the finite volumes: 3 cell sizes by default, so a finer mesh
    # also narrows them in radians; these separate that from the mesh's own error
    "tails from log f, coupling every 0.2 (saves every 0.2), exclusion 1.5 cells":
        {"interval": 0.2, "save_every": 0.2, "exclusion": 1.5, **EVERY_COUPLING},
    "tails from log f, coupling every 0.2 (saves every 0.2), exclusion 6 cells":
        {"interval": 0.2, "save_every": 0.2, "exclusion": 6.0, **EVERY_COUPLING},
    # the velocity extrapolated with ε = 1e-4 instead of 1e-3 (docs/numerics.md): the time error of the
    # finite volumes and atoms, which the F-phase's instability amplifies by about e per unit time
    "tails from log f, coupling every 0.2 (saves every 0.2), velocity tolerance 1e-4":
        {"interval": 0.2, "save_every": 0.2, "velocity_tolerance": 1e-4, **EVERY_COUPLING},
    # peaks down to 1e-6 of the mass become atoms (atom_min_mass, default 1e-4): the finite volumes
    # leave 8e-5 of the mass in the cells beside the atoms at nside 16 from t = 6 on, 8e-7 at nside 64
    "tails from log f, coupling every 0.2 (saves every 0.2), atoms from 1e-6":
        {"interval": 0.2, "save_every": 0.2, "atoms": {"min_mass": 1e-6}, **EVERY_COUPLING},
    # g interpolated at t = 0 only: every coupling follows its paths back to the start through the
    # states of all couplings since (LogTails(paths="start"); cost grows with t)
    "tails from log f, coupling every 0.2 (saves every 0.2), paths from the start":
        {"interval": 0.2, "save_every": 0.2, "paths": "start"},
    # g interpolated every 1.0 only (LogTails(anchor=1.0)): a coupling in between follows its paths
    # back to the last anchor, in RK4 steps of at most 0.1; every 0.1 tests the coupling's sensitivity
    "tails from log f, coupling every 0.2 (saves every 0.2), g interpolated every 1.0":
        {"interval": 0.2, "save_every": 0.2, "anchor": 1.0, "path_step": 0.1},
    "tails from log f, coupling every 0.1 (saves every 0.1), g interpolated every 1.0":
        {"interval": 0.1, "save_every": 0.1, "anchor": 1.0, "path_step": 0.1},
    # the same with the composed maps between anchors (LogTails(paths="maps")): each coupling traces
    # its own interval only, the paths back to the anchor by the last coupling's interpolated map
    "tails from log f, coupling every 0.2 (saves every 0.2), g interpolated every 1.0, composed maps":
        {"interval": 0.2, "save_every": 0.2, "anchor": 1.0, "path_step": 0.1, "paths": "maps"},
    "tails from log f, coupling every 0.2 (saves every 0.2), g interpolated every 1.0, paths in steps of 0.2":
        {"interval": 0.2, "save_every": 0.2, "anchor": 1.0, "path_step": 0.2},
    "tails from log f, coupling every 0.2 (saves every 0.2), g interpolated every 1.0, level relative to the atoms too":
        {"interval": 0.2, "save_every": 0.2, "anchor": 1.0, "path_step": 0.1, "reference": "measure"},
    # the solver's defaults with tails = "log" (composed maps, sigma atoms, tail cut), in the process,
    # and the same with the level relative to the atoms too: at β = ∞ the level relative to the mesh
    # alone leaves the ridges beside new atoms to the finite volumes (docs/numerics.md)
    DEFAULTS_VARIANT: {"interval": 0.2, "save_every": 0.2, **DEFAULT_TAILS},
    DEFAULTS_VARIANT + ", level relative to the atoms too":
        {"interval": 0.2, "save_every": 0.2, **DEFAULT_TAILS, "reference": "measure"},
    # and relative to the peak density of the clusters the atoms stand for, carried by Liouville
    # from the mesh's peak before the cut (LogTails._grow_peaks): independent of the mesh
    DEFAULTS_VARIANT + ", level relative to the clusters' peaks":
        {"interval": 0.2, "save_every": 0.2, **DEFAULT_TAILS, "reference": "clusters"},
    # the same with shorter couplings: at β = 30 the field of g's paths is linear in time between
    # couplings, and where atoms compete in the softmax it is not (docs/numerics.md)
    **{DEFAULTS_VARIANT.replace("0.2", format(dt, "g")) + level: {"interval": dt, "save_every": dt, **DEFAULT_TAILS,
                                                                  "reference": reference}
       for dt in (0.1, 0.05) for level, reference in (("", "mesh"), (", level relative to the clusters' peaks",
                                                                     "clusters"))},
    "tails from log f, coupling every 0.2 (saves every 0.2), paths in 4 steps":
        {"interval": 0.2, "save_every": 0.2, "substeps": 4, **EVERY_COUPLING},
    "tails from log f, coupling every 0.2 (saves every 0.2), level relative to the atoms too":
        {"interval": 0.2, "save_every": 0.2, "reference": "measure", **EVERY_COUPLING},
    "tails from log f, coupling every 0.1": {"interval": 0.1, **EVERY_COUPLING},
    "tails from log f, coupling every 0.05": {"interval": 0.05, **EVERY_COUPLING},
    "tails from log f, coupling every 0.025": {"interval": 0.025, **EVERY_COUPLING},
    "tails from log f, coupling every 0.1, not followed between couplings":
        {"interval": 0.1, "follow": False, **EVERY_COUPLING},
    "tails from log f, coupling every 0.1, the prototype's coupling": {"interval": 0.1, "reset": "bulk",
                                                                       "limited": True, "criterion": "fv",
                                                                       "follow": False, **EVERY_COUPLING},
}


# The initial laws of solvers/paper_beta.toml: (law, cache-file prefix).
PAPER_VMF = VonMisesFisher(np.ones(3) / math.sqrt(3.0), 2.0)
HYBRID_LAWS = {"projected normal": (PROJECTED_NORMAL, ""), "von Mises–Fisher": (PAPER_VMF, "vmf_")}
LAW_KINDS = {"projected_normal": "projected normal", "vmf": "von Mises–Fisher"}  # [initial] kind → HYBRID_LAWS


def hybrid_series(nside, beta=30.0, tails=None, t_end=20.0, save_every=0.1, say=None, law=None,
                  near_field_profile=None, velocity_tolerance=1e-3, atoms=None):
    """The paper's matrices at β from the projected-normal law of solvers/paper_beta.toml
    (atoms), with the tails of spherepde.solvers.tails (options, or None: the finite volumes
    alone; law: another initial law; near_field_profile: the solver's, None for its default): per
    save time t, alignment with E and F, the largest background
    share at an atom, x₂ of the heaviest atom, min f, the tail cells; and the wall time."""
    mesh = HealpixMesh(nside)
    model = AttentionModel(PAPER_B, PAPER_V, beta)
    profile = {} if near_field_profile is None else {"near_field_profile": near_field_profile}
    solver = EulerianSolver(mesh, model, velocity_tolerance=velocity_tolerance, atoms=atoms or {}, tails=tails,
                            **profile)
    times = [round(k * save_every, 12) for k in range(int(round(t_end / save_every)) + 1)]
    start, rows = time.perf_counter(), []
    law = PROJECTED_NORMAL if law is None else law
    log_f0 = np.log(law.density(mesh.centroids))
    for k, t, f, rec in solver.snapshots(law.cell_averages(mesh), times, log_f0=log_f0):
        x, m = solver.atoms.points()
        points, weights = mesh_sources(mesh, f, x, m)
        rows.append({"t": t, "E": alignment(points, weights, model.E.basis),
                     "F": alignment(points, weights, model.F.basis), "share": rec["background_share_max"],
                     "x2": float(abs(x[np.argmax(m)][1])) if len(m) else math.nan,
                     # ⟨Bz, z⟩ of the heaviest atom: 0 on the cone of rest of an equal pair (docs/theory.md)
                     "q": float(x[np.argmax(m)] @ model.B @ x[np.argmax(m)]) if len(m) else math.nan,
                     "min_f": float(f.min()),
                     "tail_cells": rec.get("tail_cells", 0)})
        if say is not None and k % int(round(2.0 / save_every)) == 0:
            say(f"    nside {nside}, {tails}: t = {t:g}, E {rows[-1]['E']:.3f}, F {rows[-1]['F']:.3f}, "
                f"{time.perf_counter() - start:.0f} s")
    return {"rows": rows, "wall": time.perf_counter() - start}


def hybrid_series_of_run(path, partial=False):
    """The rows of hybrid_series from a complete run file (its own diagnostics: alignment with E and F
    of the mesh and the atoms, background_share_max, x₂ of the heaviest atom, min_density,
    tail_cells, W₂ to Π#ρ₀) and its wall time (of the last segment, if it was resumed); partial: an
    unfinished run too (its snapshots so far; "partial": True in the result)."""
    from ..storage.runfile import open_run

    with open_run(path) as ds:
        complete = int(ds.attrs.get("complete", 0)) == 1
        if not (complete or partial):
            raise ValueError(f"{path}: the run is not complete")
        masses, positions = ds["atom_mass"].values, ds["atom_position"].values
        B = np.array(json.loads(ds.attrs["config"])["model"]["B"], dtype=float)
        rows = []
        for k, t in enumerate(ds["time"].values):
            heaviest = int(np.argmax(masses[k]))
            z = positions[k, heaviest]
            rows.append({"t": float(t), "E": float(ds["alignment_E"].values[k]), "F": float(ds["alignment_F"].values[k]),
                         "share": float(ds["background_share_max"].values[k]),
                         "x2": float(abs(z[1])) if masses[k, heaviest] > 0 else math.nan,
                         "q": float(z @ B @ z) if masses[k, heaviest] > 0 else math.nan,
                         "min_f": float(ds["min_density"].values[k]), "tail_cells": int(ds["tail_cells"].values[k]),
                         "w2": float(ds["w2_to_projection"].values[k]),
                         # its part paid by mass that crossed E⊥ (NaN in files written before it)
                         "w2_across": float(ds["w2_across_E_perp"].values[k]) if "w2_across_E_perp" in ds
                         else math.nan})
        return {"rows": rows, "wall": float(ds.attrs.get("wall_seconds", math.nan)), "run_file": Path(path).name,
                "partial": not complete}


def run_file_variant(eul):
    """The HYBRID_VARIANTS name of a run file's [eulerian] settings (import_runs), None where no
    variant holds them."""
    if (float(eul.get("tail_exclusion_width", 0.0)) > 0.0 or eul.get("tail_path_scheme", "rk4") != "rk4"
            or eul.get("tail_field_between", "linear") != "linear" or eul.get("tail_paths") == "backtrack"):
        return None  # no variant holds a neighbourhood in kernel widths, other paths than RK4's, the
        # measure's or the steps' field, or the backtracked maps
    paths = eul.get("tail_paths", "retrace")
    variant = (RUN_FILE_VARIANT if eul.get("tail_anchor", 0.0) == 0 else
               RUN_FILE_MAPS if paths in ("maps", "selective") else RUN_FILE_ANCHORED)
    made = (eul.get("atom_shape", "point"), eul.get("atom_cut", "floor"))
    level = (eul.get("tail_reference", "mesh"), eul.get("tail_interval", 0.2))
    if made == ("point", "floor"):
        return variant if level[0] == "mesh" else None
    if made != ("sigma", "tail") or variant != RUN_FILE_MAPS:
        return None
    if paths == "selective":  # its own tolerance, anchors every 5.0
        selective = ((eul.get("tail_anchor"), eul.get("tail_retrace_tolerance"), eul.get("tail_follow_bounds"), level)
                     == (5.0, 0.01, "neighbours", ("clusters", 0.05)))
        return RUN_FILE_SELECTIVE if selective else None
    if eul.get("tail_follow_bounds", "none") == "neighbours":
        return RUN_FILE_BOUNDED if level == ("clusters", 0.05) else None
    return {("mesh", 0.2): RUN_FILE_SIGMA, ("clusters", 0.05): RUN_FILE_CLUSTERS}.get(level)


def import_runs(runs, cache, partial=False):
    """Keep every complete run file in the folder `runs` (solvers/sweeps/tails_convergence.toml,
    tails_anchored.toml, tails_maps.toml, tails_sigma.toml) as the cached JSON of RUN_FILE_VARIANT (g
    interpolated at every coupling), RUN_FILE_ANCHORED (`tail_anchor` > 0), RUN_FILE_MAPS (and
    `tail_paths = "maps"`), RUN_FILE_SIGMA (and `atom_shape = "sigma"`, `atom_cut = "tail"`; other
    atoms than the default points cut at the floor are not kept) or RUN_FILE_CLUSTERS (and
    `tail_reference = "clusters"`, `tail_interval = 0.05`; other levels are not kept), RUN_FILE_BOUNDED (and
    `tail_follow_bounds = "neighbours"`) or RUN_FILE_SELECTIVE (run_file_variant) for its law, nside and β (not
    replacing one already kept, unless that one was partial);
    partial: unfinished runs too, as far as they got (the report then says where they end: the
    F-onset and the maximum of the alignment with E are final once past, the rest is not). The
    paths imported."""
    from ..storage.runfile import open_run

    done = []
    for path in sorted(Path(runs).glob("*-[0-9][0-9][0-9][0-9].nc")):  # run ids <sweep>-<index:04d>, not the combined file
        if not partial and Path(f"{path}.lock").exists():  # a run is writing it
            continue
        with open_run(path) as ds:
            if int(ds.attrs.get("complete", 0)) != 1 and not partial:
                continue
            config = json.loads(ds.attrs["config"])
        law = LAW_KINDS[config["initial"]["kind"]]
        eul = config["eulerian"]
        variant = run_file_variant(eul)
        if variant is None:
            continue
        key = hybrid_key(cache, config["eulerian"]["nside"], float(config["model"]["beta"]), variant, law)
        if not key.exists() or json.loads(key.read_text()).get("partial", False):
            key.write_text(json.dumps(hybrid_series_of_run(path, partial=partial)))
            done.append(path)
    return done


SOLVER_OPTIONS = ("near_field_profile", "velocity_tolerance", "atoms")  # of a variant, for the EulerianSolver


def hybrid_options(options):
    """(tails options, save interval, solver options) of a HYBRID_VARIANTS entry: "save_every"
    (default 0.1) is the run's, since the save times bound the coupling interval; SOLVER_OPTIONS
    the EulerianSolver's (default: its own, log-linear near field with tails, and hybrid_series'
    velocity tolerance 1e-3)."""
    if options is None:
        return None, 0.1, {}
    options = dict(options)
    options.pop("from_run", None)
    solver = {key: options.pop(key) for key in SOLVER_OPTIONS if key in options}
    return options, options.pop("save_every", 0.1), solver


MAX_KEY_BYTES = 240  # file names stop at 255 bytes on most file systems


def hybrid_key(cache, n, beta, name, law="projected normal"):
    """The cached run of a variant (JSON); the laws other than the projected normal carry a prefix.
    A name longer than MAX_KEY_BYTES keeps its first 200 characters and a digest of the whole (the
    shorter names, all those kept before the selective variant, are unchanged)."""
    prefix = HYBRID_LAWS[law][1]
    stem = f"{prefix}beta{beta:g}_nside{n}_{name.replace(' ', '_').replace(',', '').replace('+', 'and')}"
    if len(stem.encode()) + len(".json") > MAX_KEY_BYTES:
        stem = f"{stem[:200]}_{hashlib.sha1(stem.encode()).hexdigest()[:12]}"
    return Path(cache) / f"{stem}.json"


def hybrid_summary(rows):
    """The paper's metrics of hybrid_series rows: F-onset, max alignment with E and its time, the
    largest alignment with F after it and its time, the time x₂ of the heaviest atom reaches ½,
    the alignments at the end."""
    ds = xr.Dataset({"alignment_E": ("time", [r["E"] for r in rows]), "alignment_F": ("time", [r["F"] for r in rows])},
                    coords={"time": [r["t"] for r in rows]})
    e_max, t_max = max_alignment(ds)
    after = [r for r in rows if r["t"] >= t_max]  # the F-phase follows the E-phase's peak
    f = np.array([r["F"] for r in after])
    x2 = np.array([r["x2"] for r in after])
    half = np.flatnonzero(x2 >= 0.5)
    # how fast the heaviest atom drifts toward the cone ⟨Bz, z⟩ = 0 late in the run: the
    # least-squares slope of ⟨Bz, z⟩ over the second half (per unit time), where it was recorded
    late = [r for r in rows if r["t"] >= rows[-1]["t"] / 2 and math.isfinite(r.get("q", math.nan))]
    q_rate = float(np.polyfit([r["t"] for r in late], [r["q"] for r in late], 1)[0]) if len(late) > 2 else math.nan
    # the bottom of the W₂ U-curve, W₂(ρ_t, Π#ρ₀) (recorded by run files only)
    w2 = np.array([r.get("w2", math.nan) for r in rows])
    w2_min, t_w2_min = (u_curve_minimum(ds.assign(w2_to_projection=("time", w2))) if np.isfinite(w2).any()
                        else (math.nan, math.nan))
    return {"onset": f_phase_onset(ds), "e_max": e_max, "w2_min": w2_min, "t_w2_min": t_w2_min, "t_max": t_max, "f_max": float(f.max()),
            "t_f_max": after[int(f.argmax())]["t"], "t_x2_half": after[half[0]]["t"] if half.size else math.nan,
            "E_end": rows[-1]["E"], "F_end": rows[-1]["F"], "q_end": rows[-1].get("q", math.nan), "q_rate": q_rate,
            "x2_end": rows[-1]["x2"], "t_end": rows[-1]["t"]}


def _drift(summary):
    """The drift column of hybrid_report: the slope of ⟨Bz, z⟩ late in the run, the time at the cone at
    that rate where there is no F-onset, and |x₂| of the heaviest atom at the end."""
    rate, q, x2 = summary["q_rate"], summary["q_end"], summary["x2_end"]
    if not math.isfinite(rate):
        return "—"
    text = f"{rate:+.4f}/unit"
    if not math.isfinite(summary["onset"]) and rate > 0 and math.isfinite(q) and q < 0:
        text += f", cone at t ≈ {summary['t_end'] - q / rate:.0f}"
    return text + (f"; {x2:.1e}" if math.isfinite(x2) else "")


def _w2_bottom(summary):
    """The W₂ column of hybrid_report: the bottom of the U-curve and its time, "—" where not recorded."""
    if not math.isfinite(summary["w2_min"]):
        return "—"
    return f"{summary['w2_min']:.4f} at {summary['t_w2_min']:g}"


def _ended_early(summary, t_end):
    """" (at t = T)" where a run ends before the report's t_end (run files of a shorter sweep), else ""."""
    return f" (at t = {summary['t_end']:g})" if summary["t_end"] < t_end - 1e-9 else ""


def hybrid_report(out, nsides, beta=30.0, cache=None, say=print, run_missing=True, laws=None, variants=None,
                  t_end=20.0):
    """OUT/hybrid.md: the paper's question at β with the tails in the solver, per mesh and variant
    (HYBRID_VARIANTS): F-onset, max alignment with E, max alignment with F after it and its time, the time
    the heaviest atom reaches |x₂| = ½ (the companion metric), the alignments at t_end, and the
    wall time. Every run is kept as JSON in `cache` (default OUT/hybrid_runs) and reused, so an
    interrupted study continues where it stopped; run_missing=False writes the table of the runs
    already kept and leaves the others out; laws / variants (names in HYBRID_LAWS / HYBRID_VARIANTS,
    default all) limit the runs started, not the rows of runs already kept."""
    out = Path(out)
    cache = Path(cache) if cache is not None else out / "hybrid_runs"
    cache.mkdir(parents=True, exist_ok=True)
    sections = []
    for law_name, (law, _) in HYBRID_LAWS.items():
        if laws is not None and law_name not in laws:
            continue
        lines = []
        for n in nsides:
            for name, options in HYBRID_VARIANTS.items():
                key = hybrid_key(cache, n, beta, name, law_name)
                if key.exists():
                    result = json.loads(key.read_text())
                elif (not run_missing or (variants is not None and name not in variants)
                      or (options or {}).get("from_run")):
                    continue
                else:
                    tails, save_every, solver = hybrid_options(options)
                    result = hybrid_series(n, beta, tails, t_end=t_end, save_every=save_every, say=say, law=law,
                                           **solver)
                    key.write_text(json.dumps(result))
                s = hybrid_summary(result["rows"])
                fmt = lambda x: "none" if not math.isfinite(x) else f"{x:.2f}"  # noqa: E731
                lines.append(f"| {n} | {name} | {fmt(s['onset'])} | {s['e_max']:.4f} at {s['t_max']:g} | "
                             f"{s['f_max']:.3f} at {s['t_f_max']:g} | {fmt(s['t_x2_half'])} | "
                             f"{s['E_end']:.3f} / {s['F_end']:.3f}{_ended_early(s, t_end)} | "
                             f"{fmt(s['q_end']).replace('none', '—')} | "
                             f"{_drift(s)} | {_w2_bottom(s)} | "
                             f"{'—' if not math.isfinite(result['wall']) else format(result['wall'], '.0f')} |")
        sections.append(
            f"## {law_name[0].upper() + law_name[1:]} ({law!r})\n\n"
            "| nside | state | F-onset | max alignment with E | then max alignment with F | t at \\|x₂\\| = ½ | "
            f"E / F at t = {t_end:g} | ⟨Bz, z⟩ then | its drift; \\|x₂\\| then | min W₂(ρ_t, Π#ρ₀) | wall (s) |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|\n"
            + "\n".join(lines) + "\n")
    path = out / ("hybrid.md" if beta == 30.0 else f"hybrid_beta{beta:g}.md")
    path.write_text(
        f"# The paper's question at β = {beta:g} with the tails in the solver\n\n"
        f"`python -m spherepde.validation.tails --hybrid --nside {' '.join(map(str, nsides))}"
        f"{'' if beta == 30.0 else f' --beta {beta:g} --t-end {t_end:g}'}` "
        f"({time.strftime('%Y-%m-%d')}; runs kept in `{cache.name}/` and reused). The paper's matrices, the "
        "projected-normal and von Mises–Fisher laws of `solvers/paper_beta.toml`, velocity_tolerance 1e-3, atoms, saves every 0.1 unless said, "
        f"t ≤ {t_end:g}. Variants: the finite volumes alone; `[eulerian] tails = \"log\"` (spherepde.solvers.tails: g "
        "never reset outside the atoms' neighbourhoods, unlimited interpolant, a cell is in the tail when "
        "min(f, ⟨e^g⟩) is below 10⁻³ of the mesh's largest f, between couplings the tail cells follow the rate "
        "of g over the last interval along the characteristics; g interpolated at every coupling, its paths in one "
        "RK4 step per coupling, unless the variant says \"g interpolated every 1.0\": then only at anchors 1.0 "
        "apart, the couplings in between following their paths back to the last anchor in RK4 steps of 0.1, "
        "the solver's default `tail_anchor = 1.0`, `tail_path_step = 0.1`; \"composed maps\": each of those couplings "
        "traces its own interval only and composes it with the last coupling's departure points and divergence "
        "integral, interpolated, `tail_paths = \"maps\"`) with couplings every 0.2 (the default, "
        "as far apart as that allows whatever the saves), every 0.2 and 0.4 with saves as far apart (F-onset and the "
        "time at |x₂| = ½ then resolved to the save interval; also with the level relative to the largest of "
        "the mesh's f and every atom's mass per cell area, `reference = \"measure\"`; and with g's paths in 4 RK4 steps "
        "through the states after every step, g still interpolated once, `substeps = 4`; with the atoms' "
        "neighbourhoods left to the finite volumes 1.5 or 6 cells wide instead of 3, `tail_exclusion`; with the "
        "velocity extrapolated at 1e-4 instead of 1e-3; with f constant in the near cells of the sums at the atoms, "
        "`near_field_profile = \"constant\"`, where the default log-linear profile acts, β = 1000 at nside ≤ 32; "
        "with a new atom's patch keeping the e^{linear} fit of its outer ring, \"tail cut\" (`atom_cut = \"tail\"`), "
        "and/or new atoms made of four points with their cluster's centre and covariance, \"sigma atoms\" "
        "(`atom_shape = \"sigma\"`)), "
        "and every 0.1, 0.05, 0.025; with couplings "
        "every 0.1, the tail cells left to the finite volumes between couplings (`tail_follow = false`), and "
        "the prototype's coupling (g reset to log f in the bulk, limited interpolant, the tail from f alone, "
        "not followed); \"spherepde run\": from a run file of `solvers/sweeps/tails_convergence.toml` "
        "(`tails_anchored.toml` with anchors, `tails_maps.toml` with the composed maps, `tails_sigma.toml` with "
        "the composed maps, sigma atoms and the tail cut; resumable; its wall time "
        "is the last segment's). "
        "x₂: of the heaviest atom z (F = span e₂); ⟨Bz, z⟩ = −z₁² − z₂² + z₃²: −1 on E, 0 on the cone where an "
        "equal antipodal pair is at rest, through the diagonal x₁ = ±x₃ on the way to F (docs/theory.md; — in "
        "runs kept before it was recorded). Its drift: the least-squares slope of ⟨Bz, z⟩ over the second half of "
        "the run (per unit time), and without an F-onset the time the heaviest atom would reach the cone at that "
        "rate, t_end − ⟨Bz, z⟩/slope; |x₂| then: the seed of the F-phase, which grows only once the cone is "
        "passed. min W₂(ρ_t, Π#ρ₀): the bottom of the U-curve of the mesh + atoms measure and its time, from "
        "a run file's own diagnostic (— for the runs made here); E / F of a run file that ends before "
        f"t = {t_end:g} (`tails_maps.toml` ends at 14) are at its last time, which the cell says.\n\n"
        + "\n".join(sections))
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nside", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--schemes", nargs="+", default=list(STATES), choices=list(STATES))
    parser.add_argument("--out", default=str(REPO / "validation" / "reports" / "tails"))
    parser.add_argument("--hybrid", action="store_true",
                        help="instead: the paper's question at beta = 30 with the tails in the solver (hybrid.md)")
    parser.add_argument("--cached", action="store_true",
                        help="with --hybrid: the table of the runs already kept, without running the others")
    parser.add_argument("--laws", nargs="+", choices=list(HYBRID_LAWS),
                        help="with --hybrid: run only these initial laws (default all)")
    parser.add_argument("--variants", nargs="+", choices=list(HYBRID_VARIANTS),
                        help="with --hybrid: run only these variants (default all; kept runs are always shown)")
    parser.add_argument("--beta", type=float, default=30.0, help="with --hybrid: β (default 30; another β "
                        "writes hybrid_beta{β}.md)")
    parser.add_argument("--t-end", type=float, default=20.0, help="with --hybrid: the end time (default 20)")
    parser.add_argument("--runs", help="with --hybrid: first keep the complete run files of this folder "
                        "(solvers/sweeps/tails_convergence.toml) as cached runs")
    parser.add_argument("--partial", action="store_true",
                        help="with --runs: unfinished run files too, as far as they got (replaced when complete)")
    parser.add_argument("--coupling", action="store_true",
                        help="instead: the F-onset at beta = 30 of the coupled tails and the log-density state (coupling.md)")
    args = parser.parse_args()
    if args.hybrid:
        if args.runs:
            cache = Path(args.out) / "hybrid_runs"
            cache.mkdir(parents=True, exist_ok=True)
            for path in import_runs(args.runs, cache, partial=args.partial):
                print(f"kept {path}")
        print(hybrid_report(args.out, args.nside, beta=args.beta, run_missing=not args.cached, laws=args.laws,
                           variants=args.variants, t_end=args.t_end))
    elif args.coupling:
        print(coupling_report(args.out, args.nside))
    else:
        print(run_suite(args.out, nsides=args.nside, schemes=args.schemes))
