"""Tokens on a GPU: the state (M, n, d) stays on the device between snapshots.

The particle solver's fixed-step schemes (spherepde.solvers.particles) with the field of the
fused device sums (spherepde.summation.cuda):

- "euler": x ← (x + Δt v)/|x + Δt v|;
- "rk4": k₁ = v(x), k₂ = v(x̂₂), k₃ = v(x̂₃), k₄ = v(x̂₄) at the normalised stages
  x̂ = (x + cΔt k)/|x + cΔt k| (c = ½, ½, 1), then x ← normalise(x + Δt/6 (k₁ + 2k₂ + 2k₃ + k₄)),
  the sum formed in that order as on the CPU, so that both agree to rounding.

Several heads: their fields are added on the device (one kernel launch per head); layers: each
step uses the model of its start time (the Schedule), as on the CPU. β = ∞ heads use the token
hardmax. Not on the device (refused by backend_for, so that "auto" runs them on the CPU): noise,
carried densities, and the local β = ∞ limit (hardmax = False).

Memory: x, the stage, k and the RK4 sum, 4 × M n d fp64 numbers (Euler: 2), plus log Z (M, n);
allocated once, before the run file is opened (reserve), so that a GPU without room for them is
a DeviceMemoryError and not a failed run. Positions come back to the host at save times only;
the run guard (finite positions) is checked there.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from ..summation import cuda as device_sums
from ..summation.batched import log2_masses
from ..summation.cuda import cuda
from .guards import Guards
from .timeline import segments

__all__ = ["BACKENDS", "SCHEMES", "backend_for", "device_problem", "DeviceTokens"]

BACKENDS = ("auto", "cpu", "cuda")
STEP_THREADS = 32 if device_sums.SIMULATOR else 256  # tokens per block of the update kernels


SCHEMES = ("euler", "rk4")  # the fixed-step schemes of the device (adaptive steps are not here)


def device_problem(noise=False, carry_density=False, local_limit=False, scheme="rk4") -> str | None:
    """Why a particle run cannot use the GPU (None when it can)."""
    if scheme not in SCHEMES:
        return f"scheme {scheme!r} is not on the GPU (only {', '.join(map(repr, SCHEMES))})"
    if noise:
        return "noise is not on the GPU"
    if carry_density:
        return "carried densities (quadrature particles) are not on the GPU"
    if local_limit:
        return "the local beta = inf limit (hardmax = False) is not on the GPU"
    return None


def backend_for(asked: str, problem: str | None = None) -> str:
    """The backend a run uses: "cpu" or "cuda". asked "auto" takes the GPU when numba sees one
    and problem (device_problem) is None; "cuda" raises ValueError when there is no GPU or a
    problem."""
    if asked not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {asked!r}")
    if asked == "cpu":
        return "cpu"
    if asked == "cuda":
        if not device_sums.available():
            raise ValueError('"cuda" asked for, but no GPU is visible to numba (numba.cuda.is_available() is false)')
        if problem:
            raise ValueError(f'"cuda" asked for, but {problem}')
        return "cuda"
    return "cuda" if problem is None and device_sums.available() else "cpu"


@functools.cache
def _step_kernels():
    """The update kernels (built once, on first use: numba-cuda may be absent). They name the
    module-level `cuda`, which numba's simulator swaps for its own in a kernel's globals."""

    @cuda.jit
    def normalised_axpy(x, k, coef, out):
        """out = (x + coef·k)/|x + coef·k| per token (out may be x)."""
        item = cuda.grid(1)
        nsys, n, d = x.shape
        if item < nsys * n:
            s = item // n
            i = item - s * n
            norm2 = 0.0
            for q in range(d):
                y = x[s, i, q] + coef * k[s, i, q]
                norm2 += y * y
            r = math.sqrt(norm2)
            for q in range(d):
                out[s, i, q] = (x[s, i, q] + coef * k[s, i, q]) / r

    @cuda.jit
    def accumulate(acc, k, factor, start):
        """acc = k (start), else acc + factor·k: the RK4 sum k₁ + 2k₂ + 2k₃ + k₄ in that order."""
        item = cuda.grid(1)
        nsys, n, d = acc.shape
        if item < nsys * n:
            s = item // n
            i = item - s * n
            for q in range(d):
                acc[s, i, q] = k[s, i, q] if start else acc[s, i, q] + factor * k[s, i, q]

    return normalised_axpy, accumulate


class DeviceTokens:
    """Tokens (M, n, d) with masses (n,) on the GPU, advanced by scheme "euler" | "rk4" (module
    docstring); precision "fp64" | "fp32" of the sums (spherepde.summation.cuda). A failed
    allocation raises spherepde.summation.cuda.DeviceMemoryError."""

    def __init__(self, shape, masses, scheme="rk4", precision="fp64"):
        if len(shape) != 3:
            raise ValueError(f"device tokens are (M, n, d), got shape {shape}")
        if scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {SCHEMES} on the GPU, got {scheme!r}")
        if precision not in device_sums.PRECISIONS:
            raise ValueError(f"precision must be one of {device_sums.PRECISIONS}, got {precision!r}")
        self.shape, self.scheme, self.precision = tuple(shape), scheme, precision
        lam, self.ln_top = log2_masses(masses)
        count = 4 if scheme == "rk4" else 2
        arrays = device_sums.device_arrays(*[self.shape] * count, self.shape[:2])
        self.x, self.k = arrays[0], arrays[1]
        self.stage, self.acc = (arrays[2], arrays[3]) if scheme == "rk4" else (None, None)
        self.logz = arrays[-1]
        self.lam = cuda.to_device(lam)
        self._axpy, self._accumulate = _step_kernels()
        self._matrices = {}  # id(head) → (head, Bᵀ, V) on the device
        self.evaluations = 0

    def load(self, x):
        """Copy host positions (M, n, d) to the device (taken as they are)."""
        self.x.copy_to_device(np.ascontiguousarray(x, dtype=np.float64))

    def positions(self):
        """The positions (M, n, d) on the host."""
        return self.x.copy_to_host()

    def _on_device(self, head):
        entry = self._matrices.get(id(head))
        if entry is None:  # the head is kept in the entry, so its id stays its own
            entry = (head, cuda.to_device(np.ascontiguousarray(np.asarray(head.B, float).T)),
                     cuda.to_device(np.ascontiguousarray(head.V, dtype=float)))
            self._matrices[id(head)] = entry
        return entry[1], entry[2]

    def field(self, x, out, heads):
        """out = the sum over the heads of v = P_x(V m) at the device tokens x (hardmax at β = ∞)."""
        self.evaluations += 1
        for h, head in enumerate(heads):
            BT, V = self._on_device(head)
            if head.zero_temperature:
                device_sums.launch_hardmax(x, self.lam, BT, V, out, self.precision, accumulate=h > 0)
            else:
                device_sums.launch_softmax(x, self.lam, BT, V, head.beta, self.ln_top, out, self.logz, self.precision,
                                           log_shift=head.log_field_scale if head.unnormalised else 0.0,
                                           unnormalised=head.unnormalised, accumulate=h > 0)

    def step(self, dt, heads):
        """One step of size dt of the device positions."""
        tokens = self.shape[0] * self.shape[1]
        grid = ((tokens + STEP_THREADS - 1) // STEP_THREADS, STEP_THREADS)
        if self.scheme == "euler":
            self.field(self.x, self.k, heads)
            self._axpy[grid](self.x, self.k, dt, self.x)
            return
        stage = self.x
        for c, factor in ((0.5, 1.0), (0.5, 2.0), (1.0, 2.0), (None, 1.0)):
            self.field(stage, self.k, heads)
            self._accumulate[grid](self.acc, self.k, factor, stage is self.x)
            if c is not None:
                self._axpy[grid](self.x, self.k, c * dt, self.stage)
                stage = self.stage
        self._axpy[grid](self.x, self.acc, dt / 6, self.x)

    def snapshots(self, x, schedule, dt, times, first):
        """Yield (k, t, positions) at times[first + 1 …], starting from host positions x at
        times[first]: the fixed dt, shortened to land on every save and switch time (the step
        rule of ParticleSolver.snapshots), the model of each step's start time."""
        self.load(x)
        t = float(times[first])
        key = heads = None
        for k in range(first + 1, len(times)):
            for _, t_next in segments(t, times[k], schedule.switch_times):
                while t < t_next:
                    remaining = t_next - t
                    step = remaining if remaining <= dt * 1.001 else dt
                    if schedule.key_at(t) != key:
                        key, heads = schedule.key_at(t), schedule.model_at(t).heads
                    self.step(step, heads)
                    t = t_next if step == remaining else t + step
            positions = self.positions()
            Guards.particles(t, positions, None)
            yield k, t, positions
