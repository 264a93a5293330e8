"""A real run file, the solver's dataset and the sweep's combined file, read by tools that others
wrote (docs/file_format.md), against independent values: healpy's geometry of the nested
pixels, 1/(4π) for the uniform start, the file's own density integrated with the cell area
4π/npix, and healpy's bilinear interpolation.

The default suite reads with cf-xarray, netCDF4 and healpy; the other readers (xdggs in both
conventions, CDO from the skyborn-cdo wheel, uxarray, cf-python, easygems) are marked `readers` (pytest -m readers) and skip,
visibly, where they are not installed."""

import json
import math
import re
import shutil
import subprocess
import warnings

import healpy as hp
import netCDF4
import numpy as np
import pytest
import xarray as xr
from run_helpers import run_config_text

from spherepde.geometry.mesh import HealpixMesh
from spherepde.runner.build import build_model
from spherepde.runner.config import load, resolve
from spherepde.runner.sweep import RunSpec, combine
from spherepde.solvers.eulerian import EulerianSolver
from spherepde.storage import runfile as io
from spherepde.storage.runfile import open_run

NSIDE = 8
NPIX = 12 * NSIDE**2
UNIFORM = 1.0 / (4.0 * math.pi)
# the uniform start of the paper's matrices: exactly 1/(4π) at t = 0, no longer uniform after
CONFIG = f"""
[model]
beta = 10.0
V = [[-1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, -2.0]]
B = [[-1.0, 0.0, 0.0], [0.0, -1.0, 0.0], [0.0, 0.0, 1.0]]

[initial]
kind = "uniform"

[eulerian]
nside = {NSIDE}

[time]
t_end = 0.5
save_every = 0.25
"""


@pytest.fixture(scope="module")
def run_file(tmp_path_factory):
    return run_config_text(tmp_path_factory.mktemp("readers"), "uniform", CONFIG)


@pytest.fixture(scope="module")
def density(run_file):
    """density[time, cell] as stored, read with netCDF4 alone."""
    with netCDF4.Dataset(run_file) as nc:
        values = np.asarray(nc.variables["density"][...], dtype=float)
    spread = (values[-1].max() - values[-1].min()) / values[-1].mean()
    assert spread > 1e-3  # the last snapshot is not uniform: a wrong cell order shows
    return values


def healpy_lonlat():
    """Longitude, latitude (degrees) of the nested pixel centres, by healpy."""
    lon, lat = hp.pix2ang(NSIDE, np.arange(NPIX), nest=True, lonlat=True)
    return lon, lat


def assert_same_lonlat(lon, lat):
    ref_lon, ref_lat = healpy_lonlat()
    np.testing.assert_allclose(np.asarray(lat, dtype=float), ref_lat, rtol=0, atol=1e-10)
    dlon = (np.asarray(lon, dtype=float) - ref_lon + 180.0) % 360.0 - 180.0  # −180 ≡ 180
    np.testing.assert_allclose(dlon, 0.0, atol=1e-10)


def integer_attributes(nc):
    """(where, name, dtype) of every integer attribute of an open netCDF4 file."""
    found = []
    for where, obj in [("global", nc)] + list(nc.variables.items()):
        for name in obj.ncattrs():
            value = np.asarray(obj.getncattr(name))
            if value.dtype.kind in "iu":
                found.append((where, name, value.dtype))
    return found


