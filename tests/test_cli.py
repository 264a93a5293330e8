"""The command line: the transport validation writes its report; bad input exits with status 2."""

import subprocess
import sys

from spherepde.cli import main


def test_validate_transport_small(tmp_path):
    out = tmp_path / "report"
    assert main(["validate", "transport", "--out", str(out), "--nside", "4", "8"]) == 0
    text = (out / "transport.md").read_text()
    assert "Williamson 1, α = π/4" in text and "Nair–Lauritzen divergent, gaussian hills" in text
    assert (out / "transport_convergence.png").stat().st_size > 10_000


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "spherepde.cli", *args], capture_output=True, text=True)


def test_bad_nside_exits_2(tmp_path):
    r = run_cli("validate", "transport", "--out", str(tmp_path), "--nside", "12")
    assert r.returncode == 2
    assert "nside" in r.stderr and "Traceback" not in r.stderr


def test_unwritable_out_exits_2(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = run_cli("validate", "transport", "--out", str(blocker / "sub"))
    assert r.returncode == 2
    assert "--out" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_unknown_suite_exits_2(tmp_path):
    r = run_cli("validate", "nosuch", "--out", str(tmp_path))
    assert r.returncode == 2 and "Traceback" not in r.stderr
