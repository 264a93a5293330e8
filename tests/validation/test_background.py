"""spherepde.validation.background: the density along backward characteristics equals the exact β = ∞
push-forward density (spherepde.analysis.exact), and the softmax share of the cells is the plain ratio."""

import healpy as hp
import numpy as np
import pytest

from spherepde import AttentionModel, HealpixMesh
from spherepde.analysis.exact import zero_temperature_density
from spherepde.models.initial import VonMisesFisher
from spherepde.summation.direct import zero_temperature_field
from spherepde.validation.background import characteristic_density, weight_share

PAPER_V = np.diag([-1.0, 1.0, -2.0])
PAPER_B = np.diag([-1.0, -1.0, 1.0])


def test_characteristic_density_equals_the_exact_push_forward():
    model = AttentionModel(B=PAPER_B, V=PAPER_V, beta="inf")
    law = VonMisesFisher([0.3, -0.2, 0.9], 1.0)

    def field(y, s):
        v, div = np.empty_like(y), np.empty(len(y))
        zero_temperature_field(np.ascontiguousarray(y), model.B, model.M, True, v, div)
        return v, div

    points = HealpixMesh(4).centroids
    t = 0.8
    got = characteristic_density(field, law, points, t, dt=0.02)
    exact = zero_temperature_density(model, law, t)(points)
    np.testing.assert_allclose(got, exact, rtol=1e-6)
    assert got.max() / got.min() > 100  # a density that the flow has made far from uniform


def test_weight_share_is_the_cells_share_of_the_softmax():
    model = AttentionModel(B=PAPER_B, V=PAPER_V, beta=3.0)
    mesh = HealpixMesh(2)
    rng = np.random.default_rng(1)
    f = rng.random(mesh.npix)
    x = rng.normal(size=(3, 3))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    m = np.array([0.2, 0.5, 0.0])
    z = x[1]
    w_cells = np.sum(f * mesh.area * np.exp(model.beta * mesh.centroids @ (model.B.T @ z)))
    w_atoms = np.sum(m * np.exp(model.beta * x @ (model.B.T @ z)))
    assert abs(weight_share(model, mesh, f, x, m) - w_cells / (w_cells + w_atoms)) < 1e-14


def test_saved_particle_field_interpolates_positions_in_time():
    """Between two snapshots the particles sit at the normalised linear interpolation of their
    positions: the field there is the direct sum over those points."""
    from spherepde.summation import attention_field
    from spherepde.validation.background import SavedParticleField

    model = AttentionModel(B=PAPER_B, V=PAPER_V, beta=5.0)
    rng = np.random.default_rng(2)
    x0, x1 = (rng.normal(size=(30, 3)) for _ in range(2))
    x0 /= np.linalg.norm(x0, axis=1, keepdims=True)
    x1 /= np.linalg.norm(x1, axis=1, keepdims=True)
    w = rng.random(30)
    field = SavedParticleField([0.0, 1.0], np.array([x0, x1]), w, model)
    y = HealpixMesh(2).centroids
    mid = 0.75 * x0 + 0.25 * x1
    mid /= np.linalg.norm(mid, axis=1, keepdims=True)
    v_ref, div_ref, _ = attention_field(model, mid, w, y, want_div=True, method="direct")
    v, div = field(y, 0.25)
    np.testing.assert_allclose(v, v_ref, rtol=0, atol=1e-14)
    np.testing.assert_allclose(div, div_ref, rtol=0, atol=1e-13)


def test_rescaled_state_keeps_the_total_mass_and_the_atoms_proportions():
    """spherepde.validation.background_scaling: the mesh density times s, the removed mass to the living
    atoms in proportion to their masses; mesh + atoms mass unchanged, dead slots untouched."""
    from spherepde.validation.background_scaling import rescaled_state

    mesh = HealpixMesh(4)
    rng = np.random.default_rng(3)
    f = rng.random(mesh.npix) + 0.1
    masses = np.array([0.3, 0.0, 0.1])
    positions = np.array([[1.0, 0, 0], [np.nan] * 3, [0, 0, 1.0]])
    state = {"atom_position": positions, "atom_mass": masses, "atom_created": np.array([1.0, np.nan, 2.0]),
             "created": 2, "merged": 0, "refused": 0}
    record = {"step_safety": 1.0, "steps": 10, "steps_rejected": 0, "sup_div": 1.0, "integrated_sup_div": 2.0,
              "max_sup_div": 1.0, "velocity_interval": 0.0, "velocity_interval_linear": 0.0,
              "atoms_created": 2, "atoms_merged": 0, "atoms_refused": 0}
    s = 1e-3
    got = rescaled_state(7, f, record, state, mesh, s)
    total = mesh.integrate(f) + masses.sum()
    assert got.index == 7
    np.testing.assert_allclose(got.density, s * f, rtol=0, atol=0)
    assert abs(mesh.integrate(got.density) + got.atoms["atom_mass"].sum() - total) < 1e-14
    new = got.atoms["atom_mass"]
    assert new[1] == 0.0 and abs(new[0] / new[2] - 3.0) < 1e-13
    assert masses[0] == 0.3  # the caller's state is not changed


