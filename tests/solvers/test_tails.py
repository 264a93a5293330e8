"""Tails of the density from log f (spherepde.solvers.tails, `[eulerian] tails = "log"`): the hybrid
state keeps the mass, repeats itself on resume, is the finite-volume run when nothing is
substituted, carries the characteristics' g exactly, and is accurate relative to f in the tails
of the exact β = ∞ solution where the finite volumes are not."""

import json
import math
import warnings

import healpy as hp
import numpy as np
import pytest
from run_configs import PAPER_VMF_CONFIG
from run_helpers import ROUND_OFF, interrupt_after, run_difference

from spherepde.analysis.exact import zero_temperature_density
from spherepde.cli import main
from spherepde.geometry.mesh import HealpixMesh
from spherepde.models.attention import AttentionModel
from spherepde.models.initial import ProjectedNormal, Uniform
from spherepde.runner.config import ADDED_KEYS, ConfigError, difference, resolve
from spherepde.solvers.controller import SolverState
from spherepde.solvers.eulerian import EulerianSolver
from spherepde.solvers.tails import TAIL_ANCHOR, TAIL_PATH_STEP, LogTails, coupling_schedule, coupling_times
from spherepde.storage.runfile import open_run
from spherepde.transport.semi_lagrangian import PolynomialInterpolant, advance_log_density
from spherepde.validation.tails import exact_cell_averages, zero_temperature_field_of

PAPER_V = np.diag([-1.0, 1.0, -2.0])
PAPER_B = np.diag([-1.0, -1.0, 1.0])
LAW = ProjectedNormal([0.3, 0.2, 0.1], [[1.0, 0.2, 0.0], [0.2, 0.8, 0.0], [0.0, 0.0, 0.6]])


def test_coupling_times_cut_the_interval_into_equal_parts():
    assert coupling_times(0.0, 0.25, 0.1) == pytest.approx([0.25 / 3, 0.5 / 3, 0.25])
    assert coupling_times(1.0, 1.1, 0.1)[-1] == 1.1 and len(coupling_times(1.0, 1.1, 0.1)) == 1
    times = coupling_times(2.0, 3.0, 0.3)
    assert times[-1] == 3.0 and len(times) == 4 and np.all(np.diff([2.0, *times]) <= 0.3)


def test_couplings_are_as_far_apart_as_the_interval_allows_whatever_the_saves():
    """Saves every 0.1 with interval 0.2 couple at every other save (each coupling interpolates g
    once); a long save interval is cut into equal parts; the last save always couples."""
    times = [round(0.1 * k, 12) for k in range(11)]
    schedule = coupling_schedule(times, 0.2)
    assert [c for cs in schedule for c in cs] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    schedule = coupling_schedule([0.0, 0.5, 0.6, 0.7, 0.75], 0.2)
    assert schedule[0] == pytest.approx((0.5 / 3, 1.0 / 3, 0.5)) and schedule[1:] == [(), (0.7,), (0.75,)]
    flat = [0.0, *(c for cs in coupling_schedule([0.0, 0.15, 0.3, 0.45, 1.0], 0.2) for c in cs)]
    assert flat[-1] == 1.0 and np.all(np.diff(flat) <= 0.2 + 1e-12) and len(flat) == 7


def _finite_beta_run(tails, times, start=None, nside=8, velocity_tolerance=1e-3):
    mesh = HealpixMesh(nside)
    solver = EulerianSolver(mesh, AttentionModel(PAPER_B, PAPER_V, 30.0), velocity_tolerance=velocity_tolerance,
                            atoms={}, tails=tails)
    log_f0 = np.log(LAW.density(mesh.centroids))
    out = []
    for k, t, f, rec in solver.snapshots(LAW.cell_averages(mesh), times, start=start, log_f0=log_f0):
        state = solver.atoms.state()
        if solver.tails is not None:
            state = dict(state, log_density=solver.tails.g.copy(), log_density_rate=solver.tails.rate.copy())
        out.append((k, t, f.copy(), dict(rec), state, None if solver.tails is None else solver.tails.g.copy(),
                    solver.total_mass(f)))
    return out


@pytest.fixture(scope="module")
def beta30():
    """β = 30, the paper's matrices, the projected-normal law, nside 8, to t = 6 with tails."""
    return _finite_beta_run({}, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0])


def test_mass_is_kept_and_f_stays_positive(beta30):
    assert any(rec["tail_cells"] > 0 for *_, rec, _, _, _ in [s[:4] + s[4:] for s in beta30])
    for k, t, f, rec, state, g, mass in beta30:
        assert abs(mass - 1.0) < 1e-13, (t, mass)
        assert f.min() > 0 and np.all(np.isfinite(g))
    substituted = [s[3]["tail_cells"] for s in beta30]
    assert substituted[0] == 0 and max(substituted) > 50


def test_resume_from_a_snapshot_repeats_the_run(beta30):
    """The state of snapshot 3 (density, atoms, log density and its rate, records) continues
    exactly; without the rate a run that follows g refuses to continue."""
    k, t, f, rec, state, g, _ = beta30[3]
    start = SolverState.from_record(k, f, rec, state)
    without_rate = SolverState.from_record(k, f, rec, {n: v for n, v in state.items() if n != "log_density_rate"})
    with pytest.raises(ValueError, match="log_density_rate"):
        _finite_beta_run({}, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0], start=without_rate)
    resumed = _finite_beta_run({}, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0], start=start)
    with pytest.raises(ValueError, match="at a coupling time, not t = 2.5"):  # saves 0.5, couplings 1.0 apart
        _finite_beta_run({"interval": 1.0}, [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5], start=SolverState.from_record(
            5, f, rec, state))
    for (_, _, f_a, rec_a, _, g_a, _), (_, _, f_b, rec_b, _, g_b, _) in zip(beta30[4:], resumed):
        assert np.array_equal(f_a, f_b) and np.array_equal(g_a, g_b)
        assert rec_a["tail_cells"] == rec_b["tail_cells"]


def test_nothing_substituted_is_the_finite_volume_run():
    """Tail level below every density and couplings at the save times only: bit for bit the run
    without tails (the coupling then changes nothing, and no step is cut)."""
    times = [0.0, 0.5, 1.0, 1.5]
    plain = _finite_beta_run(None, times)
    idle = _finite_beta_run({"level": 1e-300, "interval": 0.5}, times)
    for a, b in zip(plain, idle):
        assert np.array_equal(a[2], b[2]) and b[3]["tail_cells"] == 0


def test_the_level_is_relative_to_the_mesh_or_to_the_whole_measure():
    """reference "measure": an atom of mass m counts as a peak of density m / (cell area), so the
    cells below level × that take g although the mesh's own largest f fell when the atom formed."""
    from spherepde.solvers.tails import LogTails

    class OneAtom:
        count = 1

        def points(self):
            return np.array([[1.0, 0.0, 0.0]]), np.array([0.5])

    mesh = HealpixMesh(4)
    model = AttentionModel(PAPER_B, PAPER_V, math.inf)
    f = np.full(mesh.npix, 0.01)
    assert LogTails(mesh, model)._largest(f, OneAtom()) == 0.01
    assert LogTails(mesh, model, reference="measure")._largest(f, OneAtom()) == pytest.approx(0.5 / mesh.area)
    assert LogTails(mesh, model, reference="measure")._largest(f, None) == 0.01
    with pytest.raises(ValueError, match="reference must be"):
        LogTails(mesh, model, reference="atoms")


def test_the_clusters_peak_grows_by_liouville_and_the_level_does_not_fall_at_an_atom():
    """reference "clusters" at β = ∞ from the uniform law: the atoms at ±e₁ stand for the exact
    maximum f_t(±e₁) = e^{5t}/(4π) (div_S v = tr M − 3xᵀMx = −5 there), so their peak log densities
    grow at rate 5 between couplings, to round-off (the atoms sit at the fixed points); each starts
    from the mesh's largest f before it was made, and the level never falls below the mesh's."""
    from spherepde.solvers.tails import LogTails

    mesh = HealpixMesh(8)
    model = AttentionModel(PAPER_B, PAPER_V, math.inf)
    solver = EulerianSolver(mesh, model, atoms={}, tails={"reference": "clusters"})
    times = [0.0, 1.0, 2.0, 2.2, 2.4, 3.0]
    out = {}
    for _, t, f, _ in solver.snapshots(Uniform().cell_averages(mesh), times):
        out[t] = (f.copy(), solver.tails.peak_state(), solver.atoms.positions.copy(), solver.atoms.alive.copy())
    _, peaks, x, alive = out[2.4]
    on_axis = alive & (np.abs(x[:, 0]) > 1 - 1e-9)
    _, before, _, alive_before = out[2.2]
    both = on_axis & alive_before
    assert both.sum() == 2 and np.allclose(peaks[both] - before[both], 5 * 0.2, rtol=0, atol=1e-9)
    for t, (f, peaks, _, alive) in out.items():
        assert np.all(np.isfinite(peaks[alive])) and np.all(np.isnan(peaks[~alive]))
        if alive.any():
            assert np.exp(peaks[alive].max()) > f.max()  # the level is above the mesh's
    assert LogTails(mesh, model, reference="clusters")._largest(np.full(mesh.npix, 0.01), None) == 0.01
    # a peak log density past the largest float (β = 1000 after t ≈ 10) gives a finite level, silently
    tails = LogTails(mesh, model, reference="clusters")
    tails.peaks = np.array([800.0, np.nan])

    class Atoms:
        count, alive = 1, np.array([True, False])

    with np.errstate(over="raise"):
        top = tails._largest(np.full(mesh.npix, 0.01), Atoms())
    assert math.isfinite(top) and top == math.exp(709.0)


