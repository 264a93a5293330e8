"""The validation flows are what the papers define: checked against a direct lat–lon evaluation."""

import math

import numpy as np
import pytest

from spherepde.validation.transport import (
    PERIOD,
    cosine_bells,
    from_east_north,
    gaussian_hills,
    lonlat,
    nair_lauritzen_velocity,
    williamson_velocity,
)


def direct_nair_lauritzen(kind, t, x):
    lon, lat = lonlat(x)
    lp = lon - 2 * math.pi * t / PERIOD
    c = math.cos(math.pi * t / PERIOD)
    if kind == "nondivergent":
        u = 2 * np.sin(lp) ** 2 * np.sin(2 * lat) * c + 2 * math.pi * np.cos(lat) / PERIOD
        v = 2 * np.sin(2 * lp) * np.cos(lat) * c
    else:
        u = -np.sin(lp / 2) ** 2 * np.sin(2 * lat) * np.cos(lat) ** 2 * c + 2 * math.pi * np.cos(lat) / PERIOD
        v = 0.5 * np.sin(lp) * np.cos(lat) ** 3 * c
    return from_east_north(x, u, v)


@pytest.mark.parametrize("kind", ["nondivergent", "divergent"])
def test_nair_lauritzen_cartesian_matches_latlon(kind):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(500, 3))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    for t in (0.0, 1.3, 4.9):
        np.testing.assert_allclose(nair_lauritzen_velocity(kind)(t, x), direct_nair_lauritzen(kind, t, x),
                                   atol=1e-13)


def test_williamson_velocity_is_textbook_formula():
    """u = u₀(cosθ cosα + sinθ cosλ sinα), v = −u₀ sinλ sinα (Williamson et al. 1992, eq. 75–76)."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(300, 3))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    lon, lat = lonlat(x)
    for alpha in (0.0, 0.7, math.pi / 2):
        u0 = 2 * math.pi
        u = u0 * (np.cos(lat) * math.cos(alpha) + np.sin(lat) * np.cos(lon) * math.sin(alpha))
        v = -u0 * np.sin(lon) * math.sin(alpha)
        np.testing.assert_allclose(williamson_velocity(alpha)(0.0, x), from_east_north(x, u, v), atol=1e-12)


def test_initial_fields_ranges():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(20000, 3))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    h = gaussian_hills(x)
    assert 0 < h.min() and h.max() < 0.95 * 1.01
    b = cosine_bells(x)
    assert b.min() == pytest.approx(0.1) and b.max() <= 1.0


def test_direct_sum_benchmark_times_the_direct_sum(monkeypatch, capsys):
    """spherepde.validation.benchmark_attention reports the direct kernel's ns per pair: at nside 32, β = 30
    the default method would pick the harmonic expansion, which must not be what is timed."""
    import spherepde.summation.harmonic as harmonic_sum
    import spherepde.validation.benchmark_attention as bench

    def refuse(*args, **kwargs):
        raise AssertionError("the direct-sum benchmark called the harmonic expansion")

    monkeypatch.setattr(harmonic_sum, "harmonic_softmax", refuse)
    monkeypatch.setattr(bench, "measure_peak", lambda: (1.0, 1.0))
    rows = bench.run(nsides=(32,), betas=(30.0,), repeats=1, ref_targets=64, numpy_targets=64,
                     accuracy_targets=4)
    assert len(rows) == 2 and all(row["dm"] < 1e-12 for row in rows)
