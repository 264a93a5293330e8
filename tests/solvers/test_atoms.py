"""Atoms (spherepde.solvers.atoms): creation, feeding and merging conserve mass and the centre of mass;
the peak finder equals its NumPy reference; atoms move in the field of the whole measure with
the mesh's Runge–Kutta stages (a lone atom at an eigenvector stays, two atoms follow the
closed-form two-atom softmax ODE at the stepper's order); runs with atoms conserve mass."""

import math

import healpy as hp
import numpy as np
import numpy_reference as ref
import pytest
from scipy.integrate import solve_ivp

from spherepde import AttentionModel, EulerianSolver
from spherepde.solvers.atoms import PATCH_SIZE, Atoms, sigma_points, stalled_peaks, unresolved_peaks
from spherepde.solvers.controller import SolverState

PAPER_V = np.diag([-1.0, 1.0, -2.0])
PAPER_B = np.diag([-1.0, -1.0, 1.0])


def gaussian_peak(mesh, centre, sd, background=0.1, mass=0.5):
    """Cell values of background + a normalised Gaussian bump of chordal s.d. sd per axis."""
    centre = np.asarray(centre, dtype=float) / np.linalg.norm(centre)
    d2 = np.sum((mesh.centroids - centre) ** 2, axis=1)
    bump = np.exp(-d2 / (2 * sd**2))
    return background + mass * bump / (bump.sum() * mesh.area)


def test_peak_finder_equals_numpy_reference(mesh_factory):
    mesh = mesh_factory(8)
    rng = np.random.default_rng(3)
    f = rng.random(mesh.npix) ** 4
    f[[5, 6]] = 2.0  # a tie between neighbours: one group, the lower index represents it
    f[100:110] = 0.0
    div = rng.normal(size=mesh.npix)
    div[5] = div[6] = -1.0
    out = (np.empty(mesh.npix), np.empty(mesh.npix), np.zeros((mesh.npix, 3)), np.empty(mesh.npix),
           np.empty((mesh.npix, PATCH_SIZE), dtype=np.int64))
    nbr = np.ascontiguousarray(mesh.neighbours, dtype=np.int64)
    unresolved_peaks(f, nbr, mesh.centroids, div, mesh.area, *out)
    width, mass, centre, floor, patches = ref.unresolved_peaks(f, nbr, mesh.centroids, div, mesh.area)
    np.testing.assert_array_equal(np.isfinite(out[0]), np.isfinite(width))
    assert np.isfinite(width).sum() > 20  # the comparison covers many candidates
    cand = np.isfinite(width)
    np.testing.assert_allclose(out[0][cand], width[cand], rtol=1e-12)
    np.testing.assert_allclose(out[1], mass, rtol=1e-12, atol=0)
    np.testing.assert_allclose(out[2][cand], centre[cand], rtol=0, atol=1e-14)
    np.testing.assert_array_equal(out[3][cand], floor[cand])
    for c in np.flatnonzero(cand):
        assert set(out[4][c][out[4][c] >= 0].tolist()) == patches[c]
    assert cand[5] and not cand[6] and {5, 6} <= patches[5]


@pytest.mark.parametrize("sd_cells, expected", [(0.5, 0.66), (1.0, 1.36)])
def test_width_of_a_gaussian_peak(mesh_factory, sd_cells, expected):
    """σ of the excess over its floor, for a Gaussian of s.d. sd_cells·h per axis: the values the
    module docstring quotes for the default threshold (≈ √2·sd for a narrow peak)."""
    mesh = mesh_factory(32)
    h = math.sqrt(mesh.area)
    centre = mesh.centroids[4000]
    f = gaussian_peak(mesh, centre, sd_cells * h)
    atoms = Atoms(mesh)
    atoms.find_peaks(f, -np.ones(mesh.npix))
    assert atoms._width[4000] == pytest.approx(expected, abs=0.12)


def test_creation_leaves_a_steep_tail_in_place(mesh_factory):
    """A one-cell peak on a background e^{linear} that falls by a decade per cell (the tails
    beside a cluster): the atom takes the peak, and every cell of the patch keeps the background,
    where the flat floor min(f, f_bg) cut the patch down to its outer ring's minimum (a notch of
    up to four decades)."""
    mesh = mesh_factory(16)
    h = math.sqrt(mesh.area)
    centre = np.array([0.3, 0.9, 0.2]) / np.linalg.norm([0.3, 0.9, 0.2])
    slope = np.cross(centre, [0.0, 0.0, 1.0])
    slope *= math.log(10.0) / (h * np.linalg.norm(slope))  # a decade per cell size
    background = np.minimum(1e-3 * np.exp((mesh.centroids - centre) @ slope), 1.0)  # ≪ the peak far away
    f = gaussian_peak(mesh, centre, 0.25 * h, background=0.0) + background
    before = f.copy()
    floor = Atoms(mesh, width=1.3, min_mass=1e-3)
    cut = f.copy()
    assert floor.create(1.5, cut, -np.ones(mesh.npix)) == 1
    atoms = Atoms(mesh, width=1.3, min_mass=1e-3, cut="tail")
    cand = atoms.find_peaks(f, -np.ones(mesh.npix))
    assert cand.size == 1
    patch = atoms._patch[cand[0]][atoms._patch[cand[0]] >= 0]
    assert atoms.create(1.5, f, -np.ones(mesh.npix)) == 1
    assert background[patch].max() / background[patch].min() > 1e3
    np.testing.assert_allclose(f[patch], background[patch], rtol=1e-5)  # the Gaussian adds < 1e-12
    assert np.min(cut[patch] / background[patch]) < 1e-3  # the floor's notch
    assert np.all(f <= before)
    assert abs(mesh.integrate(f) + atoms.total_mass - mesh.integrate(before)) < 1e-15


