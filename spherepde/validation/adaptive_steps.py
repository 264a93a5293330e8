"""Adaptive against fixed steps on the paper's token ensembles (issue 38 item 4):
`python -m spherepde.validation.adaptive_steps [n] [t_end] [seeds] [betas] [schemes]` prints a
Markdown table.

For the laws of solvers/paper_beta.toml (the projected normal and the vMF law about (1, 1, 1)/√3,
κ = 2; the paper's matrices V = diag(−1, 1, −2), B = diag(−1, −1, 1)), n tokens of each seed
(seeds 1, 2, …, sampled as `spherepde run` samples them: default_rng(seed)), one system each, run
alone as the token sweeps run them ([particles] summation "auto"), saved every 0.1 to t_end: the
F-onset and the max alignment with E (spherepde.analysis.metrics) of each scheme beside those of
fixed dt = 0.01 RK4 (the paper report's setting), its field evaluations and wall time. Schemes:
"rk4:DT" (fixed step DT), "dopri5:RTOL", "bs32:RTOL" (atol 0, first step 0.01).

`python -m spherepde.validation.adaptive_steps pairs`: the choice of pair, field evaluations
against accuracy on 200 tokens with no save time inside the run (pair_accuracy).
"""

from __future__ import annotations

import math
import sys
import time

import numpy as np
import xarray as xr

from ..analysis.diagnostics import alignment
from ..analysis.metrics import f_phase_onset, max_alignment
from ..models.attention import AttentionModel
from ..models.initial import ProjectedNormal, VonMisesFisher
from ..solvers.particles import ParticleSolver, tokens_from_law
from ..solvers.timeline import save_times

__all__ = ["PAPER_V", "PAPER_B", "LAWS", "measure", "table", "pair_accuracy", "main"]

PAPER_V = np.diag([-1.0, 1.0, -2.0])
PAPER_B = np.diag([-1.0, -1.0, 1.0])
LAWS = {
    "projected_normal": lambda: ProjectedNormal([0.3, 0.2, 0.1], [[1.0, 0.2, 0.0], [0.2, 0.8, 0.0], [0.0, 0.0, 0.6]]),
    "vmf": lambda: VonMisesFisher(np.ones(3) / math.sqrt(3.0), 2.0),
}
SAVE_EVERY = 0.1


def one_run(law, beta, seed, scheme, n, t_end):
    """{"onset", "max_E", "evaluations", "steps", "rejected", "seconds"} of one token run; scheme
    "rk4:0.01", "dopri5:1e-6", …"""
    name, value = scheme.split(":")
    model = AttentionModel(PAPER_B, PAPER_V, beta)
    x0, w = tokens_from_law(law, n, np.random.default_rng(seed))
    if name in ("rk4", "euler"):
        solver = ParticleSolver(model, name, float(value))
    else:
        solver = ParticleSolver(model, name, 0.01, rtol=float(value))
    times = save_times(t_end, SAVE_EVERY)
    e_series, f_series = [], []
    start = time.perf_counter()
    for _, _, x, _ in solver.snapshots(x0, w, times):
        e_series.append(alignment(x, w, model.E.basis))
        f_series.append(alignment(x, w, model.F.basis))
    seconds = time.perf_counter() - start
    ds = xr.Dataset({"alignment_E": ("time", e_series), "alignment_F": ("time", f_series)}, coords={"time": times})
    state = solver.step_state()
    return {"onset": f_phase_onset(ds), "max_E": max_alignment(ds)[0], "evaluations": solver.evaluations,
            "steps": None if state is None else int(state["steps"][0]),
            "rejected": None if state is None else int(state["steps_rejected"][0]), "seconds": seconds}


def measure(n=2000, t_end=20.0, seeds=(1, 2), betas=(10.0, 30.0, 1000.0),
            schemes=("rk4:0.01", "dopri5:1e-6", "bs32:1e-6"), laws=tuple(LAWS), log=None):
    """[(law, beta, seed, scheme, result)] of one_run for every combination (the reference scheme
    first); log: a callable that gets a line per run."""
    rows = []
    for law_name in laws:
        for beta in betas:
            for seed in seeds:
                for scheme in schemes:
                    result = one_run(LAWS[law_name](), beta, seed, scheme, n, t_end)
                    rows.append((law_name, beta, seed, scheme, result))
                    if log is not None:
                        log(f"{law_name} beta={beta:g} seed={seed} {scheme}: {result}")
    return rows


