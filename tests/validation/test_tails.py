"""The tails suite's measurement (spherepde.validation.tails) against the exact β = ∞ solution."""

import json
import math
import tomllib

import numpy as np
import pytest

from spherepde.analysis.exact import zero_temperature_density
from spherepde.models.attention import AttentionModel
from spherepde.models.initial import Uniform
from spherepde.runner.config import resolve
from spherepde.validation import tails
from spherepde.validation.common import REPO


def test_tail_errors_of_the_exact_averages_are_zero_and_of_a_scaled_field_its_scale(mesh_factory):
    mesh = mesh_factory(8)
    model = AttentionModel(tails.PAPER_B, tails.PAPER_V, math.inf)
    exact = mesh.cell_average(zero_temperature_density(model, Uniform(), 2.0), order=tails.EXACT_ORDER)
    e = tails.tail_errors(mesh, exact, exact)
    assert e["cells"] > 0 and e["median"] == e["p90"] == e["max"] == 0.0 and e["min_ratio"] == 1.0
    e = tails.tail_errors(mesh, 1.1 * exact, exact)
    assert np.isclose(e["median"], 0.1) and np.isclose(e["min_ratio"], 1.1)


def test_the_exact_cell_averages_keep_the_mass_and_converge(mesh_factory):
    """At t = 2 the adaptive averages (every cell refined) integrate to the mass 1 (the exact solution conserves it);
    at t = 8 (ridges 3e-4 rad wide) the cells below the bulk agree with a tolerance ten times
    tighter to 1e-9, where a fixed order-8 rule misses the ridges."""
    mesh = mesh_factory(16)
    model = AttentionModel(tails.PAPER_B, tails.PAPER_V, math.inf)
    a = tails.exact_cell_averages(mesh, zero_temperature_density(model, Uniform(), 2.0), rtol=1e-8, bulk=2.0)
    assert not np.isnan(a).any() and abs(a.sum() * mesh.area - 1.0) < 1e-8
    density = zero_temperature_density(model, Uniform(), 8.0)
    a = tails.exact_cell_averages(mesh, density)
    b = tails.exact_cell_averages(mesh, density, rtol=1e-11, max_depth=16)
    assert 0 < np.isnan(a).sum() <= 16 and np.isnan(b).sum() <= 16  # a few cells next to the clusters
    tail = b < 1e-2 * np.nanmax(b)
    assert np.abs(a[tail] / b[tail] - 1).max() < 1e-9
    fixed = mesh.cell_average(density, order=tails.EXACT_ORDER)
    assert np.abs(fixed[tail] / b[tail] - 1).max() > 0.1


def test_the_tail_errors_fall_with_the_mesh():
    """The measurement sees the scheme's convergence: at t = 2 the 90th percentile falls from
    nside 8 to 16 (the exact solution is the reference, no stored numbers)."""
    coarse, _ = tails.zero_temperature_run(8, "muscl", times=(2.0,))
    fine, _ = tails.zero_temperature_run(16, "muscl", times=(2.0,))
    assert fine[2.0]["p90"] < 0.5 * coarse[2.0]["p90"]
    assert abs(fine[2.0]["min_ratio"] - 1) < abs(coarse[2.0]["min_ratio"] - 1)


def test_the_semi_lagrangian_prototype_converges_and_beats_the_finite_volumes():
    """Against the exact solution: the prototype's 90th percentile falls from nside 8 to 16, and
    at nside 16 its median is below a tenth of the finite-volume median (t = 2)."""
    coarse, _ = tails.semi_lagrangian_run(8, 0.2, times=(2.0,))
    fine, _ = tails.semi_lagrangian_run(16, 0.2, times=(2.0,))
    assert fine[2.0]["p90"] < 0.25 * coarse[2.0]["p90"]
    fv, _ = tails.zero_temperature_run(16, "muscl", times=(2.0,))
    assert fine[2.0]["median"] < 0.1 * fv[2.0]["median"]
    assert abs(fine[2.0]["min_ratio"] - 1) < 1e-3


