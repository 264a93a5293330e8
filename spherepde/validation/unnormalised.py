"""Validation of unnormalised attention and of the log-partition function (issue 20 item 2).

`python -m spherepde.validation.unnormalised --out DIR [--quick]` writes DIR/unnormalised.md:

1. log Z(x) = ln Σ_j μ_j e^{β⟨Bᵀx, y_j⟩} from every summation method against a long-double
   log-sum-exp (tests/numpy_reference.log_partition, re-implemented here in plain numpy), masses
   spanning 1e-320 … 1, β = 0.5 … 1000; and the cost of asking for it (ratio, same run).
2. The unnormalised field n(x) = ∫ e^{β⟨Bᵀx, y⟩} y f dA of a vMF density on the HEALPix cell
   averages against the closed form Z A₃(|w|) w/|w|, Z = (sinh|w|/|w|)/(sinh κ/κ),
   w = βBᵀx + κμ: errors and observed orders over nside (a second-order quadrature).
3. Linear growth rates about the uniform state, V = B = I: ℓ(ℓ+1) i_ℓ(β)/β (Funk–Hecke), from
   Eulerian runs (uniform + ε P_ℓ minus the uniform run, as spherepde.validation.exact §3).
4. Interaction energy ½∬e^{β⟨x, By⟩}dρdρ along runs with B = V symmetric (Eulerian with atoms,
   quadrature particles, tokens): it must not decrease (gradient ascent, docs/theory.md#formulas-and-exact-solutions).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np
from scipy.special import eval_legendre, spherical_in

from spherepde.summation import attention_field, mesh_sources

from ..analysis.exact import langevin
from ..geometry.mesh import HealpixMesh
from ..models.attention import AttentionModel
from ..models.initial import VonMisesFisher
from ..solvers.eulerian import EulerianSolver
from ..solvers.particles import ParticleSolver, quadrature_particles, tokens_from_law

__all__ = ["unnormalised_growth_rate", "growth_rates", "interaction_energy", "energy_history",
           "log_partition_errors", "log_partition_cost", "vmf_field_errors", "run_suite"]


def unnormalised_growth_rate(beta, ell):
    """ℓ(ℓ+1) i_ℓ(β)/β: growth rate of a degree-ℓ perturbation of the uniform state (unit mass),
    V = B = I, unnormalised attention without time scale (docs/theory.md#formulas-and-exact-solutions)."""
    return ell * (ell + 1) * spherical_in(ell, beta) / beta


def growth_rates(mesh, beta, ells, t_end=None, snapshots=10, eps=1e-8, scheme="muscl", rk_order=3,
                 scale="none"):
    """Measured rate per ℓ: slope of log|⟨f_t − f_t^uniform, P_ℓ⟩| over the snapshots. t_end
    defaults to 1/(the largest exact rate) (growth by e over the run); ε = 1e-8 keeps the
    quadratic terms (relative size ε × the rates of other degrees) far below the smallest rates."""
    model = AttentionModel(np.eye(3), np.eye(3), beta, normalisation="unnormalised", unnormalised_scale=scale)
    factor = math.exp(-beta) if scale == "exp_beta" else 1.0
    if t_end is None:
        t_end = 1.0 / (factor * max(unnormalised_growth_rate(beta, ell) for ell in ells))
    axis = np.array([0.3, 0.4, 0.866])
    axis /= np.linalg.norm(axis)
    solver = EulerianSolver(mesh, model, scheme=scheme, rk_order=rk_order)
    save = t_end / snapshots
    base = solver.run(np.full(mesh.npix, 1 / (4 * math.pi)), t_end, save).density.values
    rates = {}
    for ell in ells:
        legendre = mesh.cell_average(lambda x: eval_legendre(ell, x @ axis))
        f0 = (1 + eps * legendre) / (4 * math.pi)
        ds = solver.run(f0, t_end, save)
        amplitude = (ds.density.values - base) @ legendre
        rates[ell] = float(np.polyfit(ds.time.values, np.log(np.abs(amplitude)), 1)[0]) / factor
    return rates


def interaction_energy(model, sources, masses, log_scale=0.0):
    """½∬e^{β⟨x, By⟩}dρdρ·e^{−c} for ρ = Σ_j μ_j δ_{y_j}: ½ Σ_i μ_i Z(y_i) e^{−c}, Z from the
    attention sums (log_partition; direct: exact to rounding)."""
    sources = np.ascontiguousarray(sources, dtype=float)
    masses = np.asarray(masses, dtype=float)
    logz = np.empty(len(sources))
    softmax = AttentionModel(model.B, model.V, model.beta)  # log Z only: the normalisation is irrelevant
    attention_field(softmax, sources, masses, sources, method="direct", log_partition=logz)
    return 0.5 * float(np.sum(masses * np.exp(logz - log_scale)))


def energy_history(kind, beta=4.0, nside=8, t_end=1.0, save_every=0.1, scale="none", n=400, seed=0):
    """The interaction energy at the snapshots of a run with B = V symmetric (not a multiple of I),
    unnormalised attention: kind "eulerian" (with atoms), "quadrature" or "tokens"."""
    B = np.array([[1.0, 0.3, 0.0], [0.3, 0.6, -0.2], [0.0, -0.2, -0.4]])
    model = AttentionModel(B, B, beta, normalisation="unnormalised", unnormalised_scale=scale)
    law = VonMisesFisher([0.2, -0.5, 0.8], 1.5)
    c = model.log_field_scale
    if kind == "eulerian":
        mesh = HealpixMesh(nside)
        solver = EulerianSolver(mesh, model, atoms={})
        times, energy = [], []
        for _, t, f, _ in solver.snapshots(law.cell_averages(mesh), np.arange(0, t_end + 1e-12, save_every)):
            x, m = solver.velocity.point_sources(None)
            sources, masses = mesh_sources(mesh, f, x, m)
            times.append(t)
            energy.append(interaction_energy(model, sources, masses, c))
        return np.array(times), np.array(energy)
    if kind == "quadrature":
        mesh = HealpixMesh(nside)
        x0, w, log_f = quadrature_particles(mesh, law)
        solver = ParticleSolver(model, carry_density=True)
    else:
        x0, w = tokens_from_law(law, n, seed)
        log_f = None
        solver = ParticleSolver(model)
    times, energy = [], []
    for _, t, x, _ in solver.snapshots(x0, w, np.arange(0, t_end + 1e-12, save_every), log_f):
        times.append(t)
        energy.append(interaction_energy(model, x, w, c))
    return np.array(times), np.array(energy)


# ------------------------------------------------------------------ log Z
def _reference_log_z(x, B, beta, y, mu):
    ld = np.longdouble
    keep = mu > 0
    e = (np.asarray(x, dtype=ld) @ np.asarray(B, dtype=ld) * ld(beta)) @ np.asarray(y[keep], dtype=ld).T
    e += np.log(mu[keep].astype(ld))
    top = e.max(axis=1, keepdims=True)
    return (top[:, 0] + np.log(np.exp(e - top).sum(axis=1))).astype(float)


def _unit(rng, n):
    x = rng.normal(size=(n, 3))
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def log_partition_errors(betas=(0.5, 3.0, 30.0, 300.0, 1000.0), nsource=6000, ntarget=300, seed=0):
    """{(β, method): (max |Δ log Z|, max |log Z|, method used)}; masses log-uniform over
    1e-320 … 1, a third of them under a heavy source's shadow."""
    rng = np.random.default_rng(seed)
    y, x = _unit(rng, nsource), _unit(rng, ntarget)
    mu = 10.0 ** rng.uniform(-320.0, 0.0, nsource)
    out = {}
    for beta in betas:
        model = AttentionModel(rng.normal(size=(3, 3)), np.eye(3), beta)
        want = _reference_log_z(x, model.B, beta, y, mu)
        for method in ("direct", "tree", "harmonic"):
            got = np.empty(ntarget)
            stats = {}
            attention_field(model, y, mu, x, method=method, log_partition=got, stats=stats)
            used = stats["method"]
            if method == "harmonic":
                used += f" (tilted {stats['tilted']}, re-summed {stats['fallbacks']})"
            out[(beta, method)] = (float(np.abs(got - want).max()), float(np.abs(want).max()), used)
    return out


def log_partition_cost(nside=32, cases=((3.0, "direct"), (3.0, "harmonic"), (30.0, "harmonic"),
                                        (300.0, "tree"), (1000.0, "tree")), repeats=7):
    """{(β, method): (seconds without, seconds with log Z, ratio)}: the fastest of `repeats`
    alternating calls each, at the edge points of nside (every 4th) for a vMF peak over 1e-6."""
    mesh = HealpixMesh(nside)
    f = VonMisesFisher(np.array([0.0, 0.6, 0.8]), 8.0).cell_averages(mesh) + 1e-6
    x = np.ascontiguousarray(mesh.edge_points.reshape(-1, 3)[::4])
    logz = np.empty(len(x))
    out = {}
    for beta, method in cases:
        model = AttentionModel(0.9 * np.eye(3) + 0.1, np.eye(3), beta)

        def call(ask):
            attention_field(model, mesh.centroids, f * mesh.area, x, want_div=True, method=method,
                            log_partition=logz if ask else None)

        call(False)
        call(True)
        times = {False: [], True: []}
        for _ in range(repeats):
            for ask in (False, True):
                start = time.perf_counter()
                call(ask)
                times[ask].append(time.perf_counter() - start)
        a, b = min(times[False]), min(times[True])
        out[(beta, method)] = (a, b, b / a)
    return out


# ------------------------------------------------------------------ vMF field
def vmf_field_errors(nsides=(8, 16, 32), cases=((1.0, 2.0, "none"), (6.0, 4.0, "none"), (30.0, 8.0, "exp_beta")),
                     ntarget=200, seed=1):
    """{(β, κ, scale, nside): (relative max error of v, of log Z)}: the cell averages of a vMF
    density as sources (what the solver uses) against the closed forms."""
    rng = np.random.default_rng(seed)
    B = rng.normal(size=(3, 3)) / 2.0
    V = rng.normal(size=(3, 3))
    x = _unit(rng, ntarget)
    law = VonMisesFisher(np.array([0.3, -0.4, 0.866]), 1.0)
    out = {}
    for beta, kappa, scale in cases:
        law = VonMisesFisher(law.mu, kappa)
        model = AttentionModel(B, V, beta, normalisation="unnormalised", unnormalised_scale=scale)
        wv = beta * x @ B + kappa * law.mu
        ww = np.linalg.norm(wv, axis=1)
        log_z = ww + np.log(-np.expm1(-2 * ww) / (2 * ww)) - (kappa + math.log(-math.expm1(-2 * kappa) / (2 * kappa)))
        u = ((np.exp(log_z - model.log_field_scale) * langevin(ww) / ww)[:, None] * wv) @ V.T
        want = u - np.sum(u * x, axis=1, keepdims=True) * x
        for n in nsides:
            mesh = HealpixMesh(n)
            got_logz = np.empty(ntarget)
            v, _, _ = attention_field(model, mesh.centroids, law.cell_averages(mesh) * mesh.area, x,
                                      method="direct", log_partition=got_logz)
            out[(beta, kappa, scale, n)] = (float(np.abs(v - want).max() / np.abs(want).max()),
                                            float(np.abs(got_logz - log_z).max()))
    return out


# ------------------------------------------------------------------ report
def _order(a, b):
    return math.log2(a / b) if a > 0 and b > 0 else float("nan")


def run_suite(out_dir, quick=False, progress=True):
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    say = (lambda msg: print("  " + msg, flush=True)) if progress else (lambda msg: None)
    seconds = {}
    lines = ["# Unnormalised attention and the log-partition function", "",
             f"`python -m spherepde.validation.unnormalised --out DIR{' --quick' if quick else ''}`.", ""]

    start = time.perf_counter()
    errs = log_partition_errors(betas=(0.5, 3.0, 30.0, 1000.0) if quick else (0.5, 3.0, 30.0, 300.0, 1000.0),
                                nsource=3000 if quick else 6000)
    seconds["log Z errors"] = time.perf_counter() - start
    say("log Z errors: done")
    lines += ["## 1. log Z from every summation method", "",
              "6000 random unit sources (3000 with --quick), masses 10^U(−320, 0), 300 targets, random B;",
              "reference: log-sum-exp in long double. tol 1e-10 (tree, harmonic: |Δ log Z| ≤ tol).", "",
              "| β | method | max abs error | max abs error / max abs log Z | max abs log Z | path |",
              "|---:|---|---:|---:|---:|---|"]
    for (beta, method), (e, scale, used) in errs.items():
        lines.append(f"| {beta:g} | {method} | {e:.2e} | {e / max(scale, 1.0):.2e} | {scale:.4g} | {used} |")
    start = time.perf_counter()
    cost = log_partition_cost(nside=32, repeats=5 if quick else 11)  # nside 16 calls (ms) are noise
    seconds["log Z cost"] = time.perf_counter() - start
    say("log Z cost: done")
    lines += ["", "### Cost of asking for log Z (nside 32, every 4th edge point, with the divergence)", "",
              "Fastest of alternating calls with and without `log_partition`, in the same run.", "",
              "| β | method | without (ms) | with (ms) | ratio |", "|---:|---|---:|---:|---:|"]
    for (beta, method), (a, b, r) in cost.items():
        lines.append(f"| {beta:g} | {method} | {1e3 * a:.1f} | {1e3 * b:.1f} | {r:.3f} |")

    start = time.perf_counter()
    nsides = (8, 16) if quick else (8, 16, 32, 64)
    vmf = vmf_field_errors(nsides=nsides)
    seconds["vMF field"] = time.perf_counter() - start
    say("vMF field: done")
    lines += ["", "## 2. Unnormalised field of a vMF density (cell averages) against the closed form", "",
              "v = P_x(V Z A₃(|w|) w/|w|)·e^{−c}, random B/2 and V, 200 random targets, direct sum.",
              "Relative max error of v, absolute max error of log Z; order = log₂(e(nside/2)/e(nside)).", "",
              "| β | κ | scale | nside | error v | order | error log Z | order |", "|---:|---:|---|---:|---:|---:|---:|---:|"]
    prev = {}
    for (beta, kappa, scale, n), (ev, ez) in vmf.items():
        p = prev.get((beta, kappa, scale))
        o = ("", "") if p is None else (f"{_order(p[0], ev):.2f}", f"{_order(p[1], ez):.2f}")
        lines.append(f"| {beta:g} | {kappa:g} | {scale} | {n} | {ev:.3e} | {o[0]} | {ez:.3e} | {o[1]} |")
        prev[(beta, kappa, scale)] = (ev, ez)

    lines += ["", "## 3. Linear growth rates about the uniform state, V = B = I", "",
              "Uniform + 10⁻⁸ P_ℓ(⟨a, x⟩) minus the uniform run, MUSCL, SSP-RK3, 10 snapshots over",
              "t_end = 1/(largest exact rate); fit of log|amplitude|. Exact ℓ(ℓ+1) i_ℓ(β)/β.", ""]
    growth_nsides = (8, 16) if quick else (8, 16, 32)
    ells = tuple(range(1, 7))
    for beta in (1.0, 6.0):
        lines += [f"### β = {beta:g}", "", "| ℓ | exact | " + " | ".join(f"nside {n}" for n in growth_nsides) + " |",
                  "|---:|---:|" + "---:|" * len(growth_nsides)]
        measured = {}
        for n in growth_nsides:
            start = time.perf_counter()
            measured[n] = growth_rates(HealpixMesh(n), beta, ells)
            seconds[f"growth β={beta:g} nside {n}"] = time.perf_counter() - start
            say(f"growth rates β = {beta:g}, nside {n}: {seconds[f'growth β={beta:g} nside {n}']:.0f} s")
        for ell in ells:
            exact = unnormalised_growth_rate(beta, ell)
            cells = [f"{measured[n][ell]:.6g} ({100 * (measured[n][ell] / exact - 1):+.3f} %)" for n in growth_nsides]
            lines.append(f"| {ell} | {exact:.6g} | " + " | ".join(cells) + " |")
        lines.append("")

    lines += ["## 4. Interaction energy along runs, B = V symmetric", "",
              "B = V = [[1, 0.3, 0], [0.3, 0.6, −0.2], [0, −0.2, −0.4]], β = 4, vMF start (κ = 1.5),",
              "unnormalised, t ∈ [0, 1]. E = ½ Σ_i μ_i Z(y_i) on the run's measure (cells and atoms, or",
              "particles). `min ΔE / E` is the smallest relative step between snapshots (> 0: E grew",
              "over every interval).", "", "| run | E(0) | E(1) | min ΔE/E | scale |", "|---|---:|---:|---:|---|"]
    for kind in ("eulerian", "quadrature", "tokens"):
        for scale in ("none", "exp_beta"):
            start = time.perf_counter()
            t, e = energy_history(kind, nside=8 if quick else 16, scale=scale)
            seconds[f"energy {kind} {scale}"] = time.perf_counter() - start
            lines.append(f"| {kind} | {e[0]:.6g} | {e[-1]:.6g} | {np.min(np.diff(e) / e[:-1]):.2e} | {scale} |")
        say(f"energy {kind}: done")
    lines += ["", "## Wall time", "", "| part | seconds |", "|---|---:|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in seconds.items()]
    (out / "unnormalised.md").write_text("\n".join(lines) + "\n")
    return out / "unnormalised.md"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory of the report")
    parser.add_argument("--quick", action="store_true", help="smaller meshes and fewer cases")
    args = parser.parse_args(argv)
    print(run_suite(args.out, quick=args.quick))


if __name__ == "__main__":
    main()
