"""The phase diagram of Geshkovski, Letrouit, Polyanskiy & Rigollet, "A mathematical perspective
on Transformers" (arXiv 2312.10794; code borjanG/2023-transformers-rotf, phase-diagrams.py):
`spherepde validate rotf --out DIR [--quick]` writes DIR/rotf.md, DIR/phase_diagram.png and the
numbers behind them, DIR/rotf.nc.

Setting (theirs): n = 32 tokens drawn uniformly on S^{d−1} (X/|X|, X ~ N(0, I_d)), Q = K = V = I_d,
so B = QᵀK = I and V = I, normalised (softmax) attention, d ∈ {2, 8, 128}, many independent
systems batched in one array (M, n, d) per (d, β). Statistic: for each save time the fraction of
the n(n−1)/2 pairs i < j with ⟨x_i, x_j⟩ ≥ 0.999 (spherepde.analysis.systems.CLUSTER_THRESHOLD),
averaged over the systems: 1 when every system is one cluster.

Differences from their code, on purpose: they take explicit normalised steps of 0.1, x ← (x + 0.1
Σ_j softmax_j x_j)/|·| (the unprojected mean: a time step shortened by 1/(1 + 0.1⟨x, m⟩), an O(dt)
error of the time axis); here the ODE ẋ = P_x(m_β(x)) is integrated with spherepde's particle
solver, Dormand–Prince 5(4) with error control (rtol RTOL), so t is the model's time. Their β grid
is linear (0.1 … 9, 90 values), t ≤ 30 at 200 points; here β is log-spaced 0.1 … 20 (BETAS) and
t ≤ 30 at SAVES points, to fit 2 CPU cores.

Dimension reduction (exact): with B = V = I the field commutes with every rotation and lies in the
span of the tokens, so a system of n tokens in R^d (d > n) moves in the n-dimensional span of its
initial tokens; span_coordinates replaces each system by its coordinates in an orthonormal basis
of that span (Gram matrix kept to rounding). d = 128 then runs in R^32: same pair fractions,
a quarter of the arithmetic.

Two tokens, exact: with c = ⟨x₁, x₂⟩ the weight of the other token is 1/(1 + e^{β(1−c)}) and
dc/dt = 2(1 − c²)/(1 + e^{β(1−c)}), so the pair links (c = 0.999) at
T(c₀) = ∫_{c₀}^{0.999} (1 + e^{β(1−c)}) / (2(1 − c²)) dc (two_token_link_time; tests compare).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np

from ..analysis.systems import CLUSTER_THRESHOLD, clustered_pair_counts
from ..models.attention import AttentionModel
from ..solvers.particles import ParticleSolver

__all__ = ["N_TOKENS", "DIMENSIONS", "BETAS", "T_END", "SAVES", "SYSTEMS", "RTOL", "QUICK", "span_coordinates",
           "uniform_systems", "clustered_fraction", "fraction_series", "crossing_times", "half_time_interval",
           "phase_diagram", "step_check", "two_token_link_time", "figure", "dataset", "report", "run_suite"]

N_TOKENS = 32
DIMENSIONS = (2, 8, 128)
BETAS = tuple(float(b) for b in np.geomspace(0.1, 20.0, 12))
T_END = 30.0
SAVES = 31  # save times 0, 1, …, 30
# systems per d: 2 048 as in the rotf code where 2 shared cores allow it (rotf.md gives the times)
SYSTEMS = {2: 2048, 8: 2048, 128: 512}
RTOL = 1e-5  # dopri5's tolerance (max chordal distance per step); the first step is 0.1
QUICK = {"systems": {2: 128, 8: 128, 128: 64}, "betas": tuple(float(b) for b in np.geomspace(0.1, 20.0, 5)),
         "saves": 31}
LEVEL = 0.5  # the contour drawn and the crossing time tabled
BOOTSTRAP = 400  # resamples of the systems for the interval of the crossing of the mean fraction
CHECK = {"d": 8, "beta": 4.71, "systems": 512, "rtol": 1e-7}  # the time-step check: a slow transition, tighter rtol


def span_coordinates(x):
    """Tokens (M, n, d) with d > n as (M, n, n): the coordinates of each system in an orthonormal
    basis of the span of its tokens (QR of x_kᵀ = Q R: coordinates Rᵀ), rows renormalised against
    rounding. Returns x unchanged when d ≤ n. Exact for rotation-invariant fields (module
    docstring)."""
    x = np.asarray(x, dtype=float)
    n, d = x.shape[1:]
    if d <= n:
        return x
    r = np.linalg.qr(np.swapaxes(x, 1, 2), mode="r")  # (M, n, n): x_kᵀ = Q_k R_k
    y = np.swapaxes(r, 1, 2).copy()
    return y / np.linalg.norm(y, axis=-1, keepdims=True)


def uniform_systems(systems, n, d, seed):
    """systems × n tokens i.i.d. uniform on S^{d−1} (normalised Gaussians), (M, n, d), from
    default_rng(seed)."""
    x = np.random.default_rng(seed).standard_normal((systems, n, d))
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def clustered_fraction(x, threshold=CLUSTER_THRESHOLD):
    """(M,): per system the fraction of the n(n−1)/2 pairs with ⟨x_i, x_j⟩ ≥ threshold."""
    x = np.ascontiguousarray(x, dtype=float)
    n = x.shape[1]
    counts = np.empty(x.shape[0], dtype=np.int64)
    clustered_pair_counts(x, threshold, counts)
    return counts / (n * (n - 1) / 2)


def fraction_series(x0, beta, times, rtol=RTOL):
    """(len(times), M): the clustered fraction of every system at the save times, B = V = I at
    inverse temperature beta, tokens x0 (M, n, d) advanced by dopri5 (span_coordinates first);
    and the field evaluations it took."""
    x = span_coordinates(x0)
    d = x.shape[-1]
    solver = ParticleSolver(AttentionModel(np.eye(d), np.eye(d), float(beta)), "dopri5", 0.1, rtol=rtol, atol=0.0,
                            summation="batched")
    weights = np.full(x.shape[1], 1.0 / x.shape[1])
    out = np.array([clustered_fraction(xt) for _, _, xt, _ in solver.snapshots(x, weights, times)])
    return out, solver.evaluations


def crossing_times(times, fractions, level=LEVEL):
    """(K,): the first time each column of fractions (T, K) reaches level, linear between save
    times; inf where it never does (censored at times[-1])."""
    f = np.asarray(fractions, dtype=float)
    t = np.asarray(times, dtype=float)
    reached = f >= level
    k = np.argmax(reached, axis=0)  # the first save at or above level (0 where none is)
    prev = np.maximum(k - 1, 0)
    cols = np.arange(f.shape[1])
    lo, hi = f[prev, cols], f[k, cols]
    gap = hi - lo
    share = np.divide(level - lo, gap, out=np.ones_like(gap), where=gap > 0)
    value = np.where(k == 0, t[0], t[prev] + share * (t[k] - t[prev]))
    return np.where(reached.any(axis=0), value, np.inf)


def half_time_interval(times, fractions, level=LEVEL, resamples=BOOTSTRAP, seed=0):
    """(t, lo, hi): the time at which the mean over systems of fractions (T, M) reaches level, and
    the 2.5 and 97.5 percentiles of the same time over bootstrap resamples of the systems (inf
    where the mean does not reach it by the last save time)."""
    f = np.asarray(fractions, dtype=float)
    m = f.shape[1]
    t = float(crossing_times(times, f.mean(axis=1)[:, None], level)[0])
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(m, np.full(m, 1.0 / m), size=resamples)  # (R, M) resample weights
    means = f @ counts.T / m  # (T, R)
    boot = crossing_times(times, means, level)
    lo, hi = np.percentile(boot, [2.5, 97.5], method="inverted_cdf")  # a resample's value: inf allowed
    return t, float(lo), float(hi)


def phase_diagram(dimensions=DIMENSIONS, betas=BETAS, systems=SYSTEMS, saves=SAVES, t_end=T_END, n=N_TOKENS,
                  seed=0, rtol=RTOL, say=None):
    """{"times", "betas", "dimensions", "systems" {d: M}, "fraction" (D, B, T) mean over systems,
    "half" {(d, β): (t, lo, hi)}, "system_half" {(d, β): per-system crossing times (M,)},
    "evaluations" {(d, β): int}, "seconds" {(d, β): float}}. systems: {d: M} or one M for all d.
    The same tokens for every β of one d (default_rng(seed + d))."""
    if not isinstance(systems, dict):
        systems = {d: int(systems) for d in dimensions}
    times = np.linspace(0.0, t_end, saves)
    result = {"times": times, "betas": np.array(betas), "dimensions": tuple(dimensions), "systems": systems, "n": n,
              "rtol": rtol, "fraction": np.empty((len(dimensions), len(betas), saves)), "half": {},
              "system_half": {}, "evaluations": {}, "seconds": {}}
    for a, d in enumerate(dimensions):
        x0 = uniform_systems(systems[d], n, d, seed + d)
        for b, beta in enumerate(betas):
            start = time.perf_counter()
            series, evaluations = fraction_series(x0, beta, times, rtol)
            seconds = time.perf_counter() - start
            result["fraction"][a, b] = series.mean(axis=1)
            result["half"][(d, beta)] = half_time_interval(times, series)
            result["system_half"][(d, beta)] = crossing_times(times, series)
            result["evaluations"][(d, beta)] = evaluations
            result["seconds"][(d, beta)] = seconds
            if say is not None:
                say(f"  rotf: d = {d}, β = {beta:.3g}: t½ = {result['half'][(d, beta)][0]:.2f}, "
                    f"{evaluations} evaluations, {seconds:.1f} s")
    return result


def step_check(d, beta, systems, times, n=N_TOKENS, seed=0, rtol=RTOL, tight=CHECK["rtol"]):
    """The same systems (the first `systems` draws of phase_diagram for d) at rtol and at a tighter
    tolerance: {"d", "beta", "systems", "rtol", "tight", "max_fraction_change" (over times and
    systems), "max_half_change" (per-system crossing times, finite ones), "same_censoring",
    "evaluations" (rtol, tight)}."""
    x0 = uniform_systems(systems, n, d, seed + d)
    loose, ev_loose = fraction_series(x0, beta, times, rtol)
    strict, ev_strict = fraction_series(x0, beta, times, tight)
    a, b = crossing_times(times, loose), crossing_times(times, strict)
    both = np.isfinite(a) & np.isfinite(b)
    return {"d": d, "beta": beta, "systems": systems, "rtol": rtol, "tight": tight,
            "max_fraction_change": float(np.abs(loose - strict).max()),
            "max_half_change": float(np.abs(a - b)[both].max()) if both.any() else 0.0,
            "same_censoring": bool(np.array_equal(np.isfinite(a), np.isfinite(b))),
            "evaluations": (ev_loose, ev_strict)}


def two_token_link_time(c0, beta, threshold=CLUSTER_THRESHOLD):
    """The time at which two tokens with ⟨x₁, x₂⟩ = c0 < threshold reach ⟨x₁, x₂⟩ = threshold
    (B = V = I, normalised attention; module docstring), by quadrature."""
    from scipy.integrate import quad

    def rate(c):
        return (1.0 + math.exp(beta * (1.0 - c))) / (2.0 * (1.0 - c * c))

    value, _ = quad(rate, c0, threshold, limit=200, epsabs=0.0, epsrel=1e-11)
    return value


def _edges(centres, log=False):
    """Cell edges around grid centres (midpoints; geometric midpoints for log), the ends mirrored."""
    c = np.log(centres) if log else np.asarray(centres, dtype=float)
    mid = (c[1:] + c[:-1]) / 2
    e = np.concatenate([[2 * c[0] - mid[0]], mid, [2 * c[-1] - mid[-1]]])
    return np.exp(e) if log else e


def figure(result, path):
    """One panel per d: t across, β up (log), colour the mean clustered fraction, a contour at ½."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dims = result["dimensions"]
    times, betas = result["times"], result["betas"]
    fig, axes = plt.subplots(1, len(dims), figsize=(4.2 * len(dims) + 1.0, 3.8), sharey=True, squeeze=False,
                             layout="constrained")
    image = None
    for ax, d, frac in zip(axes[0], dims, result["fraction"]):
        image = ax.pcolormesh(_edges(times), _edges(betas, log=True), frac, cmap="RdBu_r", vmin=0.0, vmax=1.0,
                              rasterized=True)
        ax.contour(times, betas, frac, levels=[LEVEL], colors="k", linewidths=1.5)
        ax.set_yscale("log")
        ax.set_xlabel("$t$")
        ax.set_title(f"$d = {d}$ ({result['systems'][d]} systems)")
    axes[0, 0].set_ylabel(r"$\beta$")
    fig.colorbar(image, ax=axes[0].tolist(), label=r"fraction of pairs with $\langle x_i, x_j\rangle \geq 0.999$")
    fig.suptitle(f"$n = {result['n']}$ tokens uniform on $S^{{d-1}}$, $B = V = I$; black line: fraction 1/2")
    fig.savefig(path, dpi=130)
    plt.close(fig)


