"""Attention sums with hierarchical pruning over a HEALPix NESTED tree of the sources.

At large β the softmax weights μ_j e^{β⟨Bᵀx, y_j⟩} of most sources are negligible: only the
sources within an angle θ of the direction â = Bᵀx/|Bᵀx|, β|Bᵀx|(1 − cos θ) ≲ log(1/tol), matter.
The sources (unit vectors) are sorted into the pixels of a HEALPix grid in NESTED order, so every
pixel of every coarser level is a contiguous range: a tree whose nodes carry the cap (centre c,
angular radius r) containing their sources and their total relative mass. For a node,

    Σ_{j ∈ node} 2^{e_j} ≤ 2^{λ_node + |a|(cos(max(0, θ_c − r)) − 1)},   θ_c = ∠(â, c),

with a = β log₂e Bᵀx, e_j = λ_j + ⟨a, y_j − â⟩ the centred base-2 exponents of
spherepde.summation.kernels and λ_node = log₂ Σ_node μ_j/max μ. Targets go in groups of
TARGET_GROUP consecutive ones (NESTED-ordered edge points are close together): for the group's
cone of directions (centre ĉ, radius r_b, smallest |a|) the same form with θ_c − r − r_b bounds
every target of the group. One depth-first walk from the 12 base pixels per group drops a node when
that bound is below 2^{s}·tol·2⁻⁷, s the smallest of the targets' lower bounds of their largest
exponent (exact maxima over one leaf near ĉ); the kept leaves are gathered into one contiguous
buffer, and every target of the group is summed over it with the vectorised block kernels of the
direct sum. The bounds of the dropped nodes are added up; if they exceed tol × a target's
computed sum, that target is recomputed by the direct sum. So the neglected weight is at most
tol·Z for every target: |Δm_β| ≤ 2 tol (|y| = 1) and the covariance, hence div v, is off by at
most ~4 tol·β‖V‖‖B‖ — rigorous, not estimated.

Cost (β = 1000, nside 64, tol 1e-10): ~1 200 kept sources per target where ~700 carry weight
above the threshold (the rest: leaf granularity and the group's cone). One walk per 16 targets
instead of one per target, and the leaf lower bound as the shift (one pass over the sources
instead of two), made the method 2.2× faster (same run, shared machine).
"""

from __future__ import annotations

import math

import healpy as hp
import numpy as np
from numba import get_num_threads, njit, prange

from .fastmath import LOG2E
from .kernels import (
    SHIFT_SLACK,
    add_near_field,
    block_max,
    block_moments1,
    block_moments2,
    finish_target,
    kernel_direction,
    no_log_partition,
    no_near_field,
    source_arrays,
    store_log_partition,
)

__all__ = ["SourceTree", "tree_softmax", "tree_sums", "LEAF_SIZE"]

LEAF_SIZE = 16  # sources per leaf pixel (on average); leaves are gathered, so they can be small:
# 64 / 16 / 4 kept 1410 / 1170 / 1040 sources per target at nside 64, β = 1000
PRUNE_MARGIN = 7.0  # a node is dropped below tol·2⁻⁷ of the shift's lower bound (base 2)
TARGET_GROUP = 16  # targets sharing one walk of the tree
SORT_NSIDE = 1024  # the grid whose NESTED order the targets without a near field are summed in (3.4' pixels)


class SourceTree:
    """Sources sorted into a HEALPix NESTED tree, with per-node caps and masses.

    Attributes: soa (4, n) sorted sources as in kernels.source_arrays; depth (leaf level);
    node_start (nnodes + 1 per level, concatenated), node_cos_r, node_sin_r, node_centre (3, ·),
    node_log_mass (log₂ of the node's relative mass, −inf if empty); level_offset[ℓ] the first
    node of level ℓ in the concatenated arrays.
    """

    def __init__(self, sources, masses, leaf_size: int = LEAF_SIZE, soa=None):
        """soa: the sources as kernels.source_arrays returns them, if already computed."""
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
def _cone_bound(a_min, c0, c1, c2, cos_rb, sin_rb, k, centre, cos_r, sin_r, log_mass):
    """log₂ of a bound on Σ_node 2^{e_j} valid for every target whose â lies within r_b of
    ĉ = (c0, c1, c2) and whose |a| ≥ a_min: λ_node + a_min(cos(max(0, θ − R)) − 1), θ = ∠(ĉ, c),
    R = r + r_b (no transcendental functions: cos(θ − R) = cos θ cos R + sin θ sin R)."""
    cos_big = cos_r[k] * cos_rb - sin_r[k] * sin_rb  # cos R
    sin_big = sin_r[k] * cos_rb + cos_r[k] * sin_rb  # sin R < 0: R > π, the cap is the sphere
    ct = c0 * centre[0, k] + c1 * centre[1, k] + c2 * centre[2, k]
    if sin_big < 0.0 or ct >= cos_big:
        best = 1.0
    else:
        st = math.sqrt(max(0.0, 1.0 - ct * ct))
        best = ct * cos_big + st * sin_big
    return log_mass[k] + a_min * (best - 1.0)


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


