"""A vectorisable exponential (and float max) for numba kernels.

numba without SVML turns math.exp in a loop into a scalar libm call (~17 ns for large negative
arguments, docs/theory.md#formulas-and-exact-solutions), which also keeps LLVM from vectorising the loop. The functions here are
straight-line arithmetic (no calls, no branches), so a loop that calls them vectorises.

    e^x = 2^u, u = x·log₂e = k + f, k = round(u), |f| ≤ ½,    2^u = 2^k · 2^f

- k by the shifter trick: t = u + S with S = 1.5·2⁵² + 1022 rounds u to an integer, and the low
  mantissa bits of t then hold k + 1022; t − S is k exactly (no float→int conversion).
- 2^k from the bit pattern: bits(t) << 52 shifts the leading bits of t out and k + 1022 into the
  exponent field, giving 2^(k−1) — the polynomial carries the factor 2 (exact). Taking
  max(bits(t), bits(1.5·2⁵²)) first makes k + 1022 ≤ 0 the bit pattern of +0.0: every result
  below 2^−1021.5 (e^x for x < −708.05) is exactly 0 — no subnormals, no garbage, no NaN.
- 2^f: degree-11 polynomial, minimax for the relative error on [−½, ½] (Remez, error
  3·10⁻¹⁸ ≪ 2⁻⁵³), Horner with fused multiply–adds. The results are within 1 ulp.

exp_fast(x) reduces x with a two-part ln 2 (Cody–Waite): r = x − k·ln2_hi − k·ln2_lo is exact to
~2⁻¹⁰⁶ relative, so e^x is within 1 ulp on the whole normal range. exp2_fast(u) skips that
reduction (f = u − k is exact), two FMAs fewer: a kernel that can scale its exponents by log₂e
once per target / per source calls it. Both clamp their argument (so ±inf work and t stays
exact). exp2_weight(u) is the kernel variant for softmax weights: no clamps (the caller keeps
|u| < 2⁵⁰) and results below 2^−957.5 flushed to 0, so that a weight times factors ≥ 2⁻⁶⁴
(moments w·d_i·d_k) is never subnormal — subnormal products cost ~35 % of the second-moment
loop on Zen 4 when many weights sit near the underflow limit (measured). It uses a polynomial
scaled by 2⁶⁵ and the exponent offset 958 instead of 1022 (same operation count).

None of these may be compiled with fastmath 'reassoc' (it would fold (u + S) − S into u): they
use 'contract' only and keep their own flags when LLVM inlines them into a fastmath kernel.
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core.extending import intrinsic

__all__ = ["exp_fast", "exp2_fast", "exp2_weight", "maxnum", "LOG2E"]

LOG2E = 1.4426950408889634
_LN2_HI = 0.6931471803691238  # 0x3fe62e42fee00000: 32 significant bits, k·ln2_hi exact (|k| < 2²¹)
_LN2_LO = 1.9082149292705877e-10  # ln 2 − ln2_hi
_SHIFTER = 6755399441055744.0 + 1022.0  # 1.5·2⁵² + 1022
_SHIFTER_ZERO_BITS = 0x4338000000000000  # bits(1.5·2⁵²): t at k + 1022 = 0
_WEIGHT_SHIFTER = 6755399441055744.0 + 958.0  # exp2_weight: 2^(k−65) from k + 958
_U_MIN = -2000.0  # anything below −1021.5 gives 0; the clamp keeps t exact and maps −inf to 0
_U_MAX = 1024.0  # k ≤ 1024 keeps k + 1022 inside the exponent field (+inf from k = 1024 on)
_X_MIN = -1400.0  # the same two bounds for exp_fast, in the natural base
_X_MAX = 710.0

# 2·2^f ≈ Σ P_i f^i on [−½, ½], relative error 3.1e-18 (Remez, degree 11)
_P = (2.0, 1.3862943611198906, 0.4804530139182031, 0.11100821732963985, 0.01923625821517667,
      0.00266671162935799, 0.0003080706092502923, 3.050546697992161e-05, 2.643086617918926e-06,
      2.0356396066657056e-07, 1.4148211252491318e-08, 8.870561889220673e-10)
_P_WEIGHT = tuple(c * 2.0**64 for c in _P)  # 2⁶⁵·2^f: exact (powers of two)

# 2·e^r ≈ Σ Q_i r^i on [−ln2/2, ln2/2], relative error 3.1e-18 (Remez, degree 11)
_Q = (2.0, 2.0, 1.0000000000000036, 0.3333333333333234, 0.08333333333298554, 0.01666666666711854,
      0.0027777777902447975, 0.00039682538865358475, 4.9602973042854926e-05,
      5.511524506174451e-06, 5.526458655891975e-07, 4.9988609769634415e-08)


@intrinsic
def _float_bits(typingctx, x):
    """The IEEE-754 bit pattern of a float64 as an int64 (a register bit cast)."""
    if x != types.float64:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(64))

    return types.int64(types.float64), codegen


@intrinsic
def _bits_float(typingctx, i):
    """The float64 with bit pattern i (int64)."""
    if i != types.int64:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.DoubleType())

    return types.float64(types.int64), codegen


@intrinsic
def maxnum(typingctx, a, b):
    """max(a, b) of two float64 as llvm.maxnum (IEEE maxNum: a NaN operand is ignored).

    Unlike numba's max() (a compare and a select without fast-math flags), LLVM vectorises a
    max reduction written with it.
    """
    if a != types.float64 or b != types.float64:
        return None

    def codegen(context, builder, signature, args):
        d = ir.DoubleType()
        fn = builder.module.declare_intrinsic("llvm.maxnum", [d], ir.FunctionType(d, [d, d]))
        return builder.call(fn, args)

    return types.float64(types.float64, types.float64), codegen


@njit(cache=True, fastmath={"contract"})
def _pow2_km1(t):
    """2^(k−1) from t = k + 1022 + 1.5·2⁵², exactly 0 when k ≤ −1022 (k − 65 from k + 958)."""
    return _bits_float(max(_float_bits(t), _SHIFTER_ZERO_BITS) << 52)


@njit(cache=True, fastmath={"contract"})
def _horner11(f, c):
    """Σ c_i f^i, i ≤ 11, by Horner's rule (c a constant tuple, unrolled by the compiler)."""
    p = c[11]
    p = p * f + c[10]
    p = p * f + c[9]
    p = p * f + c[8]
    p = p * f + c[7]
    p = p * f + c[6]
    p = p * f + c[5]
    p = p * f + c[4]
    p = p * f + c[3]
    p = p * f + c[2]
    p = p * f + c[1]
    return p * f + c[0]


