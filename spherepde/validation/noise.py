"""Validation of the noise variant (`python -m spherepde.validation.noise --out DIR [--quick]` → DIR/noise.md).

∂_t f + div_S(f v[f]) = ν Δ_S f on the mesh, Brownian tokens on S² (spherepde.models.noise,
spherepde.transport.diffusion, spherepde.solvers.particles). Exact references only:

1. Heat equation on its own (V = 0): uniform + ½P_ℓ(⟨a, x⟩) decays like e^{−νℓ(ℓ+1)t}. Relative L²
   error of the perturbation's cell averages at e^{−1} decay and error of the fitted decay rate,
   nside 8/16/32 (64 with the full run), observed orders. The diffusion is exact in time
   (uniformisation), so these are the errors of the mesh operator alone. For comparison, the
   decay rate of the edge-only two-point flux ν(f_j − f_i)ℓ_ij/d_ij, which HEALPix's
   non-orthogonal cells make inconsistent.
2. Transport and diffusion together, in time: paper matrices, β = 5, ν = 0.05, one mesh,
   fixed steps dt … dt/4 against dt/16: the order of the integrating-factor SSP-RK2 step.
3. Linear growth rates about the uniform state, V = B = I (Funk–Hecke, docs/theory.md#formulas-and-exact-solutions):
   ℓ(ℓ+1) i_ℓ(β)/(β i₀(β)) − νℓ(ℓ+1) for ℓ = 1 … 6, β = 1 and 6, ν = 0 and the ν that makes
   ℓ = 3 neutral, at nside 32 (and 16: the resolution error). Relative error against
   max(|exact rate|, attention rate ℓ(ℓ+1)i_ℓ/(βi₀)): the neutral mode's exact rate is 0, and
   its error is then measured against either of the two parts that cancel.
4. Brownian tokens: E[x_t] = e^{−2νt}x₀ with its 95 % confidence interval over an ensemble (all
   tokens start at x₀, V = 0); and the geodesic random walk's weak order: its exact mean
   m(s)^{t/dt} (s = √(2ν dt)) against e^{−2νt} for dt → 0, and the ensemble against m(s)^{t/dt}.
5. Cost of the variant as a ratio in the same process (noise on / off, same run otherwise):
   Eulerian (paper matrices, vMF start, β = 10) and tokens.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np
from scipy.special import eval_legendre, spherical_in

from ..analysis.exact import linear_growth_rate
from ..geometry.mesh import HealpixMesh
from ..models.attention import AttentionModel
from ..models.initial import VonMisesFisher
from ..models.noise import NoiseSchedule
from ..solvers.eulerian import EulerianSolver
from ..solvers.particles import ParticleSolver, noise_mean_factor

__all__ = ["heat_decay", "two_point_flux_rates", "time_order", "growth_rates_with_noise", "brownian_mean",
           "weak_order", "cost_ratios", "report", "run_suite"]

AXIS = np.array([0.3, 0.4, 0.866]) / np.linalg.norm([0.3, 0.4, 0.866])
PAPER_V = np.diag([-1.0, 1.0, -2.0])
PAPER_B = np.diag([-1.0, -1.0, 1.0])
NEUTRAL_ELL = 3


def _order(coarse, fine):
    return math.log2(coarse / fine) if coarse > 0 and fine > 0 else float("nan")


def _legendre(mesh, ell):
    return mesh.cell_average(lambda x: eval_legendre(ell, x @ AXIS), order=6)


# ------------------------------------------------------------------ 1. heat equation
def heat_decay(mesh, ell, nu=0.1, snapshots=4):
    """(relative L² error at e^{−1} decay, relative error of the fitted decay rate, relative
    error of the Rayleigh quotient −⟨P, LP⟩/⟨P, P⟩ against ℓ(ℓ+1), mass drift, min f) of the pure
    heat flow of uniform + ½P_ℓ through the Eulerian solver (V = 0)."""
    model = AttentionModel(np.eye(3), np.zeros((3, 3)), 1.0)
    P = _legendre(mesh, ell)
    lam = nu * ell * (ell + 1)
    t_end = 1.0 / lam
    solver = EulerianSolver(mesh, model, noise=NoiseSchedule(nu))
    ds = solver.run((1 + 0.5 * P) / (4 * math.pi), t_end, t_end / snapshots)
    pert = ds.density.values * 4 * math.pi - 1
    exact = 0.5 * math.exp(-1.0) * P
    err = math.sqrt(np.sum((pert[-1] - exact) ** 2) / np.sum(exact**2))
    rate = np.polyfit(ds.time.values, np.log(pert @ P), 1)[0]
    rayleigh = -(P @ solver.diffusion.laplacian(P)) / (P @ P) / (ell * (ell + 1))
    return (err, abs(rate / -lam - 1), abs(rayleigh - 1), float(np.abs(ds.mass.values - 1).max()),
            float(ds.density.values.min()))


def two_point_flux_rates(mesh, ells):
    """Relative error of the Y_ℓ decay rate (Rayleigh quotient) of the edge-only two-point flux
    ℓ_ij/d_ij (edge length over centroid distance): the operator that is NOT used."""
    import scipy.sparse as sp

    p, q = mesh.edge_cells.T
    c = mesh.centroids
    w = mesh.edge_weights.sum(axis=1) / np.arccos(np.clip(np.einsum("ed,ed->e", c[p], c[q]), -1, 1))
    n = mesh.npix
    W = sp.csr_matrix((np.r_[w, w], (np.r_[p, q], np.r_[q, p])), shape=(n, n))
    L = (W - sp.diags(np.asarray(W.sum(axis=1)).ravel())) / mesh.area
    out = {}
    for ell in ells:
        Y = _legendre(mesh, ell)
        out[ell] = float(-(Y @ (L @ Y)) / (Y @ Y) / (ell * (ell + 1)) - 1)
    return out


# ------------------------------------------------------------------ 2. time order
def time_order(mesh, nu=0.05, t_end=0.4, steps=(8, 16, 32), reference_steps=128, scheme="upwind"):
    """Max-norm errors of fixed-step runs (paper matrices, β = 5, vMF start) against a run with
    reference_steps steps, on one mesh: {steps: error}."""
    solver = EulerianSolver(mesh, AttentionModel(PAPER_B, PAPER_V, 5.0), scheme=scheme, cfl=1.0,
                            noise=NoiseSchedule(nu))
    f0 = VonMisesFisher([0.6, 0.0, 0.8], 2.0).cell_averages(mesh)

    def integrate(n):
        dt, f, t = t_end / n, f0.copy(), 0.0
        for _ in range(n):
            f, taken = solver.stepper.step(f, t, dt)
            if taken != dt:
                raise RuntimeError(f"the Courant limit cut the step {dt:g} to {taken:g}: use more steps")
            t += dt
        return f

    reference = integrate(reference_steps)
    return {n: float(np.abs(integrate(n) - reference).max()) for n in steps}


# ------------------------------------------------------------------ 3. growth rates
def neutral_noise(beta, ell=NEUTRAL_ELL):
    """The ν that makes mode ℓ neutral: i_ℓ(β)/(β i₀(β))."""
    return float(spherical_in(ell, beta) / (beta * spherical_in(0, beta)))


def growth_rates_with_noise(mesh, betas=(1.0, 6.0), ells=range(1, 7), nus=None, t_end=0.3, save_every=0.02,
                            eps=1e-4):
    """Rows (β, ν, ℓ, measured, exact, attention, error) of the linear growth rates about the
    uniform state, V = B = I; ν ∈ {0, neutral_noise(β)} unless nus = {β: [...]} is given.
    measured: slope of log|⟨f_t − f_t^uniform, P_ℓ⟩| over the snapshots (the run from the
    uniform state is subtracted: the rate of the linearised discrete flow). error: |measured −
    exact| / max(|exact|, attention)."""
    rows = []
    for beta in betas:
        model = AttentionModel(np.eye(3), np.eye(3), beta)
        for nu in (nus or {}).get(beta, (0.0, neutral_noise(beta))):
            solver = EulerianSolver(mesh, model, noise=NoiseSchedule(nu))
            base = solver.run(np.full(mesh.npix, 1 / (4 * math.pi)), t_end, save_every).density.values
            for ell in ells:
                P = _legendre(mesh, ell)
                ds = solver.run((1 + eps * P) / (4 * math.pi), t_end, save_every)
                amplitude = (ds.density.values - base) @ P
                measured = float(np.polyfit(ds.time.values, np.log(np.abs(amplitude)), 1)[0])
                attention = float(linear_growth_rate(beta, ell))
                exact = attention - nu * ell * (ell + 1)
                rows.append({"beta": beta, "nu": nu, "ell": ell, "measured": measured, "exact": exact,
                             "attention": attention, "error": abs(measured - exact) / max(abs(exact), attention)})
    return rows


# ------------------------------------------------------------------ 4. Brownian tokens
def brownian_mean(nu, times, dt, seeds, n=2000):
    """Mean and standard error of x_t·x₀ (x₀ = e_z, V = 0) over len(seeds) runs of n tokens, at
    each of the times (increasing, times[0] = 0). Returns {t: (mean, standard error, samples)}."""
    model = AttentionModel(np.eye(3), np.zeros((3, 3)), 1.0)
    x0 = np.tile([0.0, 0.0, 1.0], (n, 1))
    values = {t: [] for t in times[1:]}
    for seed in seeds:
        solver = ParticleSolver(model, "euler", dt, noise=NoiseSchedule(nu), seed=seed)
        for k, t, x, _ in solver.snapshots(x0, np.full(n, 1.0 / n), list(times)):
            if k > 0:
                values[times[k]].append(x[:, 2])
    out = {}
    for t, parts in values.items():
        z = np.concatenate(parts)
        out[t] = (float(z.mean()), float(z.std(ddof=1) / math.sqrt(z.size)), z.size)
    return out


def weak_order(nu, t, dts):
    """{dt: (scheme mean m(s)^{t/dt}, relative bias against e^{−2νt})}: the scheme's exact mean."""
    exact = math.exp(-2 * nu * t)
    out = {}
    for dt in dts:
        steps = int(round(t / dt))
        mean = float(noise_mean_factor(math.sqrt(2 * nu * dt))) ** steps
        out[dt] = (mean, mean / exact - 1)
    return out