def dataset(result):
    """The numbers behind the figure and the table as an xarray Dataset (written as rotf.nc)."""
    import xarray as xr

    dims, betas = result["dimensions"], result["betas"]
    half = np.array([[result["half"][(d, b)] for b in betas] for d in dims])  # (D, B, 3)
    return xr.Dataset(
        {"clustered_fraction": (("dimension", "beta", "time"), result["fraction"],
                                {"long_name": "fraction of pairs with <x_i, x_j> >= 0.999, mean over systems"}),
         "half_time": (("dimension", "beta"), half[..., 0], {"long_name": "time the mean fraction reaches 1/2"}),
         "half_time_low": (("dimension", "beta"), half[..., 1], {"long_name": "2.5 % bootstrap percentile"}),
         "half_time_high": (("dimension", "beta"), half[..., 2], {"long_name": "97.5 % bootstrap percentile"}),
         "systems": (("dimension",), [result["systems"][d] for d in dims])},
        coords={"dimension": list(dims), "beta": betas, "time": result["times"]},
        attrs={"n_tokens": result["n"], "rtol": result["rtol"], "B": "identity", "V": "identity"})


def _time_text(t):
    return "> t_end" if math.isinf(t) else f"{t:.2f}"


def report(result, wall, command):
    """The Markdown report (module docstring for the setting)."""
    times = result["times"]
    lines = ["# The rotf phase diagram: clustering of n = 32 tokens against β and t", "",
             f"`{command}` ({wall:.0f} s wall time on this machine's 2 shared CPU cores). Geshkovski, Letrouit, "
             "Polyanskiy & Rigollet, \"A mathematical perspective on Transformers\" (arXiv 2312.10794), "
             "borjanG/2023-transformers-rotf phase-diagrams.py.", "",
             "## Setting", "",
             f"- n = {result['n']} tokens i.i.d. uniform on S^(d−1), d ∈ {{{', '.join(map(str, result['dimensions']))}}}; "
             "Q = K = V = I_d, i.e. B = QᵀK = I and V = I; normalised (softmax) attention, no noise, one layer.",
             "- Independent systems batched in one (M, n, d) array per (d, β), the same draws for every β of a d: "
             + ", ".join(f"M = {m} for d = {d}" for d, m in result["systems"].items()) + " (the rotf code: 2 048). "
             "d = 128 runs exactly in the 32-dimensional span of each system's tokens "
             "(spherepde.validation.rotf.span_coordinates).",
             f"- β log-spaced, {len(result['betas'])} values from {result['betas'][0]:g} to {result['betas'][-1]:g}; "
             f"saves at t = 0, {times[1]:g}, …, {times[-1]:g}.",
             f"- Time stepping: dopri5 (spherepde's particle solver), rtol {result['rtol']:g}, per-system steps. "
             "The rotf code takes explicit normalised steps of 0.1 instead.",
             "- Colour: the fraction of the n(n−1)/2 pairs with ⟨xᵢ, xⱼ⟩ ≥ 0.999, averaged over the systems.", "",
             "![phase diagram](phase_diagram.png)", "",
             "## Time at which the fraction of clustered pairs reaches ½", "",
             "t½: where the mean over systems crosses ½ (linear between saves), with the 95 % interval of a "
             f"bootstrap over systems ({BOOTSTRAP} resamples). Per system: the median and the 2.5–97.5 % range of each "
             "system's own crossing time, and the share of systems that cross by t_end.", "",
             "| d | β | t½ of the mean [95 %] | per system: median [2.5 %, 97.5 %] | systems crossed | "
             "field evaluations | seconds |",
             "|---|---|---|---|---|---|---|"]
    for d in result["dimensions"]:
        for beta in result["betas"]:
            t, lo, hi = result["half"][(d, beta)]
            own = result["system_half"][(d, beta)]
            q = np.percentile(own, [50, 2.5, 97.5], method="inverted_cdf")
            lines.append(f"| {d} | {beta:.3g} | {_time_text(t)} [{_time_text(lo)}, {_time_text(hi)}] | "
                         f"{_time_text(q[0])} [{_time_text(q[1])}, {_time_text(q[2])}] | "
                         f"{np.mean(np.isfinite(own)):.1%} | {result['evaluations'][(d, beta)]} | "
                         f"{result['seconds'][(d, beta)]:.1f} |")
    check = result.get("check")
    if check is not None:
        lines += ["", "## Time-step check", "",
                  f"d = {check['d']}, β = {check['beta']:.3g} (a slow transition), the first {check['systems']} systems "
                  f"again at rtol {check['tight']:g} ({check['evaluations'][1]} field evaluations) against rtol "
                  f"{check['rtol']:g} ({check['evaluations'][0]}): largest change of a system's clustered fraction at "
                  f"a save time {check['max_fraction_change']:.3g}, of a system's crossing time "
                  f"{check['max_half_change']:.3g}; the same systems cross by t_end: "
                  f"{'yes' if check['same_censoring'] else 'no'}."]
    lines += ["", "## What the picture shows", "", *_observations(result), ""]
    return "\n".join(lines)


