"""Tokens on S^{d−1} for any d and batched systems (issue 38 items 1–2): exact solutions in d ≥ 2,
rotation covariance, the d = 3 batched path against the S² path, batched runs against single runs
(system k = the run with seed + k), the per-system diagnostics against references, the vMF
sampler in any d, and bad input."""

import math

import numpy as np
import numpy_reference as ref
import pytest
from run_helpers import one_numba_thread  # noqa: F401 (autouse: one numba thread)
from scipy.integrate import quad, solve_ivp
from scipy.special import ive
from scipy.stats import ortho_group

from spherepde.analysis.systems import CLUSTER_THRESHOLD, cluster_masses, interaction_energy, threshold_components
from spherepde.cli import main
from spherepde.models.attention import AttentionModel
from spherepde.models.initial import Uniform, VonMisesFisher
from spherepde.models.noise import NoiseSchedule
from spherepde.solvers import particles
from spherepde.solvers.particles import ParticleSolver, token_systems
from spherepde.storage.runfile import open_run


def final(solver, x0, weights, t_end):
    """Positions at t_end (snapshots at 0 and t_end)."""
    out = None
    for _, _, x, _ in solver.snapshots(x0, weights, [0.0, t_end]):
        out = x
    return out


def two_tokens(d, angle):
    x = np.zeros((2, d))
    x[0, 0] = 1.0
    x[1, 0], x[1, 1] = math.cos(angle), math.sin(angle)
    return x


@pytest.mark.parametrize("d", [2, 4, 7])
def test_two_tokens_without_attention_scores_close_exactly(d):
    """B = 0 (every weight equal: m = the centre of mass), V = I, two tokens at angle φ₀: each
    moves toward the other at angular speed ½ sin φ, so tan(φ/2) = tan(φ₀/2) e^{−t}, and their
    bisector stays fixed. RK4 with dt = 0.01 to 1e-9."""
    phi0 = 2.5
    model = AttentionModel(np.zeros((d, d)), np.eye(d), 3.0)
    x = final(ParticleSolver(model, "rk4", 0.01), two_tokens(d, phi0), np.full(2, 0.5), 2.0)
    phi = math.acos(np.clip(x[0] @ x[1], -1, 1))
    assert abs(phi - 2 * math.atan(math.tan(phi0 / 2) * math.exp(-2.0))) < 1e-9
    bisector = (x[0] + x[1]) / np.linalg.norm(x[0] + x[1])
    np.testing.assert_allclose(bisector, two_tokens(d, phi0 / 2)[1], atol=1e-9)


def test_two_tokens_on_the_circle_follow_their_angle_ode():
    """d = 2, B = V = I, β = 4: by symmetry dφ/dt = −2 sin φ e^{β cos φ}/(e^β + e^{β cos φ}) =
    −2 sin φ / (1 + e^{β(1 − cos φ)}), integrated by scipy at rtol 1e-12."""
    beta, phi0, t_end = 4.0, 2.0, 3.0
    model = AttentionModel(np.eye(2), np.eye(2), beta)
    x = final(ParticleSolver(model, "rk4", 0.005), two_tokens(2, phi0), np.full(2, 0.5), t_end)
    sol = solve_ivp(lambda t, p: -2 * np.sin(p) / (1 + np.exp(beta * (1 - np.cos(p)))), (0, t_end), [phi0],
                    rtol=1e-12, atol=1e-14)
    assert abs(math.atan2(x[0, 0] * x[1, 1] - x[0, 1] * x[1, 0], x[0] @ x[1]) - sol.y[0, -1]) < 1e-9


def test_rotating_tokens_and_conjugating_the_weights_rotates_the_paths():
    """d = 6: tokens Qx₀ with QBQᵀ, QVQᵀ follow Q x(t) (the field is covariant), to round-off."""
    d = 6
    rng = np.random.default_rng(0)
    B, V = rng.normal(size=(d, d)), rng.normal(size=(d, d))
    Q = ortho_group.rvs(d, random_state=1)
    x0, w = token_systems(Uniform(d), 80, 2, seed=3)
    a = final(ParticleSolver(AttentionModel(B, V, 5.0), "rk4", 0.02), x0, w, 1.0)
    b = final(ParticleSolver(AttentionModel(Q @ B @ Q.T, Q @ V @ Q.T, 5.0), "rk4", 0.02), x0 @ Q.T, w, 1.0)
    np.testing.assert_allclose(b, a @ Q.T, atol=1e-12)