def test_tails_need_atoms_one_head_and_no_noise():
    mesh = HealpixMesh(4)
    with pytest.raises(ValueError, match="need atoms"):
        EulerianSolver(mesh, AttentionModel(PAPER_B, PAPER_V, 10.0), tails={})


# ---------------------------------------------------------------------- the exact β = ∞ solution
@pytest.fixture(scope="module")
def zero_temperature():
    """β = ∞ from the uniform law at nside 8 with and without tails: (mesh, model, {t: (f_fv, f_tails, g)})."""
    mesh = HealpixMesh(8)
    model = AttentionModel(PAPER_B, PAPER_V, math.inf)
    f0 = Uniform().cell_averages(mesh)
    times = [0.0, 2.0, 3.0, 4.0]
    plain = {t: f.copy() for _, t, f, _ in EulerianSolver(mesh, model, atoms={}).snapshots(f0, times)}
    solver = EulerianSolver(mesh, model, atoms={}, tails={})
    out = {}
    for _, t, f, rec in solver.snapshots(f0, times):
        out[t] = (plain[t], f.copy(), solver.tails.g.copy(), solver.tails.tail.copy())
    return mesh, model, out


def test_g_is_the_characteristics_log_density(zero_temperature):
    """At β = ∞ the field of g's paths is local (v = P_x(Mx), div_S v = tr M − 3xᵀMx for B
    orthogonal), the same for any state: g is the semi-Lagrangian transport in that exact field,
    written out here, outside the cells near the atoms (where g is reset to log f)."""
    mesh, model, out = zero_temperature
    interpolant = PolynomialInterpolant(mesh)
    field = zero_temperature_field_of(PAPER_V @ PAPER_B.T)

    g = np.full(mesh.npix, -math.log(4 * math.pi))
    # the default couplings every 0.2 with anchors every 1.0: g interpolated at t = 0 and 1 only,
    # its paths from there in RK4 steps of 0.1
    for anchor in (0.0, 1.0):
        g = advance_log_density(interpolant, g, field, anchor, TAIL_ANCHOR, round(TAIL_ANCHOR / TAIL_PATH_STEP))
    f_fv, f_tails, g_tails, _ = out[2.0]
    far = np.abs(mesh.centroids[:, 0]) < 0.5  # > 60° from ±e₁, where the atoms are
    assert np.max(np.abs(g_tails[far] - g[far])) < 1e-10


def test_tails_are_accurate_relative_to_f_where_the_finite_volumes_are_not(zero_temperature):
    """The exact solution f_t = e^{2t}/(4π|e^{−tM}y|³): over the substituted tail cells the
    relative error of the cell averages is small, where the finite volumes' is tens of percent;
    min f within 2 % at this coarse mesh (the finite volumes: 30 % high at t = 4)."""
    mesh, model, out = zero_temperature
    for t in (3.0, 4.0):
        f_fv, f_tails, g, tail = out[t]
        exact = exact_cell_averages(mesh, zero_temperature_density(model, Uniform(), t))
        substituted = tail & np.isfinite(exact)
        assert substituted.sum() > 100
        err_tails = np.abs(f_tails[substituted] / exact[substituted] - 1.0)
        err_fv = np.abs(f_fv[substituted] / exact[substituted] - 1.0)
        assert np.median(err_tails) < 0.02 < 0.1 < np.median(err_fv), (t, np.median(err_tails), np.median(err_fv))
        assert abs(f_tails.min() / np.nanmin(exact) - 1.0) < 0.02 < 0.2 < abs(f_fv.min() / np.nanmin(exact) - 1.0)


def test_between_couplings_the_tail_follows_g_closer_than_the_finite_volumes():
    """β = ∞, uniform law, nside 16, couplings every 0.1: at each coupling the tail cells' values
    reached since the last one are compared with ⟨e^g⟩ of the characteristics (accurate against
    the exact solution: the test above), as tail_drift (90th percentile, decades). Followed at
    g's rate they stay within 0.03 decades; moved by the finite volumes they drift 2× farther
    and more once the tails steepen (t ≥ 3.5)."""
    mesh = HealpixMesh(16)
    model = AttentionModel(PAPER_B, PAPER_V, math.inf)
    times = [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0]
    drift = {}
    for follow in (False, True):
        solver = EulerianSolver(mesh, model, atoms={}, tails={"follow": follow, "interval": 0.1})
        runs = solver.snapshots(Uniform().cell_averages(mesh), times)
        drift[follow] = {t: rec["tail_drift"] for _, t, _, rec in runs}
    late = [t for t in times if t >= 3.5]
    assert all(drift[True][t] < 0.03 for t in late), drift[True]
    assert all(drift[False][t] > 2 * drift[True][t] for t in late), drift


# ---------------------------------------------------------------------- config and run file
TAILS = PAPER_VMF_CONFIG.replace("beta = 10.0", "beta = 30.0") + """
[eulerian]
nside = 4
tails = "log"
velocity_tolerance = 1e-3

tail_interval = 0.2
tail_anchor = 1.0  # (the default 5.0 has no anchor after t = 0 here)

[time]
t_end = 1.2
save_every = 0.1
"""


def test_config_refuses_tails_without_atoms_or_with_heads():
    with pytest.raises(ConfigError, match=r"\[eulerian\] tails: must be"):
        resolve({"model": {"beta": 1.0, "B": "identity", "V": "identity"}, "eulerian": {"tails": "logf"},
                  "time": {"t_end": 1.0, "save_every": 0.5}})
    with pytest.raises(ConfigError, match=r"\[eulerian\] tails: \"log\" needs atoms"):
        resolve({"model": {"beta": 1.0, "B": "identity", "V": "identity"},
                 "eulerian": {"tails": "log", "atoms": False}, "time": {"t_end": 1.0, "save_every": 0.5}})
    with pytest.raises(ConfigError, match=r"\[eulerian\] tail_interval"):
        resolve({"model": {"beta": 1.0, "B": "identity", "V": "identity"},
                 "eulerian": {"tails": "log", "tail_interval": 0.0}, "time": {"t_end": 1.0, "save_every": 0.5}})
    for key, value in (("tail_anchor", -0.5), ("tail_anchor", 6.0), ("tail_path_step", 0.0), ("tail_path_step", 2.0),
                       ("tail_paths", "compose"), ("tail_substeps", 0), ("tail_substeps", 2.5), ("tail_substeps", 17),
                       ("tail_reference", "measure"), ("tail_step_states", "events")):
        with pytest.raises(ConfigError, match=rf"\[eulerian\] {key}"):
            resolve({"model": {"beta": 1.0, "B": "identity", "V": "identity"},
                     "eulerian": {"tails": "log", key: value}, "time": {"t_end": 1.0, "save_every": 0.5}})
    with pytest.raises(ConfigError, match=r"\[eulerian\] tail_follow: must be true or false"):
        resolve({"model": {"beta": 1.0, "B": "identity", "V": "identity"},
                 "eulerian": {"tails": "log", "tail_follow": "yes"}, "time": {"t_end": 1.0, "save_every": 0.5}})


