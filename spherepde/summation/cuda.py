"""The batched token sums of spherepde.summation.batched on a GPU, with numba's CUDA target.

The same sums (M systems of n tokens x_{k,i} ∈ S^{d−1}, masses μ_j shared by the systems):

    m_β(x_{k,i}) = Σ_j ω_j x_{k,j},  ω_j ∝ μ_j e^{β⟨Bᵀx_{k,i}, x_{k,j}⟩},  v = P_x(V m_β),
    log Z(x) = ln Σ_j μ_j e^{β⟨Bᵀx, x_{k,j}⟩},

and the β = ∞ hardmax m(x) = x_{k,j*}, j* = argmax_{j: μ_j > 0} ⟨Bᵀx, x_{k,j}⟩ (first index on
ties), as one fused kernel each: no n × n array, no second pass, memory O(M n d).

Design (fused online softmax, Milakov & Gimelshein 2018, arXiv 1805.02867):
- one thread per target, THREADS targets per block (fewer, whole warps, for small n), grid
  (⌈n / THREADS⌉, M): blockIdx.y is the system, so every block streams the sources of one system.
- the sources of that system pass through shared memory in tiles of `tile` tokens × d
  coordinates plus their λ_j = log₂(μ_j / max μ); the threads of a block load a tile together
  (coalesced: the tile is contiguous in the (M, n, d) array) and then all read it (broadcast).
- per target, per source (base 2, exponents centred as in the CPU kernel: a = β log₂e Bᵀx,
  â = a/|a|, e_j = λ_j + ⟨a, y_j − â⟩ ≤ λ_j, so rounding is ~ε|a||y_j − â|, small where the
  weights are heavy): a running maximum r, and z = Σ 2^(e_j − r), s = Σ 2^(e_j − r)(y_j − â)
  rescaled by 2^(r_old − r) when a source raises r; weights below 2^EXPONENT_FLOOR are 0,
  sources without mass are skipped. At the end m = â + s/z, v = P_x(V m), and
  log Z = ln 2 (log₂ z + r + |a|) + ln max μ. The unnormalised field (v scaled by e^{log Z − c},
  spherepde.models.attention) is the same kernel with a flag.
- one thread per target (not a warp per target): the tokens of the runs this serves have
  d = 2 … 32, where a thread's d-vectors a, â, s stay in registers and every pair costs
  ~ (4d + 6) operations with no cross-thread reduction. For large d (rotf's 128, 1024) the
  vectors spill to local memory and the tile holds few sources (it is sized to SHARED_BYTES);
  a warp per target (lanes splitting the coordinates, a shuffle reduction per source) would be
  the better layout there, and is not written.
- precision: "fp64" (default) or "fp32" is the type of the tile, the exponents and the
  accumulators; positions and velocities stay fp64 in global memory (the state of a run is fp64
  either way), and the final m, V m and the projection are fp64.
- the kernels are built per (d, precision) by kernels(): d fixes the sizes of the local and
  shared arrays at compile time, the precision the type of the constants. numba compiles each
  on its first launch (no cache on disk for CUDA kernels here).

numba-cuda is optional ([cuda] extra): without it, or without a GPU, available() is False and
nothing here compiles. Tests run the kernels in numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1).
"""

from __future__ import annotations

import functools
import math

import numba
import numpy as np

from .batched import EXPONENT_FLOOR, log2_masses
from .fastmath import LOG2E
from .kernels import LN2

try:  # numba-cuda (pip install 'spherepde[cuda]'); numba's own numba.cuda redirects to it
    from numba import cuda
except ImportError:  # pragma: no cover - numba without a CUDA target
    cuda = None

__all__ = ["available", "device_name", "kernels", "PRECISIONS", "THREADS", "SHARED_BYTES", "DeviceMemoryError",
           "device_arrays", "softmax_on_device", "hardmax_on_device", "launch_softmax", "launch_hardmax",
           "tile_size", "blocks", "SIMULATOR"]

PRECISIONS = ("fp64", "fp32")
# numba's simulator runs a Python thread per GPU thread: one warp per block there keeps the tests
# short (and gives several tiles at small n, which the tests then cover)
SIMULATOR = bool(numba.config.ENABLE_CUDASIM)
THREADS = 32 if SIMULATOR else 128  # targets per block (4 warps): enough blocks for 132 SMs from n ≈ 2·10⁴
SHARED_BYTES = 32 * 1024  # one tile of sources (d + 1 numbers each) per block; 48 KiB is the static limit
_REAL = {"fp64": np.float64, "fp32": np.float32}


class DeviceMemoryError(MemoryError):
    """The GPU has not enough free memory for the arrays of a run (a one-line message)."""


@functools.cache
def available() -> bool:
    """Whether numba sees a CUDA GPU (True in the simulator, NUMBA_ENABLE_CUDASIM=1)."""
    if cuda is None:
        return False
    try:
        return bool(cuda.is_available())
    except Exception:  # noqa: BLE001 - a broken driver installation counts as no GPU
        return False