@njit(cache=True)
def _greedy_leaf(norm, h0, h1, h2, depth, level_offset, node_centre, node_cos_r, node_sin_r,
                 node_log_mass):
    """The leaf reached by descending from the base pixels to the child with the best bound
    (for |a| = norm, â = (h0, h1, h2)): its sources hold a large exponent."""
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
    return level_offset[depth] + p


@njit(cache=True)
def _sum_shifted(a0, a1, a2, h0, h1, h2, shift, y0, y1, y2, lw, want_div, mom):
    """mom = Σ_j 2^(λ_j + ⟨a, d_j⟩ − shift)(1, d_j[, d_j d_jᵀ]) over the given sources."""
    if want_div:
        r2 = block_moments2(a0, a1, a2, h0, h1, h2, -shift, y0, y1, y2, lw)
        for q in range(10):
            mom[q] = r2[q]
    else:
        r1 = block_moments1(a0, a1, a2, h0, h1, h2, -shift, y0, y1, y2, lw)
        for q in range(4):
            mom[q] = r1[q]


@njit(cache=True)
def _sum_target(a0, a1, a2, h0, h1, h2, y0, y1, y2, lw, want_div, mom):
    """_sum_shifted with the sources' exact largest exponent as the shift (returned)."""
    shift = block_max(a0, a1, a2, h0, h1, h2, y0, y1, y2, lw)
    _sum_shifted(a0, a1, a2, h0, h1, h2, shift, y0, y1, y2, lw, want_div, mom)
    return shift


