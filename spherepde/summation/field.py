"""The attention velocity field of a density on S² and its surface divergence.

For a measure ρ = Σ_j μ_j δ_{y_j} (cell masses μ_j = f_j·A at the cell centroids y_j: a
second-order quadrature of the density) and a target point x:

    weights  ω_j ∝ μ_j e^{β⟨Bᵀx, y_j⟩}           (softmax, normalised to Σ ω_j = 1)
    m_β(x) = Σ_j ω_j y_j                          (softmax mean)
    C_x    = Σ_j ω_j y_j y_jᵀ − m mᵀ              (softmax covariance)
    v(x)   = P_x(V m_β(x)),  P_x = I − x xᵀ
    div_S v(x) = β tr(P_x V C_x Bᵀ) − 2⟨x, V m_β(x)⟩

The divergence follows from div_S P_x(u) = tr(P_x ∇u) − 2⟨x, u⟩ with ∇m_β = β C_x Bᵀ
(docs/theory.md#formulas-and-exact-solutions). Exponents are shifted by their maximum over the sources with positive mass,
max_j (β⟨Bᵀx, y_j⟩ + log μ_j), so the largest term is exactly 1: no overflow and no 0/0 for any β.

At β = ∞ the field is local: v(x) = P_x(M x)/|Bᵀx| with M = VBᵀ and
div_S v = (tr M − 3xᵀMx)/|Bᵀx| − ⟨P_x(BBᵀx), P_x(Mx)⟩/|Bᵀx|³.

Units: positions are unit vectors, masses any positive unit (only ratios enter), β and the
matrices B, V dimensionless; v and div_S v are per unit time.

Memory is O(N + targets); no N × targets array is formed. ``attention_field`` is the single entry
point of the summation: it chooses among the sums below it (choose_method, the cost model) and
hands them the shared source arrays (spherepde.summation.kernels):

- "direct": spherepde.summation.direct.softmax_blocked, exact to rounding (and the reference
  kernel for absurd β, beyond the range of the fast exp2);
- "tree": spherepde.summation.tree, pruning with a certified neglected weight;
- "harmonic": spherepde.summation.harmonic, the Funk–Hecke expansion for moderate β; the
  targets it cannot serve within the tolerance are re-summed here, by the tree where that pays
  (FALLBACK_TREE_CAP_FRACTION), else directly;
- "clustered": spherepde.summation.clustered, a tight group of sources (concentrated tokens) as
  one third-order expansion term, |Δm_β| ≤ 2 tol; "auto" takes it before the others for callers
  whose sources can concentrate (may_cluster: the tokens) whenever the groups are at most
  1/CLUSTER_GAIN of the sources and no divergence is asked for;
- near-field corrections: spherepde.summation.near_field (NearField), added by the direct and
  tree kernels.
"""

from __future__ import annotations

import math
import warnings

import numpy as np

from . import clustered, direct, harmonic, tree
from .fastmath import LOG2E
from .kernels import (
    EXP2_LIMIT,
    no_log_partition,
    no_near_field,
    source_arrays,
    unnormalise,
    write_back,
)
from .near_field import NearField, table_bytes

__all__ = ["attention_field", "choose_method", "METHODS", "DEFAULT_TOL", "AttentionField", "mesh_sources",
           "tree_cap_fraction", "PreparedSources"]

METHODS = ("auto", "direct", "tree", "harmonic", "clustered")
DEFAULT_TOL = 1e-10
TREE_MIN_SOURCES = 3072  # below this the tree's overhead is not worth it
CLUSTER_MIN_SOURCES = 256  # below this grouping the sources costs more than it can save
TREE_MAX_CAP_FRACTION = 0.2  # the tree pays when the weights live on < 20 % of the sphere
# harmonic cost per target ≈ HARMONIC_PAIRS_PER_TERM·(L+1)² direct pairs (per source: twice that;
# measured against softmax_blocked in the same runs at nside 8 to 32, β = 3 to 30: 0.9 to 2.1,
# larger at small L where the per-point overheads weigh more)
HARMONIC_PAIRS_PER_TERM = 1.5
FALLBACK_TREE_CAP_FRACTION = 0.6  # re-sum the targets the harmonic sums hand back with the tree
# below this cap fraction (tree_cap_fraction), else directly: on two vMF peaks over a 1e-6 floor
# at nside 64 the tree took 0.62× the direct time at β = 30 (fraction 0.47), 1.13× at β = 10 (1.4)