def test_the_tails_report_names_its_reference_step_and_command(tmp_path):
    """`--states` / `--save-every`: the report of runs saved every 0.025 goes to its own file, whose
    command line and last column say the save intervals compared (no state run: states=[])."""
    from spherepde.validation.background import (BACKTRACK, CELLS_ONLY, EVENTS, FORMER_DEFAULTS, HEUN, LINEAR,
                                                 MEASURE, RETRACED, RUN_FILE_TAGS, SELECTIVE, STEPS, SUBSTEPS,
                                                 TAIL_STATES, UNBOUNDED, tails_report)

    tails_report((16,), (8.0,), out=tmp_path, say=lambda *_: None, states=[], save_every=0.025)
    text = (tmp_path / "background_tails_saves0.025.md").read_text()
    assert "--save-every 0.025" in text and "f_char, saves 0.05 against 0.025, p90" in text
    assert "--tails --nside 16 --t 8 --save-every 0.025`" in text  # times other than 2, 4, 6, 8 are named
    assert not (tmp_path / "background_tails.md").exists()
    assert "RK4, dt = 0.025)" in text and "--reference-step" not in text
    # f_char in shorter RK4 steps: a report of its own, which says so
    tails_report((16,), (8.0,), out=tmp_path, say=lambda *_: None, states=[], save_every=0.025, reference_step=0.0125)
    text = (tmp_path / "background_tails_saves0.025_step0.0125.md").read_text()
    assert "--save-every 0.025 --reference-step 0.0125" in text and "RK4, dt = 0.0125)" in text
    from spherepde.validation.background import main
    with pytest.raises(SystemExit) as stop:
        main(["--tails", "--reference-step", "0", "--out", str(tmp_path)])
    assert stop.value.code == 2
    # one run file per state, under the names the runs were written with (the finite volumes' has no tag)
    assert list(RUN_FILE_TAGS) == list(TAIL_STATES) and len(set(RUN_FILE_TAGS.values())) == len(TAIL_STATES)
    assert [RUN_FILE_TAGS[label] for label in list(TAIL_STATES)[:4]] == ["", "tails_anchored_", "tails_clusters_",
                                                                         "tails_retraced_"]
    assert len(TAIL_STATES) == 23 and list(TAIL_STATES.values())[0] is False  # index 0: the finite volumes
    # the states made before the field of the measure became the default keep the fields linear, as run
    assert all(o[-1] == LINEAR for o in list(TAIL_STATES.values())[1:13])
    assert not any(LINEAR in o for o in list(TAIL_STATES.values())[13:])
    # every state on top of the defaults they were run with, whatever the defaults are now
    assert all(o[:len(FORMER_DEFAULTS)] == list(FORMER_DEFAULTS) for o in list(TAIL_STATES.values())[1:])
    states = [o if o is False else [x for x in o[len(FORMER_DEFAULTS):] if x != LINEAR] for o in TAIL_STATES.values()]
    # the states first run before the bound became the default keep their unbounded following
    assert all(UNBOUNDED in overrides for overrides in states[1:4])
    # the defaults' state as it was run: 3 cells kept around an atom, before one kernel width became the default
    assert states[4] == [CELLS_ONLY]
    assert states[5] == list(SELECTIVE)  # the defaults (one kernel width) with selective paths
    # the retraced paths of state 3 through the states after every step, in a run file of their own
    substeps = states[6]
    assert SUBSTEPS in substeps and set(RETRACED) <= set(substeps) and UNBOUNDED in substeps
    # the same and the defaults through every step's state only where atoms changed
    assert states[7] == [*substeps[:-1], EVENTS, UNBOUNDED]
    assert states[8] == [SUBSTEPS, EVENTS]
    assert states[9] == [*substeps[:2], SUBSTEPS, EVENTS]  # the clusters' peaks, maps
    # the retraced paths at atom events, one RK4 step between each two states
    assert states[10] == [*substeps[:4], EVENTS, UNBOUNDED]
    # the retraced paths of state 3 in shorter RK4 steps, without the step states
    assert [overrides[4] for overrides in states[11:13]] == [
        "eulerian.tail_path_step=0.025", "eulerian.tail_path_step=0.05"]
    assert all(overrides[:4] + overrides[5:] == substeps[:4] + [UNBOUNDED]
               for overrides in states[11:13])
    # states 3, 4 and 2 through the field of the measure between couplings, nothing else changed
    assert states[13] == [*states[3][:4], MEASURE, UNBOUNDED]
    assert states[14] == [*states[4], MEASURE]
    assert sorted(states[15]) == sorted([*states[2], MEASURE])
    # state 14 with the backtracked maps, through the field of the measure and through the steps' states
    assert states[16] == [*states[14], *BACKTRACK] and states[17] == [CELLS_ONLY, STEPS, *BACKTRACK]
    assert states[18] == [*states[2][:2], STEPS, *BACKTRACK]  # and the clusters' peaks, couplings every 0.05
    assert states[19] == [states[2][0], STEPS, *BACKTRACK]  # the clusters' peaks, couplings every 0.2
    assert states[20] == [*states[19], HEUN]  # and the paths by the trapezoidal rule
    assert states[21] == [*states[19], "eulerian.tail_path_step=0.1"]  # and RK4 steps of 0.1 (the last step wins)