def open_quietly(path, **kw):
    """xr.open_dataset, any warning an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return xr.open_dataset(path, **kw).load()


# ------------------------------------------------------------------ the layout, as stored
def test_layout(run_file):
    with netCDF4.Dataset(run_file) as nc:
        assert "cells" not in nc.dimensions and len(nc.dimensions["cell"]) == NPIX
        index = nc.variables["cell"]
        assert index.dimensions == ("cell",) and index.dtype == np.int64
        assert {k: index.getncattr(k) for k in index.ncattrs()} == io.CELL_INDEX_ATTRS
        np.testing.assert_array_equal(index[:], np.arange(NPIX))
        ids = nc.variables["cell_ids"]
        assert sorted(ids.ncattrs()) == ["grid_name", "indexing_scheme", "level"]  # nothing else
        crs = nc.variables["crs"]
        assert {k: crs.getncattr(k) for k in crs.ncattrs()} == {
            "grid_mapping_name": "healpix", "refinement_level": 3, "indexing_scheme": "nested"}
        time = nc.variables["time"]
        assert {k: time.getncattr(k) for k in time.ncattrs()} == io.TIME_ATTRS  # no axis T
        assert nc.variables["density"].getncattr("grid_mapping") == "crs"
        assert nc.variables["density"].getncattr("coordinates") == "cell_ids crs"
        found = integer_attributes(nc)
        assert ("global", "nside", np.dtype(np.int32)) in found
        assert ("crs", "refinement_level", np.dtype(np.int32)) in found
        assert [f for f in found if f[2].itemsize > 4] == []  # CDO drops int64 attributes
        for name in ("complete", "steps", "dim_E", "rejected_steps"):
            assert nc.getncattr(name).dtype == np.int32, name
    open_quietly(run_file)  # xarray decodes it without a warning


# ------------------------------------------------------------------ xdggs, cf-xarray
@pytest.mark.readers
@pytest.mark.parametrize("convention", ["xdggs", "cf"])
def test_xdggs_cell_centres_are_healpys(run_file, density, convention):
    xdggs = pytest.importorskip("xdggs")  # a reader: pip install -e '.[readers]'
    ds = open_quietly(run_file)
    decoded = xdggs.decode(ds) if convention == "xdggs" else xdggs.decode(ds, convention="cf")
    info = decoded.dggs.grid_info
    assert (info.level, info.indexing_scheme) == (3, "nested")
    assert decoded.dggs.coord.name == ("cell_ids" if convention == "xdggs" else "cell")
    centres = decoded.dggs.cell_centers()
    assert_same_lonlat(centres.longitude.values, centres.latitude.values)
    # the decoded dataset keeps the values in the file's cell order
    np.testing.assert_array_equal(decoded.density.values, density)


def test_cf_xarray_finds_index_grid_mapping_and_no_calendar_axis(run_file):
    pytest.importorskip("cf_xarray")  # a test dependency
    ds = open_quietly(run_file)
    assert ds.cf.standard_names["healpix_index"] == ["cell"]
    assert ds.cf.grid_mapping_names == {"healpix": ["crs"]}
    assert ds.cf["healpix_index"].name == "cell"
    assert ds.density.cf.attrs["grid_mapping"] == "crs"
    assert "T" not in ds.cf.axes and "time" not in ds.cf.coordinates  # depth, not calendar time
    # the grid mapping of the DataArray, on a plain open_dataset (density:coordinates lists crs)
    assert ds.density.cf["grid_mapping"].attrs["refinement_level"] == 3
    with_crs = open_quietly(run_file, decode_coords="all")
    assert with_crs.density.cf["grid_mapping"].attrs["refinement_level"] == 3


@pytest.mark.readers
def test_easygems_reads_nside_and_nesting_from_a_plain_open(run_file):
    """easygems.healpix.get_nside / is_nested read the grid mapping that the density variable
    carries as a coordinate (no decode_coords needed)."""
    egh = pytest.importorskip("easygems.healpix")  # a reader: pip install -e '.[readers]'
    ds = open_quietly(run_file)
    assert egh.get_nside(ds.density) == NSIDE and egh.is_nested(ds.density)
    assert egh.get_nside(ds) == NSIDE and egh.is_nested(ds)


# ------------------------------------------------------------------ the solver's dataset
def solver_file(tmp_path):
    """The solver's in-memory dataset of a short nside-4 run, written by xarray: (path, npix)."""
    cfg = resolve(load_text(tmp_path, CONFIG.replace(f"nside = {NSIDE}", "nside = 4")))
    mesh = HealpixMesh(4)
    f0 = np.full(mesh.npix, UNIFORM)
    ds = EulerianSolver(mesh, build_model(cfg["model"])).run(f0, 0.25, 0.25)
    assert ds.density.dims == ("time", "cell") and ds.cell.attrs == io.CELL_INDEX_ATTRS
    assert ds.time.attrs == io.TIME_ATTRS and ds.crs.attrs["refinement_level"].dtype == np.int32
    assert ds.cell_ids.attrs == {"grid_name": "healpix", "level": 2, "indexing_scheme": "nested"}
    path = tmp_path / "solver.nc"
    ds.to_netcdf(path)
    return path, mesh.npix


