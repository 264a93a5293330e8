"""Hostile input (hypothesis): random TOML documents, random matrices and β, damaged NetCDF files.
Each ends in a clear error or a correct result: never another exception, a hang, or a silently
wrong number."""

import json
import math
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numba
import numpy as np
import pytest
from hypothesis import HealthCheck, event, example, given, settings, strategies as st
from run_configs import PAPER_VMF_CONFIG
from run_helpers import ROUND_OFF, run_difference

from spherepde import AttentionModel, EulerianSolver, ParticleSolver
from spherepde.cli import main
from spherepde.runner.build import build_initial_law, build_model, build_noise
from spherepde.runner.config import DEFAULTS, ConfigError, load, resolve
from spherepde.solvers.guards import RunFailure
from spherepde.storage import runfile
from spherepde.storage.runfile import RUN_END_ATTRS, RunFileError, open_run

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module", autouse=True)
def one_numba_thread_and_quick_hang_detection():
    """One numba thread: many tiny kernel calls, each waiting for a time slice per parallel
    region on a busy machine otherwise (results do not depend on the thread count). HDF5 gets
    3 CPU seconds, not 30, to read a small damaged file before it counts as hanging: CPU time,
    which a child starved of the processor does not use up (test_a_starved_reader_is_no_hang)."""
    threads, seconds = numba.get_num_threads(), runfile.PARSE_SECONDS
    numba.set_num_threads(1)
    runfile.PARSE_SECONDS = 3.0
    yield
    numba.set_num_threads(threads)
    runfile.PARSE_SECONDS = seconds


# ------------------------------------------------------------------ TOML documents
def toml_number(x):
    return repr(x) if math.isfinite(x) else ("nan" if math.isnan(x) else ("inf" if x > 0 else "-inf"))


# numbers at every scale, mostly moderate (so that many documents are valid and reach the solvers)
numbers = st.one_of(
    st.integers(-3, 20).map(str),
    st.floats(-10, 10).map(toml_number),
    st.builds(lambda m, e: f"{m}e{e}", st.integers(-9999, 9999), st.integers(-330, 330)),
    st.sampled_from(["nan", "inf", "-inf", "9223372036854775807", "0", "1024", "2048"]),
)
others = st.one_of(
    st.sampled_from(['"inf"', '"muscl"', '"upwind"', '"vmf"', '"uniform"', '"mixture"', '"projected_normal"',
                     '"tokens"', '"quadrature"', '"rk4"', '"euler"', "1979-05-27", "true", "false", '""']),
    st.text(max_size=6).map(json.dumps),
)


def listed(items, size=3):
    return st.lists(items, min_size=size, max_size=size).map(lambda xs: "[" + ", ".join(xs) + "]")


vectors = listed(numbers)
matrices_toml = listed(vectors)
anything = st.recursive(st.one_of(numbers, others), lambda inner: st.one_of(
    st.lists(inner, max_size=4).map(lambda xs: "[" + ", ".join(xs) + "]"),
    st.dictionaries(st.sampled_from(["mu", "kappa", "x"]), inner, max_size=3).map(
        lambda d: "{" + ", ".join(f"{k} = {v}" for k, v in d.items()) + "}")), max_leaves=8)
components = st.lists(st.builds(lambda mu, kappa: f"{{ mu = {mu}, kappa = {kappa} }}", vectors, numbers),
                      min_size=1, max_size=3).map(lambda xs: "[" + ", ".join(xs) + "]")
VALUES = {"B": matrices_toml, "V": matrices_toml, "cov": matrices_toml, "mu": vectors, "mean": vectors,
          "weights": st.lists(numbers, min_size=1, max_size=3).map(lambda xs: "[" + ", ".join(xs) + "]"),
          "components": components, "kind": others, "scheme": others, "mode": others,
          "noise_schedule": st.one_of(st.sampled_from(['"constant"', '"exponential"', '"linear"', '"piecewise"']), others),
          "noise_breakpoints": st.lists(listed(numbers, 2), min_size=1, max_size=3).map(lambda xs: "[" + ", ".join(xs) + "]")}
SECTION_KEYS = dict({s: sorted(t) for s, t in DEFAULTS.items()},
                    initial=["kind", "mu", "kappa", "weights", "components", "mean", "cov"])
