"""Cost of the direct attention sum per source–target pair, against the machine's FMA peak.

    python -m spherepde.validation.benchmark_attention [--nside 32 64] [--beta 30] [--repeats 3]

Setup (docs/theory.md#the-equation-and-its-conventions conventions): HealpixMesh(nside); targets = all edge quadrature points
(mesh.edge_points, 2 per edge, 4·npix of them), sources = the cell centroids with masses f·A of a
smooth density f = 1 + 5 e^{8(⟨μ, y⟩ − 1)} (uniform plus a von Mises–Fisher bump); β = 30;
fixed non-symmetric B = I + 0.3 G₁, V = I + 0.3 G₂ (G Gaussian, seed 0). Every timing is the
best of --repeats runs in the same process (other processes may share the machine), with numba's
default thread count. Columns, in ns per pair (time / (targets × sources)):

- fast: spherepde.summation.attention_field with method="direct" → softmax_blocked (all targets;
  the default "auto" would pick the harmonic expansion here);
- reference: softmax_direct_reference, the scalar libm-exp kernel it replaces (a subset of the
  targets at nside ≥ 64, scaled per pair);
- numpy: a plain NumPy/SciPy logsumexp, blocked over 256 targets so memory stays bounded (a
  subset of the targets, scaled per pair);
- bound: the FLOP bound, flops per pair / measured peak; and "x bound" = fast / bound;
- max|dm|/max|m|: fast against reference on m_β. Then an accuracy block: m_β and div_S v of
  fast, reference and numpy against an extended-precision (np.longdouble) evaluation.

FLOP bound. Floating-point operations per pair of the inner loop (spherepde.summation
.kernels.block_moments1/2 with spherepde.summation.fastmath.exp2_weight), an FMA counted as 2:
    centring d = y − â: 3; exponent c + λ + ⟨a, d⟩: 1 + 3 FMA = 7;
    exp2: rounding t = u + S, k = t − S, f = u − k: 3, degree-11 Horner: 11 FMA = 22, × 2^k: 1;
    moments, velocity: Σw 1 + Σw d 3 FMA = 7                          → 43 flop / pair;
    moments, with div: Σw 1, w·d 3, Σw d 3, Σw d dᵀ 6 FMA = 19         → 55 flop / pair
(plus 2 integer ops per pair for 2^k, and ~3 % extra for the sample that sets the shift).
The peak is measured, not assumed: a numba loop of independent FMAs on 64 doubles held in
registers, one per thread (GFLOP/s = 2 × FMAs / s). Its per-core rate divided by the nominal
16 flop/cycle of a core with two 256-bit FMA pipes (Zen 4; AVX-512 is double-pumped) gives the
implied clock. A tighter bound counts only the instructions that must go through the two FMA/
multiply pipes (18 per pair for velocity, 24 with div; the adds run on separate pipes) at the
measured FMA rate — "x FMA-port bound".
"""

from __future__ import annotations

import argparse
import re
import time

import numba
import numpy as np
from numba import njit, prange
from scipy.special import logsumexp

from spherepde import summation
from spherepde.geometry.mesh import HealpixMesh
from spherepde.models.attention import AttentionModel
from spherepde.summation import kernels

FLOPS_PER_PAIR = {False: 43, True: 55}
FMA_PORT_OPS_PER_PAIR = {False: 18, True: 24}
NOMINAL_FLOP_PER_CYCLE = 16  # 2 FMA pipes × 4 doubles (256 bit) × 2


# ------------------------------------------------------------------ machine peak
@njit(fastmath={"contract"})
def _fma_chains(x, reps, b, c):
    """64 independent FMA chains (8 zmm / 16 ymm registers after unrolling), reps deep.

    'contract' only: with 'reassoc' LLVM may fold two steps into one (x b² + (cb + c)).
    """
    for _ in range(reps):
        for j in range(64):
            x[j] = x[j] * b + c


@njit(fastmath={"contract"}, parallel=True)
def _fma_threads(reps, nthreads):
    out = np.empty(nthreads)
    for t in prange(nthreads):
        x = np.full(64, 1.0 + t)
        _fma_chains(x, reps, 0.999999, 1e-6)
        out[t] = x.sum()
    return out


