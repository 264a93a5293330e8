"""The vectorised exponential and the blocked softmax kernel against libm, the scalar reference
kernel and a plain NumPy logsumexp (in float64 and in extended precision)."""

import math
import re

import llvmlite.binding as llvm
import numpy as np
import pytest
from numba import njit

from spherepde.models.attention import AttentionModel
from spherepde.summation import attention_field
from spherepde.summation.direct import SOURCE_BLOCK, softmax_direct_reference
from spherepde.summation.fastmath import exp2_fast, exp2_weight, exp_fast
from spherepde.summation.kernels import SUMS, block_moments1, source_arrays

SMALLEST_NORMAL = np.finfo(float).tiny


@njit
def _apply_exp(x, out):
    for i in range(x.size):
        out[i] = exp_fast(x[i])


@njit
def _apply_exp2(x, out):
    for i in range(x.size):
        out[i] = exp2_fast(x[i])


@njit
def _apply_exp2_weight(x, out):
    for i in range(x.size):
        out[i] = exp2_weight(x[i])


def apply(kernel, x):
    x = np.ascontiguousarray(x, dtype=float)
    out = np.empty_like(x)
    kernel(x, out)
    return out


def ulps(a, b):
    """Distance in units in the last place (both arrays ≥ 0)."""
    return np.abs(a.view(np.int64) - b.view(np.int64))


# ----------------------------------------------------------------------------- exponential
def test_exp_within_one_ulp_of_libm():
    rng = np.random.default_rng(0)
    x = np.concatenate([np.linspace(-708.04, 0.0, 1_000_001), rng.uniform(-708.04, 0.0, 1_000_000),
                        rng.uniform(-1e-3, 1e-3, 10_000), rng.uniform(0.0, 709.7, 100_000)])
    assert ulps(apply(_apply_exp, x), np.exp(x)).max() <= 1  # ≤ 2 required


def test_exp_flushes_below_the_normal_range():
    """Below −708.05 (2^−1021.5) the result is exactly 0 — no subnormal, garbage or NaN — where
    libm returns subnormals (< 2^−1021.5 < 3.2e-308 absolute difference)."""
    x = np.linspace(-745.0, -708.05, 100_001)
    y = apply(_apply_exp, x)
    assert np.all(y == 0.0)
    assert np.abs(y - np.exp(x)).max() < 3.2e-308
    x = np.linspace(-708.05, 0.0, 100_001)
    y = apply(_apply_exp, x)
    assert np.all((y == 0) | (y >= SMALLEST_NORMAL))  # never subnormal


def test_exp_edge_cases():
    x = np.array([0.0, -0.0, -708.0, -709.0, -745.0, -800.0, -1e6, -1e300, -np.inf, 1e-300, -1e-300,
                  709.78, 709.8, 1e6, np.inf])
    y = apply(_apply_exp, x)
    with np.errstate(over="ignore"):
        ref = np.exp(x)
    assert y[0] == 1.0 and y[1] == 1.0 and y[9] == 1.0 and y[10] == 1.0
    assert ulps(y[2:3], ref[2:3]).max() <= 1  # −708: still normal
    assert np.all(y[3:9] == 0.0)  # −709, −745, −800, −1e6, −1e300, −inf → exactly 0
    assert ulps(y[11:12], ref[11:12]).max() <= 1
    assert np.all(np.isposinf(y[12:]))
    assert not np.any(np.isnan(y))


def test_exp2_variants():
    rng = np.random.default_rng(1)
    u = np.concatenate([rng.uniform(-1021.4, 0.0, 1_000_000), rng.uniform(-0.5, 0.5, 10_000)])
    assert ulps(apply(_apply_exp2, u), np.exp2(u)).max() <= 1
    assert np.all(apply(_apply_exp2, np.array([-1021.6, -1074.0, -2e3, -1e300, -np.inf])) == 0)
    assert apply(_apply_exp2, np.array([0.0, 1.0, -1022.0 + 0.5]))[:2].tolist() == [1.0, 2.0]
    # the kernel variant: no clamp (|u| < 2⁵⁰), flushed below 2^−957.5
    w = rng.uniform(-957.4, 0.0, 1_000_000)
    assert ulps(apply(_apply_exp2_weight, w), np.exp2(w)).max() <= 1
    low = np.array([-957.6, -1000.0, -1021.0, -1e6, -1e14])
    assert np.all(apply(_apply_exp2_weight, low) == 0.0)


