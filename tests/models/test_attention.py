"""AttentionModel: spectral data against hand-computable cases."""

import math

import numpy as np
import pytest

from spherepde.models.attention import AttentionModel, spectral_data

PAPER_V = np.diag([-1.0, 1.0, -2.0])
PAPER_B = np.diag([-1.0, -1.0, 1.0])


def test_paper_matrices():
    m = AttentionModel(PAPER_B, PAPER_V, 30)
    np.testing.assert_array_equal(m.M, np.diag([1.0, -1.0, -2.0]))  # M = VBᵀ
    assert m.E.dim == 1 and abs(abs(m.E.basis[0, 0]) - 1) < 1e-14
    np.testing.assert_allclose(m.E.projector, np.diag([1.0, 0, 0]), atol=1e-14)
    assert m.gap == pytest.approx(2.0)  # 1 − (−1)
    assert m.F.dim == 1 and abs(abs(m.F.basis[1, 0]) - 1) < 1e-14  # F = span e₂
    assert m.sigma_max == pytest.approx(1.0)
    assert not any(m.assumption_flags.values())
    x = np.array([[0.6, 0.0, 0.8], [-0.1, 0.9, 0.1]])
    np.testing.assert_allclose(m.project_E(x), [[1, 0, 0], [-1, 0, 0]])


def test_non_symmetric_projector_is_spectral():
    rng = np.random.default_rng(0)
    S = rng.normal(size=(3, 3))
    M = S @ np.diag([3.0, 1.0, -0.5]) @ np.linalg.inv(S)
    sd = spectral_data(M)
    P = sd.projector
    np.testing.assert_allclose(P @ P, P, atol=1e-12)  # projector
    np.testing.assert_allclose(P @ M, M @ P, atol=1e-12)  # spectral: commutes with M
    np.testing.assert_allclose(M @ P, 3.0 * P, atol=1e-12)  # range = eigenspace of 3
    assert sd.gap == pytest.approx(2.0) and sd.dim == 1


def test_flags_complex_pair_and_nonsymmetric():
    V = np.array([[0.0, -1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, -1.0]])  # ±i and −1
    m = AttentionModel(np.eye(3), V, 10)
    assert m.E.complex_pair and m.E.dim == 2
    flags = m.assumption_flags
    assert flags["complex_dominant_pair"] and flags["M_not_symmetric"]
    P = m.E.projector
    np.testing.assert_allclose(P, np.diag([1.0, 1.0, 0.0]), atol=1e-12)


def test_repeated_dominant_eigenvalue():
    m = AttentionModel(np.eye(3), np.diag([2.0, 2.0, 1.0]), 1.0)
    assert m.E.dim == 2 and m.gap == pytest.approx(1.0)


@pytest.mark.parametrize("beta", [0, -1, float("nan"), "abc", -math.inf])
def test_bad_beta(beta):
    with pytest.raises(ValueError, match="beta"):
        AttentionModel(np.eye(3), np.eye(3), beta)


def test_bad_matrices():
    with pytest.raises(ValueError, match="V must have the shape of B"):  # d×d for any d ≥ 2, one d
        AttentionModel(np.eye(2), np.eye(3), 1)
    with pytest.raises(ValueError, match="B must be a real square matrix"):
        AttentionModel(np.ones((2, 3)), np.eye(3), 1)
    with pytest.raises(ValueError, match="B must be a real square matrix"):
        AttentionModel(np.eye(1), np.eye(1), 1)
    with pytest.raises(ValueError, match="V has non-finite"):
        AttentionModel(np.eye(3), np.diag([1, np.inf, 1]), 1)
    with pytest.raises(ValueError, match="invertible B"):
        AttentionModel(np.diag([1.0, 1.0, 0.0]), np.eye(3), math.inf)
