"""Several heads (spherepde.models.heads, the SUM convention): the combined field against a NumPy
reference and against the exact local field at β = ∞, identical heads against one head in both
solvers, two orthogonal heads at β = ∞ against the exact push-forward by e^{tM}, M = Σ_h M_h, the
config (bad values: exit 2 naming the key), the run file, sweeps, and the cost in sums."""

import json
import math

import numpy as np
import pytest
import scipy.linalg
from numpy_reference import random_points, reference_field
from run_helpers import one_numba_thread  # noqa: F401 (autouse: one numba thread)

from spherepde.analysis.exact import zero_temperature_density
from spherepde.cli import main
from spherepde.models.attention import AttentionModel
from spherepde.models.heads import MultiHeadModel, orthogonal_scale, theory_objects
from spherepde.models.initial import ProjectedNormal, Uniform, VonMisesFisher
from spherepde.models.schedule import Schedule, schedule_of
from spherepde.models.weights import resolve_weights
from spherepde.runner.build import build_model
from spherepde.runner.config import difference, resolve
from spherepde.solvers.eulerian import EulerianSolver
from spherepde.solvers.particles import (
    ParticleSolver,
    quadrature_particles,
    tokens_from_law,
)
from spherepde.storage.runfile import open_run
from spherepde.summation import heads as head_fields
from spherepde.summation.heads import HeadsField, heads_attention_field

