"""The finite-n study (spherepde.validation.finite_n): its statistics against values computed
another way, the mean-field values read from the committed reports, and a tiny study run end to
end (batched cells cached, reused, resumed; missing cells named in the report)."""

import json
import math

import numpy as np
import pytest

from spherepde.validation import finite_n
from spherepde.validation.ensembles import interval, onset_text


def test_interval_of_a_known_sample():
    """1 … 5: mean 3, s = √2.5, t_{0.975, 4} = 2.7764 (printed tables): half-width 1.9632."""
    iv = interval([1.0, 2.0, 3.0, 4.0, 5.0, math.nan])  # a seed without onset is left out
    assert iv.count == 5 and iv.mean == 3.0
    assert iv.half_width == pytest.approx(2.7764 * math.sqrt(2.5) / math.sqrt(5.0), rel=1e-4)


def test_log_n_fit_recovers_an_exact_slope():
    ns = [500, 1000, 2000, 4000, 8000] * 3
    fit = finite_n.log_n_fit(ns, [9.0 + 0.75 * math.log(n) for n in ns])
    assert fit.slope == pytest.approx(0.75, abs=1e-12)
    assert fit.intercept == pytest.approx(9.0, abs=1e-10)
    assert fit.half_width == pytest.approx(0.0, abs=1e-9)
    assert (fit.points, fit.ns) == (15, 5)


def test_log_n_fit_matches_linregress_on_noisy_data_and_covers_the_true_slope():
    """Slope and 95 % half-width against scipy.stats.linregress (a second method); over 400
    synthetic studies (8 seeds at 5 n, noise σ = 1, true slope −0.4) the interval covers the true
    slope in 95 % ± 3.3 % (3 binomial standard deviations) of them."""
    from scipy import stats

    rng = np.random.default_rng(7)
    ns = np.repeat([500, 1000, 2000, 4000, 8000], 8)
    covered = 0
    for k in range(400):
        y = 11.0 - 0.4 * np.log(ns) + rng.normal(0.0, 1.0, ns.size)
        y[k % ns.size] = np.nan  # one seed without an onset: left out
        fit = finite_n.log_n_fit(ns, y)
        keep = np.isfinite(y)
        ref = stats.linregress(np.log(ns[keep]), y[keep])
        if k < 5:
            assert fit.slope == pytest.approx(ref.slope, rel=1e-12)
            assert fit.half_width == pytest.approx(stats.t.ppf(0.975, keep.sum() - 2) * ref.stderr, rel=1e-10)
            assert fit.points == ns.size - 1
        covered += abs(fit.slope + 0.4) <= fit.half_width
    assert abs(covered / 400 - 0.95) < 3 * math.sqrt(0.95 * 0.05 / 400)


def test_log_n_fit_needs_two_n():
    fit = finite_n.log_n_fit([1000] * 4, [1.0, 2.0, 3.0, 4.0])
    assert math.isnan(fit.slope) and fit.ns == 1


def test_mean_field_values_come_from_the_finest_mesh_of_the_committed_reports(tmp_path):
    """The atoms report's table (particles first, 3 meshes, 2 at β = 30) and the paper report's
    (Eulerian first); '—' is no value; a case the first report lacks comes from the second."""
    atoms = tmp_path / "atoms.md"
    atoms.write_text(
        "| law | β | quantity | particles (nside 16 / 32 / 64) | differences | order | Eulerian + atoms | differences "
        "| order | Eulerian − particles, finest |\n|---|---|---|---|---|---|---|---|---|---|\n"
        "| vmf | 10 | F-onset | 6.1 / 6.2 / 6.3 | x | x | 5.9 / 6.0 / 6.05 | x | x | +0.1 |\n"
        "| vmf | 30 | F-onset | 9.7 / 7.5 | x | x | 13.5 / 11.1 | x | x | +3.6 |\n")
    paper = tmp_path / "report.md"
    paper.write_text(
        "| law | β | quantity | Eulerian + atoms (nside 8 / 16) | differences | order | quadrature particles "
        "(nside 8 / 16) | differences | order | tokens, mean ± 95 % (n; seeds) |\n|---|---|---|---|---|---|---|---|---|---|\n"
        "| vmf | 1000 | F-onset | — / — | — | — | 17.5 / 17.1 | x | — | 12.0 ± 0.6 (8 of 8) |\n"
        "| vmf | 1000 | max alignment with E | 0.99 / 0.98 | x | — | 0.97 / 0.96 | x | — | 0.999 |\n")
    reports = (atoms, paper)
    got = finite_n.mean_field_values("vmf", 10.0, reports)["onset"]
    assert [(label, value) for label, value, _ in got] == [("quadrature particles, nside 64", 6.3),
                                                          ("Eulerian + atoms, nside 64", 6.05)]
    got = finite_n.mean_field_values("vmf", 30.0, reports)["onset"]
    assert [(label, value) for label, value, _ in got] == [("quadrature particles, nside 32", 7.5),
                                                          ("Eulerian + atoms, nside 32", 11.1)]
    got = finite_n.mean_field_values("vmf", 1000.0, reports)
    assert [(label, value) for label, value, _ in got["onset"]] == [("Eulerian + atoms, nside 16", None),
                                                                   ("quadrature particles, nside 16", 17.1)]
    assert got["max_E"][1][1] == 0.96 and got["onset"][1][2] == paper
    assert finite_n.mean_field_values("projected_normal", 10.0, reports) == {q: [] for q in finite_n.QUANTITIES}


