"""HEALPix geometry (NESTED ordering): the finite-volume mesh, the projection of the base faces,
quadrature rules. Knows nothing else of spherepde."""

from .faces import face_to_sphere
from .mesh import HealpixMesh

__all__ = ["HealpixMesh", "face_to_sphere"]