PAPER_V = np.diag([-1.0, 1.0, -2.0])
PAPER_B = np.diag([-1.0, -1.0, 1.0])
ROTATION = np.array([[0.0, -1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])  # orthogonal, not diagonal
V2 = np.array([[0.5, 0.0, 0.0], [0.0, 0.2, 0.0], [0.0, 0.0, -1.0]])
ATOMS = dict(capacity=16, width=1.3, min_mass=1e-4, merge=0.5, feeding=True)




def two_orthogonal_heads(scale=1.0):
    """Head 1: the paper's matrices; head 2: a rotation B (times scale) and V2; both at β = ∞."""
    return MultiHeadModel((AttentionModel(PAPER_B, PAPER_V, math.inf),
                           AttentionModel(scale * ROTATION, V2, math.inf)))


def identical_heads(n, beta=10.0):
    return MultiHeadModel(tuple(AttentionModel(PAPER_B, PAPER_V / n, beta) for _ in range(n)))


# ------------------------------------------------------------------ the combined field
def test_combined_field_is_the_sum_of_the_heads_numpy_reference(mesh_factory):
    """Three heads at different β with random matrices: velocity and divergence equal the sum of
    the heads' NumPy logsumexp references, for point measures and for a mesh (HeadsField)."""
    rng = np.random.default_rng(11)
    heads = [AttentionModel(rng.normal(size=(3, 3)), rng.normal(size=(3, 3)), beta) for beta in (0.7, 5.0, 20.0)]
    model = MultiHeadModel(tuple(heads))
    src, mass, x = random_points(300, 1), rng.random(300), random_points(40, 2)
    v, div = heads_attention_field(model, src, mass, x, want_div=True, method="direct")
    refs = [reference_field(h, src, mass, x) for h in heads]
    np.testing.assert_allclose(v, sum(r[0] for r in refs), atol=1e-12)
    np.testing.assert_allclose(div, sum(r[1] for r in refs), atol=1e-10 * 20)
    # a mean of the heads would be a third of it: the test can tell the conventions apart
    assert np.abs(v - sum(r[0] for r in refs) / 3).max() > 0.1

    mesh = mesh_factory(4)
    f = 0.5 + rng.random(mesh.npix)
    field = HeadsField(model, mesh, x, method="direct", near_field=False)
    v, div, mean = field(f, want_div=True)
    refs = [reference_field(h, mesh.centroids, f * mesh.area, x) for h in heads]
    np.testing.assert_allclose(v, sum(r[0] for r in refs), atol=1e-12)
    np.testing.assert_allclose(div, sum(r[1] for r in refs), atol=2e-9)
    assert mean is None


@pytest.mark.parametrize("scale", [1.0, 2.0])
def test_zero_temperature_heads_are_the_local_linear_field(scale):
    """Every head at β = ∞ with B_h = c_h·orthogonal: v = P_x(Mx), M = Σ_h M_h/c_h, and
    div_S v = tr M − 3xᵀMx (docs/theory.md#formulas-and-exact-solutions); theory_objects gives E, Π of that M, F undefined."""
    model = two_orthogonal_heads(scale)
    M = PAPER_V @ PAPER_B.T + V2 @ (scale * ROTATION).T / scale
    x = random_points(200, 3)
    v, div = heads_attention_field(model, x, np.ones(len(x)), x, want_div=True)
    u = x @ M.T
    np.testing.assert_allclose(v, u - np.sum(u * x, axis=1, keepdims=True) * x, atol=1e-14)
    np.testing.assert_allclose(div, np.trace(M) - 3 * np.sum(x * u, axis=1), atol=1e-13)
    th = theory_objects(model)
    assert th.has_E and not th.has_F
    np.testing.assert_allclose(th.model.M, M, atol=1e-15)
    assert th.model.zero_temperature and th.model.sigma_max == pytest.approx(1.0)
    assert orthogonal_scale(scale * ROTATION) == pytest.approx(scale)


def test_theory_objects_where_undefined():
    """One head: its own E and F (any B); a finite β or a B_h that is not a multiple of an
    orthogonal matrix among several heads: E, F, Π not defined."""
    one = AttentionModel(PAPER_B, PAPER_V, 10.0)
    assert theory_objects(one).model is one and theory_objects(one).has_F
    assert theory_objects(MultiHeadModel((one,))).model is one
    finite = MultiHeadModel((one, AttentionModel(ROTATION, V2, math.inf)))
    assert not theory_objects(finite).has_E and "finite β" in theory_objects(finite).note
    skew = MultiHeadModel((AttentionModel(PAPER_B, PAPER_V, math.inf),
                           AttentionModel(np.diag([1.0, 2.0, 1.0]), V2, math.inf)))
    assert not theory_objects(skew).has_E and "orthogonal" in theory_objects(skew).note


def test_combined_models_refuse_bad_input():
    with pytest.raises(ValueError, match="at least one head"):
        MultiHeadModel(())
    with pytest.raises(ValueError, match="at most 64"):
        MultiHeadModel(tuple(AttentionModel(PAPER_B, PAPER_V, 1.0) for _ in range(65)))
    with pytest.raises(TypeError):
        MultiHeadModel((PAPER_B,))
    with pytest.raises(TypeError):
        schedule_of("not a model")
    with pytest.raises(ValueError, match="expected"):
        schedule_of(lambda t: 3.0).model_at(0.0)
    with pytest.raises(ValueError, match="largest entry"):
        schedule_of(lambda t: (PAPER_B, 1e60 * PAPER_V, 1.0)).model_at(0.0)
    with pytest.raises(ValueError, match="largest entry"):
        EulerianSolver(None, MultiHeadModel((AttentionModel(PAPER_B, 1e60 * PAPER_V, 1.0),)))


# ------------------------------------------------------------------ identical heads = one head
def eulerian_run(mesh, model, f0, t_end=0.6, save_every=0.2, **options):
    return EulerianSolver(mesh, model, **options).run(f0, t_end, save_every)


@pytest.mark.parametrize("velocity_tolerance", [0.0, 1e-3])
def test_identical_heads_with_v_over_h_equal_one_head_eulerian(mesh_factory, velocity_tolerance):
    """Sum convention: H identical heads with V/H each are one head. H = 2, 4: V/H and the sum are
    exact in binary, so the runs agree bit for bit; H = 3 to round-off. With atoms (created here:
    the concentrated start collapses below the nside-4 cells) and with extrapolated fluxes."""
    mesh = mesh_factory(4)
    f0 = VonMisesFisher([0.6, 0.0, 0.8], 12.0).cell_averages(mesh)
    opts = dict(atoms=ATOMS, velocity_tolerance=velocity_tolerance)
    one = eulerian_run(mesh, AttentionModel(PAPER_B, PAPER_V, 10.0), f0, **opts)
    assert one.atom_count.values[-1] > 0
    for n in (2, 4):
        ds = eulerian_run(mesh, identical_heads(n), f0, **opts)
        np.testing.assert_array_equal(ds.density.values, one.density.values)
        np.testing.assert_array_equal(ds.atom_mass.values, one.atom_mass.values)
        np.testing.assert_array_equal(ds.sup_div.values, one.sup_div.values)
    ds = eulerian_run(mesh, identical_heads(3), f0, **opts)
    np.testing.assert_allclose(ds.density.values, one.density.values, rtol=1e-11, atol=1e-11 * f0.max())
    np.testing.assert_allclose(ds.atom_mass.values, one.atom_mass.values, rtol=1e-10, atol=1e-14)
    assert int(ds.steps.values[-1]) == int(one.steps.values[-1])
    # and not the mean convention: 3 identical heads with V each move 3× faster
    fast = eulerian_run(mesh, MultiHeadModel((AttentionModel(PAPER_B, PAPER_V, 10.0),) * 3), f0, t_end=0.2,
                        save_every=0.2, **opts)
    assert np.abs(fast.density.values[-1] - one.density.values[1]).max() > 0.05 * f0.max()


@pytest.mark.parametrize("mode,beta", [("tokens", 10.0), ("tokens", math.inf), ("quadrature", 10.0),
                                       ("quadrature", math.inf)])
def test_identical_heads_with_v_over_h_equal_one_head_particles(mesh_factory, mode, beta):
    """Tokens (hardmax at β = ∞) and density-carrying quadrature particles: H = 2 bit for bit,
    H = 3 to round-off."""
    law = VonMisesFisher([0.6, 0.0, 0.8], 3.0)
    if mode == "tokens":
        x0, w = tokens_from_law(law, 200, seed=4)
        log_f0 = None
    else:
        x0, w, log_f0 = quadrature_particles(mesh_factory(4), law)
    carry = mode == "quadrature"

    def run(model):
        return ParticleSolver(model, "rk4", 0.05, carry_density=carry).run(x0, w, 0.6, 0.3, log_f0=log_f0)

    one = run(AttentionModel(PAPER_B, PAPER_V, beta))
    two = run(identical_heads(2, beta))
    np.testing.assert_array_equal(two.positions.values, one.positions.values)
    three = run(identical_heads(3, beta))
    np.testing.assert_allclose(three.positions.values, one.positions.values, atol=1e-13)
    if carry:
        np.testing.assert_array_equal(two.particle_density.values, one.particle_density.values)
        np.testing.assert_allclose(three.particle_density.values, one.particle_density.values, rtol=1e-12)
    assert np.abs(one.positions.values[-1] - x0).max() > 0.05  # the tokens moved


# ------------------------------------------------------------------ β = ∞: exact push-forward
def test_two_orthogonal_heads_zero_temperature_exact_density(mesh_factory):
    """Two heads at β = ∞ with orthogonal B_h, uniform start: the Eulerian density against the
    exact push-forward by x ↦ e^{tM}x/|e^{tM}x|, M = M_1 + M_2 (the sum convention), second order
    at t = 0.5; one head alone (or the mean, M/2) is far off."""
    model = two_orthogonal_heads()
    effective = theory_objects(model).model
    law = Uniform()
    err = {}
    for nside in (8, 16):
        m = mesh_factory(nside)
        ds = EulerianSolver(m, model).run(law.cell_averages(m), 0.5, 0.5)
        exact = m.cell_average(zero_temperature_density(effective, law, 0.5))
        err[nside] = m.area * np.abs(ds.density.values[-1] - exact).sum()
    assert math.log2(err[8] / err[16]) > 1.5, err
    assert err[16] < 1e-2, err
    half = AttentionModel(np.eye(3), effective.M / 2, math.inf)
    wrong = m.cell_average(zero_temperature_density(half, law, 0.5))
    assert m.area * np.abs(ds.density.values[-1] - wrong).sum() > 20 * err[16]


def test_two_orthogonal_heads_zero_temperature_particle_paths(mesh_factory):
    """Quadrature particles (local field, RK4) follow e^{tM}x₀/|e^{tM}x₀| and carry the exact
    push-forward density, M = M_1 + M_2."""
    model = two_orthogonal_heads()
    effective = theory_objects(model).model
    law = ProjectedNormal([0.2, 0.1, 0.0], np.diag([1.0, 0.7, 0.5]))
    x0, w, log_f0 = quadrature_particles(mesh_factory(4), law)
    t = 1.0
    y = x0 @ scipy.linalg.expm(t * effective.M).T
    exact_x = y / np.linalg.norm(y, axis=1, keepdims=True)
    exact_f = zero_temperature_density(effective, law, t)(exact_x)
    ds = ParticleSolver(model, "rk4", 0.02, carry_density=True).run(x0, w, t, t, log_f0=log_f0)
    assert np.abs(ds.positions.values[-1] - exact_x).max() < 1e-6
    assert np.abs(ds.particle_density.values[-1] / exact_f - 1).max() < 1e-5


# ------------------------------------------------------------------ cost: H heads, H sums
def test_h_heads_cost_h_sums(mesh_factory, monkeypatch):
    """The same run with 1, 2 and 4 identical heads (V/H: the same steps) calls the attention sum
    exactly H times as often: no work beyond the heads' own sums."""
    import spherepde.summation.field as field_module

    calls = [0]
    original = field_module.attention_field

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(field_module, "attention_field", counted)
    monkeypatch.setattr(head_fields, "attention_field", counted)
    import spherepde.solvers.velocity as velocity_module

    monkeypatch.setattr(velocity_module, "attention_field", counted)
    mesh = mesh_factory(4)
    f0 = VonMisesFisher([0.6, 0.0, 0.8], 12.0).cell_averages(mesh)
    counts = {}
    for n in (1, 2, 4):
        calls[0] = 0
        model = AttentionModel(PAPER_B, PAPER_V, 10.0) if n == 1 else identical_heads(n)
        eulerian_run(mesh, model, f0, t_end=0.4, atoms=ATOMS)
        counts[n] = calls[0]
    assert counts[1] > 10 and counts[2] == 2 * counts[1] and counts[4] == 4 * counts[1], counts


# ------------------------------------------------------------------ config, run file, sweeps
HEADS_CONFIG = """
[model]
beta = {beta}
{heads}
[initial]
kind = "vmf"
mu = [0.6, 0.0, 0.8]
kappa = 3.0

[eulerian]
nside = 2

[time]
t_end = 0.2
save_every = 0.1
"""
TWO_HEADS = """
[[model.heads]]
B = [[-1.0, 0.0, 0.0], [0.0, -1.0, 0.0], [0.0, 0.0, 1.0]]
V = [[-1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, -2.0]]

[[model.heads]]
B = [[0.0, -1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]
V = [[0.5, 0.0, 0.0], [0.0, 0.2, 0.0], [0.0, 0.0, -1.0]]
beta = "inf"
"""


def heads_config(beta="10.0", heads=TWO_HEADS):
    return HEADS_CONFIG.format(beta=beta, heads=heads)


def test_heads_config_resolves_and_builds():
    cfg = resolve(tomllib_loads(heads_config()))
    heads = cfg["model"]["heads"]
    assert [h["beta"] for h in heads] == [10.0, "inf"]  # the default β, and the head's own
    assert cfg["model"]["B"] is None and cfg["model"]["V"] is None and cfg["model"]["layers"] is None
    schedule = build_model(cfg["model"])  # the one shape: a Schedule of one layer of two heads
    assert isinstance(schedule, Schedule) and len(schedule.layers) == 1 and schedule.layers[0].count == 2
    np.testing.assert_array_equal(schedule.layers[0].heads[1].B, ROTATION)
    assert schedule.describe().startswith("MultiHeadModel(2 heads")
    # one [[model.heads]] table is that head
    one = resolve(tomllib_loads(heads_config(heads="[[model.heads]]" + TWO_HEADS.split("[[model.heads]]")[1])))
    assert isinstance(build_model(one["model"]).single_head, AttentionModel)


def tomllib_loads(text):
    import tomllib

    return tomllib.loads(text)


def test_heads_run_file_records_the_heads_and_flags_undefined_diagnostics(tmp_path):
    """A finite-β head among two: E, F, Π not defined (NaN, E_defined = 0); the attributes hold
    the convention and the heads as in the config, and build the same model again. Both at β = ∞
    with orthogonal B_h: E defined (of M = M_1 + M_2), F not."""
    for name, beta, e_defined in (("finite", "10.0", 0), ("zero", '"inf"', 1)):
        cfg = tmp_path / f"{name}.toml"
        cfg.write_text(heads_config(beta=beta) + '\n[particles]\nmode = "quadrature"\ndt = 0.05\n')
        out = tmp_path / f"{name}.nc"
        assert main(["run", str(cfg), "-o", str(out)]) == 0
        ds = open_run(out)
        stored = json.loads(ds.attrs["config"])
        assert json.loads(ds.attrs["heads"]) == stored["model"]["heads"]
        assert ds.attrs["head_convention"] == "sum"
        assert int(ds.attrs["E_defined"]) == e_defined and int(ds.attrs["F_defined"]) == 0
        rebuilt = build_model(stored["model"])
        assert [h.beta for h in rebuilt.heads] == [10.0 if name == "finite" else math.inf, math.inf]
        assert np.isnan(ds.alignment_F.values).all() and np.isnan(ds.particle_alignment_F.values).all()
        for var in ("alignment_E", "w2_to_projection", "lyapunov", "w2_bound_zero_temperature",
                    "particle_alignment_E"):
            assert np.isnan(ds[var].values).all() == (e_defined == 0), var
        assert np.isfinite(ds.density.values).all() and np.isfinite(ds.sup_div.values).all()
    assert ds.attrs["beta"] == "inf" and int(ds.attrs["dim_E"]) == 1


BAD_HEADS = [
    ("B with heads", lambda t: t.replace("beta = 10.0", "beta = 10.0\nB = [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]"),
     ["[model] B", "[[model.heads]]"]),
    ("head missing V", lambda t: t.replace("V = [[0.5, 0.0, 0.0], [0.0, 0.2, 0.0], [0.0, 0.0, -1.0]]", ""),
     ["[model.heads[1]] V", "required"]),
    ("head matrix shape", lambda t: t.replace("V = [[0.5, 0.0, 0.0], [0.0, 0.2, 0.0], [0.0, 0.0, -1.0]]",
                                              "V = [[0.5, 0.0], [0.0, 0.2]]"), ["[model.heads[1]] V", "3×3"]),
    ("head beta", lambda t: t.replace('beta = "inf"', "beta = -2.0"), ["[model.heads[1]] beta", "> 0"]),
    ("head unknown key", lambda t: t.replace('beta = "inf"', "temperature = 1.0"), ["[model.heads[1]] temperature", "unknown key"]),
    ("head singular B at inf", lambda t: t.replace("B = [[0.0, -1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]",
                                                   "B = [[0.0, -1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]"),
     ["[model.heads[1]] B", "invertible"]),
    ("head huge V", lambda t: t.replace("[0.0, 0.0, -2.0]]", "[0.0, 0.0, -2e60]]"), ["[model.heads[0]] V", "largest entry"]),
    ("head law", lambda t: t.replace("V = [[0.5, 0.0, 0.0], [0.0, 0.2, 0.0], [0.0, 0.0, -1.0]]", 'V = "goa"'),
     ["[model.heads[1]] V", "goa"]),
    ("heads not tables", lambda t: t.replace(TWO_HEADS, "heads = 3\n"), ["[model] heads", "list of tables"]),
    ("unnormalised head at inf", lambda t: t.replace("[model]", '[model]\nnormalisation = "unnormalised"'),
     ["[model.heads[1]] beta", "unnormalised", "inf"]),
    ("unnormalised head overflows", lambda t: t.replace("[model]", '[model]\nnormalisation = "unnormalised"')
     .replace('beta = "inf"', "beta = 900.0"), ["[model] unnormalised_scale", "[model.heads[1]]", "exp_beta"]),
    ("heads and layers", lambda t: t + "\n[[model.layers]]\nstart = 0.0\nB = [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]\n"
     "V = [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]\n", ["[model] layers", "[[model.heads]]"]),
]


@pytest.mark.parametrize("name,edit,words", BAD_HEADS, ids=[b[0] for b in BAD_HEADS])
def test_bad_heads_config_one_line_exit_2(tmp_path, capsys, name, edit, words):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(edit(heads_config()))
    out = tmp_path / "out" / "run.nc"
    assert main(["run", str(cfg), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and not out.exists()
    for word in words:
        assert word in err, (word, err)


def test_random_laws_per_head_draw_independent_streams():
    """B = "orthogonal", V = "goe" in two heads: each head's draw is its own (SeedSequence key),
    reproducible, and not the single-head draw of the same seed."""
    text = heads_config(heads='[[model.heads]]\nB = "orthogonal"\nV = "goe"\n\n[[model.heads]]\nB = "orthogonal"\nV = "-B"\n')
    text = text.replace("[model]\n", "[model]\nweight_seed = 7\n")
    a, b = resolve(tomllib_loads(text)), resolve(tomllib_loads(text))
    assert a == b
    h0, h1 = a["model"]["heads"]
    assert not np.allclose(h0["B"], h1["B"])
    np.testing.assert_array_equal(np.array(h1["V"]), -np.array(h1["B"]))
    single_B, _ = resolve_weights("orthogonal", "goe", 7)
    assert not np.allclose(h0["B"], single_B)
    np.testing.assert_array_equal(np.array(h0["B"]), resolve_weights("orthogonal", "goe", 7, key=(2, 0))[0])
    assert a["model"]["weights"] == ("heads[0]: B = orthogonal, V = goe; heads[1]: B = orthogonal, V = -B "
                                     "(weight_seed 7, weight_scale 1)")


def test_a_file_written_before_heads_resumes():
    """Resolved configs from before the heads and layers keys compare equal (ADDED_KEYS)."""
    now = resolve(tomllib_loads(heads_config(heads="B = [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]\n"
                                                   "V = [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]\n")))
    before = {**now, "model": {k: v for k, v in now["model"].items() if k not in ("heads", "layers")}}
    assert difference(before, now) is None
    assert difference(before, resolve(tomllib_loads(heads_config()))) is not None


def test_sweep_over_beta_with_heads(tmp_path):
    """A sweep over [model] beta with heads present: each run's heads without their own β take
    the swept value; a head's own β stays."""
    from spherepde.runner.sweep import expand

    base = tmp_path / "base.toml"
    base.write_text(heads_config())
    sweep = tmp_path / "sweep.toml"
    sweep.write_text('[sweep]\nname = "heads"\nbase = "base.toml"\n\n[sweep.grid]\n"model.beta" = [3.0, 30.0]\n'
                     '"eulerian.nside" = [2, 4]\n')
    specs = expand(sweep, tmp_path / "out")
    assert [[h["beta"] for h in s.config["model"]["heads"]] for s in specs] == [[3.0, "inf"]] * 2 + [[30.0, "inf"]] * 2


def test_region_cache_keeps_every_heads_rows(monkeypatch):
    """Two heads (two (β, B) keys) on one source measure, edge then cell evaluation: the second
    evaluation of each head computes no region again; a new measure drops both."""
    import spherepde.summation.harmonic as harmonic

    computed = []
    original = harmonic.region_coefficients

    def counted(sources, mu, shifts, L2):
        computed.append(len(shifts))
        return original(sources, mu, shifts, L2)

    monkeypatch.setattr(harmonic, "region_coefficients", counted)
    cache = harmonic._RegionCache()
    y, mu = random_points(200, 5), np.random.default_rng(5).random(200)
    shifts, regions = np.random.default_rng(6).normal(size=(3, 3)) * 4, np.arange(3)
    for key in ("head 1", "head 2", "head 1", "head 2"):
        cache.coefficients(y, mu, 2, regions, shifts, 6, key)
    assert computed == [3, 3]
    cache.coefficients(y, 2 * mu, 2, regions, shifts, 6, "head 1")
    assert computed == [3, 3, 3] and list(cache.models) == ["head 1"]


# ------------------------------------------------------------------ heads with noise
@pytest.mark.parametrize("solver", ["eulerian", "tokens"])
def test_identical_heads_with_noise_equal_one_head_with_noise(mesh_factory, solver):
    """Noise is independent of the heads: H = 2 identical heads with V/2 under an annealed ν(t)
    equal one head under the same ν(t), bit for bit (the same sums, the same diffusion steps, the
    same random streams), on the mesh and for Brownian tokens; and the noise acts (the runs differ
    from the noiseless ones)."""
    from spherepde.models.noise import NoiseSchedule

    noise = NoiseSchedule(0.05, "exponential", time=0.5)
    law = VonMisesFisher([0.6, 0.0, 0.8], 3.0)
    if solver == "eulerian":
        mesh = mesh_factory(4)
        f0 = law.cell_averages(mesh)

        def run(model, nu):
            return eulerian_run(mesh, model, f0, noise=nu).density.values
    else:
        x0, w = tokens_from_law(law, 200, seed=4)

        def run(model, nu):
            return ParticleSolver(model, "rk4", 0.05, noise=nu, seed=3).run(x0, w, 0.6, 0.3).positions.values

    one = run(AttentionModel(PAPER_B, PAPER_V, 10.0), noise)
    np.testing.assert_array_equal(run(identical_heads(2), noise), one)
    assert np.abs(one[-1] - run(AttentionModel(PAPER_B, PAPER_V, 10.0), None)[-1]).max() > 1e-3


@pytest.mark.parametrize("scale", ["none", "exp_beta"])
def test_identical_unnormalised_heads_with_v_over_h_equal_one_head(mesh_factory, scale):
    """The model's normalisation applies to every head: two identical unnormalised heads with V/2
    equal one unnormalised head bit for bit (mesh and tokens), and differ from softmax heads."""
    def unnormalised(V, name="unnormalised"):
        return AttentionModel(PAPER_B, V, 3.0, normalisation=name, unnormalised_scale=scale)

    one = unnormalised(PAPER_V)
    two = MultiHeadModel((unnormalised(PAPER_V / 2),) * 2)
    softmax = MultiHeadModel((unnormalised(PAPER_V / 2, "softmax"),) * 2)
    mesh = mesh_factory(4)
    f0 = VonMisesFisher([0.6, 0.0, 0.8], 3.0).cell_averages(mesh)
    a = eulerian_run(mesh, one, f0).density.values
    np.testing.assert_array_equal(eulerian_run(mesh, two, f0).density.values, a)
    assert np.abs(eulerian_run(mesh, softmax, f0).density.values[-1] - a[-1]).max() > 1e-3 * f0.max()
    x0, w = tokens_from_law(VonMisesFisher([0.6, 0.0, 0.8], 3.0), 100, seed=2)
    paths = [ParticleSolver(m, "rk4", 0.05).run(x0, w, 0.6, 0.3).positions.values for m in (one, two)]
    np.testing.assert_array_equal(paths[1], paths[0])


def test_unnormalised_heads_from_the_config():
    """[model] normalisation reaches every head of every layer."""
    cfg = resolve(tomllib_loads(heads_config(beta="2.0", heads=TWO_HEADS.replace('beta = "inf"', "beta = 4.0"))
                                .replace("[model]", '[model]\nnormalisation = "unnormalised"\nunnormalised_scale = "exp_beta"')))
    model = build_model(cfg["model"])
    assert [h.unnormalised and h.unnormalised_scale == "exp_beta" for h in model.heads] == [True, True]
