"""Cost of one velocity evaluation along a concentrating run: why late states are expensive.

    python -m spherepde.validation.concentrated_cost RUN.nc [--nside 128] [--tolerances 1e-10 1e-8 1e-6]
                                          [--times 1 2 3 4 5 6] [--out DIR]

The densities of a run file (e.g. the exact-stage quick-start run that spherepde.validation.velocity_lag
keeps) at the given times, refined to --nside by giving each cell's value to its NESTED
children, are summed at all edge quadrature points of that mesh with "auto" at each summation
tolerance. Reported per time: the density range, the share of targets the harmonic expansion
hands back (its error estimate exceeds the tolerance where the density under a target's kernel
is tiny against the total: the sums span e^{2κ} and the small ones drown in the rounding of the
large ones), how they were re-summed, and the time against the direct sum, which is timed in the
same run on every 64th target and scaled.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import xarray as xr

from spherepde.summation import AttentionField, attention_field

from ..geometry.mesh import HealpixMesh
from ..models.attention import AttentionModel

PAPER_V = np.diag([-1.0, 1.0, -2.0])
PAPER_B = np.diag([-1.0, -1.0, 1.0])
DIRECT_STRIDE = 64


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--nside", type=int, default=128)
    parser.add_argument("--beta", type=float, default=30.0)
    parser.add_argument("--tolerances", type=float, nargs="+", default=[1e-10, 1e-8, 1e-6])
    parser.add_argument("--times", type=float, nargs="+", default=[1, 2, 3, 4, 5, 6])
    parser.add_argument("--out", type=Path, default=Path("validation/reports/summation"))
    args = parser.parse_args(argv)
    with xr.open_dataset(args.run) as ds:
        densities = {t: ds.density.sel(time=t, method="nearest").values for t in args.times}
        source_npix = ds.density.shape[-1]  # cell (or cells, in older files)
    mesh = HealpixMesh(args.nside)
    children = mesh.npix // source_npix
    model = AttentionModel(PAPER_B, PAPER_V, args.beta)
    targets = mesh.edge_points.reshape(-1, 3)
    fields = {tol: AttentionField(model, mesh, targets, tol=tol) for tol in args.tolerances}
    lines = [f"# One velocity evaluation at the {targets.shape[0]} edge points of nside {args.nside}, "
             f"β = {args.beta:g}, densities of {args.run.name}", "",
             f"`python -m spherepde.validation.concentrated_cost {' '.join(sys.argv[1:] if argv is None else argv)}`", "",
             "| t | min f | max f | direct (s, scaled) | " + " | ".join(
                 f"tol {tol:g}: s (×direct), re-summed" for tol in args.tolerances) + " |",
             "|---:|---:|---:|---:|" + "---:|" * len(args.tolerances)]
    # compile every path (direct, harmonic, tree re-summing) before anything is timed
    warm = np.repeat(densities[max(densities)], children)
    attention_field(model, mesh.centroids, warm * mesh.area, targets[:64], method="direct")
    for tol in args.tolerances:
        AttentionField(model, mesh, targets[::4096], tol=tol)(warm)
    for t, coarse in densities.items():
        f = np.repeat(coarse, children)
        sub = targets[::DIRECT_STRIDE]
        start = time.perf_counter()
        attention_field(model, mesh.centroids, f * mesh.area, sub, method="direct")
        direct = (time.perf_counter() - start) * targets.shape[0] / sub.shape[0]
        cells = [f"{t:g}", f"{f.min():.1e}", f"{f.max():.1e}", f"{direct:.1f}"]
        for tol, field in fields.items():
            start = time.perf_counter()
            field(f)
            wall = time.perf_counter() - start
            share = field.stats.get("fallbacks", 0) / targets.shape[0]
            how = field.stats.get("fallback_method") or "–"
            cells.append(f"{wall:.2f} ({direct / wall:.1f}×), {share:.0%} {how}")
        lines.append("| " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"concentrated_cost_nside{args.nside}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