GOOD = PAPER_VMF_CONFIG + "\n[eulerian]\nnside = 2\n\n[time]\nt_end = 0.2\nsave_every = 0.1\n"


@st.composite
def toml_documents(draw):
    """Random text now and then; mostly the good config with one to three settings replaced or
    added (a plausible value for the key, sometimes anything, sometimes a foreign key)."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.text(alphabet=string.printable + "é∞", max_size=200))
    sections = {}
    current = None
    for line in GOOD.splitlines():
        if line.startswith("["):
            current = line.strip("[]")
            sections[current] = {}
        elif "=" in line:
            key, value = line.split("=", 1)
            sections[current][key.strip()] = value.strip()
    for _ in range(draw(st.integers(1, 3))):
        section = draw(st.sampled_from([*DEFAULTS, "solver"]))
        key = draw(st.sampled_from(SECTION_KEYS.get(section, ["x"]) + ["extra"]))
        value = draw(st.one_of(VALUES.get(key, numbers), anything) if draw(st.integers(0, 4)) == 0
                     else VALUES.get(key, numbers))
        sections.setdefault(section, {})[key] = value
    return "\n".join(f"[{s}]\n" + "\n".join(f"{k} = {v}" for k, v in table.items()) for s, table in sections.items())


@given(text=toml_documents())
@settings(max_examples=200, **SETTINGS)
def test_random_toml_gives_config_error_or_a_runnable_config(text, mesh_factory):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "c.toml"
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        try:
            cfg = resolve(load(path))
        except ConfigError as exc:
            assert str(exc) and "\n" not in str(exc)
            event("ConfigError")
            return
    event("valid config")
    json.dumps(cfg, allow_nan=False)  # what the run file stores
    model = build_model(cfg["model"])
    mesh = mesh_factory(1)
    noise = build_noise(cfg["model"])  # None without noise
    EulerianSolver(mesh, model, rk_order=cfg["eulerian"]["rk_order"], noise=noise)
    if noise is not None:
        assert math.isfinite(noise.integral(0.0, min(cfg["time"]["t_end"], 1.0))) and noise(0.0) >= 0
    f0 = build_initial_law(cfg["initial"]).cell_averages(mesh)
    assert np.all(np.isfinite(f0)) and np.all(f0 >= 0) and mesh.integrate(f0) == pytest.approx(1.0, rel=1e-9)


def test_integer_beyond_double_range_is_a_config_error():
    with pytest.raises(ConfigError, match=r"\[time\] t_end: must be finite"):
        resolve({"model": {"beta": 1.0, "B": np.eye(3).tolist(), "V": np.eye(3).tolist()},
                 "time": {"t_end": 10**400, "save_every": 1.0}})


# ------------------------------------------------------------------ matrices and β
moderate = st.lists(st.floats(-5, 5), min_size=9, max_size=9).map(lambda xs: np.array(xs).reshape(3, 3))
wild_entries = st.one_of(
    st.floats(-5, 5),
    st.builds(lambda m, e: float(f"{m}e{e}"), st.integers(-9999, 9999), st.integers(-324, 305)),
    st.sampled_from([0.0, math.nan, math.inf, -math.inf, 1e-320, 1e308, 1e-50, 1e50]),
)
matrices = st.one_of(
    moderate,
    st.builds(lambda a, e: a * float(f"1e{e}"), moderate, st.integers(-330, 330)),  # huge and tiny
    st.tuples(moderate, st.integers(1, 2)).map(  # singular: rank 1 or 2
        lambda a: np.linalg.svd(a[0])[0][:, :a[1]] @ np.diag(np.linalg.svd(a[0])[1][:a[1]])
        @ np.linalg.svd(a[0])[2][:a[1]]),
    st.lists(wild_entries, min_size=9, max_size=9).map(lambda xs: np.array(xs).reshape(3, 3)),
)
betas = st.integers(0, 4).flatmap(lambda i: st.just(math.inf) if i == 0 else st.floats(-8, 8).map(lambda e: 10.0**e))


EYE, PAPER_B, PAPER_V = np.eye(3), np.diag([-1.0, -1.0, 1.0]), np.diag([-1.0, 1.0, -2.0])


@given(B=matrices, V=matrices, beta=betas)
@example(B=EYE, V=1e40 * EYE, beta=10.0)  # velocity 1e40: the step collapses
@example(B=EYE, V=1e5 * EYE, beta=1.0)  # fast but fine: 30000 steps to t = 0.05
@example(B=1e-45 * PAPER_B, V=PAPER_V, beta=math.inf)  # |Bᵀx|³ ~ 1e-135
@example(B=1e50 * EYE, V=EYE, beta=1e8)  # exponents beyond range
@example(B=np.zeros((3, 3)), V=PAPER_V, beta=1.0)  # uniform weights
@example(B=PAPER_B, V=PAPER_V, beta=1e-8)
@example(B=PAPER_B, V=PAPER_V, beta=1e8)
@example(B=np.ones((3, 3)), V=PAPER_V, beta=math.inf)  # singular at β = ∞
@settings(max_examples=80, **SETTINGS)
def test_solvers_refuse_or_compute_finite_fields(B, V, beta, mesh_factory):
    """AttentionModel or the solvers raise ValueError with a message, or the velocity and its
    divergence are finite and a short solve (a few Courant steps) ends in a RunFailure or a
    finite, positive, mass-conserving density."""
    mesh = mesh_factory(2)
    try:
        with np.errstate(all="ignore"):
            model = AttentionModel(B, V, beta)
        solver = EulerianSolver(mesh, model)
        particles = ParticleSolver(model, dt=0.05, carry_density=model.zero_temperature)
    except ValueError as exc:
        assert str(exc)
        event("ValueError")
        return
    f0 = np.full(mesh.npix, 1 / (4 * math.pi))
    f0[:5] *= 2.0
    v, div, _ = solver.velocity.at_cells(f0)
    assert np.all(np.isfinite(v)) and np.all(np.isfinite(div))
    pv, _ = particles.field(mesh.centroids, f0 * mesh.area)
    assert np.all(np.isfinite(pv))
    speed = float(np.abs(v).max())
    t_end = min(0.05, 2 * math.sqrt(mesh.area) / speed) if speed > 0 else 0.05  # a few steps at any speed
    try:
        for _, _, f, _ in solver.snapshots(f0, [0.0, t_end]):
            pass
    except RunFailure as failure:
        assert "at t = " in str(failure)
        event(f"RunFailure: {failure.reason.split()[0]}")
        return
    event("finite solution")
    assert np.all(np.isfinite(f)) and f.min() >= -1e-14 * f.max()
    assert mesh.integrate(f) == pytest.approx(mesh.integrate(f0), rel=1e-12)


# ------------------------------------------------------------------ damaged run files
def test_a_reader_that_computes_forever_is_a_hang(run_files, monkeypatch):
    """A child that loops (as HDF5 does on some flipped bits) is stopped once it has used
    PARSE_SECONDS of CPU time, with one line naming the file."""
    _, done = run_files

    def spin(path):
        while True:
            pass

    monkeypatch.setattr(runfile, "_verify", spin)
    monkeypatch.setattr(runfile, "PARSE_SECONDS", 0.3)
    with pytest.raises(RunFileError, match="HDF5 did not finish reading it") as info:
        open_run(done)
    assert str(done) in str(info.value) and "\n" not in str(info.value)


def test_a_starved_reader_is_no_hang(run_files, monkeypatch):
    """A child that takes longer in wall time than its CPU budget, without computing (as a child
    starved of the processor on a busy machine), still reads the file: the budget is CPU time.
    Deterministic: the child sleeps 4× its CPU budget."""
    _, done = run_files
    verify = runfile._verify

    def slow(path):
        time.sleep(1.2)
        return verify(path)

    monkeypatch.setattr(runfile, "_verify", slow)
    monkeypatch.setattr(runfile, "PARSE_SECONDS", 0.3)
    assert open_run(done).sizes["time"] > 0


def test_cpu_time_of_a_child_is_measured():
    """_cpu_seconds reads a running child's CPU time: a spinning child's grows past 0.3 s, while a
    sleeping one's stays below (no wall-clock window: the test waits for the spinner's CPU time)."""
    spinning = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    sleeping = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        deadline = time.monotonic() + 120.0  # however busy the machine: until the spinner has had 0.3 s
        while runfile._cpu_seconds(spinning.pid) <= 0.3:
            assert time.monotonic() < deadline, "the spinning child got no CPU time"
            time.sleep(0.01)
        assert runfile._cpu_seconds(sleeping.pid) < 0.3
    finally:
        spinning.kill(), sleeping.kill()
        spinning.wait(), sleeping.wait()
@pytest.fixture(scope="module")
def run_files(tmp_path_factory):
    """A finished small run with tokens, the same run interrupted after two snapshots, and its
    uninterrupted result: (config, finished, interrupted bytes)."""
    d = tmp_path_factory.mktemp("damage")
    cfg = d / "c.toml"
    cfg.write_text(GOOD.replace("t_end = 0.2", "t_end = 0.3") + '\n[particles]\nn = 10\ndt = 0.05\n')
    done = d / "done.nc"
    assert main(["run", str(cfg), "-o", str(done)]) == 0
    return cfg, done


def damaged(raw, data):
    """raw truncated at a random byte, or with 1-4 random bits flipped."""
    raw = bytearray(raw)
    if data.draw(st.booleans(), label="truncate"):
        return bytes(raw[: data.draw(st.integers(0, len(raw) - 1), label="size")])
    for _ in range(data.draw(st.integers(1, 4), label="flips")):
        i = data.draw(st.integers(0, len(raw) - 1), label="byte")
        raw[i] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    return bytes(raw)


@given(data=st.data())
@settings(max_examples=80, **SETTINGS)
def test_damaged_file_is_refused_or_read_correctly(run_files, data):
    """open_run raises RunFileError naming the file, or returns complete snapshots equal to the
    undamaged file's (checksums on every chunk turn a flipped bit into an error)."""
    _, done = run_files
    reference = open_run(done)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "damaged.nc"
        path.write_bytes(damaged(done.read_bytes(), data))
        try:
            ds = open_run(path)
        except RunFileError as exc:
            assert str(path) in str(exc) and "\n" not in str(exc)
            event("RunFileError" + (": HDF5 hung or crashed" if "HDF5 " in str(exc) else ""))
            return
    event(f"read: {ds.sizes['time']} of {reference.sizes['time']} snapshots")
    index = np.searchsorted(reference.time.values, ds.time.values)
    np.testing.assert_array_equal(reference.time.values[index], ds.time.values)
    for name in reference.data_vars:
        np.testing.assert_array_equal(ds[name].values, reference[name].isel(time=index).values
                                      if "time" in reference[name].dims else reference[name].values)
    fixed = {k: str(v) for k, v in reference.attrs.items() if k not in RUN_END_ATTRS}
    if "warning" in ds.attrs:  # run-end attributes damaged: dropped, and the run not complete
        event("run-end attributes dropped")
        assert ds.attrs["complete"] == 0 and not set(RUN_END_ATTRS[1:]) & set(ds.attrs)
        assert {k: str(v) for k, v in ds.attrs.items() if k not in ("complete", "warning")} == fixed
    else:
        assert {k: str(v) for k, v in ds.attrs.items()} == {k: str(v) for k, v in reference.attrs.items()}