@njit(cache=True, parallel=True)
def tree_softmax(targets, BT, beta, soa, depth, level_offset, node_start, node_end, node_centre,
                 node_cos_r, node_sin_r, node_log_mass, V, tol, want_div,
                 velocity, divergence, mean, direct_fallbacks,
                 near_cells, near_delta, log2_factor, nthreads, logz, ln_top, group_start):
    """The softmax sums of direct.softmax_blocked with pruning (module docstring); writes the
    same outputs, and direct_fallbacks[i] = 1 where the pruning bound failed and target i was
    summed directly. nthreads: numba.get_num_threads() (sets the number of work chunks).
    logz, ln_top: log Z as in softmax_blocked (length 0: not written); with the pruning it is
    within tol of the full sum's (neglected weight ≤ tol·Z).

    Targets go in blocks of at most TARGET_GROUP consecutive ones, block b from group_start[b] to
    group_start[b + 1] (target_groups: close together, for NESTED-ordered
    edge points); one walk of the tree serves the whole block: a node is dropped when the
    bound for the block's cone of directions â (centre ĉ, radius r_b, smallest |a|),

        λ_node + |a|_min (cos(max(0, ∠(ĉ, c) − r − r_b)) − 1)  ≥  every target's own bound,

    is below the smallest lower bound of the block's shifts times tol·2⁻⁷. The sources of the
    kept leaves are gathered into one contiguous buffer and every target of the block is summed
    over it with the block kernels of the direct sum (its exact maximum as the shift); the
    dropped bounds certify each target's neglected weight."""
    ntarget = targets.shape[0]
    nsource = soa.shape[1]
    ys0, ys1, ys2, lws = soa[0], soa[1], soa[2], soa[3]
    scale = beta * LOG2E
    log_tol = math.log2(tol)
    nmom = 10 if want_div else 4
    nblocks = group_start.size - 1
    nchunks = min(nblocks, 8 * nthreads)
    per_chunk = (nblocks + nchunks - 1) // max(nchunks, 1)  # no targets: no chunks
    for chunk in prange(nchunks):
        # work arrays once per chunk: the gathered sources can be all of them
        buf = np.empty((4, nsource))
        a = np.empty((TARGET_GROUP, 3))
        anorm = np.empty(TARGET_GROUP)
        h = np.zeros((TARGET_GROUP, 3))
        lower = np.empty(TARGET_GROUP)
        mom = np.empty(nmom)
        stack_level = np.empty(12 + 3 * depth + 4, dtype=np.int64)
        stack_pix = np.empty(12 + 3 * depth + 4, dtype=np.int64)
        for blk in range(chunk * per_chunk, min(nblocks, (chunk + 1) * per_chunk)):
            i0 = group_start[blk]
            nt = group_start[blk + 1] - i0
            c0 = c1 = c2 = 0.0
            amin = np.inf
            for t in range(nt):
                a0, a1, a2, norm, h[t, 0], h[t, 1], h[t, 2] = kernel_direction(
                    BT, scale, targets[i0 + t, 0], targets[i0 + t, 1], targets[i0 + t, 2])
                a[t, 0] = a0
                a[t, 1] = a1
                a[t, 2] = a2
                anorm[t] = norm
                c0 += h[t, 0]
                c1 += h[t, 1]
                c2 += h[t, 2]
                amin = min(amin, norm)
            # the block's cone of directions: centre ĉ, radius r_b (rounded outwards)
            cn = math.sqrt(c0 * c0 + c1 * c1 + c2 * c2)
            if cn > 0:
                c0 /= cn
                c1 /= cn
                c2 /= cn
            else:
                c2 = 1.0
            cos_rb = 1.0
            for t in range(nt):
                cos_rb = min(cos_rb, h[t, 0] * c0 + h[t, 1] * c1 + h[t, 2] * c2)
            cos_rb = max(-1.0, cos_rb - 1e-12)
            sin_rb = math.sqrt(1.0 - cos_rb * cos_rb)
            # lower bounds of the targets' largest exponents: their exact maxima over one leaf
            # near ĉ (any sources give a lower bound; a good one prunes more)
            leaf = _greedy_leaf(amin, c0, c1, c2, depth, level_offset, node_centre, node_cos_r,
                                node_sin_r, node_log_mass)
            s0 = node_start[leaf]
            s1 = node_end[leaf]
            smin = np.inf
            for t in range(nt):
                lower[t] = block_max(a[t, 0], a[t, 1], a[t, 2], h[t, 0], h[t, 1], h[t, 2],
                                      ys0[s0:s1], ys1[s0:s1], ys2[s0:s1], lws[s0:s1])
                smin = min(smin, lower[t])
            # depth-first walk with the block bound; kept leaves are gathered
            pruned = 0.0  # Σ block bounds of the dropped nodes, in units of 2^smin
            upper = -np.inf  # the largest block bound of a kept leaf: ≥ every kept exponent
            count = 0
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
                b = _cone_bound(amin, c0, c1, c2, cos_rb, sin_rb, k, node_centre, node_cos_r,
                                node_sin_r, node_log_mass)
                if b - smin < log_tol - PRUNE_MARGIN:
                    pruned += 2.0 ** (b - smin)
                    continue
                if level < depth:
                    for c in range(4 * p + 3, 4 * p - 1, -1):
                        stack_level[top] = level + 1
                        stack_pix[top] = c
                        top += 1
                    continue
                upper = max(upper, b)
                for j in range(node_start[k], node_end[k]):
                    buf[0, count] = ys0[j]
                    buf[1, count] = ys1[j]
                    buf[2, count] = ys2[j]
                    buf[3, count] = lws[j]
                    count += 1
            y0 = buf[0, :count]
            y1 = buf[1, :count]
            y2 = buf[2, :count]
            lw = buf[3, :count]
            for t in range(nt):
                i = i0 + t
                if upper - lower[t] <= SHIFT_SLACK:
                    # the lower bound is close enough to the maximum to serve as the shift
                    # (weights ≤ 2^SHIFT_SLACK, as in softmax_blocked): one pass
                    shift = lower[t]
                    _sum_shifted(a[t, 0], a[t, 1], a[t, 2], h[t, 0], h[t, 1], h[t, 2], shift, y0,
                                 y1, y2, lw, want_div, mom)
                else:
                    shift = _sum_target(a[t, 0], a[t, 1], a[t, 2], h[t, 0], h[t, 1], h[t, 2], y0,
                                        y1, y2, lw, want_div, mom)
                direct_fallbacks[i] = 0
                # neglected weight ≤ 2^smin·pruned: certify it is ≤ tol·Z = tol·mom₀·2^shift
                if not (count > 0 and pruned * 2.0 ** (smin - shift) <= tol * mom[0]):
                    direct_fallbacks[i] = 1
                    shift = _sum_target(a[t, 0], a[t, 1], a[t, 2], h[t, 0], h[t, 1], h[t, 2], ys0,
                                        ys1, ys2, lws, want_div, mom)
                shift = add_near_field(i, mom, nmom, shift, near_cells, near_delta, log2_factor)
                finish_target(i, targets[i, 0], targets[i, 1], targets[i, 2], h[t, 0], h[t, 1],
                               h[t, 2], mom, BT, beta, V, want_div, velocity, divergence, mean)
                store_log_partition(i, logz, mom[0], shift + anorm[t], ln_top)
    return nsource


