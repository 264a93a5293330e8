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

Layers (LayerSchedule). Piecewise-constant weights in depth: layer k (an AttentionModel or a
MultiHeadModel) acts on [s_k, s_{k+1}), s_0 = 0 < s_1 < …. The solvers take the model of a step's
start time (`model_at`) and land a step exactly on every switch time (`switch_times`), so each
step sees one model. A Python callable t ↦ (B, V, β) (or t ↦ a model) is a CallableSchedule: its
model at the start of a step is held over the step (first order in time where the callable varies
continuously; no step lands on its jumps). A single model is a ConstantSchedule.

Every schedule answers model_at(t), key_at(t) (equal keys: the same model, so the solvers keep
their summation tables), switch_times and models (the models known in advance; None for a
callable).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .attention import AttentionModel
from .checks import check_model

__all__ = ["MultiHeadModel", "LayerSchedule", "CallableSchedule", "ConstantSchedule", "TheoryObjects",
           "CONVENTION", "MAX_HEADS", "as_schedule", "heads_of", "theory_objects", "common_beta",
           "orthogonal_scale"]

CONVENTION = "sum"  # v = Σ_h P_x(V_h m^h): module docstring
MAX_HEADS = 64


def heads_of(model) -> tuple:
    """The heads (AttentionModel, …) of an AttentionModel or a MultiHeadModel."""
    if isinstance(model, AttentionModel):
        return (model,)
    if isinstance(model, MultiHeadModel):
        return model.heads
    raise TypeError(f"expected an AttentionModel or a MultiHeadModel, got {type(model).__name__}")


def orthogonal_scale(B, rtol: float = 1e-12) -> float | None:
    """c > 0 when B Bᵀ = c² I (to rtol), i.e. |Bᵀx| = c on the whole sphere; else None."""
    B = np.asarray(B, dtype=float)
    G = B @ B.T
    c2 = float(np.trace(G)) / 3.0
    if not c2 > 0 or np.abs(G - c2 * np.eye(3)).max() > rtol * c2:
        return None
    return math.sqrt(c2)


@dataclass(frozen=True)
class MultiHeadModel:
    """H ≥ 1 heads whose fields add up (module docstring). heads: AttentionModel, …"""

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
        object.__setattr__(self, "heads", heads)

    @classmethod
    def from_matrices(cls, heads):
        """From (B, V, β) triples."""
        return cls(tuple(AttentionModel(B, V, beta) for B, V, beta in heads))

    convention = CONVENTION

    @property
    def count(self) -> int:
        return len(self.heads)

    @property
    def zero_temperature(self) -> bool:
        """Every head at β = ∞."""
        return all(h.zero_temperature for h in self.heads)

    @property
    def M(self) -> np.ndarray:
        """Σ_h M_h, the matrix of the combined field when every head is local with |B_hᵀx| = 1."""
        return sum((h.M for h in self.heads), np.zeros((3, 3)))

    @property
    def beta(self):
        """The common β of the heads, or None when they differ."""
        return common_beta(self)

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
    """E, F and Π of a combined model where the theory defines them (module docstring)."""
    heads = heads_of(model)
    if len(heads) == 1:
        return TheoryObjects(heads[0], True, "one head: E, Π of M = VBᵀ, F of V")
    scales = [orthogonal_scale(h.B) for h in heads]
    if all(h.zero_temperature for h in heads) and all(c is not None for c in scales):
        M = sum((h.M / c for h, c in zip(heads, scales)), np.zeros((3, 3)))
        return TheoryObjects(AttentionModel(np.eye(3), M, math.inf), False,
                             f"{len(heads)} heads at β = ∞ with B_h = c_h·orthogonal: the local field "
                             "P_x(Mx), M = Σ_h V_h B_hᵀ/c_h; E, Π of M; F not defined for several heads")
    why = ("a head at finite β (the combined field is nonlocal)"
           if not all(h.zero_temperature for h in heads)
           else "a B_h that is not a multiple of an orthogonal matrix (the combined field is not linear)")
    return TheoryObjects(None, False, f"{len(heads)} heads with {why}: E, F and Π not defined")


def common_beta(model):
    """The β shared by every head (of every layer, for a schedule), or None."""
    if isinstance(model, (LayerSchedule, ConstantSchedule)):
        betas = {common_beta(m) for m in model.models}
        return betas.pop() if len(betas) == 1 else None
    if isinstance(model, CallableSchedule):
        return None
    betas = {h.beta for h in heads_of(model)}
    return betas.pop() if len(betas) == 1 else None


