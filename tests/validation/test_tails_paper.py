"""The mean field's paper metrics from tails run files (spherepde.validation.tails_paper): grouping
by β, law and mesh, the differences and orders of mesh halvings, and the report."""

import math

import pytest
from run_configs import PAPER_VMF_CONFIG

from spherepde.cli import main
from spherepde.storage.runfile import open_run
from spherepde.validation import tails_paper

# the paper's matrices and a vMF start (tests/run_configs.py) at β = 30, with a mesh, tails and times
CONFIG = PAPER_VMF_CONFIG.replace("beta = 10.0", "beta = 30.0") + """
[eulerian]
nside = {nside}
tails = "{tails}"

[time]
t_end = {t_end}
save_every = 0.5
"""


def test_differences_and_orders_of_mesh_halvings():
    d, p = tails_paper.differences([10.0, 11.0, 11.5, 11.75])
    assert d == pytest.approx([1.0, 0.5, 0.25]) and p == pytest.approx([1.0, 1.0])
    d, p = tails_paper.differences([10.0, math.nan, 11.0])
    assert math.isnan(d[0]) and math.isnan(p[0])


def test_report_groups_complete_tails_runs_and_keeps_the_longer(tmp_path):
    folder = tmp_path / "runs"
    folder.mkdir()
    for name, nside, tails, t_end in (("a-0000", 4, "log", 1.0), ("a-0001", 8, "log", 1.0),
                                      ("b-0000", 4, "log", 1.5),  # same group, longer: kept
                                      ("c-0000", 8, "finite_volume", 1.0)):  # no tails: skipped
        cfg = tmp_path / f"{name}.toml"
        cfg.write_text(CONFIG.format(nside=nside, tails=tails, t_end=t_end))
        assert main(["run", str(cfg), "-o", str(folder / f"{name}.nc")]) == 0
    (folder / "a.nc").write_bytes(b"a sweep's combined file")  # not a run id: never read
    runs = tails_paper.collect_runs([folder])
    # the defaults with tails = "log"
    label = ("sigma atoms, tail cut, anchors every 5 with backtracked maps (budget 0.01 decades) in RK4 steps of "
             "0.05, level relative to the clusters' peaks, followed within the neighbours, finite volumes within 1 "
             "kernel width of the atoms, the tail cells' mass paid where their flow goes, the steps' states between "
             "couplings")
    assert sorted(runs) == [(30.0, "vmf", label, 4), (30.0, "vmf", label, 8)]
    assert runs[(30.0, "vmf", label, 4)]["t_end"] == 1.5
    with open_run(folder / "a-0001.nc") as ds:
        assert runs[(30.0, "vmf", label, 8)]["max_E"] == tails_paper.paper_metrics(ds)["max_E"]
    path = tails_paper.paper_report([folder], out=tmp_path, say=lambda *_: None)
    text = path.read_text()
    assert f"## β = 30, von Mises–Fisher: {label}" in text and "| 4 |" in text and "| 8 |" in text
    assert "max_E: differences" in text and "unfinished" not in text.split("## ")[1]
    # an unfinished run is kept only when asked, and marked
    import netCDF4

    with netCDF4.Dataset(folder / "a-0001.nc", "a") as nc:
        nc.setncattr("complete", 0)
    assert sorted(tails_paper.collect_runs([folder])) == [(30.0, "vmf", label, 4)]
    assert tails_paper.collect_runs([folder], partial=True)[(30.0, "vmf", label, 8)]["partial"] is True
    text = tails_paper.paper_report([folder], out=tmp_path, partial=True, say=lambda *_: None).read_text()
    assert "| 1 (unfinished) |" in text and "--partial" in text


