"""The GPU backend measured on a real GPU, in one command (issue 38 item 5):

    python -m spherepde.validation.benchmark_gpu            (about 5 min on an H200)

prints Markdown for docs/performance.md: the device, checks against the CPU (the sum, fp64 and
fp32; five RK4 steps of the device solver; it stops if fp64 differs by more than 1e-12), then

1. throughput of the fused sum (spherepde.summation.cuda), fp64 and fp32: one system of
   n = 10⁴ … 10⁶ tokens in d = 3 (and d = 16 at n = 10⁵; 8 systems of 2 000): pairs per second
   and the implied FLOP rate against the H200's peak. Operations counted per pair: 4d + 6
   (the exponent ⟨a, y − â⟩: 2d; the weight's exp2, max and the sum z: ~4 counted as 4, though
   fp64 exp2 is a ~20-operation software routine; the moments s += w (y − â): 2d; + 2);
2. the paper's token ensembles end to end: the 12 batched runs of solvers/sweeps/paper_tokens.toml
   and paper_tokens_sharp.toml (3 laws × β ∈ {10, 30, 1000, ∞}, 8 seeds as `systems = 8`,
   n = 2 000, t ≤ 20 saved every 0.1, RK4 dt 0.05 / 0.01) on the device, in fp64 and in
   fp32, with the F-onset of every seed (alignment with F = e₂ exceeding that with E = e₁ after
   its maximum, as spherepde.analysis.metrics.f_phase_onset) and the fp32 − fp64 difference;
3. the largest n that runs to t = 20 within 10 minutes (one system, RK4, dt = 0.01 and 0.05, β =
   30): from measured step times at a few n, t_step = a + b n² fitted, the n at 600 s.

They run in the order 1, 3, 2: the ensembles last, and no ensemble case starts later than
ENSEMBLE_DEADLINE seconds after the start (the table then says it stopped), so that the whole
stays within ~10 minutes of device time even on a slower GPU.

Without a GPU (numba.cuda.is_available() false) it says so and exits 0. It needs numpy, numba,
numba-cuda and the imports of spherepde.solvers (healpy included), not netCDF4, POT or dask:
docs/performance.md#gpu-backend says how to bring what the GPU machine lacks. `--smoke` runs
every part on tiny sizes (the test suite runs it in numba's CUDA simulator).
"""

from __future__ import annotations

import math
import platform
import sys
import time

import numpy as np

__all__ = ["main", "check", "check_steps", "throughput", "ensembles", "largest_n", "flops_per_pair", "PEAK"]

# H200 (SXM) peaks without tensor cores, operations per second (the kernel uses none): fp64 34
# TFLOP/s (67 with fp64 tensor cores, which a softmax sum cannot use), fp32 67 TFLOP/s
PEAK = {"fp64": 34e12, "fp32": 67e12}
WALL = 600.0  # seconds: "the largest n to t = 20 in 10 minutes"
ENSEMBLE_DEADLINE = 480.0  # seconds after the start: no ensemble case starts later (the device time is lent)
PAPER_V = [[-1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, -2.0]]
PAPER_B = [[-1.0, 0.0, 0.0], [0.0, -1.0, 0.0], [0.0, 0.0, 1.0]]
LAWS = {"uniform": {"kind": "uniform"},
        "projected_normal": {"kind": "projected_normal", "mean": [0.3, 0.2, 0.1],
                             "cov": [[1.0, 0.2, 0.0], [0.2, 0.8, 0.0], [0.0, 0.0, 0.6]]},
        "vmf": {"kind": "vmf", "mu": [0.57735026918962573] * 3, "kappa": 2.0}}
BETAS = {10.0: 0.05, 30.0: 0.05, 1000.0: 0.01, math.inf: 0.01}  # β: dt of the paper's sweeps


def flops_per_pair(d: int) -> int:
    return 4 * d + 6


def _tokens(rng, shape):
    x = rng.standard_normal(shape)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _timed(call, sync, min_seconds=0.5, max_calls=20):
    """Best time of repeated calls (after one warm-up call), at least min_seconds in all."""
    call()
    sync()
    best, spent, calls = math.inf, 0.0, 0
    while calls < 2 or (spent < min_seconds and calls < max_calls):
        start = time.perf_counter()
        call()
        sync()
        elapsed = time.perf_counter() - start
        best, spent, calls = min(best, elapsed), spent + elapsed, calls + 1
    return best


