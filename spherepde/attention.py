"""The attention field; the code lives in spherepde.summation (dispatcher: spherepde.summation.field)."""

from .summation.direct import softmax_blocked, softmax_direct_reference, zero_temperature_field
from .summation.field import DEFAULT_TOL, METHODS, AttentionField, attention_field, choose_method, mesh_sources
from .summation.kernels import project_velocity, source_arrays

__all__ = ["attention_field", "choose_method", "METHODS", "DEFAULT_TOL", "softmax_blocked", "softmax_direct_reference",
           "source_arrays", "zero_temperature_field", "AttentionField", "mesh_sources", "project_velocity"]
