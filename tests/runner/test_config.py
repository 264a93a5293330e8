"""`spherepde run` config handling: every bad input gives one line naming the key, exit
status 2, and no output file."""

import subprocess
import sys

import pytest
from run_configs import PAPER_VMF_CONFIG

from spherepde.cli import main
from spherepde.runner.config import (
    ConfigError,
    apply_overrides,
    load,
    parse_override,
    resolve,
)

GOOD = PAPER_VMF_CONFIG.replace("mu = [0.6, 0.0, 0.8]\nkappa = 3.0", "mu = [0.0, 0.0, 1.0]\nkappa = 2.0") + """
[eulerian]
nside = 4

[time]
t_end = 0.2
save_every = 0.1
"""

# (name, transformation of the GOOD text, words the error line must contain)
BAD = [
    ("unknown section", lambda t: t + "\n[solver]\nx = 1\n", ["[solver]", "unknown section"]),
    ("unknown key", lambda t: t.replace("nside = 4", "nside = 4\nresolution = 3"), ["[eulerian] resolution", "unknown key"]),
    ("matrix shape", lambda t: t.replace("V = [[-1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, -2.0]]", "V = [[1.0, 0.0], [0.0, 1.0]]"), ["[model] V", "3×3"]),
    ("non-finite entry", lambda t: t.replace("[0.0, 1.0, 0.0], [0.0, 0.0, -2.0]", "[0.0, nan, 0.0], [0.0, 0.0, -2.0]"), ["[model] V[1][1]", "finite"]),
    ("infinite entry", lambda t: t.replace("[0.0, 0.0, 1.0]]", "[0.0, 0.0, inf]]"), ["[model] B[2][2]", "finite"]),
    ("beta zero", lambda t: t.replace("beta = 10.0", "beta = 0"), ["[model] beta", "> 0"]),
    ("beta negative", lambda t: t.replace("beta = 10.0", "beta = -1.0"), ["[model] beta", "> 0"]),
    ("beta text", lambda t: t.replace("beta = 10.0", 'beta = "hot"'), ["[model] beta"]),
    ("nside not power of two", lambda t: t.replace("nside = 4", "nside = 12"), ["[eulerian] nside", "power of two"]),
    ("t_end zero", lambda t: t.replace("t_end = 0.2", "t_end = 0.0"), ["[time] t_end", "> 0"]),
    ("t_end negative", lambda t: t.replace("t_end = 0.2", "t_end = -1.0"), ["[time] t_end", "> 0"]),
    ("save_every > t_end", lambda t: t.replace("save_every = 0.1", "save_every = 0.5"), ["[time] save_every", "t_end"]),
    ("unknown initial law", lambda t: t.replace('kind = "vmf"', 'kind = "gaussian"'), ["[initial] kind", "gaussian"]),
    ("vmf missing kappa", lambda t: t.replace("kappa = 2.0", ""), ["[initial] kappa", "required"]),
    ("missing beta", lambda t: t.replace("beta = 10.0", ""), ["[model] beta", "required"]),
    ("malformed TOML", lambda t: t.replace("[time]", "[time"), ["malformed TOML"]),
    ("bad scheme", lambda t: t.replace("nside = 4", 'nside = 4\nscheme = "weno"'), ["[eulerian] scheme"]),
    ("particle mode", lambda t: t + '\n[particles]\nmode = "swarm"\n', ["[particles] mode"]),
    ("particle n", lambda t: t + "\n[particles]\nn = 0\n", ["[particles] n"]),
    ("particle dt", lambda t: t + "\n[particles]\ndt = 0.5\n", ["[particles] dt", "save_every"]),
    ("particle key", lambda t: t + "\n[particles]\nsize = 5\n", ["[particles] size", "unknown key"]),
    ("huge matrix", lambda t: t.replace("[0.0, 0.0, -2.0]]", "[0.0, 0.0, -2e60]]"), ["[model] V", "largest entry", "1e+50"]),
    ("tiny matrix", lambda t: t.replace("B = [[-1.0, 0.0, 0.0], [0.0, -1.0, 0.0], [0.0, 0.0, 1.0]]",
                                        "B = [[-1e-60, 0.0, 0.0], [0.0, -1e-60, 0.0], [0.0, 0.0, 1e-60]]"),
     ["[model] B", "largest entry"]),
    ("bad summation", lambda t: t.replace("nside = 4", 'nside = 4\nsummation = "fmm"'), ["[eulerian] summation", "fmm"]),
    ("bad tolerance", lambda t: t.replace("nside = 4", "nside = 4\ntolerance = 0.5"), ["[eulerian] tolerance", "<= 0.001"]),
    ("bad near_field", lambda t: t.replace("nside = 4", 'nside = 4\nnear_field = "yes"'), ["[eulerian] near_field", "true or false"]),
    ("velocity tolerance", lambda t: t.replace("nside = 4", "nside = 4\nvelocity_tolerance = -0.1"), ["[eulerian] velocity_tolerance", ">= 0"]),
    ("velocity tolerance large", lambda t: t.replace("nside = 4", "nside = 4\nvelocity_tolerance = 0.5"), ["[eulerian] velocity_tolerance", "<= 0.1"]),
    ("atoms not bool", lambda t: t.replace("nside = 4", 'nside = 4\natoms = 1'), ["[eulerian] atoms", "true or false"]),
    ("atom width zero", lambda t: t.replace("nside = 4", "nside = 4\natom_width = 0"), ["[eulerian] atom_width", "> 0"]),
    ("atom width large", lambda t: t.replace("nside = 4", "nside = 4\natom_width = 5.0"), ["[eulerian] atom_width", "<= 3"]),
    ("atom min mass", lambda t: t.replace("nside = 4", "nside = 4\natom_min_mass = 1.0"), ["[eulerian] atom_min_mass", "< 1"]),
    ("atom merge", lambda t: t.replace("nside = 4", "nside = 4\natom_merge = -1"), ["[eulerian] atom_merge", ">= 0"]),
    ("max atoms", lambda t: t.replace("nside = 4", "nside = 4\nmax_atoms = 0"), ["[eulerian] max_atoms", "integer"]),
    ("atom feeding not bool", lambda t: t.replace("nside = 4", 'nside = 4\natom_feeding = "no"'), ["[eulerian] atom_feeding", "true or false"]),
    ("atom stalled width below width", lambda t: t.replace("nside = 4", "nside = 4\natom_stalled_width = 1.0"),
     ["[eulerian] atom_stalled_width", "0 (off) or ≥ atom_width"]),
    ("atom stalled width large", lambda t: t.replace("nside = 4", "nside = 4\natom_stalled_width = 4"),
     ["[eulerian] atom_stalled_width", "<= 3"]),
    ("atom join negative", lambda t: t.replace("nside = 4", "nside = 4\natom_join = -1"), ["[eulerian] atom_join", ">= 0"]),
    ("atom join large", lambda t: t.replace("nside = 4", "nside = 4\natom_join = 9"), ["[eulerian] atom_join", "<= 8"]),
    ("misspelt key", lambda t: t.replace("nside = 4", "nsied = 4"), ["[eulerian] nsied", "did you mean 'nside'?"]),
    ("misspelt section", lambda t: t.replace("[time]", "[tiem]"), ["[tiem]", "did you mean 'time'?"]),
    ("atom cut unknown", lambda t: t.replace("nside = 4", 'nside = 4\natom_cut = "notch"'),
     ["[eulerian] atom_cut", '"floor" or "tail"', "'notch'"]),
    ("atom shape unknown", lambda t: t.replace("nside = 4", 'nside = 4\natom_shape = "gaussian"'),
     ["[eulerian] atom_shape", '"point" or "sigma"', "'gaussian'"]),
    ("atom join without the stalled rule", lambda t: t.replace("nside = 4", "nside = 4\natom_stalled_width = 0\natom_join = 4"),
     ["[eulerian] atom_join", "needs atom_stalled_width > 0"]),
    ("max atoms float", lambda t: t.replace("nside = 4", "nside = 4\nmax_atoms = 2.5"), ["[eulerian] max_atoms", "integer"]),
    ("guard tolerance", lambda t: t + "\n[guards]\nmass_tolerance = -1.0\n", ["[guards] mass_tolerance", "> 0"]),
    ("guard key", lambda t: t + "\n[guards]\nnan_check = false\n", ["[guards] nan_check", "unknown key"]),
    ("guard dt_floor", lambda t: t + '\n[guards]\ndt_floor = "small"\n', ["[guards] dt_floor", "a number"]),
]


