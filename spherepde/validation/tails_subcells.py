"""How many children per cell g's paths need: v and div_S v of their sums with k × k children per
cell against a finer k, at the centroids of a run's saved states.

    python -m spherepde.validation.tails_subcells RUN.nc [--times 2,4,5.4] [--subcells 2,4,8,16]

Where the kernel is narrower than a cell, g's paths sum each cell as k² sources at its children's
centres with the log-linear profile of ln f (solvers.tails.log_linear_masses); the default k is the
power of two with h/k ≤ σ (subcells_for). This prints, for each saved state nearest the times
asked and each k but the last, the relative error |Δv|/|v| and the absolute error |Δ div_S v|
(1/time) against the last k, median, 90th percentile and largest over the tail cells (f below
1e-3 of the mesh's largest; the cells whose g the paths carry). An error of div v of e per unit time
moves g by e·Δt along a path, in units of ln f.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

TAIL_FRACTION = 1e-3  # the tail cells: f below this fraction of the mesh's largest f (the tails' level)


def field_with_subcells(model, mesh, interpolant, f, atom_x, atom_m, subcells, targets):
    """(v, div_S v) at targets of f dA (each cell as subcells² log-linear sources) + the atoms."""
    from ..solvers.tails import PATH_SUM_TOLERANCE, log_linear_masses, subcell_centres
    from ..summation import attention_field

    children = subcell_centres(mesh.nside, subcells)
    masses = log_linear_masses(interpolant, children, subcells, f, mesh.area)
    return attention_field(model, np.concatenate([children, atom_x]), np.concatenate([masses, atom_m]), targets,
                           want_div=True, tol=PATH_SUM_TOLERANCE)[:2]


def subcell_errors(model, mesh, f, atom_x, atom_m, subcells=(2, 4, 8, 16)):
    """Rows {subcells, v_p50, v_p90, v_max, div_p50, div_p90, div_max} of each k but the last
    against the last, over the tail cells' centroids (module docstring); with the tail's size."""
    from ..transport.semi_lagrangian import PolynomialInterpolant

    interpolant = PolynomialInterpolant(mesh, limited=True)
    targets = interpolant.centroids
    tail = np.flatnonzero(f < TAIL_FRACTION * f.max())
    fields = {k: field_with_subcells(model, mesh, interpolant, f, atom_x, atom_m, k, targets[tail]) for k in subcells}
    v_ref, div_ref = fields[subcells[-1]]
    speed = np.maximum(np.linalg.norm(v_ref, axis=1), 1e-300)
    rows = []
    for k in subcells[:-1]:
        v, div = fields[k]
        ev, ed = np.linalg.norm(v - v_ref, axis=1) / speed, np.abs(div - div_ref)
        rows.append({"subcells": k, "v_p50": float(np.median(ev)), "v_p90": float(np.percentile(ev, 90)),
                     "v_max": float(ev.max()), "div_p50": float(np.median(ed)),
                     "div_p90": float(np.percentile(ed, 90)), "div_max": float(ed.max())})
    return rows, int(tail.size)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a run file with tails (open_run)")
    parser.add_argument("--times", default="2,4", help="comma-separated times; the nearest saved states")
    parser.add_argument("--subcells", default="2,4,8,16", help="children per cell side, the last the reference")
    args = parser.parse_args(argv)
    from ..geometry.mesh import HealpixMesh
    from ..models.attention import AttentionModel
    from ..storage.runfile import open_run

    subcells = tuple(int(k) for k in args.subcells.split(","))
    with open_run(args.run) as ds:
        config = json.loads(ds.attrs["config"])
        m = config["model"]
        model = AttentionModel(np.array(m["B"]), np.array(m["V"]), m["beta"])
        mesh = HealpixMesh(config["eulerian"]["nside"])
        print(f"{args.run}: β = {m['beta']:g}, nside {mesh.nside}, reference k = {subcells[-1]}")
        print("| t | tail cells | k | relative error of v: p50 / p90 / max | error of div_S v (1/time): p50 / p90 / max |")
        print("|---|---|---|---|---|")
        for t in (float(s) for s in args.times.split(",")):
            i = int(np.argmin(np.abs(ds.time.values - t)))
            mass = ds.atom_mass.values[i]
            alive = mass > 0
            rows, cells = subcell_errors(model, mesh, ds.density.values[i], ds.atom_position.values[i][alive],
                                         mass[alive], subcells)
            for r in rows:
                print(f"| {float(ds.time.values[i]):g} | {cells} | {r['subcells']} | {r['v_p50']:.1e} / {r['v_p90']:.1e} / "
                      f"{r['v_max']:.1e} | {r['div_p50']:.1e} / {r['div_p90']:.1e} / {r['div_max']:.1e} |")


if __name__ == "__main__":
    main()
