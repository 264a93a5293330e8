"""validation.background: the density along backward characteristics equals the exact β = ∞
push-forward density (spherepde.exact), and the softmax share of the cells is the plain ratio."""

import numpy as np

from spherepde import AttentionModel, HealpixMesh
from spherepde.exact import zero_temperature_density
from spherepde.initial import VonMisesFisher
from spherepde.summation.direct import zero_temperature_field
from validation.background import characteristic_density, weight_share

PAPER_V = np.diag([-1.0, 1.0, -2.0])
PAPER_B = np.diag([-1.0, -1.0, 1.0])


def test_characteristic_density_equals_the_exact_push_forward():
    model = AttentionModel(B=PAPER_B, V=PAPER_V, beta="inf")
    law = VonMisesFisher([0.3, -0.2, 0.9], 1.0)

    def field(y, s):
        v, div = np.empty_like(y), np.empty(len(y))
        zero_temperature_field(np.ascontiguousarray(y), model.B, model.M, True, v, div)
        return v, div

    points = HealpixMesh(4).centroids
    t = 0.8
    got = characteristic_density(field, law, points, t, dt=0.02)
    exact = zero_temperature_density(model, law, t)(points)
    np.testing.assert_allclose(got, exact, rtol=1e-6)
    assert got.max() / got.min() > 100  # a density that the flow has made far from uniform


def test_weight_share_is_the_cells_share_of_the_softmax():
    model = AttentionModel(B=PAPER_B, V=PAPER_V, beta=3.0)
    mesh = HealpixMesh(2)
    rng = np.random.default_rng(1)
    f = rng.random(mesh.npix)
    x = rng.normal(size=(3, 3))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    m = np.array([0.2, 0.5, 0.0])
    z = x[1]
    w_cells = np.sum(f * mesh.area * np.exp(model.beta * mesh.centroids @ (model.B.T @ z)))
    w_atoms = np.sum(m * np.exp(model.beta * x @ (model.B.T @ z)))
    assert abs(weight_share(model, mesh, f, x, m) - w_cells / (w_cells + w_atoms)) < 1e-14


def test_saved_particle_field_interpolates_positions_in_time():
    """Between two snapshots the particles sit at the normalised linear interpolation of their
    positions: the field there is the direct sum over those points."""
    from spherepde.summation import attention_field
    from validation.background import SavedParticleField

    model = AttentionModel(B=PAPER_B, V=PAPER_V, beta=5.0)
    rng = np.random.default_rng(2)
    x0, x1 = (rng.normal(size=(30, 3)) for _ in range(2))
    x0 /= np.linalg.norm(x0, axis=1, keepdims=True)
    x1 /= np.linalg.norm(x1, axis=1, keepdims=True)
    w = rng.random(30)
    field = SavedParticleField([0.0, 1.0], np.array([x0, x1]), w, model)
    y = HealpixMesh(2).centroids
    mid = 0.75 * x0 + 0.25 * x1
    mid /= np.linalg.norm(mid, axis=1, keepdims=True)
    v_ref, div_ref, _ = attention_field(model, mid, w, y, want_div=True, method="direct")
    v, div = field(y, 0.25)
    np.testing.assert_allclose(v, v_ref, rtol=0, atol=1e-14)
    np.testing.assert_allclose(div, div_ref, rtol=0, atol=1e-13)
