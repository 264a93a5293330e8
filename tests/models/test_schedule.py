"""Weights that change with depth (spherepde.models.schedule: Schedule, callables): steps land on every
switch time and use the model of their start; two layers of equal weights are one run (both
solvers, atoms, extrapolated fluxes); a callable equals the schedule it describes; two different
layers at β = ∞ follow the composition of the two exact flows; a run resumed across a switch
equals the uninterrupted one; the per-layer diagnostics; bad [[model.layers]] exit 2."""

import json
import math

import numpy as np
import pytest
import scipy.linalg
from run_helpers import ROUND_OFF, interrupt_after, one_numba_thread, run_difference  # noqa: F401 (autouse: one numba thread)

from spherepde.analysis.exact import linear_pushforward_density
from spherepde.cli import main
from spherepde.models.attention import AttentionModel
from spherepde.models.heads import MultiHeadModel, theory_objects
from spherepde.models.initial import ProjectedNormal, Uniform, VonMisesFisher
from spherepde.models.schedule import Schedule
from spherepde.solvers.eulerian import EulerianSolver
from spherepde.solvers.particles import (
    ParticleSolver,
    quadrature_particles,
    tokens_from_law,
)
from spherepde.solvers.timeline import segments, with_breaks
from spherepde.storage.runfile import open_run
from spherepde.summation.heads import heads_attention_field

PAPER_V = np.diag([-1.0, 1.0, -2.0])
PAPER_B = np.diag([-1.0, -1.0, 1.0])
V_TILTED = np.array([[0.2, 0.0, 0.0], [0.0, 1.0, 0.4], [0.0, 0.4, -0.5]])  # dominant axis near e₂
ATOMS = dict(capacity=16, width=1.3, min_mass=1e-4, merge=0.5, feeding=True)




class Recording(Schedule):
    """A Schedule that records every time the solvers ask for the model's key."""

    def __init__(self, *args):
        super().__init__(*args)
        self.asked = []

    def key_at(self, t):
        self.asked.append(t)
        return super().key_at(t)


def two_layers(beta=10.0, start=0.4, second=None):
    first = AttentionModel(PAPER_B, PAPER_V, beta)
    return Schedule([0.0, start], [first, second or AttentionModel(np.eye(3), V_TILTED, beta)])


# ------------------------------------------------------------------ schedule and timeline
def test_layer_schedule_and_segments():
    a, b = AttentionModel(PAPER_B, PAPER_V, 3.0), AttentionModel(np.eye(3), V_TILTED, 3.0)
    s = Schedule([0.0, 0.5], [a, b])
    assert s.model_at(0.0).heads == (a,) and s.model_at(0.5 - 1e-15).heads == (a,)
    assert s.model_at(0.5).heads == (b,) and s.model_at(9).heads == (b,)
    assert s.switch_times == (0.5,) and s.key_at(0.49) == 0 and s.key_at(0.5) == 1
    for starts, models, match in (([0.1], [a], "start at 0"), ([0.0, 0.5, 0.5], [a, b, a], "previous start"),
                                  ([0.0], [a, b], "one start time per model")):
        with pytest.raises(ValueError, match=match):
            Schedule(starts, models)
    assert segments(0.0, 1.0, [0.3, 0.7, 1.5, 1e-13, 1.0 - 1e-13]) == [(0.0, 0.3), (0.3, 0.7), (0.7, 1.0)]
    assert segments(0.2, 0.4, ()) == [(0.2, 0.4)]
    times = [k * 0.1 for k in range(6)]  # 3·0.1 = 0.30000000000000004
    assert with_breaks(times, [0.3, 0.25, 0.5]) == [0.0, 0.1, 0.2, 0.25, 0.3, 0.4, 0.5]


