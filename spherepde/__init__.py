"""spherepde: mean-field self-attention dynamics on the sphere S²."""

from importlib.metadata import PackageNotFoundError, version

from .mesh import HealpixMesh

try:
    __version__ = version("spherepde")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+unknown"

__all__ = ["HealpixMesh", "__version__"]
