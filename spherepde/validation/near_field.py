"""Accuracy uniform in β: error of m_β and div v against the vMF closed form, with and without the
near-field correction (spherepde.summation.near_field), for β from 1 to 1e5 on nside 16 / 32 / 64.

    python -m spherepde.validation.near_field [--nside 16 32 64] [--out DIR]

The density is vMF(μ, κ = 4) (cell averages), B and V random non-symmetric, 300 random targets.
Exact: m_β = L(|w|) ŵ with w = βBᵀx + κμ (L the Langevin function) and the covariance of the
tilted vMF, C = (L/k) I + (1 − 3L/k − L²) ŵŵᵀ (k = |w|), in div v = β tr(P_x V C Bᵀ) − 2⟨x, V m⟩.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from spherepde.summation import attention_field
from spherepde.summation.near_field import NearField

from ..geometry.mesh import HealpixMesh
from ..models.attention import AttentionModel
from ..models.initial import VonMisesFisher

BETAS = (1.0, 10.0, 100.0, 1e3, 1e4, 1e5)
KAPPA = 4.0


def exact_mean_and_divergence(model, mu, kappa, x):
    """m_β and div_S v for the vMF density ∝ e^{κ⟨μ,y⟩} (module docstring)."""
    w = model.beta * x @ model.B + kappa * mu
    k = np.linalg.norm(w, axis=1)
    what = w / k[:, None]
    L = 1.0 / np.tanh(k) - 1.0 / k
    m = L[:, None] * what
    div = np.empty(len(x))
    for i in range(len(x)):
        C = (L[i] / k[i]) * np.eye(3) + (1.0 - 3.0 * L[i] / k[i] - L[i] ** 2) * np.outer(what[i], what[i])
        P = np.eye(3) - np.outer(x[i], x[i])
        div[i] = model.beta * np.trace(P @ model.V @ C @ model.B.T) - 2.0 * x[i] @ model.V @ m[i]
    return m, div


def errors(nside, beta, seed=0, ntargets=300):
    """Max errors (m before, m after, div before, div after, near-field build seconds)."""
    rng = np.random.default_rng(seed)
    model = AttentionModel(rng.normal(size=(3, 3)), rng.normal(size=(3, 3)), beta)
    mu = rng.normal(size=3)
    mu /= np.linalg.norm(mu)
    x = rng.normal(size=(ntargets, 3))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    mesh = HealpixMesh(nside)
    f = VonMisesFisher(mu, KAPPA).cell_averages(mesh)
    m_exact, d_exact = exact_mean_and_divergence(model, mu, KAPPA, x)
    start = time.perf_counter()
    near = NearField(mesh, model, x)
    build = time.perf_counter() - start
    out = []
    for nf in (None, near):
        _, d, m = attention_field(model, mesh.centroids, f * mesh.area, x, want_div=True, method="direct", near=nf)
        out.append((float(np.abs(m - m_exact).max()), float(np.abs(d - d_exact).max())))
    return out[0][0], out[1][0], out[0][1], out[1][1], build


def table(nsides):
    lines = ["| β | nside | m_β before | m_β after | div v before | div v after |",
             "|---:|---:|---:|---:|---:|---:|"]
    for beta in BETAS:
        for n in nsides:
            mb, ma, db, da, _ = errors(n, beta)
            lines.append(f"| {beta:g} | {n} | {mb:.2e} | {ma:.2e} | {db:.2e} | {da:.2e} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nside", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--out", help="also write DIR/near_field.md")
    args = parser.parse_args(argv)
    text = table(args.nside)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "near_field.md").write_text("# Near-field correction: vMF errors\n\n" + text + "\n")


if __name__ == "__main__":
    main()
