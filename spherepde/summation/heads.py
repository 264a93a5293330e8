"""The attention field of a model with several heads: the sum of the heads' fields.

v(x) = Σ_h P_x(V_h m^h(x)) and div_S v = Σ_h div_S v_h (the divergence is linear), each head
summed by spherepde.summation with its own B_h, V_h, β_h, so with its own method choice,
near-field tables and routing (spherepde.models.heads: the sum convention). The heads share the sources
(cells and atoms: every head sees every atom), so H heads cost H single-head sums, no more.
The softmax mean m_β has no combined meaning: it is returned as None for several heads.

One head is the single-head summation itself (AttentionField, attention_field), untouched: a
one-head model gives the numbers of the single-head code bit for bit.
"""

from __future__ import annotations

import numpy as np

from .field import DEFAULT_TOL, AttentionField, attention_field

__all__ = ["HeadsField", "heads_field", "heads_attention_field"]


class HeadsField:
    """The combined field of a MultiHeadModel at fixed targets on a mesh: one AttentionField per
    head (arguments as AttentionField), their velocities and divergences summed in head order into
    buffers owned here."""

    def __init__(self, model, mesh, targets, method="auto", tol=DEFAULT_TOL, near_field=True):
        self.model = model
        self.fields = [AttentionField(h, mesh, targets, method=method, tol=tol, near_field=near_field)
                       for h in model.heads]
        n = self.fields[0].targets.shape[0]
        self._velocity = np.empty((n, 3))
        self._divergence = np.empty(n)

    @property
    def near(self):
        """A head's near-field table, if any head has one (None otherwise)."""
        return next((f.near for f in self.fields if f.near is not None), None)

    @property
    def stats(self):
        """The summation statistics of the first head."""
        return self.fields[0].stats

    def __call__(self, f, want_div=False, points=None, point_masses=None):
        velocity, divergence = self._velocity, self._divergence
        for h, field in enumerate(self.fields):
            v, div, _ = field(f, want_div, points, point_masses)
            if h == 0:
                np.copyto(velocity, v)
                if want_div:
                    np.copyto(divergence, div)
            else:
                velocity += v
                if want_div:
                    divergence += div
        return velocity, (divergence if want_div else None), None

    def forget_route(self):
        for field in self.fields:
            field.forget_route()


def heads_field(model, mesh, targets, **options):
    """The field object of a layer (a MultiHeadModel) at fixed targets: the AttentionField of a
    single head (as in the single-head code), a HeadsField for several."""
    heads = model.heads
    if len(heads) == 1:
        return AttentionField(heads[0], mesh, targets, **options)
    return HeadsField(model, mesh, targets, **options)


def heads_attention_field(model, sources, masses, targets, want_div=False, nears=None, **options):
    """(v, div_S v or None) of the measure Σ masses δ_sources at the targets for a layer (a
    MultiHeadModel); nears: one NearField (or None) per head; options as attention_field (method, tol)."""
    heads = model.heads
    nears = nears if nears is not None else [None] * len(heads)
    velocity = divergence = None
    for head, near in zip(heads, nears):
        v, div, _ = attention_field(head, sources, masses, targets, want_div=want_div, near=near, **options)
        if velocity is None:
            velocity, divergence = v, div
        else:
            velocity = velocity + v
            if want_div:
                divergence = divergence + div
    return velocity, divergence
