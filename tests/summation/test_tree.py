"""Tree-pruned attention sums against the direct sum: the certified tolerance holds."""

import math

import numpy as np
import pytest

from spherepde.models.attention import AttentionModel
from spherepde.models.initial import Mixture, VonMisesFisher
from spherepde.summation import attention_field, choose_method
from spherepde.summation.tree import SourceTree, _cone_bound


def random_points(n, seed):
    x = np.random.default_rng(seed).normal(size=(n, 3))
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def densities(mesh, seed):
    rng = np.random.default_rng(seed)
    smooth = VonMisesFisher([0.2, -0.5, 0.8], 2.0).cell_averages(mesh)
    peaks = Mixture([0.7, 0.3], [VonMisesFisher([1, 0, 0], 60.0), VonMisesFisher([0, 0, -1], 200.0)]).cell_averages(mesh)
    rough = rng.random(mesh.npix) * (rng.random(mesh.npix) < 0.3)  # 70 % empty cells
    tiny = smooth.copy()
    tiny[rng.random(mesh.npix) < 0.5] *= 1e-200
    return {"smooth": smooth, "peaks": peaks, "rough": rough, "tiny": tiny}


@pytest.mark.parametrize("beta", [0.1, 3.0, 30.0, 1000.0, 1e4, 1e6])
@pytest.mark.parametrize("tol", [1e-10, 1e-4])
def test_tree_within_tolerance_of_direct(mesh_factory, beta, tol):
    """|Δm| ≤ 2 tol and |Δ div| ≤ 4 tol β‖V‖‖B‖ (+ rounding) for random non-symmetric B, V."""
    mesh = mesh_factory(16)
    rng = np.random.default_rng(int(beta * 7) % 1000)
    model = AttentionModel(rng.normal(size=(3, 3)), rng.normal(size=(3, 3)), beta)
    targets = np.concatenate([random_points(300, 1), mesh.centroids[::37]])
    scale = beta * np.linalg.norm(model.V, 2) * np.linalg.norm(model.B, 2)
    for name, f in densities(mesh, 3).items():
        masses = f * mesh.area
        d = attention_field(model, mesh.centroids, masses, targets, want_div=True, method="direct")
        stats = {}
        t = attention_field(model, mesh.centroids, masses, targets, want_div=True, method="tree",
                            tol=tol, stats=stats)
        assert stats["method"] == "tree"
        dm = np.abs(t[2] - d[2]).max()
        ddiv = np.abs(t[1] - d[1]).max()
        assert dm <= 2 * tol + 1e-13, (name, dm)
        assert ddiv <= (4 * tol + 1e-12) * scale + 1e-11, (name, ddiv / scale)
        np.testing.assert_allclose(t[0], d[0], atol=(2 * tol + 1e-13) * np.linalg.norm(model.V, 2))


@pytest.mark.parametrize("beta", [300.0, 3000.0])
def test_tree_on_edge_points(mesh_factory, beta):
    """NESTED-ordered edge points: groups of 16 targets share one walk with narrow cones (the
    production case); the tolerance holds for every target, with and without the divergence."""
    mesh = mesh_factory(16)
    model = AttentionModel(np.diag([-1.0, -1.0, 1.0]), np.diag([-1.0, 1.0, -2.0]), beta)
    targets = mesh.edge_points.reshape(-1, 3)
    masses = densities(mesh, 5)["peaks"] * mesh.area
    for want_div in (False, True):
        d = attention_field(model, mesh.centroids, masses, targets, want_div=want_div, method="direct")
        stats = {}
        t = attention_field(model, mesh.centroids, masses, targets, want_div=want_div, method="tree",
                            stats=stats)
        assert stats["method"] == "tree"
        assert np.abs(t[2] - d[2]).max() <= 2e-10 + 1e-13
        if want_div:
            scale = beta * np.linalg.norm(model.V, 2) * np.linalg.norm(model.B, 2)
            assert np.abs(t[1] - d[1]).max() <= (4e-10 + 1e-12) * scale + 1e-11