def test_metadata_changed_behind_the_writer(run_files, tmp_path):
    """HDF5 checks no attribute: the file's digests do. A config edited (or damaged) after the
    run is refused; a run-end attribute that does not match is dropped and the run reported as
    not complete, so that --resume recomputes it."""
    import netCDF4

    _, done = run_files
    edited, ended = tmp_path / "edited.nc", tmp_path / "ended.nc"
    edited.write_bytes(done.read_bytes())
    ended.write_bytes(done.read_bytes())
    with netCDF4.Dataset(edited, "a") as nc:
        nc.setncattr("config", nc.getncattr("config").replace('"beta": 10.0', '"beta": 30.0'))
    with pytest.raises(RunFileError, match="do not match their checksum layout_digest"):
        open_run(edited)
    with netCDF4.Dataset(ended, "a") as nc:
        nc.setncattr("C0", 1.0)
    ds = open_run(ended)
    assert ds.attrs["complete"] == 0 and "C0" not in ds.attrs and "checksum" in ds.attrs["warning"]



@pytest.mark.parametrize("damage", ["snapshot served at another index", "rewritten series",
                                    "finished run missing a snapshot", "particle array"])
def test_values_that_do_not_match_their_time_index_are_refused(run_files, tmp_path, damage):
    """What a damaged chunk index does (measured: one flipped bit served a snapshot's chunk at
    another time index, and left another unread), done here through HDF5 itself, so that every
    chunk checksum is valid: only the snapshot digests can see it."""
    import netCDF4

    _, done = run_files
    path = tmp_path / "moved.nc"
    path.write_bytes(done.read_bytes())
    with netCDF4.Dataset(path, "a") as nc:
        if damage == "snapshot served at another index":
            nc.variables["density"][3, :] = nc.variables["density"][2, :]
            expected = "snapshot 3 does not match its checksum snapshot_digest"
        elif damage == "rewritten series":
            nc.variables["lower_bound_paper"][1] = nc.variables["lower_bound_paper"][2]
            expected = "series_digest"
        elif damage == "finished run missing a snapshot":
            nc.variables["snapshot_complete"][2] = 0
            expected = "snapshot 2 is not marked written"
        else:
            nc.variables["positions"][1, 0, :] = nc.variables["positions"][0, 0, :]
            expected = "snapshot 1 does not match"
    with pytest.raises(RunFileError, match=expected):
        open_run(path)