@pytest.mark.parametrize("beta", [10.0, math.inf])
def test_the_batched_path_on_the_sphere_equals_the_s2_path(beta):
    """d = 3, one system: summation = "batched" against the S² summation ("auto": the direct
    softmax_blocked below 256 tokens; the hardmax kernel at β = ∞), positions at t = 1 to 1e-12."""
    rng = np.random.default_rng(2)
    model = AttentionModel(rng.normal(size=(3, 3)), rng.normal(size=(3, 3)), beta)
    x0, w = token_systems(Uniform(3), 120, 1, seed=5)
    a = final(ParticleSolver(model, "rk4", 0.02), x0[0], w, 1.0)
    b = final(ParticleSolver(model, "rk4", 0.02, summation="batched"), x0[0], w, 1.0)
    np.testing.assert_allclose(b, a, atol=1e-12)


def test_batched_solver_equals_single_systems_with_noise():
    """Three systems with noise in d = 5 against three single runs: system k equals the run with
    seed + k (its tokens from default_rng(seed + k), its noise from the streams of seed + k)."""
    d = 5
    rng = np.random.default_rng(7)
    model = AttentionModel(rng.normal(size=(d, d)), rng.normal(size=(d, d)), 4.0)
    noise = NoiseSchedule(0.1)
    x0, w = token_systems(VonMisesFisher(np.ones(d), 2.0), 50, 3, seed=11)
    batch = final(ParticleSolver(model, "euler", 0.05, noise=noise, seed=11), x0, w, 0.5)
    for k in range(3):
        one = final(ParticleSolver(model, "euler", 0.05, noise=noise, seed=11 + k), x0[k], w, 0.5)
        np.testing.assert_array_equal(batch[k], one)


@pytest.mark.parametrize("beta", [10.0, math.inf])
def test_large_systems_on_the_sphere_take_their_own_summation(monkeypatch, beta):
    """Systems of n ≥ PER_SYSTEM_N tokens on S² go one at a time through the S² summation
    (clustered sums once they concentrate): the same paths as the batched direct sum, each system
    as its own single run (which never goes through the batched kernel)."""
    monkeypatch.setattr(particles, "PER_SYSTEM_N", 100)
    rng = np.random.default_rng(3)
    model = AttentionModel(rng.normal(size=(3, 3)), rng.normal(size=(3, 3)), beta)
    x0, w = token_systems(VonMisesFisher(np.ones(3), 8.0), 150, 3, seed=4)
    solver = ParticleSolver(model, "rk4", 0.05)
    assert solver.per_system_for(x0) and not solver.batched_for(x0)
    assert not solver.per_system_for(x0[:, :99])  # below the size: the batched kernel
    batch = final(solver, x0, w, 2.0)
    direct = final(ParticleSolver(model, "rk4", 0.05, summation="batched"), x0, w, 2.0)
    np.testing.assert_allclose(batch, direct, atol=1e-9)
    for k in range(3):
        np.testing.assert_array_equal(batch[k], final(ParticleSolver(model, "rk4", 0.05), x0[k], w, 2.0))


def test_the_batched_path_refuses_carried_densities_and_wrong_dimensions():
    model = AttentionModel(np.eye(4), np.eye(4), 2.0)
    solver = ParticleSolver(model)
    with pytest.raises(ValueError, match="R\\^3 but the model's matrices are 4×4"):
        next(solver.snapshots(Uniform(3).sample(5, 0), np.full(5, 0.2), [0.0, 1.0]))
    with pytest.raises(ValueError, match="summation"):
        ParticleSolver(model, summation="fast")


