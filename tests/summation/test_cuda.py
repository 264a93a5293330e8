"""The fused device sums (spherepde.summation.cuda) in numba's CUDA simulator against the CPU:
the long-double numpy reference and the batched kernel, fp64 to 1e-12, fp32 to 1e-5, hardmax
exactly (tests/cuda_simulator.py runs them in a child process: NUMBA_ENABLE_CUDASIM=1 must be
set before numba is imported)."""

import pytest
from cuda_simulator import simulate

from spherepde.summation import cuda as device


@pytest.fixture(scope="module")
def sums():
    return simulate("sums")["cases"]


def test_fp64_sum_equals_the_reference_and_the_batched_kernel(sums):
    """Every case (d = 2, 3, 5, 130; β = 1 … 1000; several tiles, a massless source): v and
    log Z to 1e-12 relative (scaled by β/30 above 30, as the batched kernel's own test)."""
    for case in sums:
        tol = 1e-12 * max(1.0, case["beta"] / 30)
        for key in ("reference", "batched"):
            assert case[key] <= tol, case
        assert case["logz_reference"] <= 1e-12 and case["logz_batched"] <= 1e-12, case


def test_the_cases_cover_several_tiles_and_tiles_narrower_than_a_block(sums):
    """n > THREADS everywhere (several tiles per block), and one case whose tile is narrower
    than a block (d = 130): the loops the kernel has for large d ran."""
    assert all(case["threads"] < 33 for case in sums)
    assert any(case["tile"] < case["threads"] for case in sums)


def test_fp32_sum_within_1e_5(sums):
    for case in sums:
        if "fp32_reference" in case:
            assert case["fp32_reference"] <= 1e-5 and case["fp32_logz"] <= 1e-6, case


def test_hardmax_picks_the_cpu_token(sums):
    for case in sums:
        if "hardmax_batched" in case:
            assert case["hardmax_batched"] == 0.0 and case["hardmax_reference"] <= 1e-14, case


def test_tile_fits_the_shared_memory():
    assert device.tile_size(3) == device.THREADS
    for d in (64, 130, 1024, 4096):
        for precision, size in (("fp64", 8), ("fp32", 4)):
            tile = device.tile_size(d, precision)
            assert 1 <= tile <= device.THREADS and tile * (d + 1) * size <= max(device.SHARED_BYTES, (d + 1) * size)
    assert device.blocks(1000, 7) == (((1000 + device.THREADS - 1) // device.THREADS, 7), device.THREADS)
    assert device.blocks(20, 2048) == ((1, 2048), 32)  # one warp per system of 20 tokens


def test_a_failed_allocation_is_a_one_line_memory_error(monkeypatch):
    """The driver's out-of-memory error becomes DeviceMemoryError (a MemoryError: the CLI's
    one line), any other error passes through."""
    def refuse(shape, dtype):
        raise RuntimeError("[2] Call to cuMemAlloc results in CUDA_ERROR_OUT_OF_MEMORY")

    monkeypatch.setattr(device.cuda, "device_array", refuse)
    with pytest.raises(device.DeviceMemoryError, match="GPU out of memory: the tokens need 16.0 MiB") as info:
        device.device_arrays((1024, 1024, 2))
    assert "\n" not in str(info.value) and isinstance(info.value, MemoryError)

    def broken(shape, dtype):
        raise RuntimeError("something else")

    monkeypatch.setattr(device.cuda, "device_array", broken)
    with pytest.raises(RuntimeError, match="something else"):
        device.device_arrays((3,))