def test_settings_label_separates_how_atoms_and_paths_were_made():
    """Runs made with other atoms or paths go to tables of their own; a file without the keys reads
    as the values such a file implies (points cut at the floor, g at every coupling)."""
    assert tails_paper.settings_label({}) == "point atoms, floor cut, g interpolated at every coupling"
    assert tails_paper.settings_label({"atom_shape": "sigma", "atom_cut": "tail", "tail_anchor": 1.0,
                                       "tail_paths": "retrace"}) == "sigma atoms, tail cut, anchors every 1 with retraced paths"
    # the couplings, the level and the following, where they are not those of the first runs
    bounded = {"atom_shape": "sigma", "atom_cut": "tail", "tail_anchor": 1.0, "tail_paths": "maps", "tail_interval": 0.05,
               "tail_reference": "clusters", "tail_follow_bounds": "neighbours"}
    assert tails_paper.settings_label(bounded) == ("sigma atoms, tail cut, anchors every 1 with composed maps, couplings "
                                                   "every 0.05, level relative to the clusters' peaks, followed within "
                                                   "the neighbours")
    assert tails_paper.settings_label({**bounded, "tail_paths": "selective", "tail_anchor": 5.0, "tail_interval": 0.2,
                                       "tail_reference": "mesh", "tail_follow_bounds": "none"}) == (
        "sigma atoms, tail cut, anchors every 5 with selective paths (budget 0.01 decades)")
    # tails_exclusion.toml's runs and trapezoidal paths get tables of their own
    assert tails_paper.settings_label({**bounded, "tail_exclusion_width": 1.0}).endswith(
        "followed within the neighbours, finite volumes within 1 kernel width of the atoms")
    assert tails_paper.settings_label({**bounded, "tail_path_scheme": "heun"}).endswith(", paths by heun")
    assert tails_paper.settings_label({**bounded, "tail_field_between": "measure"}).endswith(
        ", the field of the measure between couplings")
    assert tails_paper.settings_label({**bounded, "tail_field_between": "linear"}) == tails_paper.settings_label(bounded)
    # the backtracked maps through the steps' states (tails_backtrack.toml) are neither the selective paths
    # nor the field of the measure, and their shorter RK4 steps are named
    backtrack = tails_paper.settings_label({**bounded, "tail_paths": "backtrack", "tail_anchor": 5.0,
                                            "tail_path_step": 0.05, "tail_field_between": "steps"})
    assert backtrack.startswith("sigma atoms, tail cut, anchors every 5 with backtracked maps (budget 0.01 decades) "
                                "in RK4 steps of 0.05, couplings every 0.05")
    assert backtrack.endswith(", the steps' states between couplings")


def test_settings_label_names_the_halved_steps_and_the_local_payment():
    """Runs that differ only in tail_path_tolerance or tail_mass_correction get tables of their
    own (collect_runs groups by the label); the defaults' label names neither."""
    eul = {"atom_shape": "sigma", "atom_cut": "tail", "tail_anchor": 5.0, "tail_paths": "backtrack",
           "tail_path_step": 0.05}
    plain = tails_paper.settings_label(eul)
    assert "halved" not in plain and "paid locally" not in plain
    assert tails_paper.settings_label({**eul, "tail_path_tolerance": 0.0, "tail_mass_correction": "global"}) == plain
    halved = tails_paper.settings_label({**eul, "tail_path_tolerance": 0.03})
    assert "in RK4 steps of 0.05 halved above 0.03 decades per unit time" in halved
    assert tails_paper.settings_label({**eul, "tail_mass_correction": "local"}).endswith(
        ", the tail cells' mass paid locally")
    assert tails_paper.settings_label({**eul, "tail_mass_correction": "downstream"}).endswith(
        ", the tail cells' mass paid where their flow goes")


def test_a_run_without_an_onset_says_how_far_its_heavier_atom_is_from_the_cone():
    """'none' comes with ⟨Bz, z⟩ of the heavier atom and its late drift; the time it would reach the
    cone ⟨Bz, z⟩ = 0 is given only where the drift was measured after t = log β."""
    long = {"onset": math.nan, "q_end": -0.5, "q_rate": 0.01, "t_end": 30.0}
    short = dict(long, t_end=5.0)
    leaving = {"onset": 9.5, "q_end": 0.2, "q_rate": 0.1, "t_end": 30.0}
    text = tails_paper._why_none(1000.0, [16, 32, 64], [long, short, leaving])
    assert "nside 16: -0.500 at t = 30, +0.0100 per unit time (at the cone at t ≈ 80)" in text
    assert "nside 32: -0.500 at t = 5, +0.0100 per unit time;" not in text  # the last part ends the sentence
    assert text.endswith("nside 32: -0.500 at t = 5, +0.0100 per unit time.") and "nside 64" not in text
    assert tails_paper._why_none(1000.0, [16], [leaving]) == ""
