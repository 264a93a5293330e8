"""Parameter sweeps: a grid of run configs, run as tasks on dask.distributed, combined into one
dataset along a `run` dimension.

A sweep file (TOML) names a base run config and a grid of values:

    [sweep]
    name = "beta_phase"             # run ids <name>-<index:04d>; default output dir results/<name>/
    base = "../quickstart.toml"     # a run config, relative to the sweep file; OR inline [base.model], ...
    seed = 1                        # optional (default 0): base of the per-run particle seeds

    [sweep.grid]                    # cartesian product, in the order written (the last key varies fastest)
    "model.beta" = [3.0, 10.0, "inf"]
    "initial" = [{label = "uniform", kind = "uniform"}, {label = "vmf", kind = "vmf", mu = [0, 0, 1], kappa = 4.0}]

A key "section.key" sets one value of the run config; a key that is a section name replaces that
whole table, and each of its values carries a `label` (removed before the config is resolved)
that names the case. Every expanded config is resolved (spherepde.runner.config.resolve) before anything
runs; any problem raises SweepError, one line naming the sweep key and value.

Each run writes `OUT/<run id>.nc` with spherepde.runner.run.execute, one task and one file per run (HDF5
is not thread-safe). A complete file whose stored config equals the run's is skipped, an
incomplete one is continued (execute(..., resume=True)), one with another config is refused
unless overwrite. The runs' per-snapshot diagnostics are then combined into `OUT/<name>.nc`.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import itertools
import json
import math
import multiprocessing
import os
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import NamedTuple

from .config import DEFAULTS, ConfigError, difference, load, resolve
from .toml_text import toml_short

__all__ = ["RunSpec", "SweepError", "SweepFailure", "expand", "plan", "run_sweep", "run_one", "combine", "combined_is_current",
           "derived_seed", "local_cluster", "base_config", "MAX_RUNS"]

MAX_RUNS = 10_000  # run ids carry four digits
SWEEP_KEYS = ("name", "base", "seed", "grid")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\Z")  # a file name: no separators, no leading dot
WARM_UP_TIME = 1e-3  # simulated time of a warm-up run: one step
# per-time variables of a run file that are bookkeeping, not diagnostics (open_run has used them;
# a snapshot's digest checks its own file only, and integer markers cannot hold the NaN of a
# time that one run lacks: combine writes snapshot_kind again, as a float)
MARKERS = ("snapshot_complete", "snapshot_kind", "snapshot_digest")


class SweepError(ValueError):
    """A bad sweep file, or existing outputs that do not fit it; raised before anything runs."""


class SweepFailure(RuntimeError):
    """Some runs failed (the others finished): failures is a list of (run id, reason), combined
    the path of the combined dataset of the runs that succeeded (None if none did)."""

    def __init__(self, failures, combined):
        self.failures, self.combined = list(failures), combined
        super().__init__(f"{len(self.failures)} run(s) failed: " + ", ".join(r for r, _ in self.failures))


class RunSpec(NamedTuple):
    """One run of a sweep: its id, its place in the expansion, the swept values (the label for a
    whole-table key) and the resolved run config ([output] path = `OUT/<run id>.nc`)."""

    run_id: str
    index: int
    params: dict
    config: dict

    @property
    def param_hash(self) -> str:
        """A short stable hash of the swept values (recorded in the combined dataset)."""
        text = json.dumps(self.params, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    @property
    def path(self) -> Path:
        return Path(self.config["output"]["path"])


def derived_seed(sweep_seed: int, index: int) -> int:
    """particles.seed of run `index`: the state of child `index` of SeedSequence(sweep_seed), as
    SeedSequence.spawn numbers them, so runs draw independent streams. 63 bits: an int64 anywhere."""
    import numpy as np

    state = np.random.SeedSequence(sweep_seed, spawn_key=(index,)).generate_state(1, np.uint64)[0]
    return int(state >> np.uint64(1))


# ------------------------------------------------------------------ the sweep file
class _Sweep(NamedTuple):
    """A checked sweep file: name, base config (raw TOML data), seed, grid [(key, values)]."""

    name: str
    base: dict
    seed: int
    grid: list


def _read(path) -> _Sweep:
    try:
        doc = load(path)
    except ConfigError as exc:
        raise SweepError(f"sweep file {exc}") from None
    for key in doc:
        if key not in ("sweep", "base"):
            raise SweepError(f"[{key}]: unknown table in a sweep file (allowed: [sweep], [sweep.grid], [base.*])")
    sweep = doc.get("sweep")
    if not isinstance(sweep, dict):
        raise SweepError(f"{path}: no [sweep] table")
    for key in sweep:
        if key not in SWEEP_KEYS:
            raise SweepError(f"[sweep] {key}: unknown key (allowed: {', '.join(SWEEP_KEYS)})")
    name = sweep.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise SweepError(f"[sweep] name: must be a file name of letters, digits, '_', '-', '.', got {toml_short(name)}")
    seed = sweep.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise SweepError(f"[sweep] seed: must be an integer >= 0, got {toml_short(seed)}")
    return _Sweep(name, base_config(path, sweep, doc), seed, _grid(sweep.get("grid")))


def base_config(path, sweep, doc) -> dict:
    """The base run config of the sweep file at path (doc: its tables, sweep: its [sweep] table):
    the file [sweep] base names, or the inline [base.*] tables. Raises SweepError."""
    if ("base" in sweep) == ("base" in doc):
        raise SweepError("[sweep] base: give exactly one of base = \"CONFIG.toml\" in [sweep] or inline "
                         "tables [base.model], [base.initial], ...")
    if "base" in doc:
        if not isinstance(doc["base"], dict):
            raise SweepError("[base]: must hold the run config's tables ([base.model], ...)")
        return doc["base"]
    base = sweep["base"]
    if not isinstance(base, str) or not base.strip():
        raise SweepError(f"[sweep] base: must be the path of a run config (relative to the sweep file), "
                         f"got {toml_short(base)}")
    try:
        return load(Path(path).parent / base)
    except ConfigError as exc:
        raise SweepError(f"[sweep] base: {exc}") from None


def _grid(grid) -> list:
    if not isinstance(grid, dict) or not grid:
        raise SweepError("[sweep.grid]: required, a table of at least one key = [values]")
    sections = set(DEFAULTS) - {"output"}
    out = []
    for key, values in grid.items():
        where = f'[sweep.grid] "{key}"'
        if isinstance(values, dict):  # model.beta = [...] written without quotes: a nested table
            raise SweepError(f'{where}: must be a list of values; quote dotted keys ("{key}.KEY" = [...])')
        section, dot, name = key.partition(".")
        if section == "output":
            raise SweepError(f"{where}: the sweep sets each run's output (OUT/<run id>.nc)")
        if section not in sections or (dot and (not name or "." in name)):
            raise SweepError(f'{where}: must be "section.key" or a section name '
                             f'(sections: {", ".join(sorted(sections))})')
        if not isinstance(values, list) or not values:
            raise SweepError(f"{where}: must be a non-empty list of values, got {toml_short(values)}")
        if not dot:
            _check_labels(where, values)
        out.append((key, values))
    whole = {k for k, _ in out if "." not in k}
    for key, _ in out:
        if "." in key and key.partition(".")[0] in whole:
            raise SweepError(f'[sweep.grid] "{key}": conflicts with "{key.partition(".")[0]}", which replaces '
                             "that whole table")
    runs = math.prod(len(v) for _, v in out)
    if runs > MAX_RUNS:
        raise SweepError(f"[sweep.grid]: {runs} runs, at most {MAX_RUNS} are supported")
    return out


def _check_labels(where, values):
    labels = set()
    for value in values:
        if not isinstance(value, dict):
            raise SweepError(f"{where}: a whole-table key takes tables with a label, got {toml_short(value)}")
        label = value.get("label")
        if not isinstance(label, str) or not label.strip():
            raise SweepError(f"{where}: every table needs a label = \"...\" naming the case, got {toml_short(value)}")
        if label in labels:
            raise SweepError(f'{where}: label "{label}" used twice')
        labels.add(label)


def _blame(message, params) -> str | None:
    """The swept key a ConfigError message is about ("[model] beta: ..." → "model.beta"), if any."""
    for key in params:
        section, _, name = key.partition(".")
        if name:
            hit = (message.startswith(f"[{section}] {name}:") or message.startswith(f"[{section}] {name}[")
                   or message.startswith(f"[{section}.{name}"))
        else:
            hit = message.startswith(f"[{section}]") or message.startswith(f"[{section}.")
        if hit:
            return key
    return None


def expand(path, out_dir=None) -> list[RunSpec]:
    """The runs of a sweep file, in expansion order (the last grid key varies fastest).

    Args:
        path: the sweep file (TOML: [sweep] name, base, seed, [sweep.grid]; module docstring).
        out_dir: where the run files go (default `results/<name>/`).

    Returns:
        One RunSpec per run: its id `<name>-<index:04d>`, the swept values, and its resolved
        config, whose [output] path is `out_dir/<run id>.nc` (`spec.path`). Nothing is run or
        written: `spherepde.runner.run.execute(spec.config, spec.path)` runs one.

    Raises:
        SweepError: the first problem of the sweep file or of an expanded config, in one line
            that names the sweep key and value.
    """
    return _expand(path, out_dir)[1]


def _expand(path, out_dir):
    """(the checked sweep file, its RunSpecs)."""
    sweep = _read(path)
    out = Path(out_dir) if out_dir is not None else Path("results") / sweep.name
    keys = [k for k, _ in sweep.grid]
    # a seed the grid sets is the user's; otherwise each run gets its own derived seed
    seed_swept = "particles.seed" in keys or any(
        "seed" in v for k, values in sweep.grid if k == "particles" for v in values)
    specs = []
    for index, combo in enumerate(itertools.product(*(v for _, v in sweep.grid))):
        run_id = f"{sweep.name}-{index:04d}"
        raw = copy.deepcopy(sweep.base)
        params = {}
        for key, value in zip(keys, combo):
            section, _, name = key.partition(".")
            if name:
                table = raw.setdefault(section, {})
                if not isinstance(table, dict):
                    raise SweepError(f"[sweep] base: [{section}] is not a table")
                table[name] = copy.deepcopy(value)
                params[key] = value
            else:
                raw[section] = {k: copy.deepcopy(v) for k, v in value.items() if k != "label"}
                params[key] = value["label"]
        if isinstance(raw.get("particles"), dict) and not seed_swept:
            raw["particles"]["seed"] = derived_seed(sweep.seed, index)
        raw["output"] = {"path": str(out / f"{run_id}.nc")}
        try:
            config = resolve(raw)
        except ConfigError as exc:
            key = _blame(str(exc), params)
            if key is not None:
                value = combo[keys.index(key)]
                shown = f'label "{params[key]}"' if "." not in key else toml_short(value)
                raise SweepError(f'[sweep.grid] "{key}" = {shown}: {exc}') from None
            where = ", ".join(f"{k} = {toml_short(params[k])}" for k in keys)
            raise SweepError(f"run {run_id} ({where}): {exc}") from None
        specs.append(RunSpec(run_id, index, params, config))
    return sweep, specs


# ------------------------------------------------------------------ existing run files
def plan(specs, overwrite=False) -> list[str]:
    """What each run needs, from its file: "skip" (complete), "resume" (interrupted, continued
    from its last complete snapshot), "start" (no file, or a file holding no snapshot yet) or
    "replace" (another config or an unreadable file, with overwrite). Raises SweepError, naming
    the run, for a file that does not fit its run (without overwrite). Reads only."""
    from ..storage.runfile import RunFileError, open_run

    actions = []
    for spec in specs:
        path = spec.path
        if not path.exists():
            actions.append("start")
            continue
        if path.is_dir():
            raise SweepError(f"run {spec.run_id}: {path} is a directory")
        try:
            ds = open_run(path)
            stored = json.loads(ds.attrs["config"])
        except (RunFileError, KeyError, ValueError) as exc:
            if overwrite:
                actions.append("replace")
                continue
            raise SweepError(f"run {spec.run_id}: cannot be checked ({exc}); --overwrite replaces the file") from None
        diff = difference(stored, json.loads(json.dumps(spec.config)))
        if diff is not None:
            if overwrite:
                actions.append("replace")
                continue
            raise SweepError(f"run {spec.run_id}: {path} holds another config ({diff}): the sweep changed what "
                             f"run {spec.index} is; use --overwrite to replace it, or another --out")
        if int(ds.attrs.get("complete", 0)) == 1:
            actions.append("skip")
        elif ds.sizes["time"] and ("snapshot_kind" not in ds or int(ds["snapshot_kind"].values[0]) == 0):
            actions.append("resume")
        else:
            actions.append("start")
    return actions


# ------------------------------------------------------------------ one task
def run_one(task: dict) -> dict:
    """One run, in a worker: execute(task["config"]) into its file, under the file's lock.
    task: run_id, config (its [output] path absolute), action ("start", "replace", "resume"),
    threads (numba threads). Never raises for a failed run: returns run_id, ok, reason, seconds,
    notes (and traceback for an unexpected error)."""
    from ..solvers.guards import RunFailure
    from ..storage.locking import LockError, output_lock
    from ..storage.runfile import RunFileError, WriteError
    from .run import execute

    _numba_threads(task.get("threads", 1))
    path = Path(task["config"]["output"]["path"])
    result = {"run_id": task["run_id"], "ok": False, "reason": "", "notes": [], "seconds": 0.0}
    clock = time.perf_counter()
    try:
        with output_lock(path, note=result["notes"].append):
            resume = task["action"] == "resume"
            if not resume and path.exists():
                path.unlink()
            execute(task["config"], path, progress=False, log=None, resume=resume)
        result["ok"] = True
    except RunFailure as exc:
        result["reason"] = f"a guard stopped the run: {exc}"
    except (WriteError, RunFileError, LockError) as exc:
        result["reason"] = str(exc)
    except Exception as exc:  # a bug: keep the traceback for -v
        result["reason"] = f"unexpected {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        result["traceback"] = traceback.format_exc()
    result["seconds"] = time.perf_counter() - clock
    return result


def _numba_threads(n):
    """At most n numba threads in this (task) thread; the pool size (NUMBA_NUM_THREADS) caps it."""
    import numba

    numba.set_num_threads(max(1, min(int(n), numba.config.NUMBA_NUM_THREADS)))


def warm_up(specs, log=None):
    """Compile (or load from numba's cache) every kernel the runs need, here, before any worker
    starts: several processes building the same numba cache files at once can crash (docs/running.md#parameter-sweeps).
    One short run per kind of run: β = ∞ or not, mesh, scheme, particles, noise; the smallest and the
    largest β of each kind, since the attention sum switches to the tree at large β."""
    from .run import execute

    kinds = {}
    for spec in specs:
        c = spec.config
        pt = c["particles"]
        noisy = c["model"].get("noise", 0.0) > 0  # the diffusion kernels
        kind = (c["model"]["beta"] == "inf", c["eulerian"]["nside"], c["eulerian"]["scheme"],
                c["eulerian"]["rk_order"], None if pt is None else (pt["mode"], pt["scheme"]), noisy)
        kinds.setdefault(kind, []).append(spec)
    def beta(spec):
        value = spec.config["model"]["beta"]
        return math.inf if value == "inf" else value

    chosen = {}
    for group in kinds.values():
        low, high = min(group, key=beta), max(group, key=beta)
        chosen.update({s.run_id: s for s in ((low,) if beta(low) == beta(high) else (low, high))})
    with tempfile.TemporaryDirectory(prefix="spherepde-warm-up-") as tmp:
        for spec in chosen.values():
            cfg = copy.deepcopy(spec.config)
            cfg["time"] = {"t_end": WARM_UP_TIME, "save_every": WARM_UP_TIME}
            cfg["guards"] = dict(DEFAULTS["guards"])  # a run's strict guard must not stop its warm-up
            if cfg["particles"]:
                cfg["particles"]["dt"] = min(cfg["particles"]["dt"], WARM_UP_TIME)
            path = Path(tmp) / f"{spec.run_id}.nc"
            cfg["output"]["path"] = str(path)
            try:
                execute(cfg, path, progress=False, log=None)
            except Exception as exc:  # the run itself will meet it and report it
                if log is not None:
                    log(f"  warm-up of {spec.run_id}: {type(exc).__name__}: {exc}")
    return len(chosen)


# ------------------------------------------------------------------ the cluster
def _refuse_in_worker():
    """A spawned process (a dask worker, or one importing the main script of its parent) must not
    start a cluster: that is what a script without `if __name__ == "__main__":` does."""
    if multiprocessing.current_process().name != "MainProcess":
        raise SweepError("run_sweep was called in a child process (a worker importing your script?): "
                         'put the call under `if __name__ == "__main__":`')


@contextlib.contextmanager
def _restored_environ():
    """The Nanny writes its pre-spawn environment into this process's os.environ: undo it."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        for key in set(os.environ) - set(saved):
            del os.environ[key]
        os.environ.update(saved)


@contextlib.contextmanager
def _connected(address):
    """A Client of the running scheduler at address."""
    from distributed import Client

    try:
        client = Client(address, timeout="20s")
    except (OSError, TimeoutError, ValueError) as exc:
        raise SweepError(f"--scheduler {address}: cannot connect ({type(exc).__name__}: {exc})") from None
    try:
        yield client
    finally:
        client.close()


@contextlib.contextmanager
def _local_cluster(workers, threads):
    """A Client of a LocalCluster of `workers` single-threaded processes, NUMBA_NUM_THREADS = threads."""
    import dask
    from distributed import Client, LocalCluster

    with _restored_environ():
        # numba reads NUMBA_NUM_THREADS when the worker imports it: set before the spawn. The
        # Nanny prefers a value in os.environ over the dask config, so both are set.
        os.environ["NUMBA_NUM_THREADS"] = str(threads)
        try:
            with dask.config.set({"distributed.nanny.pre-spawn-environ.NUMBA_NUM_THREADS": str(threads)}):
                # the dashboard on a free port of this host: None would still take 8787 (and warn
                # when another cluster has it)
                cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                                       dashboard_address="127.0.0.1:0")
        except RuntimeError as exc:
            raise SweepError(f"the local dask cluster did not start ({exc}); in a script, call run_sweep "
                             'under `if __name__ == "__main__":`') from None
        try:
            with Client(cluster) as client:
                yield client
        finally:
            cluster.close()


def _check_sizes(workers, threads_per_run):
    """SweepError naming the setting unless both are positive integers."""
    for name, value in (("workers", workers), ("threads_per_run", threads_per_run)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SweepError(f"{name}: must be a positive integer, got {value!r}")


@contextlib.contextmanager
def local_cluster(workers=2, threads_per_run=1):
    """One LocalCluster of `workers` processes for several run_sweep calls: yields its scheduler
    address, to pass as run_sweep(..., scheduler=address). Starting a cluster (spawning the
    workers, importing spherepde and loading its kernels) takes seconds; a script that runs many
    small sweeps pays it once. Call it under `if __name__ == "__main__":`, like run_sweep."""
    _refuse_in_worker()
    _check_sizes(workers, threads_per_run)
    with _local_cluster(workers, threads_per_run) as client:
        yield client.scheduler.address


def _describe(spec):
    return ", ".join(f"{k} = {toml_short(v)}" for k, v in spec.params.items())


def _run_on_dask(todo, client, threads, progress, total, emit, verbose):
    """Submit every (spec, action), collect as they finish; returns {run_id: result}."""
    from distributed import as_completed
    from tqdm import tqdm

    tasks = []
    for spec, action in todo:
        config = copy.deepcopy(spec.config)
        config["output"]["path"] = str(spec.path.absolute())  # a worker's cwd may differ
        tasks.append({"run_id": spec.run_id, "config": config, "action": action, "threads": threads})
    futures = client.map(run_one, tasks, pure=False)
    run_of = {f.key: spec for f, (spec, _) in zip(futures, todo)}
    results = {}
    bar = tqdm(total=total, initial=total - len(todo), unit="run", disable=not progress, file=sys.stderr)
    try:
        for future in as_completed(futures):
            spec = run_of[future.key]
            try:
                result = future.result()
            except Exception as exc:  # run_one does not raise: its worker died, or was lost
                result = {"run_id": spec.run_id, "ok": False, "notes": [], "seconds": math.nan,
                          "reason": f"its worker failed ({type(exc).__name__}: {exc})"}
            results[spec.run_id] = result
            bar.update(1)
            for note in result["notes"]:
                emit(f"  {spec.run_id}: note: {note}", bar)
            if not result["ok"]:
                emit(f"spherepde sweep: run {spec.run_id} failed ({_describe(spec)}): {result['reason']}", bar)
                if verbose and result.get("traceback"):
                    emit(result["traceback"].rstrip(), bar)
            elif verbose:
                emit(f"  run {spec.run_id} done in {result['seconds']:.1f} s ({_describe(spec)})", bar)
    except BaseException:  # Ctrl-C, SIGTERM: no new runs; the cluster is closed by the caller
        with contextlib.suppress(Exception):
            client.cancel(futures)
        raise
    finally:
        bar.close()
    return results


def run_sweep(path, out_dir=None, scheduler=None, workers=2, progress=None, overwrite=False,
              threads_per_run=1, log=print, verbose=False):
    """Run a sweep file on dask.distributed and combine the runs: what `spherepde sweep` does.

    Complete run files of the same config are skipped, interrupted ones continued, so a repeated
    call only runs what is missing. Call it under `if __name__ == "__main__":` (the local
    cluster spawns processes).

    Args:
        path: the sweep file.
        out_dir: where the run files and the combined file go (default `results/<name>/`).
        scheduler: address of a running dask scheduler (its workers need spherepde and out_dir);
            None: a LocalCluster of `workers` processes.
        workers: processes of the LocalCluster.
        progress: a tqdm bar over runs (default: when stderr is a terminal).
        overwrite: replace run files that hold another config (else SweepError).
        threads_per_run: numba threads of a run.
        log: called with each line of text (None: silent); verbose: a line per run.

    Returns:
        The path of the combined file `out_dir/<name>.nc` (`combine`).

    Raises:
        SweepError: before anything runs: a bad sweep file, or run files that do not fit it.
        SweepFailure: after the combined file is written, when some runs failed.
    """
    _refuse_in_worker()
    _check_sizes(workers, threads_per_run)
    log = log or (lambda text: None)
    sweep, specs = _expand(path, out_dir)
    name, out = sweep.name, specs[0].path.parent
    if combined_is_current(out / f"{name}.nc", specs):
        log(f"spherepde sweep {name}: {len(specs)} of {len(specs)} runs complete, combined file up to date → "
            f"{out / f'{name}.nc'}")
        return out / f"{name}.nc"
    actions = plan(specs, overwrite)
    todo = [(spec, action) for spec, action in zip(specs, actions) if action != "skip"]
    with contextlib.ExitStack() as stack:
        # a cluster that is already there is checked before anything is written
        client = stack.enter_context(_connected(scheduler)) if scheduler and todo else None
        _output_dir(out)
        counts = {a: actions.count(a) for a in ("skip", "resume", "start", "replace")}
        replacing = f", {counts['replace']} replacing a file" if counts["replace"] else ""
        log(f"spherepde sweep {name}: {len(specs)} runs → {out}/ ({counts['skip']} complete, {counts['resume']} "
            f"to continue, {counts['start'] + counts['replace']} to start{replacing})")
        if verbose:
            for spec, action in zip(specs, actions):
                if action == "skip":
                    log(f"  run {spec.run_id}: complete, skipped")
        results = {}
        if todo:
            clock = time.perf_counter()
            kinds = warm_up([spec for spec, _ in todo], log=log if verbose else None)
            if verbose:
                log(f"  numba kernels ready ({kinds} warm-up run(s), {time.perf_counter() - clock:.1f} s)")
            if client is None:
                clock = time.perf_counter()
                client = stack.enter_context(_local_cluster(workers, threads_per_run))
                if verbose:
                    log(f"  LocalCluster of {workers} worker processes × 1 thread ({threads_per_run} numba "
                        f"thread(s) each) started in {time.perf_counter() - clock:.1f} s")
            elif verbose:
                log(f"  on the scheduler at {scheduler}")

            def emit(text, bar):
                with bar.external_write_mode():
                    log(text)

            progress = sys.stderr.isatty() if progress is None else progress
            results = _run_on_dask(todo, client, threads_per_run, progress, len(specs), emit, verbose)
    failures = [(s.run_id, results[s.run_id]["reason"]) for s in specs
                if s.run_id in results and not results[s.run_id]["ok"]]
    failed = {run_id for run_id, _ in failures}
    done = [spec for spec in specs if spec.run_id not in failed]
    combined = None
    if done:
        try:
            combined = combine(done, out / f"{name}.nc", name, sweep_file=path, failures=failures)
        except (OSError, ValueError) as exc:  # RunFileError is a ValueError: a file damaged meanwhile
            failures.append((f"{name}.nc", f"the combined file was not written ({type(exc).__name__}: {exc})"))
            log(f"spherepde sweep: {failures[-1][1]}")
    failed_text = f", {len(failed)} failed" if failed else ""
    log(f"spherepde sweep {name}: {len(done)} of {len(specs)} runs complete{failed_text} → "
        f"{combined if combined else 'no combined file'}")
    if failures:
        raise SweepFailure(failures, combined)
    return combined


def combined_is_current(path, specs) -> bool:
    """Whether the combined file at path already holds exactly these runs, complete: written by
    this spherepde version, with no failed run, from the same run ids and resolved configs, and
    after the last change of every run file. Then nothing is left to run and combining again
    would write the same file, so a repeated sweep skips both (and the reading of every run
    file they need). Any doubt (a missing or unreadable file, another config) answers False."""
    import xarray as xr

    from ..version import __version__

    path = Path(path)
    try:
        written = path.stat().st_mtime_ns
        if any(spec.path.stat().st_mtime_ns > written for spec in specs):
            return False
        with xr.open_dataset(path, engine="netcdf4") as ds:
            if ds.attrs.get("spherepde_version") != __version__ or json.loads(ds.attrs.get("failed_runs", "?")):
                return False
            run_ids = [str(r) for r in ds["run_id"].values]
            configs = [json.loads(str(c)) for c in ds["run_config"].values]
    except (OSError, ValueError, KeyError):
        return False
    return (run_ids == [spec.run_id for spec in specs]
            and configs == [json.loads(json.dumps(spec.config)) for spec in specs])


def _output_dir(out):
    """Create the output directory and check that it takes files; SweepError if not."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".spherepde-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise SweepError(f"output directory {out}: not writable ({exc.strerror})") from None


# ------------------------------------------------------------------ the combined dataset
def _coordinate(key, specs):
    """Values of a swept key per run: the resolved value ("inf" → float inf), the label for a
    whole-table key; numbers as numbers, other values as text (JSON for lists and tables)."""
    import numpy as np

    section, _, name = key.partition(".")
    if name:
        values = [(s.config.get(section) or {}).get(name, s.params[key]) for s in specs]
    else:
        values = [s.params[key] for s in specs]

    def number(v):
        if isinstance(v, str) and v.strip().lower() in ("inf", "+inf", "infinity", "-inf", "-infinity"):
            return float(v.replace("inity", ""))
        return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    numbers = [number(v) for v in values]
    if all(n is not None for n in numbers):
        return np.array(numbers, dtype=int if all(isinstance(n, int) for n in numbers) else float)
    if all(isinstance(v, str) for v in values):
        return np.array(values, dtype=object)
    return np.array([json.dumps(v) for v in values], dtype=object)


def combine(specs, path, sweep_name, sweep_file=None, failures=()) -> Path:
    """Write the per-snapshot diagnostics (every (time,) variable) of the runs' files, along a new
    dimension `run`, to path; returns path. specs: the RunSpecs of `expand` whose files exist;
    sweep_name: recorded in the attributes; sweep_file: the sweep file's path, recorded.

    Besides the diagnostics: snapshot_kind (run, time) as a float (0 regular, 1 the state at a guard
    failure, NaN where the run has no snapshot), run_complete and run_wall_seconds per run, so
    that a reader of the combined file alone (spherepde/validation/paper.py) knows each run's own times.

    Coordinates: run (the expansion index), run_id, param_hash, one per swept key ("model.beta" →
    model_beta; labels for whole-table keys; "_label" appended where the name is taken, as
    "time" is); run_config holds each run's resolved config (JSON). failures: (run id, reason)
    of the runs left out, recorded in the attribute failed_runs.
    Runs with other save times are joined on the union of times (NaN where a run has none).
    Each file is read with spherepde.open_run (checksums verified, cut snapshots dropped) and the
    small per-time part kept in memory, then xr.concat: open_mfdataset would read the files
    lazily through HDF5 without those checks, and the density fields differ in size across runs.
    The file is written next to path and renamed: a reader never sees half of it.
    """
    import numpy as np
    import xarray as xr

    from ..storage.runfile import TIME_ATTRS, open_run, timestamp
    from ..version import __version__

    parts, complete, walls = [], [], []
    for spec in specs:
        ds = open_run(spec.path)
        keep = [n for n, v in ds.data_vars.items() if v.dims == ("time",) and n not in MARKERS]
        part = ds[keep]
        part.attrs = {}
        # which times the run has, and which of them is its state at a guard failure: float, so
        # that the union of times can hold NaN where the run has no snapshot
        kind = ds["snapshot_kind"].values if "snapshot_kind" in ds else np.zeros(ds.sizes["time"])
        part["snapshot_kind"] = ("time", np.asarray(kind, dtype=float))
        parts.append(part.expand_dims(run=[spec.index]))
        complete.append(int(ds.attrs.get("complete", 0)))
        walls.append(float(ds.attrs.get("wall_seconds", np.nan)))
    combined = xr.concat(parts, dim="run", join="outer", data_vars="all", coords="minimal",
                         compat="override", combine_attrs="drop")
    coords = {"run_id": ("run", np.array([s.run_id for s in specs], dtype=object)),
              "param_hash": ("run", np.array([s.param_hash for s in specs], dtype=object),
                             {"long_name": "hash of the run's swept values"})}
    for key in specs[0].params:
        name = key.replace(".", "_")
        if name in combined.variables or name in coords:  # a whole-table key "time": not the time axis
            name += "_label" if "." not in key else "_value"
        what = f'label of the table swept as "{key}"' if "." not in key else f'swept value of "{key}"'
        coords[name] = ("run", _coordinate(key, specs), {"long_name": what})
    combined = combined.assign_coords(coords)
    # the current attributes of the dimensionless time, whichever spherepde version wrote the runs
    combined["time"].attrs = dict(TIME_ATTRS)
    combined["run"].attrs["long_name"] = "index of the run in the sweep's expansion"
    combined["run_config"] = ("run", np.array([json.dumps(s.config) for s in specs], dtype=object))
    combined["run_config"].attrs["long_name"] = "the run's resolved config (JSON)"
    combined["snapshot_kind"].attrs = {
        "long_name": "0 a regular snapshot of the run, 1 its state at a guard failure, NaN: the run has "
                     "no snapshot at this time"}
    combined["run_complete"] = ("run", np.array(complete, dtype=np.int8),
                                {"long_name": "1 if the run finished, 0 if it was interrupted or failed"})
    combined["run_wall_seconds"] = ("run", np.array(walls), {"long_name": "wall time of the run", "units": "s"})
    combined.attrs = {
        "Conventions": "CF-1.13",
        "title": f"spherepde sweep {sweep_name}: per-snapshot diagnostics of its runs",
        "sweep_name": sweep_name,
        "sweep_file": str(Path(sweep_file).absolute()) if sweep_file else "",
        "sweep_keys": json.dumps(list(specs[0].params)),
        "failed_runs": json.dumps([{"run_id": r, "reason": why} for r, why in failures]),
        "spherepde_version": __version__,
        "created": timestamp(),
    }
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        combined.to_netcdf(tmp, engine="netcdf4", format="NETCDF4", encoding={"time": {"_FillValue": None}})
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    return path