def device_name() -> str:
    """The name of the current GPU ("simulator" under NUMBA_ENABLE_CUDASIM)."""
    if not available():
        return "none"
    if SIMULATOR:
        return "numba CUDA simulator"
    name = cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else str(name)


def tile_size(d: int, precision: str = "fp64") -> int:
    """Sources per shared-memory tile: THREADS, or fewer so that tile × (d + 1) numbers fit in
    SHARED_BYTES."""
    itemsize = np.dtype(_REAL[precision]).itemsize
    return max(1, min(THREADS, SHARED_BYTES // ((d + 1) * itemsize)))


def blocks(n: int, systems: int):
    """The launch grid of the sums: (⌈n / T⌉, M) blocks of T threads, T = THREADS, or the whole
    warps that cover n when fewer (2048 systems of 32 tokens: one warp per system, not four)."""
    threads = min(THREADS, 32 * ((n + 31) // 32))
    return ((n + threads - 1) // threads, systems), threads


@functools.cache
def kernels(d: int, precision: str = "fp64"):
    """(softmax, hardmax): the two CUDA kernels for tokens in R^d at a precision (module docstring).

    softmax(x, lam, BT, V, scale, ln_top, log_shift, unnormalised, accumulate, velocity, logz):
      x (M, n, d) fp64 tokens (targets and sources), lam (n,) log₂ mass ratios (−inf: no mass),
      BT = Bᵀ and V (d, d), scale = β log₂e, ln_top = ln max μ; writes logz (M, n) = log Z and
      velocity (M, n, d) = P_x(V m_β) (times e^{log Z − log_shift} when unnormalised), added to
      what velocity holds when accumulate (several heads).
    hardmax(x, lam, BT, V, accumulate, velocity): the β = ∞ token rule, v = P_x(V x_{j*}).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if cuda is None:
        raise RuntimeError("numba-cuda is not installed (pip install 'spherepde[cuda]')")
    real = _REAL[precision]
    tile = tile_size(d, precision)
    zero = real(0.0)
    neg_inf = real(-np.inf)
    floor = real(EXPONENT_FLOOR)

    def load_tile(x, lam, k, t0, count, ys, ls):
        """The block's threads copy sources t0 … t0 + count − 1 of system k into shared memory."""
        cuda.syncthreads()  # everyone is done with the previous tile
        for idx in range(cuda.threadIdx.x, count * d, cuda.blockDim.x):
            j = idx // d
            ys[j, idx - j * d] = real(x[k, t0 + j, idx - j * d])
        for j in range(cuda.threadIdx.x, count, cuda.blockDim.x):
            ls[j] = real(lam[t0 + j])
        cuda.syncthreads()

    load = cuda.jit(device=True)(load_tile)

    @cuda.jit
    def softmax(x, lam, BT, V, scale, ln_top, log_shift, unnormalised, accumulate, velocity, logz):
        k = cuda.blockIdx.y
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        n = x.shape[1]
        active = i < n  # idle threads still load tiles
        ys = cuda.shared.array((tile, d), real)
        ls = cuda.shared.array(tile, real)
        a = cuda.local.array(d, real)
        h = cuda.local.array(d, real)
        acc = cuda.local.array(d, real)
        norm = 0.0
        if active:
            norm2 = 0.0
            for p in range(d):
                s = 0.0
                for q in range(d):
                    s += BT[p, q] * x[k, i, q]
                s *= scale
                a[p] = real(s)
                norm2 += s * s
            norm = math.sqrt(norm2)
            for p in range(d):
                h[p] = real(a[p] / norm) if norm > 0.0 else zero
                acc[p] = zero
        run = neg_inf  # running maximum of the exponents (base 2)
        z = zero
        for t0 in range(0, n, tile):
            count = min(tile, n - t0)
            load(x, lam, k, t0, count, ys, ls)
            if active:
                for j in range(count):
                    e = ls[j]
                    if e > neg_inf:  # a source without mass has weight 0
                        for q in range(d):
                            e += a[q] * (ys[j, q] - h[q])
                        if e > run:  # rescale what was summed under the old maximum
                            factor = real(math.exp2(run - e))  # 0 while run = −inf
                            z *= factor
                            for q in range(d):
                                acc[q] *= factor
                            run = e
                        w = real(math.exp2(max(e - run, floor)))
                        z += w
                        for q in range(d):
                            acc[q] += w * (ys[j, q] - h[q])
        if active:
            # m = â + s/z in fp64, kept in acc's place as the fp64 vector V m is formed
            zf = np.float64(z)
            lz = LN2 * (math.log2(zf) + np.float64(run) + norm) + ln_top
            logz[k, i] = lz
            factor = math.exp(lz - log_shift) if unnormalised else 1.0
            xu = 0.0
            for p in range(d):
                up = 0.0
                for q in range(d):
                    up += V[p, q] * (np.float64(h[q]) + np.float64(acc[q]) / zf)
                xu += x[k, i, p] * up
            for p in range(d):
                up = 0.0
                for q in range(d):
                    up += V[p, q] * (np.float64(h[q]) + np.float64(acc[q]) / zf)
                vp = factor * (up - xu * x[k, i, p])
                velocity[k, i, p] = velocity[k, i, p] + vp if accumulate else vp

    @cuda.jit
    def hardmax(x, lam, BT, V, accumulate, velocity):
        k = cuda.blockIdx.y
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        n = x.shape[1]
        active = i < n
        ys = cuda.shared.array((tile, d), real)
        ls = cuda.shared.array(tile, real)
        a = cuda.local.array(d, real)
        if active:
            for p in range(d):
                s = 0.0
                for q in range(d):
                    s += BT[p, q] * x[k, i, q]
                a[p] = real(s)
        best = neg_inf
        arg = 0
        for t0 in range(0, n, tile):
            count = min(tile, n - t0)
            load(x, lam, k, t0, count, ys, ls)
            if active:
                for j in range(count):
                    if ls[j] > neg_inf:
                        s = zero
                        for q in range(d):
                            s += a[q] * ys[j, q]
                        if s > best:
                            best = s
                            arg = t0 + j
        if active:
            xu = 0.0
            for p in range(d):
                up = 0.0
                for q in range(d):
                    up += V[p, q] * x[k, arg, q]
                xu += x[k, i, p] * up
            for p in range(d):
                up = 0.0
                for q in range(d):
                    up += V[p, q] * x[k, arg, q]
                vp = up - xu * x[k, i, p]
                velocity[k, i, p] = velocity[k, i, p] + vp if accumulate else vp

    return softmax, hardmax


def device_arrays(*shapes):
    """Uninitialised fp64 device arrays of the given shapes; a failed allocation becomes
    DeviceMemoryError naming the memory asked for."""
    try:
        return [cuda.device_array(shape, dtype=np.float64) for shape in shapes]
    except Exception as exc:  # numba raises CudaAPIError / RuntimeError with the driver's code
        if "OUT_OF_MEMORY" not in str(exc).upper() and "out of memory" not in str(exc).lower():
            raise
        total = sum(8 * math.prod(s) for s in shapes)
        raise DeviceMemoryError(f"GPU out of memory: the tokens need {total / 2**20:.1f} MiB on "
                                f"{device_name()} ({exc.__class__.__name__}); use fewer systems or tokens") from None


def launch_softmax(x, lam, BT, V, beta, ln_top, velocity, logz, precision="fp64", log_shift=0.0,
                   unnormalised=False, accumulate=False):
    """One launch of the fused softmax kernel on device arrays (kernels() for the arguments)."""
    nsys, n, d = x.shape
    grid, threads = blocks(n, nsys)
    softmax = kernels(d, precision)[0]
    softmax[grid, threads](x, lam, BT, V, float(beta) * LOG2E, float(ln_top), float(log_shift),
                           bool(unnormalised), bool(accumulate), velocity, logz)


def launch_hardmax(x, lam, BT, V, velocity, precision="fp64", accumulate=False):
    """One launch of the hardmax kernel on device arrays."""
    nsys, n, d = x.shape
    grid, threads = blocks(n, nsys)
    kernels(d, precision)[1][grid, threads](x, lam, BT, V, bool(accumulate), velocity)


def softmax_on_device(x, masses, B, V, beta, precision="fp64"):
    """(v (M, n, d), log Z (M, n)) of host tokens x (M, n, d) with masses (n,) by the device
    kernel: the tokens go to the GPU and the results come back (tests, benchmarks)."""
    x = np.ascontiguousarray(x, dtype=float)
    lam, ln_top = log2_masses(masses)
    xd = cuda.to_device(x)
    velocity, logz = device_arrays(x.shape, x.shape[:2])
    launch_softmax(xd, cuda.to_device(lam), cuda.to_device(np.ascontiguousarray(np.asarray(B, float).T)),
                   cuda.to_device(np.ascontiguousarray(V, dtype=float)), beta, ln_top, velocity, logz, precision)
    return velocity.copy_to_host(), logz.copy_to_host()


def hardmax_on_device(x, masses, B, V, precision="fp64"):
    """v (M, n, d) of the β = ∞ hardmax rule by the device kernel, for host tokens."""
    x = np.ascontiguousarray(x, dtype=float)
    lam, _ = log2_masses(masses)
    (velocity,) = device_arrays(x.shape)
    launch_hardmax(cuda.to_device(x), cuda.to_device(lam), cuda.to_device(np.ascontiguousarray(np.asarray(B, float).T)),
                   cuda.to_device(np.ascontiguousarray(V, dtype=float)), velocity, precision)
    return velocity.copy_to_host()
