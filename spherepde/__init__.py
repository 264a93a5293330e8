"""spherepde: mean-field self-attention dynamics on the sphere S²."""

from importlib.metadata import PackageNotFoundError, version

from . import initial
from .eulerian import EulerianSolver
from .io import open_run
from .mesh import HealpixMesh
from .particles import ParticleSolver
from .model import AttentionModel

try:
    __version__ = version("spherepde")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+unknown"

__all__ = ["HealpixMesh", "AttentionModel", "EulerianSolver", "ParticleSolver", "initial", "open_run", "__version__"]
