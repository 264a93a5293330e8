"""The clustered attention sums (spherepde.summation.clustered): the grouping keeps mass and first
moment exactly, the kernel equals its plain numpy reference, the expansion's error against the
exact long-double sum stays below the tolerance at the widest groups it accepts, "auto" takes it
only for tight clusters and never with the divergence, and a token run with it follows the run
without it."""

import math

import numpy as np
import numpy_reference as ref
import pytest

from spherepde.models.attention import AttentionModel
from spherepde.summation import attention_field, clustered
from spherepde.summation.field import CLUSTER_MIN_SOURCES

PAPER_V = np.diag([-1.0, 1.0, -2.0])
PAPER_B = np.diag([-1.0, -1.0, 1.0])
TOL = 1e-10


def _clusters(rng, n, width, centres=((1.0, 0.1, 0.0), (-1.0, 0.0, 0.2), (0.0, 0.6, -0.8))):
    """n unit vectors in len(centres) Gaussian clusters of the given angular width, random masses."""
    c = np.asarray(centres, dtype=float)
    c /= np.linalg.norm(c, axis=1, keepdims=True)
    x = c[rng.integers(0, len(c), n)] + width * rng.normal(size=(n, 3))
    return x / np.linalg.norm(x, axis=1, keepdims=True), rng.random(n) + 0.1


def test_grouping_keeps_mass_and_first_moment():
    rng = np.random.default_rng(1)
    x, w = _clusters(rng, 3000, 1e-9)
    g = clustered.group_sources(x, w, 10.0, TOL)
    assert 3 <= g.count <= 12 and g.nsources == 3000
    mass = np.exp(g.log_mass)
    assert mass.sum() == pytest.approx(w.sum(), rel=1e-14)
    np.testing.assert_allclose(mass @ g.centres, w @ x, rtol=0, atol=1e-12)
    # second moments: trace = mean square distance ≤ radius²; the third ones are ≤ radius³
    trace = g.second[:, :3].sum(axis=1)
    assert np.all(trace >= 0) and np.all(trace <= g.radius**2 * (1 + 1e-12))
    assert np.all(np.abs(g.third) <= g.radius[:, None] ** 3 * (1 + 1e-12))
    assert np.all(g.radius * 10.0 <= clustered.epsilon(TOL))


def test_spread_sources_stay_single():
    rng = np.random.default_rng(2)
    x, w = _clusters(rng, 2000, 0.3)
    g = clustered.group_sources(x, w, 10.0, TOL)
    assert g.count == 2000  # one source per group: its own position, no spread (up to rounding)
    assert np.abs(g.second).max() <= 1e-30 and np.abs(g.third).max() <= 1e-45 and g.radius.max() <= 1e-15


@pytest.mark.parametrize("beta", [1.0, 30.0, 1000.0])
def test_kernel_equals_numpy_reference(beta):
    rng = np.random.default_rng(3)
    x, w = _clusters(rng, 500, 1e-4, centres=((1.0, 0.1, 0.0),))
    targets = _clusters(rng, 200, 0.5)[0]
    # groups built by hand, of random members of one cluster: |a|·r_g up to ~0.3 at β = 1000
    labels = rng.integers(0, 40, x.shape[0])
    centres, log_mass, second, third = [], [], [], []
    for k in np.unique(labels):
        y, mu = x[labels == k], w[labels == k]
        c = mu @ y / mu.sum()
        d = y - c
        S = np.einsum("j,jk,jl->kl", mu, d, d) / mu.sum()
        T = np.einsum("j,jk,jl,jn->kln", mu, d, d, d) / mu.sum()
        centres.append(c)
        log_mass.append(math.log(mu.sum()))
        second.append([S[0, 0], S[1, 1], S[2, 2], S[0, 1], S[0, 2], S[1, 2]])
        third.append([T[0, 0, 0], T[1, 1, 1], T[2, 2, 2], T[0, 0, 1], T[0, 0, 2], T[0, 1, 1], T[1, 1, 2],
                      T[0, 2, 2], T[1, 2, 2], T[0, 1, 2]])
    centres, log_mass, second, third = map(np.array, (centres, log_mass, second, third))
    v, m, lz = np.empty((200, 3)), np.empty((200, 3)), np.empty(200)
    clustered.clustered_softmax(targets, np.ascontiguousarray(PAPER_B.T), beta, centres, log_mass, second, third,
                                PAPER_V, v, m, lz)
    v_ref, m_ref, lz_ref = ref.clustered_softmax(targets, PAPER_B, beta, PAPER_V, centres, log_mass, second, third)
    np.testing.assert_allclose(m, m_ref, rtol=0, atol=1e-12)
    np.testing.assert_allclose(v, v_ref, rtol=0, atol=1e-12)
    np.testing.assert_allclose(lz, lz_ref, rtol=1e-13, atol=1e-12 * beta)