def check(n=2000, d=3, beta=30.0, systems=2):
    """Relative difference of the device sum (fp64, fp32) to the CPU batched kernel."""
    from ..summation import cuda as device
    from ..summation.batched import batched_softmax, log2_masses, source_rows

    rng = np.random.default_rng(0)
    x = _tokens(rng, (systems, n, d))
    masses = np.full(n, 1.0 / n)
    B, V = rng.standard_normal((d, d)), rng.standard_normal((d, d))
    lam, ln_top = log2_masses(masses)
    v_cpu, logz = np.empty(x.shape), np.empty(x.shape[:2])
    batched_softmax(x, source_rows(x), lam, np.ascontiguousarray(B.T), beta, V, v_cpu, logz, ln_top)
    scale = np.abs(v_cpu).max()
    return {p: float(np.abs(device.softmax_on_device(x, masses, B, V, beta, p)[0] - v_cpu).max() / scale)
            for p in ("fp64", "fp32")}


def check_steps(n=500, systems=2, steps=5, dt=0.02):
    """max |x_gpu − x_cpu| after `steps` RK4 steps of the paper's model at β = 30 and β = ∞
    (the device solver against the CPU particle solver, fp64)."""
    from ..models.attention import AttentionModel
    from ..solvers.particles import ParticleSolver

    x = _tokens(np.random.default_rng(4), (systems, n, 3))
    w = np.full(n, 1.0 / n)
    out = {}
    for beta in (30.0, math.inf):
        ends = {}
        for backend in ("cpu", "cuda"):
            solver = ParticleSolver(AttentionModel(PAPER_B, PAPER_V, beta), "rk4", dt, backend=backend)
            ends[backend] = list(solver.snapshots(x, w, [0.0, steps * dt]))[-1][2]
        out[beta] = float(np.abs(ends["cuda"] - ends["cpu"]).max())
    return out


def throughput(sizes, d=3, systems=1, beta=30.0, precisions=("fp64", "fp32"), budget=60.0, min_seconds=0.5):
    """[(precision, d, M, n, seconds per call, pairs/s)], one kernel launch per call; a size is
    skipped once a call of the precision took more than budget / 4 seconds."""
    from ..summation import cuda as device

    cu = device.cuda
    rng = np.random.default_rng(1)
    rows = []
    for precision in precisions:
        slow = False
        for n in sizes:
            if slow:
                break
            x = cu.to_device(_tokens(rng, (systems, n, d)))
            lam = cu.to_device(np.zeros(n))
            eye = cu.to_device(np.eye(d))
            velocity, logz = device.device_arrays((systems, n, d), (systems, n))

            def call(x=x, lam=lam, eye=eye, velocity=velocity, logz=logz, precision=precision):
                device.launch_softmax(x, lam, eye, eye, beta, 0.0, velocity, logz, precision)

            seconds = _timed(call, cu.synchronize, min_seconds)
            rows.append((precision, d, systems, n, seconds, systems * n * n / seconds))
            slow = seconds > budget / 4
    return rows


