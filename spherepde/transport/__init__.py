"""Finite-volume transport on a HEALPix mesh: ∂_t f + div_S(f v) = 0 for any given velocity.

Layers: kernels (numba, per edge / per cell), operator (the right-hand side −div_S(f v) for a
scheme), stepping (SSP Runge–Kutta with an adaptive Courant step). ``advect`` ties them together
for a velocity given as a function of time and position; semi_lagrangian carries log f along
characteristics (accurate relative to f in the tails). This package knows nothing about
attention: the mean-field solver supplies its own edge fluxes to the same stepper.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import kernels
from .operator import SCHEMES, FluxDivergence
from .stepping import SSP_RK, SSPStepper

__all__ = [
    "advect",
    "AdvectionResult",
    "FluxDivergence",
    "SSPStepper",
    "SCHEMES",
    "SSP_RK",
    "velocity_edge_flux",
    "stream_function_edge_flux",
]


def velocity_edge_flux(mesh, velocity):
    """Edge-flux provider (t, f) → un for an ambient velocity field ``velocity(t, points)``.

    points (n, 3) unit vectors → (n, 3) ambient vectors; only the tangent part matters (the
    normals are tangent), which is the projection P_x v the equation uses.
    """
    points = mesh.edge_points.reshape(-1, 3)
    shape = mesh.edge_points.shape
    un = np.empty(mesh.edge_weights.shape)

    def edge_flux(t, f):
        v = np.ascontiguousarray(np.asarray(velocity(t, points), dtype=float).reshape(shape))
        kernels.edge_normal_flux(v, mesh.edge_normals, mesh.edge_weights, un)
        return un

    return edge_flux


def stream_function_edge_flux(mesh, stream_function):
    """Edge-flux provider for a solenoidal flow v = x × ∇_S ψ given by ``ψ(t, points)``.

    The flux through the sub-arc from node k to node k+1 is exactly ψ(node k) − ψ(node k+1), so
    the fluxes around any cell telescope to zero and a constant density stays constant to
    round-off.
    """
    nodes = mesh.edge_nodes.reshape(-1, 3)
    shape = mesh.edge_nodes.shape[:2]

    def edge_flux(t, f):
        psi = np.asarray(stream_function(t, nodes), dtype=float).reshape(shape)
        return np.ascontiguousarray(psi[:, :-1] - psi[:, 1:])

    return edge_flux


@dataclass
class AdvectionResult:
    """Final density and step statistics of ``advect(..., full_output=True)``."""

    density: np.ndarray
    time: float
    steps: int
    rejected_steps: int
    max_courant: float


def advect(mesh, f0, velocity=None, t_end=1.0, scheme: str = "muscl", cfl: float = 0.5, *,
           stream_function=None, rk_order: int = 2, t0: float = 0.0, callback=None,
           full_output: bool = False):
    """Solve ∂_t f + div_S(f v) = 0 from f(t0) = f0 (cell averages, npix) to t_end.

    velocity(t, points) → ambient 3-vectors at points (n, 3), projected to the tangent plane
    inside; or stream_function(t, points) → ψ (n,) for v = x × ∇_S ψ (exact edge fluxes).
    scheme: "upwind" (first order) or "muscl" (limited least-squares reconstruction).
    cfl: outflow Courant number per step; positivity is guaranteed for cfl ≤ 1 (upwind) and
    cfl ≤ 0.5 (muscl). rk_order: SSP Runge–Kutta order, 2 or 3.
    Returns f(t_end), or an AdvectionResult with full_output=True.
    """
    if (velocity is None) == (stream_function is None):
        raise ValueError("give exactly one of velocity or stream_function")
    f = np.array(f0, dtype=float)
    if f.shape != (mesh.npix,):
        raise ValueError(f"f0 must have shape ({mesh.npix},), got {f.shape}")
    if not t_end >= t0:
        raise ValueError(f"t_end must be >= t0, got t_end={t_end!r}, t0={t0!r}")
    edge_flux = (velocity_edge_flux(mesh, velocity) if velocity is not None
                 else stream_function_edge_flux(mesh, stream_function))
    stepper = SSPStepper(FluxDivergence(mesh, scheme), edge_flux, order=rk_order, cfl=cfl)
    f = stepper.advance(f, float(t0), float(t_end), callback=callback)
    if full_output:
        return AdvectionResult(f, float(t_end), stepper.steps, stepper.rejected, stepper.max_courant)
    return f