def tree_cap_fraction(model, targets, tol=DEFAULT_TOL):
    """The fraction (ln(1/tol) + 5)/(2β|Bᵀx|) of the sphere that the tree visits around a target
    (median |Bᵀx| over up to 256 of the targets); inf where Bᵀx = 0."""
    bx = tree.median_kernel_norm(model, targets)
    return (math.log(1.0 / tol) + 5.0) / (2.0 * model.beta * bx) if bx > 0 else math.inf


def choose_method(model, targets, nsources, tol=DEFAULT_TOL):
    """The cost model of "auto".

    tree: it visits the cap where β|Bᵀx|(1 − cos θ) ≲ ln(1/tol) + 5, a fraction
    (ln(1/tol) + 5)/(2β|Bᵀx|) of the sphere (median |Bᵀx| over the targets); "tree" when that
    fraction is small. harmonic: (T + 2N)·c·(L+1)² against T·N for the direct sum, L the degree
    spherepde.summation.harmonic needs at κ_max = βσ_max(B); "harmonic" when cheaper. Else "direct".
    """
    if nsources < TREE_MIN_SOURCES:
        return "direct"
    fraction = tree_cap_fraction(model, targets, tol)
    if fraction == math.inf:
        return "direct"
    if fraction < TREE_MAX_CAP_FRACTION:
        return "tree"
    L, _ = harmonic.harmonic_degree(model.beta * float(np.linalg.norm(model.B, 2)), harmonic.tail_target(tol))
    ntarget = len(targets)
    harmonic_cost = (ntarget + 2 * nsources) * HARMONIC_PAIRS_PER_TERM * (L + 1) ** 2
    return "harmonic" if harmonic_cost < ntarget * nsources else "direct"


class PreparedSources:
    """The source arrays of attention_field for one measure, built once for many calls with
    other targets (the paths of spherepde.solvers.tails evaluate one frozen field at the
    points of every RK4 stage and of every coupling that traces back through it).

    sources (N, 3), masses (N,) as attention_field takes them; holds the contiguous sources,
    kernels.source_arrays of them, whether they are unit vectors, and the tree of
    spherepde.summation.tree once a call has needed it. Memory: about 10·N floats with the
    tree. Answers are those of attention_field without it, to the last bit."""

    def __init__(self, sources, masses):
        self.sources = np.ascontiguousarray(sources, dtype=float)
        self.masses = masses
        self.arrays = source_arrays(self.sources, masses)  # (soa, sample, rmax)
        self.unit = bool(np.abs(np.einsum("ij,ij->i", self.sources, self.sources) - 1.0).max() <= 1e-12)
        self.ln_top = float(np.log(np.max(masses)))
        self._tree = None

    def tree(self):
        """The SourceTree of these sources (built on first use)."""
        if self._tree is None:
            self._tree = tree.SourceTree(self.sources, self.masses, soa=self.arrays[0])
        return self._tree