def test_creation_conserves_mass_and_centre_and_keeps_the_floor(mesh_factory):
    mesh = mesh_factory(16)
    h = math.sqrt(mesh.area)
    f = gaussian_peak(mesh, [0.3, 0.9, 0.2], 0.4 * h)
    before = f.copy()
    atoms = Atoms(mesh, width=1.3, min_mass=1e-3)
    made = atoms.create(1.5, f, -np.ones(mesh.npix))
    assert made == 1 and atoms.count == 1
    x, m = atoms.points()
    assert abs(mesh.integrate(f) + m.sum() - mesh.integrate(before)) < 1e-15
    taken = (before - f) * mesh.area
    first_moment = taken @ mesh.centroids
    np.testing.assert_allclose(x[0], first_moment / np.linalg.norm(first_moment), atol=1e-15)
    assert m[0] == pytest.approx(taken.sum(), rel=1e-14)
    assert 0.45 < m[0] < 0.5  # the bump's mass, less what its tails leave outside the patch
    assert f.min() >= before.min()  # min f is not lowered
    assert atoms.created[0] == 1.5


@pytest.mark.parametrize("heavier", [+1, -1])
def test_mirror_image_peaks_become_mirror_image_atoms(mesh_factory, heavier):
    """Two narrow peaks mirror-symmetric under y → −y (a symmetry of the HEALPix mesh), so close
    that their patches overlap: whichever is heavier by round-off, they become two mirror-image
    atoms of equal mass and the density stays mirror-symmetric. (Extracting one before the other
    broke a symmetric run by the round-off that ordered them.)"""
    mesh = mesh_factory(16)
    h = math.sqrt(mesh.area)
    c = mesh.centroids
    mirror = hp.vec2pix(mesh.nside, c[:, 0], -c[:, 1], c[:, 2], nest=True)
    np.testing.assert_allclose(c[mirror], c * [1, -1, 1], atol=1e-15)
    base = np.array([0.6, 0.0, 0.8])
    p = np.argmin(np.linalg.norm(c - base - [0, 1.5 * h, 0], axis=1))  # a cell ~1.5 cells off the plane
    assert c[p, 1] > 1.5 * h
    f = gaussian_peak(mesh, c[p], 0.3 * h, mass=0.25) + gaussian_peak(mesh, c[mirror[p]], 0.3 * h, mass=0.25)
    f = 0.5 * (f + f[mirror])
    f[p if heavier > 0 else mirror[p]] *= 1 + 1e-14  # round-off decides which peak is heavier
    before = f.copy()
    atoms = Atoms(mesh, width=1.3, min_mass=1e-3)
    cand = atoms.find_peaks(f, -np.ones(mesh.npix))
    patches = [set(atoms._patch[k][atoms._patch[k] >= 0].tolist()) for k in cand]
    assert len(cand) == 2 and patches[0] & patches[1]  # two peaks, overlapping patches
    assert atoms.create(1.0, f, -np.ones(mesh.npix)) == 2
    x, m = atoms.points()
    assert atoms.count == 2 and abs(m[0] - m[1]) < 1e-13 * m[0]
    np.testing.assert_allclose(x[1], x[0] * [1, -1, 1], atol=1e-13)
    np.testing.assert_allclose(f, f[mirror], rtol=1e-12, atol=0)
    assert mesh.integrate(f) + m.sum() == pytest.approx(mesh.integrate(before), abs=1e-15)
    taken = (before - f) * mesh.area
    first = taken @ c  # the directions of the first moments: of the two atoms and of what they took
    np.testing.assert_allclose((m @ x) / np.linalg.norm(m @ x), first / np.linalg.norm(first), atol=1e-13)
    assert f.min() >= before.min()


def test_antipodal_peaks_on_a_coarse_mesh_stay_two_atoms(mesh_factory):
    """On a coarse mesh the patches of antipodal peaks overlap; each cell's excess goes to the
    nearer peak, so ±e₁ become two atoms at ±e₁ (not one atom at the normalised mean of the
    two, a direction set by round-off)."""
    mesh = mesh_factory(2)
    e1 = np.array([1.0, 0.0, 0.0])
    f = gaussian_peak(mesh, e1, 0.15, background=0.01, mass=0.3) + gaussian_peak(mesh, -e1, 0.15, background=0.0, mass=0.3)
    before = f.copy()
    atoms = Atoms(mesh, width=1.3, min_mass=1e-3)
    made = atoms.create(0.5, f, -np.ones(mesh.npix))
    x, m = atoms.points()
    assert made == 2 and atoms.count == 2
    np.testing.assert_allclose(np.sort(x[:, 0]), [-1.0, 1.0], atol=0.05)
    assert mesh.integrate(f) + m.sum() == pytest.approx(mesh.integrate(before), abs=1e-15)