def measure_peak(repeats=5, reps=4_000_000):
    """Measured GFLOP/s of independent FMAs: (all threads, one thread)."""
    nthreads = numba.get_num_threads()
    _fma_threads(10, nthreads)
    result = []
    for n in (nthreads, 1):
        best = min(_timed(lambda: _fma_threads(reps, n)) for _ in range(repeats))
        result.append(2 * 64 * reps * n / best / 1e9)
    return tuple(result)


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def vectorisation_report():
    """Packed FMAs in the inner loops, compiled afresh (cached code cannot be inspected)."""
    lines = []
    for name in ("block_moments1", "block_moments2"):
        kernel = njit(fastmath=kernels.SUMS)(getattr(kernels, name).py_func)
        y = np.zeros(64)
        kernel(1.0, 2.0, 3.0, 0.0, 0.0, 1.0, -1.0, y, y, y, y)
        asm = kernel.inspect_asm(kernel.signatures[0])
        zmm = len(re.findall(r"vfn?m(?:add|sub)\d+pd\s+[^\n]*%zmm", asm))
        ymm = len(re.findall(r"vfn?m(?:add|sub)\d+pd\s+[^\n]*%ymm", asm))
        scalar = len(re.findall(r"vfn?m(?:add|sub)\d+sd\s", asm))
        libm = len(re.findall(r"call\w*\s+\S*exp", asm))
        lines.append(f"{name}: packed FMAs {zmm} on zmm and {ymm} on ymm, {scalar} scalar FMAs "
                     f"(remainder loop), {libm} calls to exp")
    return lines


# ------------------------------------------------------------------ problem and references
def problem(nside, beta):
    mesh = HealpixMesh(nside)
    targets = np.ascontiguousarray(mesh.edge_points.reshape(-1, 3))
    sources = mesh.centroids
    mu = np.array([0.3, -0.5, 0.8]) / np.linalg.norm([0.3, -0.5, 0.8])
    masses = (1.0 + 5.0 * np.exp(8.0 * (sources @ mu - 1.0))) * mesh.area
    rng = np.random.default_rng(0)
    model = AttentionModel(np.eye(3) + 0.3 * rng.normal(size=(3, 3)),
                           np.eye(3) + 0.3 * rng.normal(size=(3, 3)), beta)
    return model, sources, masses, targets


def reference_kernel(model, sources, masses, targets, want_div):
    n = len(targets)
    out = (np.empty((n, 3)), np.empty(n), np.empty((n, 3)))
    summation.softmax_direct_reference(targets, np.ascontiguousarray(model.B.T), model.beta,
                                       sources, np.log(masses), model.V, want_div, *out, np.empty(0))
    return out


def numpy_softmax(model, sources, masses, targets, want_div, block=256):
    """Plain NumPy/SciPy logsumexp, blocked over targets (memory O(block · N))."""
    n = len(targets)
    velocity, divergence, mean = np.empty((n, 3)), np.empty(n), np.empty((n, 3))
    log_mass = np.log(masses)
    outer = (sources[:, :, None] * sources[:, None, :]).reshape(-1, 9)
    for i0 in range(0, n, block):
        x = targets[i0:i0 + block]
        logits = model.beta * (x @ model.B) @ sources.T + log_mass
        w = np.exp(logits - logsumexp(logits, axis=1, keepdims=True))
        m = w @ sources
        u = m @ model.V.T
        xu = np.sum(x * u, axis=1)
        mean[i0:i0 + block] = m
        velocity[i0:i0 + block] = u - xu[:, None] * x
        if want_div:
            C = (w @ outer).reshape(-1, 3, 3) - m[:, :, None] * m[:, None, :]
            K = np.einsum("ij,tjk,lk->til", model.V, C, model.B)
            tr = np.einsum("tii->t", K) - np.einsum("ti,tij,tj->t", x, K, x)
            divergence[i0:i0 + block] = model.beta * tr - 2 * xu
    return velocity, divergence, mean


def extended_precision(model, sources, masses, targets):
    """m and div in np.longdouble (x87 extended, ε = 2⁻⁶⁴): the exact answer for float64 data."""
    L = np.longdouble
    y, x, B, V = sources.astype(L), targets.astype(L), model.B.astype(L), model.V.astype(L)
    logits = L(model.beta) * (x @ B) @ y.T + np.log(masses.astype(L))
    w = np.exp(logits - logits.max(axis=1, keepdims=True))
    w /= w.sum(axis=1, keepdims=True)
    m = w @ y
    C = (w @ (y[:, :, None] * y[:, None, :]).reshape(-1, 9)).reshape(-1, 3, 3)
    C -= m[:, :, None] * m[:, None, :]
    u = m @ V.T
    K = np.einsum("ij,tjk,lk->til", V, C, B)
    tr = np.einsum("tii->t", K) - np.einsum("ti,tij,tj->t", x, K, x)
    div = L(model.beta) * tr - 2 * np.sum(x * u, axis=1)
    return m.astype(float), div.astype(float)


def ns_per_pair(fn, ntarget, nsource, repeats):
    fn()  # compile / warm up
    return min(_timed(fn) for _ in range(repeats)) / (ntarget * nsource) * 1e9