def attention_field(model, sources, masses, targets, want_div=False, out=None, method="auto",
                    tol=DEFAULT_TOL, stats=None, near=None, route=None, log_partition=None, may_cluster=False,
                    added_log_partition=None, prepared=None):
    """Velocity v (T, 3), divergence div_S v (T,) (or None) and softmax mean m_β (T, 3).

    The field follows model.normalisation: softmax, v = P_x(V m_β); or unnormalised,
    v = P_x(V Z m_β)·e^{−c} with c = model.log_field_scale (kernels.unnormalise; its log Z is
    computed whether or not log_partition is asked for). The mean is m_β in both cases.

    sources (N, 3) with masses (N,) ≥ 0 (need not be normalised); targets (T, 3) unit vectors.
    The one entry point of the summation. At β = ∞ the masses are unused and mean is None.
    method: "direct" (direct.softmax_blocked, exact to rounding), "tree" (spherepde.summation.tree:
    pruning with a certified neglected weight ≤ tol·Z per target; unit-vector sources only), "harmonic"
    (spherepde.summation.harmonic: Funk–Hecke expansion for moderate β, targets whose error bound
    exceeds tol re-evaluated by tilted regional expansions, then by the tree or directly; unit-vector
    sources only) or "auto" (choose_method). stats, if a dict, receives the method used, the
    targets served by the tilted expansions and those re-summed by the tree or directly.
    near: a spherepde.summation.near_field.NearField for these targets with the sources = the cells of its
    mesh (masses = f·A in cell order): the kernel is integrated exactly over the cells around its
    peak (accuracy uniform in β); None: the cell-centre sums only.
    route: for "harmonic", a mask of targets to send to the tilted regional expansions without
    trying the global one (harmonic.harmonic_softmax; cost only); stats["handed_back"] then
    receives the mask for the next call.
    log_partition: None (not computed), or a float64 array (T,) that receives, per target,

        log Z(x) = ln Σ_j μ_j e^{β⟨Bᵀx, y_j⟩}   (natural log, the masses as given),

    with the near-field corrections when near is active (then Z is Σ over the far cells of the
    centre terms plus the cell integrals f_c ∫_cell e^{β⟨Bᵀx, y⟩} dA of the near ones), from
    every method: direct and tree (kernels.store_log_partition), the reference kernel, and the
    harmonic expansions (global, tilted and re-summed targets). Its error is that of the sums:
    rounding for direct, ≤ tol (absolute, in log Z) for the tree and the harmonic sums. At β = ∞
    there is no partition function: the array is filled with NaN. Not asking costs nothing (the
    kernels skip the store).
    may_cluster: let "auto" try the clustered sums (grouping costs O(N log N) per call): for sources
    that can concentrate, the tokens of spherepde.solvers.particles; mesh cells never do.
    added_log_partition: None, or per target (T,) ln Z_add of point sources the caller adds to
    these sums exactly afterwards (spherepde.summation.points: the atoms of split sums). The
    harmonic sums then hold each target to tol relative to Z + Z_add, the partition function of
    the whole measure (harmonic.harmonic_softmax); the other methods are within tol of Z anyway.
    prepared: None, or the PreparedSources of these very sources and masses (checked by
    identity): their arrays and tree are reused instead of built for this call.
    """
    if prepared is not None and (prepared.sources is not sources or prepared.masses is not masses):
        raise ValueError("prepared was built for other sources or masses: pass prepared.sources, prepared.masses")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not (0 < tol < 1):
        raise ValueError(f"tol must be in (0, 1), got {tol!r}")
    targets = np.ascontiguousarray(targets, dtype=float)
    ntarget = targets.shape[0]
    if out is None:
        out = (np.empty((ntarget, 3)), np.empty(ntarget), np.empty((ntarget, 3)))
    velocity, divergence, mean = out
    if log_partition is None:
        logz = np.empty(ntarget) if getattr(model, "unnormalised", False) else no_log_partition()
    else:
        logz = log_partition
        if not (isinstance(logz, np.ndarray) and logz.shape == (ntarget,) and logz.dtype == np.float64
                and logz.flags.c_contiguous and logz.flags.writeable):
            raise ValueError(f"log_partition must be a writeable contiguous float64 array of shape ({ntarget},)")
    if model.zero_temperature:
        direct.zero_temperature_field(targets, model.B, model.M, want_div, velocity, divergence)
        logz[:] = np.nan  # β = ∞: no partition function (Z diverges or vanishes)
        return velocity, (divergence if want_div else None), None
    sources = np.ascontiguousarray(sources, dtype=float)
    source_tree = None if prepared is None else prepared.tree
    groups = _clustered_groups(model, sources, masses, want_div, near, tol, method, may_cluster)
    if groups is not None:
        method = "clustered"
    elif method == "clustered":
        method = "direct"  # asked for, but the divergence (or a near field) needs every source
    if method == "auto":
        method = choose_method(model, targets, sources.shape[0], tol)
    if method in ("tree", "harmonic") and not (
            prepared.unit if prepared is not None
            else np.abs(np.einsum("ij,ij->i", sources, sources) - 1.0).max() <= 1e-12):
        method = "direct"  # the caps of the tree bound ⟨a, y⟩, and Funk–Hecke needs, unit vectors y
    if method == "harmonic" and near is not None and near.active:
        method = "direct"  # the harmonic sums are uncentred: no near-field correction there
    soa, sample, rmax = source_arrays(sources, masses) if prepared is None else prepared.arrays
    ln_top = (float(np.log(np.max(masses))) if prepared is None else prepared.ln_top) if logz.size else 0.0
    near_cells, near_delta, log2_factor = _near_arrays(near, masses, sources.shape[0], ntarget)
    BT = np.ascontiguousarray(model.B.T)
    # the fast kernels' exponents λ + ⟨a, y − â⟩ − shift are bounded by 2|a|(r_max + 1) + max|λ|
    bound = 2.0 * model.beta * LOG2E * np.linalg.norm(BT, 2) * (rmax + 1.0) - soa[3].min()
    if bound >= EXP2_LIMIT:  # absurd β (> ~10¹⁴): the reference kernel has no range limit
        method = "reference"
        masses = np.asarray(masses, dtype=float)
        with np.errstate(divide="ignore"):
            log_mass = np.log(np.maximum(masses, 0.0))
        direct.softmax_direct_reference(targets, BT, model.beta, sources, log_mass, model.V,
                                        want_div, velocity, divergence, mean, logz)
    elif method == "clustered":
        clustered.clustered_softmax(targets, BT, float(model.beta), groups.centres, groups.log_mass, groups.second,
                                    groups.third, model.V, velocity, mean, logz)
        if stats is not None:
            stats["groups"] = groups.count
    elif method == "tree":
        fallbacks = tree.tree_sums(model, sources, masses, soa, targets, tol, want_div, velocity,
                                   divergence, mean, near_cells, near_delta, log2_factor, logz,
                                   source_tree=source_tree)
        if stats is not None:
            stats["fallbacks"] = fallbacks
    elif method == "harmonic":
        degree, left, tilted, handed = harmonic.harmonic_softmax(model, sources, masses, targets, want_div,
                                                                 tol, velocity, divergence, mean, route, logz,
                                                                 added_log_partition)
        redo, how = _resum(model, sources, masses, targets, soa, sample, rmax, want_div, tol, left,
                           velocity, divergence, mean, logz, ln_top, source_tree)
        if stats is not None:
            stats["handed_back"] = handed
            stats["degree"] = degree
            stats["tilted"] = tilted
            stats["fallbacks"] = redo
            stats["fallback_method"] = how
    else:
        direct.softmax_blocked(targets, BT, model.beta, soa, sample, rmax, model.V, want_div,
                               velocity, divergence, mean, near_cells, near_delta, log2_factor, logz, ln_top)
    if stats is not None:
        stats["method"] = method
    if getattr(model, "unnormalised", False):
        unnormalise(np.ascontiguousarray(model.B, dtype=float), float(model.beta), float(model.log_field_scale),
                    logz, want_div, velocity, divergence, mean)
    return velocity, (divergence if want_div else None), mean


