"""Runs of the particles alone (`[eulerian] enabled = false`): what the token ensembles of a sweep
run. The particles never read the Eulerian state, so they must equal the particle part of the
same run with the Eulerian solver; the file has no cells; resume, plots, sweeps and bad input
work as for any run."""

import numpy as np
import pytest
from run_configs import PAPER_VMF_CONFIG
from run_helpers import ROUND_OFF, interrupt_after, one_numba_thread, run_difference  # noqa: F401 (autouse: one numba thread)

from spherepde.cli import main
from spherepde.storage.runfile import open_run

TOKENS = """
[particles]
mode = "{mode}"
n = 60
seed = 5
dt = 0.05

[time]
t_end = 1.0
save_every = 0.1
"""
ALONE = "\n[eulerian]\nenabled = false\nnside = 4\n"
WITH_MESH = "\n[eulerian]\nnside = 4\n"


def write(folder, name, eulerian, mode="tokens"):
    path = folder / f"{name}.toml"
    path.write_text(PAPER_VMF_CONFIG + eulerian + TOKENS.format(mode=mode))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(config alone, file alone, file of the same run with the Eulerian solver), tokens."""
    d = tmp_path_factory.mktemp("alone")
    files = {}
    for name, eulerian in (("alone", ALONE), ("with_mesh", WITH_MESH)):
        cfg = write(d, name, eulerian)
        files[name] = d / f"{name}.nc"
        assert main(["run", str(cfg), "-o", str(files[name])]) == 0
    return d / "alone.toml", files["alone"], files["with_mesh"]


@pytest.mark.parametrize("mode", ["tokens", "quadrature"])
def test_particles_alone_equal_the_particles_beside_the_mesh(tmp_path, mode):
    """Every particle variable of the run alone equals that of the run with the Eulerian solver
    (bitwise: the same arithmetic on the same numbers); the file has no cells and no density."""
    alone, beside = tmp_path / "alone.nc", tmp_path / "beside.nc"
    assert main(["run", str(write(tmp_path, "a", ALONE, mode)), "-o", str(alone)]) == 0
    assert main(["run", str(write(tmp_path, "b", WITH_MESH, mode)), "-o", str(beside)]) == 0
    a, b = open_run(alone), open_run(beside)
    assert "density" not in a and "cell" not in a.dims and "alignment_E" not in a
    particle_vars = [n for n in b.data_vars if n.startswith("particle_") or n == "positions"]
    assert set(particle_vars) <= set(a.data_vars)
    assert len(particle_vars) >= 6
    for name in particle_vars:
        np.testing.assert_array_equal(a[name].values, b[name].values, err_msg=name)
    assert a.attrs["complete"] == 1 and "steps" not in a.attrs
    if mode == "quadrature":  # one particle per cell of the mesh that is not solved on
        assert a.sizes["particle"] == 12 * 4**2


def test_interrupted_run_alone_resumes_to_the_uninterrupted_one(runs, tmp_path):
    cfg, ref, _ = runs
    out = tmp_path / "out.nc"
    interrupt_after(cfg, out, 4)
    assert open_run(out).attrs["complete"] == 0
    assert main(["run", str(cfg), "-o", str(out), "--resume"]) == 0
    assert run_difference(out, ref) <= ROUND_OFF
    assert "resumed from snapshot 3" in open_run(out).attrs["history"]


def test_plot_of_a_run_alone(runs, tmp_path):
    """The plots of a run alone: the particles' histogram (its cells sum to the particles' mass)
    and their diagnostics."""
    from spherepde.visualization.plots import token_histogram

    _, ref, _ = runs
    assert main(["plot", str(ref), "-o", str(tmp_path)]) == 0
    for suffix in ("density", "diagnostics", "sphere"):
        assert (tmp_path / f"alone_{suffix}.png").stat().st_size > 10_000
    hist = token_histogram(open_run(ref), nside=8)
    mass = hist.density.sum("cell").values * 4 * np.pi / (12 * 8**2)
    np.testing.assert_allclose(mass, 1.0, rtol=1e-12)


def test_particles_alone_need_particles(tmp_path, capsys):
    cfg = tmp_path / "none.toml"
    cfg.write_text(PAPER_VMF_CONFIG + ALONE + "\n[time]\nt_end = 1.0\nsave_every = 0.5\n")
    assert main(["run", str(cfg), "-o", str(tmp_path / "none.nc")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "[eulerian] enabled" in err[0]
    assert not (tmp_path / "none.nc").exists()


def test_seed_sweep_of_particles_alone(tmp_path):
    """A sweep over seeds of runs alone: one run file per seed, the combined file with a run
    dimension whose runs differ (different samples) and equal the single runs."""
    from spherepde.runner.sweep import run_sweep

    write(tmp_path, "base", ALONE)
    sweep = tmp_path / "seeds.toml"
    sweep.write_text('[sweep]\nname = "seeds"\nbase = "base.toml"\n\n[sweep.grid]\n'
                     '"particles.seed" = [1, 2, 3]\n')
    combined = open_combined(run_sweep(sweep, out_dir=tmp_path / "out", workers=1, log=None))
    assert combined.sizes["run"] == 3
    series = combined.particle_alignment_E.values
    assert np.all(np.isfinite(series))
    assert len({tuple(row) for row in series.round(12)}) == 3


def open_combined(path):
    import xarray as xr

    with xr.open_dataset(path) as ds:
        return ds.load()


def test_plot_of_one_system_of_a_batch(tmp_path, capsys):
    """`spherepde plot --system K` on a file of batched systems shows system K, which is the single
    run with seed + K (its token histogram equal to that run's); a system out of range and tokens
    off S² are one error line each, exit 2."""
    from spherepde.visualization.plots import select_system, token_histogram

    batch = tmp_path / "batch.toml"
    batch.write_text(PAPER_VMF_CONFIG + ALONE + TOKENS.format(mode="tokens").replace("seed = 5", "seed = 5\nsystems = 2")
                     .replace("t_end = 1.0", "t_end = 0.3"))
    single = tmp_path / "single.toml"
    single.write_text(PAPER_VMF_CONFIG + ALONE + TOKENS.format(mode="tokens").replace("seed = 5", "seed = 6")
                      .replace("t_end = 1.0", "t_end = 0.3"))
    for cfg in (batch, single):
        assert main(["run", str(cfg), "-o", str(cfg.with_suffix(".nc"))]) == 0
    out = tmp_path / "figs"
    out.mkdir()
    assert main(["plot", str(tmp_path / "batch.nc"), "-o", str(out), "--system", "1"]) == 0
    assert all((out / f"batch_{s}.png").stat().st_size > 10_000 for s in ("density", "diagnostics", "sphere"))
    one = select_system(open_run(tmp_path / "batch.nc"), 1)
    assert one.attrs["plotted_system"] == "system 1 of 2 (seed 6)"
    np.testing.assert_array_equal(token_histogram(one).density.values,
                                  token_histogram(open_run(tmp_path / "single.nc")).density.values)
    capsys.readouterr()
    assert main(["plot", str(tmp_path / "batch.nc"), "-o", str(out), "--system", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--system" in err[0]

    d4 = tmp_path / "d4.toml"
    d4.write_text('[model]\nbeta = 2.0\nB = "identity"\nV = "identity"\ndimension = 4\n[initial]\nkind = "uniform"\n'
                  + ALONE + TOKENS.format(mode="tokens").replace("t_end = 1.0", "t_end = 0.2"))
    assert main(["run", str(d4), "-o", str(tmp_path / "d4.nc")]) == 0
    assert main(["plot", str(tmp_path / "d4.nc"), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "R^4" in err[0] and not (out / "d4_density.png").exists()
