"""Bit-identity of run files across a code change (a refactoring must not move a bit).

    python validation/run_identity.py write DIR      # run the fixed set with the installed code
    python validation/run_identity.py compare A B    # every variable bit for bit; attributes too

The fixed set covers each path through the run: the quick start (Eulerian + atoms, β = 30), two
heads with quadrature particles, layers (a model switch at t = 3), noise (heat flow + noisy
tokens), tokens alone (no mesh), and a run interrupted after its fourth snapshot and resumed.

Two runs of the same code agree bitwise only when the sums see the same memory alignment: the
vectorised loops peel their first elements according to it, and the 1-ulp differences that
follow grow along a run (the quick start, β = 30: 3e-14 in C₀ between two runs of one commit).
So every run here has one numba thread (parallel reductions keep their order) and glibc's
malloc_mmap_threshold at 0 (every array gets pages of its own: the same offset in a page, every
run). And numba's kernels must come from its cache: a kernel compiled in the running process
rounds differently in the last bit from the same kernel loaded from the cache (measured: the
quick start's C₀ 4.762042020274106 on a cold cache, 4.762042020274079 on every warm run, old
code and new alike). So `write` runs the whole set twice and keeps the second. Then two runs of
one commit are bit-identical, and so must be two commits that only move code.

Attributes that may legitimately differ: `spherepde_version`, `created` and `history` (the version,
the dates). Everything else, variables and attributes, must be equal to the last bit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import netCDF4
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SOLVERS = ROOT / "solvers"
# one thread, and every array at the same offset in its page (module docstring)
DETERMINISTIC = {"NUMBA_NUM_THREADS": "1", "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=0"}
MAY_DIFFER = {"spherepde_version", "created", "history", "wall_seconds", "end_digest", "layout_digest"}

PAPER = """V = [[-1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, -2.0]]
B = [[-1.0, 0.0, 0.0], [0.0, -1.0, 0.0], [0.0, 0.0, 1.0]]"""
VMF = """[initial]
kind = "vmf"
mu = [0.6, 0.0, 0.8]
kappa = 3.0"""


def _config(model, initial, eulerian, particles, t_end, save_every):
    return (f"[model]\n{model}\n\n{initial}\n\n[eulerian]\n{eulerian}\n\n[particles]\n{particles}\n\n"
            f"[time]\nt_end = {t_end}\nsave_every = {save_every}\n")


NOISE = _config('beta = 6.0\nV = "identity"\nB = "identity"\nnoise = 0.05\nnoise_schedule = "exponential"\n'
                "noise_time = 2.0", VMF, "nside = 8\nrk_order = 2", 'mode = "tokens"\nn = 200\nseed = 5\ndt = 0.05',
                1.0, 0.25)
TOKENS = _config(f"beta = 30.0\n{PAPER}",
                 '[initial]\nkind = "projected_normal"\nmean = [0.3, 0.1, 0.2]\n'
                 "cov = [[1.0, 0.0, 0.0], [0.0, 0.6, 0.0], [0.0, 0.0, 0.3]]",
                 "enabled = false", 'mode = "tokens"\nn = 500\nseed = 11\ndt = 0.02', 4.0, 0.5)
RESUMED = _config(f"beta = 10.0\n{PAPER}", VMF, "nside = 8", 'mode = "quadrature"\ndt = 0.05', 2.0, 0.25)

# name: (config file or text, extra arguments)
RUNS = {
    "quickstart": (SOLVERS / "quickstart.toml", []),
    "heads": (SOLVERS / "heads.toml", ["--set", "eulerian.nside=8", "--set", "time.t_end=2.0"]),
    "layers": (SOLVERS / "layers.toml", ["--set", "eulerian.nside=8", "--set", "time.t_end=4.0"]),
    "noise": (NOISE, []),
    "tokens": (TOKENS, []),
}


def _spherepde(directory, *args):
    """`spherepde ARGS` inside directory (output paths relative to it: the config attribute that
    records them is then the same for every directory)."""
    env = dict(os.environ, **DETERMINISTIC)
    subprocess.run([sys.executable, "-m", "spherepde.cli", *map(str, args)], check=True, env=env, cwd=directory)


def write(directory: Path):
    """The set twice: into DIR/warm-up (numba compiles and caches its kernels), then into DIR."""
    directory = directory.resolve()
    _write_set(directory / "warm-up")
    _write_set(directory)


def _write_set(directory: Path):
    directory.mkdir(parents=True, exist_ok=True)
    for name, (config, extra) in RUNS.items():
        if isinstance(config, str):
            path = directory / f"{name}.toml"
            path.write_text(config)
            config = path
        print(f"run {name}", flush=True)
        _spherepde(directory, "run", config.resolve(), "-o", f"{name}.nc", "--overwrite", *extra)
    # a run interrupted (SIGINT after its 4th snapshot) and resumed: exact, wherever it stopped
    config = directory / "resumed.toml"
    config.write_text(RESUMED)
    print("run resumed", flush=True)
    env = dict(os.environ, **DETERMINISTIC)
    proc = subprocess.Popen([sys.executable, "-m", "spherepde.cli", "run", config.name, "-o", "resumed.nc",
                             "--overwrite", "-v"], cwd=directory, env=env, stderr=subprocess.PIPE, text=True)
    seen = 0
    for line in proc.stderr:
        seen += line.startswith("snapshot")
        if seen == 4:
            proc.send_signal(signal.SIGINT)
            break
    proc.wait()
    proc.stderr.close()
    if proc.returncode != 130:
        sys.exit(f"the run to be resumed ended with status {proc.returncode}, not 130 (interrupted)")
    _spherepde(directory, "run", config.name, "-o", "resumed.nc", "--resume")


def _equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.kind in "fc":
        return a.tobytes() == b.tobytes()
    return bool(np.all(a == b))


def _attribute_differences(group_a, group_b, where=""):
    out = []
    for key in sorted(set(group_a.ncattrs()) | set(group_b.ncattrs())):
        if key in MAY_DIFFER:
            continue
        if key not in group_a.ncattrs() or key not in group_b.ncattrs():
            out.append(f"{where}attribute {key}: only in one file")
        elif not _equal(group_a.getncattr(key), group_b.getncattr(key)):
            out.append(f"{where}attribute {key}: {group_a.getncattr(key)!r} != {group_b.getncattr(key)!r}")
    return out


def _differences(group_a, group_b, where=""):
    out = _attribute_differences(group_a, group_b, where)
    names = set(group_a.variables) | set(group_b.variables)
    for name in sorted(names):
        if name not in group_a.variables or name not in group_b.variables:
            out.append(f"{where}variable {name}: only in one file")
            continue
        va, vb = group_a.variables[name], group_b.variables[name]
        va.set_auto_maskandscale(False)
        vb.set_auto_maskandscale(False)
        if va.dimensions != vb.dimensions or not _equal(va[...], vb[...]):
            out.append(f"{where}variable {name}: values differ")
        out += _attribute_differences(va, vb, where=f"{where}{name}.")
    return out


def compare(a: Path, b: Path) -> int:
    bad = 0
    for name in [*RUNS, "resumed"]:
        with netCDF4.Dataset(a / f"{name}.nc") as da, netCDF4.Dataset(b / f"{name}.nc") as db:
            diffs = _differences(da, db)
            n_vars = len(da.variables)
        print(f"{name}: {n_vars} variables, " + ("bit-identical" if not diffs else f"{len(diffs)} differences"))
        for line in diffs:
            print("   ", line)
        bad += bool(diffs)
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "write":
        write(Path(sys.argv[2]))
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(Path(sys.argv[2]), Path(sys.argv[3])))
    else:
        sys.exit(__doc__)