def run_main(capsys, args):
    status = main(args)
    err = capsys.readouterr().err
    return status, err


@pytest.mark.parametrize("name,edit,words", BAD, ids=[b[0] for b in BAD])
def test_bad_config_one_line_exit_2_no_output(tmp_path, capsys, name, edit, words):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(edit(GOOD))
    out = tmp_path / "out" / "run.nc"
    status, err = run_main(capsys, ["run", str(cfg), "-o", str(out)])
    assert status == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert not out.exists()


def test_unwritable_output_path(tmp_path, capsys):
    cfg = tmp_path / "good.toml"
    cfg.write_text(GOOD)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    status, err = run_main(capsys, ["run", str(cfg), "-o", str(blocker / "sub" / "run.nc")])
    assert status == 2 and len(err.strip().splitlines()) == 1 and "-o" in err and "not writable" in err


def test_existing_output_needs_overwrite(tmp_path, capsys):
    cfg = tmp_path / "good.toml"
    cfg.write_text(GOOD)
    out = tmp_path / "run.nc"
    out.write_text("precious")
    status, err = run_main(capsys, ["run", str(cfg), "-o", str(out)])
    assert status == 2 and "--overwrite" in err
    assert out.read_text() == "precious"


def test_missing_config_file(tmp_path, capsys):
    status, err = run_main(capsys, ["run", str(tmp_path / "nope.toml")])
    assert status == 2 and "cannot read" in err


