"""Tails of the density from log f: the hybrid state of the Eulerian solver (`[eulerian] tails = "log"`).

At β ≥ 20 the mean field after t ≈ log β is steered by densities 10⁻¹⁰–10⁻¹⁵ below the clusters
(docs/numerics.md#tails-relative-to-f), where a finite-volume density is wrong by decades: it
reconstructs f, which varies there by about a decade per cell. Along a characteristic X(s) of the
field v, g = log f obeys

    d/ds g(X(s), s) = −div_S v(X(s), s),

which transports relative accuracy: g(x, t₁) = g(X(t₀), t₀) − ∫_{t₀}^{t₁} div_S v dt along the path
that arrives at x (spherepde.transport.semi_lagrangian.advance_log_density; g at the departure
point by the quadratic interpolant, unlimited by default: limiting clips g at the ridges, where
the mass gathers).

The hybrid state is f (cell averages, finite volumes), the atoms, and g at the cell centroids.
At every coupling time t₁ (as far apart as `interval` allows, whatever the saves:
coupling_schedule):
1. g is advanced from the last anchor t_a ≤ t₀ (`anchor` = 1.0 apart: g is interpolated there
   only, its interpolation errors do not add up at every coupling) along paths in RK4 steps of at
   most `path_step` = 0.1 through the field of the states at every coupling since, linear in time
   between them (the attention sums of f dA + atoms); with `substeps` > 1, through the states
   after every step (step_states "atom_events", any substeps: in the intervals where an atom was
   made or merged only, `substeps` RK4 steps between each two of them); with between "measure",
   through the field of the measure the solver holds between two couplings' states (the followed
   tails exponential in time, the rest linear: _measure_path) instead; with paths "maps"
   (`[eulerian] tail_paths`) only back to the last coupling, composed there with that coupling's departure points at the anchor and divergence integral
   (interpolated: smooth maps), so each coupling traces one interval instead of the whole span;
   with paths "selective" the maps, retraced to the anchor at the centroids whose map's error
   budget (the quadratic against the cubic fit at every composition, carried along the paths)
   exceeds `retrace_tolerance` decades of g;
2. every tail cell takes the cell average ⟨e^g⟩: a cell is in the tail when min(f, ⟨e^g⟩) is
   below `level` × the mesh's largest f (criterion "min"; "fv": f alone; reference "measure":
   × the largest of that and every atom's mass per cell area) and its centroid lies farther
   than `exclusion` cell sizes from every atom;
3. the rest (the bulk cells and the atoms) is scaled by one factor so that the mass of the
   measure is unchanged (to round-off);
4. g is not reset (reset "none", the default): a reset to log f in the bulk ("bulk") or near the
   atoms ("atoms") hands g the finite volumes' error before a cell enters the tail.
5. between two couplings (follow=True, the default) the cells below the level and away from the
   atoms at the last coupling t₁ are not left to the finite volumes, which move a tail that
   falls by a decade per cell by 0.2–0.9 decades within 0.05 in time (β = 30, nside 16): after
   every step they take f(t₁)·e^{(t − t₁)r}, r = (g(t₁) − g(t₀))/(t₁ − t₀) g's rate over the
   last interval along the characteristics (at the start −v·∇g − div_S v in the field of the
   initial state; capped at the level then), the rest scaled to keep the mass; an atom's creation
   or merger stops this until the next coupling. r is part of the state (`log_density_rate`).
The conservative scheme thus keeps the bulk and the atoms, and the tails are those of the
characteristics. A snapshot at a coupling time holds the whole state (f, atoms, g, r); one between
couplings holds g and r of the last coupling (`log_density_time`), and a run resumed after it
continues from the last snapshot at an anchor (`log_density_anchor`), so that it repeats the
uninterrupted one.

The keyword defaults of LogTails are those of the first runs; the configuration's
(`[eulerian] tail_*`, spherepde.runner.config) are the backtracked maps ("backtrack", anchors 5.0
apart, path_step 0.05) through the steps' states at the clusters' peaks.

Measured (docs/numerics.md#anchors-g-interpolated-every-10): on the exact β = ∞ solution of the
paper's matrices the 90th-percentile relative error of the tail cells at t = 8 falls from 7·10³
(finite volumes) to 6·10⁻⁴ at nside 16 and from 1.5·10² to 1.5·10⁻⁴ at nside 32. With the
configuration's defaults g stays within 0.05 decades of its own characteristics to t = 8 at β = 30
and 1000 (nside 16), and the F-onset at β = 30 moves by 0.3 % from nside 32 to 64
(docs/numerics.md#backtracked-maps-through-the-steps-states-tail_paths--backtrack-tail_field_between--steps).
"""

from __future__ import annotations

import bisect
import math

import healpy as hp
import numpy as np
from scipy.spatial import cKDTree

from ..summation import PreparedSources, attention_field, mesh_sources
from .guards import RunFailure
from ..transport.semi_lagrangian import PATH_SCHEMES, PolynomialInterpolant, compose_paths, trace_back, unit_rows

__all__ = ["LogTails", "coupling_times", "coupling_schedule", "subcells_for", "kernel_width", "subcell_centres",
           "log_linear_masses", "TAIL_INTERVAL", "TAIL_LEVEL", "TAIL_EXCLUSION", "TAIL_EXCLUSION_WIDTH",
           "TAIL_ANCHOR", "TAIL_PATH_STEP", "TAIL_PATHS", "TAIL_PATHS_DEFAULT", "TAIL_RETRACE_TOLERANCE",
           "TAIL_FOLLOW_BOUNDS", "TAIL_PATH_SCHEMES", "TAIL_STEP_STATES", "TAIL_FIELD_BETWEEN", "TAIL_STATE_SPACING",
           "TAIL_MASS_CORRECTIONS"]

