"""Combined attention models: several heads, and weights that change with depth.

Heads (MultiHeadModel). H heads (B_h, V_h, β_h) act on the same tokens; the velocity is the SUM
of the heads' fields,

    v(x) = Σ_h P_x(V_h m^h(x)),   m^h(x) the softmax mean of head h (weights e^{β_h⟨x, B_h y⟩}).

The sum is the convention of multi-head attention in transformers: the heads' outputs are
concatenated and multiplied by one output matrix, Concat(head_1, …, head_H) W_O = Σ_h head_h W_O^h
(W_O^h the rows of W_O that act on head h), so the value matrices of the heads (V_h, which holds
W_O^h) enter as a sum; a mean would need W_O scaled by 1/H. Consequences: H identical heads with
V/H each are one head, and the matrix of the zero-temperature field is M = Σ_h M_h (M_h = V_h B_hᵀ).

The objects of the theory (docs/theory.md#the-equation-and-its-conventions) for a combined model (`theory_objects`):
- one head: its own E, F, Π (M = VBᵀ, any B);
- several heads, every one at β = ∞ with B_h B_hᵀ = c_h² I (B_h = c_h × an orthogonal matrix):
  head h's field is P_x(M_h x)/|B_hᵀx| = P_x(M_h x)/c_h, so the combined field is the LOCAL linear
  field P_x(M x), M = Σ_h M_h / c_h, which is the single-head β = ∞ field of B = I, V = M. Its
  trajectories are x ↦ e^{tM}x/|e^{tM}x| (no time change), and E, γ, Π and the W₂ bound of the
  theory are those of that model (σ_max(B) = 1). F, the principal eigenspace of V, belongs to the
  finite-β single-head theory (the F-phase); for several heads it is not defined;
- several heads otherwise (a finite β, or a B_h that is not a multiple of an orthogonal matrix):
  the field is nonlocal or not linear, and E, F and Π are not defined.

Layers in depth and callables are spherepde.models.schedule (the one shape of a model: a
Schedule whose layers are MultiHeadModels).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .attention import AttentionModel

__all__ = ["MultiHeadModel", "TheoryObjects", "CONVENTION", "MAX_HEADS", "theory_objects", "orthogonal_scale"]

CONVENTION = "sum"  # v = Σ_h P_x(V_h m^h): module docstring
MAX_HEADS = 64


def orthogonal_scale(B, rtol: float = 1e-12) -> float | None:
    """c > 0 when B Bᵀ = c² I (to rtol), i.e. |Bᵀx| = c on the whole sphere; else None."""
    B = np.asarray(B, dtype=float)
    G = B @ B.T
    c2 = float(np.trace(G)) / len(G)
    if not c2 > 0 or np.abs(G - c2 * np.eye(len(G))).max() > rtol * c2:
        return None
    return math.sqrt(c2)


@dataclass(frozen=True)
class MultiHeadModel:
    """H ≥ 1 attention heads acting on the same tokens; their fields add up:
    v(x) = Σ_h P_x(V_h m^h(x)), m^h the softmax mean of head h at its own β_h (module docstring).

    heads: a tuple of AttentionModel (1 to MAX_HEADS). The theory's objects (theory_objects):
    E and Π for several heads only when every head is at β = ∞ with B_h B_hᵀ = c_h² I (the field
    is then the local linear field of M = Σ_h V_h B_hᵀ / c_h); F for one head only.
    """

    heads: tuple

    def __post_init__(self):
        heads = tuple(self.heads)
        if not heads:
            raise ValueError("heads: at least one head is needed")
        if len(heads) > MAX_HEADS:
            raise ValueError(f"heads: at most {MAX_HEADS} heads are supported, got {len(heads)}")
        for h, head in enumerate(heads):
            if not isinstance(head, AttentionModel):
                raise TypeError(f"heads[{h}]: expected an AttentionModel, got {type(head).__name__}")
            if head.dim != heads[0].dim:
                raise ValueError(f"heads[{h}]: {head.dim}×{head.dim} matrices, but heads[0] has "
                                 f"{heads[0].dim}×{heads[0].dim} (one dimension d for every head)")
        object.__setattr__(self, "heads", heads)

    @classmethod
    def of(cls, model) -> "MultiHeadModel":
        """A model as a layer of heads: a MultiHeadModel as it is, an AttentionModel as its one head."""
        if isinstance(model, MultiHeadModel):
            return model
        if isinstance(model, AttentionModel):
            return cls((model,))
        raise TypeError(f"expected an AttentionModel or a MultiHeadModel, got {type(model).__name__}")

    @classmethod
    def from_matrices(cls, heads):
        """From (B, V, β) triples."""
        return cls(tuple(AttentionModel(B, V, beta) for B, V, beta in heads))

    convention = CONVENTION

    @property
    def count(self) -> int:
        return len(self.heads)

    @property
    def dim(self) -> int:
        """d of the heads (all equal): the tokens live on S^{d−1}."""
        return self.heads[0].dim

    @property
    def zero_temperature(self) -> bool:
        """Every head at β = ∞."""
        return all(h.zero_temperature for h in self.heads)

    @property
    def M(self) -> np.ndarray:
        """Σ_h M_h, the matrix of the combined field when every head is local with |B_hᵀx| = 1."""
        return sum((h.M for h in self.heads), np.zeros((self.dim, self.dim)))

    @property
    def beta(self):
        """The common β of the heads, or None when they differ."""
        betas = {h.beta for h in self.heads}
        return betas.pop() if len(betas) == 1 else None

    def describe(self) -> str:
        return f"MultiHeadModel({len(self.heads)} heads, {CONVENTION} of their fields): " + "; ".join(
            f"[{h}] {head.describe()}" for h, head in enumerate(self.heads))


class TheoryObjects(NamedTuple):
    """What the theory's diagnostics of a model refer to: `model` is the single-head model whose
    E, Π, γ and σ_max(B) they use (None: E and Π not defined), has_F whether its F (principal
    eigenspace of V) is defined, note says which (module docstring)."""

    model: AttentionModel | None
    has_F: bool
    note: str

    @property
    def has_E(self) -> bool:
        return self.model is not None


def theory_objects(model) -> TheoryObjects:
    """E, F and Π of a layer (a MultiHeadModel, or one AttentionModel) where the theory defines
    them (module docstring)."""
    heads = MultiHeadModel.of(model).heads
    if len(heads) == 1:
        return TheoryObjects(heads[0], True, "one head: E, Π of M = VBᵀ, F of V")
    scales = [orthogonal_scale(h.B) for h in heads]
    if all(h.zero_temperature for h in heads) and all(c is not None for c in scales):
        d = heads[0].dim
        M = sum((h.M / c for h, c in zip(heads, scales)), np.zeros((d, d)))
        return TheoryObjects(AttentionModel(np.eye(d), M, math.inf), False,
                             f"{len(heads)} heads at β = ∞ with B_h = c_h·orthogonal: the local field "
                             "P_x(Mx), M = Σ_h V_h B_hᵀ/c_h; E, Π of M; F not defined for several heads")
    why = ("a head at finite β (the combined field is nonlocal)"
           if not all(h.zero_temperature for h in heads)
           else "a B_h that is not a multiple of an orthogonal matrix (the combined field is not linear)")
    return TheoryObjects(None, False, f"{len(heads)} heads with {why}: E, F and Π not defined")