@pytest.mark.parametrize("beta", [1.0, 10.0, 1000.0])
def test_error_below_tolerance_at_the_widest_accepted_groups(beta):
    """Clusters as wide as the grouping accepts (|a|·r up to ε = (4 tol)^{1/4}): m_β and log Z against
    the exact sum in long double, for targets everywhere; the error must be below tol, and the
    same clusters 30× wider are not grouped."""
    tol = 1e-7  # ε = 0.025: errors well above rounding, so the bound is what is tested
    scale = beta * np.linalg.norm(PAPER_B, 2)
    r = clustered.epsilon(tol) / max(scale, 1.0)
    rng = np.random.default_rng(4)
    x, w = _clusters(rng, 1500, 0.25 * r)
    g = clustered.group_sources(x, w, scale, tol)
    assert g.count < 100 and g.radius.max() > 0.3 * r  # groups near the accepted width
    model = AttentionModel(PAPER_B, PAPER_V, beta)
    targets = np.concatenate([_clusters(rng, 300, 0.6)[0], x[:100]])
    lz = np.empty(targets.shape[0])
    stats = {}
    _, _, m = attention_field(model, x, w, targets, tol=tol, stats=stats, log_partition=lz, may_cluster=True)
    assert stats["method"] == "clustered" and stats["groups"] == g.count
    m_exact, lz_exact = ref.softmax_moments(targets, PAPER_B, beta, x, w)
    assert np.abs(m - m_exact).max() <= 2 * tol
    assert np.abs(lz - lz_exact).max() <= tol
    # the moments carry the groups' spread: the groups as points (S = T = 0) are far worse
    _, m_points, _ = ref.clustered_softmax(targets, PAPER_B, beta, PAPER_V, g.centres, g.log_mass,
                                           np.zeros_like(g.second), np.zeros_like(g.third))
    assert np.abs(m - m_exact).max() < 0.1 * np.abs(m_points - m_exact).max()
    wide = _clusters(rng, 1500, 30 * r)
    stats = {}
    attention_field(model, *wide, targets, tol=tol, stats=stats, may_cluster=True)
    assert stats["method"] != "clustered"


def test_auto_needs_tokens_many_sources_and_no_divergence():
    """"auto" groups only when the caller's sources may concentrate (may_cluster: the tokens; the
    mesh's cells never do and would pay the grouping for nothing)."""
    rng = np.random.default_rng(5)
    model = AttentionModel(PAPER_B, PAPER_V, 10.0)
    x, w = _clusters(rng, 2 * CLUSTER_MIN_SOURCES, 1e-10)
    stats = {}
    attention_field(model, x, w, x, stats=stats, may_cluster=True)
    assert stats["method"] == "clustered"
    for kwargs in ({"want_div": True}, {"method": "direct"}, {"may_cluster": False}):
        stats = {}
        attention_field(model, x, w, x, stats=stats, **({"may_cluster": True} | kwargs))
        assert stats["method"] == "direct"
    stats = {}
    attention_field(model, x[: CLUSTER_MIN_SOURCES - 1], w[: CLUSTER_MIN_SOURCES - 1], x, stats=stats,
                    may_cluster=True)
    assert stats["method"] != "clustered"
    stats = {}  # asked for with the divergence: the exact sum instead
    v, div, _ = attention_field(model, x, w, x, want_div=True, method="clustered", stats=stats)
    assert stats["method"] == "direct" and div is not None


def test_token_run_follows_the_run_without_clustering(monkeypatch):
    """n = 1500 tokens at β = 10 (projected normal, paper matrices) to t = 12, RK4 dt 0.05: with the
    clustered sums (used once the clusters are tight, from t ≈ 9) and without; the positions agree
    to 1e-8."""
    from spherepde.models.initial import ProjectedNormal
    from spherepde.solvers.particles import ParticleSolver, tokens_from_law

    law = ProjectedNormal([0.3, 0.2, 0.1], [[1.0, 0.2, 0.0], [0.2, 0.8, 0.0], [0.0, 0.0, 0.6]])
    x0, weights = tokens_from_law(law, 1500, seed=3)
    model = AttentionModel(PAPER_B, PAPER_V, 10.0)
    used = []
    real = clustered.clustered_softmax

    def counting(*args):
        used.append(args[3].shape[0])
        return real(*args)

    monkeypatch.setattr(clustered, "clustered_softmax", counting)
    a = ParticleSolver(model, "rk4", 0.05).run(x0, weights, 12.0, 3.0)
    assert len(used) > 100 and max(used) * clustered.CLUSTER_GAIN <= 1500
    monkeypatch.setattr(clustered, "CLUSTER_GAIN", 10**9)
    used.clear()
    b = ParticleSolver(model, "rk4", 0.05).run(x0, weights, 12.0, 3.0)
    assert not used
    assert np.abs(a.positions.values - b.positions.values).max() <= 1e-8