# ------------------------------------------------------------------ 5. cost
class _Timed:
    """Wraps a callable and adds up the seconds spent in it."""

    def __init__(self, func):
        self.func, self.seconds = func, 0.0

    def __call__(self, *args, **kwargs):
        clock = time.perf_counter()
        try:
            return self.func(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - clock


def cost_ratios(nside=32, nus=(0.01, 0.1), t_end=1.0, tokens=2000, repeats=3):
    """Wall-time ratios noise on / off in this process: Eulerian (paper matrices, β = 10, vMF κ = 3,
    MUSCL, SSP-RK2) and tokens (same model, RK4, dt = 0.02). Every configuration runs once to
    compile, then `repeats` rounds run each configuration in turn (so that a changing machine
    load hits all alike) and the best time of each is kept. Also: the share of the noisy run spent
    in the variant's own operations (the heat flow; the tokens' noise steps), the steps and the
    heat flow's sparse products. The whole-run ratio also contains the change noise makes to the
    dynamics: a smoother density changes the cost of the attention sums. On one numba thread: on a
    shared machine each parallel region waits for time slices, which would swamp the ratio."""
    import numba

    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        return _cost_ratios(nside, nus, t_end, tokens, repeats)
    finally:
        numba.set_num_threads(threads)


def _cost_ratios(nside, nus, t_end, tokens, repeats):
    model = AttentionModel(PAPER_B, PAPER_V, 10.0)
    mesh = HealpixMesh(nside)
    law = VonMisesFisher([0.6, 0.0, 0.8], 3.0)
    f0 = law.cell_averages(mesh)
    x0 = law.sample(tokens, np.random.default_rng(0))
    w = np.full(tokens, 1.0 / tokens)
    cases = []
    for nu in (0.0, *nus):
        solver = EulerianSolver(mesh, model, noise=NoiseSchedule(nu))
        timer = None
        if solver.diffusion is not None:
            timer = solver.diffusion.propagate = _Timed(solver.diffusion.propagate)
        cases.append({"solver": f"Eulerian nside {nside}", "nu": nu, "timer": timer,
                      "run": (lambda s=solver: s.run(f0, t_end, t_end))})
    for nu in (0.0, *nus):
        psolver = ParticleSolver(model, "rk4", 0.02, noise=NoiseSchedule(nu), seed=1)
        timer = psolver.noise_step = _Timed(psolver.noise_step)

        def run(s=psolver):
            for _ in s.snapshots(x0, w, [0.0, t_end]):
                pass

        cases.append({"solver": f"{tokens} tokens, RK4", "nu": nu, "timer": timer if nu > 0 else None, "run": run})
    for case in cases:
        case["result"] = case["run"]()  # compile, warm caches
        case["seconds"], case["own"] = math.inf, 0.0
    for _ in range(repeats):
        for case in cases:
            if case["timer"] is not None:
                case["timer"].seconds = 0.0
            clock = time.perf_counter()
            case["result"] = case["run"]()
            seconds = time.perf_counter() - clock
            if seconds < case["seconds"]:
                case["seconds"] = seconds
                case["own"] = case["timer"].seconds if case["timer"] is not None else 0.0
    rows = []
    for case in cases:
        ds = case["result"]
        eulerian = ds is not None
        rows.append({"solver": case["solver"], "nu": case["nu"], "seconds": case["seconds"],
                     "share": case["own"] / case["seconds"],
                     "steps": int(ds.steps.values[-1]) if eulerian else int(round(t_end / 0.02)),
                     "products": int(ds.heat_products.values[-1]) if eulerian and "heat_products" in ds else 0})
    for row in rows:
        plain = next(r for r in rows if r["solver"] == row["solver"] and r["nu"] == 0.0)
        row["ratio"] = row["seconds"] / plain["seconds"]
    return rows


# ------------------------------------------------------------------ the report
def report(quick=False, progress=True):
    """Run every measurement and return the markdown report (quick: CI-sized, seconds)."""
    say = (lambda msg: print("  " + msg, flush=True)) if progress else (lambda msg: None)
    meshes = {}

    def mesh(n):
        if n not in meshes:
            meshes[n] = HealpixMesh(n)
        return meshes[n]

    seconds = {}
    heat_nsides = (8, 16) if quick else (8, 16, 32, 64)
    heat_ells = (1, 2, 4, 6)
    clock = time.perf_counter()
    heat = {(n, ell): heat_decay(mesh(n), ell) for n in heat_nsides for ell in heat_ells}
    tpfa = {n: two_point_flux_rates(mesh(n), heat_ells) for n in heat_nsides}
    seconds["heat equation"] = time.perf_counter() - clock
    say(f"heat equation: {seconds['heat equation']:.0f} s")

    clock = time.perf_counter()
    order_nside = 4 if quick else 8
    orders = {s: time_order(mesh(order_nside), scheme=s) for s in ("upwind", "muscl")}
    seconds["time order"] = time.perf_counter() - clock
    say(f"time order: {seconds['time order']:.0f} s")

    clock = time.perf_counter()
    growth_nsides = (8,) if quick else (16, 32)
    growth_betas = (6.0,) if quick else (1.0, 6.0)
    growth_ells = (1, 2, 3) if quick else range(1, 7)
    growth = {n: growth_rates_with_noise(mesh(n), growth_betas, growth_ells) for n in growth_nsides}
    seconds["growth rates"] = time.perf_counter() - clock
    say(f"growth rates: {seconds['growth rates']:.0f} s")

    clock = time.perf_counter()
    nu_b, t_b = 0.5, (0.0, 0.25, 0.5, 1.0)
    dt_b = 0.01 if quick else 0.0025
    seeds = range(4) if quick else range(40)
    brownian = brownian_mean(nu_b, t_b, dt_b, seeds)
    weak_dts = (0.25, 0.125, 0.0625, 0.03125)
    weak = weak_order(1.0, 0.5, weak_dts)
    coarse = brownian_mean(1.0, (0.0, 0.5), 0.25, range(100, 104 if quick else 120))[0.5]
    seconds["Brownian tokens"] = time.perf_counter() - clock
    say(f"Brownian tokens: {seconds['Brownian tokens']:.0f} s")

    clock = time.perf_counter()
    cost = cost_ratios(nside=8 if quick else 32, t_end=0.3 if quick else 1.0, tokens=300 if quick else 2000,
                       repeats=1 if quick else 3)
    seconds["cost"] = time.perf_counter() - clock
    say(f"cost: {seconds['cost']:.0f} s")

    lines = ["# Noise: validation", "",
             "∂_t f + div_S(f v[f]) = ν Δ_S f on the HEALPix mesh (symmetric non-negative 8-neighbour rates,",
             "exact heat flow by uniformisation, integrating-factor SSP-RK2), Brownian tokens on S²",
             "(geodesic random walk after each drift step). `order` is log₂(e(coarse)/e(fine)).",
             "" if not quick else "\n**Quick run** (CI-sized): coarse meshes and small ensembles; the numbers quoted in the docs come from the full run.\n",
             "## 1. Heat equation on its own: Y_ℓ decays like e^{−νℓ(ℓ+1)t}", "",
             "V = 0, ν = 0.1, uniform + ½P_ℓ(⟨a, x⟩), run to e^{−1} decay (t = 1/(νℓ(ℓ+1))) in 4 snapshots.",
             "Solution: relative L² error of the perturbation's cell averages at the end; rate: relative",
             "error of the decay rate fitted over the snapshots; Rayleigh: relative error of −⟨P_ℓ, LP_ℓ⟩/⟨P_ℓ, P_ℓ⟩",
             "against ℓ(ℓ+1) (the operator's own decay rate of the mode, no time stepping). Mass drift and",
             f"min f over all nside: {max(h[3] for h in heat.values()):.1e} and {min(h[4] for h in heat.values()):.3e} (> 0).", "",
             "| ℓ | nside | solution error | order | rate error | order | Rayleigh error | order | two-point flux Rayleigh error |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for ell in heat_ells:
        prev = None
        for n in heat_nsides:
            e = heat[(n, ell)][:3]
            o = ["", "", ""] if prev is None else [f"{_order(a, b):.2f}" for a, b in zip(prev, e)]
            lines.append(f"| {ell} | {n} | {e[0]:.3e} | {o[0]} | {e[1]:.3e} | {o[1]} | {e[2]:.3e} | {o[2]} | "
                         f"{tpfa[n][ell]:+.2%} |")
            prev = e
    lines += ["", "The operator's decay rates (Rayleigh) converge at order 2; the solution, compared with the cell",
              "averages of P_ℓ, at order 1.3–1.8: the discrete eigenvectors differ from the cell averages by",
              "more than the eigenvalues do, where HEALPix cells change shape abruptly (base-face boundaries,",
              "|z| = 2/3). The fitted rate holds some of that difference (projection on P_ℓ), hence its order",
              "between the two. The last column is the edge-only two-point flux ν(f_j − f_i)ℓ_ij/d_ij: its",
              "decay rates stay 5–8 % too fast at every nside, which is why it is not used.", "",
              f"## 2. Transport and diffusion together: order in time (nside {order_nside})", "",
              "Paper matrices, β = 5, ν = 0.05, vMF(μ = (0.6, 0, 0.8), κ = 2) start, t = 0.4 in n fixed steps;",
              "max-norm difference from 128 steps.", "",
              "| scheme | n = 8 | n = 16 | n = 32 | orders |", "|---|---:|---:|---:|---|"]
    for scheme, errs in orders.items():
        e = [errs[n] for n in sorted(errs)]
        lines.append(f"| {scheme} | " + " | ".join(f"{v:.3e}" for v in e) + " | "
                     + ", ".join(f"{_order(a, b):.2f}" for a, b in zip(e, e[1:])) + " |")
    lines += ["", "## 3. Linear growth rates about the uniform state with noise (Funk–Hecke)", "",
              "V = B = I, uniform + 10⁻⁴P_ℓ, SSP-RK2 with steps ≤ 0.02, fit over t ∈ [0, 0.3], the run from the",
              "uniform state subtracted. Exact rate ℓ(ℓ+1)(i_ℓ(β)/(β i₀(β)) − ν); the neutral ν makes ℓ = 3",
              "neutral. Relative error = |measured − exact| / max(|exact|, ℓ(ℓ+1)i_ℓ/(βi₀)). Target: 1 % at",
              "nside 32.", ""]
    header = "| β | ν | ℓ | exact | " + " | ".join(f"nside {n}" for n in growth_nsides) + " |"
    lines += [header, "|---:|---:|---:|---:|" + "---:|" * len(growth_nsides)]
    first = growth[growth_nsides[0]]
    for i, row in enumerate(first):
        cells = [f"{growth[n][i]['measured']:.5f} ({growth[n][i]['error']:.2%})" for n in growth_nsides]
        lines.append(f"| {row['beta']:g} | {row['nu']:.5f} | {row['ell']} | {row['exact']:.5f} | " + " | ".join(cells) + " |")
    worst = {n: max(r["error"] for r in growth[n]) for n in growth_nsides}
    lines += ["", "Largest relative error: " + ", ".join(f"nside {n}: {worst[n]:.2%}" for n in growth_nsides) + ".",
              "", "## 4. Brownian tokens", "",
              f"All tokens start at x₀ = e_z, V = 0, ν = {nu_b:g}, dt = {dt_b:g}, {len(seeds)} seeds × 2000 tokens. E[x_t·x₀]",
              "against e^{−2νt} with the 95 % confidence interval (±1.96 standard errors); the geodesic random",
              "walk's exact mean m(s)^{t/dt} (s = √(2νdt)) shows its bias at this dt.", "",
              "| t | e^{−2νt} | scheme mean m(s)^{t/dt} | ensemble mean | 95 % interval | exact inside |",
              "|---:|---:|---:|---:|---:|---|"]
    for t, (mean, se, size) in brownian.items():
        exact = math.exp(-2 * nu_b * t)
        scheme = float(noise_mean_factor(math.sqrt(2 * nu_b * dt_b))) ** int(round(t / dt_b))
        lo, hi = mean - 1.96 * se, mean + 1.96 * se
        lines.append(f"| {t:g} | {exact:.5f} | {scheme:.5f} | {mean:.5f} | [{lo:.5f}, {hi:.5f}] | "
                     f"{'yes' if lo <= exact <= hi else 'no'} |")
    lines += ["", "Weak order of the scheme: its exact mean at t = 0.5, ν = 1 (relative bias against e^{−1}),",
              "and an ensemble at the coarsest dt, where the bias is larger than the interval:", "",
              "| dt | m(s)^{t/dt} | relative bias | order |", "|---:|---:|---:|---:|"]
    prev = None
    for dt, (mean, bias) in weak.items():
        lines.append(f"| {dt:g} | {mean:.5f} | {bias:+.3e} | {'' if prev is None else f'{_order(abs(prev), abs(bias)):.2f}'} |")
        prev = bias
    mean, se, size = coarse
    lines += ["", f"dt = 0.25, {size} tokens: ensemble mean {mean:.5f} ± {1.96 * se:.5f} (95 %), scheme mean "
              f"{weak[0.25][0]:.5f}, e^{{−1}} = {math.exp(-1):.5f}.", "",
              "## 5. Cost of the variant (ratio noise on / off, same process, same run otherwise)", "",
              "Paper matrices, β = 10, vMF(κ = 3) start, t = " + ("0.3" if quick else "1") + ", one numba thread; each",
              "configuration once to compile, then rounds over all of them (best time of each). `own share`: the part of the run spent",
              "in the variant's own operations (the mesh's heat flow; the tokens' noise steps). The whole-run",
              "ratio also holds the change noise makes to the dynamics (a smoother density makes the attention",
              "sums cheaper or dearer).", "",
              "| solver | ν | seconds | ratio to ν = 0 | own share | steps | heat-flow sparse products |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for row in cost:
        lines.append(f"| {row['solver']} | {row['nu']:g} | {row['seconds']:.2f} | {row['ratio']:.2f} | {row['share']:.1%} | "
                     f"{row['steps']} | {row['products']} |")
    lines += ["", "## Wall times (s)", "", "| case | seconds |", "|---|---:|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in seconds.items()]
    return "\n".join(lines) + "\n"


def run_suite(out_dir, quick=False, slow=False, nsides=None, progress=True):
    """Write DIR/noise.md (slow and nsides are accepted for the validate command's interface; the
    suite's meshes are fixed by quick). Returns the report text."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = report(quick=quick, progress=progress)
    (out / "noise.md").write_text(text)
    return text


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m spherepde.validation.noise", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output directory (DIR/noise.md)")
    parser.add_argument("--quick", action="store_true", help="CI-sized runs (seconds)")
    args = parser.parse_args(argv)
    run_suite(args.out, quick=args.quick)
    print(f"wrote {Path(args.out) / 'noise.md'}")


if __name__ == "__main__":
    main()
