"""The direct softmax sums of tokens on S^{d−1}, any d ≥ 2, for M independent systems at once.

For M systems of n tokens x_{k,i} ∈ S^{d−1} (the sources are the targets: every token attends to
the tokens of its own system) with masses μ_j > 0 shared by the systems (tokens: 1/n),

    m_β(x_{k,i}) = Σ_j ω_j x_{k,j},   ω_j ∝ μ_j e^{β⟨Bᵀx_{k,i}, x_{k,j}⟩},   v = P_x(V m_β),

and, optionally, log Z(x) = ln Σ_j μ_j e^{β⟨Bᵀx, x_{k,j}⟩} (the interaction energy and the
unnormalised field need it). Exact to rounding, O(n²) work per system.

Streaming (online) log-sum-exp, one pass over the sources: per target a running maximum r of
the base-2 exponents and accumulators z = Σ 2^(e_j − r), s = Σ 2^(e_j − r) d_j rescaled by
2^(r_old − r) whenever a block of sources raises r (the block-wise form of the online softmax
of Milakov & Gimelshein 2018, arXiv 1805.02867). No second pass for the maximum, no n × n array:
memory O(M n d) for the tokens plus a block buffer per thread.

As in spherepde.summation.kernels the exponents are centred, e_j = λ_j + ⟨a, y_j − â⟩ with
a = β log₂e Bᵀx, â = a/|a|, λ_j = log₂(μ_j/max μ): the rounding error of an exponent is then
~ε|a||y_j − â|, small where the weights are heavy at large β, and the moments are centred too,
m = â + Σw d/Σw (d = y − â). Weights come from the vectorised exp2 of spherepde.summation.fastmath,
their exponents clamped at −2000 (weights below 2^−957.5 are 0 anyway), so no range limit on β;
sources without mass have λ = −inf and weight 0.

Layout: the sources of system k are a structure of arrays soa[k] (d, n) (source_rows), so the
inner loops over a block of sources are contiguous and vectorise for every d; work items are
(system, block of targets) pairs, in parallel.

batched_hardmax is the β = ∞ token rule in any d: m(x) = y_j*, j* = argmax_{j: μ_j > 0} ⟨Bᵀx, y_j⟩.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .fastmath import LOG2E, exp2_weight, maxnum
from .kernels import LN2, SUMS

__all__ = ["batched_softmax", "batched_hardmax", "source_rows", "log2_masses", "BATCH_TARGETS",
           "BATCH_SOURCES", "EXPONENT_FLOOR"]

BATCH_TARGETS = 16  # targets per work item: enough items for the threads even at M = 1, n = 2000
BATCH_SOURCES = 512  # sources per block: the block's rows (d × 512 × 8 B) stay in L1/L2 for d ≤ 32
EXPONENT_FLOOR = -2000.0  # base 2: any weight this far below the maximum is 0 (exp2_weight: 2^−957.5)


def source_rows(x):
    """The tokens (M, n, d) as the kernels' source arrays (M, d, n), contiguous."""
    return np.ascontiguousarray(np.swapaxes(np.asarray(x, dtype=float), 1, 2))


def log2_masses(masses):
    """(λ (n,), ln max μ): λ_j = log₂(μ_j / max μ) ≤ 0, −inf where μ_j = 0 (such a source gets
    weight 0 exactly at any β: a finite floor would be beaten by β⟨a, y⟩ at large β). Raises if
    no mass is positive."""
    mu = np.asarray(masses, dtype=float)
    top = float(mu.max()) if mu.size else 0.0
    if not top > 0 or not np.all(np.isfinite(mu)) or np.any(mu < 0):
        raise ValueError("token masses must be finite, >= 0 and not all zero")
    with np.errstate(divide="ignore"):
        lam = np.log2(mu / top)
    return lam, math.log(top)


@njit(cache=True, fastmath=SUMS)
def _add_exponents(buf, row, aq, hq):
    """buf_j += a_q (y_qj − â_q) over one block (row: coordinate q of the block's sources)."""
    for j in range(buf.size):
        buf[j] += aq * (row[j] - hq)


@njit(cache=True, fastmath=SUMS)
def _block_max(buf):
    m = -np.inf
    for j in range(buf.size):
        m = maxnum(m, buf[j])
    return m


@njit(cache=True, fastmath=SUMS)
def _weights(buf, shift):
    """buf_j ← 2^(max(buf_j − shift, floor)); returns their sum. maxnum: a source without mass
    (−inf − (−inf) = NaN in a block of such sources) gets the floor, whose weight is 0."""
    z = 0.0
    for j in range(buf.size):
        w = exp2_weight(maxnum(buf[j] - shift, EXPONENT_FLOOR))
        buf[j] = w
        z += w
    return z


