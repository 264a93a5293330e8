"""The prepared GPU benchmark (spherepde.validation.benchmark_gpu): without a GPU it says so and
exits 0; every part runs on tiny sizes in numba's CUDA simulator (--smoke, a child process);
its F-onset is spherepde.analysis.metrics.f_phase_onset's."""

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import xarray as xr
from cuda_simulator import ROOT, TESTS

from spherepde.analysis.metrics import f_phase_onset, onset_of
from spherepde.summation import cuda as device_sums
from spherepde.validation import benchmark_gpu


def test_without_a_gpu_it_says_so_and_exits_0(monkeypatch, capsys):
    monkeypatch.setattr(device_sums, "available", lambda: False)
    assert benchmark_gpu.main([]) == 0
    out = capsys.readouterr().out
    assert "no GPU visible" in out and len(out.strip().splitlines()) == 1


def test_smoke_run_in_the_simulator():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]))
    proc = subprocess.run([sys.executable, "-m", "spherepde.validation.benchmark_gpu", "--smoke"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "device: numba CUDA simulator" in out
    for heading in ("Fused sum throughput", "token ensembles", "Largest n"):
        assert heading in out
    # 2 precisions × (1 + 1 + 1 sizes) throughput rows, 2 precisions × 2 β ensemble rows
    assert out.count("| fp64 |") == 3 + 2 and out.count("| fp32 |") == 3 + 2
    assert "benchmark_gpu: done" in out


def test_onset_is_the_metrics_onset():
    """The array form of the F-onset the benchmark uses (metrics.onset_of) against f_phase_onset on
    a Dataset, for curves with an onset between save times, at the maximum, and none; and against
    a crossing known exactly."""
    t = np.linspace(0.0, 10.0, 41)
    cases = [(1 - np.exp(-t), 0.2 + 0.1 * t),
             (np.where(t < 3, t / 3, 1.0), np.where(t < 3, 0.0, 2.0)),
             (np.ones_like(t), np.zeros_like(t))]
    for e, f in cases:
        ds = xr.Dataset({"alignment_E": ("time", e), "alignment_F": ("time", f)}, coords={"time": t})
        expected = f_phase_onset(ds)
        got = onset_of(t, e, f)
        assert (math.isnan(expected) and math.isnan(got)) or got == expected
    # piecewise linear: E = 1 until t = 2, then 1 − 0.1(t − 2); F = 0.1 t: they cross at t = 6
    assert onset_of(t, np.minimum(1.0, 1.0 - 0.1 * (t - 2.0)), 0.1 * t) == pytest.approx(6.0, abs=1e-12)
    t_off = t + 0.1  # the crossing between two save times: linear interpolation finds it exactly
    assert onset_of(t_off, np.minimum(1.0, 1.0 - 0.1 * (t_off - 2.0)), 0.1 * t_off) == pytest.approx(6.0, abs=1e-12)
    assert benchmark_gpu.flops_per_pair(3) == 18