@pytest.mark.parametrize("damage", ["empty", "text", "half", "flipped density", "foreign netcdf"])
def test_plot_and_resume_of_damaged_files_exit_2(run_files, tmp_path, capsys, damage):
    cfg, done = run_files
    raw = done.read_bytes()
    path = tmp_path / "bad.nc"
    if damage == "foreign netcdf":
        import netCDF4

        with netCDF4.Dataset(path, "w") as nc:
            nc.createDimension("x", 3)
            nc.createVariable("y", "f8", ("x",))[:] = 1.0
    else:
        density1 = open_run(done).density.values[1].tobytes()
        at = raw.find(density1)
        assert at > 0
        bad = {"empty": b"", "text": b"not netcdf\n", "half": raw[: len(raw) // 2],
               "flipped density": raw[:at + 100] + bytes([raw[at + 100] ^ 4]) + raw[at + 101:]}[damage]
        path.write_bytes(bad)
    for args in (["plot", str(path), "-o", str(tmp_path)], ["run", str(cfg), "-o", str(path), "--resume"]):
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(path) in err[0], err


def test_resume_refuses_a_file_damaged_where_only_a_write_reads(run_files, tmp_path, capsys):
    """A flipped bit in the last bytes of an interrupted file, where HDF5 put the index of the
    global attributes when the interruption was simulated: the read-only checks of the resume
    point pass and the first write fails (found by the random test below: exit 4, "writing
    snapshot 2 failed", with ample free space). Damage is exit 2 with one line naming the file,
    or a finished file equal to the uninterrupted run, never a write error."""
    import netCDF4

    cfg, done = run_files
    cut = tmp_path / "cut.nc"
    cut.write_bytes(done.read_bytes())
    with netCDF4.Dataset(cut, "a") as nc:  # interrupted after two snapshots
        nc.variables["snapshot_complete"][2:] = 0
        nc.setncattr("complete", 0)
    raw = cut.read_bytes()
    path = tmp_path / "damaged.nc"
    statuses = []
    for at in range(len(raw) - 16, len(raw), 2):
        path.write_bytes(raw[:at] + bytes([raw[at] ^ 1]) + raw[at + 1:])
        status = main(["run", str(cfg), "-o", str(path), "--resume"])
        err = capsys.readouterr().err.strip().splitlines()
        statuses.append(status)
        if status == 2:
            assert len(err) == 1 and str(path) in err[0], err
        else:
            assert status == 0 and run_difference(path, done) <= ROUND_OFF, (at, err)
    assert 2 in statuses


@given(data=st.data())
@settings(max_examples=10, deadline=None,  # capsys: each example reads (and so empties) it
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
def test_resume_of_a_damaged_interrupted_file(run_files, data, capsys):
    """--resume on a damaged copy of an interrupted run: exit 2 with one line, or a finished file
    equal to the uninterrupted run."""
    cfg, done = run_files
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "cut.nc"
        path.write_bytes(done.read_bytes())
        import netCDF4

        with netCDF4.Dataset(path, "a") as nc:  # interrupted after two snapshots
            nc.variables["snapshot_complete"][2:] = 0
            nc.setncattr("complete", 0)
        path.write_bytes(damaged(path.read_bytes(), data))
        status = main(["run", str(cfg), "-o", str(path), "--resume"])
        err = capsys.readouterr().err.strip().splitlines()
        if status == 2:
            assert len(err) == 1
            event("exit 2")
            return
        event("resumed")
        assert status == 0 and run_difference(path, done) <= ROUND_OFF
