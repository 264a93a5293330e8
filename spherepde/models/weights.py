"""Random weight matrices B and V for ensembles of models.

A config may name a law instead of giving a matrix (`[model] B = "goe"`, `V = "-B"`); with
`weight_seed` (and `weight_scale`) the draw is reproducible, and a sweep over `weight_seed` is an
ensemble of models. The laws, for n × n matrices (n = d, the dimension of the model: 3 on S²,
`[model] dimension` for tokens on S^{d−1}), entries scaled so that the spectrum stays O(1) as n
grows:

    "gaussian"    Ginibre: i.i.d. N(0, 1/n) entries
    "goe"         Gaussian orthogonal ensemble: (G + Gᵀ)/√2, G Ginibre (off-diagonal variance 1/n,
                  diagonal 2/n)
    "wigner"      symmetric, entries on and above the diagonal i.i.d. ±1/√n (Rademacher)
    "orthogonal"  Haar measure on O(n): Q of the QR factorisation of a Ginibre matrix, columns
                  signed by the signs of diag(R) (Mezzadri 2007, Notices AMS 54, 592)
    "identity"    I

each times `weight_scale`; or the other matrix, "B", "-B", "V", "-V". B and V draw from two
independent streams of numpy.random.SeedSequence(weight_seed), so B's draw does not depend on
what V is. The heads and layers of a combined model (spherepde.models.heads) draw from streams of their
own (`key`: SeedSequence(weight_seed, spawn_key=key)), so the heads of a model are independent.
"""

from __future__ import annotations

import numpy as np

__all__ = ["LAWS", "REFERENCES", "random_matrix", "resolve_weights"]

LAWS = ("gaussian", "goe", "wigner", "orthogonal", "identity")
REFERENCES = ("B", "-B", "V", "-V")


def random_matrix(law: str, rng: np.random.Generator, n: int = 3) -> np.ndarray:
    """One n × n draw of the law (module docstring), unscaled."""
    if law == "gaussian":
        return rng.normal(0.0, 1.0 / np.sqrt(n), size=(n, n))
    if law == "goe":
        g = rng.normal(0.0, 1.0 / np.sqrt(n), size=(n, n))
        return (g + g.T) / np.sqrt(2.0)
    if law == "wigner":
        upper = np.triu(rng.choice([-1.0, 1.0], size=(n, n)) / np.sqrt(n))
        return upper + np.triu(upper, 1).T
    if law == "orthogonal":
        q, r = np.linalg.qr(rng.normal(size=(n, n)))
        return q * np.sign(np.diag(r))
    if law == "identity":
        return np.eye(n)
    raise ValueError(f"unknown law {law!r} (one of {', '.join(LAWS)})")


def resolve_weights(B, V, seed: int = 0, scale: float = 1.0, key=(), dim: int = 3):
    """(B, V) as matrices: each given as a matrix, a law of LAWS (drawn with its own stream of
    SeedSequence(seed, spawn_key=key), times scale, dim × dim) or a reference to the other ("B", "-B",
    "V", "-V"). key: () for the single-head model, a tuple of integers per head or layer (spherepde.runner.config).
    Raises ValueError naming "B" or "V" for a reference to itself or a pair of references."""
    streams = dict(zip("BV", np.random.SeedSequence(seed, spawn_key=tuple(key)).spawn(2)))
    given = {"B": B, "V": V}
    out = {}
    for name, value in given.items():
        if isinstance(value, str) and value in LAWS:
            out[name] = scale * random_matrix(value, np.random.default_rng(streams[name]), int(dim))
        elif not isinstance(value, str):
            out[name] = np.array(value, dtype=float)
    for name, value in given.items():
        if isinstance(value, str) and value in REFERENCES:
            other = value.lstrip("-")
            if other == name:
                raise ValueError(f'{name}: "{value}" refers to itself')
            if other not in out:
                raise ValueError(f'{name}: "{value}" refers to {other}, which refers back')
            out[name] = (-1.0 if value.startswith("-") else 1.0) * out[other]
        elif isinstance(value, str) and name not in out:
            raise ValueError(f"{name}: {value!r} is neither a d×d matrix nor one of "
                             f"{', '.join(map(repr, LAWS + REFERENCES))}")
    return out["B"], out["V"]
