"""The batched direct sum of tokens in any d (spherepde.summation.batched): against the long-double
numpy reference, against the S² direct sum of the Eulerian solver, at absurd β, and its cost per
pair batched against one system, measured in the same run."""

import time

import numba
import numpy as np
import numpy_reference as ref
import pytest

from spherepde.models.attention import AttentionModel
from spherepde.summation import attention_field
from spherepde.summation.batched import (
    batched_hardmax,
    batched_softmax,
    log2_masses,
    source_rows,
)


def tokens(rng, M, n, d):
    x = rng.normal(size=(M, n, d))
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def run_kernel(x, masses, B, V, beta, want_logz=True):
    lam, ln_top = log2_masses(masses)
    v = np.empty(x.shape)
    logz = np.empty(x.shape[:2]) if want_logz else np.empty((0, 0))
    batched_softmax(x, source_rows(x), lam, np.ascontiguousarray(B.T), float(beta), V, v, logz, ln_top)
    return v, logz


@pytest.mark.parametrize("d", [2, 3, 5, 16])
@pytest.mark.parametrize("beta", [0.5, 30.0, 1000.0])
def test_kernel_matches_numpy(d, beta):
    """Velocity and log Z of 3 systems, masses with zeros and 600 sources (two blocks of 512):
    equal to the long-double log-sum-exp to 1e-12 (relative to the field's scale)."""
    rng = np.random.default_rng(d)
    x = tokens(rng, 3, 600, d)
    B, V = rng.normal(size=(d, d)), rng.normal(size=(d, d))
    masses = rng.random(600)
    masses[::7] = 0.0
    v, logz = run_kernel(x, masses, B, V, beta)
    v_ref, logz_ref = ref.batched_softmax(x, masses, B, V, beta)
    scale = np.abs(v_ref).max()
    assert np.abs(v - v_ref).max() <= 1e-12 * scale * max(1.0, beta / 30)
    assert np.abs(logz - logz_ref).max() <= 1e-12 * np.abs(logz_ref).max()


def test_one_system_on_the_sphere_equals_the_eulerian_direct_sum():
    """d = 3, one system: the same field as spherepde.summation's direct sum (softmax_blocked),
    to round-off."""
    rng = np.random.default_rng(1)
    x = tokens(rng, 1, 900, 3)
    B, V = rng.normal(size=(3, 3)), rng.normal(size=(3, 3))
    masses = np.full(900, 1 / 900)
    model = AttentionModel(B, V, 20.0)
    v_direct, _, _ = attention_field(model, x[0], masses, x[0], method="direct")
    v, _ = run_kernel(x, masses, B, V, 20.0, want_logz=False)
    assert np.abs(v[0] - v_direct).max() <= 1e-13 * np.abs(v_direct).max()


def test_absurd_beta_and_zero_masses_stay_finite():
    """β = 1e12: exponents far beyond the exp2 range are clamped, the field is the hardmax field
    (the kernel's nearest token dominates); sources without mass get weight 0."""
    rng = np.random.default_rng(2)
    x = tokens(rng, 2, 300, 4)
    B, V = np.eye(4) + 0.1 * rng.normal(size=(4, 4)), rng.normal(size=(4, 4))
    masses = np.ones(300)
    masses[:5] = 0.0
    v, logz = run_kernel(x, masses, B, V, 1e12)
    assert np.all(np.isfinite(v)) and np.all(np.isfinite(logz))
    lam, _ = log2_masses(masses)
    assert np.all(lam[:5] == -np.inf)
    hard = np.empty(x.shape)
    batched_hardmax(x, source_rows(x), lam, np.ascontiguousarray(B.T), V, hard)
    np.testing.assert_allclose(v, hard, atol=1e-9)


@pytest.mark.parametrize("d", [2, 3, 7])
def test_hardmax_matches_numpy(d):
    rng = np.random.default_rng(3)
    x = tokens(rng, 3, 200, d)
    B, V = rng.normal(size=(d, d)), rng.normal(size=(d, d))
    masses = np.ones(200)
    masses[10:20] = 0.0
    lam, _ = log2_masses(masses)
    v = np.empty(x.shape)
    batched_hardmax(x, source_rows(x), lam, np.ascontiguousarray(B.T), V, v)
    np.testing.assert_allclose(v, ref.batched_hardmax(x, masses, B, V), rtol=0, atol=1e-14)


def test_bad_masses():
    for masses in (np.zeros(3), np.array([1.0, -1.0, 1.0]), np.array([1.0, np.nan, 1.0])):
        with pytest.raises(ValueError, match="masses"):
            log2_masses(masses)


def best_times(calls, repeats=7):
    """The best CPU time of this process for each call over `repeats` rounds, the calls interleaved in
    each round (so that a busy spell of the machine hits them alike). CPU time, not wall time: on a
    shared machine an 8 ms call is preempted by other processes more often than a 1 ms one, and
    the wall-time ratio then measured the machine's load (1.7 with a solver run beside the CI's two
    workers on 2 cores, 0.95 alone)."""
    best = [np.inf] * len(calls)
    for _ in range(repeats):
        for k, call in enumerate(calls):
            start = time.process_time()
            call()
            best[k] = min(best[k], time.process_time() - start)
    return best


def test_batched_cost_per_pair_within_1_1_of_one_system():
    """Cost per pair of M = 8 systems in one call against one system (n = 2000, d = 3, β = 30),
    best CPU time of 7 interleaved calls each on one thread, in this run: the batch must not cost more per pair than one system (1.1× the target, 1.25× allowed for noise)
    (it usually costs less: more parallel work items). Printed with the S² direct sum of the
    Eulerian solver (softmax_blocked, one system) beside it."""
    rng = np.random.default_rng(4)
    n, M = 2000, 8
    x = tokens(rng, M, n, 3)
    B = V = np.eye(3)
    masses = np.full(n, 1 / n)
    lam, ln_top = log2_masses(masses)
    none = np.empty((0, 0))

    def batch():
        batched_softmax(x, source_rows(x), lam, B, 30.0, V, np.empty(x.shape), none, ln_top)

    one_x = np.ascontiguousarray(x[:1])

    def one():
        batched_softmax(one_x, source_rows(one_x), lam, B, 30.0, V, np.empty(one_x.shape), none, ln_top)

    def one_times_m():  # the same work as the batch, so that a busy machine slows both alike
        for _ in range(M):
            one()

    model = AttentionModel(B, V, 30.0)

    def blocked():
        attention_field(model, x[0], masses, x[0], method="direct")

    for call in (batch, one, blocked):  # compile
        call()
    # one thread: the cost per pair of the kernel itself, not how a shared machine's cores happen
    # to be split between 4 (one system) and 32 (eight) blocks of targets
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        t_batch, t_one, t_blocked = best_times((batch, one_times_m, blocked))
    finally:
        numba.set_num_threads(threads)
    per_pair = {"batched (M = 8)": t_batch / (M * n * n), "one system": t_one / (M * n * n),
                "softmax_blocked (one system)": t_blocked / (n * n)}
    ratio = per_pair["batched (M = 8)"] / per_pair["one system"]
    print("ns per pair: " + ", ".join(f"{k} {v * 1e9:.3f}" for k, v in per_pair.items()) + f"; ratio {ratio:.3f}")
    # the target is 1.1 (docs/performance.md measures it on an idle machine); on a shared
    # one a 1 ms call and an 8 ms call are preempted differently, so the guard here is 1.25
    assert ratio <= 1.25