def test_a_run_file_with_tails_resumes_to_the_same_result(tmp_path, capsys):
    cfg = tmp_path / "tails.toml"
    cfg.write_text(TAILS)
    ref, out = tmp_path / "ref.nc", tmp_path / "out.nc"
    assert main(["run", str(cfg), "-o", str(ref)]) == 0
    ds = open_run(ref)
    assert ds["log_density"].dims == ("time", "cell") and "tail_cells" in ds and ds.attrs["tails"] == "log"
    assert np.all(np.isfinite(ds["log_density"].values))
    # saves every 0.1, couplings every 0.2: log_density is of the last coupling; g interpolated
    # every 1.0 (tail_anchor): the paths of the couplings (the defaults: backtracked maps through
    # the steps' states) start at the last anchor
    assert ds["log_density_time"].values == pytest.approx(np.floor(ds["time"].values / 0.2 + 1e-9) * 0.2)
    assert ds["log_density_anchor"].values == pytest.approx(np.floor(ds["time"].values + 1e-9))
    interrupt_after(cfg, out, 13)  # t = 0 … 1.2 minus the last: the run continues from the anchor t = 1
    assert main(["run", str(cfg), "-o", str(out), "--resume"]) == 0
    assert "resumed from snapshot 10 (t = 1)" in open_run(out).attrs["history"]
    assert run_difference(out, ref) <= ROUND_OFF
    # the composed maps between anchors, through the states after every step: the resumed run
    # repeats them from the anchor
    maps = tmp_path / "maps.toml"
    maps.write_text(TAILS.replace("tail_interval = 0.2", 'tail_interval = 0.2\ntail_paths = "maps"\ntail_substeps = 2'))
    ref, out = tmp_path / "ref_maps.nc", tmp_path / "out_maps.nc"
    assert main(["run", str(maps), "-o", str(ref)]) == 0
    assert open_run(ref).attrs["tail_paths"] == "maps" and open_run(ref).attrs["tail_substeps"] == 2
    one = tmp_path / "one.toml"  # the key reaches the solver: one state per coupling gives another g
    one.write_text(maps.read_text().replace("tail_substeps = 2", "tail_substeps = 1"))
    assert main(["run", str(one), "-o", str(tmp_path / "one.nc")]) == 0
    assert not np.array_equal(open_run(tmp_path / "one.nc")["log_density"].values, open_run(ref)["log_density"].values)
    interrupt_after(maps, out, 13)
    assert main(["run", str(maps), "-o", str(out), "--resume"]) == 0
    assert "resumed from snapshot 10 (t = 1)" in open_run(out).attrs["history"]
    assert run_difference(out, ref) <= ROUND_OFF
    # the selective paths: the states since the anchor are rebuilt by the couplings the resumed run repeats
    selective = tmp_path / "selective.toml"
    selective.write_text(TAILS.replace("tail_interval = 0.2", 'tail_interval = 0.2\ntail_paths = "selective"\n'
                                       "tail_retrace_tolerance = 0.001"))
    ref, out = tmp_path / "ref_selective.nc", tmp_path / "out_selective.nc"
    assert main(["run", str(selective), "-o", str(ref)]) == 0
    ds = open_run(ref)
    assert ds.attrs["tail_paths"] == "selective" and ds.attrs["tail_retrace_tolerance"] == 0.001
    assert ds["tail_retraced"].values.max() > 0 and "tail_retraced" not in open_run(tmp_path / "ref_maps.nc")
    interrupt_after(selective, out, 13)
    assert main(["run", str(selective), "-o", str(out), "--resume"]) == 0
    assert "resumed from snapshot 10 (t = 1)" in open_run(out).attrs["history"]
    assert run_difference(out, ref) <= ROUND_OFF
    # the backtracked paths: the maps of the couplings since the anchor too are rebuilt by the resumed run
    backtrack = tmp_path / "backtrack.toml"
    backtrack.write_text(selective.read_text().replace('tail_paths = "selective"', 'tail_paths = "backtrack"'))
    ref, out = tmp_path / "ref_backtrack.nc", tmp_path / "out_backtrack.nc"
    assert main(["run", str(backtrack), "-o", str(ref)]) == 0
    ds = open_run(ref)
    assert ds.attrs["tail_paths"] == "backtrack" and ds["tail_retraced"].values.max() > 0
    interrupt_after(backtrack, out, 13)
    assert main(["run", str(backtrack), "-o", str(out), "--resume"]) == 0
    assert "resumed from snapshot 10 (t = 1)" in open_run(out).attrs["history"]
    assert run_difference(out, ref) <= ROUND_OFF
    # g interpolated at every coupling (tail_anchor = 0, the files before anchors): from the last coupling
    every = tmp_path / "every.toml"
    every.write_text(TAILS.replace("tail_anchor = 1.0", "tail_anchor = 0.0"))
    ref, out = tmp_path / "ref0.nc", tmp_path / "out0.nc"
    assert main(["run", str(every), "-o", str(ref)]) == 0
    assert "log_density_anchor" not in open_run(ref)  # the layout of the files before the key
    interrupt_after(every, out, 4)  # t = 0 … 0.3: the run continues from t = 0.2, the last coupling
    assert main(["run", str(every), "-o", str(out), "--resume"]) == 0
    assert "resumed from snapshot 2 (t = 0.2)" in open_run(out).attrs["history"]
    assert run_difference(out, ref) <= ROUND_OFF
    # the level relative to the clusters' peaks: their log densities are part of the state
    clusters = tmp_path / "clusters.toml"
    clusters.write_text(TAILS.replace("tail_interval = 0.2", 'tail_interval = 0.2\ntail_reference = "clusters"'))
    ref, out = tmp_path / "ref_clusters.nc", tmp_path / "out_clusters.nc"
    assert main(["run", str(clusters), "-o", str(ref)]) == 0
    ds = open_run(ref)
    assert ds.attrs["tail_reference"] == "clusters" and ds["atom_peak_log_density"].dims == ("time", "atom")
    at_coupling = np.isclose(ds["log_density_time"].values, ds["time"].values)  # new atoms get a peak there
    alive = (ds["atom_mass"].values > 0) & at_coupling[:, None]
    assert alive.any() and np.all(np.isfinite(ds["atom_peak_log_density"].values[alive]))
    interrupt_after(clusters, out, 13)
    assert main(["run", str(clusters), "-o", str(out), "--resume"]) == 0
    assert "resumed from snapshot 10 (t = 1)" in open_run(out).attrs["history"]
    assert run_difference(out, ref) <= ROUND_OFF


def test_a_file_with_the_anchor_record_at_tail_anchor_0_resumes(tmp_path, monkeypatch):
    """Files written at tail_anchor = 0 while the layout still had log_density_anchor (equal to
    log_density_time there): the resumed run writes the record on, and its digests hold."""
    from spherepde.runner import run as run_module
    from spherepde.storage.schema import TAIL_META

    every = tmp_path / "every.toml"
    every.write_text(TAILS.replace("tail_anchor = 1.0", "tail_anchor = 0.0"))
    ref, out = tmp_path / "ref.nc", tmp_path / "out.nc"
    with monkeypatch.context() as patch:  # the layout of those files
        patch.setattr(run_module, "tail_records", lambda eul: dict(TAIL_META))
        assert main(["run", str(every), "-o", str(ref)]) == 0
        interrupt_after(every, out, 4)
    assert "log_density_anchor" in open_run(out)
    assert main(["run", str(every), "-o", str(out), "--resume"]) == 0
    ds = open_run(out)
    assert "resumed from snapshot 2 (t = 0.2)" in ds.attrs["history"]
    assert np.array_equal(ds["log_density_anchor"].values, ds["log_density_time"].values)
    assert run_difference(out, ref) <= ROUND_OFF  # open_run verifies the snapshots' digests


def test_paths_in_substeps_interpolate_g_once_and_converge_in_time():
    """advance_log_density with substeps: in the exact β = ∞ field (time-independent) the paths
    of 4 substeps of 0.1 land where one step of 0.1 four times would, within RK4's error, while
    g is interpolated once; one substep is the former single step bit for bit."""
    mesh = HealpixMesh(8)
    M = PAPER_V @ PAPER_B.T
    field = zero_temperature_field_of(M)
    interp = PolynomialInterpolant(mesh)
    g = np.full(mesh.npix, -math.log(4 * math.pi))
    one = advance_log_density(interp, g, field, 0.0, 0.4)
    assert np.array_equal(one, advance_log_density(interp, g, field, 0.0, 0.4, substeps=1))
    # a smooth g, interpolated once in each case: the differences are those of the paths and the divergence integral
    linear = mesh.centroids @ np.array([0.3, -0.2, 0.5])
    coarse = advance_log_density(interp, linear, field, 0.0, 0.4)
    fine = advance_log_density(interp, linear, field, 0.0, 0.4, substeps=4)
    finer = advance_log_density(interp, linear, field, 0.0, 0.4, substeps=8)
    assert np.abs(fine - finer).max() < 0.05 * np.abs(coarse - finer).max()
    with pytest.raises(ValueError, match="substeps must be"):
        from spherepde.solvers.tails import LogTails

        LogTails(mesh, AttentionModel(PAPER_B, PAPER_V, math.inf), substeps=0)


def _time_tagged_tails(step_states, substeps=4):
    """LogTails on nside 4 whose states' fields are the projected linear flow c(Mx − ⟨x, Mx⟩x),
    c = the state's f (constant, = 1 + t here), each call of a state's field logged as its c."""
    tails = LogTails(HealpixMesh(4), AttentionModel(PAPER_B, PAPER_V, math.inf), interval=0.2, anchor=1.0,
                     paths="retrace", substeps=substeps, step_states=step_states, follow=False)
    M = np.diag([1.0, -1.0, -2.0])
    calls = []

    def field_of(f, atoms):
        c = float(f[0])

        def field(points, want_div=True):  # div v whether asked or not: the paths take v from it
            calls.append(c)
            mx = points @ M
            along = np.sum(points * mx, axis=1)
            return c * (mx - along[:, None] * points), c * (np.trace(M) - 3.0 * along)
        return field

    tails.field_of = field_of
    f = np.ones(tails.mesh.npix)
    tails.start(0.0, np.zeros(tails.mesh.npix), f, None)
    return tails, calls, f