def test_the_committed_reports_hold_every_mean_field_case():
    for law in finite_n.LAWS:
        for beta in finite_n.BETAS:
            onsets = finite_n.mean_field_values(law, beta)["onset"]
            assert any("particles" in label and value is not None for label, value, _ in onsets), (law, beta)


def test_a_tiny_study_runs_caches_resumes_and_reports(tmp_path, monkeypatch):
    """Two n at β = 10, 3 systems, t ≤ 7: the report's rows are the ensembles' statistics of each
    system's metrics; each system is the single-system run of its seed; a second call reuses the
    files; an interrupted file is resumed; a cell never run is named as missing."""
    from spherepde.analysis.metrics import f_phase_onset, max_alignment
    from spherepde.runner.run import execute

    monkeypatch.setitem(finite_n.T_END, 10.0, 7.0)
    cache = tmp_path / "runs"
    report = finite_n.run_suite(tmp_path / "out", cache=cache, ns=[40, 80], betas=[10.0], systems=3, progress=False)
    text = report.read_text()
    assert (tmp_path / "out" / "onset_vs_n.png").stat().st_size > 10_000
    cell = finite_n.Cell("vmf", 10.0, 40)
    m = finite_n.cell_metrics(finite_n.cell_path(cache, cell))
    assert m["state"] == "complete" and len(m["onset"]) == 3
    assert f"| 40 | {onset_text(m['onset'])} |" in text
    assert "missing" not in text

    # system 2 of the batched run is the single-system run of seed 3
    config = finite_n.cell_config(cell, systems=1)
    config["particles"]["seed"] = 3
    execute(config, tmp_path / "one.nc", progress=False, log=None)
    from spherepde.storage.runfile import open_run

    one = open_run(tmp_path / "one.nc")
    assert f_phase_onset(one, "particle_") == pytest.approx(m["onset"][2], abs=1e-6, nan_ok=True)
    assert max_alignment(one, "particle_")[0] == pytest.approx(m["max_E"][2], abs=1e-9)

    # reused: no file is rewritten
    stamps = {p: p.stat().st_mtime_ns for p in cache.iterdir()}
    spent = finite_n.run_cells(cache, finite_n.cells(finite_n.LAWS, [10.0], [40, 80]), systems=3, say=lambda s: None)
    assert set(spent.values()) == {None}
    assert {p: p.stat().st_mtime_ns for p in cache.iterdir()} == stamps

    # interrupted after 20 snapshots, then continued to the same metrics
    other = finite_n.Cell("projected_normal", 10.0, 80)
    path = finite_n.cell_path(cache, other)
    before = finite_n.cell_metrics(path)
    path.unlink()

    class Interrupt:
        lines = 0

        def write(self, text):
            Interrupt.lines += text.count("\n")
            if Interrupt.lines >= 20:
                raise KeyboardInterrupt

        def flush(self):
            pass

    with pytest.raises(KeyboardInterrupt):
        execute(finite_n.cell_config(other, systems=3), path, progress=False, log=None, snapshot_log=Interrupt())
    assert finite_n.cell_metrics(path)["state"] == "partial"
    spent = finite_n.run_cells(cache, [other], systems=3, say=lambda s: None)
    assert spent[other] is not None
    after = finite_n.cell_metrics(path)
    assert after["state"] == "complete"
    for key in ("onset", "max_E", "w2_min"):
        np.testing.assert_allclose(after[key], before[key], rtol=0, atol=1e-12)

    # a budget of 0 s starts nothing: the new cell is reported missing
    report = finite_n.run_suite(tmp_path / "out", cache=cache, ns=[40, 80, 160], betas=[10.0], systems=3,
                                budget_s=0.0, progress=False)
    assert "- vmf, β = 10, n = 160: missing" in report.read_text()
    assert not finite_n.cell_path(cache, finite_n.Cell("vmf", 10.0, 160)).exists()