def test_anchors_cut_the_error_of_the_semi_lagrangian_transport():
    """Against the exact solution at nside 16, t = 4: g interpolated every 1.0 (paths in steps of
    0.1) is more than 10× closer in the 90th percentile than g interpolated every 0.2, whose
    interpolation errors add up (0.036 against 0.0008 measured)."""
    every, _ = tails.semi_lagrangian_run(16, 0.2, times=(4.0,))
    anchored, _ = tails.semi_lagrangian_run(16, 0.2, times=(4.0,), anchor=1.0, path_step=0.1)
    assert anchored[4.0]["p90"] < every[4.0]["p90"] / 10
    # the composed maps interpolate the smooth maps at every step, g at the anchors only: between
    # the two (0.0033 measured), and their error falls with the mesh (0.00043 at nside 32)
    maps, _ = tails.semi_lagrangian_run(16, 0.2, times=(4.0,), anchor=1.0, path_step=0.1, maps=True)
    assert anchored[4.0]["p90"] < maps[4.0]["p90"] < every[4.0]["p90"] / 5
    finer, _ = tails.semi_lagrangian_run(32, 0.2, times=(4.0,), anchor=1.0, path_step=0.1, maps=True)
    assert finer[4.0]["p90"] < maps[4.0]["p90"] / 2 ** 1.5  # observed order ≥ 1.5


def test_the_coupled_tails_keep_the_mass():
    """The prototype coupling rewrites the tail cells after every interval and scales the bulk
    (cells and atoms): the solver's mass guard (1e-10 relative, every step) stays silent, and the
    measure concentrates on E as without the coupling (β = 10, nside 8, t ≤ 3)."""
    onset, e_max, _, _, share, _, _, _ = tails.coupled_f_onset(8, beta=10.0, dt=0.25, t_end=3.0)
    plain, e_plain, *_ = tails.coupled_f_onset(8, beta=10.0, dt=0.25, t_end=3.0, coupled=False)
    assert math.isnan(onset) and math.isnan(plain)
    assert e_max > 0.9 and abs(e_max - e_plain) < 0.02
    assert 0.0 <= share < 1.0


def test_the_shadow_tails_measure_the_run_without_touching_it():
    """shadow=True advances g beside the finite volumes without substituting: the run (its E
    alignment, its atoms) is the plain run exactly, and the drift of its tails from their own
    characteristics at t = 4 is a finite, positive number of decades."""
    plain = tails.coupled_f_onset(8, beta=10.0, dt=0.25, t_end=4.0, coupled=False)
    shadow = tails.coupled_f_onset(8, beta=10.0, dt=0.25, t_end=4.0, coupled=False, shadow=True)
    assert shadow[1:3] == plain[1:3] and shadow[6] == plain[6]
    assert plain[7] == {} and 0.0 < shadow[7][4] < 10.0