def test_step_states_at_atom_events_only_cross_the_intervals_where_atoms_changed():
    """tail_step_states = "atom_events": g's paths cross a coupling interval through its states
    after every step only where an atom was made or merged in it (forget_anchor), there in
    `substeps` RK4 steps between each two states; elsewhere they are the paths without substeps,
    bit for bit. "all" crosses every interval so."""
    runs = {}
    for states, substeps in (("atom_events", 4), ("all", 4), ("all", 1)):
        tails, calls, f = _time_tagged_tails(states, substeps)
        for s in (0.05, 0.1, 0.15):
            tails.follow_tail(s, f * (1.0 + s), None)
        del calls[:]
        tails.couple(0.2, f * 1.2, None)
        runs[states, substeps] = (tails, sorted(set(calls)), tails.g.copy(), calls)
    events, every, none = runs["atom_events", 4], runs["all", 4], runs["all", 1]
    assert events[1] == none[1] == [1.0, 1.2]  # the couplings' states only
    assert every[1] == pytest.approx([1.0, 1.05, 1.1, 1.15, 1.2])
    assert np.array_equal(events[2], none[2]) and not np.array_equal(every[2], none[2])
    assert events[0]._path_steps(0.4, 0.2, 0.0) == 4  # path_step steps over [0, 0.4], no substeps
    # the next interval: an atom made at 0.31
    tails, calls, f = events[0], events[3], np.ones(events[0].mesh.npix)
    for s in (0.23, 0.31):
        tails.follow_tail(s, f * (1.0 + s), None)
    tails.forget_anchor()
    tails.follow_tail(0.37, f * 1.37, None)
    del calls[:]
    tails.couple(0.4, f * 1.4, None)
    assert tails._fine == [(0.2, 0.4, [0.23, 0.31, 0.37])] and not tails._atoms_changed
    assert sorted(set(calls)) == pytest.approx([1.0, 1.2, 1.23, 1.31, 1.37, 1.4])
    edges = tails._path_steps(0.4, 0.2, 0.0)
    # [0, 0.2] in steps of path_step, [0.2, 0.4] in 4 steps between each two of its states
    fine = [a + (b - a) * j / 4 for a, b in zip((0.2, 0.23, 0.31, 0.37), (0.23, 0.31, 0.37, 0.4)) for j in range(4)]
    assert edges == pytest.approx([0.0, 0.1, *fine, 0.4], abs=1e-12) and edges[0] == 0.0 and edges[-1] == 0.4
    # one RK4 step between each two states (substeps 1): the boundaries are the states' times
    one, calls, f = _time_tagged_tails("atom_events", substeps=1)
    one.forget_anchor()
    for s in (0.05, 0.12):
        one.follow_tail(s, f * (1.0 + s), None)
    one.couple(0.2, f * 1.2, None)
    assert sorted(set(calls)) == pytest.approx([1.0, 1.05, 1.12, 1.2])
    assert one._path_steps(0.2, 0.2, 0.0) == pytest.approx([0.0, 0.05, 0.12, 0.2], abs=1e-12)
    with pytest.raises(ValueError, match="step_states"):
        LogTails(HealpixMesh(2), AttentionModel(PAPER_B, PAPER_V, 30.0), step_states="events")


class _FixedAtoms:
    """Stand-in for the solver's Atoms: fixed points and masses."""

    def __init__(self, x, m):
        self.x, self.m = x, m
        self.count = len(m)

    def points(self):
        return self.x, self.m


def test_atoms_see_the_tails_across_a_cell_with_the_log_linear_profile():
    """Atoms of negligible mass in a density falling by 1.7 decades per cell (vMF, κ = 60, nside 16),
    β = 1000 (kernel width 0.03 rad, half a cell): their velocity is the mesh's softmax mean, known in
    closed form (B = V = I: v = m − ⟨m, x⟩x, m = L(r) c/r, c = βx + κμ). The log-linear profile of
    the near cells is ≥ 5× closer to it than f constant per cell."""
    from spherepde.models.schedule import schedule_of
    from spherepde.models.initial import VonMisesFisher
    from spherepde.solvers.velocity import EulerianVelocity
    from spherepde.summation import NearField

    mesh = HealpixMesh(16)
    mu, kappa, beta = np.array([0.0, 0.0, 1.0]), 60.0, 1000.0
    f = VonMisesFisher(mu, kappa).cell_averages(mesh)
    rng = np.random.default_rng(4)
    theta, phi = rng.uniform(0.6, 1.6, 40), rng.uniform(0.0, 2.0 * np.pi, 40)
    x = np.stack([np.sin(theta) * np.cos(phi), np.sin(theta) * np.sin(phi), np.cos(theta)], axis=1)
    c = beta * x + kappa * mu
    r = np.linalg.norm(c, axis=1)
    m = (1.0 / np.tanh(r) - 1.0 / r)[:, None] * c / r[:, None]
    exact = m - np.sum(m * x, axis=1)[:, None] * x
    errors = {}
    for profile in ("constant", "log_linear"):
        velocity = EulerianVelocity(mesh, schedule_of(AttentionModel(np.eye(3), np.eye(3), beta)),
                                    atoms=_FixedAtoms(x, np.full(len(x), 1e-200)), near_field_profile=profile)
        v = velocity.atom_velocity(0.0, f, x)
        errors[profile] = np.median(np.linalg.norm(v - exact, axis=1))
        assert np.all(velocity.background_share(f) > 1.0 - 1e-12)  # the atoms weigh nothing
    assert errors["log_linear"] < errors["constant"] / 5, errors
    # the slopes are computed in the cells the near field can reach only: the same table as with all
    head = velocity.heads[0]
    full = PolynomialInterpolant(mesh).slopes(np.log(f))
    np.testing.assert_array_equal(NearField(mesh, head, x, full).delta,
                                  NearField(mesh, head, x, velocity.log_slopes(f, head, x)).delta)
    with pytest.raises(ValueError, match="near_field_profile"):
        EulerianVelocity(mesh, schedule_of(AttentionModel(np.eye(3), np.eye(3), beta)), near_field_profile="linear")


def test_config_resolves_the_near_field_profile():
    base = {"model": {"beta": 1.0, "B": "identity", "V": "identity"}, "time": {"t_end": 1.0, "save_every": 0.5}}
    assert resolve({**base, "eulerian": {"tails": "log"}})["eulerian"]["near_field_profile"] == "log_linear"
    assert resolve(base)["eulerian"]["near_field_profile"] == "constant"
    given = resolve({**base, "eulerian": {"tails": "log", "near_field_profile": "constant"}})
    assert given["eulerian"]["near_field_profile"] == "constant"
    with pytest.raises(ConfigError, match=r"\[eulerian\] near_field_profile: must be \"constant\" or \"log_linear\""):
        resolve({**base, "eulerian": {"near_field_profile": "quadratic"}})


def test_config_makes_atoms_for_the_tails_when_they_are_on():
    """With tails = "log" a new atom keeps its cluster's spread and the tail beside it (sigma, tail
    cut), as the F-onset's convergence at β = 30 was measured; with the finite volumes' tails the
    atoms stay points cut at the floor; a value given is kept either way."""
    base = {"model": {"beta": 1.0, "B": "identity", "V": "identity"}, "time": {"t_end": 1.0, "save_every": 0.5}}
    on = resolve({**base, "eulerian": {"tails": "log"}})["eulerian"]
    assert (on["atom_shape"], on["atom_cut"], on["tail_paths"]) == ("sigma", "tail", "backtrack")
    off = resolve(base)["eulerian"]
    assert (off["atom_shape"], off["atom_cut"]) == ("point", "floor")
    given = resolve({**base, "eulerian": {"tails": "log", "atom_shape": "point", "atom_cut": "floor"}})["eulerian"]
    assert (given["atom_shape"], given["atom_cut"]) == ("point", "floor")
    assert resolve({**base, "eulerian": {"atom_shape": "sigma"}})["eulerian"]["atom_shape"] == "sigma"


def test_paths_from_the_start_interpolate_g_once():
    """LogTails(paths="start") at β = ∞ (the field is the same for every state): g at t = 4 is the
    semi-Lagrangian step from t = 0 in one go (20 RK4 steps of 0.2, one interpolation), and is
    closer to the exact log density than g interpolated at every coupling."""
    mesh = HealpixMesh(8)
    model = AttentionModel(PAPER_B, PAPER_V, np.inf)
    f0 = Uniform().cell_averages(mesh)
    g = {}
    for paths in ("retrace", "start"):  # "retrace" with anchor 0: g interpolated at every coupling
        solver = EulerianSolver(mesh, model, atoms={}, tails={"paths": paths, "anchor": 0.0, "path_step": None})
        for _, t, f, rec in solver.snapshots(f0, [0.0, 2.0, 4.0]):
            g[paths] = solver.tails.g.copy()
    interpolant = PolynomialInterpolant(mesh)
    field = zero_temperature_field_of(PAPER_V @ PAPER_B.T)
    once = advance_log_density(interpolant, np.full(mesh.npix, -math.log(4 * math.pi)), field, 0.0, 4.0, 20)
    far = np.abs(mesh.centroids[:, 0]) < 0.5  # > 60° from ±e₁, where the atoms are
    assert np.max(np.abs(g["start"][far] - once[far])) < 1e-10
    exact = np.log(zero_temperature_density(model, Uniform(), 4.0)(mesh.centroids))
    errors = {p: np.percentile(np.abs(g[p][far] - exact[far]), 90) for p in g}
    assert errors["start"] < errors["retrace"] / 2, errors
    with pytest.raises(ValueError, match="paths must be"):
        EulerianSolver(mesh, model, atoms={}, tails={"paths": "end"})