def test_steps_land_on_switch_times_and_use_the_model_of_their_start(mesh_factory):
    """A switch at t = 0.37, not a save time: the Eulerian solver's steps and the particles' steps
    end exactly there, one switch is taken, and the particles ask for the model at step starts
    only (the RK4 stages of a step keep it)."""
    mesh = mesh_factory(4)
    schedule = Recording([0.0, 0.37], two_layers().layers)
    f0 = VonMisesFisher([0.6, 0.0, 0.8], 3.0).cell_averages(mesh)
    solver = EulerianSolver(mesh, schedule, atoms=ATOMS, velocity_tolerance=1e-3)
    solver.run(f0, 0.6, 0.3)
    assert 0.37 in schedule.asked and solver.switches == 1 and solver.velocity.key == 1
    schedule = Recording([0.0, 0.37], two_layers().layers)
    x0, w = tokens_from_law(VonMisesFisher([0.6, 0.0, 0.8], 3.0), 50, seed=1)
    ParticleSolver(schedule, "rk4", 0.05).run(x0, w, 0.6, 0.3)
    starts = schedule.asked[1:]  # the first is the constructor's
    # [0, 0.3]: 6 steps; [0.3, 0.37]: 0.05 + 0.02; [0.37, 0.6]: 4 × 0.05 + 0.03
    assert 0.37 in starts and len(starts) == 13
    assert all(b - a <= 0.05 + 1e-12 for a, b in zip(starts, starts[1:]))


# ------------------------------------------------------------------ equal layers = one run
@pytest.mark.parametrize("velocity_tolerance", [0.0, 1e-3])
def test_two_equal_layers_equal_one_run_eulerian(mesh_factory, velocity_tolerance):
    """Two layers of the same weights switching at 0.3 (inside a save interval) against one model
    with a snapshot at 0.3 (a step lands there in both): the same densities, atoms and bound
    records, with atoms and with extrapolated fluxes (the history restarts at the switch as at a
    snapshot)."""
    mesh = mesh_factory(4)
    model = AttentionModel(PAPER_B, PAPER_V, 10.0)
    f0 = VonMisesFisher([0.6, 0.0, 0.8], 12.0).cell_averages(mesh)
    opts = dict(atoms=ATOMS, velocity_tolerance=velocity_tolerance)
    one = {t: (f.copy(), dict(rec)) for _, t, f, rec in
           EulerianSolver(mesh, model, **opts).snapshots(f0, [0.0, 0.2, 0.3, 0.4, 0.6])}
    solver = EulerianSolver(mesh, Schedule([0.0, 0.3], [model, AttentionModel(PAPER_B, PAPER_V, 10.0)]), **opts)
    two = {t: (f.copy(), dict(rec)) for _, t, f, rec in solver.snapshots(f0, [0.0, 0.2, 0.4, 0.6])}
    assert solver.switches == 1 and one[0.6][1]["atom_count"] > 0
    for t in (0.2, 0.4, 0.6):
        np.testing.assert_allclose(two[t][0], one[t][0], rtol=ROUND_OFF, atol=ROUND_OFF * f0.max())
        for name in ("integrated_sup_div", "sup_div", "atom_mass_total", "steps", "steps_rejected"):
            assert two[t][1][name] == pytest.approx(one[t][1][name], rel=ROUND_OFF), (t, name)


@pytest.mark.parametrize("mode", ["tokens", "quadrature"])
def test_two_equal_layers_equal_one_run_particles(mesh_factory, mode):
    law = VonMisesFisher([0.6, 0.0, 0.8], 3.0)
    model = AttentionModel(PAPER_B, PAPER_V, 10.0)
    if mode == "tokens":
        x0, w = tokens_from_law(law, 100, seed=2)
        log_f0 = None
    else:
        x0, w, log_f0 = quadrature_particles(mesh_factory(4), law)
    carry = mode == "quadrature"
    one = ParticleSolver(model, "rk4", 0.05, carry_density=carry).run(x0, w, 0.8, 0.4, log_f0=log_f0)
    two = ParticleSolver(Schedule([0.0, 0.4], [model, AttentionModel(PAPER_B, PAPER_V, 10.0)]), "rk4", 0.05,
                         carry_density=carry).run(x0, w, 0.8, 0.4, log_f0=log_f0)
    np.testing.assert_array_equal(two.positions.values, one.positions.values)
    if carry:
        np.testing.assert_array_equal(two.particle_density.values, one.particle_density.values)