def test_saved_field_hands_merged_and_new_atoms_mass_over_linearly():
    """Between two snapshots where atom 0 merges into atom 1 and atom 2 is born from the cells,
    the measure's total mass is linear in time (an atom that disappears is ramped down, not dropped)."""
    import xarray as xr

    from spherepde.validation.background import SavedField

    mesh = HealpixMesh(2)
    model = AttentionModel(B=PAPER_B, V=PAPER_V, beta=3.0)
    pos = np.array([[1.0, 0, 0], [0, 1.0, 0], [0, 0, 1.0]])
    m0, m1 = np.array([0.2, 0.3, 0.0]), np.array([0.0, 0.5, 0.1])
    f0 = np.full(mesh.npix, 0.5 / (4 * np.pi))
    f1 = np.full(mesh.npix, 0.4 / (4 * np.pi))
    ds = xr.Dataset({"density": (("time", "cell"), np.stack([f0, f1])),
                     "atom_position": (("time", "atom", "xyz"), np.stack([pos, pos])),
                     "atom_mass": (("time", "atom"), np.stack([m0, m1]))}, coords={"time": [1.0, 1.1]})
    field = SavedField(ds, mesh, model)
    for a in (0.0, 0.3, 0.7, 1.0):
        _, masses = field.measure(1.0 + 0.1 * a)
        np.testing.assert_allclose(masses.sum(), 1.0, rtol=1e-12)
    sources, masses = field.measure(1.03)
    dying = np.all(np.isclose(sources, pos[0]), axis=1) & (masses > 0)
    np.testing.assert_allclose(masses[dying].sum(), 0.7 * 0.2, rtol=1e-12)


def _run_dataset(mesh, densities, times, g=None):
    import xarray as xr

    n = len(times)
    pos = np.zeros((n, 1, 3))
    pos[:, 0, 0] = 1.0
    data = {"density": (("time", "cell"), np.asarray(densities)),
            "atom_position": (("time", "atom", "xyz"), pos),
            "atom_mass": (("time", "atom"), np.zeros((n, 1)))}  # no atom alive: every cell is far
    if g is not None:
        data["log_density"] = (("time", "cell"), g)
        data["log_density_time"] = ("time", np.asarray(times))
    return xr.Dataset(data, coords={"time": np.asarray(times)})


def test_reference_sampling_sees_only_a_measure_that_is_not_linear_in_time():
    """A measure linear in time is the same field from every k-th snapshot (the differences vanish to
    round-off); one that bends in time between snapshots 0.1 apart is not. The g column compares log f of the tails with each reference."""
    from spherepde.validation.background import reference_sampling

    mesh = HealpixMesh(2)
    model = AttentionModel(B=PAPER_B, V=PAPER_V, beta=3.0)
    law = VonMisesFisher([0.3, -0.2, 0.9], 8.0)  # deep background (f < 10⁻⁴) on the far side
    times = np.linspace(0.0, 0.8, 9)
    f0 = law.cell_averages(mesh)
    bump = np.exp(-8 * (1 - mesh.centroids @ np.array([0.0, 1.0, 0.0]))) / (4 * np.pi)
    bump *= f0.sum() / bump.sum()
    linear = [f0 + (s / 0.8) * (bump - f0) for s in times]
    bent = [f0 + np.sin(4 * np.pi * s) ** 2 * (bump - f0) for s in times]
    g = np.log(np.array(linear))
    r = reference_sampling(_run_dataset(mesh, linear, times, g), mesh, model, law, 0.8, strides=(4, 2, 1), dt=0.05)
    assert r["cells"] > 0
    assert max(r["against_finest"].values()) < 1e-9
    assert set(r["g"]) == {4, 2, 1}
    r = reference_sampling(_run_dataset(mesh, bent, times), mesh, model, law, 0.8, strides=(4, 2, 1), dt=0.05)
    assert min(r["against_finest"].values()) > 1e-3
    assert r["g"] == {}