def test_anchored_paths_interpolate_g_at_the_anchors_only():
    """LogTails(anchor=1.0, path_step=0.1) at β = ∞ (the field is the same for every state), couplings
    every 0.2: g at t = 2 is the semi-Lagrangian transport from t = 1 in one go (10 RK4 steps of 0.1),
    of g at t = 1 from t = 0 in one go: two interpolations where the default makes ten; it is
    closer to the exact log density than g interpolated at every coupling (anchor 0); it is the
    default; the snapshots' anchor times are those of the rule (t − anchor ≥ 1)."""
    mesh = HealpixMesh(8)
    model = AttentionModel(PAPER_B, PAPER_V, np.inf)
    f0 = Uniform().cell_averages(mesh)
    g, anchors = {}, []
    for name, options in (("default", {}), ("every", {"anchor": 0.0, "path_step": None}),
                          ("anchored", {"anchor": 1.0, "path_step": 0.1})):
        solver = EulerianSolver(mesh, model, atoms={}, tails=options)
        for _, t, f, rec in solver.snapshots(f0, [0.0, 0.4, 0.8, 1.2, 1.6, 2.0]):
            g[name] = solver.tails.g.copy()
            if name == "anchored":
                anchors.append(solver.tails.anchor_time)
    assert np.array_equal(g["default"], g["anchored"])
    assert anchors == pytest.approx([0.0, 0.0, 0.0, 1.0, 1.0, 2.0])
    interpolant = PolynomialInterpolant(mesh)
    field = zero_temperature_field_of(PAPER_V @ PAPER_B.T)
    at_one = advance_log_density(interpolant, np.full(mesh.npix, -math.log(4 * math.pi)), field, 0.0, 1.0, 10)
    twice = advance_log_density(interpolant, at_one, field, 1.0, 1.0, 10)
    far = np.abs(mesh.centroids[:, 0]) < 0.5  # > 60° from ±e₁, where the atoms are
    assert np.max(np.abs(g["anchored"][far] - twice[far])) < 1e-10
    exact = np.log(zero_temperature_density(model, Uniform(), 2.0)(mesh.centroids))
    errors = {p: np.percentile(np.abs(g[p][far] - exact[far]), 90) for p in ("every", "anchored")}
    assert errors["anchored"] < errors["every"] / 2, errors
    for bad in ({"anchor": -1.0}, {"path_step": 0.0}):
        with pytest.raises(ValueError, match="anchor|path_step"):
            EulerianSolver(mesh, model, atoms={}, tails=bad)


def test_composed_maps_interpolate_g_at_the_anchors_and_the_smooth_maps_between():
    """LogTails(paths="maps") at β = ∞: a coupling between anchors traces its own interval only and
    composes it with the last coupling's departure points and divergence integral (interpolated).
    g is then within the maps' interpolation error of the retraced paths, and closer to the exact
    log density than g interpolated at every coupling (by 3× at nside 8); with anchor 0 there is
    nothing to compose, and it is that state bit for bit."""
    mesh = HealpixMesh(8)
    model = AttentionModel(PAPER_B, PAPER_V, np.inf)
    f0 = Uniform().cell_averages(mesh)
    every = {"anchor": 0.0, "path_step": None}
    g = {}
    for name, options in (("every", every), ("retrace", {}), ("maps", {"paths": "maps"}),
                          ("maps at every coupling", {"paths": "maps", **every})):
        solver = EulerianSolver(mesh, model, atoms={}, tails=options)
        for _, t, f, rec in solver.snapshots(f0, [0.0, 0.4, 0.8, 1.2, 1.6, 2.0, 2.4, 2.8]):
            g[name, t] = solver.tails.g.copy()
    far = np.abs(mesh.centroids[:, 0]) < 0.5  # > 60° from ±e₁, where the atoms are
    for t in (2.0, 2.8):
        assert np.array_equal(g["maps at every coupling", t], g["every", t])
        exact = np.log(zero_temperature_density(model, Uniform(), t)(mesh.centroids))
        errors = {name: np.percentile(np.abs(g[name, t][far] - exact[far]), 90) for name in ("every", "retrace", "maps")}
        assert errors["maps"] < errors["every"] / 2, errors
        assert errors["retrace"] < errors["maps"], errors  # the maps' own interpolation error
    with pytest.raises(ValueError, match="paths must be"):
        EulerianSolver(mesh, model, atoms={}, tails={"paths": "compose"})


def _paths_against_the_maps(paths, tolerance):
    """g and LogTails.retraced at t = 2.0 and 2.8 (nside 8, β = ∞, couplings every 0.2 to saves 0.4
    apart) for the retraced paths, the composed maps and `paths` with a tolerance no path reaches,
    one every path exceeds and `tolerance` (decades of g); the exact log density at those times."""
    mesh = HealpixMesh(8)
    model = AttentionModel(PAPER_B, PAPER_V, np.inf)
    f0 = Uniform().cell_averages(mesh)
    g, retraced = {}, {}
    for name, options in (("retrace", {}), ("maps", {"paths": "maps"}),
                          ("none", {"paths": paths, "retrace_tolerance": 1e6}),
                          ("all", {"paths": paths, "retrace_tolerance": 1e-300}),
                          ("some", {"paths": paths, "retrace_tolerance": tolerance})):
        solver = EulerianSolver(mesh, model, atoms={}, tails=options)
        for _, t, f, rec in solver.snapshots(f0, [0.0, 0.4, 0.8, 1.2, 1.6, 2.0, 2.4, 2.8]):
            g[name, t] = solver.tails.g.copy()
            retraced[name, t] = solver.tails.retraced
    exact = {t: np.log(zero_temperature_density(model, Uniform(), t)(mesh.centroids)) for t in (2.0, 2.8)}
    return mesh, g, retraced, exact


@pytest.mark.parametrize("paths", ["selective", "backtrack"])
def test_selective_and_backtracked_paths_are_the_maps_retraced_where_the_maps_fail(paths):
    """LogTails(paths="selective" / "backtrack") at β = ∞ (the field is local, so a subset of paths
    is the same as the whole set's rows): with a tolerance no path reaches, the composed maps bit
    for bit; with one every path exceeds, the retraced paths to rounding (every centroid retraced;
    "backtrack": traced back through the same step boundaries, interval by interval); with 0.001
    decades, between the two: some centroids retraced, and g closer to the exact log density than
    the maps (p90 at t = 2.8, nside 8: maps 0.045, selective 0.008, backtrack 0.019, the retraced
    paths 0.008). selective: retraced where the error budget its map carries exceeds the tolerance;
    backtrack: traced on where the map's quadratic and cubic interpolants disagree by more."""
    mesh, g, retraced, exact = _paths_against_the_maps(paths, 1e-3)
    far = np.abs(mesh.centroids[:, 0]) < 0.5  # > 60° from ±e₁, where the atoms are
    for t in (2.0, 2.8):
        assert np.array_equal(g["none", t], g["maps", t])
        np.testing.assert_allclose(g["all", t], g["retrace", t], rtol=0, atol=1e-12)
        assert retraced["none", t] == 0 and 0 < retraced["some", t] < mesh.npix
        errors = {name: np.percentile(np.abs(g[name, t][far] - exact[t][far]), 90) for name in ("maps", "some")}
        assert errors["some"] < errors["maps"] / 2, errors
    # t = 2.8: every path of a coupling after the first since the anchor at 2.0
    assert retraced["all", 2.8] == mesh.npix
    with pytest.raises(ValueError, match="retrace_tolerance"):
        EulerianSolver(mesh, AttentionModel(PAPER_B, PAPER_V, np.inf), atoms={},
                       tails={"paths": paths, "retrace_tolerance": 0.0})


def test_bounded_following_does_not_extrapolate_a_front_that_has_passed():
    """follow_bounds "neighbours": a tail cell whose g rose by 16 over the last interval (a front
    passing, as in the vMF run of tails_retrace.toml at t = 7.3–7.35, nside 16) stays within the
    range of f over itself and its neighbours at the coupling, where the rate alone carries it
    e^{16} higher within the next interval; the mass of the measure is kept either way."""
    mesh = HealpixMesh(8)
    model = AttentionModel(PAPER_B, PAPER_V, np.inf)
    rng = np.random.default_rng(3)
    f0 = 10.0 ** rng.uniform(-12, -6, mesh.npix)
    f0[:64] = 1.0 / mesh.area / 64  # the bulk: one unit of mass on 64 cells
    followed = {}
    for bounds in ("none", "neighbours"):
        tails = LogTails(mesh, model, follow_bounds=bounds)
        f = f0.copy()
        tails.start(0.0, np.log(f), f, None)
        tails.rate = np.full(mesh.npix, 16.0 / 0.05)
        tails._anchor_at(0.0, f, None)
        mass = f.sum() * mesh.area
        tails.follow_tail(0.05, f, None)
        assert f.sum() * mesh.area == pytest.approx(mass, rel=1e-12)
        followed[bounds] = f
    cells = tails._anchor[1]
    stencil = tails.interpolant.stencil[cells]
    around = np.where(stencil >= 0, f0[np.maximum(stencil, 0)], f0[cells, None])
    assert np.all(followed["neighbours"][cells] <= around.max(axis=1) * (1 + 1e-12))
    assert np.any(followed["none"][cells] > 1e3 * around.max(axis=1))
    with pytest.raises(ValueError, match="follow_bounds"):
        LogTails(mesh, model, follow_bounds="upwind")


