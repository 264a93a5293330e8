"""The CUDA kernels of spherepde run in numba's CUDA simulator, for the tests without a GPU.

NUMBA_ENABLE_CUDASIM must be set before numba is first imported, so the checks run in a child
process: `python tests/cuda_simulator.py CHECK` (CHECK: sums, steps, run) prints one JSON object
of measured differences against the CPU, and the tests (tests/summation/test_cuda.py,
tests/solvers/test_device.py, tests/runner/test_backend.py) assert on them. simulate(check)
starts that process. Small n only: the simulator runs a Python thread per GPU thread.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def simulate(check, *args, timeout=300):
    """Run one check in a child process under the CUDA simulator; its JSON result."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", HDF5_USE_FILE_LOCKING="FALSE",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(TESTS / "cuda_simulator.py"), check, *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def relative(a, b):
    """max |a − b| / max |b|."""
    import numpy as np

    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    return float(np.abs(a - b).max() / np.abs(b).max())


def tokens(rng, shape):
    import numpy as np

    x = rng.standard_normal(shape)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def check_sums():
    """The device softmax and hardmax against the long-double numpy reference and the CPU
    batched kernel, fp64 and fp32, several tiles per block (n > THREADS = 32 here), a partial
    last block and tile, a source without mass, and a d large enough for tiles < THREADS."""
    import numpy as np
    import numpy_reference as ref

    from spherepde.summation import cuda as device
    from spherepde.summation.batched import batched_hardmax, batched_softmax, log2_masses, source_rows

    rng = np.random.default_rng(38)
    cases = []
    # d = 130: tiles of 31 sources (< THREADS), the slow case in the simulator: fp64 softmax only
    for d, beta, systems, n in [(2, 1.0, 2, 40), (3, 30.0, 3, 37), (5, 1000.0, 2, 40), (130, 4.0, 1, 33)]:
        x = tokens(rng, (systems, n, d))
        masses = rng.random(n)
        masses[5] = 0.0
        B = rng.standard_normal((d, d)) / np.sqrt(d)
        V = rng.standard_normal((d, d)) / np.sqrt(d)
        v, logz = device.softmax_on_device(x, masses, B, V, beta)
        v_ref, logz_ref = ref.batched_softmax(x, masses, B, V, beta)
        lam, ln_top = log2_masses(masses)
        v_cpu, logz_cpu = np.empty(x.shape), np.empty(x.shape[:2])
        batched_softmax(x, source_rows(x), lam, np.ascontiguousarray(B.T), beta, V, v_cpu, logz_cpu, ln_top)
        case = {"d": d, "beta": beta, "tile": device.tile_size(d), "threads": device.THREADS,
                "reference": relative(v, v_ref), "batched": relative(v, v_cpu),
                "logz_reference": relative(logz, logz_ref), "logz_batched": relative(logz, logz_cpu)}
        if d < 100:
            v32, logz32 = device.softmax_on_device(x, masses, B, V, beta, precision="fp32")
            h = device.hardmax_on_device(x, masses, B, V)
            h_cpu = np.empty(x.shape)
            batched_hardmax(x, source_rows(x), lam, np.ascontiguousarray(B.T), V, h_cpu)
            case.update({"fp32_reference": relative(v32, v_ref), "fp32_logz": relative(logz32, logz_ref),
                         "hardmax_reference": float(np.abs(h - ref.batched_hardmax(x, masses, B, V)).max()),
                         "hardmax_batched": float(np.abs(h - h_cpu).max())})
        cases.append(case)
    return {"cases": cases}


def _paths(solver_args, x, weights, times, backend, **kw):
    import numpy as np

    from spherepde.solvers.particles import ParticleSolver

    solver = ParticleSolver(*solver_args, backend=backend, **kw)
    out = [np.array(p) for _, _, p, _ in solver.snapshots(x, weights, times)]
    return np.array(out), solver


def check_steps():
    """Euler and RK4 steps of the device solver against the CPU particle solver: one head (RK4
    and Euler), an unnormalised head, two heads (one at β = ∞: hardmax), two layers, one system
    (n, d); and a run resumed from a snapshot on the device against the uninterrupted one."""
    import numpy as np

    from spherepde.models.attention import AttentionModel
    from spherepde.models.heads import MultiHeadModel
    from spherepde.models.schedule import Schedule
    from spherepde.solvers.particles import ParticleSolver

    rng = np.random.default_rng(3)
    d, n = 4, 16
    B, V = rng.standard_normal((d, d)) / 2, rng.standard_normal((d, d)) / 2
    B2, V2 = rng.standard_normal((d, d)) / 2, rng.standard_normal((d, d)) / 2
    x = tokens(rng, (2, n, d))
    weights = rng.random(n) + 0.5
    times = [0.0, 0.03, 0.05]  # dt 0.02: steps 0.02, 0.01 (shortened to land on 0.03), 0.02
    cases = {"softmax/rk4": (AttentionModel(B, V, 8.0), "rk4"),
             "softmax/euler": (AttentionModel(B, V, 8.0), "euler"),
             "unnormalised/euler": (AttentionModel(B, V, 1.0, normalisation="unnormalised"), "euler"),
             "heads/rk4": (MultiHeadModel((AttentionModel(B, V, 8.0), AttentionModel(B2, V2, np.inf))), "rk4"),
             "layers/rk4": (Schedule([0.0, 0.02], [AttentionModel(B, V, 8.0), AttentionModel(B2, V2, 30.0)]), "rk4")}
    result = {}
    for name, (model, scheme) in cases.items():
        gpu, solver = _paths((model, scheme, 0.02), x, weights, times, "cuda")
        cpu, reference = _paths((model, scheme, 0.02), x, weights, times, "cpu")
        result[name] = {"difference": float(np.abs(gpu - cpu).max()), "moved": float(np.abs(cpu[-1] - cpu[0]).max()),
                        "backend": solver.backend, "evaluations": [solver.evaluations, reference.evaluations]}
    model = cases["softmax/rk4"][0]
    gpu, _ = _paths((model, "rk4", 0.02), x[0], weights, times, "cuda")
    cpu, _ = _paths((model, "rk4", 0.02), x[0], weights, times, "cpu")
    result["one system"] = {"difference": float(np.abs(gpu - cpu).max()), "shape": list(gpu.shape)}
    full, _ = _paths((model, "rk4", 0.02), x, weights, times, "cuda")
    resumed = [p for _, _, p, _ in ParticleSolver(model, "rk4", 0.02, backend="cuda").snapshots(
        full[1], weights, times, resume_from=1)]
    result["resume"] = {"bitwise": bool(np.array_equal(resumed[-1], full[-1])), "snapshots": len(resumed)}
    return result


def check_run(config, out, *extra):
    """`spherepde run CONFIG --set particles.backend="cuda" -o OUT` in the simulator (the CLI
    in this process), or with extra arguments (e.g. --resume) instead of the --set; its exit
    status."""
    from spherepde.cli import main

    args = list(extra) or ["--set", 'particles.backend="cuda"']
    return {"status": main(["run", config, "-o", out, *args])}


if __name__ == "__main__":
    if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        sys.exit("tests/cuda_simulator.py: run with NUMBA_ENABLE_CUDASIM=1 (simulate() sets it)")
    check = {"sums": check_sums, "steps": check_steps, "run": check_run}[sys.argv[1]]
    print(json.dumps(check(*sys.argv[2:])))
