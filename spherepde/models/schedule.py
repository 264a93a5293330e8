"""The one shape of a model in spherepde: a schedule of layers in depth, each layer a
MultiHeadModel (one head being the simplest layer, one layer the simplest schedule).

Schedule. Piecewise-constant weights in depth: layer k acts on [s_k, s_{k+1}), s_0 = 0 < s_1 < ….
The solvers take the layer of a step's start time (`model_at`) and land a step exactly on every
switch time (`switch_times`), so each step sees one layer. `Schedule.constant(model)` is one
layer for all times. A run config builds a Schedule (spherepde.runner.build.build_model); the
solvers, the fields and the run use it as it is.

CallableSchedule. A Python callable t ↦ (B, V, β) (or t ↦ a model): its layer at the start of a
step is held over the step (first order in time where the callable varies continuously; no step
lands on its jumps). Its layers are not known in advance (`layers` is None).

Both answer model_at(t) (a MultiHeadModel), key_at(t) (equal keys: the same layer, so the
solvers keep their summation tables), layer_at(t), switch_times, layers, heads, beta,
single_head and describe(). `schedule_of` turns any model argument of the public API (an
AttentionModel, a MultiHeadModel, a schedule, a callable) into one of them, once.
"""

from __future__ import annotations

import bisect
import math

import numpy as np

from .attention import AttentionModel
from .checks import check_model
from .heads import MultiHeadModel

__all__ = ["Schedule", "CallableSchedule", "schedule_of"]


class Schedule:
    """Layers (each an AttentionModel or a MultiHeadModel, kept as MultiHeadModel) starting at
    `starts` (starts[0] = 0, strictly increasing, finite). layered: whether it was given as
    layers (only what describe() says depends on it)."""

    def __init__(self, starts, layers, layered: bool = True):
        starts = [float(s) for s in starts]
        given = tuple(layers)
        if not starts or len(starts) != len(given):
            raise ValueError("layers: give one start time per model, at least one layer")
        if starts[0] != 0.0:
            raise ValueError(f"layers: the first layer must start at 0, got {starts[0]!r}")
        for k in range(1, len(starts)):
            if not (math.isfinite(starts[k]) and starts[k] > starts[k - 1]):
                raise ValueError(f"layers[{k}] start: must be finite and > the previous start "
                                 f"{starts[k - 1]:g}, got {starts[k]!r}")
        self.starts = tuple(starts)
        self.layers = tuple(MultiHeadModel.of(m) for m in given)
        for k, layer in enumerate(self.layers):
            if layer.dim != self.layers[0].dim:
                raise ValueError(f"layers[{k}]: {layer.dim}×{layer.dim} matrices, but layers[0] has "
                                 f"{self.layers[0].dim}×{self.layers[0].dim} (one dimension d for every layer)")
        self.layered = bool(layered)
        self._descriptions = tuple(m.describe() for m in given)

    @classmethod
    def constant(cls, model) -> "Schedule":
        """One layer (an AttentionModel or a MultiHeadModel) for all times."""
        return cls((0.0,), (model,), layered=False)

    @property
    def switch_times(self):
        return self.starts[1:]

    @property
    def dim(self) -> int:
        """d of every head of every layer: the tokens live on S^{d−1}."""
        return self.layers[0].dim

    @property
    def heads(self) -> tuple:
        """Every head of every layer, in order (repeats included)."""
        return tuple(h for layer in self.layers for h in layer.heads)

    @property
    def beta(self):
        """The β shared by every head of every layer, or None."""
        betas = {h.beta for h in self.heads}
        return betas.pop() if len(betas) == 1 else None

    @property
    def single_head(self) -> AttentionModel | None:
        """The head when the schedule is one layer of one head (the paper's model), else None."""
        return self.layers[0].heads[0] if len(self.layers) == 1 and self.layers[0].count == 1 else None

    def layer_at(self, t) -> int:
        """The layer k with starts[k] ≤ t < starts[k+1] (the first layer for t < 0)."""
        return max(bisect.bisect_right(self.starts, t) - 1, 0)

    def model_at(self, t) -> MultiHeadModel:
        return self.layers[self.layer_at(t)]

    def key_at(self, t):
        return self.layer_at(t)

    def describe(self) -> str:
        if not self.layered:
            return self._descriptions[0]
        return f"LayerSchedule({len(self.layers)} layers): " + "; ".join(
            f"from t = {s:g}: {d}" for s, d in zip(self.starts, self._descriptions))


class CallableSchedule:
    """t ↦ (B, V, β), or t ↦ a model, held constant over each step (module docstring). The layer
    built for the last (B, V, β) is kept, so a callable that returns the same weights over many
    steps costs one model."""

    switch_times = ()
    layers = None
    dim = None  # known once the callable is evaluated
    heads = None
    beta = None
    single_head = None
    starts = (0.0,)

    def __init__(self, function):
        if not callable(function):
            raise TypeError("a schedule function must be callable: t ↦ (B, V, beta)")
        self.function = function
        self._last = None  # (t, key, layer)

    def _evaluate(self, t):
        if self._last is not None and self._last[0] == t:
            return self._last[1], self._last[2]
        value = self.function(t)
        if isinstance(value, (AttentionModel, MultiHeadModel)):
            layer = MultiHeadModel.of(value)
        else:
            try:
                B, V, beta = value
            except (TypeError, ValueError):
                raise ValueError(f"the schedule function returned {value!r} at t = {t:g}: expected "
                                 "(B, V, beta) or a model") from None
            layer = None
            if self._last is not None:
                old = self._last[2]
                head = old.heads[0]
                if (old.count == 1 and float(beta) == head.beta and np.array_equal(np.asarray(B, dtype=float), head.B)
                        and np.array_equal(np.asarray(V, dtype=float), head.V)):
                    layer = old
            if layer is None:
                layer = MultiHeadModel((AttentionModel(B, V, beta),))
        for head in layer.heads:
            check_model(head.B, head.V, head.beta)
        key = tuple((h.B.tobytes(), h.V.tobytes(), h.beta) for h in layer.heads)
        self._last = (t, key, layer)
        return key, layer

    def model_at(self, t) -> MultiHeadModel:
        return self._evaluate(t)[1]

    def key_at(self, t):
        return self._evaluate(t)[0]

    def layer_at(self, t) -> int:
        return 0

    def describe(self) -> str:
        return f"CallableSchedule({getattr(self.function, '__name__', repr(self.function))})"


def schedule_of(model):
    """Any model argument of the public API as a schedule, once: an AttentionModel or a
    MultiHeadModel (one layer for all times), a Schedule or CallableSchedule as it is, a callable
    t ↦ (B, V, β) as a CallableSchedule."""
    if isinstance(model, (AttentionModel, MultiHeadModel)):
        return Schedule.constant(model)
    if isinstance(model, (Schedule, CallableSchedule)):
        return model
    if callable(model):
        return CallableSchedule(model)
    raise TypeError(f"expected a model, a Schedule or a callable t -> (B, V, beta), got {type(model).__name__}")