def _clustered_groups(model, sources, masses, want_div, near, tol, method, may_cluster):
    """The SourceGroups of the clustered sum when it serves this call, else None: asked for
    ("clustered"), or "auto" with may_cluster and at least CLUSTER_MIN_SOURCES sources grouped
    into at most 1/CLUSTER_GAIN of their number; never with the divergence or an active near field."""
    if want_div or (near is not None and near.active) or method not in ("auto", "clustered"):
        return None
    if method == "auto" and (not may_cluster or sources.shape[0] < CLUSTER_MIN_SOURCES):
        return None
    scale = float(model.beta) * float(np.linalg.norm(model.B, 2))
    groups = clustered.group_sources(sources, masses, scale, tol)
    if method == "auto" and groups.count * clustered.CLUSTER_GAIN > groups.nsources:
        return None
    return groups


def _resum(model, sources, masses, targets, soa, sample, rmax, want_div, tol, redo, velocity,
           divergence, mean, logz, ln_top, source_tree=None):
    """Re-sum the targets redo (indices) that the harmonic sums handed back, by the tree or the
    direct sum (and their log Z, if logz is not empty; ln_top = ln max μ); returns (their number,
    "tree" or "direct" or None). source_tree: None, or a callable giving the sources' SourceTree."""
    if not redo.size:
        return 0, None
    n = redo.size
    out = (np.empty((n, 3)), np.empty(n), np.empty((n, 3)), np.empty(n if logz.size else 0))
    redo_targets = np.ascontiguousarray(targets[redo])
    # where the density is small under a target's kernel (late, concentrated states: most
    # targets), the tree beats the direct sum already at moderate β (β = 30: 1.6×)
    if (soa.shape[1] >= TREE_MIN_SOURCES  # the sources with positive mass
            and tree_cap_fraction(model, redo_targets, tol) < FALLBACK_TREE_CAP_FRACTION):
        tree.tree_sums(model, sources, masses, soa, redo_targets, tol, want_div, *out[:3], logz=out[3],
                       source_tree=source_tree)
        how = "tree"
    else:
        how = "direct"
        direct.softmax_blocked(redo_targets, np.ascontiguousarray(model.B.T, dtype=float), float(model.beta),
                               soa, sample, rmax, model.V, want_div, *out[:3], *no_near_field(n), out[3], ln_top)
    write_back(redo, out, slice(None), want_div, velocity, divergence, mean, logz)
    return int(n), how