@pytest.mark.skipif("avx2" not in llvm.get_host_cpu_features().flatten(),
                    reason="vectorisation check needs an AVX2 host")
def test_inner_loop_vectorises():
    """The source loop compiles to packed FMAs on ymm/zmm registers (no scalar libm call).

    Cached code cannot be inspected: compile the same function with the same flags afresh.
    """
    kernel = njit(fastmath=SUMS)(block_moments1.py_func)
    y = np.zeros(16)
    kernel(1.0, 2.0, 3.0, 0.0, 0.0, 1.0, -1.0, y, y, y, y)
    asm = kernel.inspect_asm(kernel.signatures[0])
    assert re.search(r"vfn?madd\d+pd\s+[^\n]*%[yz]mm", asm)
    assert "exp" not in re.findall(r"call\w*\s+([^\n]*)", asm)


# ----------------------------------------------------------------------------- softmax kernel
def random_points(n, seed):
    x = np.random.default_rng(seed).normal(size=(n, 3))
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def numpy_field(B, V, beta, sources, masses, x, dtype=np.float64):
    """Plain NumPy logsumexp (T × N arrays: small sizes only) in the precision dtype.

    np.longdouble (x87 extended, ε = 2⁻⁶⁴ on x86-64) serves as the exact answer for the float64
    inputs. The covariance is formed from centred differences (two-pass, no cancellation).
    """
    keep = masses > 0
    y = sources[keep].astype(dtype)
    B, V, x = B.astype(dtype), V.astype(dtype), x.astype(dtype)
    logits = dtype(beta) * (x @ B) @ y.T + np.log(masses[keep].astype(dtype))[None, :]
    w = np.exp(logits - logits.max(axis=1, keepdims=True))
    w /= w.sum(axis=1, keepdims=True)
    m = w @ y
    d = y[None, :, :] - m[:, None, :]
    C = np.einsum("tn,tni,tnj->tij", w, d, d)
    u = m @ V.T
    xu = np.sum(x * u, axis=1)
    v = u - xu[:, None] * x
    K = np.einsum("ij,tjk,lk->til", V, C, B)  # V C Bᵀ
    tr = np.einsum("tii->t", K) - np.einsum("ti,tij,tj->t", x, K, x)
    div = dtype(beta) * tr - 2 * xu
    return v.astype(float), div.astype(float), m.astype(float)


def reference_kernel(model, sources, masses, x, want_div):
    out = (np.empty((len(x), 3)), np.empty(len(x)), np.empty((len(x), 3)))
    with np.errstate(divide="ignore"):
        log_mass = np.log(masses)
    softmax_direct_reference(x, np.ascontiguousarray(model.B.T), model.beta, sources, log_mass,
                             model.V, want_div, *out, np.empty(0))
    return out


def masses_with_gaps(n, rng):
    """Random masses with empty cells, 1e-200-scale cells and a spread of magnitudes."""
    mass = rng.random(n) * 10.0 ** rng.uniform(-3, 0, n)
    mass[1::7] *= 1e-200
    if n > 2:
        mass[::5] = 0.0
    return mass


@pytest.mark.parametrize("nsource", [1, 7, 1001])
@pytest.mark.parametrize("beta", [1e-3, 0.7, 12.0, 300.0, 1e4, 1e6])
def test_kernel_against_references(beta, nsource):
    rng = np.random.default_rng(int(beta * 1000) % 9973 + nsource)
    model = AttentionModel(rng.normal(size=(3, 3)), rng.normal(size=(3, 3)), beta)
    src = random_points(nsource, 1)
    mass = masses_with_gaps(nsource, rng)
    x = random_points(150, 2)  # > TARGET_BLOCK, not a multiple of it
    nV, nB = np.linalg.norm(model.V, 2), np.linalg.norm(model.B, 2)
    scale = beta * nV * nB + nV  # of div
    exact = numpy_field(model.B, model.V, beta, src, mass, x, np.longdouble)
    plain = numpy_field(model.B, model.V, beta, src, mass, x)
    for want_div in (False, True):
        v, div, m = (np.copy(a) if a is not None else None
                     for a in attention_field(model, src, mass, x, want_div=want_div))
        rv, rdiv, rm = reference_kernel(model, src, mass, x, want_div)
        assert np.all(np.isfinite(v)) and np.all(np.isfinite(m))
        # m: |y| = 1 sets the scale; the reference kernels carry rounding of order ε|βBᵀx| in
        # each exponent (≈ 2e-13 on m at β = 1e4), the fast kernel centres its exponents and does
        # not: compare it with the exact answer at 1e-13 and with the others up to their own error
        err_ref = np.abs(rm - exact[2]).max()
        err_plain = np.abs(plain[2] - exact[2]).max()
        np.testing.assert_allclose(m, exact[2], rtol=0, atol=1e-13)
        np.testing.assert_allclose(m, rm, rtol=0, atol=1e-13 + err_ref)
        np.testing.assert_allclose(m, plain[2], rtol=0, atol=1e-13 + err_plain)
        np.testing.assert_allclose(v, exact[0], rtol=0, atol=2e-13 * nV)
        if want_div:
            assert np.all(np.isfinite(div))
            np.testing.assert_allclose(div, exact[1], rtol=0, atol=1e-12 * scale)
            err_ref_div = np.abs(rdiv - exact[1]).max()
            np.testing.assert_allclose(div, rdiv, rtol=0, atol=1e-12 * scale + err_ref_div)
            np.testing.assert_allclose(div, plain[1], rtol=0,
                                       atol=1e-12 * scale + np.abs(plain[1] - exact[1]).max())