def test_a_run_file_gives_the_rows_of_the_solver_driven_directly(tmp_path):
    """hybrid_series_of_run reads a `spherepde run` file of the tails sweep's config into the rows
    hybrid_series computes from the solver itself: the same run (min f and the tail cells at every
    save equal), the alignments to the quadrature's O(h²) (the file's integrate |Qx|² over each
    cell, hybrid_series takes the centroids)."""
    from spherepde.cli import main

    text = (REPO / "solvers" / "sweeps" / "tails_convergence.toml").read_text()
    base = text[text.index("[base.model]"):text.index("[sweep.grid]")].replace("[base.", "[")
    cfg = tmp_path / "tails.toml"
    cfg.write_text(base.replace("nside = 16", "nside = 8").replace("t_end = 20.0", "t_end = 3.0") + """
[initial]
kind = "projected_normal"
mean = [0.3, 0.2, 0.1]
cov = [[1.0, 0.2, 0.0], [0.2, 0.8, 0.0], [0.0, 0.0, 0.6]]
""")
    run = tmp_path / "tails-0000.nc"  # a sweep's run id
    assert main(["run", str(cfg), "-o", str(run)]) == 0
    from_file = tails.hybrid_series_of_run(run)["rows"]
    direct = tails.hybrid_series(8, 30.0, {"interval": 0.2, **tails.EVERY_COUPLING}, t_end=3.0, save_every=0.2)["rows"]
    assert [r["t"] for r in from_file] == pytest.approx([r["t"] for r in direct], abs=1e-12)
    for a, b in zip(from_file, direct):
        assert a["min_f"] == pytest.approx(b["min_f"], rel=1e-12) and a["tail_cells"] == b["tail_cells"]
        assert abs(a["E"] - b["E"]) < 1e-2 and abs(a["F"] - b["F"]) < 1e-2
        assert 0.0 <= a["w2_across"] <= a["w2"]  # a part of W₂², recorded in the file
    assert any(r["tail_cells"] > 0 for r in direct)
    cache = tmp_path / "cache"
    cache.mkdir()
    (tmp_path / "tails.nc").write_bytes(b"the sweep's combined file: not a run file")
    assert tails.import_runs(tmp_path, cache) == [run]  # kept once, as the run file's variant
    kept = tails.hybrid_key(cache, 8, 30.0, tails.RUN_FILE_VARIANT, "projected normal")
    assert kept.is_file() and tails.import_runs(tmp_path, cache) == []
    # a run with anchors (tail_anchor > 0: tails_anchored.toml) is kept as the anchored variant
    anchored = tmp_path / "anchored"
    anchored.mkdir()
    cfg.write_text(cfg.read_text().replace("tail_anchor = 0.0", "tail_anchor = 1.0").replace(
        "tail_path_step = 1.0", "tail_path_step = 0.1").replace('tail_paths = "maps"', 'tail_paths = "retrace"'))
    assert main(["run", str(cfg), "-o", str(anchored / "tails-0000.nc")]) == 0
    assert tails.import_runs(anchored, cache) == [anchored / "tails-0000.nc"]
    assert tails.hybrid_key(cache, 8, 30.0, tails.RUN_FILE_ANCHORED, "projected normal").is_file()
    # and one with the composed maps (tails_maps.toml) as the maps' variant
    maps = tmp_path / "maps"
    maps.mkdir()
    cfg.write_text(cfg.read_text().replace('tail_paths = "retrace"', 'tail_paths = "maps"'))
    assert main(["run", str(cfg), "-o", str(maps / "tails-0000.nc")]) == 0
    assert tails.import_runs(maps, cache) == [maps / "tails-0000.nc"]
    assert tails.hybrid_key(cache, 8, 30.0, tails.RUN_FILE_MAPS, "projected normal").is_file()
    # an unfinished run is kept only when asked (partial), and replaced once a complete one is there
    import shutil

    import netCDF4

    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    shutil.copy(maps / "tails-0000.nc", unfinished / "tails-0000.nc")
    with netCDF4.Dataset(unfinished / "tails-0000.nc", "a") as nc:
        nc.setncattr("complete", 0)
    fresh = tmp_path / "fresh_cache"
    fresh.mkdir()
    assert tails.import_runs(unfinished, fresh) == []
    assert tails.import_runs(unfinished, fresh, partial=True) == [unfinished / "tails-0000.nc"]
    key = tails.hybrid_key(fresh, 8, 30.0, tails.RUN_FILE_MAPS, "projected normal")
    assert json.loads(key.read_text())["partial"] is True
    assert tails.import_runs(maps, fresh) == [maps / "tails-0000.nc"]
    assert json.loads(key.read_text())["partial"] is False and tails.import_runs(maps, fresh) == []