def _observations(result):
    """Sentences computed from the numbers (no claim that the data do not carry)."""
    out = []
    betas, t_end = result["betas"], result["times"][-1]
    for d in result["dimensions"]:
        half = np.array([result["half"][(d, b)][0] for b in betas])
        finite = np.isfinite(half)
        rising = bool(np.all(np.diff(half[finite]) >= -1e-9)) and bool(np.all(finite[:finite.sum()]))
        text = f"- d = {d}: t½ = {half[0]:.2f} at β = {betas[0]:.3g}"
        if finite.any():
            last = np.flatnonzero(finite)[-1]
            text += f", {half[last]:.2f} at β = {betas[last]:.3g}"
        if (~finite).any():
            text += f"; the mean fraction stays below ½ up to t = {t_end:g} for β ≥ {betas[~finite][0]:.3g}"
        out.append(text + f"; t½ {'non-decreasing' if rising else 'not monotone'} in β over the grid.")
    spacing = result["times"][1] - result["times"][0]
    out += ["", f"Resolution: saves are {spacing:g} apart and crossing times are interpolated linearly between them; "
            "where every pair of every system links within one save interval (d = 128 at small β: the tokens, "
            "almost orthogonal, move together to their mean) the crossing lands mid-interval and its bootstrap "
            "interval says nothing about the true time within it.",
            "",
            "Reading: at small β the weights are nearly uniform and every token moves toward its system's mean, so "
            "one cluster forms at a time that depends little on β. At large β each token attends mostly to itself "
            "and its nearest neighbours: clusters form locally and merge late (the metastability described by "
            "Geshkovski et al.), so the time to reach a clustered majority of pairs grows with β, and beyond some β "
            "it exceeds the window. In high d the tokens start almost orthogonal (⟨x_i, x_j⟩ ≈ 0 ± 1/√d): no "
            "token has a near neighbour to cluster with first, each attends to itself with weight ≈ e^β/(e^β + n − 1) "
            "and to the others about equally, and the system contracts as a whole, later as β grows; on the circle "
            "(d = 2) near neighbours exist from the start and local clusters form and persist."]
    return out


def run_suite(out, quick=False, progress=True):
    """Write OUT/rotf.md, OUT/phase_diagram.png and OUT/rotf.nc (quick: QUICK's systems, β grid
    and saves)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    say = (lambda m: print(m, flush=True)) if progress else None
    options = QUICK if quick else {"systems": SYSTEMS, "betas": BETAS, "saves": SAVES}
    start = time.perf_counter()
    result = phase_diagram(say=say, **options)
    beta = min(options["betas"], key=lambda b: abs(math.log(b / CHECK["beta"])))
    result["check"] = step_check(CHECK["d"], beta, min(CHECK["systems"], options["systems"][CHECK["d"]]),
                                 result["times"])
    wall = time.perf_counter() - start
    figure(result, out / "phase_diagram.png")
    dataset(result).to_netcdf(out / "rotf.nc")
    command = f"spherepde validate rotf{' --quick' if quick else ''}"
    (out / "rotf.md").write_text(report(result, wall, command))
    return result