def test_source_blocks_and_non_unit_sources():
    """More sources than one block (a partial last block), sources off the unit sphere."""
    rng = np.random.default_rng(3)
    n = SOURCE_BLOCK + 1001
    model = AttentionModel(rng.normal(size=(3, 3)), rng.normal(size=(3, 3)), 40.0)
    src = random_points(n, 4) * rng.uniform(0.5, 1.0, (n, 1))
    mass = masses_with_gaps(n, rng)
    x = random_points(9, 5)
    v, div, m = attention_field(model, src, mass, x, want_div=True)
    ev, ediv, em = numpy_field(model.B, model.V, 40.0, src, mass, x, np.longdouble)
    np.testing.assert_allclose(m, em, rtol=0, atol=1e-13)
    scale = 40 * np.linalg.norm(model.V, 2) * np.linalg.norm(model.B, 2)
    np.testing.assert_allclose(div, ediv, rtol=0, atol=1e-12 * scale)


def test_concentrated_mass_far_from_the_attention_direction():
    """One heavy cell and light cells: the one-pass bound would underflow, the exact max pass
    must take over (β|Bᵀx| large), and a single positive mass gives m = its position."""
    model = AttentionModel(np.eye(3), np.eye(3), 2000.0)
    src = random_points(50, 6)
    x = -src[:5]  # targets opposite to the first sources
    mass = np.full(50, 1e-150)
    mass[0] = 1.0
    _, _, m = attention_field(model, src, mass, x)
    _, _, em = numpy_field(model.B, model.V, 2000.0, src, mass, x, np.longdouble)
    np.testing.assert_allclose(m, em, rtol=0, atol=1e-13)
    only = np.zeros(50)
    only[17] = 1e-300
    v, div, m = attention_field(model, src, only, x, want_div=True)
    np.testing.assert_allclose(m, np.broadcast_to(src[17], m.shape), rtol=0, atol=3e-16)
    np.testing.assert_allclose(div, -2 * x @ src[17], rtol=0, atol=1e-12 * model.beta)  # C = 0


def test_huge_masses_ratio_and_absurd_beta():
    rng = np.random.default_rng(8)
    model = AttentionModel(rng.normal(size=(3, 3)), rng.normal(size=(3, 3)), 5.0)
    src = random_points(300, 9)
    mass = 10.0 ** rng.uniform(-300, 300, 300)  # ratios below 2⁻¹⁰⁷⁴: log₂ ratios down to −2000
    x = random_points(20, 10)
    lw = source_arrays(src, mass)[0][3]
    assert np.all(np.isfinite(lw)) and lw.min() < -1100 and lw.max() == 0.0
    _, _, m = attention_field(model, src, mass, x)
    _, _, em = numpy_field(model.B, model.V, 5.0, src, mass, x, np.longdouble)
    np.testing.assert_allclose(m, em, rtol=0, atol=1e-13)
    # β beyond the exp2 argument range of the fast kernel: the reference kernel takes over
    big = AttentionModel(np.eye(3), np.eye(3), 1e16)
    _, _, m = attention_field(big, src, np.ones(300), x)
    np.testing.assert_array_equal(m, src[np.argmax(x @ src.T, axis=1)])
    assert math.isfinite(float(np.abs(m).sum()))
