"""[particles] backend: bad values and "cuda" without a GPU exit 2 with one line naming the key
and write nothing; "auto" without a GPU runs on the CPU and the file says so; a GPU out of
memory is one line, exit 3, nothing written; old files without the key still resume; and a
`spherepde run` on the GPU (numba's CUDA simulator, in a child process) equals the CPU run."""

import numpy as np
import pytest
from cuda_simulator import simulate
from run_helpers import interrupt_after, relative_difference

from spherepde.cli import main
from spherepde.runner.config import ADDED_KEYS, difference, resolve
from spherepde.solvers.particles import ParticleSolver
from spherepde.storage.runfile import open_run
from spherepde.summation import cuda as device_sums

TOKENS = """
[model]
beta = 10.0
dimension = 4
B = "gaussian"
V = "gaussian"

[eulerian]
enabled = false

[particles]
n = 20
systems = 2
dt = 0.02
{extra}

[time]
t_end = 0.06
save_every = 0.03
"""


def write(tmp_path, extra=""):
    path = tmp_path / "tokens.toml"
    path.write_text(TOKENS.format(extra=extra))
    return path


def run_cli(tmp_path, capsys, extra, *args):
    out = tmp_path / "out.nc"
    status = main(["run", str(write(tmp_path, extra)), "-o", str(out), *args])
    return status, capsys.readouterr().err, out


@pytest.mark.parametrize("extra, gpu, words", [
    ('backend = "gpu"', False, ["[particles] backend", "must be one of 'auto', 'cpu', 'cuda'"]),
    ("backend = 1", False, ["[particles] backend", "must be one of"]),
    ('backend = "cuda"', False, ["[particles] backend", "no GPU is visible"]),
    ('backend = "cuda"', True, ["[particles] backend", "noise is not on the GPU"]),
    ('precision = "fp16"', True, ["[particles] precision", "must be one of 'fp64', 'fp32'"]),
    ('precision = "fp32"', True, ["[particles] precision", 'needs backend = "cuda"', 'got backend = "auto"']),
])
def test_bad_backend_exits_2_with_one_line_and_no_file(tmp_path, capsys, monkeypatch, extra, gpu, words):
    monkeypatch.setattr(device_sums, "available", lambda: gpu)
    args = ["--set", "model.noise=0.1"] if "noise" in words[-1] else []
    status, err, out = run_cli(tmp_path, capsys, extra, *args)
    assert status == 2 and len(err.strip().splitlines()) == 1, err
    assert all(w in err for w in words), err
    assert not out.exists()


def test_quadrature_particles_refuse_cuda(monkeypatch):
    monkeypatch.setattr(device_sums, "available", lambda: True)
    config = {"model": {"beta": 10.0, "B": "identity", "V": "identity"}, "time": {"t_end": 1.0, "save_every": 0.5},
              "particles": {"mode": "quadrature", "backend": "cuda"}}
    with pytest.raises(ValueError, match=r"\[particles\] backend: .*carried densities"):
        resolve(config)


