"""The Eulerian solver with atoms against the mean-field references (`spherepde validate atoms`).

Three sweeps (solvers/sweeps/atoms_*.toml, base solvers/atoms_base.toml: the paper's matrices,
the Eulerian solver with atoms and the quadrature particles of the same mesh in lockstep):

- atoms_convergence: projected-normal and vMF laws at β = 10, 30, nside 16 / 32 (/ 64 with
  slow), t ≤ 20. Per solver and mesh: the F-onset, the max alignment with E and the minimum of
  W₂(ρ_t, Π#ρ₀) (spherepde.validation.paper's metrics), with the differences between meshes and their
  observed orders; W₂(Eulerian + atoms, particles) over t ≤ 3 log β;
- atoms_zero_temperature: β = ∞ from the uniform law, t ≤ 8: W₂ of both solvers to the exact
  push-forward of ρ₀ at t = 1, 2, 4, 8, and W₂(Eulerian + atoms, particles) (t ≤ 8);
- atoms_symmetric: the uniform law (no F-phase) and its perturbations of size ε along e₃: the
  departure time from E against log(1/ε), whose slope is 1/rate, against the rate of the
  linearised two-atom system at ±e₁.

and one measurement of cost: the same run with and without atoms, in this process, as a ratio.

W₂ between two general measures (thousands of cells against thousands of particles) is computed
by `w2_coarsened`: each measure is moved to the barycentres of an adaptive HEALPix partition
(refined where its mass is, at most `max_bins` bins), exact OT between the two coarse measures
(POT), and the coarsening error bounded by the triangle inequality,
|W₂(μ, ν) − W₂(μ̃, ν̃)| ≤ W₂(μ, μ̃) + W₂(ν, ν̃) ≤ √c_μ + √c_ν, with c_μ = Σ_bins Σ_i w_i|x_i − x̄_b|²
(computed exactly, not estimated). Every such W₂ in the report carries that bound.

Complete run files in the output folders are reused (same config: nothing is recomputed).
"""

from __future__ import annotations

import contextlib
import heapq
import math
import time
from pathlib import Path

import numpy as np

from ..analysis.metrics import f_phase_onset, series, zero_temperature_push
from ..runner.sweep import local_cluster
from .common import REPO, beta_text
from .convergence import (
    METRICS,
    by_law_and_beta as _by,
    convergence_cells as _convergence_rows,
    number_text as _f,
    order_text as _order_text,
)
from .paper import collect, derive_sweep, run_sweep_files

__all__ = ["w2_coarsened", "coarsen", "departure_time", "two_atom_rate", "run_suite",
           "CONVERGENCE", "ZERO_TEMPERATURE", "SYMMETRIC"]

SWEEPS = REPO / "solvers" / "sweeps"
CONVERGENCE = SWEEPS / "atoms_convergence.toml"
ZERO_TEMPERATURE = SWEEPS / "atoms_zero_temperature.toml"
SYMMETRIC = SWEEPS / "atoms_symmetric.toml"
NSIDES, SLOW_NSIDES = (16, 32), (16, 32, 64)
# nside 64 runs β = 10 only: at β = 30 the nside-32 run already takes ~20 min (one thread), and
# nside 64 costs ~8× that
FINE_BETAS = {64: [10.0]}
SYMMETRIC_NSIDES = (16, 32)
QUICK = {"time.t_end": 4.0, "particles.dt": 0.1}  # with nside 8 unless given
EXACT_TIMES = (1.0, 2.0, 4.0, 8.0)
MAX_LEVEL = 13  # finest HEALPix level of the coarsening (nside 8192, cells ≈ 1.3e-4 rad)



# ====================================================================== W₂ between general measures
def coarsen(points, weights, max_bins=2000, max_level=MAX_LEVEL):
    """Move a discrete measure Σ w_i δ_{x_i} to the barycentres of an adaptive nested HEALPix
    partition: starting from the 12 base pixels, the bin with the largest c_b = Σ_{i∈b} w_i|x_i − x̄_b|²
    is split into its 4 children until max_bins bins (or max_level) are reached.
    Returns (barycentres (K, 3), masses (K,), c = Σ_b c_b): W₂(μ, μ̃)² ≤ c exactly (the map
    x_i ↦ x̄_b is a transport plan)."""
    import healpy as hp

    x = np.asarray(points, dtype=float)
    w = np.asarray(weights, dtype=float)
    keep = w > 0
    x, w = x[keep], w[keep]
    fine = hp.vec2pix(2**max_level, x[:, 0], x[:, 1], x[:, 2], nest=True).astype(np.int64)
    order = np.argsort(fine, kind="stable")
    fine, x, w = fine[order], x[order], w[order]
    # prefix sums: a bin is a contiguous run of sorted fine pixels
    zero = np.zeros(1)
    cw = np.concatenate([zero, np.cumsum(w)])
    cwx = np.concatenate([np.zeros((1, 3)), np.cumsum(w[:, None] * x, axis=0)])
    cwxx = np.concatenate([zero, np.cumsum(w * np.einsum("ij,ij->i", x, x))])

    def stats(level, pixel):
        span = 4 ** (max_level - level)
        lo, hi = np.searchsorted(fine, [pixel * span, (pixel + 1) * span])
        mass = cw[hi] - cw[lo]
        if mass <= 0:
            return None
        first = cwx[hi] - cwx[lo]
        cost = max(cwxx[hi] - cwxx[lo] - float(first @ first) / mass, 0.0)
        return cost, mass, first / mass

    heap, done = [], []
    for pixel in range(12):
        s = stats(0, pixel)
        if s is not None:
            heapq.heappush(heap, (-s[0], 0, pixel, s))
    while heap and len(heap) + len(done) + 3 <= max_bins:
        negcost, level, pixel, s = heapq.heappop(heap)
        if level == max_level or negcost == 0.0:
            done.append(s)
            continue
        for child in range(4 * pixel, 4 * pixel + 4):
            c = stats(level + 1, child)
            if c is not None:
                heapq.heappush(heap, (-c[0], level + 1, child, c))
    bins = done + [item[3] for item in heap]
    cost = float(sum(b[0] for b in bins))
    return np.array([b[2] for b in bins]), np.array([b[1] for b in bins]), cost


