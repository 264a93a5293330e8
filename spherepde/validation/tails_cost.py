"""The cost of the tails from log f: CPU time of the same run with and without them, in one process.

    python -m spherepde.validation.tails_cost [--nside 16] [--t-end 10] [--law vmf] [--beta 30] [--variant '...']

The paper's matrices at β = 30 unless `--beta` says otherwise (the laws of
solvers/paper_beta.toml), Eulerian + atoms, saves every 0.2, no particles; run one after the
other in this process: the finite volumes alone (`tails = "finite_volume"`), then `tails = "log"` with its defaults, then each `--variant` (a
space-separated list of overrides, e.g. `--variant 'eulerian.tail_exclusion_width=0.0'`). Prints
each run's CPU time (`time.process_time`, so other jobs on the machine count little), its ratio to
the finite volumes' and its F-onset. The numba kernels are compiled by a short run first, so no
ratio pays for compilation. Issue 37's target: the tails at most 2× the finite volumes' cost.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

from .common import REPO

LAWS = {"projected_normal": {"kind": "projected_normal", "mean": [0.3, 0.2, 0.1],
                             "cov": [[1.0, 0.2, 0.0], [0.2, 0.8, 0.0], [0.0, 0.0, 0.6]]},
        "vmf": {"kind": "vmf", "mu": [0.57735026918962573] * 3, "kappa": 2.0}}


def config_for(nside, t_end, law, overrides=(), beta=30.0):
    """The resolved config of one run (β, paper matrices, saves every 0.2, no particles)."""
    from ..runner import config as C

    base = C.load(REPO / "solvers" / "atoms_base.toml")
    base.pop("particles", None)
    base["initial"] = dict(LAWS[law])
    # four atom slots per new sigma atom until its points merge, as the tail sweeps give
    over = [f"eulerian.nside={nside}", f"model.beta={beta!r}", f"time.t_end={t_end}", "time.save_every=0.2",
            "eulerian.max_atoms=128", *overrides]
    return C.resolve(C.apply_overrides(base, over))


def cpu_run(config, folder, name):
    """(CPU seconds, F-onset) of one run written to folder/name.nc."""
    from ..analysis.metrics import f_phase_onset
    from ..runner.run import execute
    from ..storage.runfile import open_run

    path = Path(folder) / f"{name}.nc"
    start = time.process_time()
    execute(config, str(path), progress=False, log=None)
    cpu = time.process_time() - start
    with open_run(path) as ds:
        onset = f_phase_onset(ds)
    return cpu, onset


def compare(nside=16, t_end=10.0, law="vmf", variants=(), say=print, beta=30.0):
    """Rows (label, CPU s, ratio to the finite volumes, F-onset) of the finite volumes, the tails'
    defaults and each variant (a tuple of overrides)."""
    runs = [("finite volumes + atoms", ['eulerian.tails="finite_volume"']), ('tails = "log", defaults', ['eulerian.tails="log"'])]
    runs += [(" ".join(v), ['eulerian.tails="log"', *v]) for v in variants]
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for _, over in runs[:2]:  # compile every kernel first
            cpu_run(config_for(max(4, nside // 4), 0.4, law, over, beta), folder, "warm")
        for label, over in runs:
            cpu, onset = cpu_run(config_for(nside, t_end, law, over, beta), folder, f"run{len(rows)}")
            rows.append((label, cpu, cpu / rows[0][1] if rows else 1.0, onset))
            say(f"  {label}: {cpu:.1f} s CPU")
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nside", type=int, default=16)
    parser.add_argument("--t-end", type=float, default=10.0)
    parser.add_argument("--law", choices=sorted(LAWS), default="vmf")
    parser.add_argument("--beta", type=float, default=30.0)
    parser.add_argument("--variant", action="append", default=[],
                        help="overrides of one more run with the tails, space-separated (repeatable)")
    args = parser.parse_args(argv)
    if not args.beta > 0:
        parser.exit(2, f"tails_cost: --beta must be positive, got {args.beta:g}\n")
    rows = compare(args.nside, args.t_end, args.law, [tuple(v.split()) for v in args.variant], beta=args.beta)
    print(f"| β = {args.beta:g}, {args.law}, nside {args.nside}, t ≤ {args.t_end:g} "
          "| CPU s | against the finite volumes | F-onset |")
    print("|---|---|---|---|")
    for label, cpu, ratio, onset in rows:
        print(f"| {label} | {cpu:.1f} | {ratio:.2f} | {'none' if math.isnan(onset) else f'{onset:.3f}'} |")


if __name__ == "__main__":
    main()
