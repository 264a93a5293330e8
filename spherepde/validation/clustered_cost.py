"""Token runs with and without the clustered sums: the wall-time ratio, measured in one process.

    python -m spherepde.validation.clustered_cost [--beta 10] [--n 8000] [--dt 0.05] [--t-end 20] [--seed 1]

n tokens from the projected-normal law of the paper reproduction (paper matrices), RK4 with the
given step, to t_end; the same run twice, one right after the other: "auto" as shipped (the
clustered method once the clusters are tight, spherepde.summation.clustered), then with that
method switched off (CLUSTER_GAIN raised so that "auto" never takes it). Prints both wall times,
their ratio, the largest difference of the token positions over the run and the two F-onsets.
docs/performance.md ("Concentrated tokens") gives the measured table.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import xarray as xr

from spherepde.summation import clustered

from ..analysis.diagnostics import MeasureDiagnostics
from ..analysis.metrics import f_phase_onset
from ..models.attention import AttentionModel
from ..models.initial import ProjectedNormal
from ..solvers.particles import ParticleSolver, tokens_from_law

PAPER_V = np.diag([-1.0, 1.0, -2.0])
PAPER_B = np.diag([-1.0, -1.0, 1.0])
LAW = ProjectedNormal([0.3, 0.2, 0.1], [[1.0, 0.2, 0.0], [0.2, 0.8, 0.0], [0.0, 0.0, 0.6]])


def compare(beta=10.0, n=8000, dt=0.05, t_end=20.0, seed=1, save_every=0.1):
    """(wall with, wall without, largest position difference, onset with, onset without)."""
    x0, weights = tokens_from_law(LAW, n, seed=seed)
    model = AttentionModel(PAPER_B, PAPER_V, beta)
    runs = []
    gain = clustered.CLUSTER_GAIN
    try:
        for switch_off in (False, True):
            clustered.CLUSTER_GAIN = 10**18 if switch_off else gain
            start = time.perf_counter()
            ds = ParticleSolver(model, "rk4", dt).run(x0, weights, t_end, save_every)
            runs.append((time.perf_counter() - start, ds))
    finally:
        clustered.CLUSTER_GAIN = gain
    (wall_on, on), (wall_off, off) = runs
    diff = float(np.abs(on.positions.values - off.positions.values).max())
    onsets = []
    diagnostics = MeasureDiagnostics(model, x0, weights)
    for ds in (on, off):
        series = [diagnostics(x, weights) for x in ds.positions.values]
        onsets.append(f_phase_onset(xr.Dataset(
            {k: ("time", np.array([s[k] for s in series])) for k in ("alignment_E", "alignment_F")},
            coords={"time": ds.time.values})))
    return wall_on, wall_off, diff, onsets[0], onsets[1]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m spherepde.validation.clustered_cost", description=__doc__.split("\n")[0])
    ap.add_argument("--beta", type=float, default=10.0)
    ap.add_argument("--n", type=int, default=8000)
    ap.add_argument("--dt", type=float, default=0.05)
    ap.add_argument("--t-end", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    on, off, diff, onset_on, onset_off = compare(args.beta, args.n, args.dt, args.t_end, args.seed)
    print(f"β = {args.beta:g}, n = {args.n}, dt = {args.dt:g}, t ≤ {args.t_end:g}: clustered {on:.1f} s, "
          f"without {off:.1f} s, ratio {off / on:.2f}; largest position difference {diff:.2e}; "
          f"F-onset {onset_on:.6f} / {onset_off:.6f}")


if __name__ == "__main__":
    main()