def test_no_atom_from_a_resolved_or_expanding_or_light_peak(mesh_factory):
    mesh = mesh_factory(16)
    h = math.sqrt(mesh.area)
    wide = gaussian_peak(mesh, [0.3, 0.9, 0.2], 3 * h)
    narrow = gaussian_peak(mesh, [0.3, 0.9, 0.2], 0.4 * h)
    light = gaussian_peak(mesh, [0.3, 0.9, 0.2], 0.4 * h, mass=1e-5)
    assert Atoms(mesh).create(0.0, wide.copy(), -np.ones(mesh.npix)) == 0
    assert Atoms(mesh).create(0.0, narrow.copy(), np.ones(mesh.npix)) == 0  # div v > 0
    assert Atoms(mesh, min_mass=1e-4).create(0.0, light.copy(), -np.ones(mesh.npix)) == 0


@pytest.mark.parametrize("growth, stalled_width, sd_cells, made", [
    (0.0, 1.7, 1.15, 1),   # the maximum stopped growing: the scheme holds the peak, it is unresolved
    (1.0, 1.7, 1.15, 0),   # the maximum grows at the compression rate (Liouville): resolved
    (0.3, 1.7, 1.15, 1),   # below half the rate
    (0.0, 0.0, 1.15, 0),   # rule off
    (0.0, 1.7, 3.0, 0),    # wider than stalled_width: never
])
def test_a_stalled_peak_becomes_an_atom(mesh_factory, growth, stalled_width, sd_cells, made):
    """σ ≈ 1.5 h lies between atom_width (1.3) and stalled_width (1.7): the peak becomes an atom
    only when its maximum grows at less than half the compression rate −div v over the step."""
    mesh = mesh_factory(16)
    h = math.sqrt(mesh.area)
    f = gaussian_peak(mesh, [0.3, 0.9, 0.2], sd_cells * h)
    div, dt = -2.0 * np.ones(mesh.npix), 0.01
    f_old = f * np.exp(-growth * 2.0 * dt)  # log f grew by growth·(−div)·dt over the step
    atoms = Atoms(mesh, stalled_width=stalled_width)
    atoms.find_peaks(f, div)
    width = atoms._width[np.argmax(f)]
    assert (1.3 < width < 1.7) if sd_cells < 2 else width > 1.7
    assert atoms.create(0.0, f.copy(), div, f_old, dt) == made
    assert Atoms(mesh, stalled_width=stalled_width).create(0.0, f.copy(), div) == 0  # no step known


def _peak_beside_an_atom(mesh, atom_mass, distance_cells):
    """A stalled peak (σ ≈ 1.5 h, its maximum not growing over the step) and one atom at
    distance_cells·h from its centre, outside its patch: (atoms, f, div, f_old, dt)."""
    h = math.sqrt(mesh.area)
    centre = np.array([0.3, 0.9, 0.2]) / np.linalg.norm([0.3, 0.9, 0.2])
    f = gaussian_peak(mesh, centre, 1.15 * h)
    div, dt = -2.0 * np.ones(mesh.npix), 0.01
    side = np.cross(centre, [0.0, 0.0, 1.0])
    side /= np.linalg.norm(side)
    angle = 2 * math.asin(distance_cells * h / 2)  # chordal distance_cells·h
    x = math.cos(angle) * centre + math.sin(angle) * side
    atoms = Atoms(mesh)
    positions = np.full((atoms.capacity, 3), np.nan)
    positions[0] = x
    masses = np.zeros(atoms.capacity)
    masses[0] = atom_mass
    created = np.full(atoms.capacity, np.nan)
    created[0] = 0.0
    atoms.restore(positions, masses, created, created_count=1)
    return atoms, f, div, f.copy(), dt  # f_old = f: the maximum did not grow


def test_a_stalled_peak_beside_a_heavier_atom_joins_it(mesh_factory):
    """The join (atom_join, default 4 h): the peak's excess goes to the atom; mass exact and the
    atom moves to the direction of m x + Σ_j e_j y_j (the patch's excess and its first moment,
    e_j = A (f_j before − f_j after)), as in a merge."""
    mesh = mesh_factory(16)
    atoms, f, div, f_old, dt = _peak_beside_an_atom(mesh, 0.8, 3.5)
    cand = atoms.find_peaks(f, div, f_old, dt)
    assert cand.size == 1
    patch = atoms._patch[cand[0]][atoms._patch[cand[0]] >= 0]
    assert atoms.cells()[0] not in patch  # not the rule of an atom inside the patch
    x0, m0 = atoms.positions[0].copy(), atoms.masses[0]
    before = f.copy()
    assert atoms.create(1.0, f, div, f_old, dt) == 1
    assert atoms.count == 1 and atoms.created_count == 1  # no new atom
    e = (before - f) * mesh.area
    assert e.sum() > 0.4
    assert atoms.masses[0] == pytest.approx(m0 + e.sum(), rel=1e-15)
    assert mesh.integrate(f) + atoms.total_mass == pytest.approx(mesh.integrate(before) + m0, abs=1e-15)
    moment = m0 * x0 + e @ mesh.centroids
    np.testing.assert_allclose(atoms.positions[0], moment / np.linalg.norm(moment), rtol=0, atol=1e-15)
    assert np.linalg.norm(atoms.positions[0] - x0) > 0.01  # it moved toward the peak


