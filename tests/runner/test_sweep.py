"""Parameter sweeps (spherepde.runner.sweep, `spherepde sweep`): the expansion (order, ids, seeds,
labels), bad sweep files (exit 2, one line, nothing written), a LocalCluster of 2 workers whose
files equal serial runs, the combined dataset, re-runs (complete runs skipped, another config
refused), and a sweep on a given scheduler with a failing run, a replaced and a resumed file."""

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
from run_helpers import ROUND_OFF, relative_difference

from spherepde.cli import main
from spherepde.runner.run import execute
from spherepde.runner.sweep import (
    SweepError,
    derived_seed,
    expand,
    local_cluster,
    plan,
    run_sweep,
)
from spherepde.storage.runfile import open_run

SOLVERS = Path(__file__).parents[2] / "solvers"

MATRICES = """
V = [[-1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, -2.0]]
B = [[-1.0, 0.0, 0.0], [0.0, -1.0, 0.0], [0.0, 0.0, 1.0]]
"""

# four runs of a fraction of a second: nside 2, t ≤ 0.5, 20 token particles
TINY = f"""
[sweep]
name = "t"
seed = 7

[base.model]
{MATRICES}
[base.eulerian]
nside = 2

[base.time]
t_end = 0.5
save_every = 0.25

[base.particles]
n = 20
dt = 0.05

[sweep.grid]
"model.beta" = [3.0, "inf"]
"initial" = [
    {{label = "uniform", kind = "uniform"}},
    {{label = "vmf", kind = "vmf", mu = [0.6, 0.0, 0.8], kappa = 3.0}},
]
"""


def write(folder, text, name="sweep.toml"):
    path = Path(folder) / name
    path.write_text(text)
    return path


# ------------------------------------------------------------------ expansion
def test_expansion_order_ids_seeds_labels(tmp_path):
    path = write(tmp_path, TINY)
    specs = expand(path, tmp_path / "out")
    assert [s.run_id for s in specs] == ["t-0000", "t-0001", "t-0002", "t-0003"]
    assert [s.index for s in specs] == [0, 1, 2, 3]
    # the cartesian product in the order written: the last key varies fastest
    assert [s.params for s in specs] == [
        {"model.beta": 3.0, "initial": "uniform"}, {"model.beta": 3.0, "initial": "vmf"},
        {"model.beta": "inf", "initial": "uniform"}, {"model.beta": "inf", "initial": "vmf"}]
    assert [s.config["model"]["beta"] for s in specs] == [3.0, 3.0, "inf", "inf"]
    # the label names the case and is not part of the run config
    assert specs[1].config["initial"] == {"kind": "vmf", "mu": [0.6, 0.0, 0.8], "kappa": 3.0}
    assert specs[0].config["initial"] == {"kind": "uniform"}
    assert [s.path for s in specs] == [tmp_path / "out" / f"t-000{i}.nc" for i in range(4)]
    # seeds: child i of SeedSequence(7), as spawn numbers them, distinct
    children = np.random.SeedSequence(7).spawn(4)
    seeds = [s.config["particles"]["seed"] for s in specs]
    assert seeds == [int(c.generate_state(1, np.uint64)[0] >> np.uint64(1)) for c in children]
    assert seeds == [derived_seed(7, i) for i in range(4)] and len(set(seeds)) == 4
    # deterministic: the same file expands to the same runs and hashes
    again = expand(path, tmp_path / "out")
    assert again == specs and [s.param_hash for s in again] == [s.param_hash for s in specs]
    assert len({s.param_hash for s in specs}) == 4
    # the default output directory is results/<name>/
    assert expand(path)[0].path == Path("results") / "t" / "t-0000.nc"


def test_grid_seed_is_kept(tmp_path):
    text = TINY.replace('"model.beta" = [3.0, "inf"]', '"particles.seed" = [5, 6]').replace(
        "[base.model]", "[base.model]\nbeta = 3.0")
    assert [s.config["particles"]["seed"] for s in expand(write(tmp_path, text))] == [5, 5, 6, 6]


