"""Quadrature rules on the unit interval, the triangle and the HEALPix pixel square (weights as
fractions of the domain), shared by the mesh and the near-field cell integrals."""

from __future__ import annotations

import functools

import numpy as np

__all__ = ["gauss_legendre_01", "triangle_rule", "pixel_rule"]


def gauss_legendre_01(n):
    """Gauss–Legendre nodes and weights on [0, 1]."""
    x, w = np.polynomial.legendre.leggauss(n)
    return 0.5 * (x + 1.0), 0.5 * w


def triangle_rule(order):
    """Collapsed (Duffy) Gauss rule on the triangle a, b ≥ 0, a + b ≤ 1; weights sum to 1/2.

    The collapsed vertex is the origin: a = ξ(1 − η), b = ξη, dA = ξ dξ dη. Functions that are
    homogeneous of degree one around the origin (the HEALPix map at a pole) become smooth.
    """
    x, w = gauss_legendre_01(order)
    xi, eta = np.meshgrid(x, x, indexing="ij")
    wxi, weta = np.meshgrid(w, w, indexing="ij")
    a = (xi * (1.0 - eta)).ravel()
    b = (xi * eta).ravel()
    weight = (wxi * weta * xi).ravel()
    return a, b, weight


@functools.lru_cache(maxsize=8)
def pixel_rule(order):
    """Quadrature over the pixel square (a, b) ∈ [0, 1]², split along the W–E diagonal a + b = 1.

    The HEALPix map has a derivative jump on that diagonal for the pixels centred on the rings
    z = ±2/3, so each triangle is integrated on its own; the S and N corners are the collapsed
    vertices, which makes the polar-corner pixels (a cone point of the map) exact to high order.
    Weights sum to 1 (fraction of the pixel).
    """
    a, b, w = triangle_rule(order)
    a = np.concatenate([a, 1.0 - a])
    b = np.concatenate([b, 1.0 - b])
    return a, b, np.concatenate([w, w])