@njit(cache=True, fastmath={"contract"})
def exp2_weight(u):
    """2^u (≤ 1 ulp), exactly 0 for u < −957.5; requires |u| < 2⁵⁰ (no clamp, no inf/NaN)."""
    t = u + _WEIGHT_SHIFTER
    f = u - (t - _WEIGHT_SHIFTER)  # exact
    return _horner11(f, _P_WEIGHT) * _pow2_km1(t)


@njit(cache=True, fastmath={"contract"})
def exp2_fast(u):
    """2^u for any float64 u but NaN (≤ 1 ulp), exactly 0 for u < −1021.5."""
    u = min(max(u, _U_MIN), _U_MAX)
    t = u + _SHIFTER
    f = u - (t - _SHIFTER)  # exact
    return _horner11(f, _P) * _pow2_km1(t)


@njit(cache=True, fastmath={"contract"})
def exp_fast(x):
    """e^x for any float64 x but NaN (≤ 1 ulp), exactly 0 for x < −708.05."""
    x = min(max(x, _X_MIN), _X_MAX)
    t = x * LOG2E + _SHIFTER
    k = t - _SHIFTER
    r = x - k * _LN2_HI  # exact: k·ln2_hi has ≤ 43 significant bits and is close to x
    r = r - k * _LN2_LO
    return _horner11(r, _Q) * _pow2_km1(t)