def test_the_edges_between_followed_cells_are_known_to_the_velocity():
    """followed_edges: exactly the edges whose two cells follow g after a coupling (their fluxes move
    nothing the solver keeps: the velocity leaves them out of its lag error); None once the atoms
    changed and nothing is followed."""
    mesh = HealpixMesh(8)
    model = AttentionModel(PAPER_B, PAPER_V, np.inf)
    f = 10.0 ** np.random.default_rng(4).uniform(-12, -6, mesh.npix)
    f[:64] = 1.0 / mesh.area / 64
    tails = LogTails(mesh, model)
    tails.start(0.0, np.log(f), f, None)
    followed = np.zeros(mesh.npix, dtype=bool)
    followed[tails._anchor[1]] = True
    assert 0 < followed.sum() < mesh.npix
    edges = tails.followed_edges
    assert edges.shape == (mesh.nedges,) and edges.any() and not edges.all()
    for e, (p, q) in enumerate(mesh.edge_cells):
        assert edges[e] == (followed[p] and followed[q])
    assert tails.followed_edges is edges  # computed once per coupling
    tails.forget_anchor()
    assert tails.followed_edges is None


def test_the_bounded_following_is_the_default_and_old_files_were_unbounded():
    """`tails = "log"` follows within the neighbours unless told otherwise; a run file written
    before the key existed compares as unbounded, so it resumes only under `tail_follow_bounds = "none"`."""
    raw = {"model": {"beta": 30.0, "B": "identity", "V": "identity"}, "eulerian": {"tails": "log"},
           "time": {"t_end": 1.0, "save_every": 0.5}}
    config = json.loads(json.dumps(resolve(raw)))
    assert config["eulerian"]["tail_follow_bounds"] == "neighbours"
    old = json.loads(json.dumps(config))
    del old["eulerian"]["tail_follow_bounds"]
    assert difference(old, config) == "[eulerian] tail_follow_bounds: 'none' in the file, 'neighbours' now"
    pinned = resolve({**raw, "eulerian": {"tails": "log", "tail_follow_bounds": "none"}})
    assert difference(old, json.loads(json.dumps(pinned))) is None
    with pytest.raises(ConfigError, match="tail_follow_bounds"):
        resolve({**raw, "eulerian": {"tails": "log", "tail_follow_bounds": "upwind"}})


def test_the_path_scheme_is_checked_and_reaches_the_tails():
    """`tail_path_scheme` goes to LogTails (the trapezoidal paths: tests/transport); another
    value is one error naming the key."""
    from spherepde.runner.run import _tail_options

    raw = {"model": {"beta": 30.0, "B": "identity", "V": "identity"}, "time": {"t_end": 1.0, "save_every": 0.5}}
    config = resolve({**raw, "eulerian": {"tails": "log", "tail_path_scheme": "heun"}})
    options = _tail_options(config["eulerian"])
    assert options["path_scheme"] == "heun"
    assert LogTails(HealpixMesh(2), AttentionModel(PAPER_B, PAPER_V, 30.0), **options).path_scheme == "heun"
    assert resolve({**raw, "eulerian": {"tails": "log"}})["eulerian"]["tail_path_scheme"] == "rk4"
    with pytest.raises(ConfigError, match="tail_path_scheme"):
        resolve({**raw, "eulerian": {"tails": "log", "tail_path_scheme": "euler"}})


def test_the_path_tolerance_is_checked_reaches_the_tails_and_halves_their_steps(monkeypatch):
    """`tail_path_tolerance` goes to LogTails, which hands trace_back that many decades of g per
    unit time in units of g (× ln 10), and None at 0 (the default, and files written before the
    key: fixed steps); a negative value, or one with the trapezoidal paths, is one error naming it."""
    from spherepde.runner.run import _tail_options
    from spherepde.solvers import tails as tails_module

    raw = {"model": {"beta": 30.0, "B": "identity", "V": "identity"}, "time": {"t_end": 1.0, "save_every": 0.5}}
    config = resolve({**raw, "eulerian": {"tails": "log", "tail_path_tolerance": 0.03}})
    options = _tail_options(config["eulerian"])
    tails = LogTails(HealpixMesh(2), AttentionModel(PAPER_B, PAPER_V, 30.0), **options)
    assert tails.path_tolerance == 0.03
    given = []
    monkeypatch.setattr(tails_module, "trace_back", lambda *args, **kw: given.append(kw["tolerance"]))
    tails._trace(np.zeros((1, 3)), None, 0.0, 0.2, 0.2)
    assert given == [pytest.approx(0.03 * math.log(10.0))]
    default = resolve({**raw, "eulerian": {"tails": "log"}})["eulerian"]
    assert default["tail_path_tolerance"] == 0.0
    LogTails(HealpixMesh(2), AttentionModel(PAPER_B, PAPER_V, 30.0), **_tail_options(default))._trace(
        np.zeros((1, 3)), None, 0.0, 0.2, 0.2)
    assert given[-1] is None
    old = json.loads(json.dumps(default))
    del old["tail_path_tolerance"]
    assert difference({"eulerian": old}, {"eulerian": json.loads(json.dumps(default))}) is None
    for bad in ({"tail_path_tolerance": -0.1}, {"tail_path_tolerance": 0.03, "tail_path_scheme": "heun"}):
        with pytest.raises(ConfigError, match="tail_path_tolerance"):
            resolve({**raw, "eulerian": {"tails": "log", **bad}})


def test_a_local_mass_correction_keeps_the_far_clusters_mass():
    """tail_mass_correction "local": the mass the tail cells gain beside one atom is paid by that
    atom (their nearest living place), so the atom across the sphere keeps its mass to the bit,
    where the global factor takes from both in proportion to their mass; what a payer cannot pay
    (more than half of its mass) falls to the global factor; the measure's mass is kept to
    round-off either way, and the config key reaches LogTails and refuses other values."""
    from spherepde.runner.run import _tail_options
    from spherepde.solvers.atoms import Atoms

    mesh = HealpixMesh(4)
    model = AttentionModel(PAPER_B, PAPER_V, 1000.0)
    east = mesh.centroids[:, 0] > 0.3

    def state(gain):
        f = np.full(mesh.npix, 1e-6)
        atoms = Atoms(mesh, capacity=4)
        atoms.restore(np.array([[1.0, 0, 0], [-1.0, 0, 0], [np.nan] * 3, [np.nan] * 3]), np.array([0.6, 0.4, 0, 0]),
                      np.array([0.0, 0.0, np.nan, np.nan]))
        values = f[east] + gain / (east.sum() * mesh.area)  # the tail cells beside +e1 gain `gain` in all
        return f, atoms, values

    def mass(f, atoms):
        return f.sum() * mesh.area + atoms.total_mass

    results = {}
    for correction in ("global", "local"):
        tails = LogTails(mesh, model, mass_correction=correction)
        f, atoms, values = state(1e-3)
        before = mass(f, atoms)
        moved = tails._substitute(f, east, values, atoms)
        assert moved == pytest.approx(1e-3, rel=1e-12)
        assert abs(mass(f, atoms) - before) < 1e-15
        results[correction] = atoms.masses[:2].copy()
    assert results["local"][1] == 0.4 and results["local"][0] < 0.6  # the far atom untouched
    assert results["global"][1] < 0.4 - 1e-5  # one factor for all takes from it too
    # a gain beyond half of the payer's mass: half of it paid there, the rest by all
    tails = LogTails(mesh, model, mass_correction="local")
    f, atoms, values = state(0.5)
    before = mass(f, atoms)
    tails._substitute(f, east, values, atoms)
    assert abs(mass(f, atoms) - before) < 1e-14 and (f > 0).all() and atoms.masses[0] > 0
    raw = {"model": {"beta": 30.0, "B": "identity", "V": "identity"}, "time": {"t_end": 1.0, "save_every": 0.5}}
    config = resolve({**raw, "eulerian": {"tails": "log", "tail_mass_correction": "local"}})
    assert LogTails(mesh, model, **_tail_options(config["eulerian"])).mass_correction == "local"
    assert resolve({**raw, "eulerian": {"tails": "log"}})["eulerian"]["tail_mass_correction"] == "downstream"
    assert ADDED_KEYS[("eulerian", "tail_mass_correction")] == "global"  # files written before the key
    with pytest.raises(ConfigError, match="tail_mass_correction"):
        resolve({**raw, "eulerian": {"tails": "log", "tail_mass_correction": "nearest"}})


