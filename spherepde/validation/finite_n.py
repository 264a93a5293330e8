"""The finite-n study (`spherepde validate finite_n --out DIR [--quick]`, issue 38 item 6): how n
tokens' answer to the paper's question approaches (or not) the mean field's as n grows.

Per cell (law, β, n): n i.i.d. tokens of an initial law of solvers/paper_beta.toml (the projected
normal and the vMF law; the paper's matrices of solvers/paper_base.toml), SYSTEMS = 8 draws as ONE
batched run (`[particles] systems = 8`, seeds 1 … 8), dopri5 at rtol 1e-6 (at β = 10 and 30 it
equals dt = 0.01 RK4 to < 1e-6 in F-onset with ~5× fewer evaluations; at β = 1000 it is within
4e-4 of RK4 at dt = 0.0025 for half its evaluations, where dt = 0.01 RK4 is 0.05 late:
docs/performance.md#adaptive-particle-steps), saved every 0.1 to t_end (20; 30 at β = 1000).
Per cell and system the F-onset, the max alignment with E and min W₂(ρ_t, Π#ρ₀)
(spherepde.analysis.metrics); over the systems the mean and its 95 % Student-t interval
(spherepde.validation.ensembles); per (law, β) a least-squares fit of the F-onset against ln n
over every system with an onset (`log_n_fit`: slope ± 95 %); beside them the mean-field values
read from the committed atoms and paper reports (`mean_field_values`).

Resumable: each cell's run file is CACHE/{law}_beta{β}_n{n}.nc (default cache OUT/runs). A
complete file is reused, an interrupted one continued from its last snapshot (the runner's
resume), one written with another config replaced. `budget_s` stops starting new cells after
that many seconds, so the long default sweep (hours on 2 cores) can be spread over sessions; the
report always says which cells are missing or unfinished. Cells run cheapest first (by n, then β).

A run file saves the positions of every snapshot: 8 systems × n × 3 × 8 bytes × 201 snapshots,
about 77 MB at n = 2000 and 1.2 GB at n = 32 000 (the full default sweep ≈ 15 GB of cache).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
import tomllib
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..analysis.metrics import f_phase_onset, max_alignment, u_curve_minimum
from .common import REPO, beta_text
from .ensembles import interval, interval_text, onset_text

__all__ = ["Cell", "DEFAULT_NS", "QUICK_NS", "BETAS", "QUICK_BETAS", "LAWS", "SYSTEMS", "cells", "cell_config",
           "cell_path", "run_cells", "cell_metrics", "LogFit", "log_n_fit", "mean_field_values", "write_report",
           "run_suite", "main"]

DEFAULT_NS = (500, 1000, 2000, 4000, 8000, 16000, 32000)
QUICK_NS = (500, 1000, 2000)
BETAS = (10.0, 30.0, 1000.0)
QUICK_BETAS = (10.0, 30.0)
LAWS = ("projected_normal", "vmf")
SYSTEMS = 8
SEED = 1
RTOL = 1e-6
SAVE_EVERY = 0.1
T_END = {10.0: 20.0, 30.0: 20.0, 1000.0: 30.0}  # t_end per β (β = 1000: its onsets lie near 15–17)
PAPER_BETA = REPO / "solvers" / "paper_beta.toml"
PAPER_BASE = REPO / "solvers" / "paper_base.toml"
ATOMS_REPORT = REPO / "validation" / "reports" / "atoms" / "atoms.md"
PAPER_REPORT = REPO / "validation" / "reports" / "paper" / "report.md"
TAILS_REPORT = REPO / "validation" / "reports" / "tails" / "hybrid.md"
TAILS_RUNS = REPO / "validation" / "reports" / "tails" / "hybrid_runs"
QUANTITIES = {"onset": "F-onset", "max_E": "max alignment with E", "w2_min": "min W₂(ρ_t, Π#ρ₀)"}


class Cell(NamedTuple):
    law: str
    beta: float
    n: int

    @property
    def t_end(self) -> float:
        return T_END.get(self.beta, 20.0)


def cells(laws=LAWS, betas=BETAS, ns=DEFAULT_NS):
    """The cells of a study, cheapest first (by n, then β, then law)."""
    return [Cell(law, float(beta), int(n)) for n in sorted(ns) for beta in sorted(betas) for law in laws]


def _toml(path):
    with open(path, "rb") as fh:
        return tomllib.load(fh)


def _initial(law):
    """The [initial] table of a law of solvers/paper_beta.toml (by its label), without the label."""
    for entry in _toml(PAPER_BETA)["sweep"]["grid"]["initial"]:
        if entry["label"] == law:
            return {k: v for k, v in entry.items() if k != "label"}
    raise KeyError(f"{PAPER_BETA} has no initial law labelled {law!r}")


def cell_config(cell: Cell, systems=SYSTEMS) -> dict:
    """The resolved run config of one cell: the paper's matrices, the law, n tokens alone, systems
    draws batched (seeds SEED … SEED + systems − 1), dopri5, saved every SAVE_EVERY to t_end."""
    from ..runner.config import resolve

    base = _toml(PAPER_BASE)
    return resolve({
        "model": {"beta": cell.beta, "V": base["model"]["V"], "B": base["model"]["B"]},
        "initial": _initial(cell.law),
        "eulerian": {"enabled": False},
        "particles": {"mode": "tokens", "n": cell.n, "seed": SEED, "systems": systems, "scheme": "dopri5",
                      "dt": 0.01, "rtol": RTOL, "atol": 0.0},
        "time": {"t_end": cell.t_end, "save_every": SAVE_EVERY},
        "diagnostics": dict(base.get("diagnostics", {})),
    })


def cell_path(cache, cell: Cell) -> Path:
    return Path(cache) / f"{cell.law}_beta{beta_text(cell.beta)}_n{cell.n}.nc"


def _state(path):
    """"complete", "partial" (an interrupted run with snapshots) or "missing"."""
    from ..storage.runfile import RunFileError, open_run

    if not path.is_file():
        return "missing"
    try:
        ds = open_run(path)
    except RunFileError:
        return "missing"
    return "complete" if int(ds.attrs.get("complete", 0)) == 1 else "partial"


def run_cells(cache, todo, systems=SYSTEMS, budget_s=None, say=print, out=None):
    """Run every cell of todo into the cache folder (complete files reused, interrupted ones
    resumed, and, with out, cells whose summary OUT/cells/*.json exists skipped); with budget_s
    no new cell starts after that many seconds. A cell that completes gets its summary at once.
    Returns {cell: seconds of this call's run, or None when reused or not started}."""
    from ..runner.run import execute
    from ..storage.runfile import RunFileError

    cache = Path(cache)
    cache.mkdir(parents=True, exist_ok=True)
    start, spent = time.perf_counter(), {}
    for cell in todo:
        path = cell_path(cache, cell)
        state = _state(path)
        if out is not None and state != "complete" and read_summary(out, cell, systems) is not None:
            spent[cell] = None
            continue
        if state == "complete":
            try:  # complete with this config: reuse (execute(resume=True) checks the config)
                if execute(cell_config(cell, systems), path, progress=False, log=None, resume=True).get(
                        "already_complete"):
                    spent[cell] = None
                    continue
            except RunFileError as exc:
                say(f"  {path.name}: {exc}; run again")
                state = "missing"
        if budget_s is not None and time.perf_counter() - start > budget_s:
            say(f"  budget of {budget_s:.0f} s spent: {cell} not started")
            spent[cell] = None
            continue
        t0 = time.perf_counter()
        config = cell_config(cell, systems)
        say(f"  {path.name}: {'resuming' if state == 'partial' else 'running'}")
        try:
            execute(config, path, progress=False, log=None, resume=state == "partial")
        except RunFileError as exc:  # an interrupted file of another config: start over
            say(f"  {path.name}: {exc}; run again")
            execute(config, path, progress=False, log=None)
        spent[cell] = time.perf_counter() - t0
        if out is not None:
            write_summary(out, cell, cell_metrics(path), systems)
        say(f"  {path.name}: done in {spent[cell]:.0f} s")
    return spent


def summary_path(out, cell: Cell) -> Path:
    """The cell's committed summary: OUT/cells/<law>_beta<β>_n<n>.json."""
    return Path(out) / "cells" / f"{cell.law}_beta{beta_text(cell.beta)}_n{cell.n}.json"


def write_summary(out, cell: Cell, metrics, systems=SYSTEMS) -> Path:
    """Keep a complete cell's per-seed metrics (and the config that made them) as a small JSON
    beside the report, so the study outlives its run files (~77 MB per cell at n = 2 000)."""
    path = summary_path(out, cell)
    path.parent.mkdir(parents=True, exist_ok=True)
    plain = {k: ([None if isinstance(x, float) and math.isnan(x) else x for x in v] if isinstance(v, list) else v)
             for k, v in metrics.items()}
    path.write_text(json.dumps({"config": cell_config(cell, systems), **plain}, indent=1) + "\n")
    return path


def read_summary(out, cell: Cell, systems=SYSTEMS):
    """The committed metrics of a cell, or None when there is none for this cell's config."""
    path = summary_path(out, cell)
    if not path.is_file():
        return None
    from ..runner.config import difference

    data = json.loads(path.read_text())
    stored = data.pop("config", None)
    # the run files' rule: keys added since (at the value they imply) and idle keys do not count
    if stored is None or difference(stored, json.loads(json.dumps(cell_config(cell, systems)))) is not None:
        return None  # made by another config: run the cell again
    return {k: ([math.nan if x is None else x for x in v] if isinstance(v, list) else v) for k, v in data.items()}


def cell_metrics(path):
    """{"state", "wall", "evaluations", "onset", "max_E", "w2_min"} of one cell's run file (lists
    over its systems), or {"state": "missing"}."""
    from ..storage.runfile import RunFileError, open_run

    try:
        ds = open_run(path)
    except (RunFileError, FileNotFoundError):
        return {"state": "missing"}
    systems = ds.sizes.get("system", 1)
    out = {"state": "complete" if int(ds.attrs.get("complete", 0)) == 1 else "partial",
           "wall": float(ds.attrs.get("wall_seconds", math.nan)),
           "evaluations": int(ds.attrs.get("particle_field_evaluations", -1)),
           "t_reached": float(ds["time"].values[-1]), "onset": [], "max_E": [], "w2_min": []}
    for k in range(systems):
        one = ds.isel(system=k) if "system" in ds.dims else ds
        out["onset"].append(f_phase_onset(one, "particle_"))
        out["max_E"].append(max_alignment(one, "particle_")[0])
        out["w2_min"].append(u_curve_minimum(one, "particle_")[0])
    return out


class LogFit(NamedTuple):
    """onset ≈ intercept + slope · ln n, least squares over `points` values; half_width: the 95 %
    Student-t half-width of the slope (NaN with fewer than 3 points or one n)."""

    slope: float
    half_width: float
    intercept: float
    points: int
    ns: int


def log_n_fit(ns, values) -> LogFit:
    """Ordinary least squares of values against ln ns (pairs with a finite value only): slope,
    its standard error s/√Σ(u − ū)² (s² = residual sum of squares / (m − 2)) times t_{0.975, m−2}."""
    from scipy import stats

    pairs = [(math.log(n), v) for n, v in zip(ns, values) if v is not None and np.isfinite(v)]
    m = len(pairs)
    distinct = len({u for u, _ in pairs})
    if m < 2 or distinct < 2:
        return LogFit(math.nan, math.nan, math.nan, m, distinct)
    u = np.array([p[0] for p in pairs])
    y = np.array([p[1] for p in pairs])
    du = u - u.mean()
    slope = float(du @ (y - y.mean()) / (du @ du))
    intercept = float(y.mean() - slope * u.mean())
    if m < 3:
        return LogFit(slope, math.nan, intercept, m, distinct)
    residual = y - intercept - slope * u
    se = math.sqrt(float(residual @ residual) / (m - 2) / float(du @ du))
    return LogFit(slope, float(stats.t.ppf(0.975, m - 2) * se), intercept, m, distinct)


# ====================================================================== the mean-field values
def _cells_of(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _finest(text):
    """(the last of 'a / b / c' as a float or None for '—', how many values the cell holds)."""
    parts = text.split("/")
    try:
        return float(parts[-1].strip()), len(parts)
    except ValueError:
        return None, len(parts)


def tails_mean_field(law, beta, cache=TAILS_RUNS):
    """[(quantity, method label, value, source)] of the finest mesh with the tails from log f
    (couplings every 0.2) kept for this law and β in the tails report's cached runs
    (validation/reports/tails/hybrid_runs, spherepde.validation.tails.hybrid_report): F-onset and
    max alignment with E; [] where none is kept. The solver's defaults first (sigma atoms, tail
    cut, composed maps: the runs of solvers/sweeps/tails_sigma.toml), then points cut at the floor;
    an unfinished run only where its F-onset is already past."""
    from .tails import LAW_KINDS, RUN_FILE_SIGMA, RUN_FILE_VARIANT, hybrid_key, hybrid_summary

    name = LAW_KINDS[law]
    variants = {RUN_FILE_SIGMA: "sigma atoms, tail cut", RUN_FILE_VARIANT: "point atoms",
                "tails from log f, coupling every 0.2 (saves every 0.2)": "point atoms"}
    for variant, atoms in variants.items():
        for nside in (128, 64, 32, 16, 8):
            key = hybrid_key(cache, nside, float(beta), variant, name)
            if key.is_file():
                kept = json.loads(key.read_text())
                rows = kept["rows"]
                s = hybrid_summary(rows)
                if kept.get("partial", False) and not math.isfinite(s["onset"]):
                    continue  # stopped before its onset: a coarser mesh that got there says more
                label = f"Eulerian + tails from log f ({atoms}), nside {nside}, t ≤ {rows[-1]['t']:g}"
                report = TAILS_REPORT if float(beta) == 30.0 else TAILS_REPORT.with_name(f"hybrid_beta{beta:g}.md")
                source = report.relative_to(REPO) if Path(cache) == TAILS_RUNS else Path(cache)
                onset = s["onset"] if math.isfinite(s["onset"]) else None
                return [("onset", label, onset, source), ("max_E", label, s["e_max"], source)]
    return []


def mean_field_values(law, beta, reports=None, tails_cache=None):
    """{quantity: [(method label, value, source)]} of the mean-field runs in the committed reports
    (default: the atoms report, whose meshes are finer, then the paper report): for each report
    the finest mesh of each method's column ('particles' / 'quadrature particles' and 'Eulerian +
    atoms') in its rows of this law and β; first, the Eulerian solver with the tails from log f
    (tails_mean_field; default: with the default reports, the tails report's runs)."""
    if tails_cache is None and reports is None:
        tails_cache = TAILS_RUNS
    reports = reports if reports is not None else (ATOMS_REPORT, PAPER_REPORT)
    found = {q: [] for q in QUANTITIES}
    if tails_cache is not None:
        for quantity, label, value, source in tails_mean_field(law, beta, tails_cache):
            found[quantity].append((label, value, source))
    names = {v: k for k, v in QUANTITIES.items()}
    for report in reports:
        report = Path(report)
        if not report.is_file():
            continue
        header = None
        for line in report.read_text().splitlines():
            if not line.startswith("|"):
                header = None
                continue
            cells_ = _cells_of(line)
            if header is None:
                header = cells_
                continue
            if len(cells_) != len(header) or cells_[:2] != [law, beta_text(beta)] or cells_[2] not in names:
                continue
            listed = re.findall(r"nside ([\d /]+)\)", " ".join(header))  # the meshes, coarsest first
            meshes = [m.strip() for m in listed[0].split("/")] if listed else []
            for title, text in zip(header, cells_):
                if re.match(r"(quadrature )?particles|Eulerian \+ atoms", title) and "−" not in title:
                    value, count = _finest(text)
                    mesh = meshes[count - 1] if count <= len(meshes) else "?"
                    method = "quadrature particles" if "particles" in title else "Eulerian + atoms"
                    source = report.relative_to(REPO) if report.is_relative_to(REPO) else report
                    found[names[cells_[2]]].append((f"{method}, nside {mesh}", value, source))
        if any(label.startswith(("quadrature", "Eulerian + atoms")) for rows in found.values() for label, _, _ in rows):
            break  # the first report that has this case
    return found


# ====================================================================== the report
def _fmt(x, digits=3):
    return "—" if x is None or not np.isfinite(x) else f"{x:.{digits}f}"


def _fit_text(fit: LogFit):
    if not np.isfinite(fit.slope):
        return f"— ({fit.points} onsets at {fit.ns} n)"
    hw = "" if not np.isfinite(fit.half_width) else f" ± {fit.half_width:.3f}"
    return f"{fit.slope:+.3f}{hw} per e-fold of n ({fit.points} onsets at {fit.ns} n; intercept {fit.intercept:.2f})"


def figure(results, path, betas):
    """F-onset (mean ± 95 %) against n, one panel per β, one curve per law; the mean-field
    particles' onset as a dashed line where the reports have one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(betas), figsize=(4.6 * len(betas), 4.2), squeeze=False)
    colors = {"projected_normal": "C0", "vmf": "C1"}
    for ax, beta in zip(axes[0], betas):
        for law in LAWS:
            rows = sorted((c.n, m) for c, m in results.items() if c.law == law and c.beta == beta
                          and m["state"] == "complete")
            if rows:
                ivs = [interval(m["onset"]) for _, m in rows]
                ns = [n for (n, _), iv in zip(rows, ivs) if iv.count]
                mean = [iv.mean for iv in ivs if iv.count]
                err = [0.0 if not np.isfinite(iv.half_width) else iv.half_width for iv in ivs if iv.count]
                ax.errorbar(ns, mean, yerr=err, marker="o", capsize=3, color=colors[law], label=f"{law} (tokens)")
            onsets = mean_field_values(law, beta)["onset"]
            mf = [v for label, v, _ in onsets if "particles" in label]
            if mf and mf[0] is not None:
                ax.axhline(mf[0], ls="--", color=colors[law], lw=1, label=f"{law} (quadrature particles)")
            mf = [v for label, v, _ in onsets if "tails" in label]
            if mf and mf[0] is not None:
                ax.axhline(mf[0], ls=":", color=colors[law], lw=1.5, label=f"{law} (mean field, tails from log f)")
        ax.set_xscale("log")
        ticks = sorted({c.n for c in results if c.beta == beta})
        ax.set_xticks(ticks, [str(n) for n in ticks], rotation=45 if len(ticks) > 4 else 0)
        ax.minorticks_off()
        ax.set_xlabel("n (tokens per system)")
        ax.set_title(f"β = {beta_text(beta)}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("F-onset (mean ± 95 %, 8 seeds)")
    legend = {}  # every panel's entries once (the tails mean field is not in every panel)
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(out, results, todo, quick, info=()):
    """OUT/finite_n.md and OUT/onset_vs_n.png from results {cell: cell_metrics} of the cells todo."""
    out = Path(out)
    betas = sorted({c.beta for c in todo})
    ns = sorted({c.n for c in todo})
    lines = ["# The finite-n study: tokens against n beside the mean field", ""]
    if quick:
        lines += ["> **Quick run** (`--quick`): n ≤ 2000, β = 10 and 30 only.", ""]
    lines += [f"Tokens alone (no mesh): for each law of solvers/paper_beta.toml (paper matrices) and β, n i.i.d. tokens, "
              f"{SYSTEMS} seeds ({SEED} … {SEED + SYSTEMS - 1}) as one batched run (`[particles] systems = {SYSTEMS}`), "
              f"dopri5 at rtol {RTOL:g}, saved every {SAVE_EVERY} to t_end = "
              + ", ".join(f"{T_END.get(b, 20.0):g} (β = {beta_text(b)})" for b in betas)
              + ". Each entry: mean ± the 95 % Student-t half-width over the seeds; the F-onset over the seeds "
              "that have one by t_end (k of 8). The fit: least squares of every seed's F-onset against ln n.", "",
              "## What was run", ""] + list(info) + [""]
    missing = [c for c in todo if results[c]["state"] != "complete"]
    if missing:
        lines += ["**Cells missing from this report** (not run, or unfinished: `partial` means the run file stops at "
                  "the time shown and is continued by the next call):", ""]
        lines += [f"- {c.law}, β = {beta_text(c.beta)}, n = {c.n}: {results[c]['state']}"
                  + (f" (t = {results[c]['t_reached']:g} of {c.t_end:g})" if results[c]["state"] == "partial" else "")
                  for c in missing]
        lines.append("")
    for law in LAWS:
        for beta in betas:
            mf = mean_field_values(law, beta)
            lines += [f"## {law}, β = {beta_text(beta)}", "",
                      "| n | F-onset (seeds with one) | std of one seed | max alignment with E | min W₂(ρ_t, Π#ρ₀) "
                      "| field evaluations | wall (s) |", "|---|---|---|---|---|---|---|"]
            fit_n, fit_v = [], []
            for n in ns:
                cell = Cell(law, beta, n)
                m = results.get(cell, {"state": "missing"})
                if m["state"] != "complete":
                    lines.append(f"| {n} | {m['state']} | | | | | |")
                    continue
                iv = interval(m["onset"])
                fit_n += [n] * len(m["onset"])
                fit_v += m["onset"]
                lines.append(f"| {n} | {onset_text(m['onset'])} | {_fmt(iv.std, 2)} | "
                             f"{interval_text(interval(m['max_E']), 4)} | {interval_text(interval(m['w2_min']), 4)} | "
                             f"{m['evaluations']} | {m['wall']:.0f} |")
            for key in ("onset",):
                for label, value, source in mf[key]:
                    me = next((v for lab, v, _ in mf["max_E"] if lab == label), None)
                    w2 = next((v for lab, v, _ in mf["w2_min"] if lab == label), None)
                    # the reports' runs: t ≤ 20 unless the label says
                    onset = _fmt(value, 2) if value is not None else "none" if "t ≤" in label else "none by t = 20"
                    lines.append(f"| mean field: {label} ({source}) | {onset} | — | {_fmt(me, 4)} | "
                                 f"{_fmt(w2, 4)} | | |")
            if not mf["onset"]:
                lines.append("| mean field | not in the committed reports | | | | | |")
            lines += ["", f"F-onset against ln n: slope {_fit_text(log_n_fit(fit_n, fit_v))}.", ""]
    figure(results, out / "onset_vs_n.png", betas)
    lines += ["## F-onset against n", "", "![F-onset against n](onset_vs_n.png)", ""]
    path = out / "finite_n.md"
    path.write_text("\n".join(lines))
    return path


def run_suite(out, quick=False, progress=True, cache=None, ns=None, betas=None, budget_s=None, run=True,
              systems=SYSTEMS, notes=()):
    """Run (or reuse) the cells and write OUT/finite_n.md with OUT/onset_vs_n.png. cache: the run
    files' folder (default OUT/runs); ns, betas: override the lists (default: QUICK_* with quick,
    else DEFAULT_NS, BETAS); budget_s: start no new cell after that many seconds; run=False:
    report from the files in the cache only; notes: lines added to "What was run". Returns the
    report path."""
    from .paper import machine

    say = (lambda msg: print(msg, flush=True)) if progress else (lambda msg: None)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(cache) if cache else out / "runs"
    todo = cells(LAWS, betas or (QUICK_BETAS if quick else BETAS), ns or (QUICK_NS if quick else DEFAULT_NS))
    t0 = time.perf_counter()
    if run:
        run_cells(cache, todo, systems, budget_s, say, out)
    results = {}
    for c in todo:  # a complete run file first (its summary refreshed), then the committed summary
        metrics = cell_metrics(cell_path(cache, c))
        if metrics["state"] == "complete":
            write_summary(out, c, metrics, systems)
        else:
            metrics = read_summary(out, c, systems) or metrics
        results[c] = metrics
    done = sum(m["state"] == "complete" for m in results.values())
    flags = " --quick" if quick else ""
    walls = sum(m["wall"] for m in results.values() if m["state"] == "complete")
    how = (f"this call took {time.perf_counter() - t0:.0f} s" if run else
           "this call read the run files only (`--report-only`)")
    info = [f"- command: `spherepde validate finite_n{flags} --out DIR` (or `python -m spherepde.validation.finite_n`); "
            f"{how}, on {machine()}, shared with other jobs; the complete cells' run wall times sum to {walls:.0f} s",
            f"- {done} of {len(todo)} cells complete; each complete cell's per-seed metrics are kept in `cells/*.json` "
            f"beside this report (with the config that made them), so the study continues without its run files; "
            f"run files under `{cache}` (not part of the report), one per cell, reused when complete and resumed "
            f"when interrupted",
            "- wall (s): each run file's `wall_seconds` on the shared 2-core host (loaded: not a benchmark)",
            "- the mean-field rows are read from the committed reports: validation/reports/atoms/atoms.md where it "
            "has the case (finest mesh of its nside 16 / 32 / 64 runs), else validation/reports/paper/report.md "
            "(nside 16), and the Eulerian solver with the tails from log f (couplings every 0.2) from "
            "validation/reports/tails/hybrid.md (finest mesh kept; β = 30 only so far): the finite volumes alone are "
            "not converged in the mesh at β ≥ 30, and quadrature particles there are a finite-n system "
            "(docs/theory.md#tails-at-large-β)"] + list(notes)
    report = write_report(out, results, todo, quick, info)
    say(f"  report {report} ({done} of {len(todo)} cells complete)")
    return report


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m spherepde.validation.finite_n",
                                     description="The finite-n study: run (resumable) and report.")
    parser.add_argument("--out", required=True)
    parser.add_argument("--cache", help="run files' folder (default OUT/runs)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--n", type=int, nargs="+", help="override the list of n")
    parser.add_argument("--beta", type=float, nargs="+", help="override the list of β")
    parser.add_argument("--budget", type=float, help="start no new cell after this many seconds")
    parser.add_argument("--report-only", action="store_true", help="run nothing: report the cache")
    parser.add_argument("--note", action="append", default=[], help="a line added to the report's 'What was run'")
    args = parser.parse_args(argv)
    run_suite(args.out, args.quick, cache=args.cache, ns=args.n, betas=args.beta, budget_s=args.budget,
              run=not args.report_only, notes=[f"- {note}" for note in args.note])
    return 0


if __name__ == "__main__":
    sys.exit(main())
