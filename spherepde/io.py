"""NetCDF output of a run, appended one snapshot at a time (DESIGN.md §5).

Layout (NETCDF4 format, so uint64 cell ids survive):
- dimensions cells (npix) and time (unlimited);
- cell_ids(cells) uint64 with exactly grid_name="healpix", level, indexing_scheme="nested", so
  `xdggs.decode(ds)` works without arguments;
- crs: 0-d variable with the CF-1.13 healpix grid mapping, referenced by grid_mapping="crs";
- time(time), units "1"; density(time, cells); one (time) variable per diagnostic;
- global attributes: Conventions="CF-1.13", config (the resolved config as JSON), spherepde
  version, creation time, and run metadata.

Every snapshot is written and flushed to disk as soon as it exists (`RunWriter.append`), so a
run killed midway leaves a file with every snapshot written so far. The snapshot slots of a run
are allocated when the file is created (NaN, snapshot_complete = 0), so that a kill can only
interrupt an in-place data write, never a change of HDF5 metadata; `open_run` returns the
complete snapshots (readers that open the file directly see NaN in the slots not yet written).
"""

from __future__ import annotations

import datetime as _dt
import json
import math

import numpy as np

__all__ = ["RunWriter", "open_run"]


def _attr_value(value):
    """NetCDF attributes cannot be bool, None or dict."""
    if isinstance(value, bool):
        return int(value)
    if value is None:
        return ""
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value)
    return value


class RunWriter:
    """Create the run file and append snapshots.

    variables: name → (long_name, units) of the per-time diagnostics, declared up front.
    dims: extra dimensions name → size (e.g. particle, xyz); arrays: per-time arrays over them,
    name → (dims without time, long_name, units); static: arrays without time,
    name → (dims, values, long_name, units).
    """

    def __init__(self, path, mesh, config: dict, variables: dict, attrs: dict | None = None,
                 dims: dict | None = None, arrays: dict | None = None, static: dict | None = None,
                 n_snapshots: int | None = None):
        import netCDF4

        from . import __version__

        self.path = str(path)
        self.variables = dict(variables)
        self.arrays = dict(arrays or {})
        self._count = 0
        self._nc = nc = netCDF4.Dataset(self.path, "w", format="NETCDF4")
        try:
            nc.createDimension("cells", mesh.npix)
            nc.createDimension("time", None)
            ids = nc.createVariable("cell_ids", "u8", ("cells",))
            ids.setncatts({"grid_name": "healpix", "level": np.int64(mesh.level), "indexing_scheme": "nested"})
            ids[:] = mesh.cell_ids.astype(np.uint64)
            crs = nc.createVariable("crs", "i4")
            crs.setncatts({"grid_mapping_name": "healpix", "refinement_level": np.int64(mesh.level),
                           "indexing_scheme": "nested"})
            crs.assignValue(0)
            time = nc.createVariable("time", "f8", ("time",), fill_value=False)
            time.setncatts({"units": "1", "axis": "T", "long_name": "time (depth of the network)"})
            dens = nc.createVariable("density", "f8", ("time", "cells"), fill_value=False,
                                     chunksizes=(1, mesh.npix))
            dens.setncatts({"long_name": "density f_t w.r.t. surface measure (cell average)",
                            "units": "sr-1", "grid_mapping": "crs", "coordinates": "cell_ids"})
            for name, (long_name, units) in self.variables.items():
                var = nc.createVariable(name, "f8", ("time",), fill_value=False)
                var.setncatts({"long_name": long_name, "units": units})
            for name, size in (dims or {}).items():
                nc.createDimension(name, size)
            for name, (var_dims, long_name, units) in self.arrays.items():
                sizes = tuple(len(nc.dimensions[d]) for d in var_dims)
                var = nc.createVariable(name, "f8", ("time", *var_dims), fill_value=False,
                                        chunksizes=(1, *sizes))
                var.setncatts({"long_name": long_name, "units": units})
            for name, (var_dims, values, long_name, units) in (static or {}).items():
                var = nc.createVariable(name, "f8", var_dims, fill_value=False)
                var.setncatts({"long_name": long_name, "units": units})
                var[:] = np.asarray(values, dtype=float)
            done = nc.createVariable("snapshot_complete", "i1", ("time",), fill_value=np.int8(0))
            done.setncatts({"long_name": "1 once every variable of the snapshot is on disk",
                            "units": "1"})
            glob = {
                "Conventions": "CF-1.13",
                "title": "spherepde run: mean-field self-attention dynamics on S²",
                "spherepde_version": __version__,
                "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "config": json.dumps(config),
                "complete": 0,
            }
            glob.update({k: _attr_value(v) for k, v in (attrs or {}).items()})
            nc.setncatts(glob)
            if n_snapshots:
                self._preallocate(int(n_snapshots))
            nc.sync()
        except BaseException:
            nc.close()
            raise

    def _preallocate(self, n):
        """Write every snapshot slot up front (NaN, snapshot_complete = 0). HDF5 keeps its
        metadata (chunk index, dimension sizes) in the file; a process killed while a write
        changes them can leave a file whose variables cannot be read (observed under SIGKILL).
        With every chunk allocated here, appending a snapshot only overwrites data in place."""
        nc = self._nc
        for k in range(n):
            nc.variables["density"][k, :] = np.nan
            for name in self.arrays:
                nc.variables[name][k, ...] = np.nan
        for name in list(self.variables) + ["time"]:
            nc.variables[name][:n] = np.full(n, np.nan)
        nc.variables["snapshot_complete"][:n] = np.zeros(n, dtype=np.int8)

    def append(self, time: float, density, values: dict, arrays: dict | None = None) -> int:
        """Write one snapshot (density, scalar values, the declared arrays) and flush it to disk;
        returns its index."""
        nc = self._nc
        k = self._count
        self._count += 1
        nc.variables["density"][k, :] = np.asarray(density, dtype=float)
        for name in self.arrays:
            nc.variables[name][k, ...] = np.asarray((arrays or {})[name], dtype=float)
        for name in self.variables:
            value = values.get(name, math.nan)
            nc.variables[name][k] = math.nan if value is None else float(value)
        nc.variables["time"][k] = float(time)
        nc.sync()
        # written last, in its own flush: a snapshot interrupted mid-write stays marked 0
        nc.variables["snapshot_complete"][k] = 1
        nc.sync()
        return k

    def set_variable(self, name, values):
        """Overwrite a whole (time) variable (for quantities only known at the end of the run)."""
        self._nc.variables[name][:] = np.asarray(values, dtype=float)

    def set_attrs(self, attrs: dict):
        self._nc.setncatts({k: _attr_value(v) for k, v in attrs.items()})

    def close(self, complete: bool = True):
        if self._nc.isopen():
            if complete:
                self._nc.setncattr("complete", 1)
            self._nc.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(complete=exc_type is None)


def open_run(path):
    """Open a run file as an xarray.Dataset, loaded into memory (the file is not kept open).

    The resolved config is the JSON string ds.attrs["config"]; ds.attrs["complete"] is 1 when the
    run finished, 0 when it was interrupted. A snapshot cut short by a kill (snapshot_complete
    not 1) is dropped, so every snapshot returned was completely written.
    """
    import xarray as xr

    with xr.open_dataset(path, engine="netcdf4") as ds:
        ds = ds.load()
    if "snapshot_complete" in ds:
        ds = ds.isel(time=np.nonzero(ds["snapshot_complete"].values == 1)[0])  # drops unwritten slots
    return ds