def w2_coarsened(xa, wa, xb, wb, max_bins=2000):
    """(W₂ of the coarsened measures, bound on its error): chordal W₂ between the normalised
    measures Σ wa δ_xa and Σ wb δ_xb, by exact OT (POT) between their coarsenings (`coarsen`);
    |W₂ − value| ≤ bound = √c_a + √c_b."""
    import ot

    wa = np.asarray(wa, dtype=float) / np.sum(wa)
    wb = np.asarray(wb, dtype=float) / np.sum(wb)
    ya, ma, ca = coarsen(xa, wa, max_bins)
    yb, mb, cb = coarsen(xb, wb, max_bins)
    cost = np.sum(ya * ya, 1)[:, None] + np.sum(yb * yb, 1)[None, :] - 2.0 * ya @ yb.T
    np.maximum(cost, 0.0, out=cost)
    value = float(ot.emd2(ma / ma.sum(), mb / mb.sum(), cost, numItermax=50_000_000))
    return math.sqrt(max(value, 0.0)), math.sqrt(ca) + math.sqrt(cb)


# ====================================================================== measures of a run file
class RunMeasures:
    """The measures of one run file at its save times: the Eulerian solution (cell quadrature of
    the density plus the atoms) and the particles."""

    def __init__(self, ds):
        from ..geometry.mesh import HealpixMesh

        self.ds = ds
        self.nside = int(ds.attrs["nside"])
        self.mesh = mesh = HealpixMesh(self.nside)
        pts, qw = mesh.cell_quadrature(2)
        self._points, self._qw = pts.reshape(-1, 3), qw * mesh.area
        self.times = np.asarray(ds["time"].values, dtype=float)

    def index(self, t):
        k = int(np.argmin(np.abs(self.times - t)))
        if abs(self.times[k] - t) > 1e-9:
            raise ValueError(f"no snapshot at t = {t:g} in the run (nside {self.nside})")
        return k

    def eulerian(self, t):
        k = self.index(t)
        f = np.asarray(self.ds["density"].values[k], dtype=float)
        x, w = self._points, (f[:, None] * self._qw[None, :]).ravel()
        if "atom_mass" in self.ds:
            m = np.asarray(self.ds["atom_mass"].values[k], dtype=float)
            alive = m > 0
            xa = np.asarray(self.ds["atom_position"].values[k], dtype=float)[alive]
            x, w = np.concatenate([x, xa]), np.concatenate([w, m[alive]])
        return x, w

    def particles(self, t):
        k = self.index(t)
        return (np.asarray(self.ds["positions"].values[k], dtype=float),
                np.asarray(self.ds["particle_weights"].values, dtype=float))


def graded_quadrature(axis, n_s=200, n_phi=256, s_min=1e-14):
    """(points (K, 3), weights (K,)) of a quadrature of the area measure of S² in the coordinates
    s = x·axis ∈ [−1, 1] and the azimuth φ about the axis, where dA = ds dφ exactly (Archimedes).
    In |s| the nodes are 2-point Gauss–Legendre on n_s intervals graded geometrically from s_min to 1
    (plus [0, s_min]); in φ the periodic midpoint rule with n_phi nodes. The weights sum to 4π.

    Why graded: at β = ∞ the mass that is still far from the attracting atoms ±u₁ at time t comes
    from the band |x·u₁| ≲ e^{−gap·t} around the repelling great circle x·u₁ = 0; the band is
    1e-7 wide at t = 8 for the paper matrices, 10⁵ times narrower than a HEALPix-128 cell, and
    its image (mass ≈ 1e-7/r beyond angle r) sets W₂ ≈ 4e-4 there."""
    axis = np.asarray(axis, dtype=float) / np.linalg.norm(axis)
    edges = np.concatenate([[0.0], np.geomspace(s_min, 1.0, n_s)])
    lo, hi = edges[:-1], edges[1:]
    gauss = np.array([-1.0, 1.0]) / math.sqrt(3.0)
    s = ((lo + hi) / 2)[:, None] + ((hi - lo) / 2)[:, None] * gauss[None, :]
    ws = np.repeat(((hi - lo) / 2)[:, None], 2, axis=1)
    s, ws = np.concatenate([s.ravel(), -s.ravel()]), np.concatenate([ws.ravel(), ws.ravel()])
    phi = (np.arange(n_phi) + 0.5) * (2 * math.pi / n_phi)
    # an orthonormal frame (axis, a, b)
    a = np.cross(axis, [1.0, 0.0, 0.0] if abs(axis[0]) < 0.9 else [0.0, 1.0, 0.0])
    a /= np.linalg.norm(a)
    b = np.cross(axis, a)
    r = np.sqrt(np.maximum(1.0 - s * s, 0.0))
    x = (s[:, None, None] * axis + r[:, None, None] * (np.cos(phi)[None, :, None] * a
                                                        + np.sin(phi)[None, :, None] * b))
    w = np.repeat(ws[:, None], n_phi, axis=1) * (2 * math.pi / n_phi)
    return x.reshape(-1, 3), w.ravel()


