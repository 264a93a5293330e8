"""`spherepde run` output: the NetCDF layout (xdggs, healpy, CF), diagnostics against the
solver, a killed run keeps its snapshots, and `spherepde plot`."""

import json
import signal
import time

import healpy as hp
import netCDF4
import numpy as np
import pytest
import xarray as xr
from run_configs import PAPER_VMF_CONFIG
from run_helpers import start_run, wait_for_snapshots

from spherepde.cli import main
from spherepde.geometry.mesh import HealpixMesh
from spherepde.runner.build import build_initial_law, build_model
from spherepde.runner.config import load, resolve
from spherepde.solvers.eulerian import EulerianSolver
from spherepde.storage.runfile import open_run

CONFIG = PAPER_VMF_CONFIG + """
[eulerian]
nside = {nside}

[time]
t_end = {t_end}
save_every = {save_every}
"""


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    cfg = d / "small.toml"
    cfg.write_text(CONFIG.format(nside=8, t_end=0.5, save_every=0.25))
    out = d / "small.nc"
    assert main(["run", str(cfg), "-o", str(out)]) == 0
    return cfg, out


def test_netcdf_layout(small_run):
    _, out = small_run
    with netCDF4.Dataset(out) as nc:
        assert nc.data_model == "NETCDF4"
        assert nc.dimensions["time"].isunlimited()
        ids = nc.variables["cell_ids"]
        assert ids.dtype == np.uint64
        assert {k: ids.getncattr(k) for k in ids.ncattrs()} == {
            "grid_name": "healpix", "level": 3, "indexing_scheme": "nested"}
        assert nc.variables["crs"].getncattr("grid_mapping_name") == "healpix"
        assert nc.variables["density"].getncattr("grid_mapping") == "crs"
        assert "_FillValue" not in nc.variables["time"].ncattrs()
        assert nc.getncattr("Conventions") == "CF-1.13"
        cfg = json.loads(nc.getncattr("config"))
        assert cfg["eulerian"]["nside"] == 8 and cfg["initial"]["kind"] == "vmf"
        assert nc.getncattr("complete") == 1
        for name in ("mass", "alignment_E", "alignment_F", "w2_to_projection", "lyapunov",
                     "lower_bound_paper", "lower_bound_aposteriori", "w2_bound_zero_temperature"):
            var = nc.variables[name]
            assert var.dimensions == ("time",) and var.long_name and hasattr(var, "units")


@pytest.mark.readers
def test_xdggs_decodes_without_arguments(small_run):
    xdggs = pytest.importorskip("xdggs")  # a reader: pip install -e '.[readers]'
    ds = xr.open_dataset(small_run[1])
    decoded = xdggs.decode(ds)
    assert decoded.dggs.grid_info.level == 3
    assert decoded.dggs.grid_info.indexing_scheme == "nested"


def test_healpy_reads_density_in_nested_order(small_run):
    """The t = 0 map equals the vMF density at healpy's pixel centres, in NESTED order and after
    healpy's reorder to RING (up to the cell-average vs point-value difference); read in the
    wrong ordering it does not."""
    from spherepde.models.initial import VonMisesFisher

    ds = open_run(small_run[1])
    f0 = ds.density.values[0]
    nside = hp.npix2nside(f0.size)
    law = VonMisesFisher([0.6, 0.0, 0.8], 3.0)
    pix = np.arange(f0.size)
    nested = law.density(np.stack(hp.pix2vec(nside, pix, nest=True), axis=-1))
    ring = law.density(np.stack(hp.pix2vec(nside, pix, nest=False), axis=-1))
    scale = f0.max()
    assert np.abs(f0 - nested).max() < 0.03 * scale
    assert np.abs(hp.reorder(f0, n2r=True) - ring).max() < 0.03 * scale
    assert np.abs(f0 - ring).max() > 0.3 * scale  # the check can fail
    np.testing.assert_array_equal(ds.cell_ids.values, pix.astype(np.uint64))


def test_run_file_equals_direct_solver(small_run):
    """The CLI run writes exactly what the library solver computes, and its diagnostics."""
    cfg_path, out = small_run
    cfg = resolve(load(cfg_path))
    mesh = HealpixMesh(8)
    law = build_initial_law(cfg["initial"])
    solver = EulerianSolver(mesh, build_model(cfg["model"]), velocity_tolerance=cfg["eulerian"]["velocity_tolerance"])
    ref = solver.run(law.cell_averages(mesh), 0.5, 0.25)
    ds = open_run(out)
    np.testing.assert_array_equal(ds.time.values, ref.time.values)
    # round-off, not bitwise: vectorised reductions depend on memory alignment
    np.testing.assert_allclose(ds.density.values, ref.density.values, rtol=1e-12, atol=0)
    np.testing.assert_allclose(ds.mass.values, 1.0, atol=1e-13)
    np.testing.assert_allclose(ds.lower_bound_paper.values,
                               0.5 * ds.attrs["ell0"] * np.exp(-ds.attrs["C0"] * ds.time.values))
    assert np.all(ds.alignment_E.values >= 0) and np.all(ds.alignment_E.values <= 1)