def median_kernel_norm(model, targets):
    """The median of |Bᵀx| over up to 256 of the targets: the scale of the kernel's exponent
    β|Bᵀx| that sizes the cap the tree visits around a target."""
    sample = np.asarray(targets)[:: max(1, len(targets) // 256)]
    return float(np.median(np.linalg.norm(sample @ model.B, axis=1)))


def target_groups(targets, model, tol):
    """(order, group_start): the targets (T, 3) in the NESTED order of an nside-SORT_NSIDE grid,
    in groups of at most TARGET_GROUP within one pixel of the grid whose pixels (√(4π/12)/nside
    rad) are about half as wide as the cap the tree visits around a target, θ with
    β|Bᵀx|(1 − cos θ) = ln(1/tol) + 5 (median |Bᵀx|): a group's cone stays within about 1.5 caps.
    Half a cap rather than one: 1.3–1.4× faster on the centroids of nside 16 at β = 1000 (fewer
    gathered sources per target outweigh more walks), 1.1× on scattered subsets of them."""
    pix = hp.vec2pix(SORT_NSIDE, targets[:, 0], targets[:, 1], targets[:, 2], nest=True)
    order = np.argsort(pix, kind="stable")
    pix = pix[order]
    bx = median_kernel_norm(model, targets)
    cap = math.acos(max(-1.0, 1.0 - (math.log(1.0 / tol) + 5.0) / (model.beta * bx))) if bx > 0 else math.pi
    level = int(np.clip(round(math.log2(2.0 * math.sqrt(math.pi / 3.0) / max(cap, 1e-9))), 0, math.log2(SORT_NSIDE)))
    coarse = pix >> (2 * (int(math.log2(SORT_NSIDE)) - level))
    starts = np.flatnonzero(np.diff(coarse, prepend=-1))  # the first target of each coarse pixel
    ends = np.append(starts[1:], len(pix))
    # each coarse pixel's run cut into groups of at most TARGET_GROUP
    sizes = ends - starts
    counts = (sizes + TARGET_GROUP - 1) // TARGET_GROUP
    group_start = np.repeat(starts, counts) + TARGET_GROUP * (np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts))
    return order, np.append(group_start, len(pix)).astype(np.int64)


def tree_sums(model, sources, masses, soa, targets, tol, want_div, velocity, divergence, mean,
              near_cells=None, near_delta=None, log2_factor=None, logz=None, source_tree=None):
    """The tree sums of attention_field (soa from kernels.source_arrays of sources, masses),
    written into velocity, divergence and mean; near_cells, near_delta, log2_factor: the
    near-field corrections (kernels.add_near_field; None: none); logz: None, or an array (T,)
    that receives log Z; source_tree: None (the SourceTree built here), or a callable that
    returns the SourceTree of these sources (built once for many calls). Returns the number of
    targets the tree summed directly."""
    ntarget = targets.shape[0]
    if near_cells is None:
        near_cells, near_delta, log2_factor = no_near_field(ntarget)
    ln_top = 0.0
    if logz is None:
        logz = no_log_partition()
    elif logz.size:
        ln_top = float(np.log(np.max(masses)))
    tree = SourceTree(sources, masses, soa=soa) if source_tree is None else source_tree()  # soa: the caller's
    fallbacks = np.zeros(ntarget, dtype=np.int8)
    order = None
    if near_cells.shape[1] == 0 and ntarget > 1:
        # scattered targets (the feet of g's paths, a subset of them) in groups of consecutive
        # ones would make wide group cones that gather many leaves (β = 1000, nside 16: 75 µs
        # per target against 7): grouped by where they are instead (target_groups)
        order, group_start = target_groups(targets, model, tol)
        targets = np.ascontiguousarray(targets[order])
        given = velocity, divergence, mean, logz
        velocity, mean = np.empty((ntarget, 3)), np.empty((ntarget, 3))
        divergence = np.empty(ntarget) if want_div else divergence
        logz = np.empty(ntarget) if logz.size else logz
    else:  # the callers' order (a near field's edge points are NESTED-ordered: close together)
        group_start = np.append(np.arange(0, ntarget, TARGET_GROUP), ntarget).astype(np.int64)
    tree_softmax(targets, np.ascontiguousarray(model.B.T), model.beta, tree.soa, tree.depth,
                 tree.level_offset, tree.node_start, tree.node_end, tree.node_centre,
                 tree.node_cos_r, tree.node_sin_r, tree.node_log_mass, model.V, tol, want_div,
                 velocity, divergence, mean, fallbacks, near_cells, near_delta, log2_factor,
                 get_num_threads(), logz, ln_top, group_start)
    if order is not None:
        given[0][order], given[2][order] = velocity, mean
        if want_div:
            given[1][order] = divergence
        if logz.size:
            given[3][order] = logz
    return int(fallbacks.sum())
