"""Objects from a resolved config (spherepde.runner.config.resolve): the model as the one shape
the solvers take (a Schedule), the noise schedule, the initial law. Building is apart from
validating: a resolved config is plain JSON data, and these functions read it."""

from __future__ import annotations

import math

from ..models import initial
from ..models.attention import AttentionModel
from ..models.heads import MultiHeadModel
from ..models.noise import NoiseSchedule
from ..models.schedule import Schedule

__all__ = ["build_model", "build_noise", "build_initial_law"]


def build_model(spec: dict) -> Schedule:
    """The model of a resolved [model] section as the one shape the solvers take: a Schedule
    (spherepde.models.schedule) of one layer (B, V; or [[model.heads]], a list of one head being
    that head), or of the layers of [[model.layers]], every head with the model's normalisation."""
    normalisation = {"normalisation": spec.get("normalisation", "softmax"),
                     "unnormalised_scale": spec.get("unnormalised_scale", "none")}
    if spec.get("heads") is not None:
        return Schedule.constant(_layer(spec["heads"], normalisation))
    if spec.get("layers") is not None:
        layers = spec["layers"]
        return Schedule([layer["start"] for layer in layers], [_layer(layer["heads"], normalisation) for layer in layers])
    return Schedule.constant(AttentionModel(spec["B"], spec["V"], _beta(spec["beta"]), **normalisation))


def _beta(value) -> float:
    return math.inf if value == "inf" else value


def _layer(heads, normalisation):
    """One layer's heads: the AttentionModel of a single head, else a MultiHeadModel."""
    models = [AttentionModel(h["B"], h["V"], _beta(h["beta"]), **normalisation) for h in heads]
    return models[0] if len(models) == 1 else MultiHeadModel(tuple(models))


def build_noise(spec: dict):
    """The NoiseSchedule of a resolved [model] section, or None without noise."""
    return NoiseSchedule.from_config(spec)


def build_initial_law(spec: dict, dim: int = 3):
    """The spherepde.models.initial law described by a resolved [initial] section, on S^{dim−1}
    (the uniform law takes dim; the others have the length of their mu / mean)."""
    kind = spec["kind"]
    if kind == "uniform":
        return initial.Uniform(dim)
    if kind == "vmf":
        return initial.VonMisesFisher(spec["mu"], spec["kappa"])
    if kind == "mixture":
        return initial.Mixture(spec["weights"],
                               [initial.VonMisesFisher(c["mu"], c["kappa"]) for c in spec["components"]])
    return initial.ProjectedNormal(spec["mean"], spec["cov"])