def test_killed_run_keeps_every_snapshot(tmp_path):
    """SIGKILL at random moments (after a random number of snapshots, plus a random delay): the
    file opens, its snapshots are complete and equal to those of an uninterrupted run."""
    cfg = tmp_path / "kill.toml"
    cfg.write_text(CONFIG.format(nside=8, t_end=3.0, save_every=0.05))
    full = tmp_path / "full.nc"
    assert main(["run", str(cfg), "-o", str(full)]) == 0
    reference = open_run(full)
    rng = np.random.default_rng(1)
    for trial in range(4):
        out = tmp_path / f"killed{trial}.nc"
        proc = start_run(cfg, "-o", out)
        target = int(rng.integers(1, 20))
        written = wait_for_snapshots(proc, target)
        time.sleep(rng.uniform(0.0, 0.05))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        rest = proc.stderr.read()
        proc.stderr.close()
        assert written == target, f"the run ended before it could be killed: {rest[-2000:]}"
        ds = open_run(out)
        k = ds.sizes["time"]
        assert target <= k < reference.sizes["time"] and ds.attrs["complete"] == 0
        np.testing.assert_array_equal(ds.time.values, reference.time.values[:k])
        # equal to round-off, not bitwise: the vectorised sums' loop peeling depends on the
        # arrays' memory alignment, which differs between processes (1-ulp differences)
        np.testing.assert_allclose(ds.density.values, reference.density.values[:k], rtol=1e-12, atol=0)
        np.testing.assert_allclose(ds.alignment_E.values, reference.alignment_E.values[:k], rtol=1e-12)


@pytest.mark.parametrize("mode", ["tokens", "quadrature"])
def test_particles_in_the_run_file(tmp_path, mode):
    """[particles] runs the particle solver in lockstep: positions on the sphere, weights summing to
    1, the same diagnostics by the same code; quadrature particles start at the centroids with the
    law's point density, and the two solvers' alignments agree closely."""
    cfg = tmp_path / "p.toml"
    cfg.write_text(CONFIG.format(nside=8, t_end=0.5, save_every=0.25)
                   + f'\n[particles]\nmode = "{mode}"\nn = 300\nseed = 2\ndt = 0.05\n')
    out = tmp_path / "p.nc"
    assert main(["run", str(cfg), "-o", str(out)]) == 0
    ds = open_run(out)
    x = ds.positions.values
    np.testing.assert_allclose(np.linalg.norm(x, axis=-1), 1.0, atol=1e-14)
    assert ds.particle_weights.values.sum() == pytest.approx(1.0, abs=1e-13)
    for name in ("particle_alignment_E", "particle_alignment_F", "particle_w2_to_projection",
                 "particle_lyapunov", "w2_eulerian_particles"):
        assert np.all(np.isfinite(ds[name].values)), name
    gap = np.abs(ds.particle_alignment_E.values - ds.alignment_E.values).max()
    if mode == "quadrature":
        from spherepde.models.initial import VonMisesFisher

        mesh = HealpixMesh(8)
        assert x.shape[1] == mesh.npix
        np.testing.assert_allclose(x[0], mesh.centroids)
        np.testing.assert_allclose(ds.particle_density.values[0],
                                   VonMisesFisher([0.6, 0.0, 0.8], 3.0).density(mesh.centroids), rtol=1e-12)
        assert gap < 0.01
    else:
        assert x.shape[1] == 300 and "particle_density" not in ds
        assert gap < 0.1  # 300 i.i.d. tokens: sampling error ~ 1/√300


def test_plot_command_writes_pngs(small_run, tmp_path):
    _, out = small_run
    assert main(["plot", str(out), "-o", str(tmp_path)]) == 0
    for suffix in ("density", "diagnostics"):
        assert (tmp_path / f"small_{suffix}.png").stat().st_size > 20_000


def test_plot_helpers_take_axes(small_run):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from spherepde.visualization.plots import diagnostics_plot, mollweide

    ds = open_run(small_run[1])
    fig, ax = plt.subplots()
    got_fig, got_ax = mollweide(ds.density.values[-1], ax=ax)
    assert got_fig is fig and got_ax is ax and ax.images
    fig, axes = plt.subplots(1, 3)
    got_fig, got_axes = diagnostics_plot(ds, axes=axes)
    assert got_fig is fig
    plt.close("all")


def test_plot_bad_file(tmp_path, capsys):
    bogus = tmp_path / "x.nc"
    bogus.write_text("not netcdf")
    assert main(["plot", str(bogus)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert main(["plot", str(tmp_path / "missing.nc")]) == 2