def test_solver_dataset_writes_a_file_with_the_run_file_layout(tmp_path):
    pytest.importorskip("cf_xarray")  # a test dependency (registers the .cf accessor)
    path, _ = solver_file(tmp_path)
    with netCDF4.Dataset(path) as nc:
        assert [f for f in integer_attributes(nc) if f[2].itemsize > 4] == []
    back = open_quietly(path)
    assert back.cf.grid_mapping_names == {"healpix": ["crs"]} and back.cf.standard_names["healpix_index"] == ["cell"]


@pytest.mark.readers
def test_xdggs_reads_the_solver_dataset(tmp_path):
    xdggs = pytest.importorskip("xdggs")  # a reader: pip install -e '.[readers]'
    path, npix = solver_file(tmp_path)
    back = open_quietly(path)
    for convention in ("xdggs", "cf"):
        decoded = xdggs.decode(back, convention=convention)
        lon, lat = hp.pix2ang(4, np.arange(npix), nest=True, lonlat=True)
        centres = decoded.dggs.cell_centers()
        np.testing.assert_allclose(centres.latitude.values, lat, atol=1e-10)
        np.testing.assert_allclose(np.cos(np.radians(centres.longitude.values - lon)), 1.0, atol=1e-12)


def load_text(folder, text):
    path = folder / "c.toml"
    path.write_text(text)
    return load(path)


# ------------------------------------------------------------------ old files, the combined file
def as_old_layout(src, dst):
    """A copy of a run file in the layout written before this change (dimension `cells`, no
    index coordinate, int64 integer attributes, time with axis T), its digests recomputed."""
    with netCDF4.Dataset(src) as a, netCDF4.Dataset(dst, "w", format="NETCDF4") as b:
        for name, dim in a.dimensions.items():
            b.createDimension("cells" if name == "cell" else name, None if dim.isunlimited() else len(dim))
        for name, var in a.variables.items():
            if name == "cell":
                continue
            attrs = {k: var.getncattr(k) for k in var.ncattrs()}
            fill = attrs.pop("_FillValue", False)
            new = b.createVariable(name, var.dtype, tuple("cells" if d == "cell" else d for d in var.dimensions),
                                   fill_value=fill)
            for key in ("level", "refinement_level"):
                if key in attrs:
                    attrs[key] = np.int64(attrs[key])
            if name == "time":
                attrs = {"units": "1", "axis": "T", "long_name": "time (depth of the network)"}
            new.setncatts(attrs)
            new[...] = var[...]
        b.setncatts({k: (np.int64(v) if np.asarray(v).dtype.kind == "i" else v)
                     for k, v in ((k, a.getncattr(k)) for k in a.ncattrs())})
        b.setncatts({"layout_digest": io._digest(io._layout(b)), "end_digest": io._digest(io._run_end(b))})


def test_old_file_opens_in_the_current_layout(run_file, tmp_path):
    old = tmp_path / "old.nc"
    as_old_layout(run_file, old)
    with netCDF4.Dataset(old) as nc:
        assert "cells" in nc.dimensions and "cell" not in nc.variables
        assert nc.getncattr("nside").dtype == np.int64
    a, b = open_run(old), open_run(run_file)
    assert dict(a.sizes) == dict(b.sizes) and a.density.dims == ("time", "cell")
    assert a.cell.attrs == io.CELL_INDEX_ATTRS and "axis" not in a.time.attrs
    assert a.attrs["nside"].dtype == np.int32 and a.crs.attrs["refinement_level"].dtype == np.int32
    np.testing.assert_array_equal(a.cell.values, b.cell.values)
    np.testing.assert_array_equal(a.density.values, b.density.values)