def test_the_neighbourhood_kept_by_the_finite_volumes_can_be_given_in_kernel_widths():
    """`tail_exclusion_width`: the cells kept by the finite volumes around an atom reach at least
    that many kernel widths σ = (β σ_max(B))^{-1/2} (β = 30, paper matrices: σ = 0.1826 rad),
    whatever the mesh; 0 (files before the key) leaves the cell sizes alone; β = ∞ has σ = 0."""
    from spherepde.solvers.tails import kernel_width

    model = AttentionModel(PAPER_B, PAPER_V, 30.0)
    assert kernel_width(model) == pytest.approx(1 / math.sqrt(30.0))
    assert kernel_width(AttentionModel(PAPER_B, PAPER_V, np.inf)) == 0.0
    for nside in (8, 16, 32):
        mesh = HealpixMesh(nside)
        cells = LogTails(mesh, model, exclusion=3.0)
        wide = LogTails(mesh, model, exclusion=3.0, exclusion_width=1.0)
        assert cells.reach == pytest.approx(3.0 * math.sqrt(mesh.area))
        assert wide.reach == pytest.approx(max(3.0 * math.sqrt(mesh.area), 1 / math.sqrt(30.0)))
    with pytest.raises(ValueError, match="exclusion_width"):
        LogTails(HealpixMesh(2), model, exclusion_width=-1.0)
    raw = {"model": {"beta": 30.0, "B": "identity", "V": "identity"}, "time": {"t_end": 1.0, "save_every": 0.5}}
    assert resolve({**raw, "eulerian": {"tails": "log"}})["eulerian"]["tail_exclusion_width"] == 1.0  # the default
    # a run file made before the key compares as cells only
    old_file = resolve({**raw, "eulerian": {"tails": "log", "tail_exclusion_width": 0.0}})
    del old_file["eulerian"]["tail_exclusion_width"]
    assert difference(old_file, resolve({**raw, "eulerian": {"tails": "log", "tail_exclusion_width": 0.0}})) is None
    assert difference(old_file, resolve({**raw, "eulerian": {"tails": "log"}})) is not None
    with pytest.raises(ConfigError, match="tail_exclusion_width"):
        resolve({**raw, "eulerian": {"tails": "log", "tail_exclusion_width": 5.0}})


def test_paths_of_g_see_a_kernel_narrower_than_a_cell():
    """Where the kernel is narrower than a cell, g's paths take each cell as k × k sources at its
    children's centres (log-linear profile, the cell's mass): k the power of two that brings the
    spacing below the kernel width; the field converges in k (k and 2k agree far better than the
    cell-centre sums agree with 2k: those get div v wrong by ~0.2)."""
    from spherepde.solvers.tails import LogTails, subcells_for

    assert subcells_for(HealpixMesh(16), AttentionModel(PAPER_B, PAPER_V, 30.0)) == 1  # σ = 0.18 > h
    assert [subcells_for(HealpixMesh(n), AttentionModel(PAPER_B, PAPER_V, 1000.0)) for n in (8, 16, 32, 64)] \
        == [8, 4, 2, 1]
    assert subcells_for(HealpixMesh(16), AttentionModel(PAPER_B, PAPER_V, math.inf)) == 1
    mesh = HealpixMesh(16)
    model = AttentionModel(PAPER_B, PAPER_V, 1000.0)
    f = LAW.cell_averages(mesh) * np.exp(-8.0 * mesh.centroids[:, 1] ** 2)  # steep across F
    x = mesh.centroids[::7]
    divs = {}
    for k in (1, 4, 8):
        tails = LogTails(mesh, model, profile="log_linear")
        assert tails.subcells == 4
        if k != 4:
            tails.subcells = k
            tails._children = np.stack(hp.pix2vec(16 * k, np.arange(mesh.npix * k * k), nest=True), axis=1)
        divs[k] = tails.field_of(f, None)(x)[1]
    fine, coarse = np.abs(divs[4] - divs[8]).max(), np.percentile(np.abs(divs[1] - divs[8]), 90)
    assert fine < 0.02 < 0.1 < coarse, (fine, coarse)
    assert LogTails(mesh, model).subcells == 1  # the constant profile keeps the cell-centre sums


def test_subcells_are_capped():
    from spherepde.solvers.tails import MAX_SUBCELLS, subcells_for

    assert subcells_for(HealpixMesh(8), AttentionModel(PAPER_B, PAPER_V, 1e9)) == MAX_SUBCELLS


def test_the_field_between_couplings_is_that_of_the_measure_the_solver_holds():
    """tail_field_between = "measure": between two couplings g's paths see the field of the measure
    the solver holds at s: the followed tail cells as follow_tail gives them at s (exponential in
    time within their bounds), the other cells linear between the couplings' states. It is the
    states' fields at both ends, one attention sum inside (the linear field takes two), and none
    is kept for an interval in which an atom was made or merged."""
    import spherepde.solvers.tails as tails_module

    mesh = HealpixMesh(4)
    model = AttentionModel(PAPER_B, PAPER_V, 30.0)
    rng = np.random.default_rng(5)
    f0 = 10.0 ** rng.uniform(-12, -6, mesh.npix)
    f0[:16] = 1.0 / mesh.area / 16  # the bulk
    tails = LogTails(mesh, model, between="measure", follow_bounds="neighbours")
    tails.start(0.0, np.log(f0), f0.copy(), None)
    tails.rate = rng.uniform(-40.0, 40.0, mesh.npix)  # some cells meet their bounds within the interval
    tails._anchor_at(0.0, f0, None)
    cells = tails._anchor[1]
    assert 0 < cells.size < mesh.npix
    f1 = f0.copy()
    tails._follow(0.2, f1, None)  # the followed cells at the coupling, as the solver left them
    bulk = np.ones(mesh.npix, dtype=bool)
    bulk[cells] = False
    f1[bulk] *= 1.0 + 0.5 * mesh.centroids[bulk, 2]  # the finite volumes moved the rest
    path = tails._measure_path(0.2, f1, None)
    x = hp.pix2vec(8, np.arange(0, 768, 7), nest=True)
    x = np.ascontiguousarray(np.stack(x, axis=1))
    for s, f_end in ((0.0, f0), (0.2, f1)):
        for got, want in zip(path(s)(x), tails.field_of(f_end, None)(x)):
            assert got == pytest.approx(want, rel=1e-12, abs=1e-14)
    s = 0.07
    held = f0.copy()
    tails._follow(s, held, None)  # the solver's followed cells at s
    held[bulk] = (1 - s / 0.2) * f0[bulk] + s / 0.2 * f1[bulk]
    for got, want in zip(path(s)(x), tails.field_of(held, None)(x)):
        assert got == pytest.approx(want, rel=1e-12, abs=1e-14)
    sums = []
    real = tails_module.attention_field
    try:
        tails_module.attention_field = lambda *a, **k: sums.append(1) or real(*a, **k)
        tails.couple(0.2, f1.copy(), None)
        assert list(tails._paths_between) == [(0.0, 0.2)]
        del sums[:]
        field = tails._paths_between[(0.0, 0.2)]
        field(0.1)(x)
        assert len(sums) == 1
        tails.forget_anchor()  # an atom made in the next interval: its field is linear in time
        tails.couple(0.4, f1.copy(), None)
        assert (0.2, 0.4) not in tails._paths_between
    finally:
        tails_module.attention_field = real
    with pytest.raises(ValueError, match="between"):
        LogTails(mesh, model, between="exponential")
    with pytest.raises(ConfigError, match="tail_field_between"):
        resolve({"model": {"beta": 30.0, "B": "identity", "V": "identity"},
                 "eulerian": {"tails": "log", "tail_field_between": "cubic"}, "time": {"t_end": 1.0, "save_every": 0.5}})


def test_the_field_between_couplings_can_be_the_states_after_the_steps():
    """tail_field_between = "steps": the states the solver held after its steps (recorded
    TAIL_STATE_SPACING apart at least) are kept, and between two of them g's paths see the measure
    linear in time: the state's field at every record, one attention sum between them. An atom made
    between two records enters with its mass ramped from 0 (as in validation.background's
    reference), so an atom event keeps the interval's path."""
    import spherepde.solvers.tails as tails_module
    from spherepde.solvers.atoms import Atoms
    from spherepde.solvers.tails import TAIL_STATE_SPACING

    mesh = HealpixMesh(4)
    model = AttentionModel(PAPER_B, PAPER_V, 30.0)
    rng = np.random.default_rng(6)
    f0 = 10.0 ** rng.uniform(-12, -6, mesh.npix)
    f0[:16] = 1.0 / mesh.area / 16
    atoms = Atoms(mesh, capacity=4)
    tails = LogTails(mesh, model, between="steps", follow=False)
    tails.start(0.0, np.log(f0), f0.copy(), atoms)
    x = np.ascontiguousarray(np.stack(hp.pix2vec(8, np.arange(0, 768, 7), nest=True), axis=1))
    states = {0.0: (f0.copy(), None)}
    f = f0.copy()
    for k, t in enumerate((0.01, 0.03, 0.05, 0.1, 0.2)):
        f = f * (1.0 + 0.3 * mesh.centroids[:, 2] * t)
        if k == 2:  # an atom made after the third step
            atoms.positions[1], atoms.masses[1] = [0.0, 0.6, 0.8], 0.05
        if t < 0.2:
            tails.follow_tail(t, f, atoms)
        states[t] = (f.copy(), atoms.points())
    # the step at 0.01 is closer than the spacing to the coupling before: not recorded
    assert TAIL_STATE_SPACING > 0.01 and [r[0] for r in tails._records] == [0.0, 0.03, 0.05, 0.1]
    sums = []
    real = tails_module.attention_field
    try:
        tails_module.attention_field = lambda *a, **k: sums.append(1) or real(*a, **k)
        tails.couple(0.2, f.copy(), atoms)
        path = tails._paths_between[(0.0, 0.2)]
        for s in (0.03, 0.1):
            f_s, (xa, ma) = states[s]
            for got, want in zip(path(s)(x), tails._field_of_points(f_s.astype(np.float32).astype(float), xa, ma)(x)):
                assert got == pytest.approx(want, rel=1e-12, abs=1e-14)
        del sums[:]
        s, a = 0.04, 0.5  # between the records at 0.03 (no atom) and 0.05 (the atom made)
        got = path(s)(x)
        assert len(sums) == 1
    finally:
        tails_module.attention_field = real
    f_s = ((1 - a) * states[0.03][0].astype(np.float32).astype(float) + a * states[0.05][0].astype(np.float32).astype(float))
    xa, ma = states[0.05][1]
    for got_part, want in zip(got, tails._field_of_points(f_s, xa, a * ma)(x)):
        assert got_part == pytest.approx(want, rel=1e-12, abs=1e-14)


