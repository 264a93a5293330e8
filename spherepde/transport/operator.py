"""The semi-discrete finite-volume operator: df/dt = −div_S(f v) from edge fluxes."""

from __future__ import annotations

import numpy as np

from . import kernels

__all__ = ["FluxDivergence", "SCHEMES"]

# Largest outflow Courant number dt·Σ_out un⁺/A for which one forward-Euler step keeps f ≥ 0:
# upwind takes at most f_c out of a cell; MUSCL edge values are limited to [0, 2 f_c], in f
# ("muscl") or in log f ("log_muscl": exact for exponential profiles, so accurate relative to f
# in the tails, kernels.log_limited_gradients).
SCHEMES = {"upwind": 1.0, "muscl": 0.5, "log_muscl": 0.5}


class FluxDivergence:
    """Right-hand side L(f) = −div_S(f v) of the continuity equation on a HealpixMesh.

    Called with the edge fluxes un (nedges, nq) of the velocity (see kernels.edge_normal_flux).
    Work arrays are allocated once. ``compression_tol`` decides which cells count as compressive
    for the limiter: net inflow larger than tol × total flow through the cell (a round-off sized
    divergence of a solenoidal flow must not switch the bound off).
    """

    def __init__(self, mesh, scheme: str = "muscl", compression_tol: float = 1e-6, edge_ratio: float = 2.0):
        if scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {sorted(SCHEMES)}, got {scheme!r}")
        self.mesh = mesh
        self.scheme = scheme
        self.positivity_courant = SCHEMES[scheme]
        if scheme == "log_muscl":  # edge values up to edge_ratio × the cell average
            self.log_ratio = float(np.log(edge_ratio))
            self.positivity_courant = 1.0 / edge_ratio
        self.compression_tol = compression_tol
        self.inv_area = 1.0 / mesh.area
        self.outflow = np.empty(mesh.npix)
        self.divergence = np.empty(mesh.npix)
        self.bounded = np.ones(mesh.npix, dtype=np.bool_)
        self.grad = np.zeros((mesh.npix, 3))
        self.flux = np.empty(mesh.nedges)
        if scheme == "log_muscl":  # the cell quadrature of the reconstruction's cell averages
            self.qpoints, self.qweights = mesh.cell_quadrature(2)
            self.log_shift = np.empty(mesh.npix)

    def flow_rates(self, un):
        """Outflow rate per cell (1/time; dt × it is the Courant number) and discrete divergence."""
        m = self.mesh
        kernels.cell_flow_rates(un, m.cell_edges, m.cell_edge_sign, self.inv_area,
                                self.outflow, self.divergence)
        return self.outflow, self.divergence

    def max_outflow_rate(self, un) -> float:
        return float(self.flow_rates(un)[0].max())

    def __call__(self, f, un, out, rates_ready: bool = False):
        """Write L(f) into out. ``rates_ready``: flow_rates(un) was just called with this un."""
        m = self.mesh
        if self.scheme == "upwind":
            kernels.upwind_edge_fluxes(f, un, m.edge_cells, self.flux)
        else:
            if not rates_ready:
                self.flow_rates(un)
            total = 2.0 * self.outflow - self.divergence  # inflow + outflow
            np.greater_equal(self.divergence, -self.compression_tol * total, out=self.bounded)
            if self.scheme == "muscl":
                kernels.limited_gradients(f, m.neighbours, m.lsq_coef, m.cell_edges, m.edge_points,
                                          m.centroids, self.bounded, self.grad)
                kernels.muscl_edge_fluxes(f, self.grad, un, m.edge_cells, m.edge_points,
                                          m.centroids, self.flux)
            else:
                kernels.log_limited_gradients(f, m.neighbours, m.lsq_coef, m.cell_edges, m.edge_points,
                                              m.centroids, self.qpoints, self.qweights, self.bounded,
                                              self.log_ratio, self.grad, self.log_shift)
                kernels.log_muscl_edge_fluxes(f, self.grad, self.log_shift, un, m.edge_cells, m.edge_points,
                                              m.centroids, self.flux)
        kernels.flux_divergence(self.flux, m.cell_edges, m.cell_edge_sign, self.inv_area, out)
        return out