@pytest.mark.readers
def test_xdggs_reads_an_old_file(run_file, tmp_path):
    xdggs = pytest.importorskip("xdggs")  # a reader: pip install -e '.[readers]'
    old = tmp_path / "old.nc"
    as_old_layout(run_file, old)
    centres = xdggs.decode(open_run(old), convention="cf").dggs.cell_centers()
    assert_same_lonlat(centres.longitude.values, centres.latitude.values)


@pytest.fixture(scope="module")
def combined_file(run_file, tmp_path_factory):
    """The sweep's combined file of two runs (the same file twice)."""
    config = json.loads(open_run(run_file).attrs["config"])
    config["output"] = {"path": str(run_file)}
    specs = [RunSpec(f"t-{k:04d}", k, {"model.beta": 10.0}, config) for k in range(2)]
    return combine(specs, tmp_path_factory.mktemp("combined") / "t.nc", "t")


def test_combined_file(combined_file, run_file):
    with netCDF4.Dataset(combined_file) as nc:
        assert nc.getncattr("Conventions") == "CF-1.13"
        time = nc.variables["time"]
        assert {k: time.getncattr(k) for k in time.ncattrs()} == io.TIME_ATTRS
        assert [f for f in integer_attributes(nc) if f[2].itemsize > 4] == []
    ds = open_quietly(combined_file)
    np.testing.assert_array_equal(ds.mass.sel(run=1).values, open_run(run_file).mass.values)


# ------------------------------------------------------------------ heavy readers (-m readers)
def cdo_binary():
    """The CDO of the skyborn-cdo wheel, else a `cdo` ≥ 2.6 on PATH (older ones do not read the
    CF-1.13 healpix grid mapping: docs/file_format.md); skips otherwise."""
    try:
        import skyborn_cdo

        return skyborn_cdo.get_cdo_path()
    except ImportError:
        path = shutil.which("cdo")
        if path is None:
            pytest.skip("no CDO: pip install skyborn-cdo")
        version = subprocess.run([path, "--version"], capture_output=True, text=True).stderr.split()
        number = next((v for v in version if v[:1].isdigit()), "0")
        if tuple(int(p) for p in number.split(".")[:2]) < (2, 6):
            pytest.skip(f"the cdo on PATH is {number}, older than 2.6: pip install skyborn-cdo")
        return path


