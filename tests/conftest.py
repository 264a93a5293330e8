import functools

import pytest

from spherepde import HealpixMesh


@functools.lru_cache(maxsize=None)
def _mesh(nside, nq=2):
    return HealpixMesh(nside, edge_quadrature=nq)


@pytest.fixture(scope="session")
def mesh_factory():
    """Meshes are immutable after construction: share them across tests."""
    return _mesh


@pytest.fixture(scope="session", autouse=True)
def one_numba_thread_per_xdist_worker():
    """Under pytest-xdist (pyproject's -n 2) each worker process has one of the machine's cores:
    a numba parallel region in a worker would wait for time slices of the other worker's core."""
    import os

    import numba

    if os.environ.get("PYTEST_XDIST_WORKER"):
        numba.set_num_threads(1)
    yield