def exact_zero_temperature(model, law, t, n_s=200, n_phi=256):
    """The exact β = ∞ measure at t (B orthogonal): ρ₀ = law on the graded quadrature about the
    principal eigenvector u₁ of M (graded_quadrature; weights ρ₀(x) dA) pushed by
    x ↦ e^{tM}x/|e^{tM}x|. Its own error: the same with n_s, n_phi halved."""
    axis = np.asarray(model.E.basis)[:, 0]
    x0, area = graded_quadrature(axis, n_s, n_phi)
    return zero_temperature_push(model, x0, t), area * law.density(x0)


# ====================================================================== the symmetric case
def departure_time(ds, level=0.9, prefix=""):
    """First time after the maximum of the alignment with E at which it falls below `level`
    (linear between save times); NaN if it does not by the end of the run."""

    t, e = series(ds, "alignment_E", prefix)
    k0 = int(np.nanargmax(e))
    for k in range(k0 + 1, t.size):
        if e[k] < level:
            return float(t[k - 1] + (t[k] - t[k - 1]) * (e[k - 1] - level) / (e[k - 1] - e[k]))
    return math.nan


def two_atom_rate(model, h=1e-6):
    """Growth rate of an offset along e₃ of the antipodal pair ½δ_z + ½δ_{−z} at z = e₁: the
    e₃-component of the Jacobian of the pair's velocity, by central differences of the library's
    attention field with the two atoms as sources (closed form: tanh(β)(V₁₁ − V₃₃), docs/theory.md#the-equation-and-its-conventions
    field of two antipodal atoms)."""
    from spherepde.summation import attention_field

    def v3(delta):
        z = np.array([1.0, 0.0, delta])
        z /= np.linalg.norm(z)
        sources = np.array([z, -z])
        v, _, _ = attention_field(model, sources, np.array([0.5, 0.5]), z[None, :], method="direct")
        return float(v[0, 2])

    return (v3(h) - v3(-h)) / (2.0 * h)


def _sweeps(runs, nsides, quick, t_end=None):
    """(label, derived sweep path) of the runs the suite needs, in the order they run: the
    convergence sweep per mesh, β = ∞ per mesh (also nside 64 unless quick: it is cheap), the
    symmetric case on the coarsest mesh of the default (or the quick mesh)."""
    over = dict(QUICK) if quick else {}
    if t_end is not None:
        over["time.t_end"] = float(t_end)
    tag = "quick" if quick else "full"
    out = []
    for n in nsides:
        grid = {"eulerian.nside": [n]}
        if n in FINE_BETAS and not quick:
            grid["model.beta"] = FINE_BETAS[n]
        out.append((f"atoms_convergence nside {n}",
                    derive_sweep(CONVERGENCE, runs / f"atoms_convergence_{tag}_n{n}", over, grid,
                                 name=f"atoms_convergence_n{n}")))
    zt_nsides = nsides if quick else tuple(sorted(set(nsides) | {64}))
    for n in zt_nsides:
        out.append((f"atoms_zero_temperature nside {n}",
                    derive_sweep(ZERO_TEMPERATURE, runs / f"atoms_zero_temperature_{tag}_n{n}", over,
                                 {"eulerian.nside": [n]}, name=f"atoms_zero_temperature_n{n}")))
    for n in (nsides[:1] if quick else SYMMETRIC_NSIDES):
        out.append((f"atoms_symmetric nside {n}",
                    derive_sweep(SYMMETRIC, runs / f"atoms_symmetric_{tag}_n{n}", over, {"eulerian.nside": [n]},
                                 name=f"atoms_symmetric_n{n}")))
    return out


def run_sweeps(runs, nsides=NSIDES, quick=False, workers=2, say=print):
    """Run (or reuse) every sweep of the suite; returns {label: (specs, failures)}."""
    done = {}
    with local_cluster(workers) as address:
        for label, path in _sweeps(Path(runs), tuple(nsides), quick):
            t0 = time.perf_counter()
            specs, _, failures = run_sweep_files(path, path.parent, workers=workers, say=say, scheduler=address)
            say(f"  {label}: {len(specs)} runs, {len(failures)} failed ({time.perf_counter() - t0:.0f} s)")
            done[label] = (path, specs, failures)
    return done