def table(rows, reference="rk4:0.01") -> str:
    """Markdown: per case and scheme the F-onset and max alignment (differences to the reference),
    evaluations, steps (rejected) and seconds."""
    ref = {(r[0], r[1], r[2]): r[4] for r in rows if r[3] == reference}
    header = ("| law | β | seed | scheme | F-onset | Δ onset | max align E | Δ max | evaluations | steps (rejected) "
              "| seconds |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|---|"]
    for law, beta, seed, scheme, res in rows:
        base = ref.get((law, beta, seed))
        d_on = d_max = ""
        if base is not None and scheme != reference:
            d_on = f"{res['onset'] - base['onset']:.1e}"
            d_max = f"{res['max_E'] - base['max_E']:.1e}"
        steps = "" if res["steps"] is None else f"{res['steps']} ({res['rejected']})"
        lines.append(f"| {law} | {beta:g} | {seed} | {scheme} | {res['onset']:.4f} | {d_on} | {res['max_E']:.5f} | "
                     f"{d_max} | {res['evaluations']} | {steps} | {res['seconds']:.1f} |")
    return "\n".join(lines)


def pair_accuracy(n=200, beta=30.0, t_end=10.0, law="projected_normal", seed=1, reference_dt=2.5e-4):
    """Markdown: field evaluations against the largest position error at t_end (one save, so no
    step is cut to land) of RK4 at dt 0.05, 0.02, 0.01 and both pairs at rtol 1e-4 … 1e-8, against
    RK4 at reference_dt; n tokens of the law, paper matrices."""
    model = AttentionModel(PAPER_B, PAPER_V, beta)
    x0, w = tokens_from_law(LAWS[law](), n, np.random.default_rng(seed))

    def end(solver):
        for _, _, x, _ in solver.snapshots(x0, w, [0.0, t_end]):
            pass
        return x

    reference = end(ParticleSolver(model, "rk4", reference_dt))
    lines = ["| scheme | setting | field evaluations | steps (rejected) | max position error at t_end |",
             "|---|---|---|---|---|"]
    for dt in (0.05, 0.02, 0.01):
        solver = ParticleSolver(model, "rk4", dt)
        error = np.abs(end(solver) - reference).max()
        lines.append(f"| rk4 | dt = {dt:g} | {solver.evaluations} | | {error:.1e} |")
    for name in ("bs32", "dopri5"):
        for rtol in (1e-4, 1e-5, 1e-6, 1e-7, 1e-8):
            solver = ParticleSolver(model, name, 0.01, rtol=rtol)
            error = np.abs(end(solver) - reference).max()
            state = solver.step_state()
            lines.append(f"| {name} | rtol = {rtol:g} | {solver.evaluations} | {state['steps'][0]} "
                         f"({state['steps_rejected'][0]}) | {error:.1e} |")
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["pairs"]:  # the pairs' accuracy against evaluations
        print("n = 200, beta = 30, projected normal, seed 1, t_end = 10, reference RK4 dt = 2.5e-4\n")
        print(pair_accuracy())
        return
    n = int(argv[0]) if len(argv) > 0 else 2000
    t_end = float(argv[1]) if len(argv) > 1 else 20.0
    seeds = tuple(int(s) for s in argv[2].split(",")) if len(argv) > 2 else (1, 2)
    betas = tuple(float(b) for b in argv[3].split(",")) if len(argv) > 3 else (10.0, 30.0, 1000.0)
    schemes = tuple(argv[4].split(",")) if len(argv) > 4 else ("rk4:0.01", "dopri5:1e-6", "bs32:1e-6")
    laws = tuple(argv[5].split(",")) if len(argv) > 5 else tuple(LAWS)
    rows = measure(n, t_end, seeds, betas, schemes, laws, log=lambda line: print(line, file=sys.stderr, flush=True))
    print(f"n = {n}, t_end = {t_end:g}, save every {SAVE_EVERY}, seeds {seeds}, one system per run\n")
    print(table(rows, schemes[0]))


if __name__ == "__main__":
    main()