def test_mirror_image_peaks_joining_one_atom_keep_it_on_the_mirror_plane(mesh_factory):
    """Two stalled peaks at mirror images z = ±δ join the atom at e₁ in one step: the atom gains
    both excesses and stays on z = 0 to round-off, whatever order the peaks come in (the moments
    are summed before one normalisation; normalising after each peak moved it off the plane)."""
    mesh = mesh_factory(16)
    h = math.sqrt(mesh.area)
    u = 3.2 * h  # angle of each peak from e₁: beyond a patch, within the join distance 4 h
    f = sum(gaussian_peak(mesh, [math.cos(u), 0.0, z * math.sin(u)], 1.15 * h, background=0.05, mass=0.2)
            for z in (1.0, -1.0))
    div, dt = -2.0 * np.ones(mesh.npix), 0.01
    atoms = Atoms(mesh)
    positions = np.full((atoms.capacity, 3), np.nan)
    positions[0] = [1.0, 0.0, 0.0]
    masses = np.zeros(atoms.capacity)
    masses[0] = 0.6
    created = np.full(atoms.capacity, np.nan)
    created[0] = 0.0
    atoms.restore(positions, masses, created, created_count=1)
    before = f.copy()
    assert atoms.create(1.0, f, div, before.copy(), dt) == 2
    assert atoms.count == 1 and atoms.created_count == 1  # both joined the atom
    e = (before - f) * mesh.area
    assert atoms.masses[0] == pytest.approx(0.6 + e.sum(), rel=1e-14) and e.sum() > 0.2
    moment = 0.6 * np.array([1.0, 0.0, 0.0]) + e @ mesh.centroids
    np.testing.assert_allclose(atoms.positions[0], moment / np.linalg.norm(moment), rtol=0, atol=1e-15)
    assert abs(atoms.positions[0, 2]) <= 1e-15


@pytest.mark.parametrize("atom_mass, distance_cells, join", [
    (0.1, 3.5, 4.0),  # the atom is lighter than the peak: the peak is a cluster of its own
    (0.8, 5.0, 4.0),  # heavier but beyond the join distance
    (0.8, 3.5, 0.0),  # the join is off
])
def test_a_stalled_peak_not_joined_becomes_a_new_atom(mesh_factory, atom_mass, distance_cells, join):
    mesh = mesh_factory(16)
    atoms, f, div, f_old, dt = _peak_beside_an_atom(mesh, atom_mass, distance_cells)
    atoms.join_distance = join * math.sqrt(mesh.area)
    x0 = atoms.positions[0].copy()
    before = mesh.integrate(f) + atoms.total_mass
    assert atoms.create(1.0, f, div, f_old, dt) == 1
    assert atoms.count == 2 and atoms.created_count == 2
    np.testing.assert_array_equal(atoms.positions[0], x0)
    assert mesh.integrate(f) + atoms.total_mass == pytest.approx(before, abs=1e-15)


def test_stalled_peaks_is_the_liouville_ratio():
    f_old = np.array([1.0, 1.0, 1.0, 0.0, 2.0])
    f = np.array([1.0, math.exp(0.02), math.exp(0.0099), 1.0, 1.0])
    div = np.array([-2.0, -2.0, -2.0, -2.0, -1.0])
    # rates over dt = 0.01: 0, 2, 0.99, from zero (not stalled), −69; half of −div: 1, 1, 1, 1, 0.5
    np.testing.assert_array_equal(stalled_peaks(f, f_old, div, 0.01, np.arange(5)),
                                  [True, False, True, False, True])


def test_a_peak_beside_an_atom_feeds_it(mesh_factory):
    """A candidate whose patch holds an atom's cell joins that atom (no new atom)."""
    mesh = mesh_factory(16)
    h = math.sqrt(mesh.area)
    atoms = Atoms(mesh)
    c = 1234
    atoms.restore(np.vstack([mesh.centroids[mesh.neighbours[c, 3]], np.full((63, 3), np.nan)]),
                  np.r_[0.2, np.zeros(63)], np.r_[0.0, np.full(63, np.nan)])
    f = gaussian_peak(mesh, mesh.centroids[c], 0.4 * h)
    total = mesh.integrate(f) + atoms.total_mass
    x_before, m_before = atoms.points()
    assert atoms.create(1.0, f, -np.ones(mesh.npix)) == 1  # one peak moved ...
    assert atoms.count == 1 and atoms.created_count == 0  # ... to the existing atom
    gained = atoms.total_mass - 0.2
    assert gained > 0.4
    assert mesh.integrate(f) + atoms.total_mass == pytest.approx(total, abs=1e-15)