def test_bad_override(tmp_path, capsys):
    cfg = tmp_path / "good.toml"
    cfg.write_text(GOOD)
    status, err = run_main(capsys, ["run", str(cfg), "--set", "beta=3", "--check"])
    assert status == 2 and "section.key=value" in err
    status, err = run_main(capsys, ["run", str(cfg), "--set", "model.beta=-3", "--check"])
    assert status == 2 and "[model] beta" in err


def test_no_traceback_from_subprocess(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(GOOD.replace("nside = 4", "nside = 3"))
    r = subprocess.run([sys.executable, "-m", "spherepde.cli", "run", str(cfg)], capture_output=True, text=True,
                       cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "[eulerian] nside" in r.stderr
    assert not (tmp_path / "results").exists() or not any((tmp_path / "results").iterdir())


def test_resolve_defaults_and_overrides(tmp_path):
    cfg = tmp_path / "good.toml"
    cfg.write_text(GOOD)
    raw = apply_overrides(load(cfg), ["model.beta=inf", "eulerian.scheme=upwind", "time.t_end=1"])
    r = resolve(raw)
    assert r["model"]["beta"] == "inf" and r["eulerian"]["scheme"] == "upwind"
    assert r["eulerian"]["cfl"] == 0.5 and r["diagnostics"]["p"] == 0.25
    assert r["time"]["t_end"] == 1.0
    assert parse_override("initial.kind=vmf") == ("initial", "kind", "vmf")
    with pytest.raises(ConfigError, match=r"\[model\] B"):
        resolve(apply_overrides(load(cfg), ["model.beta=inf", "model.B=[[1,0,0],[0,1,0],[0,0,0]]"]))


def test_atom_rule_defaults(tmp_path):
    """The stalled-peak rule and the join are on by default from nside 8 (docs/atoms.md) and off
    below (a cell of nside 4 is 0.5 rad wide) unless set; a wider atom_width alone is accepted
    (the default stalled band (atom_width, 1.7] is then empty), an explicit atom_stalled_width
    below it is not."""
    cfg = tmp_path / "good.toml"
    cfg.write_text(GOOD.replace("nside = 4", "nside = 8"))
    eul = resolve(load(cfg))["eulerian"]
    assert (eul["atom_width"], eul["atom_stalled_width"], eul["atom_join"]) == (1.3, 1.7, 4.0)
    assert eul["atom_cut"] == "floor" and eul["atom_shape"] == "point"
    eul = resolve(apply_overrides(load(cfg), ["eulerian.atom_width=2.0"]))["eulerian"]
    assert eul["atom_stalled_width"] == 2.0
    with pytest.raises(ConfigError, match="atom_stalled_width"):
        resolve(apply_overrides(load(cfg), ["eulerian.atom_width=2.0", "eulerian.atom_stalled_width=1.7"]))
    assert resolve(apply_overrides(load(cfg), ["eulerian.atom_stalled_width=0"]))["eulerian"]["atom_join"] == 4.0
    coarse = load(cfg)
    coarse["eulerian"]["nside"] = 4
    eul = resolve(coarse)["eulerian"]
    assert (eul["atom_stalled_width"], eul["atom_join"]) == (0.0, 0.0)
    eul = resolve(apply_overrides(coarse, ["eulerian.atom_stalled_width=1.7"]))["eulerian"]
    assert (eul["atom_stalled_width"], eul["atom_join"]) == (1.7, 0.0)
    with pytest.raises(ConfigError, match=r"\[eulerian\] atom_join: .* 0 by default below nside 8"):
        resolve(apply_overrides(coarse, ["eulerian.atom_join=4"]))


def test_guards_section_defaults_and_values(tmp_path):
    cfg = tmp_path / "good.toml"
    cfg.write_text(GOOD)
    assert resolve(load(cfg))["guards"] == {"mass_tolerance": 1e-10, "negative_tolerance": 1e-14, "dt_floor": 1e-12}
    r = resolve(apply_overrides(load(cfg), ["guards.negative_tolerance=0", "guards.dt_floor=1e-9"]))
    assert r["guards"]["negative_tolerance"] == 0.0 and r["guards"]["dt_floor"] == 1e-9


def test_config_difference_names_the_first_setting():
    from spherepde.runner.config import difference

    a = {"model": {"beta": 10.0, "B": 1}, "output": {"path": "a.nc"}, "guards": {"dt_floor": 1e-12}}
    assert difference(a, {**a, "output": {"path": "b.nc"}, "guards": {"dt_floor": 1.0}}) is None
    assert difference(a, {**a, "model": {"beta": 30.0, "B": 1}}) == "[model] beta: 10.0 in the file, 30.0 now"
    assert difference(a, {**a, "particles": {"n": 5}}) == "[particles]: None in the file, {'n': 5} now"


def test_config_difference_ignores_settings_of_a_solver_part_that_does_not_run():
    """A token run (no Eulerian solve) does not depend on the atom settings, nor a density-only
    run on the atom keys: a changed default of those leaves old files valid; any other change,
    or the same change where the part runs, is still named."""
    from spherepde.runner.config import difference

    eul = {"enabled": False, "nside": 16, "scheme": "muscl", "atoms": True, "atom_feeding": True}
    a = {"eulerian": eul}
    assert difference(a, {"eulerian": {**eul, "atom_feeding": False, "scheme": "upwind"}}) is None
    assert difference(a, {"eulerian": {**eul, "nside": 32}}) == "[eulerian] nside: 16 in the file, 32 now"
    running = {"eulerian": {**eul, "enabled": True}}
    assert difference(running, {"eulerian": {**eul, "enabled": True, "atom_feeding": False}}) == \
        "[eulerian] atom_feeding: True in the file, False now"
    density_only = {"eulerian": {**eul, "enabled": True, "atoms": False}}
    assert difference(density_only, {"eulerian": {**eul, "enabled": True, "atoms": False,
                                                  "atom_feeding": False}}) is None
    assert difference(density_only, {"eulerian": {**eul, "enabled": True, "atoms": True}}) == \
        "[eulerian] atoms: False in the file, True now"


def test_example_configs_resolve():
    import tomllib
    from pathlib import Path

    from spherepde.runner.sweep import expand

    configs = sorted((Path(__file__).parents[2] / "solvers").rglob("*.toml"))
    assert any(p.name == "quickstart.toml" for p in configs)
    for p in configs:
        if "sweep" in tomllib.loads(p.read_text()):  # a sweep file: every run config it expands to
            assert expand(p)
        else:
            resolve(load(p))
