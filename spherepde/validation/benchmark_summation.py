"""Benchmark: one velocity evaluation at all edge quadrature points, against nside.

    python -m spherepde.validation.benchmark_summation [--nside 16 32 64 128 256] [--beta 30 1000]

For each nside and β: the wall time of one attention_field call (velocity only, the cost of one
Runge–Kutta stage of the Eulerian solver) with targets = all edge quadrature points (4·npix) and
sources = the cell centroids, for the direct sum and for "auto" (the tree at large β), measured
in the same run; the largest difference of m_β between them; and the exponent p of a fit
time ∝ npix^p over the nsides, and over nside ≥ 64 where the methods have left their small-mesh
overheads behind (p = 2 for a direct sum). Where a full direct evaluation would take
long, it is timed on an evenly spread subset of targets and scaled to all of them (marked *).
Density: a smooth vMF bump plus a uniform floor (a mid-run state).
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from spherepde.summation import attention_field

from ..geometry.mesh import HealpixMesh
from ..models.attention import AttentionModel
from ..models.initial import Mixture, Uniform, VonMisesFisher

PAPER_V = np.diag([-1.0, 1.0, -2.0])
PAPER_B = np.diag([-1.0, -1.0, 1.0])
MAX_DIRECT_PAIRS = 2e10  # beyond this the direct sum is timed on a subset of targets


def best_time(fn, repeat=3):
    best = math.inf
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(nside, beta, mesh=None):
    mesh = mesh or HealpixMesh(nside)
    model = AttentionModel(PAPER_B, PAPER_V, beta)
    law = Mixture([0.7, 0.3], [VonMisesFisher([0.6, 0.3, 0.74], 8.0), Uniform()])
    masses = law.cell_averages(mesh) * mesh.area
    targets = mesh.edge_points.reshape(-1, 3)
    stats = {}
    attention_field(model, mesh.centroids, masses, targets[:64], method="auto")  # compile
    t_auto = best_time(lambda: attention_field(model, mesh.centroids, masses, targets, method="auto",
                                               stats=stats), repeat=2)
    auto = attention_field(model, mesh.centroids, masses, targets, method="auto")[2]
    pairs = targets.shape[0] * mesh.npix
    stride = max(1, int(math.ceil(pairs / MAX_DIRECT_PAIRS)))
    sub = targets[::stride]
    t_direct = best_time(lambda: attention_field(model, mesh.centroids, masses, sub, method="direct"),
                         repeat=2 if stride == 1 else 1) * (targets.shape[0] / sub.shape[0])
    direct = attention_field(model, mesh.centroids, masses, sub, method="direct")[2]
    diff = float(np.abs(auto[::stride] - direct).max())
    return {"nside": nside, "beta": beta, "npix": mesh.npix, "targets": targets.shape[0],
            "direct_s": t_direct, "scaled": stride > 1, "auto_s": t_auto, "method": stats.get("method"),
            "fallbacks": stats.get("fallbacks", 0), "max_dm": diff}


def fit_exponent(rows, key):
    n = np.array([r["npix"] for r in rows], dtype=float)
    t = np.array([r[key] for r in rows])
    return float(np.polyfit(np.log(n), np.log(t), 1)[0]) if len(rows) > 1 else float("nan")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nside", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--beta", type=float, nargs="+", default=[30.0, 1000.0])
    args = parser.parse_args(argv)
    meshes = {n: HealpixMesh(n) for n in args.nside}
    print("| β | nside | targets | direct (s) | auto (s) | method | direct / auto | max |Δm| |")
    print("|---:|---:|---:|---:|---:|---|---:|---:|")
    results = {}
    for beta in args.beta:
        rows = []
        for n in args.nside:
            r = measure(n, beta, meshes[n])
            rows.append(r)
            star = "*" if r["scaled"] else ""
            print(f"| {beta:g} | {n} | {r['targets']} | {r['direct_s']:.3f}{star} | {r['auto_s']:.3f} | "
                  f"{r['method']} | {r['direct_s'] / r['auto_s']:.1f} | {r['max_dm']:.1e} |", flush=True)
        results[beta] = rows
        print(f"| {beta:g} | fit | time ∝ npix^p | p = {fit_exponent(rows, 'direct_s'):.2f} | "
              f"p = {fit_exponent(rows, 'auto_s'):.2f} | | | |", flush=True)
        fine = [r for r in rows if r["nside"] >= 64]
        if 1 < len(fine) < len(rows):
            print(f"| {beta:g} | fit, nside ≥ 64 | | p = {fit_exponent(fine, 'direct_s'):.2f} | "
                  f"p = {fit_exponent(fine, 'auto_s'):.2f} | | | |", flush=True)
    return results


if __name__ == "__main__":
    main()