# ====================================================================== report pieces
def convergence_table(cases):
    """Per case and metric: particles and Eulerian + atoms over the meshes, with orders, and the
    Eulerian's distance to the particles' value on the finest mesh."""
    lines = ["| law | β | quantity | particles (nside " + " / ".join(map(str, sorted({c.nside for c in cases})))
             + ") | differences | order | Eulerian + atoms | differences | order | Eulerian − particles, finest |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (law, beta), runs in sorted(_by(cases).items()):
        for name, pick in METRICS:
            part = {n: pick(c.metrics["particles"]) for n, c in runs.items()}
            eul = {n: pick(c.metrics["eulerian"]) for n, c in runs.items()}
            finest = max(runs)
            gap = eul[finest] - part[finest]
            rel = f" ({100 * gap / part[finest]:+.2f} %)" if name == "F-onset" and np.isfinite(gap) else ""
            lines.append(f"| {law} | {beta_text(beta)} | {name} | " + " | ".join(_convergence_rows(part)) + " | "
                         + " | ".join(_convergence_rows(eul)) + f" | {gap:+.4f}{rel} |")
    return lines


def onset_target_table(cases, nside=32, target=0.02):
    """The issue's target: the Eulerian F-onset at `nside` within `target` of the particles' value
    on their finest mesh."""
    lines = [f"| law | β | Eulerian + atoms, nside {nside} | particles, finest (nside) | relative gap | "
             f"within {100 * target:g} % |", "|---|---|---|---|---|---|"]
    for (law, beta), runs in sorted(_by(cases).items()):
        if nside not in runs:
            continue
        finest = max(runs)
        e = runs[nside].metrics["eulerian"]["onset"]
        p = runs[finest].metrics["particles"]["onset"]
        gap = (e - p) / p
        ok = "yes" if np.isfinite(gap) and abs(gap) <= target else "no"
        lines.append(f"| {law} | {beta_text(beta)} | {_f(e, 3)} | {_f(p, 3)} ({finest}) | {100 * gap:+.2f} % | {ok} |")
    return lines


def _split(x, w):
    """Fraction of the mass with x₁ > 0 (the side of e₁)."""
    w = np.asarray(w) / np.sum(w)
    return float(w[np.asarray(x)[:, 0] > 0].sum())


def split_table(cases, times=(0.0, 1.0, 2.0)):
    """Mass on the side x₁ > 0 over time, both solvers (projected-normal, each β)."""
    lines = ["| law | β | nside | " + " | ".join(f"t = {t:g}: Eulerian / particles" for t in times) + " |",
             "|---|---|---|" + "---|" * len(times)]
    for (law, beta), runs in sorted(_by(cases).items()):
        for n, c in sorted(runs.items()):
            rm = RunMeasures(c.ds)
            cells = [f"{_split(*rm.eulerian(t)):.5f} / {_split(*rm.particles(t)):.5f}"
                     if t <= rm.times[-1] + 1e-9 else "—" for t in times]
            lines.append(f"| {law} | {beta_text(beta)} | {n} | " + " | ".join(cells) + " |")
    return lines


def background_share(rm, t, model):
    """At the heaviest atom z at time t: (share of the softmax weight Σ μ e^{β⟨Bᵀz, y⟩} that comes
    from the mesh, mesh mass, angle from Bᵀz/|Bᵀz| to the nearest particle). The weights are taken
    relative to e^{β|Bᵀz|} (their largest possible exponent), so nothing overflows."""
    ds = rm.ds
    k = rm.index(t)
    m = np.asarray(ds["atom_mass"].values[k])
    alive = m > 0
    if not alive.any():
        return math.nan, math.nan, math.nan
    x = np.asarray(ds["atom_position"].values[k])[alive]
    z = x[int(np.argmax(m[alive]))]
    a = model.B.T @ z
    top = float(np.linalg.norm(a))
    mesh = rm.mesh
    f = np.asarray(ds["density"].values[k])
    mesh_weight = float(np.sum(f * mesh.area * np.exp(model.beta * (mesh.centroids @ a - top))))
    atom_weight = float(np.sum(m[alive] * np.exp(model.beta * (x @ a - top))))
    angle = math.nan
    if "positions" in ds:
        xp = np.asarray(ds["positions"].values[k])
        angle = float(np.arccos(np.clip(np.max(xp @ (a / top)), -1.0, 1.0)))
    return mesh_weight / (mesh_weight + atom_weight), float(mesh.integrate(f)), angle


def background_table(cases, times=(4.0, 8.0, 10.0, 11.0, 12.0, 13.0)):
    """background_share on the finest mesh of each case."""
    lines = ["| law | β | nside | " + " | ".join(f"t = {t:g}" for t in times) + " |",
             "|---|---|---|" + "---|" * len(times)]
    for (law, beta), runs in sorted(_by(cases).items()):
        n = max(runs)
        c = runs[n]
        rm = RunMeasures(c.ds)
        cells = []
        for t in times:
            share, mass, angle = background_share(rm, t, c.model) if t <= c.t_end else (math.nan,) * 3
            cells.append("—" if not np.isfinite(share) else f"{share:.2g} ({mass:.1e}; {angle:.2f})")
        lines.append(f"| {law} | {beta_text(beta)} | {n} | " + " | ".join(cells) + " |")
    return lines


def _w2_times(beta):
    t_max = 8.0 if math.isinf(beta) else math.floor(30 * math.log(beta)) / 10
    return [t for t in (1.0, 2.0, 4.0, 8.0) if t < t_max - 1e-9] + [t_max]


def w2_table(cases, max_bins=2000, say=print):
    """W₂(Eulerian + atoms, particles) ± the coarsening bound at t ≤ 3 log β, per mesh, with the
    observed order (when three meshes) at each time. Returns (lines, {(law, β): {nside: [w2]}})."""
    all_n = sorted({c.nside for c in cases})
    lines = ["| law | β | t | " + " | ".join(f"nside {n}" for n in all_n) + " | order |",
             "|---|---|---|" + "---|" * (len(all_n) + 1)]
    values = {}
    for (law, beta), runs in sorted(_by(cases).items()):
        measures = {n: RunMeasures(c.ds) for n, c in runs.items()}
        for t in _w2_times(beta):
            row = {}
            for n, rm in sorted(measures.items()):
                if t > rm.times[-1] + 1e-9:
                    continue
                row[n] = w2_coarsened(*rm.eulerian(t), *rm.particles(t), max_bins=max_bins)
            if not row:
                continue
            values.setdefault((law, beta), {})[t] = row
            ws = [row[n][0] for n in sorted(row)]
            lines.append(f"| {law} | {beta_text(beta)} | {t:g} | "
                         + " | ".join(f"{row[n][0]:.4f} ± {row[n][1]:.4f}" if n in row else "not run"
                                      for n in all_n)
                         + f" | {_order_text(ws)} |")
        say(f"  W₂(Eulerian, particles): {law}, β = {beta_text(beta)} done")
    return lines, values


def exact_table(cases, max_bins=4000):
    """β = ∞: W₂ of the Eulerian + atoms and of the particles to the exact push-forward of ρ₀ at
    EXACT_TIMES, per mesh, with orders; and the reference's own error, W₂ between the graded
    reference (exact_zero_temperature) and the same with half the nodes in s and φ. 4000 bins:
    at t ≤ 2 the measures are still diffuse and the coarsening bound is the largest error."""
    ns = sorted({c.nside for c in cases})
    lines = ["| t | " + " | ".join(f"Eulerian + atoms, nside {n}" for n in ns) + " | order | "
             + " | ".join(f"particles, nside {n}" for n in ns) + " | order | reference: W₂(graded "
             "200 × 256, 100 × 128) |", "|---|" + "---|" * (2 * len(ns) + 3)]
    if not cases:
        return lines
    c0 = cases[0]
    measures = {c.nside: RunMeasures(c.ds) for c in cases}
    for t in EXACT_TIMES:
        if t > min(rm.times[-1] for rm in measures.values()) + 1e-9:
            continue
        ref = exact_zero_temperature(c0.model, c0.initial_law, t)
        coarse_ref = exact_zero_temperature(c0.model, c0.initial_law, t, n_s=100, n_phi=128)
        cells = []
        for which in ("eulerian", "particles"):
            ws = []
            for n in ns:
                rm = measures[n]
                ws.append(w2_coarsened(*getattr(rm, which)(t), *ref, max_bins=max_bins))
            cells += [f"{w:.3g} ± {b:.2g}" for w, b in ws] + [_order_text([w for w, _ in ws])]
        r = w2_coarsened(*ref, *coarse_ref, max_bins=max_bins)
        lines.append(f"| {t:g} | " + " | ".join(cells) + f" | {r[0]:.2g} ± {r[1]:.2g} |")
    return lines


def invariant_circle_lines(cases):
    """β = ∞: the particles that start on the invariant great circle x₁ = 0 (HEALPix puts cell
    centres on it) never leave it and end at ±e₂, where the exact measure has no mass; their
    mass m costs W₂ = √(2m) (|e₂ − e₁|² = 2) once everything else has reached ±e₁."""
    lines = []
    for c in sorted(cases, key=lambda c: c.nside):
        ds = c.ds
        x0 = np.asarray(ds["positions"].values[0])
        w = np.asarray(ds["particle_weights"].values)
        w = w / w.sum()
        on = np.abs(x0[:, 0]) < 1e-12
        lines.append(f"- nside {c.nside}: {int(on.sum())} particles start on x₁ = 0 (to round-off), mass "
                     f"{w[on].sum():.4f}, √(2m) = {math.sqrt(2 * w[on].sum()):.4f}")
    return lines


def symmetric_lines(cases, level=0.9):
    """Departure time from E against log(1/ε) per mesh, both solvers: the rate between successive
    ε, log 10/Δt_dep, and the least-squares rate over all ε; the two-atom rate; the unperturbed
    uniform law's symmetry. Returns (lines, {(who, nside): fitted rate}, two-atom rate)."""
    nsides = sorted({c.nside for c in cases})
    table, fits = {}, {}
    uniform = {}
    for c in cases:
        if c.law == "uniform":
            uniform[c.nside] = c
            continue
        eps = float(c.law.split("_")[1])
        table.setdefault(eps, {})[c.nside] = (departure_time(c.ds, level), departure_time(c.ds, level, "particle_"))
    epsilons = sorted(table, reverse=True)
    head = " | ".join(f"Eulerian + atoms, nside {n} | particles, nside {n}" for n in nsides)
    lines = [f"| ε | {head} |", "|---|" + "---|" * (2 * len(nsides))]
    for eps in epsilons:
        cells = []
        for n in nsides:
            te, tp = table[eps].get(n, (math.nan, math.nan))
            cells += [_f(te, 2), _f(tp, 2)]
        lines.append(f"| {eps:g} | " + " | ".join(cells) + " |")
    for i in range(len(epsilons) - 1):
        e0, e1 = epsilons[i], epsilons[i + 1]
        cells = []
        for n in nsides:
            for j in (0, 1):
                a, b = table[e0].get(n, (math.nan,) * 2)[j], table[e1].get(n, (math.nan,) * 2)[j]
                cells.append(_f(math.log(e0 / e1) / (b - a), 3) if np.isfinite(a) and np.isfinite(b) and b > a
                             else "—")
        lines.append(f"| rate, {e0:g} → {e1:g} | " + " | ".join(cells) + " |")
    cells = []
    for n in nsides:
        for j, who in ((0, "eulerian"), (1, "particles")):
            pts = [(math.log(1 / eps), table[eps][n][j]) for eps in epsilons
                   if n in table[eps] and np.isfinite(table[eps][n][j])]
            rate = math.nan
            if len(pts) >= 2:
                a = np.array(pts)
                rate = 1.0 / float(np.polyfit(a[:, 0], a[:, 1], 1)[0])
            fits[(who, n)] = rate
            cells.append(_f(rate, 3))
    lines.append("| rate, least squares over all ε | " + " | ".join(cells) + " |")
    model = cases[0].model if cases else None
    rate = two_atom_rate(model) if model is not None and not model.zero_temperature else math.nan
    text = ["", f"- two-atom linearisation at ±e₁ (library field, central differences): rate = {rate:.6f} "
                f"(closed form tanh β·(V₁₁ − V₃₃))"]
    for n, c in sorted(uniform.items()):
        ds = c.ds
        late = ds["time"].values >= 0.5 * float(ds.time[-1])

        def late_max(name):
            return float(np.nanmax(ds[name].values[late]))

        text.append(f"- uniform law (ε = 0), nside {n}, t ≥ {0.5 * float(ds.time[-1]):g}: max alignment with F "
                    f"{late_max('alignment_F'):.2e} (Eulerian + atoms), {late_max('particle_alignment_F'):.2e} "
                    f"(particles); min alignment with E {float(np.nanmin(ds['alignment_E'].values[late])):.5f} / "
                    f"{float(np.nanmin(ds['particle_alignment_E'].values[late])):.5f}; F-onset "
                    f"{_f(f_phase_onset(ds), 2)} / {_f(f_phase_onset(ds, 'particle_'), 2)}")
        if "atom_position" in ds:
            x = np.asarray(ds["atom_position"].values[-1])
            m = np.asarray(ds["atom_mass"].values[-1])
            alive = m > 0
            text.append(f"  atoms at t = {float(ds.time[-1]):g}: "
                        + "; ".join(f"m = {mm:.6f} at ({', '.join(f'{v:+.2e}' for v in xx)})"
                                    for xx, mm in zip(x[alive], m[alive])))
    return lines + text, fits, rate


def cost_lines(nside=16, t_end=12.0, split=6.0, repeats=3, say=print):
    """The same run (projected-normal, β = 10, atoms_base) with and without atoms, alternating
    `repeats` times in this process: the fastest wall time of each (the usual benchmark statistic:
    other load only ever adds time; one pair measured 1.02, 1.20 and 1.30 idle), counts of time
    steps (before and after t = split) and of exact edge-velocity evaluations, and the wall time per
    step. Returns (lines, wall ratio).

    Why the steps are split at t = 6: up to there both runs have their clusters near ±e₁. After
    it the clusters with atoms leave E (the F-phase, onset ≈ 10.3 at β = 10), while the density-only
    run at nside 16 keeps them pinned to their cells (it has no F-phase there, docs/atoms.md); the
    moving pair steepens the field at the softmax boundary between the clusters, and the outflow
    Courant bound shortens the step. Those steps are the physics the density-only run misses; the
    price of the atoms themselves is the cost per step."""
    from spherepde.transport.stepping import SSPStepper

    from ..runner import config as C
    from ..runner.run import execute
    from ..solvers.eulerian import EulerianSolver

    counts, step_times = {}, []
    # an exact evaluation: of the whole fluxes, or of the mesh part of split sums (with atoms)
    originals = {name: getattr(EulerianSolver, name) for name in ("edge_flux", "_mesh_part")}
    original_step = SSPStepper.step

    def counter(original):
        def counted(self, *args, **kwargs):
            counts["edge"] = counts.get("edge", 0) + 1
            return original(self, *args, **kwargs)
        return counted

    def timed_step(self, f, t, dt_max):
        step_times.append(t)
        if t >= split and "split" not in counts:
            counts["split"] = time.perf_counter()  # the wall clock when the run reaches t = split
        return original_step(self, f, t, dt_max)

    rows = {}
    import tempfile

    base = C.load(REPO / "solvers" / "atoms_base.toml")

    def config(atoms, t_stop, *extra):
        over = [f"eulerian.nside={nside}", f"time.t_end={t_stop}", f"eulerian.atoms={str(atoms).lower()}", *extra]
        cfg = C.resolve(C.apply_overrides(base, over))
        cfg["particles"] = None
        return cfg

    for name, original in originals.items():
        setattr(EulerianSolver, name, counter(original))
    SSPStepper.step = timed_step
    try:
        with tempfile.TemporaryDirectory() as tmp:
            # a short run of each first, so that neither timed run pays numba's loading and compiling
            for atoms in (False, True):
                execute(config(atoms, 0.2, "time.save_every=0.1"), str(Path(tmp) / f"warm_{atoms}.nc"),
                        progress=False, log=None)
            walls, early_walls = {False: [], True: []}, {False: [], True: []}
            for _ in range(repeats):
                for atoms in (False, True):
                    cfg = config(atoms, t_end)
                    counts.clear()
                    step_times.clear()
                    t0 = time.perf_counter()
                    summary = execute(cfg, str(Path(tmp) / f"cost_{atoms}.nc"), progress=False, log=None)
                    walls[atoms].append(time.perf_counter() - t0)
                    early_walls[atoms].append(counts.get("split", math.nan) - t0)
                    # step calls include rejected tries; the summary counts accepted steps
                    early = sum(1 for t in step_times if t < split)
                    rows[atoms] = (min(walls[atoms]), summary["steps"], counts.get("edge", 0), early,
                                   len(step_times) - early, min(early_walls[atoms]))
                    say(f"  cost: atoms = {atoms}: {walls[atoms][-1]:.1f} s")
    finally:
        for name, original in originals.items():
            setattr(EulerianSolver, name, original)
        SSPStepper.step = original_step
    (w0, s0, e0, a0, b0, p0), (w1, s1, e1, a1, b1, p1) = rows[False], rows[True]

    def ratio(a, b):
        return f"{a / b:.2f}" if b else "—"

    return ["| | density only | with atoms | ratio |", "|---|---|---|---|",
            f"| wall time (s), fastest of {repeats} alternating runs | {w0:.1f} | {w1:.1f} | {w1 / w0:.2f} |",
            f"| wall time to t = {split:g} (s), fastest of {repeats} (the same dynamics in both) | {p0:.1f} | {p1:.1f} | "
            f"{p1 / p0:.2f} |",
            f"| time steps | {s0} | {s1} | {s1 / s0:.2f} |",
            f"| step tries with t < {split:g} (both pairs of clusters near E) | {a0} | {a1} | {ratio(a1, a0)} |",
            f"| step tries with t ≥ {split:g} (with atoms: the F-phase) | {b0} | {b1} | {ratio(b1, b0)} |",
            f"| wall time per step (ms) | {1e3 * w0 / s0:.1f} | {1e3 * w1 / s1:.1f} | {(w1 / s1) / (w0 / s0):.2f} |",
            f"| exact edge-velocity evaluations | {e0} | {e1} | {e1 / e0:.2f} |"], w1 / w0



def figure(cases, path):
    """Alignment with E and F over time per case: Eulerian + atoms (solid), particles (dashed),
    one colour per mesh."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted(_by(cases).items())
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.4), squeeze=False)
    colours = {16: "tab:blue", 32: "tab:orange", 64: "tab:green", 8: "tab:grey"}
    for ax, ((law, beta), runs) in zip(axes[0], groups):
        for n, c in sorted(runs.items()):
            t = c.ds["time"].values
            for name, style in (("alignment_E", "-"), ("alignment_F", ":")):
                ax.plot(t, c.ds[name].values, style, color=colours.get(n, "k"), lw=1.2,
                        label=f"Eulerian + atoms, nside {n}" if name == "alignment_E" else None)
                ax.plot(t, c.ds["particle_" + name].values, style, color=colours.get(n, "k"), lw=0.8,
                        alpha=0.5, label=f"particles, nside {n}" if name == "alignment_E" else None)
        ax.set_title(f"{law}, β = {beta_text(beta)}")
        ax.set_xlabel("t")
        ax.set_ylim(-0.02, 1.02)
    axes[0][0].set_ylabel("alignment with E (solid), F (dotted)")
    axes[0][-1].legend(fontsize=7, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(out, conv, zero, sym, cost, info, quick, say=print):
    """OUT/atoms.md (and atoms.png) from the collected cases of the three sweeps. W₂ by exact OT
    between coarsenings of ≤ 2000 bins (4000 against the exact β = ∞ measure), ≤ 300 with quick."""
    out = Path(out)
    bins = 300 if quick else 2000
    lines = ["# Atoms: the Eulerian solver with point masses against the mean-field references", "",
             "Written by `spherepde validate atoms" + (" --quick" if quick else "") + "` (spherepde/validation/atoms.py). "
             "The paper's matrices V = diag(−1, 1, −2), B = diag(−1, −1, 1); Eulerian MUSCL/SSP-RK2, CFL 0.5, "
             "`velocity_tolerance = 1e-3`, atoms on (docs/atoms.md); quadrature particles (one per cell of the "
             "same mesh, RK4, dt 0.05, carrying their density) in lockstep in the same run file. "
             "Orders are log₂ of the ratio of successive differences (three meshes needed; *not monotone* when "
             "the differences change sign). Every W₂ carries its certified coarsening bound (±); where the "
             "bound exceeds the differences between meshes (diffuse measures, t ≤ 2), the order is not "
             "certified.", "",
             "## What was run", ""] + info + [""]
    if quick:
        lines += ["**Quick mode**: CI-sized runs (nside 8, t ≤ 4); the numbers below check the machinery, "
                  "not the science.", ""]
    if conv:
        lines += ["## Mesh convergence: F-onset, max alignment with E, min W₂(ρ_t, Π#ρ₀)", ""]
        lines += convergence_table(conv) + [""]
        lines += ["F-onset against the target (within 2 % of the converged particles at nside 32):", ""]
        lines += onset_target_table(conv) + [""]
        lines += ["## The mass that crosses x₁ = 0", "",
                  "W₂(ρ_t, Π#ρ₀) at late times is set by how the mass splits between the clusters at ±e₁: "
                  "moving mass Δp from one to the other costs W₂² ≈ 4Δp. The mean field carries mass across "
                  "x₁ = 0 early (t ≲ 1). Fraction of the mass on the side x₁ > 0:", ""]
        lines += split_table([c for c in conv if c.law == "projected_normal"]) + [""]
        lines += ["## What moves the clusters late: the background", "",
                  "Share of the softmax weight at the heaviest atom z that comes from the mesh density "
                  "(in brackets: the mesh's mass, and the angle from Bᵀz/|Bᵀz| to the nearest particle, rad). "
                  "The atoms weigh each other with e^{β(⟨Bᵀz, y⟩ − |Bᵀz|)}, as small as e^{−1.3β} when the pair is "
                  "near ±(e₁ ± e₃)/√2; any background mass near Bᵀz/|Bᵀz| then competes with them.", ""]
        lines += background_table(conv) + [""]
        w2_lines, _ = w2_table(conv, max_bins=bins, say=say)
        lines += ["## W₂(Eulerian + atoms, quadrature particles), t ≤ 3 log β", "",
                  f"Exact OT between adaptive HEALPix coarsenings of both measures (≤ {bins} bins each); "
                  "± is the coarsening bound √c_Eul + √c_particles (module docstring).", ""]
        lines += w2_lines + [""]
        fig = out / "atoms.png"
        figure(conv, fig)
        lines += [f"![alignment]({fig.name})", "",
                  "Alignment with E (solid) and F (dotted): Eulerian + atoms (thick) and particles (thin, faded), "
                  "per mesh.", ""]
    if zero:
        lines += ["## β = ∞ against the exact push-forward (uniform law)", "",
                  "W₂ to the exact measure: ρ₀ on a quadrature graded toward the repelling circle x₁ = 0 "
                  "(2-point Gauss in s = x₁ on 200 intervals from 1e-14 to 1, 256 azimuths), pushed by "
                  "x ↦ e^{tM}x/|e^{tM}x|. The grading matters at t = 8: the mass still far from ±e₁ "
                  "then comes from |x₁| ≲ 1e-7, which no mesh quadrature samples (a HEALPix-128 "
                  f"reference left a floor of 5e-4). OT between coarsenings of ≤ {2 * bins} bins; ± is the "
                  "coarsening bound. The last column is the reference's own error: W₂ to the same "
                  "construction with half the nodes in s and in φ.", ""]
        lines += exact_table(zero, max_bins=2 * bins) + [""]
        lines += ["The particles' error at late times is the mass they start with on the invariant circle x₁ = 0:",
                  ""] + invariant_circle_lines(zero) + [""]
        w2_lines, _ = w2_table(zero, max_bins=bins, say=say)
        lines += ["W₂(Eulerian + atoms, particles) at β = ∞:", ""] + w2_lines + [""]
    if sym:
        sym_lines, _, _ = symmetric_lines(sym)
        lines += ["## The symmetric case", "",
                  "Uniform law (ε = 0) and (1 − ε)·uniform + ε·(vMF pair at ±(e₁ + e₃)/√2, κ = 4), β = 10: "
                  "the pair of clusters at ±e₁ starts offset along e₃ by O(ε). "
                  "Departure time: when the alignment with E falls below 0.9 after its maximum.", ""]
        lines += sym_lines + [""]
    if cost:
        lines += ["## Cost", "", "The projected-normal run of atoms_base (β = 10) without particles, with and "
                  "without atoms, alternating three times in one process after a warm-up:", ""] + cost + [""]
    path = out / "atoms.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _sweep_cases(label, path, run, workers, address, say, info, conv, zero, sym):
    """Run one sweep of the suite (run=False: read its run files) on the cluster at address,
    note it in info and add its complete cases to conv, zero or sym by label."""
    start = time.perf_counter()
    if run:
        specs, _, failures = run_sweep_files(path, path.parent, workers=workers, say=say, scheduler=address)
    else:
        from .paper import expand_sweep

        specs, failures = expand_sweep(path, path.parent), []
    cases = collect(specs, path.parent)
    done = [c for c in cases if c.complete]
    walls = ", ".join(f"{c.law} β={beta_text(c.beta)}: {c.wall:.0f} s" for c in cases)
    failed = f"; failed: {', '.join(f'{r} ({why})' for r, why in failures)}" if failures else ""
    info.append(f"- {label}: {len(done)} of {len(specs)} runs complete (wall per run, 2 shared cores: {walls})"
                f"{failed}")
    say(f"  {label}: {len(done)} runs ({time.perf_counter() - start:.0f} s)")
    target = conv if label.startswith("atoms_convergence") else zero if "zero" in label else sym
    target += done


def run_suite(out, quick=False, slow=False, nsides=None, runs=None, workers=2, progress=True, run=True,
              cost=True, t_end=None):
    """Run (or reuse) the suite's sweeps and write OUT/atoms.md. nsides: the meshes of the
    convergence sweep (default 16, 32; with slow 16, 32, 64; quick: 8). runs: where the run files
    go (default OUT/runs). run=False: report on the run files that exist. t_end: replaces the runs'
    end time (tests). cost: measure the cost of atoms (two runs in this process)."""
    say = (lambda msg: print(msg, flush=True)) if progress else (lambda msg: None)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs = Path(runs) if runs else out / "runs"
    nsides = tuple(sorted(set(int(n) for n in nsides))) if nsides else ((8,) if quick else
                                                                       (SLOW_NSIDES if slow else NSIDES))
    t0 = time.perf_counter()
    conv, zero, sym = [], [], []
    info = [f"- meshes of the convergence sweep: nside {', '.join(map(str, nsides))} (nside 64: β = 10 only); "
            f"run files under `{runs}` (not part of the report)"]
    # one cluster for every sweep (each of the quick suite's runs takes a second or two)
    with contextlib.ExitStack() as stack:
        address = stack.enter_context(local_cluster(workers)) if run else None
        for label, path in _sweeps(runs, nsides, quick, t_end):
            _sweep_cases(label, path, run, workers, address, say, info, conv, zero, sym)
    cost_table = None
    if cost:
        cost_table, _ = cost_lines(nside=8 if quick else 16, t_end=4.0 if quick else 12.0, say=say)
    report = write_report(out, conv, zero, sym, cost_table, info, quick, say)
    say(f"  report {report} ({time.perf_counter() - t0:.0f} s)")
    return report


if __name__ == "__main__":  # run the sweeps only: python -m spherepde.validation.atoms RUNS_DIR [nside ...]
    import sys

    run_sweeps(Path(sys.argv[1]), tuple(int(n) for n in sys.argv[2:]) or NSIDES)
