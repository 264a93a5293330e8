"""What moves the tokens: attention heads (B, V, β), several heads, the schedule of layers in
depth (the one shape of a model the solvers take), random weights, noise schedules, initial
laws, and the checks that a model can be evaluated."""

from . import initial
from .attention import AttentionModel
from .heads import MultiHeadModel
from .noise import NoiseSchedule
from .schedule import CallableSchedule, Schedule, schedule_of

__all__ = ["AttentionModel", "MultiHeadModel", "Schedule", "CallableSchedule", "schedule_of", "NoiseSchedule",
           "initial"]