def test_feeding_conserves_mass_and_keeps_the_atom_where_it_is(mesh_factory):
    """The growth of the atom's nearest cell joins it at its position; other cells stay."""
    mesh = mesh_factory(8)
    atoms = Atoms(mesh, feeding=True)
    x0 = np.array([0.6, 0.13, 0.8])
    x0 /= np.linalg.norm(x0)
    atoms.restore(np.vstack([x0, np.full((63, 3), np.nan)]), np.r_[0.3, np.zeros(63)],
                  np.r_[0.0, np.full(63, np.nan)])
    c = int(atoms.feeding_cells(x0)[0])
    assert atoms.feeding_cells(x0).size == 1
    f_old = np.full(mesh.npix, 0.05)
    f_new = f_old.copy()
    f_new[c] += 0.7
    other = int(mesh.neighbours[c, 0])
    f_new[other] += 0.2  # not the atom's cell: stays on the mesh
    total = mesh.integrate(f_new) + atoms.total_mass
    div = -np.ones(mesh.npix)
    moved = atoms.feed(f_old, f_new, div)
    assert moved == pytest.approx(0.7 * mesh.area, rel=1e-14)
    assert f_new[c] == f_old[c] and f_new[other] == 0.25
    assert mesh.integrate(f_new) + atoms.total_mass == pytest.approx(total, abs=1e-16)
    np.testing.assert_array_equal(atoms.points()[0][0], x0)
    f_new[c] += 0.1
    assert atoms.feed(f_old, f_new, np.ones(mesh.npix)) == 0.0  # an expanding cell is not fed


def test_feeding_off_leaves_the_mesh_alone(mesh_factory):
    """atom_feeding = false (the default): the same inflow stays on the mesh and the atom keeps
    its mass."""
    mesh = mesh_factory(8)
    atoms = Atoms(mesh)
    x0 = mesh.centroids[100]
    atoms.restore(np.vstack([x0, np.full((63, 3), np.nan)]), np.r_[0.3, np.zeros(63)],
                  np.r_[0.0, np.full(63, np.nan)])
    f_old = np.full(mesh.npix, 0.05)
    f_new = f_old.copy()
    f_new[int(atoms.feeding_cells(x0)[0])] += 0.7
    before = f_new.copy()
    assert atoms.feed(f_old, f_new, -np.ones(mesh.npix)) == 0.0
    np.testing.assert_array_equal(f_new, before)
    assert atoms.total_mass == 0.3


def test_an_atom_at_a_vertex_feeds_from_the_tied_cells(mesh_factory):
    """e₁ is a vertex of four cells (the centre of a base pixel); the two nearest, mirror images
    under y → −y, both feed it, so the feeding keeps the reflection symmetries of the mesh."""
    mesh = mesh_factory(8)
    cells = Atoms(mesh).feeding_cells(np.array([1.0, 0.0, 0.0]))
    assert cells.size == 2
    np.testing.assert_allclose(mesh.centroids[cells].sum(axis=0)[1:], 0.0, atol=1e-14)


def test_merging_conserves_mass_and_centre(mesh_factory):
    mesh = mesh_factory(8)
    h = math.sqrt(mesh.area)
    atoms = Atoms(mesh, capacity=4, merge=0.5)
    a = np.array([1.0, 0.0, 0.0])
    b = np.array([math.cos(0.3 * h), math.sin(0.3 * h), 0.0])  # 0.3 h apart: merge
    c = np.array([0.0, 0.0, 1.0])
    atoms.restore(np.vstack([a, b, c, [np.nan] * 3]), np.array([0.2, 0.1, 0.3, 0.0]),
                  np.array([2.0, 1.0, 0.5, np.nan]))
    assert atoms.merge() == 1
    assert atoms.count == 2 and atoms.total_mass == pytest.approx(0.6, abs=1e-15)
    want = 0.2 * a + 0.1 * b
    np.testing.assert_allclose(atoms.positions[1], want / np.linalg.norm(want), atol=1e-15)  # the older one
    assert atoms.masses[0] == 0 and np.isnan(atoms.positions[0]).all()
    assert atoms.masses[1] == 0.1 + 0.2


def with_atoms(solver, positions, masses):
    """A SolverState at t = 0 whose atoms are at positions with masses."""
    cap = solver.atoms.capacity
    pos = np.full((cap, 3), np.nan)
    mass = np.zeros(cap)
    created = np.full(cap, np.nan)
    n = len(masses)
    pos[:n], mass[:n], created[:n] = positions, masses, 0.0
    return {"atom_position": pos, "atom_mass": mass, "atom_created": created, "created": n,
            "merged": 0, "refused": 0}


def run_with_atoms(solver, f0, atom_state, times):
    solver.atoms.restore(atom_state["atom_position"], atom_state["atom_mass"], atom_state["atom_created"])
    state = SolverState(index=0, density=f0, safety=1.0, steps=0, rejected=0,
                        sup_div=solver.sup_divergence(f0), integral=0.0, max_sup_div=-math.inf,
                        atoms=atom_state)
    out = []
    for k, t, f, rec in solver.snapshots(f0, times, start=state):
        out.append((t, f.copy(), solver.atoms.points()[0].copy(), rec))
    return out


