"""Attention sums with hierarchical pruning over a HEALPix NESTED tree of the sources.

At large β the softmax weights μ_j e^{β⟨Bᵀx, y_j⟩} of most sources are negligible: only the
sources within an angle θ of the direction â = Bᵀx/|Bᵀx|, β|Bᵀx|(1 − cos θ) ≲ log(1/tol), matter.
The sources (unit vectors) are sorted into the pixels of a HEALPix grid in NESTED order, so every
pixel of every coarser level is a contiguous range: a tree whose nodes carry the cap (centre c,
angular radius r) containing their sources and their total relative mass. For a node,

    Σ_{j ∈ node} 2^{e_j} ≤ 2^{λ_node + |a|(cos(max(0, θ_c − r)) − 1)},   θ_c = ∠(â, c),

with a = β log₂e Bᵀx, e_j = λ_j + ⟨a, y_j − â⟩ the centred base-2 exponents of
spherepde.attention and λ_node = log₂ Σ_node μ_j/max μ. A depth-first walk from the 12 base pixels
drops a node when this bound is below 2^{shift}·tol·2⁻⁷ (shift = the largest exponent met so far,
seeded by a greedy descent towards â) and sums the leaves it reaches exactly, with the same
vectorised block kernels as the direct sum. The bounds of the dropped nodes are added up; if at
the end they exceed tol × the computed sum, that target is recomputed by the direct sum. So the
neglected weight is at most tol·Z for every target: |Δm_β| ≤ 2 tol (|y| = 1) and the covariance,
hence div v, is off by at most ~4 tol·β‖V‖‖B‖ — rigorous, not estimated.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .attention import (SHIFT_SLACK, _block_max, _block_moments1, _block_moments2, _finish_target,
                        add_near_field,
                        source_arrays)
from .fastmath import LOG2E

__all__ = ["SourceTree", "tree_softmax", "LEAF_SIZE"]

LEAF_SIZE = 64  # sources per leaf pixel (on average): long enough for the vectorised block sums
PRUNE_MARGIN = 7.0  # a node is dropped below tol·2⁻⁷ of the running maximum (base 2)


class SourceTree:
    """Sources sorted into a HEALPix NESTED tree, with per-node caps and masses.

    Attributes: soa (4, n) sorted sources as in attention.source_arrays; depth (leaf level);
    node_start (nnodes + 1 per level, concatenated), node_cos_r, node_sin_r, node_centre (3, ·),
    node_log_mass (log₂ of the node's relative mass, −inf if empty); level_offset[ℓ] the first
    node of level ℓ in the concatenated arrays.
    """

    def __init__(self, sources, masses, leaf_size: int = LEAF_SIZE, soa=None):
        """soa: the sources as attention.source_arrays returns them, if already computed."""
        import healpy as hp

        if soa is None:
            soa, _, _ = source_arrays(sources, masses)
        n = soa.shape[1]
        self.depth = max(0, int(round(math.log(max(n / (12 * leaf_size), 1.0), 4))))
        nside = 2**self.depth
        pix = hp.vec2pix(nside, soa[0], soa[1], soa[2], nest=True)
        order = np.argsort(pix, kind="stable")
        self.soa = np.ascontiguousarray(soa[:, order])
        pix = pix[order]
        offsets, starts, centres, cos_r, sin_r, log_mass = [0], [], [], [], [], []
        lam = self.soa[3]
        for level in range(self.depth + 1):
            npix = 12 * 4**level
            node = pix >> (2 * (self.depth - level))
            bounds = np.searchsorted(node, np.arange(npix + 1))
            full = np.flatnonzero(np.diff(bounds) > 0)  # non-empty nodes tile the sorted sources
            first = bounds[full]

            def per_node(ufunc, values, empty):
                out = np.full(npix, empty, dtype=float)
                out[full] = ufunc.reduceat(values, first)
                return out

            # log₂ Σ 2^λ in log space: relative masses down to 2⁻²¹⁰⁰ must not underflow
            top = per_node(np.maximum, lam, -np.inf)
            rel = per_node(np.add, np.exp2(lam - top[node]), 0.0)
            with np.errstate(divide="ignore"):
                log_mass.append(np.where(rel > 0, top + np.log2(np.where(rel > 0, rel, 1.0)), -np.inf))
            vec = np.stack([per_node(np.add, self.soa[k], 0.0) for k in range(3)])
            norm = np.linalg.norm(vec, axis=0)
            centre = np.where(norm > 0, vec / np.where(norm > 0, norm, 1.0), 0.0)
            # cap radius: the smallest cosine of the angle between a source and its node's centre,
            # rounded outwards (a slightly larger cap keeps the bound an upper bound)
            cosines = np.sum(self.soa[:3] * centre[:, node], axis=0)
            min_cos = np.clip(per_node(np.minimum, cosines, 1.0) - 1e-12, -1.0, 1.0)
            starts.append(bounds)
            centres.append(centre)
            cos_r.append(min_cos)
            sin_r.append(np.sqrt(1.0 - min_cos * min_cos))
            offsets.append(offsets[-1] + npix)
        self.level_offset = np.array(offsets, dtype=np.int64)
        self.node_start = np.concatenate([b[:-1] for b in starts]).astype(np.int64)
        self.node_end = np.concatenate([b[1:] for b in starts]).astype(np.int64)
        self.node_centre = np.ascontiguousarray(np.concatenate(centres, axis=1))
        self.node_cos_r = np.concatenate(cos_r)
        self.node_sin_r = np.concatenate(sin_r)
        self.node_log_mass = np.concatenate(log_mass)


@njit(cache=True)
def _node_bound(a_norm, h0, h1, h2, k, centre, cos_r, sin_r, log_mass):
    """log₂ of the bound on Σ_node 2^{e_j}: λ_node + |a|(cos(max(0, θ − r)) − 1)."""
    ct = h0 * centre[0, k] + h1 * centre[1, k] + h2 * centre[2, k]
    if ct >= cos_r[k]:
        best = 1.0  # â inside the cap
    else:
        st = math.sqrt(max(0.0, 1.0 - ct * ct))
        best = ct * cos_r[k] + st * sin_r[k]  # cos(θ − r)
    return log_mass[k] + a_norm * (best - 1.0)


@njit(cache=True, parallel=True)
def tree_softmax(targets, BT, beta, soa, depth, level_offset, node_start, node_end, node_centre,
                 node_cos_r, node_sin_r, node_log_mass, V, tol, want_div,
                 velocity, divergence, mean, direct_fallbacks,
                 near_cells, near_delta, log2_factor):
    """The softmax sums of attention.softmax_blocked with pruning (module docstring); writes the
    same outputs, and direct_fallbacks[i] = 1 where the pruning bound failed and target i was
    summed directly."""
    ntarget = targets.shape[0]
    nsource = soa.shape[1]
    ys0, ys1, ys2, lws = soa[0], soa[1], soa[2], soa[3]
    scale = beta * LOG2E
    log_tol = math.log2(tol)
    nmom = 10 if want_div else 4
    for i in prange(ntarget):
        x0 = targets[i, 0]
        x1 = targets[i, 1]
        x2 = targets[i, 2]
        a0 = scale * (BT[0, 0] * x0 + BT[0, 1] * x1 + BT[0, 2] * x2)
        a1 = scale * (BT[1, 0] * x0 + BT[1, 1] * x1 + BT[1, 2] * x2)
        a2 = scale * (BT[2, 0] * x0 + BT[2, 1] * x1 + BT[2, 2] * x2)
        norm = math.sqrt(a0 * a0 + a1 * a1 + a2 * a2)
        h0 = h1 = h2 = 0.0
        if norm > 0:
            h0 = a0 / norm
            h1 = a1 / norm
            h2 = a2 / norm
        # seed the shift: greedy descent to the leaf with the best bound, exact max there
        best_k = -1
        best_b = -np.inf
        for p in range(12):
            b = _node_bound(norm, h0, h1, h2, p, node_centre, node_cos_r, node_sin_r, node_log_mass)
            if b > best_b:
                best_b = b
                best_k = p
        p = best_k
        for level in range(1, depth + 1):
            best_b = -np.inf
            child = 4 * p
            for c in range(4 * p, 4 * p + 4):
                k = level_offset[level] + c
                b = _node_bound(norm, h0, h1, h2, k, node_centre, node_cos_r, node_sin_r, node_log_mass)
                if b > best_b:
                    best_b = b
                    child = c
            p = child
        leaf = level_offset[depth] + p
        s0 = node_start[leaf]
        s1 = node_end[leaf]
        shift = _block_max(a0, a1, a2, h0, h1, h2, ys0[s0:s1], ys1[s0:s1], ys2[s0:s1], lws[s0:s1])
        # depth-first walk
        mom = np.zeros(nmom)
        pruned = 0.0  # Σ bounds of dropped nodes, in units of 2^shift
        stack_level = np.empty(12 + 3 * depth + 4, dtype=np.int64)
        stack_pix = np.empty(12 + 3 * depth + 4, dtype=np.int64)
        top = 0
        for p in range(11, -1, -1):
            stack_level[top] = 0
            stack_pix[top] = p
            top += 1
        while top > 0:
            top -= 1
            level = stack_level[top]
            p = stack_pix[top]
            k = level_offset[level] + p
            if node_end[k] == node_start[k]:
                continue
            b = _node_bound(norm, h0, h1, h2, k, node_centre, node_cos_r, node_sin_r, node_log_mass)
            if b - shift < log_tol - PRUNE_MARGIN:
                pruned += 2.0 ** (b - shift)
                continue
            if level < depth:
                for c in range(4 * p + 3, 4 * p - 1, -1):
                    stack_level[top] = level + 1
                    stack_pix[top] = c
                    top += 1
                continue
            s0 = node_start[k]
            s1 = node_end[k]
            y0 = ys0[s0:s1]
            y1 = ys1[s0:s1]
            y2 = ys2[s0:s1]
            lw = lws[s0:s1]
            if b - shift > SHIFT_SLACK:
                # the leaf may hold a much larger exponent: find it and rescale what was summed
                # so far. Otherwise its weights are ≤ 2^SHIFT_SLACK and the running shift serves
                # (the rounding error of the exponents stays ≤ SHIFT_SLACK·ε, as in softmax_blocked)
                m = _block_max(a0, a1, a2, h0, h1, h2, y0, y1, y2, lw)
                if m > shift:
                    factor = 2.0 ** (shift - m)
                    for q in range(nmom):
                        mom[q] *= factor
                    pruned *= factor
                    shift = m
            if want_div:
                r2 = _block_moments2(a0, a1, a2, h0, h1, h2, -shift, y0, y1, y2, lw)
                for q in range(10):
                    mom[q] += r2[q]
            else:
                r1 = _block_moments1(a0, a1, a2, h0, h1, h2, -shift, y0, y1, y2, lw)
                for q in range(4):
                    mom[q] += r1[q]
        direct_fallbacks[i] = 0
        if pruned > tol * mom[0]:  # the bound does not certify tol: sum this target directly
            direct_fallbacks[i] = 1
            shift = _block_max(a0, a1, a2, h0, h1, h2, ys0, ys1, ys2, lws)
            if want_div:
                r2 = _block_moments2(a0, a1, a2, h0, h1, h2, -shift, ys0, ys1, ys2, lws)
                for q in range(10):
                    mom[q] = r2[q]
            else:
                r1 = _block_moments1(a0, a1, a2, h0, h1, h2, -shift, ys0, ys1, ys2, lws)
                for q in range(4):
                    mom[q] = r1[q]
        add_near_field(i, mom, nmom, shift, near_cells, near_delta, log2_factor)
        _finish_target(i, x0, x1, x2, h0, h1, h2, mom, BT, beta, V, want_div, velocity, divergence, mean)
    return nsource