def test_registered_but_not_in_a_bare_validate():
    """`spherepde validate finite_n` runs it; a bare `spherepde validate` does not (hours long)."""
    from spherepde.validation.suites import DEFAULT, SUITES

    assert SUITES["finite_n"].report == "finite_n.md" and "quick" in SUITES["finite_n"].options
    assert "finite_n" not in DEFAULT


def test_cell_summary_round_trip_keeps_missing_onsets_and_refuses_another_config(tmp_path):
    cell = finite_n.Cell("vmf", 30.0, 500)
    metrics = {"state": "complete", "wall": 12.0, "evaluations": 2000, "t_reached": 20.0,
               "onset": [7.5, math.nan], "max_E": [0.97, 0.98], "w2_min": [0.2, 0.25]}
    path = finite_n.write_summary(tmp_path, cell, metrics)
    assert "NaN" not in path.read_text()  # plain JSON: a seed without an onset is null
    got = finite_n.read_summary(tmp_path, cell)
    assert got["onset"][0] == 7.5 and math.isnan(got["onset"][1]) and got["max_E"] == [0.97, 0.98]
    assert finite_n.read_summary(tmp_path, cell, systems=4) is None  # another config: run again
    stored = json.loads(path.read_text())  # a key added since (at the value it implies) still agrees
    del stored["config"]["eulerian"]["tail_follow"]
    path.write_text(json.dumps(stored))
    assert finite_n.read_summary(tmp_path, cell)["max_E"] == [0.97, 0.98]
    assert finite_n.read_summary(tmp_path, finite_n.Cell("vmf", 30.0, 1000)) is None


def test_the_tails_mean_field_is_the_finest_mesh_kept(tmp_path):
    """The tails report's cached runs: the finest nside kept for the law and β, its F-onset and
    max alignment with E as hybrid_summary gives them, first in the list; none for another β; the
    runs with the solver's defaults before the others."""
    import json

    from spherepde.validation import tails
    from spherepde.validation.tails import hybrid_key, hybrid_summary

    times = np.round(np.arange(0.0, 20.01, 0.2), 12)
    rows = [{"t": float(t), "E": float(np.exp(-((t - 4.0) / 6.0) ** 2)), "F": float(1 / (1 + np.exp(-(t - 11.0)))),
             "x2": float(min(1.0, t / 20)), "share": 0.0, "min_f": 1e-9, "tail_cells": 0} for t in times]
    for nside, shift in ((16, 0.0), (32, 0.4)):
        shifted = [dict(r, F=float(1 / (1 + np.exp(-(r["t"] - 11.0 - shift))))) for r in rows]
        key = hybrid_key(tmp_path, nside, 30.0, "tails from log f, coupling every 0.2 (saves every 0.2)",
                         "von Mises–Fisher")
        key.write_text(json.dumps({"rows": shifted, "wall": 1.0}))
    got = finite_n.mean_field_values("vmf", 30.0, reports=(), tails_cache=tmp_path)
    expected = hybrid_summary([dict(r, F=float(1 / (1 + np.exp(-(r["t"] - 11.4))))) for r in rows])
    assert got["onset"] == [("Eulerian + tails from log f (point atoms), nside 32, t ≤ 20", expected["onset"], tmp_path)]
    assert got["max_E"][0][1] == expected["e_max"] and np.isfinite(expected["onset"])
    assert finite_n.mean_field_values("vmf", 10.0, reports=(), tails_cache=tmp_path)["onset"] == []
    # the defaults' runs (sigma atoms, tail cut) come first, even on a coarser mesh; an unfinished
    # one only where its onset is past
    sigma = hybrid_key(tmp_path, 16, 30.0, tails.RUN_FILE_SIGMA, "von Mises–Fisher")
    sigma.write_text(json.dumps({"rows": rows, "wall": 1.0}))
    unfinished = hybrid_key(tmp_path, 64, 30.0, tails.RUN_FILE_SIGMA, "von Mises–Fisher")
    unfinished.write_text(json.dumps({"rows": rows[:50], "wall": 1.0, "partial": True}))  # to t = 9.8, before 11
    got = finite_n.mean_field_values("vmf", 30.0, reports=(), tails_cache=tmp_path)
    assert got["onset"] == [("Eulerian + tails from log f (sigma atoms, tail cut), nside 16, t ≤ 20",
                             hybrid_summary(rows)["onset"], tmp_path)]
