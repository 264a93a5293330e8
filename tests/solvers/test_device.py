"""Tokens on the GPU (spherepde.solvers.device) in numba's CUDA simulator: Euler and RK4 steps
equal the CPU particle solver's to 1e-12, for one head, an unnormalised head, two heads (one
hardmax), two layers and one (n, d) system; a resumed device run equals the uninterrupted one
bitwise. And which backend a run gets (backend_for), without a GPU."""

import numpy as np
import pytest
from cuda_simulator import simulate

from spherepde.models.attention import AttentionModel
from spherepde.models.noise import NoiseSchedule
from spherepde.solvers import device
from spherepde.solvers.particles import ParticleSolver
from spherepde.summation import cuda as device_sums


@pytest.fixture(scope="module")
def steps():
    return simulate("steps")


@pytest.mark.parametrize("case", ["softmax/rk4", "softmax/euler", "unnormalised/euler", "heads/rk4", "layers/rk4"])
def test_device_steps_equal_the_cpu_solver(steps, case):
    """Positions at every snapshot to 1e-12 (the tokens moved by > 1e-2, so the steps were
    taken), with the same number of field evaluations."""
    result = steps[case]
    assert result["backend"] == "cuda"
    assert result["moved"] > 1e-2
    assert result["difference"] <= 1e-12, result
    assert result["evaluations"][0] == result["evaluations"][1] > 0


def test_one_system_keeps_its_shape(steps):
    assert steps["one system"]["shape"] == [3, 16, 4]
    assert steps["one system"]["difference"] <= 1e-12


def test_a_resumed_device_run_is_bitwise_the_uninterrupted_one(steps):
    assert steps["resume"] == {"bitwise": True, "snapshots": 1}


def test_backend_choice(monkeypatch):
    """auto takes the GPU only when one is seen and the run can use it; cuda refuses otherwise."""
    monkeypatch.setattr(device_sums, "available", lambda: False)
    assert device.backend_for("cpu") == "cpu" and device.backend_for("auto") == "cpu"
    with pytest.raises(ValueError, match="no GPU is visible"):
        device.backend_for("cuda")
    monkeypatch.setattr(device_sums, "available", lambda: True)
    assert device.backend_for("auto") == "cuda" and device.backend_for("cuda") == "cuda"
    problem = device.device_problem(noise=True)
    assert device.backend_for("auto", problem) == "cpu"
    with pytest.raises(ValueError, match="noise is not on the GPU"):
        device.backend_for("cuda", problem)
    assert device.device_problem() is None
    assert "scheme 'rk45' is not on the GPU" in device.device_problem(scheme="rk45")
    assert device.backend_for("auto", device.device_problem(scheme="rk45")) == "cpu"
    with pytest.raises(ValueError, match="backend must be one of"):
        device.backend_for("gpu")


def test_the_solver_refuses_what_the_device_does_not_run(monkeypatch):
    monkeypatch.setattr(device_sums, "available", lambda: True)
    model = AttentionModel(np.eye(3), np.eye(3), 5.0)
    assert ParticleSolver(model, backend="auto").backend == "cuda"
    assert ParticleSolver(model, backend="auto", noise=NoiseSchedule(0.1)).backend == "cpu"
    with pytest.raises(ValueError, match="noise"):
        ParticleSolver(model, backend="cuda", noise=NoiseSchedule(0.1))
    with pytest.raises(ValueError, match="carried densities"):
        ParticleSolver(model, backend="cuda", carry_density=True)
    with pytest.raises(ValueError, match="local beta = inf"):
        ParticleSolver(AttentionModel(np.eye(3), np.eye(3), np.inf), backend="cuda", hardmax=False)