def test_example_sweeps_expand():
    specs = expand(SOLVERS / "sweeps" / "beta_phase.toml")
    betas = [s.config["model"]["beta"] for s in specs]
    assert len(specs) == 12 and betas[0] == 3.0 and betas[-1] == 3000.0
    assert np.allclose(np.diff(np.log(betas)), math.log(1000) / 11, rtol=0.02)  # log-spaced
    quick = {"B": [[-1.0, 0, 0], [0, -1.0, 0], [0, 0, 1.0]], "V": [[-1.0, 0, 0], [0, 1.0, 0], [0, 0, -2.0]]}
    for s in specs:
        assert {k: s.config["model"][k] for k in "BV"} == quick
        assert s.config["initial"] == {"kind": "uniform"} and s.config["eulerian"]["nside"] == 16
        assert (s.config["time"]["t_end"], s.config["time"]["save_every"]) == (20.0, 0.5)
    assert len(expand(SOLVERS / "sweeps" / "tiny.toml")) == 6


# ------------------------------------------------------------------ bad sweep files
BASE = f"""
[base.model]
beta = 3.0
{MATRICES}
[base.eulerian]
nside = 2

[base.time]
t_end = 0.5
save_every = 0.25
"""

BAD = {
    "unknown sweep key": ('[sweep]\nname = "x"\ncolour = 1\n[sweep.grid]\n"model.beta" = [3.0]\n' + BASE,
                          "[sweep] colour: unknown key"),
    "empty grid": ('[sweep]\nname = "x"\n[sweep.grid]\n' + BASE, "[sweep.grid]: required"),
    "no grid": ('[sweep]\nname = "x"\n' + BASE, "[sweep.grid]: required"),
    "empty values": ('[sweep]\nname = "x"\n[sweep.grid]\n"model.beta" = []\n' + BASE, "non-empty list"),
    "missing base": ('[sweep]\nname = "x"\n[sweep.grid]\n"model.beta" = [3.0]\n', "[sweep] base: give exactly one"),
    "two bases": ('[sweep]\nname = "x"\nbase = "q.toml"\n[sweep.grid]\n"model.beta" = [3.0]\n' + BASE,
                  "[sweep] base: give exactly one"),
    "base file missing": ('[sweep]\nname = "x"\nbase = "nope.toml"\n[sweep.grid]\n"model.beta" = [3.0]\n',
                          "nope.toml: cannot read"),
    "bad grid value": ('[sweep]\nname = "x"\n[sweep.grid]\n"model.beta" = [3.0, -1.0]\n' + BASE,
                       '[sweep.grid] "model.beta" = -1.0: [model] beta: must be > 0'),
    "bad table value": ('[sweep]\nname = "x"\n[sweep.grid]\n"initial" = [{label = "flat", kind = "uniform"}, '
                        '{label = "bad", kind = "vmf", mu = [0.0, 0.0, 0.0], kappa = 1.0}]\n' + BASE,
                        '[sweep.grid] "initial" = label "bad": [initial] mu: must be a non-zero vector'),
    "missing label": ('[sweep]\nname = "x"\n[sweep.grid]\n"initial" = [{kind = "uniform"}]\n' + BASE,
                      "needs a label"),
    "label twice": ('[sweep]\nname = "x"\n[sweep.grid]\n"initial" = [{label = "a", kind = "uniform"}, '
                    '{label = "a", kind = "uniform"}]\n' + BASE, 'label "a" used twice'),
    "unquoted dotted key": ('[sweep]\nname = "x"\n[sweep.grid]\nmodel.beta = [3.0]\n' + BASE, "quote dotted keys"),
    "output key": ('[sweep]\nname = "x"\n[sweep.grid]\n"output.path" = ["a.nc"]\n' + BASE, "sets each run's output"),
    "unknown section": ('[sweep]\nname = "x"\n[sweep.grid]\n"solver.cfl" = [0.5]\n' + BASE, '"solver.cfl": must be'),
    "unknown run key": ('[sweep]\nname = "x"\n[sweep.grid]\n"model.betta" = [3.0]\n' + BASE,
                        '"model.betta" = 3.0: [model] betta: unknown key'),
    "whole and dotted": ('[sweep]\nname = "x"\n[sweep.grid]\n"initial" = [{label = "u", kind = "uniform"}]\n'
                         '"initial.kind" = ["uniform"]\n' + BASE, "conflicts with"),
    "bad name": ('[sweep]\nname = "a/b"\n[sweep.grid]\n"model.beta" = [3.0]\n' + BASE, "[sweep] name"),
    "bad seed": ('[sweep]\nname = "x"\nseed = -1\n[sweep.grid]\n"model.beta" = [3.0]\n' + BASE, "[sweep] seed"),
    "unknown table": ('[sweep]\nname = "x"\n[sweep.grid]\n"model.beta" = [3.0]\n[extra]\na = 1\n' + BASE,
                      "[extra]: unknown table"),
    "malformed": ('[sweep\nname = "x"\n', "malformed TOML"),
    "combination": ('[sweep]\nname = "x"\n[sweep.grid]\n"time.t_end" = [1.0, 0.1]\n' + BASE,
                    "run x-0001 (time.t_end = 0.1): [time] save_every: must be <= t_end"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_sweep_file_exits_2(case, tmp_path, capsys):
    text, fragment = BAD[case]
    path = write(tmp_path, text)
    out = tmp_path / "out"
    assert main(["sweep", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert fragment in err and "Traceback" not in err
    assert not out.exists()  # nothing written


def test_workers_with_scheduler_exits_2(tmp_path, capsys):
    path = write(tmp_path, TINY)
    assert main(["sweep", str(path), "--scheduler", "tcp://127.0.0.1:1", "--workers", "2"]) == 2
    assert "--workers" in capsys.readouterr().err


def test_refused_in_a_child_process(tmp_path, monkeypatch):
    """A spawned process (a script without the __main__ guard, re-imported) starts no cluster."""
    import multiprocessing

    class Child:
        name = "Process-1"

    monkeypatch.setattr(multiprocessing, "current_process", lambda: Child())
    with pytest.raises(SweepError, match="__name__"):
        run_sweep(write(tmp_path, TINY), out_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("setting", ["workers", "threads_per_run"])
def test_shared_cluster_refuses_bad_sizes_before_starting(setting):
    with pytest.raises(SweepError, match=setting):
        with local_cluster(**{setting: 0}):
            pass


# ------------------------------------------------------------------ on a LocalCluster
@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """The TINY sweep run once on a LocalCluster of 2 workers."""
    folder = tmp_path_factory.mktemp("sweep")
    path = write(folder, TINY)
    out = folder / "out"
    lines = []
    combined = run_sweep(path, out_dir=out, workers=2, progress=False, log=lines.append, verbose=True)
    return {"path": path, "out": out, "combined": combined, "lines": lines, "specs": expand(path, out)}


def test_cluster_runs_equal_serial_runs(swept, tmp_path):
    assert any("LocalCluster of 2 worker processes" in line for line in swept["lines"])
    for spec in swept["specs"]:
        serial = tmp_path / f"{spec.run_id}.nc"
        execute(spec.config, serial, progress=False, log=None)
        a, b = open_run(spec.path), open_run(serial)
        assert a.attrs["complete"] == 1
        assert a.density.shape == b.density.shape
        assert relative_difference(a.density.values, b.density.values) <= ROUND_OFF, spec.run_id
        assert relative_difference(a.positions.values, b.positions.values) <= ROUND_OFF, spec.run_id
        # the derived seed is recorded in the run's config
        assert json.loads(a.attrs["config"])["particles"]["seed"] == derived_seed(7, spec.index)


def test_combined_dataset(swept):
    assert swept["combined"] == swept["out"] / "t.nc"
    ds = xr.open_dataset(swept["combined"])
    assert ds.sizes["run"] == 4 and list(ds.run.values) == [0, 1, 2, 3]
    assert list(ds.run_id.values) == ["t-0000", "t-0001", "t-0002", "t-0003"]
    assert ds.model_beta.dtype == float and list(ds.model_beta.values) == [3.0, 3.0, math.inf, math.inf]
    assert list(ds.initial.values) == ["uniform", "vmf", "uniform", "vmf"]
    assert list(ds.param_hash.values) == [s.param_hash for s in swept["specs"]]
    assert "density" not in ds and "positions" not in ds and "snapshot_complete" not in ds
    assert ds.alignment_E.dims == ("run", "time") and ds.particle_alignment_E.dims == ("run", "time")
    assert list(ds.time.values) == [0.0, 0.25, 0.5]
    for spec in swept["specs"]:
        run = open_run(spec.path)
        for name in ("alignment_E", "alignment_F", "mass", "w2_to_projection"):
            np.testing.assert_array_equal(ds[name].sel(run=spec.index).values, run[name].values)
        assert json.loads(str(ds.run_config.sel(run=spec.index).values))["model"] == spec.config["model"]
        # each run's own times and record, for readers of the combined file alone
        np.testing.assert_array_equal(ds.snapshot_kind.sel(run=spec.index).values, run.snapshot_kind.values)
        assert int(ds.run_complete.sel(run=spec.index)) == run.attrs["complete"] == 1
        assert float(ds.run_wall_seconds.sel(run=spec.index)) == run.attrs["wall_seconds"]
    assert json.loads(ds.attrs["failed_runs"]) == [] and ds.attrs["sweep_name"] == "t"
    # the phase-diagram layout: one dimension per swept key
    grid = ds.set_index(run=["model_beta", "initial"]).unstack("run")
    assert grid.alignment_E.sizes == {"time": 3, "model_beta": 2, "initial": 2}


def test_whole_table_key_named_like_a_dimension(swept, tmp_path):
    """A swept [time] table is labelled by the coordinate time_label, not the time axis."""
    from spherepde.runner.sweep import combine

    specs = [s._replace(params={"time": f"case{s.index}", "model.beta": s.params["model.beta"]})
             for s in swept["specs"]]
    ds = xr.open_dataset(combine(specs, tmp_path / "c.nc", "t"))
    assert list(ds.time_label.values) == ["case0", "case1", "case2", "case3"]
    assert list(ds.time.values) == [0.0, 0.25, 0.5] and ds.model_beta.dims == ("run",)


def test_rerun_skips_complete_runs(swept):
    """A repeated sweep with its combined file current touches nothing (not even the combined
    file); once a run file is newer than the combined file, the runs are checked one by one,
    skipped as complete, and combined again."""
    mtimes = {s.run_id: s.path.stat().st_mtime_ns for s in swept["specs"]}
    combined = swept["combined"]
    written = combined.stat().st_mtime_ns
    lines = []
    assert run_sweep(swept["path"], out_dir=swept["out"], workers=2, progress=False, log=lines.append,
                     verbose=True) == combined
    assert len(lines) == 1 and "4 of 4 runs complete, combined file up to date" in lines[0]
    assert combined.stat().st_mtime_ns == written
    os.utime(swept["specs"][2].path)  # a run file changed after the combined file was written
    lines.clear()
    run_sweep(swept["path"], out_dir=swept["out"], workers=2, progress=False, log=lines.append, verbose=True)
    assert sum("complete, skipped" in line for line in lines) == 4
    assert "(4 complete, 0 to continue, 0 to start)" in lines[0]
    assert not any("started in" in line for line in lines)  # no cluster for nothing to do
    assert combined.stat().st_mtime_ns > written
    mtimes[swept["specs"][2].run_id] = swept["specs"][2].path.stat().st_mtime_ns
    assert {s.run_id: s.path.stat().st_mtime_ns for s in swept["specs"]} == mtimes


def test_combined_is_current_only_for_the_same_runs(swept):
    from spherepde.runner.sweep import combined_is_current

    specs, combined = swept["specs"], swept["combined"]
    assert combined_is_current(combined, specs)
    assert not combined_is_current(combined, specs[:3])  # another set of runs
    other = [specs[0]._replace(config=dict(specs[0].config, time={**specs[0].config["time"], "t_end": 9.0}))]
    assert not combined_is_current(combined, other + specs[1:])  # another config
    assert not combined_is_current(combined.with_name("missing.nc"), specs)


def test_changed_grid_is_refused(swept, capsys):
    """The same run ids with another meaning: refused, naming the run, nothing touched."""
    changed = write(swept["path"].parent, TINY.replace('[3.0, "inf"]', "[3.0, 10.0]"), "changed.toml")
    mtimes = {s.run_id: s.path.stat().st_mtime_ns for s in swept["specs"]}
    assert main(["sweep", str(changed), "--out", str(swept["out"])]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "run t-0002" in err and "[model] beta: 'inf' in the file, 10.0 now" in err and "--overwrite" in err
    assert {s.run_id: s.path.stat().st_mtime_ns for s in swept["specs"]} == mtimes


def test_unreadable_run_file_is_refused(tmp_path, capsys):
    path = write(tmp_path, TINY)
    out = tmp_path / "out"
    out.mkdir()
    (out / "t-0001.nc").write_bytes(b"not a netCDF file")
    assert main(["sweep", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "run t-0001: cannot be checked" in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in out.iterdir()) == ["t-0001.nc"]


# ------------------------------------------------------------------ failures, replace, resume
class _StopAfterFirstSnapshot:
    """A snapshot log that interrupts the run once its first snapshot is on disk."""

    def write(self, text):
        raise KeyboardInterrupt

    def flush(self):
        pass


def test_failed_run_replaced_and_resumed_files(tmp_path, capsys):
    """On a running scheduler (--scheduler): a run whose guard fires is reported and the others
    finish (exit 1, combined file of the others); a file of another config is replaced with
    --overwrite; an interrupted file is continued and ends equal to a serial run."""
    from distributed import LocalCluster

    text = ('[sweep]\nname = "f"\n[sweep.grid]\n"model.beta" = [10.0, 30.0]\n"guards.dt_floor" = [1e-12, 1e3]\n'
            + BASE.replace("beta = 3.0\n", ""))
    path = write(tmp_path, text)
    out = tmp_path / "out"
    specs = expand(path, out)
    out.mkdir()
    interrupted = specs[2]  # β = 30, healthy (dt_floor 1e3 stops the others at their first step)
    with pytest.raises(KeyboardInterrupt):
        execute(interrupted.config, interrupted.path, progress=False, log=None, snapshot_log=_StopAfterFirstSnapshot())
    other = json.loads(json.dumps(specs[0].config))
    other["model"]["beta"] = 3.0
    with pytest.raises(KeyboardInterrupt):
        execute(other, specs[0].path, progress=False, log=None, snapshot_log=_StopAfterFirstSnapshot())
    with pytest.raises(SweepError, match="run f-0000"):
        plan(specs)
    assert plan(specs, overwrite=True) == ["replace", "start", "resume", "start"]

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address="127.0.0.1:0") as cluster:
        rc = main(["sweep", str(path), "--out", str(out), "--scheduler", cluster.scheduler_address,
                   "--overwrite", "-v"])
    captured = capsys.readouterr()
    assert rc == 1, captured
    assert "1 to continue, 3 to start, 1 replacing a file" in captured.out
    for run_id in ("f-0001", "f-0003"):
        assert f"run {run_id} failed" in captured.out and "a guard stopped the run" in captured.out
    assert "2 of 4 runs complete, 2 failed" in captured.out
    ds = xr.open_dataset(out / "f.nc")
    assert list(ds.run_id.values) == ["f-0000", "f-0002"]
    assert [f["run_id"] for f in json.loads(ds.attrs["failed_runs"])] == ["f-0001", "f-0003"]
    assert list(ds.guards_dt_floor.values) == [1e-12, 1e-12]
    assert open_run(specs[1].path).attrs["failure"]  # the failed run keeps its state at failure
    assert json.loads(open_run(specs[0].path).attrs["config"])["model"]["beta"] == 10.0  # replaced
    resumed = open_run(interrupted.path)
    assert "resumed from snapshot 0" in resumed.attrs["history"] and resumed.attrs["complete"] == 1
    serial = tmp_path / "serial.nc"
    execute(interrupted.config, serial, progress=False, log=None)
    assert relative_difference(resumed.density.values, open_run(serial).density.values) <= ROUND_OFF