# ---------------------------------------------------------------------- diagnostics
def test_threshold_components_match_the_thresholded_gram_matrix():
    """Union–find over pairs against scipy's connected components of ⟨x_i, x_j⟩ ≥ 0.999, on
    tokens in tight clusters, in chains (a chain of links is one component) and at random."""
    rng = np.random.default_rng(3)
    d, n = 4, 120
    centres = rng.normal(size=(5, d))
    tight = centres[rng.integers(0, 5, n)] + 0.01 * rng.normal(size=(n, d))
    chain = np.stack([np.cos(np.arange(n) * 0.03), np.sin(np.arange(n) * 0.03), np.zeros(n), np.zeros(n)], axis=1)
    x = np.stack([tight, chain, rng.normal(size=(n, d))])
    x /= np.linalg.norm(x, axis=-1, keepdims=True)
    labels = np.empty((3, n), dtype=np.int64)
    counts = threshold_components(x, CLUSTER_THRESHOLD, labels)
    ref_counts, ref_labels = ref.threshold_components(x, CLUSTER_THRESHOLD)
    np.testing.assert_array_equal(counts, ref_counts)
    np.testing.assert_array_equal(labels, ref_labels)
    assert counts[1] == 1  # cos 0.03 = 0.99955: every link holds, the ends are 3.6 rad apart
    masses = cluster_masses(labels, np.ones(n), slots=8)
    assert np.all(np.diff(masses, axis=1) <= 0) and np.allclose(masses[:2].sum(axis=1), 1.0)
    assert abs(masses[1, 0] - 1.0) < 1e-14 and np.all(masses[1, 1:] == 0)


def test_interaction_energy_against_the_reference():
    """(1/β) ln Σ_ij w_i w_j e^{β⟨x_i, Bx_j⟩}: from the kernel's log Z against the numpy
    log-sum-exp; 0 for B = 0; NaN at β = ∞."""
    rng = np.random.default_rng(4)
    d = 6
    x, w = token_systems(Uniform(d), 70, 2, seed=1)
    B = rng.normal(size=(d, d))
    for beta in (0.3, 40.0):
        value = interaction_energy(AttentionModel(B, np.eye(d), beta), x, w)
        for k in range(2):
            e = beta * (x[k] @ B) @ x[k].T + np.log(np.outer(w, w))
            top = e.max()
            assert abs(value[k] - (top + math.log(np.exp(e - top).sum())) / beta) < 1e-12 * max(1, abs(value[k]))
    np.testing.assert_allclose(interaction_energy(AttentionModel(np.zeros((d, d)), np.eye(d), 2.0), x, w), 0.0,
                               atol=1e-15)
    assert np.all(np.isnan(interaction_energy(AttentionModel(np.eye(d), np.eye(d), math.inf), x, w)))


# ---------------------------------------------------------------------- initial laws in any d
@pytest.mark.parametrize("d", [2, 4, 9])
def test_wood_sampler_has_the_vmf_mean_resultant(d):
    """E⟨μ, y⟩ = A_d(κ) = I_{d/2}(κ)/I_{d/2−1}(κ) within 5 standard errors; every sample a unit
    vector; the component orthogonal to μ has mean 0."""
    kappa, n = 3.0, 200_000
    mu = np.arange(1.0, d + 1)
    law = VonMisesFisher(mu, kappa)
    y = law.sample(n, np.random.default_rng(d))
    assert y.shape == (n, d) and np.abs(np.linalg.norm(y, axis=1) - 1).max() < 1e-14
    w = y @ law.mu
    assert abs(w.mean() - ive(d / 2, kappa) / ive(d / 2 - 1, kappa)) < 5 * w.std() / math.sqrt(n)
    rest = y - np.outer(w, law.mu)
    assert np.abs(rest.mean(axis=0)).max() < 5 / math.sqrt(n)


def test_vmf_and_uniform_densities_are_normalised_off_s2():
    """On the circle ∫ f(cos θ, sin θ) dθ = 1 (vMF κ = 2.5, and the uniform 1/(2π)); on S³ the
    vMF normaliser against ∫ e^{κw}(1 − w²)^{1/2} dw |S²|."""
    law = VonMisesFisher([0.0, 1.0], 2.5)
    total, _ = quad(lambda t: float(law.density(np.array([[math.cos(t), math.sin(t)]]))[0]), 0, 2 * math.pi)
    assert abs(total - 1) < 1e-12
    assert abs(Uniform(2).density(np.zeros((1, 2)))[0] - 1 / (2 * math.pi)) < 1e-15
    law4 = VonMisesFisher([1.0, 0, 0, 0], 2.5)
    mass, _ = quad(lambda w: math.exp(2.5 * w) * math.sqrt(1 - w * w), -1, 1)
    f_at_mu = law4.density(np.array([[1.0, 0, 0, 0]]))[0]
    assert abs(f_at_mu * math.exp(-2.5) * mass * 4 * math.pi - 1) < 1e-12


