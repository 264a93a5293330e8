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

from .version import __version__

# The public names are imported on first use (PEP 562), so that `spherepde --help` and the
# light modules do not pay for numba, healpy and xarray: name → module that defines it.
_PUBLIC = {"HealpixMesh": "geometry.mesh", "AttentionModel": "models.attention", "MultiHeadModel": "models.heads",
           "EulerianSolver": "solvers.eulerian", "ParticleSolver": "solvers.particles", "open_run": "storage.runfile",
           "initial": "models"}

__all__ = ["HealpixMesh", "AttentionModel", "MultiHeadModel", "EulerianSolver", "ParticleSolver", "initial",
           "open_run", "__version__"]


def __getattr__(name):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'spherepde' has no attribute {name!r}")
    import importlib

    module = importlib.import_module(f".{_PUBLIC[name]}", __name__)
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
