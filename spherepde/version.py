"""The installed version of spherepde (the package metadata; a source tree without installation
reports 0.0.0+unknown)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("spherepde")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
