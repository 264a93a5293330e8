"""Extrapolated velocities (`[eulerian] velocity_tolerance`): what the lag costs in accuracy, set
against the discretisation error of the mesh, and what it saves.

    python -m spherepde.validation.velocity_lag [--nside 16 32] [--tolerances 1e-2 1e-3 1e-4] [--t-end 6]
                                      [--out DIR]

The quick-start experiment (the paper's matrices, β = 30, uniform start) is run at each nside
with exact velocities at every Runge–Kutta stage (ε = 0) and with each tolerance ε. Reported per
run: wall time, exact edge-velocity evaluations, the largest measured relative edge-flux error
(velocity_lag_error), and the lag error: the L¹ distance ∫|f_ε − f_0| dA of the densities at the
save times (max over times), which is what the lag changes. The exact-stage runs are kept as
DIR/exact_stages_nside<N>.nc (git-ignored). The discretisation error of the
exact-stage run at nside N is estimated by the L¹ distance to the exact-stage run at 2N averaged
onto the nside-N cells (NESTED: the four children of cell p are 4p … 4p + 3).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from ..geometry.mesh import HealpixMesh
from ..models.attention import AttentionModel
from ..models.initial import Uniform
from ..solvers.eulerian import EulerianSolver

PAPER_B = np.diag([-1.0, -1.0, 1.0])
PAPER_V = np.diag([-1.0, 1.0, -2.0])
BETA = 30.0


def coarsen(f_fine):
    """Cell averages of a NESTED nside-2N density on the nside-N cells (equal areas)."""
    return f_fine.reshape(-1, 4).mean(axis=1)


def run(nside, eps, t_end, save_every):
    """(densities (time, cell), dataset, wall seconds, exact edge evaluations)."""
    mesh = HealpixMesh(nside)
    solver = EulerianSolver(mesh, AttentionModel(PAPER_B, PAPER_V, BETA), velocity_tolerance=eps)
    calls = [0]
    field = solver.velocity.edge_field

    def counted(f, **options):
        calls[0] += 1
        return field(f, **options)

    counted.forget_route = field.forget_route
    solver.velocity.edge_field = counted
    start = time.perf_counter()
    ds = solver.run(Uniform().cell_averages(mesh), t_end, save_every)
    return ds.density.values, ds, time.perf_counter() - start, calls[0], mesh.area


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nside", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--tolerances", type=float, nargs="+", default=[1e-2, 1e-3, 1e-4])
    parser.add_argument("--t-end", type=float, default=6.0)
    parser.add_argument("--save-every", type=float, default=0.25)
    parser.add_argument("--out", type=Path, default=Path("validation/reports/velocity_lag"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    lines = [f"# Extrapolated velocities: lag error against discretisation error (β = {BETA:g}, "
             f"uniform start, t ≤ {args.t_end:g})", "",
             "`python -m spherepde.validation.velocity_lag " + " ".join(sys.argv[1:] if argv is None else argv) + "`", "",
             "| nside | ε | wall (s) | speed-up | exact edge evaluations | steps | max measured flux error "
             "| lag error max_t ∫\\|f_ε − f_0\\| dA | discretisation error of f_0 (vs 2·nside) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for eps in (0.0, 1e-3):  # compile the kernels first: no run's wall time includes compilation
        run(4, eps, 0.2, 0.1)
    exact = {}
    for nside in sorted(args.nside):
        exact[nside] = run(nside, 0.0, args.t_end, args.save_every)
        exact[nside][1].to_netcdf(args.out / f"exact_stages_nside{nside}.nc")
    for nside in sorted(args.nside):
        f0, ds0, wall0, calls0, area = exact[nside]
        disc = "–"
        if 2 * nside in exact:
            fine = exact[2 * nside][0]
            disc = f"{max(area * np.abs(coarsen(fine[k]) - f0[k]).sum() for k in range(len(f0))):.2e}"
        lines.append(f"| {nside} | 0 | {wall0:.1f} | 1.0 | {calls0} | {int(ds0.steps.values[-1])} | 0 | 0 | {disc} |")
        for eps in args.tolerances:
            f, ds, wall, calls, _ = run(nside, eps, args.t_end, args.save_every)
            lag = max(area * np.abs(f[k] - f0[k]).sum() for k in range(len(f0)))
            lines.append(f"| {nside} | {eps:g} | {wall:.1f} | {wall0 / wall:.1f} | {calls} | "
                         f"{int(ds.steps.values[-1])} | {ds.velocity_lag_error.values.max():.1e} | {lag:.2e} | {disc} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    (args.out / "velocity_lag.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
