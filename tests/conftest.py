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
