"""The command line: the transport validation writes its report; bad input exits with status 2."""

import importlib
import subprocess
import sys

import pytest

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


def test_validate_exact_small(tmp_path):
    """The exact suite runs end to end on tiny meshes; the facts that hold at any resolution are
    checked on its results: mesh reflections are symmetries of the run, mass is conserved, f ≥ 0,
    and min f_t stays above the a-posteriori bound up to the discretisation error."""
    from spherepde.validation import exact

    out = tmp_path / "exact"
    r = exact.run_suite(out, nsides=[4, 8], progress=False)
    text = (out / "exact.md").read_text()
    for heading in ("vMF closed form", "β = ∞", "Linear growth rates", "Symmetry", "lower bound"):
        assert heading in text
    assert (out / "exact_convergence.png").stat().st_size > 10_000
    for s in r["symmetry"].values():
        assert max(s["asymmetry"].values()) < 1e-12
        assert s["mass_drift"] < 1e-13 and s["min_density"] >= 0
    for ds in r["lower_bound"].values():
        assert (ds.min_density >= 0.9 * ds.lower_bound_aposteriori).all()


def test_validate_exact_is_a_suite(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = run_cli("validate", "exact", "--out", str(blocker / "sub"))
    assert r.returncode == 2 and "--out" in r.stderr


def test_validate_lagrangian_small(tmp_path):
    """β = ∞ (particles exact): the cross-check runs end to end, the two solvers start identical
    (W₂ = 0 at t = 0) and the gap shrinks from nside 4 to 8."""
    import math

    from spherepde.validation import lagrangian

    r = lagrangian.run_suite(tmp_path, nsides=[4, 8], betas=(math.inf,), progress=False)
    text = (tmp_path / "lagrangian.md").read_text()
    assert "β = inf" in text and (tmp_path / "lagrangian.png").stat().st_size > 10_000
    rows4, rows8 = r[(math.inf, 4)][0], r[(math.inf, 8)][0]
    assert rows4[0]["w2"] < 1e-6 and rows8[0]["w2"] < 1e-6
    assert rows8[1]["w2"] < 0.7 * rows4[1]["w2"]
    assert rows8[1]["density_rel_mean"] < rows4[1]["density_rel_mean"]


def test_validate_without_suites_means_all_of_them(monkeypatch, tmp_path):
    """`spherepde validate --out DIR` runs every default suite of the registry, in its order; a
    suite named alone runs alone (also one that is part of the variants suite)."""
    import spherepde.cli as cli
    from spherepde.validation.suites import DEFAULT, SUITES

    ran = []

    def fake(suite):
        return lambda out, **kw: ran.append(suite)

    for name in SUITES:
        monkeypatch.setattr(importlib.import_module(f"spherepde.validation.{name}"), "run_suite", fake(name))
    assert cli.main(["validate", "--out", str(tmp_path / "all")]) == 0
    assert ran == list(DEFAULT) == ["transport", "exact", "lagrangian", "paper", "atoms", "tails", "variants", "rotf"]
    ran.clear()
    assert cli.main(["validate", "atoms", "noise", "--out", str(tmp_path / "one")]) == 0
    assert ran == ["atoms", "noise"]


def test_validation_main_uses_the_same_registry(monkeypatch, tmp_path):
    """`python -m spherepde.validation` takes the same arguments and suites as `spherepde validate`."""
    from spherepde.validation import suites

    ran = []
    monkeypatch.setattr(importlib.import_module("spherepde.validation.transport"), "run_suite",
                        lambda out, **kw: ran.append(kw))
    assert suites.main(["transport", "--quick", "--out", str(tmp_path)]) == 0
    assert ran == [{"slow": False, "nsides": [8, 16], "progress": True}]
    with pytest.raises(SystemExit) as info:
        suites.main(["nonsense", "--out", str(tmp_path)])
    assert info.value.code == 2


def test_variants_suite_runs_every_variant_and_lists_their_reports(tmp_path, monkeypatch):
    from spherepde.validation import variants

    ran = []
    for name in ("heads", "noise", "unnormalised"):
        monkeypatch.setattr(importlib.import_module(f"spherepde.validation.{name}"), "run_suite",
                            lambda out, quick=False, progress=True, name=name, **_: ran.append((name, quick)))
    path = variants.run_suite(tmp_path, quick=True, progress=False)
    assert sorted(ran) == [("heads", True), ("noise", True), ("unnormalised", True)]
    text = path.read_text()
    for report in ("heads.md", "noise.md", "unnormalised.md"):
        assert f"[{report}]({report})" in text


def test_python_m_spherepde_is_the_command_line():
    """`python -m spherepde` runs the same command line as `spherepde` (exit status included)."""
    ok = subprocess.run([sys.executable, "-m", "spherepde", "--version"], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.startswith("spherepde ")
    bad = subprocess.run([sys.executable, "-m", "spherepde", "run", "/nonexistent.toml"], capture_output=True, text=True)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_help_says_what_the_program_is_without_loading_the_numerics():
    """`spherepde --help` opens with what spherepde is, and neither it nor `import spherepde`
    loads numba, healpy or xarray (the public names are imported on first use)."""
    out = subprocess.run([sys.executable, "-m", "spherepde", "--help"], capture_output=True, text=True, check=True)
    assert "self-attention dynamics on the sphere" in out.stdout and "Command line." not in out.stdout
    probe = ("import sys, spherepde, spherepde.cli; spherepde.cli.build_parser(); "
             "print(sorted(m for m in ('numba', 'healpy', 'xarray') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]", loaded
    import spherepde

    assert spherepde.HealpixMesh.__name__ == "HealpixMesh" and "EulerianSolver" in dir(spherepde)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        spherepde.nope  # noqa: B018


def _probe_many(folder, times):
    from spherepde.cli import _check_output_dir

    for _ in range(times):
        _check_output_dir(folder)


def test_runs_started_in_one_folder_at_once_do_not_race_on_the_write_probe(tmp_path):
    """Two processes checking the same output folder at the same moment (two runs of a batch
    script started together): each probes with a file of its own, so neither finds the folder
    'not writable' because the other removed its probe."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    with context.Pool(2) as pool:
        pool.starmap(_probe_many, [(str(tmp_path), 3000)] * 2)
    assert not list(tmp_path.iterdir())