def _near_arrays(near, masses, nsource, ntarget):
    """(cells, delta, log2_factor) for the kernels: log2_factor[c] = log₂(f_c/μ_max) with
    f_c = μ_c/A; empty arrays (K = 0) without a near field."""
    if near is None or near.cells.shape[1] == 0:
        return no_near_field(ntarget)
    # the cells come first; point sources after them (atoms) need no correction
    if near.cells.shape[0] != ntarget or nsource < near.npix:
        raise ValueError("the near field was built for other targets or another mesh")
    masses = np.asarray(masses, dtype=float)
    with np.errstate(divide="ignore"):
        log2_factor = (np.log2(np.maximum(masses[: near.npix], 0.0)) - np.log2(masses.max())
                       - np.log2(near.area))
    return near.cells, near.delta, log2_factor


def mesh_sources(mesh, f, points=None, point_masses=None):
    """(sources, masses) of the measure f dA + Σ m_k δ_{x_k}: the cell centroids with masses f·A,
    then the points (atoms) with theirs (near-field tables index the cells, which come first)."""
    sources, masses = mesh.centroids, f * mesh.area
    if points is not None and len(points):
        sources = np.concatenate([sources, points])
        masses = np.concatenate([masses, point_masses])
    return sources, masses


NEAR_FIELD_MAX_BYTES = 2 * 1024**3  # a larger near-field table is not built (warning instead)


class AttentionField:
    """The attention field of cell densities on a mesh, evaluated at fixed target points.

    Sources are the cell centroids with masses f_c·A; work arrays are allocated once. method and
    tol as in attention_field; self.stats holds the method used by the last call.
    near_field: True integrates the kernel exactly over the cells around its peak wherever it is
    narrower than a cell (spherepde.summation.near_field; built once here, costs T·K·88 bytes and a few ms
    per corrected target), False keeps the cell-centre sums. A table above NEAR_FIELD_MAX_BYTES
    is not built: a warning says so and the centre sums are used.

    Routing: the targets the global harmonic expansion handed back are sent straight to the
    tilted regions in the next call (late, concentrated states: most targets; each is still
    served within its error budget). Results then depend on the calls before at round-off level
    only; forget_route() restarts, which a solver does at its snapshots so that a run resumed
    from one repeats the uninterrupted run.
    """

    def __init__(self, model, mesh, targets, method="auto", tol=DEFAULT_TOL, near_field=True):
        self.model = model
        self.mesh = mesh
        self.method = method
        self.tol = tol
        self.stats = {}
        self._route = None
        self.targets = np.ascontiguousarray(targets, dtype=float)
        n = self.targets.shape[0]
        self._out = (np.empty((n, 3)), np.empty(n), np.empty((n, 3)))
        self.near = None
        if near_field and not model.zero_temperature:
            size = table_bytes(mesh, model, self.targets)
            if size > NEAR_FIELD_MAX_BYTES:
                warnings.warn(f"near-field table of {size / 2**30:.1f} GiB not built (limit "
                              f"{NEAR_FIELD_MAX_BYTES / 2**30:.0f} GiB): the kernel is narrower than a "
                              "cell and the centre sums under-resolve it; use a finer mesh", stacklevel=2)
            elif size > 0:
                self.near = NearField(mesh, model, self.targets)

    def __call__(self, f, want_div=False, points=None, point_masses=None, log_partition=None,
                 added_log_partition=None):
        """The field of the cell densities f (and of point masses at points (n, 3), the atoms of
        spherepde.solvers.atoms: exact point sources, appended after the cells). log_partition: None, or
        an array (T,) that receives log Z(x) = ln(∫ e^{β⟨Bᵀx, y⟩} f dA + Σ_k m_k e^{β⟨Bᵀx, x_k⟩})
        at the targets; added_log_partition: that of point sources added later (attention_field)."""
        self.stats.pop("handed_back", None)
        sources, masses = mesh_sources(self.mesh, f, points, point_masses)
        result = attention_field(self.model, sources, masses, self.targets,
                                 want_div=want_div, out=self._out, method=self.method, tol=self.tol,
                                 stats=self.stats, near=self.near, route=self._route,
                                 log_partition=log_partition, added_log_partition=added_log_partition)
        self._route = self.stats.get("handed_back")
        return result

    def forget_route(self):
        """The next call tries the global expansion at every target again."""
        self._route = None