# longest time between couplings: each coupling interpolates g once, and below ~0.2 those errors
# add up faster than the paths' error falls (docs/numerics.md#tails-relative-to-f-work-in-progress)
TAIL_INTERVAL = 0.2
TAIL_LEVEL = 1e-3  # tail cells: finite-volume average below this × the mesh's largest
TAIL_EXCLUSION = 3.0  # cell sizes around an atom where the finite volumes keep the density
# the configuration's default: that neighbourhood at least one kernel width σ = (β σ_max(B))^{-1/2}
# wide, a cluster's basin, on every mesh (3 cells shrink with the mesh and leave the shoulders of a
# collapsing cluster to g: docs/numerics.md#the-neighbourhood-kept-by-the-finite-volumes-in-kernel-widths);
# LogTails itself defaults to 0, cells only, as the runs made before it
TAIL_EXCLUSION_WIDTH = 1.0
TAIL_REFERENCES = ("mesh", "measure", "clusters")  # what the level is relative to (LogTails._largest)
# time between two interpolations of g (anchor 0: at every coupling, as before the anchors): each
# interpolation smears g by about h³ × its third derivatives, and those errors add up, so the
# couplings in between follow their paths back to the last anchor instead, in RK4 steps of at most
# TAIL_PATH_STEP (docs/numerics.md#anchors-g-interpolated-every-10)
TAIL_ANCHOR = 1.0
TAIL_PATH_STEP = 0.1
# how a coupling between anchors gets its paths back to the anchor: "retrace" them through the
# states of every coupling since, or "maps": compose this interval's paths with the last
# coupling's departure points and divergence integral, interpolated (LogTails._composed)
# or "selective": the composed maps, retraced to the anchor at the centroids whose map has used up an
# error budget of TAIL_RETRACE_TOLERANCE decades of g (LogTails._selective): across the fronts of the
# tails, where interpolating the maps smears g, and where many small compositions add up
TAIL_PATHS = ("retrace", "maps", "selective", "backtrack")
TAIL_PATHS_DEFAULT = "retrace"
TAIL_RETRACE_TOLERANCE = 0.01  # decades of g
# what bounds the tail cells that follow g's rate between couplings: "none" (the rate alone), or
# "neighbours": each stays within the range of f over itself and its 8 neighbours at the last coupling
# (the local maximum principle of transport over one interval), so that a front that has just passed,
# whose rate is not the next interval's, is not extrapolated (LogTails._follow)
TAIL_FOLLOW_BOUNDS = ("none", "neighbours")
# how g's paths are integrated over a step (trace_back): "rk4" (Simpson on div v; 6 evaluations of
# the field per step, 9 attention sums, since a field between two recorded states costs both), or
# "heun" (the trapezoidal rule: the field at the ends of the step only, 3 sums)
TAIL_MASS_CORRECTIONS = ("global", "local", "downstream")  # who pays for the mass the tail cells gain (_substitute)
# ("downstream") a tail cell's payer is the nearest bulk cell or atom to where the flow carries its
# centroid in DOWNSTREAM_TIME (Heun steps in the frozen field of the state at the last coupling:
# _downstream_from): near the cluster its flow goes to, whose centre the paths converge on (at β = ∞
# a path's angle from e₁ falls as e^{-2t} or faster), not on the rim where they enter the bulk,
# where the payments shift the cluster (by 0.07 rad at β = 1000, nside 32; docs/numerics.md)
DOWNSTREAM_TIME = 2.0
DOWNSTREAM_STEPS = 4
DOWNSTREAM_MARGIN = 100.0
# the payer nearest to a path's end shares its due with the payers within this angle of it (rad), in
# proportion to their mass: a cluster's atoms (β = 1000: three kernel widths) pay together, so that
# the payment does not move the cluster towards the payer nearest to where the flow goes
DOWNSTREAM_SPREAD = 0.1
TAIL_PATH_SCHEMES = PATH_SCHEMES
# which coupling intervals g's paths cross through the states after every step: "all" (with
# substeps > 1, in substeps × the RK4 steps), or "atom_events": only those in which an atom was made
# or merged (2 → 10 atom points within 0.1 at β = 30, t ≈ 7), in `substeps` RK4 steps between each
# two states (any substeps), the rest linear between the couplings' states in the steps of
# path_step. Measured, the field bends between couplings elsewhere too, and "atom_events" does not
# meet the self-consistency at t = 7–8 that "all" meets (docs/numerics.md, "Step states at atom
# events only")
TAIL_STEP_STATES = ("all", "atom_events")
# the field g's paths see between the states of two couplings (where no step's state is recorded):
# "linear", the two states' fields linear in time (2 attention sums per evaluation), or "measure",
# the field of the measure the solver holds then: the followed tail cells exponential in time,
# f(t₀)e^{(s − t₀)r} within their bounds, as the solver moves them after every step, the other cells
# and the atoms' masses linear, the atoms on the chord between their positions (one sum; the
# field of an interpolated measure, not an interpolated field: v is a ratio of two sums)
TAIL_FIELD_BETWEEN = ("linear", "measure", "steps")
# ("steps") the states after the finite-volume steps that g's paths go through are at least this far
# apart in time (every step at nside 16, β = 30; every second or third at nside 32): 0.025 apart the
# self-consistency at t = 8 reads 0.046 decades, 0.05 apart 0.085 (docs/numerics.md)
TAIL_STATE_SPACING = 0.0125
MAX_SUBCELLS = 16  # children per cell side for g's paths (subcells_for)
# the weight the sums of g's paths may neglect, relative to Z (tree and harmonic; direct sums are
# exact): |Δm_β| ≤ 2e-8, far below the
# sub-cell quadrature's own error (1e-4 of v at β = 1000, nside 16) and the paths' RK4 error, and
# 0.65× the time of the summation's default 1e-10 (same differences: 1e-14, β = 1000, nside 16)
PATH_SUM_TOLERANCE = 1e-8


def kernel_width(model) -> float:
    """σ = (β σ_max(B))^{-1/2} (rad): the width of the attention kernel e^{β⟨x, By⟩} around its
    peak, and so of a cluster's basin; 0 at β = ∞."""
    return 0.0 if model.zero_temperature else 1.0 / math.sqrt(model.beta * np.linalg.norm(model.B, 2))


def subcells_for(mesh, model) -> int:
    """Children per cell side for g's paths: 1 where the kernel is at least as wide as a cell
    (or β = ∞), else the power of two k with h/k ≤ σ (kernel_width), h = √A."""
    if model.zero_temperature:
        return 1
    sigma = kernel_width(model)
    h = math.sqrt(mesh.area)
    # at most MAX_SUBCELLS² sources per cell: memory and sums stay O(npix) (beyond, the spacing
    # exceeds the kernel width and the sums lose accuracy, not validity)
    return 1 if sigma >= h else min(2 ** math.ceil(math.log2(h / sigma)), MAX_SUBCELLS)


def subcell_centres(nside: int, subcells: int):
    """The centres (npix·k², 3) of the k × k children of every cell of a NESTED nside mesh, cell by
    cell (the children of cell c are rows c·k² … (c + 1)·k² − 1), k = subcells (a power of two)."""
    fine = nside * subcells
    return np.ascontiguousarray(np.stack(hp.pix2vec(fine, np.arange(12 * fine * fine), nest=True), axis=1))


def log_linear_masses(interpolant, children, subcells, f, area):
    """The masses of the children (subcell_centres) of cells with densities f and area A: each cell's mass
    f_c·A shared among its k² children as the log-linear profile of ln f over the cell,
    e^{⟨∇ln f, y − c⟩} normalised to mean 1 (PolynomialInterpolant.slopes of ln f; no slope
    where f = 0)."""
    k2 = subcells**2
    with np.errstate(divide="ignore", invalid="ignore"):
        slopes = interpolant.slopes(np.log(np.asarray(f)))
    offsets = children.reshape(-1, k2, 3) - interpolant.centroids[:, None, :]
    profile = np.exp(np.einsum("csk,ck->cs", offsets, slopes))
    profile /= profile.mean(axis=1, keepdims=True)
    return (f[:, None] * profile).ravel() * (area / k2)


def coupling_times(t0: float, t1: float, interval: float) -> list[float]:
    """The coupling times in (t0, t1]: [t0, t1] cut into m = ⌈(t1 − t0)/interval⌉ equal parts
    (t1 itself is the last, exactly)."""
    m = max(1, math.ceil((t1 - t0) / interval - 1e-9))
    return [t0 + (t1 - t0) * j / m for j in range(1, m)] + [t1]


def coupling_schedule(times, interval: float) -> list[tuple]:
    """The coupling times of a run saved at `times`, per save interval: entry k − 1 holds those in
    (times[k − 1], times[k]]. Each coupling interpolates g once, so couplings are as far apart as
    `interval` allows, whatever the saves: a save interval longer than `interval` is cut into equal
    parts (coupling_times); a save time is a coupling time unless the next save time is still
    within `interval` of the last coupling (saves every 0.1, interval 0.2: every other save),
    and the last save time always is. A function of the times alone, so a resumed run couples
    where the uninterrupted one did."""
    schedule, last = [], times[0]
    for k in range(1, len(times)):
        t0, t1 = times[k - 1], times[k]
        if t1 - last > interval * (1 + 1e-9):  # only where last == t0 (the rule below)
            schedule.append(tuple(coupling_times(t0, t1, interval)))
            last = t1
        elif k + 1 < len(times) and times[k + 1] - last <= interval * (1 + 1e-9):
            schedule.append(())  # the next save is still within reach of the last coupling
        else:
            schedule.append((t1,))
            last = t1
    return schedule