def test_at_beta_1000_the_reference_sums_the_cells_as_gs_paths_do(tmp_path):
    """Where the kernel is narrower than a cell (β = 1000, nside 8: 8 × 8 children per cell) the
    reference's field at a snapshot is the field LogTails gives g's paths for the same measure
    (the sub-cell sources with the log-linear profile of ln f), to the tree's 1e-10; and between
    two snapshots that of the linear measure. The β = 30 field sums the cell centres, as before.
    The report of runs at β ≠ 30 says so in its name, title and command line."""
    import xarray as xr

    from spherepde.solvers.tails import LogTails
    from spherepde.validation.background import SavedField, tails_report

    mesh = HealpixMesh(8)
    model = AttentionModel(B=PAPER_B, V=PAPER_V, beta=1000.0)
    rng = np.random.default_rng(7)
    f0 = 10.0 ** rng.uniform(-14, 0, mesh.npix)
    f1 = f0 * 10.0 ** rng.uniform(-1, 1, mesh.npix)
    pos = np.array([[[0.6, 0.0, 0.8]], [[0.0, 0.6, 0.8]]])
    mass = np.array([[0.3], [0.4]])
    ds = xr.Dataset({"density": (("time", "cell"), np.stack([f0, f1])),
                     "atom_position": (("time", "atom", "xyz"), pos),
                     "atom_mass": (("time", "atom"), mass)}, coords={"time": [2.0, 2.1]})
    field = SavedField(ds, mesh, model)
    tails = LogTails(mesh, model, profile="log_linear")
    assert field.subcells == tails.subcells == 8
    y = np.ascontiguousarray(np.stack(hp.pix2vec(8, np.arange(0, mesh.npix, 5), nest=True), axis=1))
    for s, f, x, m in ((2.0, f0, pos[0], mass[0]), (2.05, 0.5 * (f0 + f1), np.array([[0.3, 0.3, 0.8]]), [0.35])):
        x = x / np.linalg.norm(x, axis=1, keepdims=True)
        for got, want in zip(field(y, s), tails._field_of_points(f, x, np.asarray(m))(y)):
            np.testing.assert_allclose(got, want, rtol=1e-8, atol=1e-9)
    assert SavedField(ds, mesh, AttentionModel(B=PAPER_B, V=PAPER_V, beta=30.0)).subcells == 1
    tails_report((16,), (8.0,), out=tmp_path, say=lambda *_: None, states=[], beta=1000.0)
    text = (tmp_path / "background_tails_beta1000.md").read_text()
    assert text.startswith("# The background at β = 1000") and "--t 8 --beta 1000`" in text
    assert "sub-cell sources" in text


def test_state_19_is_what_tails_log_runs_by_default():
    """The configuration's defaults of `tails = "log"` are state 19's settings (the backtracked maps
    through the steps' states at the clusters' peaks), and every state names the former defaults
    it was run with, so its run resolves to the same config whatever the defaults are."""
    from spherepde.runner import config as C
    from spherepde.validation.background import FORMER_DEFAULTS, TAIL_STATES
    from spherepde.validation.common import REPO

    base = C.load(REPO / "solvers" / "atoms_base.toml")
    state19 = list(TAIL_STATES.values())[19][len(FORMER_DEFAULTS):]
    plain = C.resolve(C.apply_overrides(base, ['eulerian.tails="log"']))
    assert C.resolve(C.apply_overrides(base, ['eulerian.tails="log"', *state19])) == plain
    former = C.resolve(C.apply_overrides(base, ['eulerian.tails="log"', *FORMER_DEFAULTS]))
    assert (former["eulerian"]["tail_paths"], former["eulerian"]["tail_anchor"]) == ("maps", 1.0)
    assert C.difference(former, plain, ignore=()) is not None