# ------------------------------------------------------------------ the table
def run(nsides=(32, 64), betas=(30.0,), repeats=3, ref_targets=49152, numpy_targets=4096,
        accuracy_targets=48):
    peak, peak1 = measure_peak()
    nthreads = numba.get_num_threads()
    print(f"numba threads: {nthreads}")
    print(f"measured FMA peak: {peak:.1f} GFLOP/s on {nthreads} threads, {peak1:.1f} on one "
          f"(implied clock {peak1 / NOMINAL_FLOP_PER_CYCLE:.2f} GHz at {NOMINAL_FLOP_PER_CYCLE} "
          f"flop/cycle/core)")
    for line in vectorisation_report():
        print(line)
    header = (f"{'nside':>5} {'beta':>6} {'div':>5} {'targets':>8} {'sources':>7} | {'fast':>6} "
              f"{'ref':>6} {'numpy':>6} | {'ref/fast':>8} {'np/fast':>7} | {'flop':>4} "
              f"{'bound':>6} {'x bound':>7} {'GFLOP/s':>7} {'% peak':>6} {'x FMA-port':>10} | "
              f"{'max|dm|/max|m|':>14}")
    print("ns per source–target pair (best of %d); bound = flop / measured peak" % repeats)
    print(header)
    print("-" * len(header))
    rows = []
    for nside in nsides:
        for beta in betas:
            model, sources, masses, targets = problem(nside, beta)
            nt, ns = len(targets), len(sources)
            sub_ref = targets[::max(1, nt // ref_targets)][:ref_targets]  # spread over the sphere
            sub_np = targets[::max(1, nt // numpy_targets)][:numpy_targets]
            for want_div in (False, True):
                fast = ns_per_pair(lambda: summation.attention_field(
                    model, sources, masses, targets, want_div=want_div, method="direct"), nt, ns, repeats)
                ref = ns_per_pair(lambda: reference_kernel(model, sources, masses, sub_ref,
                                                           want_div), len(sub_ref), ns, repeats)
                nump = ns_per_pair(lambda: numpy_softmax(model, sources, masses, sub_np,
                                                         want_div), len(sub_np), ns, repeats)
                m_fast = summation.attention_field(model, sources, masses, sub_ref, method="direct")[2]
                m_ref = reference_kernel(model, sources, masses, sub_ref, False)[2]
                dm = np.abs(m_fast - m_ref).max() / np.abs(m_ref).max()
                flop = FLOPS_PER_PAIR[want_div]
                bound = flop / peak  # ns per pair
                port_bound = FMA_PORT_OPS_PER_PAIR[want_div] / (peak / 2)
                row = dict(nside=nside, beta=beta, want_div=want_div, fast=fast, ref=ref,
                           numpy=nump, bound=bound, port_bound=port_bound, dm=dm)
                rows.append(row)
                print(f"{nside:>5} {beta:>6g} {str(want_div):>5} {nt:>8} {ns:>7} | {fast:>6.3f} "
                      f"{ref:>6.3f} {nump:>6.3f} | {ref / fast:>8.1f} {nump / fast:>7.1f} | "
                      f"{flop:>4} {bound:>6.3f} {fast / bound:>7.2f} {flop / fast:>7.1f} "
                      f"{100 * bound / fast:>5.0f}% {fast / port_bound:>10.2f} | {dm:>14.1e}",
                      flush=True)
    print(f"(reference on {ref_targets} and numpy on {numpy_targets} targets spread over the "
          f"sphere when there are more; max|dm| = fast vs reference on the reference's targets)")
    print(f"accuracy against extended precision ({accuracy_targets} targets spread over the "
          f"sphere): max|m − m_exact| (|y| = 1 sets the scale), max|div − div_exact| / max|div|")
    for nside in nsides:
        for beta in betas:
            model, sources, masses, targets = problem(nside, beta)
            x = targets[:: max(1, len(targets) // accuracy_targets)][:accuracy_targets]
            m_exact, div_exact = extended_precision(model, sources, masses, x)
            for name, (_, div, m) in (
                    ("fast", summation.attention_field(model, sources, masses, x, want_div=True,
                                                       method="direct")),
                    ("reference", reference_kernel(model, sources, masses, x, True)),
                    ("numpy", numpy_softmax(model, sources, masses, x, True))):
                dm = np.abs(m - m_exact).max()
                ddiv = np.abs(div - div_exact).max() / np.abs(div_exact).max()
                print(f"  nside {nside:>3} beta {beta:>6g} {name:>9}: m {dm:.1e}  div {ddiv:.1e}")
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nside", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--beta", type=float, nargs="+", default=[30.0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    run(args.nside, args.beta, args.repeats)


if __name__ == "__main__":
    main()