# ====================================================================== schedules in depth
class ConstantSchedule:
    """One model for all times."""

    switch_times = ()

    def __init__(self, model):
        heads_of(model)  # type check
        self.model = model
        self.models = (model,)
        self.starts = (0.0,)

    def model_at(self, t):
        return self.model

    def key_at(self, t):
        return 0

    def layer_at(self, t) -> int:
        return 0

    def describe(self) -> str:
        return self.model.describe()


class LayerSchedule:
    """Piecewise-constant models in depth: models[k] on [starts[k], starts[k+1]), starts[0] = 0,
    strictly increasing (module docstring). Each model: an AttentionModel or a MultiHeadModel."""

    def __init__(self, starts, models):
        starts = [float(s) for s in starts]
        models = tuple(models)
        if not starts or len(starts) != len(models):
            raise ValueError("layers: give one start time per model, at least one layer")
        if starts[0] != 0.0:
            raise ValueError(f"layers: the first layer must start at 0, got {starts[0]!r}")
        for k in range(1, len(starts)):
            if not (math.isfinite(starts[k]) and starts[k] > starts[k - 1]):
                raise ValueError(f"layers[{k}] start: must be finite and > the previous start "
                                 f"{starts[k - 1]:g}, got {starts[k]!r}")
        for m in models:
            heads_of(m)
        self.starts = tuple(starts)
        self.models = models

    @property
    def switch_times(self):
        return self.starts[1:]

    def layer_at(self, t) -> int:
        """The layer k with starts[k] ≤ t < starts[k+1] (the first layer for t < 0)."""
        return max(bisect.bisect_right(self.starts, t) - 1, 0)

    def model_at(self, t):
        return self.models[self.layer_at(t)]

    def key_at(self, t):
        return self.layer_at(t)

    def describe(self) -> str:
        return f"LayerSchedule({len(self.models)} layers): " + "; ".join(
            f"from t = {s:g}: {m.describe()}" for s, m in zip(self.starts, self.models))


class CallableSchedule:
    """t ↦ (B, V, β), or t ↦ a model, held constant over each step (module docstring). The model
    built for the last (B, V, β) is kept, so a callable that returns the same weights over many
    steps costs one model."""

    switch_times = ()
    models = None
    starts = (0.0,)

    def __init__(self, function):
        if not callable(function):
            raise TypeError("a schedule function must be callable: t ↦ (B, V, beta)")
        self.function = function
        self._last = None  # (t, key, model)

    def _evaluate(self, t):
        if self._last is not None and self._last[0] == t:
            return self._last[1], self._last[2]
        value = self.function(t)
        if isinstance(value, (AttentionModel, MultiHeadModel)):
            model = value
        else:
            try:
                B, V, beta = value
            except (TypeError, ValueError):
                raise ValueError(f"the schedule function returned {value!r} at t = {t:g}: expected "
                                 "(B, V, beta) or a model") from None
            model = None
            if self._last is not None:
                old = self._last[2]
                if (isinstance(old, AttentionModel) and float(beta) == old.beta
                        and np.array_equal(np.asarray(B, dtype=float), old.B)
                        and np.array_equal(np.asarray(V, dtype=float), old.V)):
                    model = old
            if model is None:
                model = AttentionModel(B, V, beta)
        for head in heads_of(model):
            check_model(head.B, head.V, head.beta)
        key = tuple((h.B.tobytes(), h.V.tobytes(), h.beta) for h in heads_of(model))
        self._last = (t, key, model)
        return key, model

    def model_at(self, t):
        return self._evaluate(t)[1]

    def key_at(self, t):
        return self._evaluate(t)[0]

    def layer_at(self, t) -> int:
        return 0

    def describe(self) -> str:
        return f"CallableSchedule({getattr(self.function, '__name__', repr(self.function))})"


def as_schedule(model):
    """Any model argument of the solvers as a schedule: an AttentionModel or MultiHeadModel (one
    model for all times), a LayerSchedule / CallableSchedule / ConstantSchedule, or a callable
    t ↦ (B, V, β)."""
    if isinstance(model, (AttentionModel, MultiHeadModel)):
        return ConstantSchedule(model)
    if isinstance(model, (ConstantSchedule, LayerSchedule, CallableSchedule)):
        return model
    if callable(model):
        return CallableSchedule(model)
    raise TypeError(f"expected a model, a LayerSchedule or a callable t -> (B, V, beta), got "
                    f"{type(model).__name__}")
