"""Random weight matrices (spherepde.models.weights) and their config keys: each law has the moments
and symmetries of its definition (checked over many seeds against the exact values, within
bounds that a wrong law fails), draws are reproducible, B and V use independent streams, and
bad values stop the config with one line naming the key."""

import numpy as np
import pytest

from spherepde.models.weights import LAWS, random_matrix, resolve_weights
from spherepde.runner.config import ConfigError, difference, resolve

DRAWS = 4000


def draws(law):
    rng = np.random.default_rng(12345)
    return np.array([random_matrix(law, rng) for _ in range(DRAWS)])


def within(sample, value, sigmas=5.0):
    """The mean of sample agrees with value within sigmas standard errors."""
    return abs(sample.mean() - value) <= sigmas * sample.std(ddof=1) / np.sqrt(sample.size)


def test_gaussian_entries_are_iid_with_variance_one_over_n():
    m = draws("gaussian")
    assert within(m.ravel(), 0.0)
    assert within(m.ravel() ** 2, 1 / 3)
    assert within(m[:, 0, 1] * m[:, 1, 0], 0.0)  # not symmetric: independent entries


def test_goe_is_symmetric_with_the_goe_variances():
    m = draws("goe")
    np.testing.assert_array_equal(m, np.transpose(m, (0, 2, 1)))
    assert within(m[:, 0, 1] ** 2, 1 / 3) and within(m[:, 1, 2] ** 2, 1 / 3)
    assert within(np.einsum("kii->ki", m).ravel() ** 2, 2 / 3)


def test_wigner_is_symmetric_with_rademacher_entries():
    m = draws("wigner")
    np.testing.assert_array_equal(m, np.transpose(m, (0, 2, 1)))
    np.testing.assert_allclose(np.abs(m), 1 / np.sqrt(3), rtol=1e-15)
    assert within(m.ravel(), 0.0)
    assert within(m[:, 0, 1] * m[:, 0, 2], 0.0)


def test_orthogonal_is_haar():
    """Orthogonal to round-off; Haar: E[Q₁₁²] = 1/3, E[Q₁₁] = 0, det = ±1 equally often (the QR
    factor without the sign correction has Q₁₁ biased: E[Q₁₁] = −E|G₁₁|/E|G₁| ≠ 0)."""
    m = draws("orthogonal")
    eye = np.einsum("kji,kjl->kil", m, m)
    np.testing.assert_allclose(eye, np.broadcast_to(np.eye(3), eye.shape), atol=1e-14)
    assert within(m[:, 0, 0], 0.0) and within(m[:, 2, 1], 0.0)
    assert within(m[:, 0, 0] ** 2, 1 / 3)
    assert within(np.sign(np.linalg.det(m)), 0.0)


def test_draws_are_reproducible_and_b_independent_of_v():
    B1, V1 = resolve_weights("goe", "gaussian", seed=7)
    B2, V2 = resolve_weights("goe", "identity", seed=7)
    B3, _ = resolve_weights("goe", "gaussian", seed=8)
    np.testing.assert_array_equal(B1, B2)  # B's draw does not depend on what V is
    assert not np.array_equal(B1, B3)
    np.testing.assert_array_equal(resolve_weights("goe", "gaussian", seed=7)[1], V1)
    B, V = resolve_weights("orthogonal", "-B", seed=1, scale=2.0)
    np.testing.assert_array_equal(V, -B)
    np.testing.assert_allclose(B.T @ B, 4 * np.eye(3), atol=1e-14)
    _, V = resolve_weights(np.diag([1.0, 2.0, 3.0]), "identity", scale=0.5)
    np.testing.assert_array_equal(V, 0.5 * np.eye(3))


CONFIG = {"time": {"t_end": 1.0, "save_every": 0.5}}


def model(**kw):
    return {"model": {"beta": 10.0, **kw}, **CONFIG}


def test_config_resolves_laws_to_matrices_and_records_them():
    cfg = resolve(model(B="goe", V="-B", weight_seed=3))
    B, V = np.array(cfg["model"]["B"]), np.array(cfg["model"]["V"])
    np.testing.assert_array_equal(B, resolve_weights("goe", "-B", seed=3)[0])
    np.testing.assert_array_equal(V, -B)
    assert cfg["model"]["weights"] == "B = goe, V = -B (weight_seed 3, weight_scale 1)"
    again = resolve(model(B="goe", V="-B", weight_seed=3))
    assert difference(cfg, again) is None
    other = resolve(model(B="goe", V="-B", weight_seed=4))
    assert difference(cfg, other).startswith("[model] B:")
    eye = [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
    assert resolve(model(B=eye, V=eye))["model"]["weights"] == "given"


def test_a_file_written_before_random_weights_resumes():
    eye = [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
    now = resolve(model(B=eye, V=eye))
    before = {**now, "model": {k: v for k, v in now["model"].items()
                               if k not in ("weight_seed", "weight_scale", "weights")}}
    assert difference(before, now) is None
    assert difference(before, resolve(model(B=eye, V=eye, weight_seed=2))) is not None


@pytest.mark.parametrize("kw, message", [
    (dict(B="goa", V="goe"), "[model] B: must be a 3×3 matrix or one of"),
    (dict(B="goe", V="V"), '[model] V: "V" refers to itself'),
    (dict(B="V", V="-B"), "[model] B: \"V\" refers to V, which refers back"),
    (dict(B="goe", V="goe", weight_seed=-1), "[model] weight_seed: must be an integer >= 0"),
    (dict(B="goe", V="goe", weight_seed=1.5), "[model] weight_seed: must be an integer >= 0"),
    (dict(B="goe", V="goe", weight_scale=0.0), "[model] weight_scale"),
    (dict(B="goe", V="goe", weights="given"), "[model] weights: set by spherepde"),
])
def test_bad_weight_settings_name_the_key(kw, message):
    with pytest.raises(ConfigError) as err:
        resolve(model(**kw))
    assert str(err.value).startswith(message), str(err.value)


def test_every_law_is_accepted_by_the_config():
    for law in LAWS:
        cfg = resolve(model(B="orthogonal", V=law, weight_seed=5))
        assert np.isfinite(np.array(cfg["model"]["V"])).all()


def test_a_sweep_over_weight_seed_is_an_ensemble_of_models(tmp_path):
    from spherepde.runner.sweep import _coordinate, expand

    path = tmp_path / "ensemble.toml"
    path.write_text('[sweep]\nname = "ens"\n[sweep.grid]\n"model.weight_seed" = [1, 2, 3]\n'
                    '[base.model]\nbeta = 10.0\nB = "goe"\nV = "orthogonal"\n'
                    '[base.time]\nt_end = 1.0\nsave_every = 0.5\n')
    specs = expand(path, tmp_path / "out")
    Bs = [np.array(s.config["model"]["B"]) for s in specs]
    assert len(specs) == 3 and not np.array_equal(Bs[0], Bs[1]) and not np.array_equal(Bs[1], Bs[2])
    for seed, s in zip([1, 2, 3], specs):
        np.testing.assert_array_equal(np.array(s.config["model"]["V"]), resolve_weights("goe", "orthogonal", seed)[1])
    assert list(_coordinate("model.weight_seed", specs)) == [1, 2, 3]