def test_callable_equals_the_layer_schedule_it_describes(mesh_factory):
    """t ↦ (B, V, β) switching at a save time equals the Schedule: both solvers, atoms and
    extrapolated fluxes; a constant callable equals the model."""
    mesh = mesh_factory(4)
    schedule = two_layers(start=0.4)
    (first,), (second,) = (layer.heads for layer in schedule.layers)

    def weights(t):
        m = first if t < 0.4 else second
        return m.B, m.V, m.beta

    f0 = VonMisesFisher([0.6, 0.0, 0.8], 12.0).cell_averages(mesh)
    opts = dict(atoms=ATOMS, velocity_tolerance=1e-3)
    a = EulerianSolver(mesh, schedule, **opts).run(f0, 0.8, 0.2)
    b = EulerianSolver(mesh, weights, **opts).run(f0, 0.8, 0.2)
    np.testing.assert_allclose(b.density.values, a.density.values, rtol=ROUND_OFF, atol=ROUND_OFF * f0.max())
    np.testing.assert_allclose(b.atom_mass.values, a.atom_mass.values, rtol=ROUND_OFF, atol=1e-15)
    assert b.attrs["beta"] == "mixed" and a.attrs["beta"] == 10.0
    x0, w, log_f0 = quadrature_particles(mesh, VonMisesFisher([0.6, 0.0, 0.8], 3.0))
    pa = ParticleSolver(schedule, "rk4", 0.05, carry_density=True).run(x0, w, 0.8, 0.4, log_f0=log_f0)
    pb = ParticleSolver(weights, "rk4", 0.05, carry_density=True).run(x0, w, 0.8, 0.4, log_f0=log_f0)
    np.testing.assert_array_equal(pb.positions.values, pa.positions.values)
    np.testing.assert_array_equal(pb.particle_density.values, pa.particle_density.values)
    const = ParticleSolver(lambda t: (first.B, first.V, first.beta), "rk4", 0.05).run(x0, w, 0.4, 0.4)
    model = ParticleSolver(first, "rk4", 0.05).run(x0, w, 0.4, 0.4)
    np.testing.assert_array_equal(const.positions.values, model.positions.values)


# ------------------------------------------------------------------ β = ∞: composed exact flows
def composed(t, t1, M1, M2):
    """A of the composed β = ∞ flows: e^{(t − t1)M2} e^{t1 M1} (t > t1)."""
    return scipy.linalg.expm((t - t1) * M2) @ scipy.linalg.expm(t1 * M1)