@pytest.mark.parametrize("feeding", [False, True])
@pytest.mark.parametrize("beta", [10.0, math.inf])
def test_lone_atom_at_an_eigenvector_is_stationary(mesh_factory, beta, feeding):
    """An atom at e₁ (an eigenvector of V) on a uniform background: the field is symmetric under
    the reflections that fix e₁ (diagonal matrices), so the atom does not move, with or without
    feeding."""
    mesh = mesh_factory(8)
    model = AttentionModel(PAPER_B, PAPER_V, beta)
    solver = EulerianSolver(mesh, model, atoms={"capacity": 4, "min_mass": 0.5, "feeding": feeding})
    f0 = np.full(mesh.npix, 0.5 / (4 * np.pi))
    e1 = np.array([1.0, 0.0, 0.0])
    state = with_atoms(solver, [e1], [0.5])
    solver.atoms.restore(state["atom_position"], state["atom_mass"], state["atom_created"])
    v = solver.velocity.atom_velocity(0.0, f0, e1[None, :])
    # the uniform part's mean at e₁ is along ±e₁ up to the mesh's asymmetry (HEALPix is symmetric
    # under these reflections only up to the centroids' rounding)
    assert np.abs(v).max() < 1e-12
    out = run_with_atoms(solver, f0, state, [0.0, 0.5])
    np.testing.assert_allclose(out[-1][2][0], e1, atol=1e-12)


def two_atom_velocity(model, x):
    """The closed-form two-atom softmax field at both atoms (masses m, positions x (2, 3))."""
    x, m = x
    v = np.empty_like(x)
    for i in range(2):
        logits = model.beta * (x @ (model.B.T @ x[i])) + np.log(m)
        w = np.exp(logits - logits.max())
        mean = (w / w.sum()) @ x
        u = model.V @ mean
        v[i] = u - (x[i] @ u) * x[i]
    return v


def test_two_atoms_follow_the_two_atom_softmax_ode(mesh_factory):
    """With no mesh mass, the solver's atoms solve the two-atom ODE x_i' = P_x(V m_β(x_i)) with
    m_β the closed-form two-point softmax mean; the error falls at the stepper's order 2."""
    mesh = mesh_factory(8)
    model = AttentionModel(PAPER_B, PAPER_V, 3.0)
    m = np.array([0.6, 0.4])
    x0 = np.array([[0.8, 0.5, 0.2], [-0.6, 0.3, 0.7]])
    x0 /= np.linalg.norm(x0, axis=1, keepdims=True)
    solver = EulerianSolver(mesh, model, atoms={"capacity": 2})
    state = with_atoms(solver, x0, m)
    solver.atoms.restore(state["atom_position"], state["atom_mass"], state["atom_created"])
    np.testing.assert_allclose(solver.velocity.atom_velocity(0.0, np.zeros(mesh.npix), x0),
                               two_atom_velocity(model, (x0, m)), rtol=1e-12, atol=1e-14)

    def rhs(_, y):
        x = y.reshape(2, 3)
        return two_atom_velocity(model, (x, m)).ravel()

    exact = solve_ivp(rhs, (0, 1.0), x0.ravel(), rtol=1e-12, atol=1e-13).y[:, -1].reshape(2, 3)
    exact /= np.linalg.norm(exact, axis=1, keepdims=True)
    errors = []
    for cfl in (0.4, 0.2):
        solver = EulerianSolver(mesh, model, cfl=cfl, atoms={"capacity": 2})
        out = run_with_atoms(solver, np.zeros(mesh.npix), with_atoms(solver, x0, m), [0.0, 1.0])
        errors.append(np.abs(out[-1][2] - exact).max())
        assert out[-1][3]["atom_mass_total"] == m.sum()
    assert errors[0] < 1e-3
    order = math.log2(errors[0] / errors[1])
    assert 1.7 < order < 2.4, (errors, order)


@pytest.mark.parametrize("shape", ["point", "sigma"])
def test_run_with_atoms_conserves_mass_and_creates_them(mesh_factory, shape):
    """Projected-normal law, β = 10, paper matrices, nside 8 to t = 4: atoms form at the clusters
    ±e₁, the total mass stays 1 to round-off, min f never drops below its value without atoms'
    bound (ℓ₀ exp(−∫ sup div v)). The four points of a "sigma" atom collapse with its cluster
    and merge into one atom per cluster by t = 4."""
    from spherepde.models.initial import ProjectedNormal

    mesh = mesh_factory(8)
    model = AttentionModel(PAPER_B, PAPER_V, 10.0)
    law = ProjectedNormal([0.3, 0.2, 0.1], [[1.0, 0.2, 0.0], [0.2, 0.8, 0.0], [0.0, 0.0, 0.6]])
    f0 = law.cell_averages(mesh)
    solver = EulerianSolver(mesh, model, atoms={"capacity": 8 if shape == "point" else 32, "shape": shape})
    records = [rec for _, _, _, rec in solver.snapshots(f0, [0.0, 1.0, 2.0, 3.0, 4.0])]
    assert records[-1]["atom_count"] >= 2 and records[-1]["atom_mass_total"] > 0.5
    for rec in records:
        assert abs(rec["mass"] - 1.0) < 1e-13
        assert rec["min_density"] >= rec["lower_bound_aposteriori"] * (1 - 1e-12)
        assert rec["mesh_mass"] + rec["atom_mass_total"] == pytest.approx(rec["mass"], abs=1e-15)
    x, m = solver.atoms.points()
    # the clusters at ±e₁ (E); without feeding the mesh mass still trailing them can form atoms of
    # about atom_min_mass on the way in (they merge later), so the test weighs by mass
    assert m[np.abs(x[:, 0]) > 0.95].sum() > 0.99 * m.sum()
    assert np.sort(x[m > 0.1, 0]).tolist() == pytest.approx([-1.0, 1.0], abs=0.01)


