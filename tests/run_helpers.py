"""Helpers of the tests of `spherepde run`: the CLI in a subprocess (to kill, stop or limit it),
and two run files compared to round-off."""

import os
import subprocess
import sys

import numba
import numpy as np
import pytest

from spherepde.cli import main
from spherepde.storage.runfile import open_run

# the test reads files the subprocess writes: no HDF5 file locks
ENV = dict(os.environ, HDF5_USE_FILE_LOCKING="FALSE")
# Two computations of the same run agree to round-off, not always bitwise: the vectorised sums'
# loop peeling depends on the arrays' memory alignment (1-ulp differences, then carried along).
ROUND_OFF = 1e-12
# when and where a file was written (config holds the output path), and the digests over them
CHANGING_ATTRS = {"created", "wall_seconds", "history", "config", "layout_digest", "end_digest"}
# checksums of values that runs on different thread counts reproduce only to round-off: open_run
# checks them, and the values they cover are compared to round-off instead
VALUE_DIGESTS = {"snapshot_digest", "series_digest"}


def start_run(*args):
    """`spherepde run ARGS -v` in the background; its stderr (the -v snapshot log) is a pipe."""
    return subprocess.Popen([sys.executable, "-m", "spherepde.cli", "run", *map(str, args), "-v"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)


def wait_for_snapshots(proc, count):
    """Read the -v log until `count` snapshots are written; returns how many were seen."""
    seen = 0
    for line in proc.stderr:
        if line.startswith("snapshot"):
            seen += 1
            if seen == count:
                break
    return seen


def relative_difference(x, y):
    """max |x − y| / max |y| (NaN where NaN: else inf)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if not np.array_equal(np.isnan(x), np.isnan(y)):
        return np.inf
    scale = np.nanmax(np.abs(y), initial=0.0)
    diff = np.nanmax(np.abs(x - y), initial=0.0)
    return diff / scale if scale > 0 else diff


def run_difference(a, b):
    """The largest relative_difference over the variables of two finished run files; their
    attributes must agree except those that record when and where."""
    ds_a, ds_b = open_run(a), open_run(b)
    assert set(ds_a.variables) == set(ds_b.variables)
    skip = CHANGING_ATTRS | VALUE_DIGESTS | {"C0"}
    assert ({k: str(v) for k, v in ds_a.attrs.items() if k not in skip}
            == {k: str(v) for k, v in ds_b.attrs.items() if k not in skip})
    if "C0" in ds_b.attrs:  # runs with the Eulerian solver
        assert relative_difference(ds_a.attrs["C0"], ds_b.attrs["C0"]) <= ROUND_OFF
    worst = 0.0
    for name in set(ds_a.variables) - VALUE_DIGESTS:
        x, y = ds_a[name].values, ds_b[name].values
        assert x.shape == y.shape, name
        if x.dtype.kind in "fiu":
            worst = max(worst, relative_difference(x, y))
        else:
            assert np.array_equal(x, y), name
    return worst


def run_config_text(folder, name, text):
    """Write the config text to folder/name.toml and run it in this process (`spherepde run`);
    returns the path of the run file folder/name.nc."""
    from spherepde.cli import main

    cfg = folder / f"{name}.toml"
    cfg.write_text(text)
    out = folder / f"{name}.nc"
    assert main(["run", str(cfg), "-o", str(out)]) == 0
    return out


@pytest.fixture(scope="module", autouse=True)
def one_numba_thread():
    """In-process runs on one thread: on a busy machine a parallel region waits for a time slice
    per kernel call (10× slower). The CLI subprocesses keep every thread, so the comparisons also
    cover runs made with different thread counts."""
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    yield
    numba.set_num_threads(threads)


def interrupt_after(cfg, out, count, *extra):
    """Run in-process and raise KeyboardInterrupt once `count` snapshots are written."""
    class Stop:
        seen = 0

        def write(self, text):
            if text.startswith("snapshot"):
                Stop.seen += 1
                if Stop.seen == count:
                    raise KeyboardInterrupt
            return len(text)

        def flush(self):
            pass

        def isatty(self):
            return False

    stderr = sys.stderr
    sys.stderr = Stop()
    try:
        status = main(["run", str(cfg), "-o", str(out), "-v", *extra])
    finally:
        sys.stderr = stderr
    assert status == 130