def _velocity(field):
    """(s, points) ↦ v alone of a field (s, points, want_div) ↦ (v, div_S v): for trace_back's stages
    whose div v no quadrature uses (3 of its 5 calls per RK4 step), summed without the second
    moments (0.87× the tree's time at β = 1000, nside 16; v the same to 4e-16)."""
    return lambda s, points: field(s, points, False)[0]


def _per_time(field_at):
    """field_at (s ↦ the frozen field at time s), made once per time s: the RK4 stages of g's
    paths meet the same times three to five times per step, and every coupling whose paths are
    traced back through an interval meets that interval's times again (the same floats: the
    step boundaries are computed from the same coupling times), so each field's sums build their
    sources and tree once (PreparedSources). Kept as long as the path between two couplings is."""
    made = {}

    def once(s):
        if s not in made:
            made[s] = field_at(s)
        return made[s]

    return once


class LogTails:
    """g = log f at the centroids of a HealpixMesh, coupled to the finite-volume density and the
    atoms (module docstring). model: one AttentionModel (the field of g's paths; at β = ∞ the local field).

    After `start`, `couple(t, f, atoms)` advances g to t and substitutes the tail cells of f (in
    place, with the atoms' masses). The last coupling's tail cells, their mass taken from or
    given to the bulk, and the finite volumes' drift from the characteristics over the interval
    (90th percentile over the tail cells of |log₁₀(f / ⟨e^g⟩)| before the substitution) are in
    `last`, its tail cells (a boolean mask) in `tail`.

    profile: "log_linear" (the solver's default with tails): where the kernel is narrower than a
    cell, g's paths take each cell as sub-cell sources with the log-linear profile of ln f
    (field_of); "constant": the cell-centre sums. anchor: g is interpolated at the couplings at
    least this far apart in time only (the anchors; `anchor_time` the last); a coupling in between
    advances the anchor's g along paths through the states of every coupling since, in RK4 steps
    of at most path_step (None: `substeps` per coupling interval; step_states "atom_events": the
    substeps only where atoms changed, _path_steps). anchor 0: g advanced from the
    last coupling, interpolated at every one (as before the anchors). paths "retrace" (default):
    each coupling retraces its paths to the anchor; "maps": it traces its own interval and
    composes it with the last coupling's map (_composed); "selective": the maps, retraced where
    their error budget exceeds retrace_tolerance decades of g (_selective; `retraced` counts those
    centroids at the last coupling); "start": anchor = ∞, g interpolated at
    the start only (an experiment: cost grows as t², and a resumed run restarts there)."""

    def __init__(self, mesh, model, interval: float = TAIL_INTERVAL, level: float = TAIL_LEVEL,
                 exclusion: float = TAIL_EXCLUSION, reset: str = "none", limited: bool = False,
                 criterion: str = "min", follow: bool = True, reference: str = "mesh", substeps: int = 1,
                 paths: str = TAIL_PATHS_DEFAULT, profile: str = "constant", anchor: float = TAIL_ANCHOR,
                 path_step: float | None = TAIL_PATH_STEP, retrace_tolerance: float = TAIL_RETRACE_TOLERANCE,
                 follow_bounds: str = "none", path_scheme: str = "rk4", exclusion_width: float = 0.0,
                 step_states: str = "all", between: str = "linear", path_tolerance: float = 0.0,
                 mass_correction: str = "global"):
        if paths not in TAIL_PATHS + ("start",):
            raise ValueError(f"paths must be 'retrace', 'maps', 'selective', 'backtrack' or 'start', got {paths!r}")
        if follow_bounds not in TAIL_FOLLOW_BOUNDS:
            raise ValueError(f"follow_bounds must be one of {TAIL_FOLLOW_BOUNDS}, got {follow_bounds!r}")
        self.follow_bounds = follow_bounds
        if path_scheme not in TAIL_PATH_SCHEMES:
            raise ValueError(f"path_scheme must be one of {TAIL_PATH_SCHEMES}, got {path_scheme!r}")
        self.path_scheme = path_scheme
        if not retrace_tolerance > 0.0:
            raise ValueError(f"retrace_tolerance must be > 0, got {retrace_tolerance!r}")
        if not anchor >= 0.0:
            raise ValueError(f"anchor must be >= 0, got {anchor!r}")
        if path_step is not None and not path_step > 0.0:
            raise ValueError(f"path_step must be > 0, got {path_step!r}")
        if not path_tolerance >= 0.0 or (path_tolerance > 0.0 and path_scheme != "rk4"):
            raise ValueError(f"path_tolerance must be >= 0 (> 0 with path_scheme 'rk4' only), got {path_tolerance!r}")
        # > 0: g's RK4 steps halved (once) on the paths whose step error estimate exceeds this many
        # decades of g per unit time (trace_back's tolerance); 0: fixed steps of path_step
        self.path_tolerance = float(path_tolerance)
        if mass_correction not in TAIL_MASS_CORRECTIONS:
            raise ValueError(f"mass_correction must be one of {TAIL_MASS_CORRECTIONS}, got {mass_correction!r}")
        self.mass_correction = mass_correction
        # g is interpolated at the anchor times only (as far apart as `anchor` allows: 0 at every
        # coupling, inf at the start only = paths "start"); a coupling in between follows its paths
        # back to the last anchor through the states of the couplings since
        self.anchor = math.inf if paths == "start" else float(anchor)
        # "maps": the couplings in between compose the anchor's paths instead of retracing them
        self.maps = paths in ("maps", "selective", "backtrack")
        # "selective": the maps retraced where their budget runs out (_selective); the states since the anchor kept
        self.selective = paths == "selective"
        # "backtrack": the maps, a path traced on through the coupling before where a map does not
        # resolve it (_backtracked); the states and the maps of every coupling since the anchor kept
        self.backtrack = paths == "backtrack"
        self._maps_since = []  # ("backtrack") (t, departure points at the anchor, ∫ div_S v since) per coupling
        self.retrace_tolerance = float(retrace_tolerance)
        self.retraced = 0  # centroids the last coupling retraced to the anchor ("selective") or traced back ("backtrack")
        self._anchor_slopes = (math.nan, None)  # (anchor time, ∇g there at the centroids), for _selective
        self._cubic = None  # the cubic interpolant of the selective paths' error estimate
        self._map = None  # (departure points at the anchor, ∫ div_S v since, error budget) of the centroids now
        self.path_step = None if path_step is None else float(path_step)
        if reference not in TAIL_REFERENCES:
            raise ValueError(f"reference must be one of {TAIL_REFERENCES}, got {reference!r}")
        if not (isinstance(substeps, int) and substeps >= 1):
            raise ValueError(f"substeps must be an integer >= 1, got {substeps!r}")
        self.reset, self.criterion, self.follow, self.reference = reset, criterion, bool(follow), reference
        self.substeps = substeps
        if step_states not in TAIL_STEP_STATES:
            raise ValueError(f"step_states must be one of {TAIL_STEP_STATES}, got {step_states!r}")
        self.step_states = step_states
        if between not in TAIL_FIELD_BETWEEN:
            raise ValueError(f"between must be one of {TAIL_FIELD_BETWEEN}, got {between!r}")
        self.between = between
        self._measure = None  # ("measure") (t, f, atom points, atom masses) of the last coupling's state
        self._records = []  # ("steps") (t, f, atom positions, masses by slot) since the last coupling (_record)
        self._paths_between = {}  # ("measure", "steps") (t₀, t₁) → s ↦ the field of the measure at s, since the anchor
        self._states = []  # (t, field) of the steps since the last coupling, with substeps > 1 or at atom events
        self._atoms_changed = False  # an atom made or merged since the last coupling (forget_anchor)
        # ("atom_events") the coupling intervals since the anchor whose states after every step g's
        # paths cross: (start, end, the step times between them)
        self._fine = []
        self.mesh, self.model = mesh, model
        self.interval, self.level, self.exclusion = float(interval), float(level), float(exclusion)
        self.interpolant = PolynomialInterpolant(mesh, limited=limited)
        # g's paths where the kernel (width σ = (β σ_max(B))^{-1/2}) is narrower than a cell h:
        # sources at the centres of k × k children, k the power of two with h/k ≤ σ (field_of)
        self.subcells = subcells_for(mesh, model) if profile == "log_linear" else 1
        if self.subcells > 1:
            self._children = subcell_centres(mesh.nside, self.subcells)
        # the neighbourhood of an atom kept by the finite volumes: `exclusion` cells, and at least
        # `exclusion_width` kernel widths, so that it can cover a cluster's basin on every mesh
        if not exclusion_width >= 0.0:
            raise ValueError(f"exclusion_width must be >= 0, got {exclusion_width!r}")
        self.exclusion_width = float(exclusion_width)
        self.reach = max(self.exclusion * math.sqrt(mesh.area),
                         self.exclusion_width * kernel_width(model))  # chordal ≈ geodesic at this size
        self.g = None
        self.rate = None  # ∂g/∂t at the centroids that the tail cells follow until the next coupling
        self.t = math.nan
        self._previous = None  # the field of the state at self.t
        self.last = {}
        self.tail = np.zeros(mesh.npix, dtype=bool)
        self._anchor = None  # (t, cells, values, rates) of the tail cells followed between couplings
        self._anchor_edges = (None, None)  # (the _anchor it was made for, followed_edges)
        # reference "clusters": log of each atom slot's peak density (NaN: none), grown by Liouville
        self.peaks = None
        self._mesh_top = math.nan  # the mesh's largest f at the last coupling
        # ("downstream") where the flow of the last coupling's state carries each centroid in
        # DOWNSTREAM_TIME (the centroid itself for the cells away from the tail): _downstream_from
        self._downstream = mesh.centroids

    def field_of(self, f, atoms):
        """x ↦ (v(x), div_S v(x)): the attention field of f dA + the atoms, frozen now. Where the
        kernel is narrower than a cell (subcells > 1) each cell is SUBCELLS² sources at its
        children's centres (NESTED nside·k), with the log-linear profile of ln f (PolynomialInterpolant.
        slopes) and the cell's mass: the cell-centre sums would get div v wrong by 12–25 % there
        (β = 1000, nside 16; docs/numerics.md#near-field-in-the-tails-near_field_profile)."""
        x, m = atoms.points() if atoms is not None else (None, None)
        return self._field_of_points(f, x, m)

    def _field_of_points(self, f, x, m):
        """field_of for cell densities f and atoms at x (n, 3) with masses m (None: no atoms)."""
        if self.subcells > 1:
            cell_sources = (self._children, log_linear_masses(self.interpolant, self._children, self.subcells, f,
                                                                 self.mesh.area))
            sources = cell_sources[0] if x is None else np.concatenate([cell_sources[0], x])
            masses = cell_sources[1] if m is None else np.concatenate([cell_sources[1], m])
        else:
            sources, masses = mesh_sources(self.mesh, f, x, m)
        model = self.model
        if model.zero_temperature:  # the local field: no sums
            return lambda points, want_div=True: attention_field(model, sources, masses, points, want_div=True)[:2]
        prepared = []  # the sums' source arrays and tree, built at the first call for all the others

        def field(points, want_div=True):  # want_div False: (v, None), the sums' 4 moments instead of 10
            if not prepared:
                prepared.append(PreparedSources(sources, masses))
            p = prepared[0]
            return attention_field(model, p.sources, p.masses, points, want_div=want_div, prepared=p,
                                   tol=PATH_SUM_TOLERANCE)[:2]

        return field

    def start(self, t, g, f, atoms, rate=None, last=None, peaks=None):
        """g (log f at the centroids) at time t, with the state (f, atoms) there; rate: g's rate
        saved with it (a resumed run), else −v·∇g − div_S v in the field of the state (log_rate);
        last: the records of the coupling at t (a resumed run: its snapshots until the next
        coupling repeat them); peaks: the atoms' peak log densities saved with it (reference
        "clusters", a resumed run; peak_state)."""
        g = np.array(g, dtype=float)
        if g.shape != (self.mesh.npix,) or not np.isfinite(g).all():
            raise ValueError(f"tails need log f at the {self.mesh.npix} centroids, finite (f > 0 everywhere)")
        self.g, self.t = g, float(t)
        self._previous = self.field_of(f, atoms)
        self._states, self._fine, self._atoms_changed = [], [], False
        self._measure, self._paths_between = self._measure_of(t, f, atoms), {}
        self._records = self._record(t, f, atoms, [])
        # paths "start": g is interpolated at t only; every coupling follows its paths back to t
        # through the states of all couplings since (kept here)
        self._origin = (float(t), g.copy(), [(float(t), self._previous)])
        self._map, self._maps_since = None, []
        self.last = {"tail_cells": 0, "tail_mass_moved": 0.0, "tail_drift": math.nan, "tail_retraced": 0}
        if last:
            self.last.update({key: last[key] for key in self.last if key in last})
            self.last["tail_cells"] = int(self.last["tail_cells"])
            self.last["tail_retraced"] = int(self.last["tail_retraced"])
        self.rate = self.log_rate(self._previous) if rate is None else np.array(rate, dtype=float)
        self._mesh_top = float(f.max())
        if self.reference == "clusters" and atoms is not None:
            self.peaks = np.full(atoms.capacity, np.nan) if peaks is None else np.array(peaks, dtype=float)
            if self.peaks.shape != (atoms.capacity,):
                raise ValueError(f"tails: {self.peaks.shape} atom peaks for {atoms.capacity} atom slots")
        self._anchor_at(t, f, atoms)
        self._downstream_from(f, atoms)

    def couple(self, t, f, atoms) -> bool:
        """Advance g to t (from the last anchor, along paths through the states of every coupling
        since) and substitute the tail cells of f (in place; the bulk and the atoms' masses scaled
        to keep the mass); t becomes an anchor once it is `anchor` past the last. True when f
        changed."""
        t0, dt = self.t, t - self.t
        if not dt > 0:
            raise ValueError(f"coupling times must increase: {t0!r} then {t!r}")
        now = self.field_of(f, atoms)
        atoms_changed = self._atoms_changed
        if self.step_states == "atom_events":
            if self._atoms_changed:  # this interval's paths go through its states after every step
                self._fine.append((float(t0), float(t), [s for s, _ in self._states]))
            else:  # the field linear between the couplings' states, as without substeps
                self._states = []
        self._atoms_changed = False
        if self.between == "measure" and not self._states and not atoms_changed:  # no step's state in between
            self._paths_between[(float(t0), float(t))] = self._measure_path(t, f, atoms)
        if self.between == "steps" and not self._states:  # the states after the steps, linear between them
            self._paths_between[(float(t0), float(t))] = self._steps_path(self._record(t, f, atoms, self._records))
        # the states since the last anchor: at every coupling (the anchor's first), those recorded
        # since t0 (substeps > 1: one per step), then this one
        origin_t, origin_g, history = self._origin
        times = [s for s, _ in history] + [s for s, _ in self._states] + [float(t)]
        fields = [fn for _, fn in history] + [fn for _, fn in self._states] + [now]
        between = self._paths_between

        def field(s, x, want_div=True):  # the field between the recorded states around s: of the measure, else linear
            k = min(max(bisect.bisect_right(times, s) - 1, 0), len(times) - 2)
            theta = min(max((s - times[k]) / (times[k + 1] - times[k]), 0.0), 1.0)
            if theta == 0.0 or theta == 1.0:  # a recorded time: one state's sums only
                return fields[k + 1 if theta else k](x, want_div)
            path = between.get((times[k], times[k + 1]))
            if path is not None:
                return path(s)(x, want_div)
            (va, da), (vb, db) = fields[k](x, want_div), fields[k + 1](x, want_div)
            return (1 - theta) * va + theta * vb, None if da is None else (1 - theta) * da + theta * db

        g_before = self.g
        if self.backtrack:
            self.g = g = self._backtracked(origin_g, field, t0, dt)
        elif self.maps:
            self.g = g = self._composed(origin_g, field, t0, dt)
        else:
            departure, integral = self._trace(self.interpolant.centroids, field, origin_t, t - origin_t, dt)
            self.g = g = self.interpolant(origin_g, departure) - integral
        self._states_kept, self._states = self._states, []
        self.rate = (g - g_before) / dt  # g's rate over the interval, which the tail follows next
        self.t = float(t)
        f_log = self.interpolant.cell_averages_of_exp(g)
        if self.reference == "clusters":
            self._grow_peaks(t0, t, atoms, self._previous, now)
        near = self._near_atoms(atoms)
        low = f if self.criterion == "fv" else np.minimum(f, f_log)
        top = self.level * self._largest(f, atoms)
        tail = (low < top) & (f_log > 0) & ~near
        both = tail & (f > 0)
        drift = float(np.percentile(np.abs(np.log10(f[both] / f_log[both])), 90)) if both.any() else math.nan
        # A tail value is below the level by definition: where ⟨e^g⟩ exceeds it (g overshooting
        # beside a collapsing peak, which g follows without a reset) the cap keeps it a tail value.
        substitute = np.minimum(f_log[tail], top)
        changed = bool(tail.any())
        moved = self._substitute(f, tail, substitute, atoms, t) if changed else 0.0
        if self.reset == "bulk":
            bulk = ~tail & (f > 0)
        elif self.reset == "atoms":
            bulk = near & (f > 0)
        else:
            bulk = np.zeros(f.shape, dtype=bool)
        g[bulk] = np.log(f[bulk])
        self._previous = self.field_of(f, atoms) if changed else now
        self._mesh_top = float(f.max())
        self._measure = self._measure_of(t, f, atoms)
        self._records = self._record(t, f, atoms, [])
        if t - self._origin[0] >= self.anchor - 1e-9 * max(1.0, abs(t)):  # g interpolated from here on
            self._origin = (float(t), g.copy(), [(float(t), self._previous)])
            self._map, self._maps_since = None, []
            self._fine = []
            self._paths_between = {}
        elif self.maps and not self.selective and not self.backtrack:  # the paths of the next coupling start here
            self._origin = (self._origin[0], self._origin[1], [(float(t), self._previous)])
            self._paths_between = {}
        else:
            self._origin[2].extend(self._states_kept + [(float(t), self._previous)])
        self.last = {"tail_cells": int(tail.sum()), "tail_mass_moved": moved, "tail_drift": drift,
                     "tail_retraced": self.retraced}  # 0 but with the selective paths
        self.tail = tail
        self._anchor_at(t, f, atoms, near)  # the atoms have not moved: their neighbourhoods stand
        self._downstream_from(f, atoms, near)
        return changed

    def _measure_of(self, t, f, atoms):
        """("measure") the state at a coupling t, for the field between it and the next (_measure_path)."""
        if self.between != "measure":
            return None
        x, m = atoms.points() if atoms is not None else (None, None)
        return float(t), np.array(f, dtype=float), None if x is None else x.copy(), None if m is None else m.copy()

    def _measure_path(self, t1, f1, atoms):
        """s ↦ the field of the measure the solver holds at s in (t₀, t₁) (TAIL_FIELD_BETWEEN
        "measure"), from the states of the couplings t₀ (self._measure, after its substitution) and
        t₁ (f1, atoms, before it): the tail cells followed since t₀ take f(t₀)e^{(s − t₀)r} within
        their bounds, exactly as LogTails._follow gave them after every step, so at both ends the
        measure is the state; the other cells and the atoms' masses are linear in s, the atoms on
        the chord between their positions, normalised (no atom was made or merged in between: the
        caller checks, and the living atoms keep their slot order). None where the atoms differ."""
        t0, f0, x0, m0 = self._measure
        _, f1, x1, m1 = self._measure_of(t1, f1, atoms)
        if (x0 is None) != (x1 is None) or (x0 is not None and len(x0) != len(x1)):
            return None
        followed = self._anchor if self._anchor is not None and self._anchor[0] == t0 else None
        span = float(t1) - t0

        @_per_time
        def field_at(s):
            theta = (s - t0) / span
            fs = (1.0 - theta) * f0 + theta * f1
            if followed is not None:
                _, cells, values, rate, low, high = followed
                fs[cells] = np.clip(values * np.exp((s - t0) * rate), low, high)
            if x0 is None or not len(x0):
                return self._field_of_points(fs, None, None)
            return self._field_of_points(fs, unit_rows((1.0 - theta) * x0 + theta * x1), (1.0 - theta) * m0 + theta * m1)

        return field_at

    def _record(self, t, f, atoms, records):
        """("steps") records + [the state at t: f (float32: the sums' masses need no more), the
        atoms' positions and masses by slot (0: no atom)]; nothing recorded with another field."""
        if self.between == "steps":
            x, m = (None, None) if atoms is None else (atoms.positions.copy(), np.where(atoms.alive, atoms.masses, 0.0))
            records.append((float(t), np.array(f, dtype=np.float32), x, m))
        return records

    def _steps_path(self, records):
        """s ↦ the field of the measure the solver held at s between two couplings
        (TAIL_FIELD_BETWEEN "steps"): linear in time between the states recorded after its steps
        (TAIL_STATE_SPACING apart at least; the first after the earlier coupling's substitution,
        the last before the later one's), each atom on the chord between its positions; an atom
        made or merged between two records enters with its mass ramped from 0 or leaves with it
        ramped to 0, as in the reference of validation.background (SavedField)."""
        times = [r[0] for r in records]

        @_per_time
        def field_at(s):
            j = min(max(bisect.bisect_right(times, s) - 1, 0), len(times) - 2)
            (t0, f0, x0, m0), (t1, f1, x1, m1) = records[j], records[j + 1]
            a = (s - t0) / (t1 - t0)
            fs = (1.0 - a) * f0.astype(float) + a * f1.astype(float)
            if x0 is None:
                return self._field_of_points(fs, None, None)
            both, born, died = (m0 > 0) & (m1 > 0), (m1 > 0) & ~(m0 > 0), (m0 > 0) & ~(m1 > 0)
            x = np.concatenate([unit_rows((1.0 - a) * x0[both] + a * x1[both]), x1[born], x0[died]])
            m = np.concatenate([(1.0 - a) * m0[both] + a * m1[both], a * m1[born], (1.0 - a) * m0[died]])
            return self._field_of_points(fs, x, m)

        return field_at

    def _composed(self, origin_g, field, t0, dt):
        """g at the centroids at t0 + dt by the composed paths ("maps"): the paths of this interval
        only, back to t0, then the map of the last coupling at their departure points: its
        departure points at the anchor (each coordinate interpolated, then normalised) and its
        divergence integral (interpolated), g at the anchor interpolated once at the composed
        departure points. The maps are smooth where the field is (at β = 30 its width is 0.18 rad),
        and cost one interval's paths per coupling instead of the retraced span since the anchor."""
        here = self._trace(self.interpolant.centroids, field, t0, dt, dt)
        earlier = self._map  # None at the anchor
        self.retraced = 0
        if not self.selective or earlier is None:
            departure, integral = compose_paths(self.interpolant, *here, earlier[:2] if earlier else None)
            self._map = departure, integral, np.zeros(len(integral))
            return self.interpolant(origin_g, departure) - integral
        departure, integral, budget = self._selective(origin_g, earlier, *here)
        retrace = budget > self.retrace_tolerance * math.log(10.0)
        self.retraced = int(retrace.sum())
        if self.retraced:  # these paths whole, through the states of every coupling since the anchor: exact maps
            origin_t = self._origin[0]
            span = t0 + dt - origin_t
            departure[retrace], integral[retrace] = self._trace(self.interpolant.centroids[retrace], field,
                                                                origin_t, span, dt)
            budget[retrace] = 0.0
        self._map = departure, integral, budget
        return self.interpolant(origin_g, departure) - integral

    def _backtracked(self, origin_g, field, t0, dt):
        """g at the centroids at t1 = t0 + dt by the backtracked maps ("backtrack"): each path is
        traced back through this interval, then composed with the map of the coupling at its start
        (departure points at the anchor, divergence integral since: _maps_since) where that map
        resolves it; elsewhere traced on through the interval before, and so on back to the anchor,
        where g is interpolated (never further: a resumed run starts there). A map resolves a
        point where its quadratic and cubic interpolants give g within retrace_tolerance decades
        (g of the anchor at the composed points, minus the integral). Where atoms compete in the
        softmax the maps fold the tails into fronts narrower than a cell, and interpolating them
        there costs up to 0.4 decades by t = 8 (β = 30, nside 16, docs/numerics.md); the paths
        there are traced exactly, the rest composed once. `retraced`: the centroids traced back
        beyond this interval."""
        interpolant = self.interpolant
        if self._cubic is None:
            self._cubic = PolynomialInterpolant(self.mesh, degree=3)
        n = self.mesh.npix
        departure, integral = np.empty((n, 3)), np.zeros(n)
        points = interpolant.centroids.copy()
        todo = np.arange(n)
        backtracked = np.zeros(n, dtype=bool)
        tolerance = self.retrace_tolerance * math.log(10.0)
        later, k = t0 + dt, len(self._maps_since)
        while todo.size:
            earlier = self._maps_since[k - 1][0] if k else self._origin[0]
            span = later - earlier
            feet, part = self._trace(points[todo], field, earlier, span, dt)
            points[todo] = feet
            integral[todo] += part
            if not k:  # the anchor: its g at the feet
                departure[todo] = feet
                break
            _, anchor_points, anchor_integral = self._maps_since[k - 1]
            columns = np.column_stack([anchor_points, anchor_integral])
            quadratic, cubic = interpolant(columns, feet), self._cubic(columns, feet)
            composed = unit_rows(quadratic[:, :3])
            g_quadratic = interpolant(origin_g, composed) - quadratic[:, 3]
            g_cubic = interpolant(origin_g, unit_rows(cubic[:, :3])) - cubic[:, 3]
            resolved = np.abs(g_quadratic - g_cubic) <= tolerance
            done = todo[resolved]
            departure[done] = composed[resolved]
            integral[done] += quadratic[resolved, 3]
            todo = todo[~resolved]
            backtracked[todo] = True
            later, k = earlier, k - 1
        self.retraced = int(backtracked.sum())
        self._maps_since.append((float(t0 + dt), departure, integral))
        return interpolant(origin_g, departure) - integral

    def _selective(self, origin_g, earlier, feet_now, integral_now):
        """The composed map of the centroids ("selective"; compose_paths) and its error budget: the
        earlier map (departure points X₀ at the anchor, integral D₀, budget b₀) interpolated at
        this interval's departure points y₀, and b = b₀(y₀) + |∇g_a · δX₀| + |δD₀| in units of g,
        δ the difference between the quadratic and the cubic fits at y₀ (the quadratic's
        interpolation error, to leading order), ∇g_a the anchor's slope at the cell of the composed
        departure point. The budget is carried along the paths like the map itself, so the
        errors of many small compositions add up where they would; a centroid whose budget
        exceeds the tolerance is retraced (its map exact again, its budget 0). Where the flow folds
        the tails into fronts the maps bend, and there interpolating them smears g (docs/numerics.md)."""
        if self._anchor_slopes[0] != self._origin[0]:
            self._anchor_slopes = (self._origin[0], self.interpolant.slopes(origin_g, limited=False))
        feet, integral_before, budget_before = earlier
        columns = np.column_stack([feet, integral_before, budget_before])
        quadratic = self.interpolant(columns, feet_now)
        departure = unit_rows(quadratic[:, :3])
        if self._cubic is None:
            self._cubic = PolynomialInterpolant(self.mesh, degree=3)
        delta = quadratic[:, :4] - self._cubic(columns[:, :4], feet_now)
        slope = self._anchor_slopes[1][self.interpolant.cells_of(departure)]
        error = np.abs(np.sum(slope * delta[:, :3], axis=1)) + np.abs(delta[:, 3])
        budget = np.maximum(quadratic[:, 4], 0.0) + error  # an interpolated budget may dip below 0 beside a retraced one
        return departure, integral_now + quadratic[:, 3], budget

    @property
    def anchor_time(self) -> float:
        """The time of the last anchor: g's paths start there (a snapshot at it holds g there, and a
        run resumes from the last such snapshot)."""
        return self._origin[0]

    def _trace(self, points, field, start, span, dt):
        """g's paths from points at start + span back to start (trace_back: departure points,
        ∫ div_S v), in the steps of _path_steps, halved where path_tolerance asks."""
        tolerance = self.path_tolerance * math.log(10.0) if self.path_tolerance > 0.0 else None
        return trace_back(points, field, start, span, self._path_steps(span, dt, start), self.path_scheme,
                          _velocity(field), tolerance=tolerance)

    def _path_steps(self, span, dt, start):
        """RK4 steps of the paths over `span` from `start`: `substeps` per coupling interval dt
        (path_step None), else at most path_step long (× substeps); or, with step_states
        "atom_events", those steps without the substeps, where every coupling interval in the span
        whose states after every step g's paths cross (self._fine) is replaced by `substeps` steps
        between each two of its states: the step boundaries (trace_back)."""
        refine = self.substeps if self.step_states == "all" else 1
        if self.path_step is None:
            steps = refine * max(1, round(span / dt))
        else:
            steps = refine * max(1, math.ceil(span / self.path_step - 1e-9))
        end = start + span
        fine = [(a, b, between) for a, b, between in self._fine if a >= start - 1e-9 and b <= end + 1e-9]
        if not fine:
            return steps
        # the uniform boundaries inside a fine interval give way to its own
        edges = [e for e in (start + span * k / steps for k in range(steps + 1))
                 if not any(a < e < b for a, b, _ in fine)]
        for a, b, between in fine:
            states = [a, *between, b]
            for lo, hi in zip(states[:-1], states[1:]):
                edges += [lo + (hi - lo) * j / self.substeps for j in range(self.substeps + 1)]
        edges = np.unique(np.array(edges))
        keep = np.concatenate([[True], np.diff(edges) > 1e-12 * max(1.0, abs(end))])
        edges = edges[keep]
        edges[0], edges[-1] = start, end
        return edges

    def log_rate(self, field):
        """∂g/∂t = −v·∇g − div_S v at the centroids (1/time), in the frozen field (points → (v,
        div)): ∇g from each centroid's quadratic fit (the linear coefficients of its gnomonic
        coordinates, which have unit scale at the tangent point)."""
        v, div = field(self.interpolant.centroids)
        return -np.sum(self.interpolant.slopes(self.g, limited=False) * v, axis=1) - div

    def _anchor_at(self, t, f, atoms, near=None):
        """The tail cells to follow after a coupling at t: the cells below the level, away from
        the atoms, with their values and the rates of g there. A function of the state (t, f,
        atoms, g) alone, so a run resumed from a snapshot follows exactly what the uninterrupted
        run followed."""
        if not self.follow:
            return
        near = self._near_atoms(atoms) if near is None else near
        top = self.level * self._largest(f, atoms)
        cells = np.flatnonzero((f < top) & (f > 0) & ~near)
        if not cells.size:
            self._anchor = None
            return
        if self.follow_bounds == "neighbours":  # f over each cell and its neighbours (−1: none there)
            stencil = self.interpolant.stencil[cells]
            around = np.where(stencil >= 0, f[np.maximum(stencil, 0)], f[cells, None])
            low, high = around.min(axis=1), np.minimum(around.max(axis=1), top)
        else:
            low, high = 0.0, top
        self._anchor = (float(t), cells, f[cells].copy(), self.rate[cells], low, high)

    def _downstream_from(self, f, atoms, near=None):
        """("downstream") Where the flow carries the centroids of the cells below DOWNSTREAM_MARGIN ×
        the level and away from the atoms (the next couplings' tail cells) in DOWNSTREAM_TIME: Heun
        steps in the frozen field of the state (f, atoms) after the coupling (self._previous), so
        a function of the state, as the followed cells are (_anchor_at). The mass the finite
        volumes spread into a tail cell belongs to the cluster its flow goes to; the nearest bulk
        cell of the cell itself may lie across the separatrix (at β = ∞ the invariant plane x₁ = 0
        of the paper's matrices; docs/numerics.md)."""
        if self.mass_correction != "downstream":
            return
        near = self._near_atoms(atoms) if near is None else near
        # the cells up to DOWNSTREAM_MARGIN above the level too, which may enter the tail by the
        # next coupling (the clusters' peaks, the level's reference, grow as e^{5t} at β = ∞)
        cells = np.flatnonzero((f < DOWNSTREAM_MARGIN * self.level * self._largest(f, atoms)) & ~near)
        ends = self.mesh.centroids.copy()
        self._downstream = ends
        if cells.size == 0:  # no tail yet (a smooth start): nothing to carry
            return
        x = ends[cells]
        h = DOWNSTREAM_TIME / DOWNSTREAM_STEPS
        for _ in range(DOWNSTREAM_STEPS):
            v = self._previous(x, False)[0]
            ahead = unit_rows(x + h * v)
            x = unit_rows(x + 0.5 * h * (v + self._previous(ahead, False)[0]))
        ends[cells] = x

    def forget_anchor(self):
        """Follow nothing until the next coupling: the atoms changed (a new atom's patch decides
        its cells, and the mesh's largest f, which sets the level, dropped with the peak); with
        step_states "atom_events" g's paths cross this interval through its states after every step."""
        self._anchor = None
        self._atoms_changed = True

    @property
    def followed_edges(self):
        """The edges between two followed tail cells (a boolean mask over mesh.edge_cells), or None
        when none are followed: their finite-volume fluxes move nothing the solver keeps, since
        both cells are overwritten after every step (_follow), so the velocity's extrapolation
        error is not measured there (EulerianVelocity.unmeasured). There the velocity is set by
        the followed tails alone, which bend in time where they meet their bounds: measured with
        them, the lag error reached 1–3 % and cut the refresh intervals 2–4× (β = 30, nside 16)."""
        if self._anchor is None:
            return None
        if self._anchor_edges[0] is not self._anchor:
            followed = np.zeros(self.mesh.npix, dtype=bool)
            followed[self._anchor[1]] = True
            self._anchor_edges = (self._anchor, followed[self.mesh.edge_cells].all(axis=1))
        return self._anchor_edges[1]

    def follow_tail(self, t, f, atoms):
        """Between two couplings (t after the last, t₁, before the next): the followed tail cells
        take their values at t₁ times e^{(t − t₁)r} (r = self.rate), at most the level × the
        largest f then (follow_bounds "neighbours": and within the range of f over the cell and its
        neighbours then), in place; the rest of the measure is scaled to keep the mass. Without this
        the finite volumes move accurate tails by 0.15–0.9 decades within an interval of 0.05
        (nside 16, β = 30, t = 6–16), where following is off by 0.04–0.12 (docs/numerics.md)."""
        if self._anchor is not None:
            self._follow(t, f, atoms)
        if self.substeps > 1 or self.step_states == "atom_events":  # for g's paths at the next coupling
            self._states.append((float(t), self.field_of(f, atoms)))
        if self.between == "steps" and t - self._records[-1][0] >= TAIL_STATE_SPACING * (1.0 - 1e-9):
            self._record(t, f, atoms, self._records)

    def _follow(self, t, f, atoms):
        t1, cells, values, rate, low, high = self._anchor
        self._substitute(f, cells, np.clip(values * np.exp((t - t1) * rate), low, high), atoms)

    def _substitute(self, f, cells, values, atoms, t=None):
        """f[cells] = values (cells: a boolean mask or indices; f in place), the rest of the measure
        (the other cells and the atoms) paying for the mass the cells gained (> 0) or gave (< 0),
        which is returned, so that the total is unchanged: mass_correction "global", all of the rest
        by one factor, in proportion to its mass; "local" / "downstream", one payer per cell first
        (_pay_locally), the remainder by that factor. t (a coupling's): a correction that would take
        half of the rest is refused there, with that time in the message."""
        area = self.mesh.area
        gained = (values - f[cells]) * area
        moved = float(gained.sum())
        rest = np.ones(f.shape, dtype=bool)
        rest[cells] = False
        if self.mass_correction == "downstream":  # the bulk or atoms where the flow goes; what they cannot, all
            moved_globally = self._pay_downstream(f, np.arange(f.size)[cells], gained, rest, atoms)
        elif self.mass_correction == "local":  # a nearby cell or atom pays; what it cannot, all of the rest
            moved_globally = self._pay_locally(f, np.arange(f.size)[cells], gained, rest, atoms)
        else:
            moved_globally = moved
        atom_mass = atoms.total_mass if atoms is not None else 0.0
        scale = 1.0 - moved_globally / (f[rest].sum() * area + atom_mass)
        if t is not None and not scale > 0.5:
            raise RunFailure(f"tails: the tail cells would take {moved:.3g} of the mass at t = {t:g} "
                             f"(the tail_level {self.level:g} is too high for this density)")
        f[cells] = values
        f[rest] *= scale
        if atoms is not None:
            atoms.masses *= scale
        return moved

    def _pay_locally(self, f, changed, gained, rest, atoms):
        """mass_correction "local": each changed cell's gain (or loss, < 0) is paid by the cell of the
        rest with f > 0 or living atom nearest to it on the sphere, at most half of its mass and at
        most doubling it; what it cannot pay, by the nearest atom on the same terms; each payer
        scaled by one factor, in place on f[rest] and the atoms' masses. Returns what is left to the
        global factor. The finite volumes' error that the tail cells correct was made by the flow of
        their own cluster, so its mass goes back there, not across the sphere: one factor for all
        moves mass between clusters that the flow keeps apart (but the nearest payer of a cell beside
        a separatrix may lie across it: "downstream"; docs/numerics.md)."""
        area = self.mesh.area
        cells = np.flatnonzero(rest & (f > 0))
        alive = np.flatnonzero(atoms.masses > 0) if atoms is not None else np.zeros(0, dtype=int)
        owed = np.asarray(gained, dtype=float)
        targets = self.mesh.centroids[changed]
        for with_cells in (True, False):  # the nearest place, then the nearest atom for what is left
            use = cells if with_cells else cells[:0]
            if use.size + alive.size == 0 or not owed.any():
                continue
            points = np.concatenate([self.mesh.centroids[use], atoms.positions[alive] if alive.size else
                                     np.zeros((0, 3))])
            owned = np.concatenate([f[use] * area, atoms.masses[alive] if alive.size else np.zeros(0)])
            _, payer = cKDTree(points).query(targets)
            due = np.bincount(payer, weights=owed, minlength=owned.size)
            paid = np.clip(due, -owned, 0.5 * owned)  # a payer keeps at least half, and at most doubles
            share = np.divide(paid, due, out=np.zeros_like(due), where=due != 0)
            owed = owed * (1.0 - share[payer])  # each cell's part that its payer could not pay
            scale = 1.0 - paid / owned
            f[use] *= scale[:use.size]
            if alive.size:
                atoms.masses[alive] *= scale[use.size:]
        return float(owed.sum())

    def _pay_downstream(self, f, changed, gained, rest, atoms):
        """mass_correction "downstream": each changed cell's gain (or loss, < 0) is due from the
        payer (a cell of the rest at or above the level, or a living atom) nearest to where the flow
        carries the cell (_downstream_from), which shares it with the payers within
        DOWNSTREAM_SPREAD of itself, in proportion to their mass; a payer pays at most half of its
        mass, and receives without a cap. In place on f and the atoms' masses; returns what is left
        to the global factor.
        The single nearest payer moved the clusters towards where the flow goes: at β = 1000 (vMF,
        nside 32) the clusters' rotation in the (x₁, x₃) plane reached −0.089 at t = 4.8 against
        −0.066 spread and −0.065 to −0.068 with the other payments on nside 32–128 (docs/numerics.md)."""
        owed = np.asarray(gained, dtype=float)
        # the bulk only: with no cap on receipts, cells of the rest far below the level (beside an
        # atom, where the finite volumes are kept) took up to 1e18× their own mass and raised the
        # mesh's softmax weight at the heaviest atom by 20–54 % per coupling (β = 30, nside 16)
        cells = np.flatnonzero(rest & (f > 0) & (f >= self.level * self._largest(f, atoms)))
        alive = np.flatnonzero(atoms.masses > 0) if atoms is not None else np.zeros(0, dtype=int)
        if cells.size + alive.size == 0:
            return float(owed.sum())
        area = self.mesh.area
        points = np.concatenate([self.mesh.centroids[cells], atoms.positions[alive] if alive.size else np.zeros((0, 3))])
        owned = np.concatenate([f[cells] * area, atoms.masses[alive] if alive.size else np.zeros(0)])
        tree = cKDTree(points)
        _, nearest = tree.query(self._downstream[changed])
        single = np.bincount(nearest, weights=owed, minlength=owned.size)
        payers = np.flatnonzero(single != 0)
        # the pairs (payer that owes, payer within the spread angle's chord of it, itself included)
        chord = 2.0 * math.sin(0.5 * DOWNSTREAM_SPREAD)
        pairs = cKDTree(points[payers]).sparse_distance_matrix(tree, chord, output_type="ndarray")
        owner, member = pairs["i"], pairs["j"]
        group_mass = np.bincount(owner, weights=owned[member], minlength=payers.size)
        due = np.bincount(member, weights=single[payers][owner] * owned[member] / group_mass[owner],
                          minlength=owned.size)
        paid = np.minimum(due, 0.5 * owned)
        scale = 1.0 - paid / owned
        f[cells] *= scale[:cells.size]
        if alive.size:
            atoms.masses[alive] *= scale[cells.size:]
        return float(owed.sum() - paid.sum())

    def _largest(self, f, atoms):
        """The density the level is relative to (sr⁻¹): the mesh's largest f (reference "mesh"), or
        the largest of it and every atom's mass over one cell's area ("measure": an atom is a
        peak the mesh no longer holds, and the mesh's largest f falls when it forms), or of it and
        every atom's peak density ("clusters": _grow_peaks, independent of the mesh)."""
        top = float(f.max())
        if self.reference == "measure" and atoms is not None and atoms.count:
            top = max(top, float(atoms.points()[1].max()) / self.mesh.area)
        if self.reference == "clusters" and self.peaks is not None and atoms is not None and atoms.count:
            known = self.peaks[atoms.alive]
            known = known[np.isfinite(known)]
            if known.size:  # a peak past the largest float (β = 1000, t ≳ 10) is held at e^709:
                # every mesh value is far below its level either way, and no inf enters the bounds
                top = max(top, math.exp(min(float(known.max()), 709.0)))
        return top

    def peak_state(self):
        """The atoms' peak log densities (reference "clusters"; one per atom slot, NaN: none), the
        part of the state a resumed run needs besides g and its rate."""
        return self.peaks.copy()

    def _grow_peaks(self, t0, t, atoms, before, now):
        """Reference "clusters": the peak density of the cluster each atom stands for, carried by
        Liouville along the atom's path, d/dt log f = −div_S v (exact at the maximum of a smooth
        peak), from the mesh's largest f at the coupling before the atom was made (the peak the
        mesh held then, before it was cut): log peak(t) = log peak(t0) − ½(div(t0) + div(t))(t − t0)
        at the atom's position now (trapezoid in time). Unlike the mesh's largest f it does not
        fall when a peak becomes an atom, and unlike an atom's mass per cell area it does not grow
        4× per mesh halving. Slots freed by a merge forget their peak."""
        if atoms is None:
            return
        if self.peaks is None:
            self.peaks = np.full(atoms.capacity, np.nan)
        alive = atoms.alive
        self.peaks[~alive] = np.nan
        if not alive.any():
            return
        new = alive & (~np.isfinite(self.peaks) | (atoms.created > t0))
        self.peaks[new] = math.log(self._mesh_top)
        x = atoms.positions[alive]
        growth = -0.5 * (before(x)[1] + now(x)[1]) * (t - t0)
        self.peaks[alive] += growth

    def _near_atoms(self, atoms):
        """Cells whose centroid lies within `reach` of an atom."""
        near = np.zeros(self.mesh.npix, dtype=bool)
        if atoms is None or not atoms.count:
            return near
        for x in atoms.points()[0]:  # ≤ capacity atoms: O(npix) each
            near |= np.linalg.norm(self.mesh.centroids - x, axis=1) < self.reach
        return near