def cdo(*args):
    result = subprocess.run([cdo_binary(), "-s", *map(str, args)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout


def cdo_values(*args):
    return np.array([float(v) for v in cdo("outputf,%.17g", *args).split()])


@pytest.mark.readers
def test_cdo_reads_the_healpix_grid_and_its_mean(run_file, density, tmp_path):
    assert re.search(r"healpix\s*:\s*points=%d" % NPIX, cdo("sinfo", run_file))
    grid = cdo("griddes", "-selname,density", run_file)
    assert "gridtype  = healpix" in grid and "refinement_level = 3" in grid  # nside 8 = 2³
    assert 'indexing_scheme = "nested"' in grid
    mean = cdo_values("-fldmean", "-selname,density", run_file)
    assert abs(mean[0] - UNIFORM) <= 1e-12 * UNIFORM
    # every snapshot: the density integrated with the cell area 4π/npix, over 4π
    np.testing.assert_allclose(mean, density.sum(axis=1) * (4 * math.pi / NPIX) / (4 * math.pi), rtol=1e-12)
    # what CDO writes keeps the 32-bit global attributes (it drops int64 ones)
    out = tmp_path / "mean.nc"
    cdo("-f", "nc4", "fldmean", "-selname,density", run_file, out)
    with netCDF4.Dataset(out) as nc:
        assert nc.getncattr("nside") == NSIDE and nc.getncattr("complete") == 1


@pytest.mark.readers
def test_cdo_bilinear_remapping_workaround_equals_healpy(run_file, density, tmp_path):
    """CDO 2.6 refuses remapbil on a HEALPix grid that carries a cell index; -setgrid,hp8_nested
    replaces the grid by the full one, and the result is healpy's bilinear interpolation."""
    out = tmp_path / "bil.nc"
    cdo("-f", "nc4", "remapbil,r72x36", f"-setgrid,hp{NSIDE}_nested", "-selname,density", run_file, out)
    with netCDF4.Dataset(out) as nc:
        lon, lat = nc.variables["lon"][:], nc.variables["lat"][:]
        remapped = np.asarray(nc.variables["density"][...])
    lon2, lat2 = np.meshgrid(lon, lat)
    for k in range(density.shape[0]):
        ref = hp.get_interp_val(density[k], lon2.ravel(), lat2.ravel(), nest=True, lonlat=True)
        np.testing.assert_allclose(remapped[k].ravel(), ref, rtol=1e-12, atol=0)
    ring = hp.get_interp_val(density[-1], lon2.ravel(), lat2.ravel(), nest=False, lonlat=True)
    assert np.abs(remapped[-1].ravel() - ring).max() > 1e-3 * UNIFORM  # the check can fail


@pytest.mark.readers
def test_uxarray_from_healpix(run_file, density):
    uxr = pytest.importorskip("uxarray")
    ux = uxr.UxDataset.from_healpix(xr.open_dataset(run_file))  # its face_dim default: "cell"
    assert ux.uxgrid.n_face == NPIX
    assert_same_lonlat(ux.uxgrid.face_lon.values, ux.uxgrid.face_lat.values)
    np.testing.assert_array_equal(ux.density.values, density)
    assert abs(float(ux.density.isel(time=0).mean()) - UNIFORM) <= 1e-12 * UNIFORM
    # ∫ f dA with uxarray's own face areas: the file's density integrated with 4π/npix
    total = density.sum(axis=1) * 4 * math.pi / NPIX
    for k in range(density.shape[0]):
        assert abs(float(ux.density.isel(time=k).integrate()) - total[k]) <= 1e-10


@pytest.mark.readers
def test_cf_python_field_coordinates_and_area_mean(run_file, density):
    cf = pytest.importorskip("cf")
    fields = cf.read(str(run_file))
    field = next(f for f in fields if f.nc_get_variable() == "density")
    info = field.healpix_info()
    assert info["indexing_scheme"] == "nested" and info["refinement_level"] == 3
    assert info["healpix_index"].nc_get_variable() == "cell"
    field = field.create_latlon_coordinates()
    assert_same_lonlat(field.coordinate("X").array, field.coordinate("Y").array)
    mean = field.collapse("area: mean").array.ravel()
    assert abs(mean[0] - UNIFORM) <= 1e-12 * UNIFORM
    np.testing.assert_allclose(mean, density.mean(axis=1), rtol=1e-12)


@pytest.mark.readers
def test_cf_python_and_cdo_read_the_combined_file(combined_file, run_file, tmp_path):
    """cf-python reads it as it is; CDO wants time as the first dimension: the transposed copy
    of docs/file_format.md."""
    mass = open_run(run_file).mass.values
    cf = pytest.importorskip("cf")
    field = next(f for f in cf.read(str(combined_file)) if f.nc_get_variable() == "mass")
    np.testing.assert_array_equal(field.array[1], mass)
    copy = tmp_path / "time_first.nc"
    xr.open_dataset(combined_file).transpose("time", ...).to_netcdf(copy)
    assert "points=2" in cdo("sinfo", "-selname,mass", copy)  # the two runs
    table = cdo("outputf,%.17g", "-selname,mass", copy).split()
    np.testing.assert_array_equal(np.array(table, dtype=float).reshape(-1, 2)[:, 1], mass)