def test_a_run_file_is_kept_as_the_variant_of_its_settings():
    """The settings of the tails sweeps map to their variants; atoms other than points cut at the
    floor only in the sigma sweep's combination (tails_sigma.toml), others to none."""
    sweeps = REPO / "solvers" / "sweeps"
    for name, variant in [("tails_convergence", tails.RUN_FILE_VARIANT), ("tails_anchored", tails.RUN_FILE_ANCHORED),
                          ("tails_maps", tails.RUN_FILE_MAPS), ("tails_sigma", tails.RUN_FILE_SIGMA),
                          ("tails_clusters", tails.RUN_FILE_CLUSTERS), ("tails_selective", tails.RUN_FILE_SELECTIVE),
                          ("tails_bounded", tails.RUN_FILE_BOUNDED)]:
        base = tomllib.loads((sweeps / f"{name}.toml").read_text())["base"]
        eul = resolve({"model": base["model"], "eulerian": base["eulerian"], "time": base["time"]})["eulerian"]
        assert tails.run_file_variant(eul) == variant, name
    maps = {"tail_anchor": 1.0, "tail_paths": "maps"}
    assert tails.run_file_variant({**maps, "atom_shape": "sigma", "atom_cut": "floor"}) is None
    assert tails.run_file_variant({**maps, "atom_shape": "point", "atom_cut": "tail"}) is None
    assert tails.run_file_variant({"tail_anchor": 0.0, "atom_shape": "sigma", "atom_cut": "tail"}) is None
    assert tails.run_file_variant({}) == tails.RUN_FILE_VARIANT  # a file from before these keys
    sigma = {**maps, "atom_shape": "sigma", "atom_cut": "tail"}
    assert tails.run_file_variant({**sigma, "tail_reference": "clusters", "tail_interval": 0.2}) is None
    assert tails.run_file_variant({**sigma, "tail_reference": "mesh", "tail_interval": 0.05}) is None
    assert tails.run_file_variant({"tail_reference": "clusters"}) is None
    bounded = {**sigma, "tail_follow_bounds": "neighbours"}
    assert tails.run_file_variant({**bounded, "tail_reference": "clusters", "tail_interval": 0.05}) == tails.RUN_FILE_BOUNDED
    assert tails.run_file_variant({**bounded, "tail_reference": "mesh", "tail_interval": 0.2}) is None
    clusters_bounded = {**bounded, "tail_reference": "clusters", "tail_interval": 0.05}
    assert tails.run_file_variant({**clusters_bounded, "tail_exclusion_width": 1.0}) is None  # tails_exclusion.toml
    assert tails.run_file_variant({**clusters_bounded, "tail_path_scheme": "heun"}) is None
    # the field of the measure between couplings is no variant's (all ran the fields linear)
    assert tails.run_file_variant({**clusters_bounded, "tail_field_between": "measure"}) is None
    assert tails.run_file_variant({**clusters_bounded, "tail_field_between": "steps"}) is None
    assert tails.run_file_variant({"tail_anchor": 5.0, "tail_paths": "backtrack"}) is None  # nor the backtracked maps
    assert tails.run_file_variant({**clusters_bounded, "tail_field_between": "linear"}) == tails.RUN_FILE_BOUNDED
    selective = {**sigma, "tail_reference": "clusters", "tail_interval": 0.05, "tail_paths": "selective",
                 "tail_follow_bounds": "neighbours"}
    assert tails.run_file_variant({**selective, "tail_anchor": 5.0, "tail_retrace_tolerance": 0.01}) == tails.RUN_FILE_SELECTIVE
    assert tails.run_file_variant({**selective, "tail_anchor": 5.0, "tail_retrace_tolerance": 0.001}) is None
    assert tails.run_file_variant({**selective, "tail_retrace_tolerance": 0.01}) is None  # anchors every 1.0