ATOM_RUN = """
[model]
beta = 10.0
V = [[-1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, -2.0]]
B = [[-1.0, 0.0, 0.0], [0.0, -1.0, 0.0], [0.0, 0.0, 1.0]]

[initial]
kind = "projected_normal"
mean = [0.3, 0.2, 0.1]
cov = [[1.0, 0.2, 0.0], [0.2, 0.8, 0.0], [0.0, 0.0, 0.6]]

[eulerian]
nside = 8
atoms = true
max_atoms = {slots}
velocity_tolerance = {lag}
atom_stalled_width = {stalled}
atom_shape = "{shape}"

[time]
t_end = 4.0
save_every = 0.5
"""


@pytest.mark.parametrize("lag, stalled, shape", [(0.0, 0.0, "point"), (1e-3, 0.0, "point"), (0.0, 1.7, "point"),
                                                 (1e-3, 1.7, "sigma")])
def test_resume_with_atoms_equals_the_uninterrupted_run(tmp_path, lag, stalled, shape):
    """Interrupted after 6 snapshots (t ≤ 2.5, atoms alive), --resume restores the atoms from
    the file and ends equal to the uninterrupted run; the file's atom arrays index over time.
    With the stalled-peak rule the first step after the resume needs the step's f_old and dt;
    the points of "sigma" atoms are atoms of their own in the file."""
    from run_helpers import ROUND_OFF, interrupt_after, run_difference

    from spherepde import open_run
    from spherepde.cli import main

    cfg = tmp_path / "atoms.toml"
    cfg.write_text(ATOM_RUN.format(lag=lag, stalled=stalled, shape=shape, slots=8 if shape == "point" else 32))
    ref, out = tmp_path / "ref.nc", tmp_path / "out.nc"
    assert main(["run", str(cfg), "-o", str(ref)]) == 0
    interrupt_after(cfg, out, 6)
    cut = open_run(out)
    assert cut.sizes["time"] == 6 and int(cut.atom_count[-1]) >= 1
    assert main(["run", str(cfg), "-o", str(out), "--resume"]) == 0
    assert run_difference(out, ref) <= ROUND_OFF
    ds = open_run(ref)
    assert ds.atom_position.dims == ("time", "atom", "xyz") and ds.atom_mass.dims == ("time", "atom")
    alive = ds.atom_mass.isel(time=-1).values > 0
    assert alive.sum() == int(ds.atom_count[-1])
    assert np.all(np.isfinite(ds.atom_created.isel(time=-1).values[alive]))
    np.testing.assert_allclose(ds["mass"].values, 1.0, atol=1e-13)
    np.testing.assert_allclose(ds.mesh_mass + ds.atom_mass_total, ds["mass"], atol=1e-15)


@pytest.mark.parametrize("near_field", [False, True])
def test_background_share_is_the_mesh_part_of_the_softmax_weight(mesh_factory, near_field):
    """Two atoms over a random positive density, β = 30 (nside 4: the kernel is narrower than a
    cell, so the near-field cell integrals are active when asked for): without them the share is
    the plain log-sum-exp ratio Z_mesh / (Z_mesh + Z_atoms) at each atom; with them it moves, and
    it tends to 0 and 1 as the mesh mass is scaled down and up (it weighs masses, not a fixed
    normalisation)."""
    from spherepde.models.schedule import schedule_of
    from spherepde.solvers.velocity import EulerianVelocity

    mesh = mesh_factory(4)
    model = AttentionModel(PAPER_B, PAPER_V, 30.0)
    atoms = Atoms(mesh, capacity=4)
    x = np.array([[0.8, 0.1, -0.59], [-0.7, 0.2, 0.68]])
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    atoms.restore(np.r_[x, np.full((2, 3), np.nan)], np.array([0.6, 0.4, 0.0, 0.0]), np.array([1.0, 1.0, np.nan, np.nan]))
    velocity = EulerianVelocity(mesh, schedule_of(model), atoms, near_field=near_field)
    f = np.exp(np.random.default_rng(5).uniform(-20.0, -2.0, mesh.npix))
    z_atoms = np.exp(30.0 * (x @ PAPER_B) @ x.T + np.log([0.6, 0.4])).sum(axis=1)
    f *= z_atoms[0] / np.exp(30.0 * (x[0] @ PAPER_B) @ mesh.centroids.T + np.log(f * mesh.area)).sum()
    share = velocity.background_share(f)  # about ½ at the first atom
    z_mesh = np.exp(30.0 * (x @ PAPER_B) @ mesh.centroids.T + np.log(f * mesh.area)).sum(axis=1)
    expect = z_mesh / (z_mesh + z_atoms)
    assert 0.3 < expect[0] < 0.7 and 1e-6 < expect[1] < 1 - 1e-6
    if near_field:
        assert velocity.near_field_active
        assert not np.allclose(share, expect, rtol=1e-3)
        assert np.all((share > 0.1 * expect) & (share < 10 * expect))
    else:
        np.testing.assert_allclose(share, expect, rtol=1e-12)
    assert np.all(velocity.background_share(f * 1e-30) < 1e-20)
    assert np.all(velocity.background_share(f * 1e30) > 1 - 1e-12)


