"""A run held in memory: an xarray.Dataset laid out by the same schema as a run file
(spherepde.storage.schema), so that `ds.to_netcdf(path)` gives a file that xdggs, cf-python and
CDO read like one that `spherepde run` writes. What only a file has (the snapshot markers and
digests, the run's bookkeeping attributes) is left out."""

from __future__ import annotations

import numpy as np
import xarray as xr

from .schema import CELL_DIM, CELL_INDEX_ATTRS, DENSITY_ATTRS, TIME_ATTRS, attr_value, crs_attrs, xdggs_attrs

__all__ = ["memory_dataset"]


def memory_dataset(times, mesh=None, density=None, series=(), arrays=(), static=(), attrs=None) -> xr.Dataset:
    """The snapshots as a Dataset.

    times (T,); mesh and density (T, npix): the cells, their HEALPix coordinates and grid mapping
    (both None for particles alone); series: name → (values (T,), long_name, units); arrays:
    name → (dims without time, values (T, ...), long_name, units); static: name → (dims, values,
    long_name, units); attrs: global attributes (stored as NetCDF allows, attr_value).
    """
    data, coords = {}, {"time": ("time", np.asarray(times, dtype=float), dict(TIME_ATTRS))}
    if mesh is not None:
        data["density"] = (("time", CELL_DIM), np.asarray(density), dict(DENSITY_ATTRS))
        data["crs"] = ((), np.int32(0), crs_attrs(mesh.level))
        coords[CELL_DIM] = (CELL_DIM, mesh.cell_ids.astype(np.int64), dict(CELL_INDEX_ATTRS))
        coords["cell_ids"] = (CELL_DIM, mesh.cell_ids.astype(np.uint64), xdggs_attrs(mesh.level))
    for name, (values, long_name, units) in dict(series).items():
        data[name] = ("time", np.asarray(values), {"long_name": long_name, "units": units})
    for name, (dims, values, long_name, units) in dict(arrays).items():
        data[name] = (("time", *dims), np.asarray(values), {"long_name": long_name, "units": units})
    for name, (dims, values, long_name, units) in dict(static).items():
        data[name] = (dims, np.asarray(values), {"long_name": long_name, "units": units})
    ds = xr.Dataset(data, coords=coords)
    ds.attrs.update({"Conventions": "CF-1.13", **{k: attr_value(v) for k, v in (attrs or {}).items()}})
    return ds