def test_tree_on_particles_and_cost_model():
    """Sources need not be mesh cells (particles); auto picks the tree only at large β."""
    x = random_points(5000, 4)
    w = np.random.default_rng(5).random(5000)
    model = AttentionModel(np.diag([-1.0, -1.0, 1.0]), np.diag([-1.0, 1.0, -2.0]), 3000.0)
    d = attention_field(model, x, w, x[:500], want_div=True, method="direct")
    t = attention_field(model, x, w, x[:500], want_div=True, method="tree")
    assert np.abs(t[2] - d[2]).max() < 1e-10
    assert choose_method(model, x, 5000) == "tree"
    assert choose_method(AttentionModel(model.B, model.V, 5.0), x, 5000) != "tree"
    assert choose_method(model, x, 100) == "direct"


def test_tree_structure(mesh_factory):
    """Every node's cap contains its sources; node ranges tile the sorted sources; the log-mass
    of a node is log₂ of its members' relative masses (in log space: no underflow)."""
    mesh = mesh_factory(8)
    f = densities(mesh, 2)["tiny"]
    tree = SourceTree(mesh.centroids, f * mesh.area, leaf_size=4)
    soa = tree.soa
    lam = soa[3]
    for level in range(tree.depth + 1):
        lo, hi = tree.level_offset[level], tree.level_offset[level + 1]
        assert tree.node_start[lo] == 0 and tree.node_end[hi - 1] == soa.shape[1]
        np.testing.assert_array_equal(tree.node_start[lo + 1:hi], tree.node_end[lo:hi - 1])
        for k in range(lo, hi):
            s, e = tree.node_start[k], tree.node_end[k]
            if e == s:
                assert tree.node_log_mass[k] == -np.inf
                continue
            cosines = tree.node_centre[:, k] @ soa[:3, s:e]
            assert cosines.min() >= tree.node_cos_r[k]
            top = lam[s:e].max()
            assert tree.node_log_mass[k] == pytest.approx(top + math.log2(np.exp2(lam[s:e] - top).sum()))


@pytest.mark.parametrize("radius", [0.0, 0.05, 0.6, 3.0])
def test_group_bound_holds_for_every_target_in_the_cone(mesh_factory, radius):
    """The group bound λ_node + |a|_min(cos(max(0, θ − r − r_b)) − 1) is ≥ log₂ Σ_node 2^{e_j}
    for every target whose â lies within r_b of ĉ (exact sums in numpy), for every node, also
    when r + r_b > π."""
    mesh = mesh_factory(8)
    f = densities(mesh, 2)["peaks"]
    tree = SourceTree(mesh.centroids, f * mesh.area, leaf_size=4)
    y, lam = tree.soa[:3], tree.soa[3]
    rng = np.random.default_rng(int(radius * 100))
    centre = random_points(1, 9)[0]
    # targets: directions at angles ≤ r_b from the centre, |a| between 40 and 90
    tangent = np.cross(centre, random_points(40, 10))
    tangent /= np.linalg.norm(tangent, axis=1, keepdims=True)
    angle = radius * rng.random(40)
    h = np.cos(angle)[:, None] * centre + np.sin(angle)[:, None] * tangent
    a = rng.uniform(40.0, 90.0, 40)[:, None] * h
    cos_rb = float(min(1.0, (h @ centre).min()))
    sin_rb = math.sqrt(1.0 - cos_rb**2)
    exponents = lam[None, :] + a @ y - np.einsum("ij,ij->i", a, h)[:, None]  # (targets, sources)
    for k in range(len(tree.node_start)):
        s, e = tree.node_start[k], tree.node_end[k]
        if e == s:
            continue
        bound = _cone_bound(float(np.linalg.norm(a, axis=1).min()), *centre, cos_rb, sin_rb, k,
                            tree.node_centre, tree.node_cos_r, tree.node_sin_r, tree.node_log_mass)
        block = exponents[:, s:e]
        top = block.max(axis=1)
        exact = top + np.log2(np.exp2(block - top[:, None]).sum(axis=1))
        assert exact.max() <= bound + 1e-9, (k, exact.max(), bound)


def test_bad_method():
    model = AttentionModel(np.eye(3), np.eye(3), 2.0)
    x = random_points(10, 0)
    with pytest.raises(ValueError, match="method"):
        attention_field(model, x, np.ones(10), x, method="fmm")
    with pytest.raises(ValueError, match="tol"):
        attention_field(model, x, np.ones(10), x, tol=0.0)
