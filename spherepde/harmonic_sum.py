"""Harmonic (Funk–Hecke) attention sums; the code lives in spherepde.summation.harmonic."""

from .summation.harmonic import harmonic_degree, harmonic_row, harmonic_softmax, scaled_bessel

__all__ = ["harmonic_degree", "harmonic_softmax", "scaled_bessel", "harmonic_row"]
