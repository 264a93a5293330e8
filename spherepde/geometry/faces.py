"""The HEALPix base faces: the projection of face coordinates (u, v) ∈ [0, 1]² onto S².

The HEALPix projection is equal-area: on every base face dA = (4π/12) du dv. Pixel boundaries are
the lines u = const and v = const, which are not great-circle arcs (docs/theory.md#healpix-facts-for-finite-volumes).
"""

from __future__ import annotations

import numpy as np

__all__ = ["FACE_RING", "FACE_LONGITUDE", "face_to_sphere"]

# Base-face ring and longitude indices of the HEALPix construction (Górski et al. 2005).
FACE_RING = np.array([2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4])
FACE_LONGITUDE = np.array([1, 3, 5, 7, 0, 2, 4, 6, 1, 3, 5, 7])

def face_to_sphere(face, u, v, derivatives=False):
    """Unit vectors X(u, v) of base-face coordinates (u, v) ∈ [0, 1]², optionally ∂X/∂u, ∂X/∂v.

    HEALPix projection: jr = jrll(face) − u − v; polar caps (jr < 1 or jr > 3) use
    z = ±(1 − nr²/3), nr the distance to the pole in ring units, equatorial zone z = (2 − jr)·2/3;
    φ = (π/4)(jpll + (u − v)/nr). The map is C⁰ across jr = 1 and jr = 3 (pixel diagonals), so
    integrate on either side of those lines separately.
    """
    face = np.asarray(face)
    u = np.asarray(u, dtype=float)
    v = np.asarray(v, dtype=float)
    jr = FACE_RING[face] - u - v
    north = jr < 1.0
    south = jr > 3.0
    nr = np.where(north, jr, np.where(south, 4.0 - jr, 1.0))
    polar = north | south
    tmp = nr * nr / 3.0  # = 1 − |z| in the caps, computed without cancellation
    z = np.where(north, 1.0 - tmp, np.where(south, tmp - 1.0, (2.0 - jr) * (2.0 / 3.0)))
    sin_theta = np.where(polar, np.sqrt(tmp * (2.0 - tmp)), np.sqrt((1.0 - z) * (1.0 + z)))
    with np.errstate(divide="ignore", invalid="ignore"):
        phi = np.where(nr > 1e-15, (np.pi / 4.0) * (FACE_LONGITUDE[face] + (u - v) / nr), 0.0)
    cos_phi, sin_phi = np.cos(phi), np.sin(phi)
    X = np.stack([sin_theta * cos_phi, sin_theta * sin_phi, z], axis=-1)
    if not derivatives:
        return X
    # dz/du = dz/dv = 2 nr / 3 in all three zones; dnr/du = dnr/dv = −1 (north), +1 (south), 0.
    dnr = np.where(north, -1.0, np.where(south, 1.0, 0.0))
    with np.errstate(divide="ignore", invalid="ignore"):
        dz = 2.0 * nr / 3.0
        dphi_du = (np.pi / 4.0) * (1.0 / nr - (u - v) * dnr / (nr * nr))
        dphi_dv = (np.pi / 4.0) * (-1.0 / nr - (u - v) * dnr / (nr * nr))
        z_over_s = z / sin_theta
    dX_dz = np.stack([-z_over_s * cos_phi, -z_over_s * sin_phi, np.ones_like(z)], axis=-1)
    dX_dphi = np.stack([-sin_theta * sin_phi, sin_theta * cos_phi, np.zeros_like(z)], axis=-1)
    Xu = dX_dz * dz[..., None] + dX_dphi * dphi_du[..., None]
    Xv = dX_dz * dz[..., None] + dX_dphi * dphi_dv[..., None]
    return X, Xu, Xv