def test_each_time_of_the_paths_builds_its_sums_once():
    """The backtracked maps through the steps' states (β = 30, nside 8): every coupling traces
    its paths through the same step boundaries as the couplings before, so the field at each time
    is made once and its sums' sources once (PreparedSources): far fewer builds than attention
    sums, and g bit for bit that of the paths that build every field anew."""
    import spherepde.solvers.tails as tails_module

    mesh = HealpixMesh(8)
    model = AttentionModel(PAPER_B, PAPER_V, 30.0)
    f0 = LAW.cell_averages(mesh)
    options = {"paths": "backtrack", "between": "steps", "anchor": 5.0, "path_step": 0.05,
               "reference": "clusters"}
    g, counts = {}, {}
    real_once, real_prepared, real_sums = tails_module._per_time, tails_module.PreparedSources, tails_module.attention_field
    try:
        for name in ("once", "anew"):
            built, sums = [], []
            tails_module._per_time = real_once if name == "once" else (lambda field_at: field_at)
            tails_module.PreparedSources = lambda *a: built.append(1) or real_prepared(*a)
            tails_module.attention_field = lambda *a, **k: sums.append(1) or real_sums(*a, **k)
            solver = EulerianSolver(mesh, model, atoms={}, tails=options)
            for _, t, f, rec in solver.snapshots(f0, [0.0, 0.4, 0.8]):
                g[name, t] = solver.tails.g.copy()
            counts[name] = len(built), len(sums)
    finally:
        tails_module._per_time, tails_module.PreparedSources = real_once, real_prepared
        tails_module.attention_field = real_sums
    for t in (0.4, 0.8):
        assert np.array_equal(g["once", t], g["anew", t])
    assert counts["once"][1] == counts["anew"][1]  # the same sums ...
    assert 4 * counts["once"][0] < counts["once"][1]  # ... from far fewer builds
    assert counts["once"][0] < counts["anew"][0] / 2, counts


@pytest.mark.parametrize("beta, nside", [(1000.0, 8), (30.0, 8)])
def test_the_paths_velocity_alone_is_the_fields(beta, nside):
    """A state's field for g's paths asked for v alone (the RK4 stages whose div v no rule uses):
    the sums without their second moments give the v of the full field to round-off and no div v,
    on sub-cell sources by the tree (β = 1000: 8 × 8 children per cell) and on the cells directly
    (β = 30)."""
    mesh = HealpixMesh(nside)
    model = AttentionModel(PAPER_B, PAPER_V, beta)
    tails = LogTails(mesh, model, profile="log_linear")
    assert tails.subcells == (8 if beta == 1000.0 else 1)
    f = LAW.cell_averages(mesh)
    field = tails.field_of(f, None)
    x = mesh.centroids[::3]
    v, div = field(x)
    v_alone, none = field(x, False)
    assert none is None and div is not None
    assert np.abs(v_alone - v).max() <= 1e-13 * np.abs(v).max()


def test_a_downstream_mass_correction_keeps_the_side_of_the_invariant_plane():
    """tail_mass_correction "downstream" at β = ∞: the local field of the paper's matrices keeps the
    plane x₁ = 0 invariant, so every path stays on its side. The tail band −0.2 < x₁ < 0.6 (f = 1e-4
    under a bulk of 1) gives 2 % of its mass; the nearest bulk cell of its cells with 0 < x₁ < 0.2
    lies across the plane (x₁ ≤ −0.2), but the flow carries them into the bulk on their own side,
    so the mass with x₁ > 0 is kept to round-off, where "local" moves some of it across."""
    mesh = HealpixMesh(8)
    model = AttentionModel(PAPER_B, PAPER_V, math.inf)
    x1 = mesh.centroids[:, 0]
    band = (x1 > -0.2) & (x1 < 0.6) & (np.abs(x1) > 1e-9)
    plus = x1 > 0
    crossed = {}
    for correction in ("local", "downstream"):
        tails = LogTails(mesh, model, mass_correction=correction)
        f = np.where(band, 1e-4, 1.0)
        tails._previous = tails.field_of(f, None)
        tails._downstream_from(f, None)
        before, total = f[plus].sum(), f.sum()
        tails._substitute(f, band, 0.98 * f[band], None)
        assert f.sum() == pytest.approx(total, rel=1e-14)
        crossed[correction] = (f[plus].sum() - before) / (0.02e-4 * band.sum())  # of the mass moved
    assert abs(crossed["downstream"]) < 1e-9
    assert abs(crossed["local"]) > 0.05


def test_a_downstream_mass_correction_without_a_tail_carries_nothing():
    """A smooth start has no cell below the level: the downstream ends are the cells' own centroids,
    and no attention sum is asked for zero targets (that warned "Mean of empty slice" where the
    sources are enough for the tree, from nside 16)."""
    mesh = HealpixMesh(16)
    model = AttentionModel(PAPER_B, PAPER_V, 30.0)
    tails = LogTails(mesh, model, mass_correction="downstream")
    f = np.ones(mesh.npix)
    tails._previous = tails.field_of(f, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tails._downstream_from(f, None)
    np.testing.assert_array_equal(tails._downstream, mesh.centroids)


def test_a_downstream_payer_is_bulk_not_a_cell_below_the_level():
    """The downstream payment has no cap on receipts, so its payers are the bulk (f at or above the
    level) and the atoms: a tail cell's loss goes to the nearest of them to its path's end, never to
    a nearly empty cell beside it, which would take many times its own mass (at β = 30 such cells
    beside the atoms raised the mesh's softmax weight at the heaviest atom by 20–50 % per coupling).
    Here the paths stay put; the cells of the southern cap hold 1e-20 and the ring below the bulk
    (x₃ > 0.5, f = 1) gives a tenth of its 1e-6: the bulk receives all of it."""
    mesh = HealpixMesh(8)
    model = AttentionModel(PAPER_B, PAPER_V, 30.0)
    x3 = mesh.centroids[:, 2]
    f = np.where(x3 > 0.5, 1.0, 1e-20)
    ring = np.flatnonzero((x3 < 0.0) & (x3 > -0.3))
    f[ring] = 1e-6
    tails = LogTails(mesh, model, mass_correction="downstream")
    tails._downstream = mesh.centroids.copy()
    total, empty = f.sum(), (x3 <= 0.5) & (f == 1e-20)
    moved = tails._substitute(f, ring, 0.9e-6 * np.ones(ring.size), None)
    assert moved < 0
    assert f.sum() == pytest.approx(total, rel=1e-14)
    np.testing.assert_array_equal(f[empty], 1e-20)
    assert f[x3 > 0.5].min() >= 1.0


@pytest.mark.parametrize("spread", [0.0, None])
def test_a_downstream_payment_keeps_the_cluster_where_it_is(monkeypatch, spread):
    """The payer nearest to where the flow goes shares its due with the payers within
    DOWNSTREAM_SPREAD, in proportion to their mass, so a cluster narrower than that receives its
    tail's mass without moving: here every path ends at the cluster's rim (x₃ = +0.04 of a cluster
    0.045 rad wide about e₁), and the cluster's centre of mass stays put to round-off; a single
    payer (spread 0) moves it towards the rim, as it turned the clusters at β = 1000."""
    import spherepde.solvers.tails as tails_module

    if spread is not None:
        monkeypatch.setattr(tails_module, "DOWNSTREAM_SPREAD", spread)
    mesh = HealpixMesh(64)
    model = AttentionModel(PAPER_B, PAPER_V, 1000.0)
    c = mesh.centroids
    cluster = c[:, 0] > math.cos(0.045)
    ring = (c[:, 0] > math.cos(0.3)) & ~cluster
    f = np.where(cluster, 1.0, 1e-12)
    f[ring] = 1e-4
    tails = LogTails(mesh, model, mass_correction="downstream")
    rim = np.array([math.sqrt(1 - 0.04 ** 2), 0.0, 0.04])
    tails._downstream = np.tile(rim, (mesh.npix, 1))
    centre_before = (f[cluster, None] * c[cluster]).sum(axis=0) / f[cluster].sum()
    total = f.sum()
    tails._substitute(f, ring, 1e-5 * np.ones(ring.sum()), None)  # 0.4 % of the cluster's mass
    centre_after = (f[cluster, None] * c[cluster]).sum(axis=0) / f[cluster].sum()
    assert f.sum() == pytest.approx(total, rel=1e-13)
    assert f[cluster].sum() > cluster.sum()  # the cluster received the ring's mass
    shift = np.linalg.norm(centre_after - centre_before)
    if spread is None:
        assert shift < 1e-12
    else:
        assert shift > 5e-5