def test_gpu_out_of_memory_is_one_line_exit_3_no_file(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(device_sums, "available", lambda: True)

    def no_room(self, shape, weights):
        raise device_sums.DeviceMemoryError("GPU out of memory: the tokens need 9.0 MiB on a test GPU (CudaAPIError)")

    monkeypatch.setattr(ParticleSolver, "reserve_device", no_room)
    status, err, out = run_cli(tmp_path, capsys, 'backend = "cuda"')
    assert status == 3 and len(err.strip().splitlines()) == 1 and "GPU out of memory" in err, err
    assert not out.exists()


def test_auto_without_a_gpu_runs_on_the_cpu_and_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(device_sums, "available", lambda: False)
    status, err, out = run_cli(tmp_path, capsys, "")
    assert status == 0, err
    ds = open_run(out)
    assert ds.attrs["particle_backend"] == "cpu" and "particle_device" not in ds.attrs
    assert '"backend": "auto"' in ds.attrs["config"] and '"precision": "fp64"' in ds.attrs["config"]


def test_fp32_on_the_gpu_resolves_and_reaches_the_solver(tmp_path, monkeypatch):
    """precision = "fp32" with backend = "cuda": the resolved config keeps it and the run's
    particle solver sums in fp32 (its arrays are not allocated here: no GPU)."""
    from spherepde.runner.config import load
    from spherepde.runner.run import build_run

    monkeypatch.setattr(device_sums, "available", lambda: True)
    monkeypatch.setattr(ParticleSolver, "reserve_device", lambda self, shape, weights: None)
    monkeypatch.setattr(ParticleSolver, "device_name", "a test GPU")
    config = resolve(load(write(tmp_path, 'backend = "cuda"\nprecision = "fp32"')))
    assert (config["particles"]["backend"], config["particles"]["precision"]) == ("cuda", "fp32")
    setup = build_run(config)
    assert setup.particles.solver.precision == "fp32"
    assert setup.attrs["particle_backend"] == "cuda" and setup.attrs["particle_device"] == "a test GPU"
    assert "fp32" in setup.attrs["particle_summation"]


def test_files_without_the_key_still_resume(tmp_path):
    """A config stored before the key existed agrees with today's default (ADDED_KEYS)."""
    config = resolve({"model": {"beta": 10.0, "B": "identity", "V": "identity"},
                      "time": {"t_end": 1.0, "save_every": 0.5}, "eulerian": {"enabled": False},
                      "particles": {"n": 10}})
    assert config["particles"]["backend"] == "auto" and ADDED_KEYS[("particles", "backend")] == "auto"
    old = {**config, "particles": {k: v for k, v in config["particles"].items() if k not in ("backend", "precision")}}
    assert difference(old, config) is None
    changed = {**config, "particles": {**config["particles"], "backend": "cpu"}}
    assert "[particles] backend" in difference(changed, config)


def test_a_run_on_the_gpu_equals_the_cpu_run(tmp_path, capsys, monkeypatch):
    """The same config through the CLI on the CPU (here) and on the GPU (the simulator, in a
    child process): positions and per-system diagnostics to 1e-12, the backend recorded."""
    monkeypatch.setattr(device_sums, "available", lambda: False)
    config = write(tmp_path)
    cpu, gpu = tmp_path / "cpu.nc", tmp_path / "gpu.nc"
    assert main(["run", str(config), "-o", str(cpu)]) == 0
    assert simulate("run", config, gpu) == {"status": 0}
    a, b = open_run(gpu), open_run(cpu)
    assert a.attrs["particle_backend"] == "cuda" and b.attrs["particle_backend"] == "cpu"
    assert a.attrs["particle_device"] == "numba CUDA simulator"
    assert "spherepde.summation.cuda" in a.attrs["particle_summation"]
    assert a.attrs["particle_field_evaluations"] == b.attrs["particle_field_evaluations"] == 16  # 2 steps per save interval
    assert a.positions.shape == b.positions.shape == (3, 2, 20, 4)
    assert np.abs(a.positions.values[-1] - a.positions.values[0]).max() > 1e-3
    for name in b.data_vars:
        if name not in ("snapshot_digest",) and np.issubdtype(b[name].dtype, np.floating):
            assert relative_difference(a[name].values, b[name].values) <= 1e-12, name


def test_a_cpu_run_resumed_on_the_gpu_says_so_and_agrees(tmp_path, capsys, monkeypatch):
    """backend = "auto": a run interrupted on a machine without a GPU and resumed where numba
    sees one (the simulator) continues on the GPU; the history says so, and the file equals
    the uninterrupted CPU run to 1e-12."""
    monkeypatch.setattr(device_sums, "available", lambda: False)
    config = write(tmp_path)
    full, cut = tmp_path / "full.nc", tmp_path / "cut.nc"
    assert main(["run", str(config), "-o", str(full)]) == 0
    interrupt_after(config, cut, 2)
    assert simulate("run", config, cut, "--resume") == {"status": 0}
    a, b = open_run(cut), open_run(full)
    assert "resumed from snapshot 1" in a.attrs["history"]
    assert "on the cuda backend (particle_backend = 'cpu' before)" in a.attrs["history"]
    assert a.attrs["particle_backend"] == "cpu"  # the attribute of the run's start
    assert relative_difference(a.positions.values, b.positions.values) <= 1e-12
