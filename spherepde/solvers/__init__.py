"""The solvers of the mean-field equation: the Eulerian finite-volume solver whose state is the
density plus atoms (point masses), the particle solver (tokens, or quadrature particles carrying
their density), their run guards and the timeline of save and switch times."""

from .controller import SolverState
from .eulerian import EulerianSolver
from .guards import Guards, RunFailure
from .particles import ParticleSolver

__all__ = ["EulerianSolver", "SolverState", "ParticleSolver", "Guards", "RunFailure"]