def ensembles(n=2000, systems=8, t_end=20.0, save_every=0.1, precisions=("fp64", "fp32"), betas=BETAS, laws=LAWS,
              warm=True, deadline=math.inf):
    """{(precision, law, β): (seconds, F-onsets (M,), max alignment with E (M,))}: the paper's
    token ensembles on the device, seeds 1 … M batched (as the sweeps' seeds 1 … 8), each case
    in every precision before the next. warm: the kernels are compiled by untimed short runs
    first. No case starts after `deadline` (time.perf_counter())."""
    from ..analysis.metrics import onset_of
    from ..models.attention import AttentionModel
    from ..runner.build import build_initial_law
    from ..solvers.particles import ParticleSolver, token_systems
    from ..solvers.timeline import save_times

    def solver(beta, dt, precision):
        return ParticleSolver(AttentionModel(PAPER_B, PAPER_V, beta), "rk4", dt, backend="cuda", precision=precision)

    times = save_times(t_end, save_every)
    for precision in precisions if warm else ():  # compile the softmax, hardmax and step kernels
        for beta in (30.0, math.inf):
            list(solver(beta, 0.05, precision).snapshots(_tokens(np.random.default_rng(3), (systems, n, 3)),
                                                          np.full(n, 1.0 / n), [0.0, 0.05]))
    out = {}
    for law_name, spec in laws.items():
        x0, weights = token_systems(build_initial_law(spec), n, systems, 1)
        for beta, dt in betas.items():
            for precision in precisions:
                if time.perf_counter() > deadline:
                    return out
                start = time.perf_counter()
                e, f = [], []
                for _, _, x, _ in solver(beta, dt, precision).snapshots(x0, weights, times):
                    e.append(np.mean(x[..., 0] ** 2, axis=-1))  # alignment with E = span e₁, per system
                    f.append(np.mean(x[..., 1] ** 2, axis=-1))  # with F = span e₂
                seconds = time.perf_counter() - start
                e, f = np.array(e), np.array(f)
                onsets = np.array([onset_of(np.asarray(times), e[:, k], f[:, k]) for k in range(systems)])
                out[(precision, law_name, beta)] = (seconds, onsets, e.max(axis=0))
    return out


def largest_n(sizes, steps=3, dts=(0.01, 0.05), t_end=20.0, beta=30.0, wall=WALL):
    """(measured [(n, seconds per RK4 step)], {dt: n at which t_end/dt steps take `wall`
    seconds}), from t_step = a + b n² fitted to the measured steps (fp64, one system, d = 3)."""
    from ..models.attention import AttentionModel
    from ..solvers.particles import ParticleSolver

    model = AttentionModel(PAPER_B, PAPER_V, beta)
    rng = np.random.default_rng(2)
    measured = []
    for n in sizes:
        solver = ParticleSolver(model, "rk4", 1e-3, backend="cuda")
        x = _tokens(rng, (1, n, 3))
        w = np.full(n, 1.0 / n)
        list(solver.snapshots(x, w, [0.0, 1e-3]))  # compile, allocate
        start = time.perf_counter()
        list(solver.snapshots(x, w, [0.0, steps * 1e-3]))  # `steps` steps, one copy back
        measured.append((n, (time.perf_counter() - start) / steps))
    n_arr = np.array([m[0] for m in measured], dtype=float)
    t_arr = np.array([m[1] for m in measured])
    A = np.stack([np.ones_like(n_arr), n_arr**2], axis=1)
    a, b = np.linalg.lstsq(A, t_arr, rcond=None)[0]
    b = max(b, 1e-30)
    reach = {dt: int(math.sqrt(max(wall / (t_end / dt) - a, 0.0) / b)) for dt in dts}
    return measured, reach