# ---------------------------------------------------------------------- runs
RUN = """
[model]
beta = 5.0
dimension = {d}
B = "goe"
V = "gaussian"
weight_seed = 2
noise = 0.05

[initial]
kind = "vmf"
mu = {mu}
kappa = 2.0

[particles]
n = 40
seed = {seed}
dt = 0.05
summation = "batched"
{extra}

[eulerian]
enabled = false

[time]
t_end = 0.5
save_every = 0.25
"""


def run(tmp_path, name, d=5, seed=3, extra=""):
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(RUN.format(d=d, mu=[1.0] + [0.5] * (d - 1), seed=seed, extra=extra))
    out = tmp_path / f"{name}.nc"
    assert main(["run", str(cfg), "-o", str(out)]) == 0
    return open_run(out)


@pytest.mark.parametrize("d", [3, 5])
def test_batched_run_equals_single_runs(tmp_path, d):
    """`systems = 3` with seed 3: system k of the file equals the single run with seed 3 + k,
    positions and every per-system diagnostic bitwise (same kernel, same arithmetic)."""
    batch = run(tmp_path, "batch", d, 3, "systems = 3")
    assert batch["positions"].dims == ("time", "system", "particle", "xyz" if d == 3 else "component")
    assert batch.sizes["system"] == 3
    for k in range(3):
        one = run(tmp_path, f"one{k}", d, 3 + k)
        assert "system" not in one.dims
        names = [n for n in one.data_vars if n.startswith("particle_") and "system" in batch[n].dims]
        # one system on S² keeps its layout: no energy, no clusters (test below)
        new = {"particle_energy", "particle_cluster_count", "particle_cluster_mass"}
        assert {"particle_alignment_E", "particle_w2_to_projection"} | (new if d != 3 else set()) <= set(names)
        np.testing.assert_array_equal(batch["positions"].values[:, k], one["positions"].values)
        for name in names:
            np.testing.assert_array_equal(batch[name].isel(system=k).values, one[name].values, err_msg=name)


def test_a_one_system_file_on_s2_keeps_its_layout(tmp_path):
    """d = 3, one system: positions (time, particle, xyz) and none of the any-d variables."""
    ds = run(tmp_path, "s2", 3, 1, "")
    assert ds["positions"].dims == ("time", "particle", "xyz")
    assert "particle_energy" not in ds and "cluster" not in ds.dims


BAD = [
    ("model.dimension=1", "[model] dimension"),
    ("initial.mu=[1.0, 0.0, 0.0]", "[initial] mu"),
    ("eulerian.enabled=true", "[eulerian] enabled"),
    ('particles.mode="quadrature"', "[particles] mode"),
    ("particles.systems=0", "[particles] systems"),
    ("model.B=[[1.0, 0.0], [0.0, 1.0]]", "[model] B"),
]


@pytest.mark.parametrize("change, key", BAD)
def test_bad_any_d_input_exits_2(tmp_path, capsys, change, key):
    """One line naming the key, exit 2, no file: d = 1, mu of length 3 in d = 5, the Eulerian
    solver or quadrature particles off S², no systems, a 2×2 B in d = 5."""
    cfg = tmp_path / "bad.toml"
    cfg.write_text(RUN.format(d=5, mu=[1.0] * 5, seed=0, extra=""))
    assert main(["run", str(cfg), "-o", str(tmp_path / "bad.nc"), "--set", change]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and key in err[0], err
    assert not (tmp_path / "bad.nc").exists()


def test_systems_need_the_tokens_alone(tmp_path, capsys):
    cfg = tmp_path / "mesh.toml"
    cfg.write_text(RUN.format(d=3, mu=[1.0, 0.0, 0.0], seed=0, extra="systems = 2"))
    assert main(["run", str(cfg), "-o", str(tmp_path / "mesh.nc"), "--set", "eulerian.enabled=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "[particles] systems" in err[0] and "enabled = false" in err[0]
