"""What moves the tokens: attention heads (B, V, β), several heads, layers in depth, random
weights, noise schedules, initial laws, and the checks that a model can be evaluated."""

from . import initial
from .attention import AttentionModel
from .heads import CallableSchedule, ConstantSchedule, LayerSchedule, MultiHeadModel
from .noise import NoiseSchedule

__all__ = ["AttentionModel", "MultiHeadModel", "LayerSchedule", "CallableSchedule", "ConstantSchedule",
           "NoiseSchedule", "initial"]