def _device_line():
    from ..summation import cuda as device

    try:
        import numba_cuda

        nc = getattr(numba_cuda, "__version__", "?")
    except ImportError:
        nc = "?"
    import numba

    return (f"device: {device.device_name()}; numba {numba.__version__}, numba-cuda {nc}, numpy {np.__version__}, "
            f"python {platform.python_version()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    smoke = "--smoke" in argv
    from ..summation import cuda as device

    if not device.available():
        print("benchmark_gpu: no GPU visible to numba (numba.cuda.is_available() is false): nothing measured. "
              "Run it on a machine with a CUDA GPU (docs/performance.md#gpu-backend).")
        return 0
    clock = time.perf_counter()
    print(_device_line())
    errors = check(n=40 if smoke else 2000)
    print(f"\ncheck against the CPU batched kernel (n = {40 if smoke else 2000}, d = 3, beta = 30, 2 systems): "
          f"max |v_gpu − v_cpu| / max |v_cpu| = {errors['fp64']:.2e} (fp64), {errors['fp32']:.2e} (fp32)")
    steps = check_steps(n=20 if smoke else 500, steps=1 if smoke else 5)
    print("RK4 steps on the device against the CPU solver (paper matrices, 2 systems): max |x_gpu − x_cpu| = "
          + ", ".join(f"{d:.2e} (beta = {b:g})" for b, d in steps.items()))
    if not (errors["fp64"] <= 1e-12 and max(steps.values()) <= 1e-12):
        print("benchmark_gpu: the device differs from the CPU by more than 1e-12 in fp64: stopping")
        return 1

    sizes = [40] if smoke else [10_000, 30_000, 100_000, 300_000, 1_000_000]
    least = 0.0 if smoke else 0.5  # seconds of repeated calls per size
    rows = throughput(sizes, min_seconds=least)
    rows += throughput([20] if smoke else [100_000], d=16, min_seconds=least)
    rows += throughput([10] if smoke else [2000], systems=8, min_seconds=least)
    print("\n### Fused sum throughput (beta = 30, one launch, best of repeats)\n")
    print("| precision | d | M | n | s per call | pairs/s | FLOP/s at (4d + 6) per pair | of peak |")
    print("|---|---|---|---|---|---|---|---|")
    for precision, d, m, n, seconds, rate in rows:
        flops = rate * flops_per_pair(d)
        print(f"| {precision} | {d} | {m} | {n} | {seconds:.4g} | {rate:.3g} | {flops:.3g} | "
              f"{flops / PEAK[precision]:.1%} |")
    print(f"\npeaks: fp64 {PEAK['fp64'] / 1e12:g} TFLOP/s (no tensor cores), fp32 {PEAK['fp32'] / 1e12:g} TFLOP/s")

    measured, reach = largest_n([20, 40] if smoke else [50_000, 100_000, 200_000],
                                steps=1 if smoke else 3)
    print("\n### Largest n to t = 20 in 10 minutes (one system, fp64, RK4, beta = 30)\n")
    print("| n | s per RK4 step |")
    print("|---|---|")
    for n, seconds in measured:
        print(f"| {n} | {seconds:.4g} |")
    for dt, n in reach.items():
        print(f"\nfit t_step = a + b n²: n = {n:,} runs t = 20 at dt = {dt:g} ({20 / dt:.0f} steps) in {WALL:.0f} s")

    if smoke:
        result = ensembles(n=16, systems=2, t_end=0.1, save_every=0.05, betas={30.0: 0.05, math.inf: 0.05},
                           laws={"vmf": LAWS["vmf"]}, warm=False)
    else:
        result = ensembles(deadline=clock + ENSEMBLE_DEADLINE)
    print("\n### The paper's token ensembles on the device (n = 2000, 8 seeds batched, t <= 20, RK4)\n")
    print("| precision | law | beta | seconds | F-onset per seed | max alignment E (mean) |")
    print("|---|---|---|---|---|---|")
    total = dict.fromkeys(("fp64", "fp32"), 0.0)
    for (precision, law, beta), (seconds, onsets, align) in result.items():
        total[precision] += seconds
        text = " ".join("-" if math.isnan(o) else f"{o:.3f}" for o in onsets)
        print(f"| {precision} | {law} | {beta:g} | {seconds:.1f} | {text} | {np.mean(align):.4f} |")
    cases = [key for key in result if key[0] == "fp64"]
    systems = next(iter(result.values()))[1].size if result else 0
    complete = "" if len(cases) == len(LAWS) * len(BETAS) or smoke else " (stopped at the time budget)"
    print(f"\n{len(cases)} batched runs (= {systems * len(cases)} seeds of the CPU sweeps){complete}: "
          f"{total['fp64']:.1f} s fp64, {total['fp32']:.1f} s fp32 (the 96 seeds as single runs on 2 CPU cores: 23 min, issue 38)")
    pairs = [(result[("fp32", law, beta)][1], result[("fp64", law, beta)][1]) for (_, law, beta) in cases
             if ("fp32", law, beta) in result]
    shifts = np.concatenate([np.abs(a - b) for a, b in pairs] or [np.array([])])
    shifts = shifts[np.isfinite(shifts)]
    if shifts.size:
        print(f"|F-onset fp32 − fp64| over {shifts.size} seeds with an onset in both: largest {shifts.max():.2e}, "
              f"median {np.median(shifts):.2e}")

    print(f"\nbenchmark_gpu: done in {time.perf_counter() - clock:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