def test_every_hybrid_key_is_a_file_name_of_its_own(tmp_path):
    """Every variant's cached file, for every law, mesh and β of the reports, has a name short
    enough for the file system (the selective variant's full name is not) and its own."""
    keys = {tails.hybrid_key(tmp_path, n, beta, name, law)
            for name in tails.HYBRID_VARIANTS for law in tails.HYBRID_LAWS for n in (8, 16, 32, 64)
            for beta in (10.0, 30.0, 1000.0)}
    assert len(keys) == len(tails.HYBRID_VARIANTS) * len(tails.HYBRID_LAWS) * 4 * 3
    assert max(len(k.name.encode()) for k in keys) <= tails.MAX_KEY_BYTES
    for key in keys:
        assert not key.exists()  # a name the file system takes
    short = tails.hybrid_key(tmp_path, 16, 30.0, "finite volumes + atoms")
    assert short.name == "beta30_nside16_finite_volumes_and_atoms.json"  # as kept before


def test_hybrid_variants_hand_their_solver_options_to_the_solver():
    """A variant's solver settings (near-field profile, velocity tolerance, atom options) go to the
    EulerianSolver, the rest to LogTails; every variant's tails options are LogTails arguments."""
    import inspect

    from spherepde.solvers.tails import LogTails

    accepted = set(inspect.signature(LogTails).parameters)
    for name, options in tails.HYBRID_VARIANTS.items():
        tails_options, save_every, solver = tails.hybrid_options(options)
        assert save_every > 0 and set(solver) <= set(tails.SOLVER_OPTIONS)
        assert tails_options is None or set(tails_options) <= accepted, name
    _, _, solver = tails.hybrid_options(tails.HYBRID_VARIANTS[
        "tails from log f, coupling every 0.2 (saves every 0.2), f constant in the near cells"])
    assert solver == {"near_field_profile": "constant"}
    _, _, solver = tails.hybrid_options(tails.HYBRID_VARIANTS[
        "tails from log f, coupling every 0.2 (saves every 0.2), atoms from 1e-6"])
    assert solver == {"atoms": {"min_mass": 1e-6}}


def test_the_drift_toward_the_cone_is_the_slope_of_the_late_run():
    """⟨Bz, z⟩ = −1 + 0.01 t with no F-phase: the slope over the second half is 0.01 per unit
    time, and at that rate the heaviest atom reaches the cone ⟨Bz, z⟩ = 0 at t = 100."""
    rows = [{"t": t, "E": 0.99, "F": 0.0, "x2": 1e-4, "q": -1.0 + 0.01 * t} for t in np.arange(0.0, 30.01, 0.2)]
    summary = tails.hybrid_summary(rows)
    assert summary["q_rate"] == pytest.approx(0.01, rel=1e-9)
    assert not math.isfinite(summary["onset"])
    assert tails._drift(summary) == "+0.0100/unit, cone at t ≈ 100; 1.0e-04"
    # runs kept before ⟨Bz, z⟩ was recorded have no drift
    assert tails._drift(tails.hybrid_summary([{k: v for k, v in r.items() if k != "q"} for r in rows])) == "—"


def test_the_bottom_of_the_w2_u_curve_and_a_run_that_ends_early():
    """W₂(ρ_t, Π#ρ₀) = (t − 3)² + 0.05 on the save times: its bottom is 0.05 at t = 3; rows without
    W₂ (runs kept before it was recorded) give "—"; a run ending at 14 in a table of t ≤ 20 says so."""
    rows = [{"t": t, "E": 0.99, "F": 0.0, "x2": 1e-4, "w2": (t - 3.0) ** 2 + 0.05} for t in np.arange(0.0, 14.01, 0.2)]
    summary = tails.hybrid_summary(rows)
    assert (summary["w2_min"], summary["t_w2_min"]) == pytest.approx((0.05, 3.0), abs=1e-12)
    assert tails._w2_bottom(summary) == "0.0500 at 3"
    assert tails._w2_bottom(tails.hybrid_summary([{k: v for k, v in r.items() if k != "w2"} for r in rows])) == "—"
    assert tails._ended_early(summary, 20.0) == " (at t = 14)"
    assert tails._ended_early(summary, 14.0) == ""
