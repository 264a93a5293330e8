"""Runs survive what happens to real jobs: resume after a kill equals the uninterrupted run, run
guards stop a bad run with the time, the cell and the state at failure, one writer per file,
and a write error leaves a file with every complete snapshot."""

import errno
import math
import os
import resource
import signal
import subprocess
import sys
import time

import netCDF4
import numpy as np
import pytest
from run_configs import PAPER_VMF_CONFIG
from run_helpers import (
    ENV,
    ROUND_OFF,
    interrupt_after,
    one_numba_thread,  # noqa: F401 (autouse: one numba thread)
    relative_difference,
    run_difference,
    start_run,
    wait_for_snapshots,
)

from spherepde import AttentionModel, EulerianSolver, HealpixMesh, ParticleSolver
from spherepde.cli import main
from spherepde.models.initial import VonMisesFisher
from spherepde.solvers.guards import Guards, RunFailure
from spherepde.storage.runfile import RunWriter, open_run
from spherepde.transport import SSPStepper

CONFIG = PAPER_VMF_CONFIG + """
[eulerian]
nside = {nside}

[time]
t_end = {t_end}
save_every = {save_every}
"""
QUADRATURE = '\n[particles]\nmode = "quadrature"\ndt = 0.05\n'
TOKENS = '\n[particles]\nmode = "tokens"\nn = 40\nseed = 3\ndt = 0.05\n'


