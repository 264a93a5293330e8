"""Benchmark: the paper's token update written with CBXpy against spherepde's ParticleSolver.

    python -m spherepde.validation.benchmark_cbx [--n 500 2000 8000] [--steps 100]   (needs `pip install cbx`,
    the `bench` extra)

CBXpy (cbx.dynamics.PolarCBO) computes a per-particle consensus c(x_i) = Σ_j x_j softmax_j(−k(x_i, x_j)
− α f(x_j)). With α = 0 and the kernel neg_log(x_i, x_j) = −β⟨x_i, B x_j⟩ (kernel_factor_mode
"const") the consensus is exactly the softmax mean m_β(x_i) of the attention dynamics. The CBO
drift step is replaced by the paper's tangent-projected update x ← (x + Δt P_x V m)/|x + Δt P_x V m|
(σ = 0: no noise), which spherepde's ParticleSolver(scheme="euler") implements with its numba
summation. Both start from the same tokens; after `steps` steps we report the largest difference
of the positions and both wall times, measured in the same run, and their ratio.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from ..models.attention import AttentionModel
from ..models.initial import Uniform
from ..solvers.particles import ParticleSolver, tokens_from_law

PAPER_V = np.diag([-1.0, 1.0, -2.0])
PAPER_B = np.diag([-1.0, -1.0, 1.0])


def cbx_dynamics(x0, model, dt):
    """A cbx PolarCBO whose consensus is the softmax mean and whose step is the paper's update."""
    from cbx.dynamics import PolarCBO
    from cbx.dynamics.polarcbo import kernel

    beta, B, V = model.beta, model.B, model.V

    class AttentionKernel(kernel):
        # cbx calls neg_log(x[:, None, ...], x[:, :, None, ...]): the first argument runs over
        # the sources j (axis 2), the second over the targets i (axis 1); result (M, i, j)
        def neg_log(self, sources, targets):
            return -beta * np.einsum("mid,de,mje->mij", targets[:, :, 0, :], B, sources[:, 0, :, :])

    class AttentionCBO(PolarCBO):
        def cbo_step(self):
            self.compute_consensus()  # self.consensus = m_β(x_i)
            x = self.x[self.particle_idx]
            u = self.consensus @ V.T
            step = x + self.dt * (u - np.sum(u * x, axis=-1, keepdims=True) * x)
            self.x[self.particle_idx] = step / np.linalg.norm(step, axis=-1, keepdims=True)

        inner_step = cbo_step

    return AttentionCBO(lambda x: np.zeros(x.shape[:-1]), f_dim="3D", x=x0[None].copy(), dt=dt,
                        alpha=0.0, sigma=0.0, kernel=AttentionKernel(), kernel_factor_mode="const",
                        max_it=10**9, verbosity=0)


def compare(n, steps=100, dt=0.01, beta=30.0, seed=0):
    model = AttentionModel(PAPER_B, PAPER_V, beta)
    x0, w = tokens_from_law(Uniform(), n, seed)
    ours = ParticleSolver(model, "euler", dt)
    ours.step(x0, None, w, dt)  # compile outside the timing
    start = time.perf_counter()
    x = x0
    for _ in range(steps):
        x, _ = ours.step(x, None, w, dt)
    t_ours = time.perf_counter() - start

    dyn = cbx_dynamics(x0, model, dt)
    start = time.perf_counter()
    for _ in range(steps):
        dyn.step()
    t_cbx = time.perf_counter() - start
    diff = float(np.abs(dyn.x[0] - x).max())
    return {"n": n, "steps": steps, "cbx_s": t_cbx, "ours_s": t_ours, "ratio": t_cbx / t_ours, "max_diff": diff}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, nargs="+", default=[500, 2000, 8000])
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args(argv)
    print("| n | steps | cbx (s) | spherepde (s) | cbx / spherepde | max |x_cbx − x_ours| |")
    print("|---:|---:|---:|---:|---:|---:|")
    rows = []
    for n in args.n:
        r = compare(n, args.steps)
        rows.append(r)
        print(f"| {r['n']} | {r['steps']} | {r['cbx_s']:.3f} | {r['ours_s']:.4f} | {r['ratio']:.1f}× | "
              f"{r['max_diff']:.1e} |", flush=True)
    return rows


if __name__ == "__main__":
    main()
