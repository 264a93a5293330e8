"""Atoms: point masses that carry the clusters the mesh can no longer resolve.

With atoms the Eulerian state is the measure ρ_t = f_t dA + Σ_k m_k δ_{x_k}: the density on the
mesh plus atoms at exact positions. A Dirac mass moved by the characteristic flow x' = v[ρ](x)
is an exact weak solution of the continuity equation (docs/theory.md#formulas-and-exact-solutions), so an atom adds no error of
its own once it exists; the errors are those of creating and feeding it. This is the
sink-particle technique of Eulerian gas dynamics (Bate, Bonnell & Price 1995; Krumholz, McKee &
Klein 2004; Federrath et al. 2010), designed here for the mean-field equation:

- Creation (unresolved_peaks, Atoms.create): a peak is a cell c that no neighbour exceeds, with
  the neighbours tied with it to round-off (TIE; the 4 cells around a vertex of a symmetric
  state), in a compressive flow (discrete divergence of the last stage's edge fluxes < 0). Its
  patch P is the group with two rings of neighbours around each member (≤ 36 cells for a group
  of 4), its floor f_bg the minimum of f over the outer ring, its excess masses
  e_j = (f_j − f_bg)⁺ A. The peak is unresolved when the excess's second-moment width
  σ = (Σ e_j |y_j − ȳ|² / Σ e_j)^½ (chordal, ȳ the excess's mean, y_j the cell centroids) is at
  most `width` cell sizes h = √A, and it holds at least `min_mass`: then the excess becomes one
  atom at ȳ/|ȳ| and the patch cells keep min(f_j, f_bg) (cut "floor", the default; cut "tail"
  keeps min(f_j, b_j) with log b the a + w·y fit of log f over the outer ring, so a steep
  background e^{linear} stays in place, Atoms._background). Mass is exact (to round-off) and the
  direction of the first moment too; its length loses ~σ²/2, the second-order defect of
  replacing a distribution of width σ by a point on the sphere. σ over a 5 × 5 patch is 0.66 h
  for a Gaussian peak of standard deviation h/2 per axis, 1.36 h for h and 1.61 h for a peak much
  wider than the patch (a paraboloid above its floor), so `width` ≈ 1.3 makes the atom when the
  peak stops being resolved, before it becomes a one-cell spike (docs/theory.md#what-a-mesh-can-represent).
  With shape "sigma" (default "point") the excess becomes four atoms of equal mass that carry its
  tangential covariance (sigma_points): they move with the field averaged over the collapsing
  cluster, where one point moves with the field at its centre, and merge as the flow collapses
  them (docs/numerics.md#atoms-that-keep-their-clusters-spread-atom_shape--sigma).
  Stalled peaks (`stalled_width` > 0; 1.7 by default, 0: off): a peak of width up to
  `stalled_width` whose maximum stopped following the compression,
  (log f_c^{n+1} − log f_c^n)/dt < ½(−div v_c), is unresolved as well (stalled_peaks): the
  scheme holds a collapsing cluster at the width where its numerical diffusion balances the
  contraction (σ ≈ 1.3–1.6 h, measured), which a fixed `width` near that value catches on some
  meshes and not on others. A stalled peak within `join` cell sizes (4 by default, 0: off) of
  an atom heavier than the peak's excess joins that atom instead of making a new one: the
  excess goes to the atom at the normalised mass-weighted mean (Atoms._absorb), so mass and
  the direction of the first moment are exact, as in a merge. It is the remnant of a cluster
  whose core became an atom while its flank was still resolved; left on the mesh it is held
  beside the atom by the scheme's diffusion (measured: ≈ 0.2 of a 0.73 vMF cluster for t = 2.8
  to 8.5 at nside 64), and as a new atom it starts a cascade of small atoms that merge later.
  docs/atoms.md gives the measurements that made this rule the default.
  All peaks of a step are taken from the same f: a cell in several patches gives its excess
  to the candidate whose centre is nearest (shared among those tied to round-off) and keeps
  min(f, lowest floor of its owners), so the mirror-image peaks of a symmetric state are
  treated alike, where taking one first would break the symmetry by the round-off that made it
  the heavier. A peak whose patch holds an atom's cell
  joins that atom (the mass the flow gathers next to an atom, in a cell that is not its own),
  at the atom's position like feeding.
- Feeding (Atoms.feed, off by default: `atom_feeding = false`): after each step, the net mesh
  mass the flow carried into the cells an atom feeds from (the cell whose centroid is nearest
  to it; all of the tied ones at a symmetric point), A (f_c^{n+1} − f_c^n) where positive and
  the cell compressive, joins the atom, and those cells keep f_c^n. Mass is exact; the fed mass
  joins at the atom's position, which moves the first moment by Δ·(x_k − y_c),
  |x_k − y_c| ≲ h/√2: a cell average has no
  sub-cell position, and placing the fed mass at the centroid instead pulls atoms toward the
  centroids (measured: an atom at the unstable equilibrium e₁, a cell vertex, moved 6e-4 in
  t = 0.5 at nside 8, β = 10, where the symmetric rule keeps it to round-off — such a
  displacement seeds the F-phase). This does not drain the background: the atom takes only
  the growth of those cells during the step, never what they held before, so every cell keeps
  at least the value it had, which is ≥ min f; creation leaves min(f_j, f_bg) ≥ min f likewise.
  So neither lowers min f_t, and the density lower bounds (ℓ₀ exp(−∫ sup div v), ½ℓ₀e^{−C₀t})
  remain statements on f_t. Why it is off by default: it loses the sub-cell offset of a cluster
  pair, which is what the F-phase grows from. Symmetric case of docs/atoms.md, ε = 10⁻⁴, β = 10,
  nside 16: the atom at +e₁ is created at t = 2.5 with offset x₃ = +8.2e-5; with feeding it is
  at −3.0e-5 by t = 3 (the fed cells stay at their old value while the 15 % of the mass still
  falling in piles up around them), without feeding at +1.5e-4, growing at the rate 1 of the
  linearisation. Departure times from E: 13.40 with feeding, 10.70 without, 10.70 for the
  quadrature particles. Without feeding the inflow collects in the atom's cell until it is an
  unresolved peak of at least min_mass, and then joins the atom by creation (above).
- Motion: the atoms are carried points of the Runge–Kutta stepper (transport.stepping), moving
  with the attention field of the whole measure (cells and atoms as sources; the local field at
  β = ∞). They are point sources of every summation method (no quadrature, no near-field
  correction) and targets of it.
- Merging (Atoms.merge): atoms closer than `merge` cell sizes merge, closest pair first, into
  the older one at the normalised mass-weighted mean (mass exact).

Atoms live in `capacity` slots (the atom dimension of the run file): a new atom takes the first
slot never used, else the first free one; a slot keeps its atom's creation time while it lives.
When every slot is alive, a peak is not turned into an atom and `refused` counts it.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

__all__ = ["Atoms", "unresolved_peaks", "stalled_peaks", "sigma_points", "PATCH_SIZE", "SHAPES"]

PATCH_SIZE = 64  # the two rings around a group of ≤ 4 tied maxima: at most 6 × 6 cells (7 × 7 for 9)
SHAPES = ("point", "sigma")  # a new atom: one point mass, or four (sigma_points) that merge as it collapses
TIE = 1e-12  # relative: values this close count as equal (a symmetric state is symmetric to round-off)

@njit(cache=True)
def _add_unique(cells, n, c):
    """Append c to cells[:n] unless present (or full); returns the new length."""
    for i in range(n):
        if cells[i] == c:
            return n
    if n == cells.shape[0]:
        return n
    cells[n] = c
    return n + 1


@njit(cache=True)
def _maximal(f, neighbours, c):
    """No neighbour of c exceeds f_c by more than the tie tolerance."""
    top = f[c] * (1.0 + TIE)
    for k in range(8):
        if f[neighbours[c, k]] > top:
            return False
    return True


@njit(cache=True, parallel=True)
def unresolved_peaks(f, neighbours, centroids, divergence, area, peak_width, peak_mass, peak_centre,
                     peak_floor, patch_cells):
    """Creation candidates (module docstring). A peak is a group G: a cell c whose neighbours do
    not exceed f_c (to the relative tie tolerance TIE) with the neighbours tied with it; its
    representative is the lowest index among the group's maximal cells, and it must have
    divergence < 0. Its patch is G with two rings of neighbours around every member (tied
    maxima of a symmetric state thus give a symmetric patch), its floor f_bg the minimum over
    the cells of the patch outside the first rings. For each representative write the patch
    patch_cells[c] (−1 padded), f_bg, the excess mass Σ e_j (e_j = (f_j − f_bg)⁺ A), the unit
    centre ȳ/|ȳ| of the excess and its width σ/h (h = √area); other cells get width inf, mass 0.

    f (npix,); neighbours (npix, 8) (a missing neighbour is the cell itself, HealpixMesh);
    centroids (npix, 3); divergence (npix,) per unit time; area the cell area (sr). σ is
    returned for every candidate: the caller applies the thresholds.
    """
    npix = f.shape[0]
    h = math.sqrt(area)
    for c in prange(npix):
        peak_width[c] = np.inf
        peak_mass[c] = 0.0
        peak_floor[c] = 0.0
        patch = patch_cells[c]
        for k in range(PATCH_SIZE):
            patch[k] = -1
        fc = f[c]
        if not (fc > 0.0 and divergence[c] < 0.0 and _maximal(f, neighbours, c)):
            continue
        group = np.empty(9, dtype=np.int64)
        group[0] = c
        ng = 1
        represent = True
        for k in range(8):
            q = neighbours[c, k]
            if q != c and f[q] >= fc * (1.0 - TIE):
                ng = _add_unique(group, ng, q)
                if q < c and _maximal(f, neighbours, q):
                    represent = False
        if not represent:
            continue
        n = 0
        for g in range(ng):  # the group and its first rings
            n = _add_unique(patch, n, group[g])
            for k in range(8):
                n = _add_unique(patch, n, neighbours[group[g], k])
        inner = n
        for i in range(inner):  # the second rings
            q = patch[i]
            for l in range(8):
                n = _add_unique(patch, n, neighbours[q, l])
        floor = fc
        for i in range(inner, n):
            floor = min(floor, f[patch[i]])
        if n == inner:  # no outer ring (a mesh of 12 cells)
            floor = 0.0
        total = 0.0
        s0 = 0.0
        s1 = 0.0
        s2 = 0.0
        for i in range(n):
            j = patch[i]
            e = max(f[j] - floor, 0.0) * area
            total += e
            s0 += e * centroids[j, 0]
            s1 += e * centroids[j, 1]
            s2 += e * centroids[j, 2]
        if not total > 0.0:
            continue
        m0 = s0 / total
        m1 = s1 / total
        m2 = s2 / total
        var = 0.0
        for i in range(n):
            j = patch[i]
            e = max(f[j] - floor, 0.0) * area
            d0 = centroids[j, 0] - m0
            d1 = centroids[j, 1] - m1
            d2 = centroids[j, 2] - m2
            var += e * (d0 * d0 + d1 * d1 + d2 * d2)
        norm = math.sqrt(m0 * m0 + m1 * m1 + m2 * m2)
        peak_centre[c, 0] = m0 / norm
        peak_centre[c, 1] = m1 / norm
        peak_centre[c, 2] = m2 / norm
        peak_width[c] = math.sqrt(var / total) / h
        peak_mass[c] = total
        peak_floor[c] = floor


def sigma_points(centre, second):
    """Four unit vectors, to carry equal masses, whose mean direction is `centre` and whose
    tangential second moment at it is that of a distribution with second moment `second`
    (E[y yᵀ], 3 × 3, its mean direction `centre`): with the eigenpairs (λ_i, e_i), i = 1, 2, of
    Σ = P E[y yᵀ] P (P = I − c cᵀ: the tangential covariance), the points √(1 − a_i²) c ± a_i e_i,
    a_i = √(2λ_i). Each pair is symmetric about c, so the points' sum is parallel to c (the
    direction of the first moment exact) and their tangential covariance is Σ exactly. A cloud
    that collapses under the flow moves with the field averaged over it, v(c) + ½Σ:∇²v + O(σ⁴),
    where one point moves with v(c): the second-order error of an atom made from a cluster of
    width σ (docs/numerics.md#why-the-vmf-onset-at-β--30-moves-from-nside-32-to-64)."""
    c = _unit(np.asarray(centre, dtype=float))
    P = np.eye(3) - np.outer(c, c)
    lam, vec = np.linalg.eigh(P @ np.asarray(second, dtype=float) @ P)
    points = []
    for i in (2, 1):  # the two tangential axes (the third eigenvector is c, eigenvalue ≈ 0)
        a = min(math.sqrt(2.0 * max(lam[i], 0.0)), 1.0)
        for sign in (1.0, -1.0):
            points.append(math.sqrt(1.0 - a * a) * c + sign * a * vec[:, i])
    return points


def stalled_peaks(f, f_old, divergence, dt, cells, ratio=0.5):
    """Which of the peak cells no longer follow the compression of the flow (boolean, per cell).

    Along a characteristic d/dt log f = −div v (Liouville), and at the maximum of a smooth peak
    ∂f/∂t = −f div v exactly (∇f = 0 there), so a resolved peak's maximum grows at the rate
    −div v. A cluster narrower than the scheme can hold sits at the width where numerical
    diffusion balances the contraction, and its maximum stops growing (measured: the vMF cluster
    of the paper's matrices at β = 10, nside 64, held σ ≈ 1.5–1.6 h from t = 3 to 8 while the flow
    contracts it at rate ≈ 2). Stalled: (log f_c − log f_old_c)/dt < ratio · (−div_c)."""
    cells = np.asarray(cells, dtype=np.int64)
    old = f_old[cells]
    growth = np.full(cells.size, np.inf)
    ok = (old > 0.0) & (f[cells] > 0.0)
    growth[ok] = np.log(f[cells][ok] / old[ok]) / dt
    return growth < ratio * (-divergence[cells])


def _unit(v):
    return v / np.linalg.norm(v)


class Atoms:
    """The atoms of an Eulerian run and the rules that create, feed and merge them.

    mesh: the HealpixMesh; capacity: slots; width: creation threshold on σ in cell sizes h = √A;
    min_mass: smallest excess mass that becomes an atom (the initial mass is 1 for a probability
    density); merge: merge distance in cell sizes (chordal); feeding: feed atoms after each step
    (Atoms.feed); stalled_width: the stalled-peak rule's width limit in cell sizes (0: off);
    join: a stalled peak this close (cell sizes, chordal) to a heavier atom joins it (0: off);
    cut: what a new atom's patch keeps ("floor" or "tail", Atoms._background); shape: a new atom is one
    point ("point") or four that carry its covariance ("sigma", sigma_points; one point when fewer than
    four slots are free).
    State: positions (capacity, 3) (NaN in unused slots), masses (capacity,) (0: no atom),
    created (capacity,) creation times (NaN: never used); counters created_count, merged_count,
    refused_count.
    """

    def __init__(self, mesh, capacity: int = 64, width: float = 1.3, min_mass: float = 1e-4,
                 merge: float = 0.5, feeding: bool = False, stalled_width: float = 1.7, join: float = 4.0,
                 cut: str = "floor", shape: str = "point"):
        if cut not in ("floor", "tail"):
            raise ValueError(f'cut: "floor" or "tail", got {cut!r}')
        if shape not in SHAPES:
            raise ValueError(f"shape: one of {SHAPES}, got {shape!r}")
        self.mesh = mesh
        self.cut = cut
        self.shape = shape
        self.feeding = bool(feeding)  # False: atoms grow by creation and merging only
        self.capacity = int(capacity)
        self.width = float(width)
        self.stalled_width = float(stalled_width)  # 0: off (stalled_peaks)
        self.min_mass = float(min_mass)
        self.merge_distance = float(merge) * math.sqrt(mesh.area)
        self.join_distance = float(join) * math.sqrt(mesh.area)
        self._join = {}  # candidate cell → slot of the atom it joins (find_peaks, for create)
        self.positions = np.full((self.capacity, 3), np.nan)
        self.masses = np.zeros(self.capacity)
        self.created = np.full(self.capacity, np.nan)
        self.created_count = self.merged_count = self.refused_count = 0
        n = mesh.npix
        self._width = np.empty(n)
        self._mass = np.empty(n)
        self._centre = np.zeros((n, 3))
        self._floor = np.empty(n)
        self._patch = np.empty((n, PATCH_SIZE), dtype=np.int64)
        self._neighbours = np.ascontiguousarray(mesh.neighbours, dtype=np.int64)

    # ------------------------------------------------------------------ state
    @property
    def alive(self):
        return self.masses > 0

    @property
    def count(self) -> int:
        return int(np.count_nonzero(self.alive))

    @property
    def total_mass(self) -> float:
        return float(self.masses.sum())

    def points(self):
        """(positions (n, 3), masses (n,)) of the living atoms, in slot order."""
        alive = self.alive
        return self.positions[alive], self.masses[alive]

    def set_points(self, positions):
        """Move the living atoms (slot order) to positions (n, 3)."""
        self.positions[self.alive] = positions

    def cells(self, positions=None):
        """The mesh cells of the living atoms (or of positions)."""
        import healpy as hp

        x = self.points()[0] if positions is None else positions
        if len(x) == 0:
            return np.empty(0, dtype=np.int64)
        return hp.vec2pix(self.mesh.nside, x[:, 0], x[:, 1], x[:, 2], nest=True).astype(np.int64)

    def state(self) -> dict:
        """The arrays of the run file (ATOM_ARRAYS, also what a resume restores) and the counters."""
        return {"atom_position": self.positions.copy(), "atom_mass": self.masses.copy(),
                "atom_created": self.created.copy(), "created": self.created_count,
                "merged": self.merged_count, "refused": self.refused_count}

    def restore(self, positions, masses, created, created_count=0, merged_count=0, refused_count=0):
        """Set the state exactly as saved (Atoms.state)."""
        if np.shape(masses) != (self.capacity,):
            raise ValueError(f"atom state for {np.shape(masses)} slots, this run has {self.capacity}")
        self.positions = np.array(positions, dtype=float).reshape(self.capacity, 3)
        self.masses = np.array(masses, dtype=float)
        self.masses[~np.isfinite(self.masses)] = 0.0
        self.created = np.array(created, dtype=float)
        self.created_count, self.merged_count = int(created_count), int(merged_count)
        self.refused_count = int(refused_count)

    def _absorb(self, k, mass, centre):
        """Atom k gains mass at centre: mass exact, position the normalised mass-weighted mean."""
        m = self.masses[k]
        self.positions[k] = _unit(m * self.positions[k] + mass * centre)
        self.masses[k] = m + mass

    # ------------------------------------------------------------------ rules
    def find_peaks(self, f, divergence, f_old=None, dt=None):
        """Run unresolved_peaks on f; returns the candidate cells (unresolved, heavy enough),
        heaviest first: width σ ≤ `width`, or σ ≤ `stalled_width` and stalled (stalled_peaks;
        needs the step's f_old and dt). The per-cell results stay in the work arrays; the stalled
        peaks that join an atom (module docstring) in self._join."""
        mesh = self.mesh
        unresolved_peaks(f, self._neighbours, mesh.centroids, divergence, float(mesh.area), self._width,
                         self._mass, self._centre, self._floor, self._patch)
        heavy = self._mass >= self.min_mass
        unresolved = self._width <= self.width
        self._join = {}
        if self.stalled_width > 0.0 and f_old is not None and dt is not None and dt > 0.0:
            near = np.flatnonzero(heavy & ~unresolved & (self._width <= self.stalled_width))
            stalled = near[stalled_peaks(f, f_old, divergence, dt, near)]
            unresolved[stalled] = True
            if stalled.size and self.count and self.join_distance > 0.0:
                self._join = self._joining(stalled)
        cand = np.flatnonzero(unresolved & heavy)
        return cand[np.argsort(-self._mass[cand], kind="stable")]

    def _joining(self, stalled):
        """{cell: slot} for the stalled peaks within the join distance of a living atom heavier
        than the peak's excess: the nearest such atom."""
        slots = np.flatnonzero(self.alive)
        d = np.linalg.norm(self._centre[stalled][:, None, :] - self.positions[slots][None, :, :], axis=2)
        d[self.masses[slots][None, :] < self._mass[stalled][:, None]] = np.inf  # (peaks × atoms ≤ capacity)
        nearest = np.argmin(d, axis=1)
        close = d[np.arange(stalled.size), nearest] <= self.join_distance
        return {int(c): int(slots[k]) for c, k in zip(stalled[close], nearest[close])}

    def _anchors(self, f, cand):
        """Where each candidate peak sits: the normalised mean of the centroids of its maximal
        cells (the representative and the neighbours tied with it, as in unresolved_peaks), the
        same for mirror-image peaks whatever their cell indices."""
        nbr = self._neighbours[cand]
        tied = f[nbr] >= f[cand][:, None] * (1.0 - TIE)
        centroids = self.mesh.centroids
        anchors = centroids[cand] + np.einsum("ck,ckd->cd", tied, centroids[nbr])
        # a missing neighbour is the cell itself: counted twice, harmless for a mean direction
        return anchors / np.linalg.norm(anchors, axis=1, keepdims=True)

    def _ownership(self, f, cand):
        """Which candidates take each patch cell: a cell in one patch belongs to that candidate;
        a cell in several patches to the candidate whose maximal cells are nearest (_anchors), shared equally
        among those tied to round-off. Patches of neighbouring peaks overlap (on a coarse mesh
        even those of antipodal peaks), and mirror-image peaks of a symmetric state are tied in
        mass: extracting one before the other would break the symmetry by the round-off that made
        it the heavier. Returns (cells, owners, shares, exclusive): per cell its candidate indices
        (into cand) and their shares of the cell's excess; exclusive[i]: candidate i owns its
        whole patch alone."""
        patches = [self._patch[c][self._patch[c] >= 0] for c in cand]
        anchors = self._anchors(f, cand)
        holders = {}
        for i, patch in enumerate(patches):
            for cell in patch.tolist():
                holders.setdefault(cell, []).append(i)
        exclusive = np.ones(len(cand), dtype=bool)
        cells, owners, shares = [], [], []
        centroids = self.mesh.centroids
        for cell, held in holders.items():
            if len(held) > 1:
                exclusive[held] = False
                d = np.linalg.norm(anchors[held] - centroids[cell], axis=1)
                held = [i for i, di in zip(held, d) if di <= d.min() * (1 + 1e-9) + 1e-15]
            cells.append(cell)
            owners.append(held)
            shares.append(1.0 / len(held))
        return np.array(cells, dtype=np.int64), owners, np.array(shares), exclusive

    def _background(self, f, c):
        """{cell: value} the mesh keeps in candidate c's patch: min(f, b). With cut "floor", b =
        f_bg, the outer ring's least f. With cut "tail", b is the tail under the peak, log b = the least-squares fit a + w·y of log f over the outer ring (the second
        rings), at least the outer ring's least f (the flat
        floor f_bg, so min f is never lowered). (No upper cap: min(f, b) never raises f, and a cap
        would leave a plateau of equal values, a flat peak whose ties round-off decides.) A background e^{linear} is thus
        left exactly as it was around the atom, where the flat floor min(f, f_bg) cut a notch down
        to the outer ring's minimum (decades below its largest value when the background is
        steep). The flat floor remains where log f is not available (an outer cell with f = 0)."""
        patch = self._patch[c][self._patch[c] >= 0]
        group = [c] + [q for q in self._neighbours[c] if q != c and f[q] >= f[c] * (1.0 - TIE)]
        inner = np.unique(np.r_[group, self._neighbours[group].ravel()])
        is_outer = ~np.isin(patch, inner)
        outer = patch[is_outer]
        tail = np.full(patch.size, self._floor[c])
        if self.cut == "tail" and outer.size >= 4 and np.all(f[outer] > 0):
            n = self._centre[c]
            e1 = np.cross(n, [0.0, 0.0, 1.0] if abs(n[2]) < 0.9 else [1.0, 0.0, 0.0])
            e1 /= np.linalg.norm(e1)
            e2 = np.cross(n, e1)
            y = self.mesh.centroids[patch]
            h = math.sqrt(self.mesh.area)
            # log f = a + w·y exactly for any w, in O(1) columns: y's coordinates along e1, e2 and
            # its drop 1 − y·n below the tangent plane (quadratic in the distance)
            design = np.c_[np.ones(patch.size), y @ e1 / h, y @ e2 / h, (1.0 - y @ n) / h**2]
            coef = np.linalg.lstsq(design[is_outer], np.log(f[outer]), rcond=None)[0]
            tail = np.maximum(np.exp(design @ coef), f[outer].min())
        return {int(j): min(f[j], b) for j, b in zip(patch, tail)}

    def _split(self, f, cand):
        """The extraction of the candidates cand from f, all at once: (cells, new values, mass
        (per candidate), first moment (per candidate, 3), second moment Σ e_j y_j y_jᵀ (per
        candidate, 3 × 3; None unless the shape is "sigma"), exclusive) (_ownership); a cell keeps
        the least of what its owners leave it (_background)."""
        cells, owners, shares, exclusive = self._ownership(f, cand)
        old = f[cells]
        kept = [self._background(f, c) for c in cand]
        new = np.array([min(kept[i][int(cell)] for i in held) for cell, held in zip(cells, owners)])
        excess = (old - new) * self.mesh.area
        mass = np.zeros(cand.size)
        moment = np.zeros((cand.size, 3))
        second = np.zeros((cand.size, 3, 3)) if self.shape == "sigma" else None
        for j, held in enumerate(owners):
            y = self.mesh.centroids[cells[j]]
            for i in held:
                mass[i] += shares[j] * excess[j]
                moment[i] += shares[j] * excess[j] * y
                if second is not None:
                    second[i] += shares[j] * excess[j] * np.outer(y, y)
        return cells, new, mass, moment, second, exclusive

    def create(self, t, f, divergence, f_old=None, dt=None) -> int:
        """Turn the unresolved peaks of f into atoms (or feed them to an atom whose cell is in
        their patch, or join a stalled one to the heavier atom beside it), in place on f. All peaks are taken from the same f: a cell in several
        patches keeps min(f, lowest floor of its owners) and its excess goes to the nearest
        candidate(s) (_ownership); a candidate left with less than min_mass of its own (a plateau
        on the flank of a peak, whose patch reaches into the peak's) is dropped. Returns the
        number of peaks moved to atoms, new or not (self.created_count counts the new ones)."""
        cand = self.find_peaks(f, divergence, f_old, dt)
        while cand.size:
            split = self._split(f, cand)
            heavy = split[2] >= self.min_mass
            if heavy.all():
                break
            cand = cand[heavy]
        if cand.size == 0:
            return 0
        # an existing atom in the patch takes the peak; the others need a free slot (heaviest first)
        atom_cells = self.cells()
        alive_slots = np.flatnonzero(self.alive)
        free = sorted((k for k in range(self.capacity) if not self.alive[k]),
                      key=lambda k: (not np.isnan(self.created[k]), k))  # never-used slots first
        owner = np.full(cand.size, -1)
        for i, c in enumerate(cand):
            patch = self._patch[c][self._patch[c] >= 0]
            inside = np.isin(atom_cells, patch) if atom_cells.size else np.zeros(0, dtype=bool)
            if int(c) in self._join:
                owner[i] = self._join[int(c)]
            elif inside.any():
                slots = alive_slots[inside]
                owner[i] = slots[np.argmin(np.linalg.norm(self.positions[slots] - self._centre[c], axis=1))]
            elif free:
                owner[i] = free.pop(0)
            else:
                self.refused_count += 1
        if (owner < 0).any():  # refused peaks stay on the mesh: split among the others again
            cand, owner = cand[owner >= 0], owner[owner >= 0]
            if cand.size == 0:
                return 0
            split = self._split(f, cand)
        cells, new, mass, moment, second, exclusive = split
        f[cells] = new
        joined = {}  # slot → (mass, first moment) of the peaks joining it, summed before one normalisation
        for i, k in enumerate(owner):
            if self.masses[k] > 0 and int(cand[i]) in self._join:
                jm, jx = joined.get(k, (0.0, np.zeros(3)))
                joined[k] = (jm + mass[i], jx + moment[i])
            elif self.masses[k] > 0:
                self.masses[k] += mass[i]  # at the atom (see the module docstring)
            else:
                # the direction of the first moment taken (for an exclusive peak cut at the floor it is
                # the kernel's centre of the excess, computed in the same order as before)
                centre = self._centre[cand[i]] if exclusive[i] and self.cut == "floor" else _unit(moment[i])
                points = [centre]
                if self.shape == "sigma":
                    points = sigma_points(centre, second[i] / mass[i])
                    extra = [free.pop(0) for _ in range(min(len(points) - 1, len(free)))]
                    if len(extra) < len(points) - 1:  # no room for the cloud: one point, as "point"
                        free[:0] = extra
                        points, extra = [centre], []
                    slots = [k] + extra
                else:
                    slots = [k]
                for slot, x in zip(slots, points):
                    self.positions[slot] = x
                    self.masses[slot] = mass[i] / len(points)
                    self.created[slot] = t
                self.created_count += 1
        for k, (jm, jx) in joined.items():
            # direction of m_k x_k + the excesses' first moments: exact, and independent of the
            # order of the peaks (normalising after each would not be: two mirror-image peaks
            # moved the atom 1.7e-4 off its mirror plane, tests/solvers/test_atoms.py)
            if jm > 0:
                self._absorb(k, jm, jx / jm)
        return int(cand.size)

    def feeding_cells(self, x):
        """The cells an atom at x feeds from: those among its cell and that cell's neighbours
        whose centroid is nearest to x (several when tied to round-off, as at a symmetric point)."""
        c = int(self.cells(x[None, :])[0])
        near = np.unique(np.r_[c, self.mesh.neighbours[c]])
        d = np.linalg.norm(self.mesh.centroids[near] - x, axis=1)
        return near[d <= d.min() * (1 + 1e-9) + 1e-15]

    def feed(self, f_old, f_new, divergence) -> float:
        """Feeding (module docstring), in place on f_new; returns the mass moved to atoms (0 with
        feeding off)."""
        if self.count == 0 or not self.feeding:
            return 0.0
        area = self.mesh.area
        moved = 0.0
        for k in np.flatnonzero(self.alive):
            cells = self.feeding_cells(self.positions[k])
            gain = f_new[cells] - f_old[cells]
            fed = cells[(gain > 0) & (divergence[cells] < 0)]
            if fed.size:
                mass = float(np.sum(f_new[fed] - f_old[fed]) * area)
                f_new[fed] = f_old[fed]
                self.masses[k] += mass
                moved += mass
        return moved

    def merge(self) -> int:
        """Merge atoms closer than the merge distance, closest pair first; returns the merges."""
        merges = 0
        while True:
            slots = np.flatnonzero(self.alive)
            if slots.size < 2:
                return merges
            x = self.positions[slots]
            d = np.linalg.norm(x[:, None, :] - x[None, :, :], axis=2)  # n ≤ capacity: small
            np.fill_diagonal(d, np.inf)
            i, j = np.unravel_index(np.argmin(d), d.shape)
            if d[i, j] >= self.merge_distance:
                return merges
            a, b = slots[i], slots[j]
            keep, gone = (a, b) if (self.created[a], a) <= (self.created[b], b) else (b, a)
            self._absorb(keep, self.masses[gone], self.positions[gone])
            self.masses[gone] = 0.0
            self.positions[gone] = np.nan
            self.merged_count += 1
            merges += 1