def write_config(directory, name, particles="", nside=4, t_end=0.6, save_every=0.1):
    path = directory / f"{name}.toml"
    path.write_text(CONFIG.format(nside=nside, t_end=t_end, save_every=save_every) + particles)
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run with density-carrying particles (config, file)."""
    d = tmp_path_factory.mktemp("reference")
    cfg = write_config(d, "ref", QUADRATURE, t_end=3.0)
    out = d / "ref.nc"
    assert main(["run", str(cfg), "-o", str(out)]) == 0
    return cfg, out


# ------------------------------------------------------------------ resume
def kill_and_resume(reference, tmp_path, capsys, seed, trials):
    """SIGKILL at random moments, then --resume (over the stale lock the killed run left): the
    finished file equals the uninterrupted run's, every variable to the last bit."""
    cfg, ref = reference
    n_snapshots = open_run(ref).sizes["time"]
    rng = np.random.default_rng(seed)
    for trial in range(trials):
        out = tmp_path / f"killed{trial}.nc"
        proc = start_run(cfg, "-o", out)
        target = int(rng.integers(1, n_snapshots // 2))  # leave most of the run: it must not finish
        seen = wait_for_snapshots(proc, target)
        time.sleep(rng.uniform(0.0, 0.01))  # kills land anywhere within the next snapshot
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stderr.close()
        assert seen == target, "the run ended before it could be killed"
        killed = open_run(out)
        assert killed.attrs["complete"] == 0 and target <= killed.sizes["time"] <= n_snapshots
        assert main(["run", str(cfg), "-o", str(out), "--resume"]) == 0
        assert "stale lock" in capsys.readouterr().err
        assert run_difference(out, ref) <= ROUND_OFF
        assert open_run(out).attrs["complete"] == 1 and not os.path.exists(f"{out}.lock")


def test_resume_after_sigkill_equals_uninterrupted_run(reference, tmp_path, capsys):
    kill_and_resume(reference, tmp_path, capsys, seed=8, trials=2)


@pytest.mark.slow
def test_resume_after_many_sigkills(reference, tmp_path, capsys):
    kill_and_resume(reference, tmp_path, capsys, seed=9, trials=10)


def test_resume_tokens_and_a_cut_snapshot(tmp_path):
    """Tokens (sampled from the seed, RNG state recorded): interrupted, the last snapshot then cut
    (marker reset, data garbled) as a kill mid-write leaves it; --resume rewrites it in place and
    ends equal to the uninterrupted run."""
    cfg = write_config(tmp_path, "tokens", TOKENS, t_end=0.4)
    ref, out = tmp_path / "ref.nc", tmp_path / "out.nc"
    assert main(["run", str(cfg), "-o", str(ref)]) == 0
    interrupt_after(cfg, out, 4)
    with netCDF4.Dataset(out, "a") as nc:
        nc.variables["snapshot_complete"][3] = 0
        nc.variables["density"][3, :] = -1.0
        nc.variables["positions"][3] = 7.0
    assert open_run(out).sizes["time"] == 3
    assert main(["run", str(cfg), "-o", str(out), "--resume"]) == 0
    assert run_difference(out, ref) <= ROUND_OFF
    assert "resumed from snapshot 2" in open_run(out).attrs["history"]
    assert '"seed": 3' in open_run(out).attrs["particle_rng"]


def test_resume_refuses_what_it_cannot_continue(reference, tmp_path, capsys):
    """A finished run: message, exit 0, file untouched. Another config, a missing file, a file
    with no complete snapshot: one line, exit 2."""
    cfg, ref = reference
    before = ref.read_bytes()
    assert main(["run", str(cfg), "-o", str(ref), "--resume"]) == 0
    assert "already complete" in capsys.readouterr().out and ref.read_bytes() == before
    status = main(["run", str(cfg), "-o", str(ref), "--resume", "--set", "model.beta=20"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and "[model] beta: 10.0 in the file, 20.0 now" in err[0]
    assert ref.read_bytes() == before
    status = main(["run", str(cfg), "-o", str(tmp_path / "none.nc"), "--resume"])
    assert status == 2 and "no such file to resume" in capsys.readouterr().err
    old = tmp_path / "old.nc"  # a file without the resume state (an older spherepde)
    old.write_bytes(before)
    with netCDF4.Dataset(old, "a") as nc:
        nc.renameVariable("step_safety", "renamed")
        nc.setncattr("complete", 0)
        for name in ("layout_digest", "end_digest"):  # none in older files
            nc.delncattr(name)
    assert main(["run", str(cfg), "-o", str(old), "--resume"]) == 2
    assert "cannot resume, the file has no step_safety" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # argparse: --resume and --overwrite exclude each other
        main(["run", str(cfg), "-o", str(ref), "--resume", "--overwrite"])
    assert exit_info.value.code == 2


def test_resume_after_guard_failure_with_loosened_guard(tmp_path, capsys):
    """A run stopped by a guard keeps its snapshots and the failure state; resumed with the
    guard loosened ([guards] may change on resume), the failure state is overwritten, the
    failure attribute dropped, and the result equals a run that never failed."""
    cfg = write_config(tmp_path, "g", t_end=0.3)
    ref, out = tmp_path / "ref.nc", tmp_path / "out.nc"
    assert main(["run", str(cfg), "-o", str(ref)]) == 0
    # the first Courant step is 0.076, below this floor (and not cut short by a save time)
    assert main(["run", str(cfg), "-o", str(out), "--set", "guards.dt_floor=0.09"]) == 3
    failed = open_run(out)
    assert failed.snapshot_kind.values.tolist() == [0, 1] and "time step collapsed" in failed.attrs["failure"]
    capsys.readouterr()
    assert main(["run", str(cfg), "-o", str(out), "--resume"]) == 0
    assert run_difference(out, ref) <= ROUND_OFF and "failure" not in open_run(out).attrs


# ------------------------------------------------------------------ guards
@pytest.fixture(scope="module")
def small_solver():
    mesh = HealpixMesh(4)
    model = AttentionModel(B=np.diag([-1.0, -1.0, 1.0]), V=np.diag([-1.0, 1.0, -2.0]), beta=10.0)
    f0 = VonMisesFisher([0.6, 0.0, 0.8], 3.0).cell_averages(mesh)
    return mesh, model, f0


def breaking_step(monkeypatch, at_step, damage):
    """Make SSPStepper.step apply damage(stepper, f) to the state its `at_step`-th call returns
    (damage may also break the stepper itself before the step)."""
    original = SSPStepper.step
    calls = {"n": 0}

    def step(self, f, t, dt_max):
        calls["n"] += 1
        if calls["n"] == at_step:
            f_new, dt = original(self, f, t, dt_max)
            return damage(self, f_new), dt
        return original(self, f, t, dt_max)

    monkeypatch.setattr(SSPStepper, "step", step)


def set_cell(value):
    def damage(stepper, f):
        f = f.copy()
        f[17] = value * f.max() if value < 0 else value
        return f
    return damage


def leak(stepper, f):
    return f * (1 + 1e-8)


GUARD_CASES = [
    ("nan", set_cell(math.nan), ["non-finite density", "cell 17"]),
    ("inf", set_cell(math.inf), ["non-finite density", "cell 17"]),
    ("negative", set_cell(-1e-6), ["negative density", "cell 17"]),
    ("mass", leak, ["mass drift", "exceeds mass_tolerance"]),
]


@pytest.mark.parametrize("name,damage,words", GUARD_CASES, ids=[c[0] for c in GUARD_CASES])
def test_guard_fires_with_time_cell_and_state(small_solver, monkeypatch, name, damage, words):
    mesh, model, f0 = small_solver
    breaking_step(monkeypatch, 3, damage)
    solver = EulerianSolver(mesh, model)
    with pytest.raises(RunFailure) as info:
        for _ in solver.snapshots(f0, [0.0, 0.1, 0.2]):
            pass
    failure = info.value
    for w in words:
        assert w in str(failure)
    assert 0 < failure.time <= 0.2 and f"t = {failure.time:.6g}" in str(failure)
    assert failure.density.shape == (mesh.npix,)


def test_cfl_and_step_floor_guards(small_solver, monkeypatch):
    """A stepper whose Courant control is broken (bound lifted, cfl 3): the guard's own bound
    stops it. A step below dt_floor: stopped, naming the cell of the fastest outflow."""
    mesh, model, f0 = small_solver
    solver = EulerianSolver(mesh, model)
    solver.stepper.cfl, solver.stepper.stage_limit = 3.0, math.inf
    with pytest.raises(RunFailure, match=r"CFL violation: step Courant number [\d.]+ > 0.5 at t = .*, cell \d+"):
        for _ in solver.snapshots(f0, [0.0, 1.0]):
            pass
    solver = EulerianSolver(mesh, model, guards=Guards(dt_floor=0.09))
    with pytest.raises(RunFailure, match=r"time step collapsed to .* < dt_floor 0.09 at t = 0, cell \d+"):
        for _ in solver.snapshots(f0, [0.0, 0.1]):
            pass


def test_particle_guard(small_solver, monkeypatch):
    _, model, _ = small_solver
    original = ParticleSolver.step

    def step(self, x, log_f, weights, dt):
        x, log_f = original(self, x, log_f, weights, dt)
        x = x.copy()
        x[5] = math.nan
        return x, log_f

    monkeypatch.setattr(ParticleSolver, "step", step)
    x0 = VonMisesFisher([0.6, 0.0, 0.8], 3.0).sample(20, np.random.default_rng(0))
    with pytest.raises(RunFailure, match="non-finite particle position at t = 0.05, particle 5"):
        for _ in ParticleSolver(model, dt=0.05).snapshots(x0, np.full(20, 0.05), [0.0, 0.1]):
            pass


def test_guard_failure_in_the_run_file(tmp_path, monkeypatch, capsys):
    """Through the CLI: one line with time, cell and reason, exit 3; the file keeps every regular
    snapshot, then the state at failure (snapshot_kind 1, NaN in cell 17), `failure` set,
    complete = 0."""
    cfg = write_config(tmp_path, "nan", TOKENS, t_end=0.3)
    out = tmp_path / "nan.nc"
    breaking_step(monkeypatch, 3, set_cell(math.nan))  # steps end at t = 0.076, 0.1, 0.176
    assert main(["run", str(cfg), "-o", str(out)]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "run failed: non-finite density" in err[0] and "cell 17" in err[0]
    assert f"snapshots kept in {out}: 2, then the state at failure" in err[0]
    ds = open_run(out)
    assert ds.snapshot_kind.values.tolist() == [0, 0, 1] and ds.attrs["complete"] == 0
    assert ds.attrs["failure"] in err[0]
    assert 0.1 < ds.time.values[-1] <= 0.2 and ds.time.values[-1] == ds.attrs["failure_time"]
    assert np.isnan(ds.density.values[-1, 17]) and np.isfinite(np.delete(ds.density.values[-1], 17)).all()
    assert np.isnan(ds.positions.values[-1]).all()  # the particles were not at the failure time
    assert not os.path.exists(f"{out}.lock")


# ------------------------------------------------------------------ output safety
def test_one_writer_per_file_and_sigterm(reference, tmp_path, capsys):
    """While a run writes a file, a second run on it is refused (lock, exit 2) even with
    --overwrite, and the file is left alone; SIGTERM ends the first run with exit 143, its
    snapshots kept and its lock removed."""
    # long enough not to end before SIGTERM: ~40 s when idle (t_end = 40 took 4 s, and a fresh
    # environment compiling the in-process runs below once let it finish first)
    cfg = write_config(tmp_path, "long", t_end=400.0, save_every=1.0)
    out = tmp_path / "long.nc"
    proc = start_run(cfg, "-o", out)
    try:
        assert wait_for_snapshots(proc, 2) == 2
        lock = f"{out}.lock"
        assert f"pid {proc.pid}" in open(lock).read()
        for extra in (["--overwrite"], ["--resume"]):
            assert main(["run", str(cfg), "-o", str(out), *extra]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and "another run is writing it" in err[0] and f"pid {proc.pid}" in err[0]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
        assert "terminated (SIGTERM)" in proc.stderr.read()
    finally:
        proc.kill()
        proc.stderr.close()
    ds = open_run(out)
    assert ds.sizes["time"] >= 2 and ds.attrs["complete"] == 0 and not os.path.exists(lock)


def test_write_error_keeps_every_complete_snapshot(reference, tmp_path, monkeypatch, capsys):
    """The file system refuses a flush (ENOSPC) while snapshot 3 is written: one line, exit 4;
    the file opens with the three complete snapshots; --resume later finishes it exactly."""
    cfg, ref = reference
    out = tmp_path / "full.nc"
    original, calls = RunWriter._flush, {"n": 0}

    def flush(self):
        calls["n"] += 1
        if calls["n"] == 1 + 2 * 3 + 1:  # the header, three snapshots (data, marker), then data
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        original(self)

    monkeypatch.setattr(RunWriter, "_flush", flush)
    assert main(["run", str(cfg), "-o", str(out)]) == 4
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No space left on device" in err[0]
    assert "complete snapshots kept in the file: 3" in err[0]
    ds, full = open_run(out), open_run(ref)
    assert ds.sizes["time"] == 3
    assert relative_difference(ds.density.values, full.density.values[:3]) <= ROUND_OFF
    monkeypatch.setattr(RunWriter, "_flush", original)
    assert main(["run", str(cfg), "-o", str(out), "--resume"]) == 0
    assert run_difference(out, ref) <= ROUND_OFF


def _limit_file_size(limit):
    def preexec():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return preexec


def run_limited(cfg, out, limit, *extra):
    """The CLI in a process whose files may not grow past `limit` bytes: real write errors
    inside HDF5, as on a full disk."""
    return subprocess.run([sys.executable, "-m", "spherepde.cli", "run", str(cfg), "-o", str(out), *extra],
                          capture_output=True, text=True, env=ENV, preexec_fn=_limit_file_size(limit))


def test_disk_too_small_fails_before_computing(tmp_path, monkeypatch):
    """The file takes its final size when it is created and never grows afterwards, so a disk
    that cannot hold the run stops it at once (a real HDF5 write error under a file-size limit
    one byte short): exit 4, one line, no file left."""
    cfg = write_config(tmp_path, "small", nside=2, t_end=0.3)
    out = tmp_path / "small.nc"
    sizes, append = [], RunWriter.append

    def measured_append(self, *args, **kwargs):
        sizes.append(os.path.getsize(self.path))
        return append(self, *args, **kwargs)

    monkeypatch.setattr(RunWriter, "append", measured_append)
    assert main(["run", str(cfg), "-o", str(out)]) == 0
    final = out.stat().st_size
    assert sizes == [final] * 4
    out.unlink()
    r = run_limited(cfg, out, final - 1)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 4 and len(lines) == 1, r.stderr[-3000:]
    assert "writing the file header failed" in lines[0] and "nothing was computed yet" in lines[0]
    assert not out.exists() and not os.path.exists(f"{out}.lock")


@pytest.mark.slow
def test_real_write_errors_at_many_sizes(tmp_path):
    """Under file-size limits from 1 % to 100 % of the final size the run either fails at once
    without a file or finishes equal to the unlimited run; a guard failure at the limit ends with
    exit 3, or 4 and both messages if its message no longer fits, and a file that opens with the
    failure state."""
    cfg = write_config(tmp_path, "sweep", QUADRATURE, t_end=0.3)
    ref, out = tmp_path / "ref.nc", tmp_path / "out.nc"
    assert main(["run", str(cfg), "-o", str(out)]) == 0
    final = out.stat().st_size
    out.rename(ref)
    for limit in np.linspace(0.01, 1.0, 8) * final:
        r = run_limited(cfg, out, int(limit))
        if r.returncode == 4:
            assert "nothing was computed yet" in r.stderr and not out.exists()
        else:
            assert r.returncode == 0 and int(limit) == final and run_difference(out, ref) <= ROUND_OFF
            out.unlink()
    r = run_limited(cfg, out, final, "--set", "guards.dt_floor=0.09")
    if r.returncode == 4:  # the failure message did not fit in the file's final size
        assert "a guard stopped the run (time step collapsed" in r.stderr
    else:
        assert r.returncode == 3 and "time step collapsed" in r.stderr
    assert open_run(out).snapshot_kind.values.tolist() == [0, 1]
