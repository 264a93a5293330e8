"""spherepde.validation.tails_subcells: the sub-cell sums of g's paths converge with the children per
cell at second order once h/k is within the kernel width σ, and alias beyond it, which is why
subcells_for asks h/k ≤ σ."""

import healpy as hp
import numpy as np

from spherepde.geometry.mesh import HealpixMesh
from spherepde.models.attention import AttentionModel
from spherepde.solvers.tails import kernel_width, subcells_for
from spherepde.validation.tails_subcells import subcell_errors

B = np.diag([-1.0, -1.0, 1.0])
V = np.diag([-1.0, 1.0, -2.0])


def _smooth_law(mesh):
    """A von Mises–Fisher density of concentration 8 on the cells: its tail falls below 1e-3 of the top."""
    y = np.stack(hp.pix2vec(mesh.nside, np.arange(mesh.npix), nest=True), axis=1)
    mu = np.array([0.3, 0.5, 0.8]) / np.linalg.norm([0.3, 0.5, 0.8])
    f = np.exp(8.0 * (y @ mu))
    return f / (f.sum() * mesh.area)


def test_the_sub_cell_sums_converge_at_second_order_within_the_kernel_width():
    mesh = HealpixMesh(8)
    model = AttentionModel(B, V, 900.0)  # σ = 0.0333: h/4 = 0.96σ
    k = subcells_for(mesh, model)
    assert k == 4 and np.sqrt(mesh.area) / k <= kernel_width(model)
    (coarse, fine), cells = subcell_errors(model, mesh, _smooth_law(mesh), np.empty((0, 3)), np.empty(0), (4, 8, 16))
    assert cells > 100
    # against k = 16: halving h/k divides the errors by about 4 (k = 8 is itself 1/4 off the reference)
    assert coarse["div_p90"] / fine["div_p90"] > 3.0 and coarse["v_p90"] / fine["v_p90"] > 3.0
    assert coarse["v_max"] < 1e-3 and coarse["div_max"] < 1e-2


def test_the_sub_cell_sums_alias_when_the_children_are_twice_the_kernel_width():
    mesh = HealpixMesh(8)
    model = AttentionModel(B, V, 4000.0)  # σ = 0.0158: h/4 = 2σ
    (coarse, fine), _ = subcell_errors(model, mesh, _smooth_law(mesh), np.empty((0, 3)), np.empty(0), (4, 8, 16))
    assert coarse["div_p90"] > 100 * fine["div_p90"] and coarse["div_p90"] > 0.1
    k = subcells_for(mesh, model)
    assert k > 4 and np.sqrt(mesh.area) / k <= kernel_width(model)