def zero_temperature_layers():
    """Layer 1: the paper's matrices; layer 2 from t = 0.4: two heads with orthogonal B_h (its
    field is P_x(M_2 x), M_2 = Σ_h M_h)."""
    second = MultiHeadModel((AttentionModel(np.eye(3), V_TILTED, math.inf),
                             AttentionModel(np.array([[0.0, -1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]),
                                            np.diag([0.3, 0.1, -0.4]), math.inf)))
    return Schedule([0.0, 0.4], [AttentionModel(PAPER_B, PAPER_V, math.inf), second])


def test_two_layers_zero_temperature_composed_exact_flow(mesh_factory):
    """β = ∞, orthogonal B: the Eulerian density at t = 0.8 against the push-forward by the
    composition e^{0.4 M_2} e^{0.4 M_1} (second order; the first flow alone is far off), and the
    quadrature particles' paths and carried densities against it."""
    schedule = zero_temperature_layers()
    M1, M2 = (theory_objects(m).model.M for m in schedule.layers)
    law, t = Uniform(), 0.8
    exact = linear_pushforward_density(law, composed(t, 0.4, M1, M2))
    err = {}
    for nside in (8, 16):
        m = mesh_factory(nside)
        ds = EulerianSolver(m, schedule).run(law.cell_averages(m), t, 0.4)
        err[nside] = m.area * np.abs(ds.density.values[-1] - m.cell_average(exact)).sum()
    assert math.log2(err[8] / err[16]) > 1.5 and err[16] < 5e-3, err
    one_flow = m.cell_average(linear_pushforward_density(law, scipy.linalg.expm(t * M1)))
    assert m.area * np.abs(ds.density.values[-1] - one_flow).sum() > 20 * err[16]
    # local fields: sup div v is constant within a layer, so ∫ sup div v = 0.4 S₁ + 0.4 S₂ exactly
    # when the trapezoid after the switch starts from the new model's value (the right limit)
    sup = [float(heads_attention_field(model, m.centroids, m.area * np.ones(m.npix), m.centroids, True)[1].max())
           for model in schedule.layers]
    assert ds.sup_div.values.tolist() == pytest.approx([sup[0], sup[1], sup[1]], rel=1e-12)
    assert ds.integrated_sup_div.values[-1] == pytest.approx(0.4 * sup[0] + 0.4 * sup[1], rel=1e-12)

    law = ProjectedNormal([0.2, 0.1, 0.0], np.diag([1.0, 0.7, 0.5]))
    x0, w, log_f0 = quadrature_particles(mesh_factory(4), law)
    A = composed(t, 0.4, M1, M2)
    y = x0 @ A.T
    exact_x = y / np.linalg.norm(y, axis=1, keepdims=True)
    ds = ParticleSolver(schedule, "rk4", 0.02, carry_density=True).run(x0, w, t, t, log_f0=log_f0)
    assert np.abs(ds.positions.values[-1] - exact_x).max() < 1e-6
    np.testing.assert_allclose(ds.particle_density.values[-1], linear_pushforward_density(law, A)(exact_x), rtol=1e-5)


# ------------------------------------------------------------------ config, resume, diagnostics
LAYERS_CONFIG = """
[model]
beta = 10.0

[[model.layers]]
start = 0.0
B = [[-1.0, 0.0, 0.0], [0.0, -1.0, 0.0], [0.0, 0.0, 1.0]]
V = [[-1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, -2.0]]

[[model.layers]]
start = 0.3
beta = "inf"

[[model.layers.heads]]
B = [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
V = [[0.2, 0.0, 0.0], [0.0, 1.0, 0.4], [0.0, 0.4, -0.5]]

[[model.layers.heads]]
B = [[0.0, -1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]
V = [[0.3, 0.0, 0.0], [0.0, 0.1, 0.0], [0.0, 0.0, -0.4]]

[initial]
kind = "vmf"
mu = [0.6, 0.0, 0.8]
kappa = 3.0

[eulerian]
nside = 4
velocity_tolerance = 1e-3

[particles]
mode = "quadrature"
dt = 0.05

[time]
t_end = 0.7
save_every = 0.2
"""


@pytest.fixture(scope="module")
def layered_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("layers")
    cfg = d / "layers.toml"
    cfg.write_text(LAYERS_CONFIG)
    out = d / "ref.nc"
    assert main(["run", str(cfg), "-o", str(out)]) == 0
    return cfg, out


def test_layered_run_file_and_its_per_layer_diagnostics(layered_run):
    """A snapshot at the switch; the layers in the attributes (starts, heads, what E, F mean);
    from the switch on the diagnostics are those of the second layer's model (two heads at β = ∞:
    E defined, F not) relative to the measure at 0.3: W₂ bound √(2V_p(ρ_0.3)) e^{−pγ(t − 0.3)}."""
    _, out = layered_run
    ds = open_run(out)
    np.testing.assert_allclose(ds.time.values, [0.0, 0.2, 0.3, 0.4, 0.6, 0.7], atol=1e-15)
    layers = json.loads(ds.attrs["layers"])
    assert [l["start"] for l in layers] == [0.0, 0.3] and [len(l["heads"]) for l in layers] == [1, 2]
    assert [l["E_defined"] for l in layers] == [1, 1] and [l["F_defined"] for l in layers] == [1, 0]
    assert ds.attrs["beta"] == "mixed" and ds.attrs["head_convention"] == "sum"
    first = ds.time.values < 0.3 - 1e-12
    assert np.isfinite(ds.alignment_F.values[first]).all() and np.isnan(ds.alignment_F.values[~first]).all()
    assert np.isfinite(ds.particle_alignment_F.values[first]).all()
    assert np.isnan(ds.particle_alignment_F.values[~first]).all()
    gap = layers[1]["gap"]
    lyap = ds.lyapunov.values
    k = 2  # the switch
    bound = math.sqrt(2 * lyap[k]) * np.exp(-0.25 * gap * (ds.time.values[k:] - 0.3))
    np.testing.assert_allclose(ds.w2_bound_zero_temperature.values[k:], bound, rtol=1e-12)
    np.testing.assert_allclose(ds.w2_bound_zero_temperature.values[:k], math.sqrt(2 * lyap[0]) *
                               np.exp(-0.25 * AttentionModel(PAPER_B, PAPER_V, 10.0).gap * ds.time.values[:k]), rtol=1e-12)
    # at β = ∞ the mass flows towards E of M_2 = Σ_h M_h: W₂ to Π_2#ρ_0.3 shrinks
    assert np.all(np.diff(ds.w2_to_projection.values[k:]) < 0)


@pytest.mark.parametrize("count", [3, 4])
def test_resume_across_a_layer_switch_equals_the_uninterrupted_run(layered_run, tmp_path, count):
    """Interrupted after the snapshot at the switch (3) or after the next one (4, so that the
    resumed run reads the measure at the layer start back from the file), then --resume: the file
    equals the uninterrupted run's (atoms, extrapolated fluxes, quadrature particles)."""
    cfg, ref = layered_run
    out = tmp_path / "out.nc"
    interrupt_after(cfg, out, count)
    assert open_run(out).sizes["time"] == count
    assert main(["run", str(cfg), "-o", str(out), "--resume"]) == 0
    assert run_difference(out, ref) <= ROUND_OFF


BAD_LAYERS = [
    ("first start", lambda t: t.replace("start = 0.0", "start = 0.1"), ["[model.layers[0]] start", "at 0"]),
    ("starts not increasing", lambda t: t.replace("start = 0.3", "start = 0.0"), ["[model.layers[1]] start", "> the previous"]),
    ("start after t_end", lambda t: t.replace("start = 0.3", "start = 0.7"), ["[model.layers[1]] start", "< t_end"]),
    ("start missing", lambda t: t.replace("start = 0.3\n", ""), ["[model.layers[1]] start", "required"]),
    ("start text", lambda t: t.replace("start = 0.3", 'start = "late"'), ["[model.layers[1]] start", "a number"]),
    ("layer missing V", lambda t: t.replace("V = [[-1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, -2.0]]", ""),
     ["[model.layers[0]] V", "required"]),
    ("layer B and heads", lambda t: t.replace('beta = "inf"', 'beta = "inf"\nB = [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]'),
     ["[model.layers[1]] B", "not with heads"]),
    ("layer head missing B", lambda t: t.replace("B = [[0.0, -1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]\n", ""),
     ["[model.layers[1].heads[1]] B", "required"]),
    ("layer unknown key", lambda t: t.replace("start = 0.3", "start = 0.3\ndepth = 2"), ["[model.layers[1]] depth", "unknown key"]),
    ("layer beta", lambda t: t.replace('beta = "inf"', "beta = 0.0"), ["[model.layers[1]] beta", "> 0"]),
    ("layers and B", lambda t: t.replace("beta = 10.0", "beta = 10.0\nV = [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]"),
     ["[model] V", "[[model.layers]]"]),
    ("unnormalised layer at inf", lambda t: t.replace("beta = 10.0", 'beta = 10.0\nnormalisation = "unnormalised"'),
     ["[model.layers[1].heads[0]] beta", "unnormalised", "inf"]),
    ("layers not tables", lambda t: "[model]\nbeta = 10.0\nlayers = [1, 2]\n" + t[t.index("[initial]"):],
     ["[model] layers", "list of tables"]),
]


@pytest.mark.parametrize("name,edit,words", BAD_LAYERS, ids=[b[0] for b in BAD_LAYERS])
def test_bad_layers_config_one_line_exit_2(tmp_path, capsys, name, edit, words):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(edit(LAYERS_CONFIG))
    out = tmp_path / "out" / "run.nc"
    assert main(["run", str(cfg), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and not out.exists()
    for word in words:
        assert word in err, (word, err)


def test_sweep_runs_a_layered_and_a_multi_head_config(tmp_path):
    """The sweep machinery (expansion, warm-up, run_one, combine) on layers and heads: a grid over
    [eulerian] nside and over the whole [model] table (one with layers, one with heads)."""
    import tomllib

    from spherepde.runner.sweep import combine, expand, plan, run_one, warm_up

    layers = tomllib.loads(LAYERS_CONFIG)["model"]
    heads = {"label": "heads", "beta": 10.0, "heads": layers["layers"][1]["heads"]}
    layers["label"] = "layers"
    base = LAYERS_CONFIG[LAYERS_CONFIG.index("[initial]"):].replace("[particles]\nmode = \"quadrature\"\ndt = 0.05\n", "")
    (tmp_path / "base.toml").write_text(base.replace("[initial]", "[model]\nbeta = 1.0\nB = \"identity\"\nV = \"identity\"\n\n[initial]"))
    sweep = tmp_path / "sweep.toml"
    sweep.write_text('[sweep]\nname = "hl"\nbase = "base.toml"\n\n[sweep.grid]\n"eulerian.nside" = [2]\n'
                     f"model = [{_inline(layers)}, {_inline(heads)}]\n")
    specs = expand(sweep, tmp_path / "out")
    assert [s.params["model"] for s in specs] == ["layers", "heads"]
    assert plan(specs) == ["start", "start"]
    warm_up(specs)
    (tmp_path / "out").mkdir()
    for spec in specs:
        result = run_one({"run_id": spec.run_id, "config": spec.config, "action": "start"})
        assert result["ok"], result
    import xarray as xr

    ds = xr.open_dataset(combine(specs, tmp_path / "out" / "hl.nc", "hl"))
    assert ds.sizes["run"] == 2 and list(ds["model"].values) == ["layers", "heads"]
    # the union of the runs' times: the layer start 0.3 is a snapshot of the layered run only
    assert np.isfinite(ds.mass.values[0]).all() and np.isnan(ds.mass.values[1]).sum() == 1


def _inline(value):
    """A TOML inline value of nested lists and tables (numbers, strings)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_inline(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_inline(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def test_particles_alone_across_layers_equal_the_particles_beside_the_mesh(layered_run, tmp_path):
    """[eulerian] enabled = false with layers: the particles' per-layer diagnostics (those of the
    second layer's model from the switch on, relative to the particles at 0.3) equal the particle
    part of the run with the mesh bit for bit; interrupted after the snapshot past the switch and
    resumed (the positions at the layer start read back from the file), the run equals the
    uninterrupted one."""
    _, ref = layered_run
    cfg = tmp_path / "alone.toml"
    cfg.write_text(LAYERS_CONFIG.replace("nside = 4\n", "nside = 4\nenabled = false\n"))
    alone = tmp_path / "alone.nc"
    assert main(["run", str(cfg), "-o", str(alone)]) == 0
    a, b = open_run(alone), open_run(ref)
    assert "density" not in a and "alignment_E" not in a
    names = [n for n in b.data_vars if n.startswith("particle_") or n == "positions"]
    assert len(names) >= 6
    for name in names:
        np.testing.assert_array_equal(a[name].values, b[name].values, err_msg=name)
    assert np.isnan(a.particle_alignment_F.values[2:]).all() and np.isfinite(a.particle_alignment_F.values[:2]).all()
    out = tmp_path / "cut.nc"
    interrupt_after(cfg, out, 4)
    assert main(["run", str(cfg), "-o", str(out), "--resume"]) == 0
    assert run_difference(out, alone) <= ROUND_OFF