@njit(cache=True, fastmath=SUMS)
def _weighted_offsets(buf, row, hq):
    """Σ_j w_j (y_qj − â_q) over one block."""
    s = 0.0
    for j in range(buf.size):
        s += buf[j] * (row[j] - hq)
    return s


@njit(cache=True, parallel=True)
def batched_softmax(targets, soa, lam, BT, beta, V, velocity, logz, ln_top):
    """v = P_x(V m_β) at every token of every system (module docstring).

    targets (M, n, d) unit vectors; soa (M, d, n) the same tokens as source rows (source_rows);
    lam (n,) log₂ mass ratios (log2_masses); BT = Bᵀ (d, d); V (d, d). Writes velocity (M, n, d)
    and, when logz is not empty, logz (M, n) = ln Σ_j μ_j e^{β⟨Bᵀx, y_j⟩} (ln_top = ln max μ).
    """
    nsys, n, d = targets.shape
    nsource = soa.shape[2]
    scale = beta * LOG2E
    per_system = (n + BATCH_TARGETS - 1) // BATCH_TARGETS
    for item in prange(nsys * per_system):
        k = item // per_system
        i0 = (item % per_system) * BATCH_TARGETS
        i1 = min(i0 + BATCH_TARGETS, n)
        a = np.empty(d)
        h = np.empty(d)
        acc = np.empty(d)
        u = np.empty(d)
        buf = np.empty(BATCH_SOURCES)
        for i in range(i0, i1):
            norm2 = 0.0
            for p in range(d):
                s = 0.0
                for q in range(d):
                    s += BT[p, q] * targets[k, i, q]
                a[p] = scale * s
                norm2 += a[p] * a[p]
            norm = math.sqrt(norm2)
            for p in range(d):
                h[p] = a[p] / norm if norm > 0 else 0.0
                acc[p] = 0.0
            run = -np.inf  # running maximum of the exponents
            z = 0.0
            for s0 in range(0, nsource, BATCH_SOURCES):
                s1 = min(s0 + BATCH_SOURCES, nsource)
                block = buf[: s1 - s0]
                block[:] = lam[s0:s1]
                for q in range(d):
                    _add_exponents(block, soa[k, q, s0:s1], a[q], h[q])
                top = _block_max(block)
                if top > run:  # rescale what was summed under the old maximum
                    factor = 2.0 ** (run - top) if run > -np.inf else 0.0
                    z *= factor
                    for q in range(d):
                        acc[q] *= factor
                    run = top
                z += _weights(block, run)
                for q in range(d):
                    acc[q] += _weighted_offsets(block, soa[k, q, s0:s1], h[q])
            xu = 0.0
            for p in range(d):
                mp = 0.0
                for q in range(d):
                    mp += V[p, q] * (h[q] + acc[q] / z)
                u[p] = mp
                xu += targets[k, i, p] * mp
            for p in range(d):
                velocity[k, i, p] = u[p] - xu * targets[k, i, p]
            if logz.size:
                # Σ μ_j e^{β⟨Bᵀx, y_j⟩} = max μ · 2^(|a| + run) · z  (⟨a, â⟩ = |a|)
                logz[k, i] = LN2 * (math.log2(z) + run + norm) + ln_top


@njit(cache=True, parallel=True)
def batched_hardmax(targets, soa, lam, BT, V, velocity):
    """β = ∞ tokens in any d: m(x) = y_j*, j* = argmax over sources with positive mass
    (λ_j > −inf) of ⟨Bᵀx, y_j⟩ (first index on ties), v = P_x(V m). Arrays as
    batched_softmax."""
    nsys, n, d = targets.shape
    nsource = soa.shape[2]
    for item in prange(nsys * n):
        k = item // n
        i = item % n
        a = np.empty(d)
        for p in range(d):
            s = 0.0
            for q in range(d):
                s += BT[p, q] * targets[k, i, q]
            a[p] = s
        best = -np.inf
        arg = 0
        for j in range(nsource):
            if lam[j] > -np.inf:
                s = 0.0
                for q in range(d):
                    s += a[q] * soa[k, q, j]
                if s > best:
                    best = s
                    arg = j
        xu = 0.0
        for p in range(d):
            mp = 0.0
            for q in range(d):
                mp += V[p, q] * soa[k, q, arg]
            a[p] = mp  # reuse: u = V m
            xu += targets[k, i, p] * mp
        for p in range(d):
            velocity[k, i, p] = a[p] - xu * targets[k, i, p]
