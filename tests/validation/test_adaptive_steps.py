"""The adaptive-steps measurement (spherepde.validation.adaptive_steps) on a small case: its
adaptive rows agree with the fixed-step reference row, and the table shows them."""

from run_helpers import one_numba_thread  # noqa: F401 (autouse: one numba thread)

from spherepde.validation.adaptive_steps import measure, table


def test_adaptive_rows_agree_with_the_reference_row():
    """n = 40 tokens of the vMF law, β = 10, to t = 3: dopri5 at rtol 1e-7 has the max alignment of
    RK4 at dt = 0.01 to 1e-6, with fewer field evaluations; the table has a row per run."""
    rows = measure(n=40, t_end=3.0, seeds=(1,), betas=(10.0,), schemes=("rk4:0.01", "dopri5:1e-7"), laws=("vmf",))
    (_, _, _, _, fixed), (_, _, _, _, adaptive) = rows
    assert abs(adaptive["max_E"] - fixed["max_E"]) < 1e-6
    assert adaptive["evaluations"] < fixed["evaluations"] == 1200
    assert adaptive["steps"] >= 30  # at least one step per save interval (0.1)
    text = table(rows)
    assert text.count("| vmf | 10 | 1 |") == 2 and "dopri5:1e-7" in text
