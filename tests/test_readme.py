"""Every command in README.md is run: by this file (the quick start and the Python snippets, in
the default suite; the long validation commands under the `slow` marker) or by CI (.ci/run runs
the quick start's test command). A command added to the README without a way to run it here
fails test_every_readme_command_is_run."""

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
ENV = dict(os.environ, MPLBACKEND="Agg", HDF5_USE_FILE_LOCKING="FALSE")
INSTALL = "python -m pip install -e . && "


def fenced_blocks(text, language):
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


COMMAND_PREFIXES = ("spherepde ", "python ", "pip ", "cdo ")


def readme_commands():
    """The commands of the README: lines of its ```bash blocks and inline code spans that start
    with `spherepde ` or `python -m ` (a synopsis goes in a ```text block and is no command)."""
    text = README.read_text()
    lines = [ln.strip() for block in fenced_blocks(text, "bash") for ln in block.splitlines()]
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M))
    commands = [c for c in lines + spans if c.startswith(COMMAND_PREFIXES)]
    return list(dict.fromkeys(c for c in commands if c))


QUICK_START = (INSTALL + "spherepde run solvers/quickstart.toml && spherepde plot results/quickstart.nc")
TEST_COMMAND = "python -m pip install -e '.[test]' && python -m pytest"
# README command → how it is run: "default" (this file, default suite: the quick start, and
# commands on its run file RUN.nc), "slow" (this file, slow marker: minutes to hours of compute),
# "ci" (.ci/run), "readers" (tests/storage/test_file_readers.py runs the same CDO operators, marker readers)
HOW = {QUICK_START: "default", TEST_COMMAND: "ci"}
SLOW_PREFIXES = ("spherepde validate ", "spherepde run ", "python -m spherepde.validation.")


def how_run(command):
    if command in HOW:
        return HOW[command]
    if command.startswith("spherepde ") and "RUN.nc" in command:
        return "default"
    if command.startswith(SLOW_PREFIXES):
        return "slow"
    if command.startswith("cdo ") and all(op in READER_TESTS for op in cdo_operators(command)):
        return "readers"
    return None


READER_TESTS = re.sub(r"hp\{\w+\}", "hp", (ROOT / "tests" / "storage" / "test_file_readers.py").read_text())


def cdo_operators(command):
    """The operators of a CDO command, without the file names (e.g. 'remapbil,r72x36',
    '-setgrid,hp' (the nside is the test's own), '-selname,density')."""
    ops = [w for w in shlex.split(command)[1:] if not w.endswith(".nc")]
    return [re.sub(r"hp\d+", "hp", op) for op in ops]


def test_every_readme_command_is_run():
    commands = readme_commands()
    assert QUICK_START in commands and TEST_COMMAND in commands
    unrun = [c for c in commands if how_run(c) is None]
    assert not unrun, f"README commands that no test runs: {unrun}"


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert TEST_COMMAND in ci.splitlines()[-1]


def test_pytest_slow_marker_is_declared():
    """`python -m pytest -m slow` selects the checks this file and others mark slow."""
    assert "slow:" in (ROOT / "pyproject.toml").read_text()


@pytest.fixture(scope="module")
def quick_start(tmp_path_factory):
    """The quick start's first command (after its install, which CI's own install covers) in a
    fresh directory holding the repository's solvers/."""
    work = tmp_path_factory.mktemp("quickstart")
    shutil.copytree(ROOT / "solvers", work / "solvers")
    exe = shutil.which("spherepde")
    assert exe is not None, "the spherepde console script is not installed"
    for part in QUICK_START[len(INSTALL):].split(" && "):
        argv = shlex.split(part)
        done = subprocess.run([exe, *argv[1:]], cwd=work, env=ENV, capture_output=True, text=True)
        assert done.returncode == 0, f"{part}: {done.stderr[-2000:]}"
    return work


@pytest.mark.parametrize("command", [c for c in readme_commands() if how_run(c) == "default" and "RUN.nc" in c])
def test_readme_commands_on_a_run_file(quick_start, command, tmp_path):
    argv = shlex.split(command.replace("RUN.nc", str(quick_start / "results" / "quickstart.nc")))
    done = subprocess.run([shutil.which(argv[0]), *argv[1:], "-o", str(tmp_path)], cwd=quick_start,
                          env=ENV, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert any(tmp_path.iterdir())


def test_quick_start_writes_the_run_file_and_plots(quick_start):
    results = quick_start / "results"
    assert (results / "quickstart.nc").stat().st_size > 0
    pngs = sorted(p.name for p in results.glob("quickstart*.png"))
    assert "quickstart_density.png" in pngs and "quickstart_diagnostics.png" in pngs


def test_quick_start_shows_both_phases(quick_start):
    """The main job tells the paper's two phases: concentration on E (alignment with E near 1
    around t = log β), then the move to F (alignment with F overtakes it before t_end), and the
    figures mark the atom events; both as the README's Quick start paragraph says."""
    import math

    from spherepde.analysis.metrics import f_phase_onset, max_alignment
    from spherepde.storage.runfile import open_run

    ds = open_run(quick_start / "results" / "quickstart.nc")
    peak, when = max_alignment(ds)
    log_beta = float(ds.attrs["log_beta"])
    assert peak > 0.99 and log_beta - 1 < when < log_beta + 2, (peak, when)
    onset = f_phase_onset(ds)
    assert math.isfinite(onset) and when < onset < float(ds.time.values[-1]), onset
    assert ds["alignment_F"].values[-1] > 0.99
    quick = README.read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert f"{peak:.3f}" in quick and f"t = {when:g}" in quick and f"{onset:.2f}" in quick


@pytest.mark.parametrize("index", range(len(fenced_blocks(README.read_text(), "python"))))
def test_readme_python_snippets_run(quick_start, index):
    code = fenced_blocks(README.read_text(), "python")[index]
    done = subprocess.run([sys.executable, "-c", code], cwd=quick_start, env=ENV, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("command", [c for c in readme_commands() if how_run(c) == "slow"])
def test_long_readme_commands_run(command, tmp_path):
    shutil.copytree(ROOT / "solvers", tmp_path / "solvers")
    argv = shlex.split(command.replace("DIR", str(tmp_path / "out")))
    if argv[0] == "python":
        argv[0] = sys.executable
    else:
        argv[0] = shutil.which(argv[0])
    done = subprocess.run(argv, cwd=tmp_path, env=ENV, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