def test_a_run_records_the_background_share_at_its_atoms(mesh_factory):
    """In the records and the in-memory run: per atom slot (NaN where empty), in [0, 1], and the
    largest of them as background_share_max."""
    from spherepde.models.initial import ProjectedNormal

    mesh = mesh_factory(8)
    law = ProjectedNormal([0.3, 0.2, 0.1], [[1.0, 0.2, 0.0], [0.2, 0.8, 0.0], [0.0, 0.0, 0.6]])
    solver = EulerianSolver(mesh, AttentionModel(PAPER_B, PAPER_V, 10.0), atoms={"capacity": 8})
    ds = solver.run(law.cell_averages(mesh), 3.0, 1.0)
    share = ds["atom_background_share"].values
    alive = ds["atom_mass"].values > 0
    assert alive[-1].sum() >= 2
    assert np.all(np.isnan(share[~alive]))
    assert np.all((share[alive] > 0) & (share[alive] < 1))
    some = alive.any(axis=1)
    np.testing.assert_array_equal(ds["background_share_max"].values[some], np.nanmax(share[some], axis=1))
    assert np.all(np.isnan(ds["background_share_max"].values[~some])) and not some[0]


def anisotropic_peak(mesh, centre, sd_major, sd_minor, background=0.1, mass=0.5):
    """Cell values of background + a normalised bump with chordal s.d. sd_major along a tangent
    direction and sd_minor across it, at the unit vector `centre`."""
    c = np.asarray(centre, dtype=float) / np.linalg.norm(centre)
    e1 = np.cross(c, [0.0, 0.0, 1.0])
    e1 /= np.linalg.norm(e1)
    e2 = np.cross(c, e1)
    d = mesh.centroids - c
    bump = np.exp(-((d @ e1) ** 2) / (2 * sd_major**2) - (d @ e2) ** 2 / (2 * sd_minor**2) - (d @ c) ** 2 / (2 * sd_minor**2))
    return background + mass * bump / (bump.sum() * mesh.area), e1


def test_sigma_points_carry_the_direction_and_the_tangential_covariance():
    rng = np.random.default_rng(3)
    y = rng.normal(size=(500, 3)) * [0.07, 0.02, 0.01] + [0.2, -0.1, 1.0]
    y /= np.linalg.norm(y, axis=1, keepdims=True)
    w = rng.random(500)
    w /= w.sum()
    mean = w @ y
    c = mean / np.linalg.norm(mean)
    points = np.array(sigma_points(c, (w[:, None] * y).T @ y))
    assert points.shape == (4, 3)
    np.testing.assert_allclose(np.linalg.norm(points, axis=1), 1.0, atol=1e-15)
    np.testing.assert_allclose(np.cross(points.sum(axis=0), c), 0.0, atol=1e-15)  # the mean direction
    P = np.eye(3) - np.outer(c, c)
    tangential = points @ P
    want = P @ ((w[:, None] * y).T @ y) @ P  # the cloud's covariance about c, computed from the samples
    np.testing.assert_allclose(tangential.T @ tangential / 4, want, atol=1e-15)


def test_a_sigma_atom_keeps_the_peaks_mass_direction_and_covariance(mesh_factory):
    mesh = mesh_factory(16)
    h = math.sqrt(mesh.area)
    f, major = anisotropic_peak(mesh, [0.3, 0.9, 0.2], 0.8 * h, 0.3 * h)
    before = f.copy()
    atoms = Atoms(mesh, width=1.3, min_mass=1e-3, shape="sigma")
    assert atoms.create(1.5, f, -np.ones(mesh.npix)) == 1
    assert atoms.count == 4 and atoms.created_count == 1  # one peak, one atom of four points
    x, m = atoms.points()
    taken = (before - f) * mesh.area
    assert abs(mesh.integrate(f) + m.sum() - mesh.integrate(before)) < 1e-15
    np.testing.assert_allclose(m, taken.sum() / 4, rtol=1e-14)
    first = taken @ mesh.centroids
    c = first / np.linalg.norm(first)
    np.testing.assert_allclose(np.cross(m @ x, c), 0.0, atol=1e-15)
    P = np.eye(3) - np.outer(c, c)
    y = mesh.centroids @ P
    want = (taken[:, None] * y).T @ y / taken.sum()
    got = (m[:, None] * (x @ P)).T @ (x @ P) / m.sum()
    np.testing.assert_allclose(got, want, atol=1e-14)
    # the long axis of the cloud is the peak's: its first pair lies along `major`
    assert abs((x[0] - x[1]) @ major) / np.linalg.norm(x[0] - x[1]) > 0.99
    assert np.all(atoms.created[atoms.alive] == 1.5)


def test_a_sigma_atom_without_room_for_its_points_is_one_point(mesh_factory):
    mesh = mesh_factory(16)
    h = math.sqrt(mesh.area)
    f, _ = anisotropic_peak(mesh, [0.3, 0.9, 0.2], 0.8 * h, 0.3 * h)
    g = f.copy()
    sigma = Atoms(mesh, capacity=3, width=1.3, min_mass=1e-3, shape="sigma")
    point = Atoms(mesh, capacity=3, width=1.3, min_mass=1e-3)
    assert sigma.create(1.5, f, -np.ones(mesh.npix)) == point.create(1.5, g, -np.ones(mesh.npix)) == 1
    np.testing.assert_array_equal(sigma.positions, point.positions)
    np.testing.assert_array_equal(f, g)
