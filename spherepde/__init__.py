"""spherepde: mean-field self-attention dynamics on the sphere S².

The package is layered; each subpackage imports only from those listed before it
(tests/test_layering.py checks this):

    geometry       the HEALPix mesh, the face projection, quadrature rules
    models         attention models (heads, layers), weights, noise, initial laws, model checks
    summation      the attention sums: velocity, divergence and softmax mean of a measure
    transport      finite-volume fluxes and time stepping for any velocity (knows no attention)
    storage        the run file: its schema, writing, reading, locking
    solvers        the Eulerian solver (density + atoms) and the particle solver, run guards
    analysis       diagnostics of a measure, exact solutions, the paper's metrics
    visualization  maps, sphere views, diagnostics plots, movies
    runner         TOML configs, one run, parameter sweeps
    validation     the validation suites (reports under validation/reports/ in the repository)
    cli            the `spherepde` command
"""

from .geometry.mesh import HealpixMesh
from .models import initial
from .models.attention import AttentionModel
from .models.heads import MultiHeadModel
from .solvers.eulerian import EulerianSolver
from .solvers.particles import ParticleSolver
from .storage.runfile import open_run
from .version import __version__

__all__ = ["HealpixMesh", "AttentionModel", "MultiHeadModel", "EulerianSolver", "ParticleSolver", "initial",
           "open_run", "__version__"]
