"""The paper reproduction (spherepde/validation/paper.py, solvers/paper_*.toml, data/ablation_matrices.toml,
data/paper_table.csv): metric extraction on synthetic time series with known answers, the
ablation spectra against the issue's statement, the sweep files, the CLI wiring."""

import csv
import math
import tomllib
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
from scipy import stats

from spherepde.models.attention import AttentionModel
from spherepde.validation import paper

ROOT = Path(__file__).resolve().parents[2]
SQ2, SQ3 = math.sqrt(2), math.sqrt(3)
PAPER_V = np.diag([-1.0, 1.0, -2.0])
PAPER_B = np.diag([-1.0, -1.0, 1.0])


def _ds(t, prefix="", kind=None, **series):
    data = {prefix + k: ("time", np.asarray(v, dtype=float)) for k, v in series.items()}
    if kind is not None:
        data["snapshot_kind"] = ("time", np.asarray(kind))
    return xr.Dataset(data, coords={"time": np.asarray(t, dtype=float)})


# ------------------------------------------------------------------ metrics
def test_max_alignment_and_onset_of_piecewise_linear_series():
    """E rises linearly to 0.8 at t = 3 then falls with slope −0.1; F is flat at 0.1 until t = 3
    then rises with slope 0.1: F = E where 0.8 − 0.1(t − 3) = 0.1 + 0.1(t − 3), i.e. t = 6.5,
    between the save times 6.4 and 6.6 (linear pieces: the interpolated zero is exact)."""
    t = np.arange(0, 10.01, 0.2)
    e = np.where(t <= 3, 0.2 + 0.2 * t, 0.8 - 0.1 * (t - 3))
    f = np.where(t <= 3, 0.1, 0.1 + 0.1 * (t - 3))
    ds = _ds(t, alignment_E=e, alignment_F=f)
    value, when = paper.max_alignment(ds)
    assert value == pytest.approx(0.8) and when == pytest.approx(3.0)
    assert paper.f_phase_onset(ds) == pytest.approx(6.5, abs=1e-9)


def test_onset_counts_only_after_the_maximum_of_e():
    """F above E at the start (a law tilted towards F) is not the F-phase: the onset is the
    crossing after E's maximum; none when F never overtakes E again; tokens by prefix."""
    t = np.linspace(0, 10, 101)
    e = 1 - 0.7 * np.exp(-t)                      # 0.3 → 1, maximum at the end
    f = 0.6 * np.exp(-t)                          # 0.6 → 0: above E for t < log(13/10)... then below
    ds = _ds(t, prefix="particle_", alignment_E=e, alignment_F=f)
    assert f[0] > e[0]
    assert math.isnan(paper.f_phase_onset(ds, prefix="particle_"))
    # a late crossing at t = 8 exactly (a save time): E drops, F rises linearly after t = 5
    e2 = np.where(t <= 5, e, e[50] - (e[50] - 0.5) * (t - 5) / 3)
    f2 = np.where(t <= 5, f, f[50] + (0.5 - f[50]) * (t - 5) / 3)
    ds2 = _ds(t, prefix="particle_", alignment_E=e2, alignment_F=f2)
    assert paper.f_phase_onset(ds2, prefix="particle_") == pytest.approx(8.0, abs=1e-9)
    assert paper.max_alignment(ds2, prefix="particle_")[1] == pytest.approx(5.0)


def test_equal_alignments_have_no_onset():
    """dim E = dim F (the rotation case): E and F alignments are equal up to round-off."""
    t = np.linspace(0, 4, 21)
    e = 0.6 + 0.3 * np.tanh(t)
    ds = _ds(t, alignment_E=e, alignment_F=e + 1e-15)
    assert math.isnan(paper.f_phase_onset(ds))


def test_u_curve_minimum_and_failure_snapshot_dropped():
    t = np.linspace(0, 8, 81)
    w2 = (t - 4.3) ** 2 + 0.05
    kind = np.zeros(t.size, dtype=int)
    w2_fail = w2.copy()
    w2_fail[-1] = 0.0  # the state at a guard failure must not count
    kind[-1] = 1
    ds = _ds(t, kind=kind, w2_to_projection=w2_fail)
    value, when = paper.u_curve_minimum(ds)
    assert when == pytest.approx(4.3) and value == pytest.approx(0.05)
    assert paper.value_at(ds, "w2_to_projection", 4.35) == pytest.approx(0.5 * (0.05 + 0.06))
    assert math.isnan(paper.value_at(ds, "w2_to_projection", 9.0))


def test_principal_axis_of_two_atoms_and_of_a_great_circle():
    axis, frac = paper.principal_axis([[0, 1, 0], [0, -1, 0]], [0.3, 0.7])
    assert np.allclose(axis, [0, 1, 0]) and frac == pytest.approx(1.0)
    phi = np.linspace(0, 2 * np.pi, 400, endpoint=False)
    ring = np.stack([np.cos(phi), np.zeros_like(phi), np.sin(phi)], axis=1)
    assert paper.principal_axis(ring, np.ones(phi.size))[1] == pytest.approx(0.5)


def test_zero_temperature_reference_matches_the_closed_form_at_small_t():
    """Uniform ρ₀, M = diag(1, −1, −2): alignment with E of the push-forward at t is
    E[x₁²e^{2t}/(x₁²e^{2t} + x₂²e^{−2t} + x₃²e^{−4t})]; at t = 0 it is 1/3, and it increases."""
    from spherepde.models.initial import Uniform

    model = AttentionModel(PAPER_B, PAPER_V, math.inf)
    ref = paper.zero_temperature_reference(model, Uniform(), [0.0, 0.5, 1.0], nside=8)
    assert ref["alignment_E"][0] == pytest.approx(1 / 3, abs=1e-5)  # quadrature of x₁² on HEALPix-8
    # Monte Carlo of the closed form (independent of the HEALPix quadrature)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400_000, 3))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    for k, t in enumerate([0.5, 1.0]):
        num = x[:, 0] ** 2 * np.exp(2 * t)
        mc = np.mean(num / (num + x[:, 1] ** 2 * np.exp(-2 * t) + x[:, 2] ** 2 * np.exp(-4 * t)))
        assert ref["alignment_E"][k + 1] == pytest.approx(mc, abs=3e-3)
    # B not orthogonal: no closed form offered
    assert paper.zero_temperature_reference(AttentionModel(2 * PAPER_B, PAPER_V, math.inf), Uniform(), [0.0]) is None


# ------------------------------------------------------------------ ablation spectra
def _value(expr):
    return complex(eval(expr, {"__builtins__": {}}, {"sqrt": math.sqrt}))


def _matrices():
    with open(ROOT / "data" / "ablation_matrices.toml", "rb") as fh:
        return tomllib.load(fh)


def _same_multiset(a, b, tol=1e-12):
    a, b = list(map(complex, a)), list(map(complex, b))
    for z in a:
        k = min(range(len(b)), key=lambda i: abs(b[i] - z))
        if abs(b[k] - z) > tol:
            return False
        b.pop(k)
    return not b


def test_ablation_spectra_are_the_issues():
    """numpy's eigenvalues of VBᵀ against the spectra the issue asks for (written here, not read
    from the data file), and the structure of each case."""
    m = _matrices()
    required = {
        "symmetric": [1, -1, -2],
        "nonsymmetric_B": [1 + SQ2, 1 - SQ2, -2],
        "rotation_V": [1j, -1j, -2],
        "B_equals_V": [4, 1, 1],
        "B_equals_minus_V": [-1, -1, -4],
    }
    assert set(m) == set(required)
    for name, spectrum in required.items():
        V, B = np.array(m[name]["V"]), np.array(m[name]["B"])
        assert _same_multiset(np.linalg.eigvals(V @ B.T), spectrum), name
        # the data file states the same spectrum
        assert _same_multiset([_value(s) for s in m[name]["spectrum_VBt"]], spectrum), name
    sym, nsb, rot = m["symmetric"], m["nonsymmetric_B"], m["rotation_V"]
    assert np.array_equal(sym["V"], PAPER_V) and np.array_equal(sym["B"], PAPER_B)
    B = np.array(nsb["B"])
    assert np.array_equal(nsb["V"], PAPER_V) and not np.allclose(B, B.T)
    eig_b = np.linalg.eigvals(B)
    assert np.allclose(eig_b.imag, 0) and _same_multiset(eig_b, [-2 + SQ3, -2 - SQ3, 1])
    V = np.array(rot["V"])
    assert np.array_equal(rot["B"], PAPER_B)
    assert np.allclose(V[:2, :2], -V[:2, :2].T) and np.linalg.det(V[:2, :2]) > 0  # a rotation generator
    assert np.array_equal(m["B_equals_V"]["B"], m["B_equals_V"]["V"])
    assert np.array_equal(m["B_equals_minus_V"]["B"], -np.array(m["B_equals_minus_V"]["V"]))


def test_ablation_models_flag_what_the_theory_excludes():
    m = _matrices()
    flags = {k: AttentionModel(v["B"], v["V"], 30.0).assumption_flags for k, v in m.items()}
    assert not any(flags["symmetric"].values())
    assert flags["nonsymmetric_B"]["M_not_symmetric"] and not flags["nonsymmetric_B"]["complex_dominant_pair"]
    assert flags["rotation_V"]["complex_dominant_pair"]
    assert not any(flags["B_equals_V"].values()) and not any(flags["B_equals_minus_V"].values())
    dims = {k: AttentionModel(v["B"], v["V"], 30.0).E.dim for k, v in m.items()}
    assert dims == {"symmetric": 1, "nonsymmetric_B": 1, "rotation_V": 2, "B_equals_V": 1, "B_equals_minus_V": 2}


# ------------------------------------------------------------------ sweep files and data
def test_sweep_files_expand_to_the_issues_runs(tmp_path):
    specs = paper.expand_sweep(paper.PAPER_BETA, tmp_path)
    assert len(specs) == 12
    betas = {s.config["model"]["beta"] for s in specs}
    assert betas == {10.0, 30.0, 1000.0, "inf"}
    assert {s.params["initial"] for s in specs} == {"uniform", "projected_normal", "vmf"}
    for s in specs:
        c = s.config
        assert c["eulerian"]["nside"] == 16 and c["eulerian"]["atoms"] and c["time"]["t_end"] == 20.0
        assert c["particles"]["mode"] == "quadrature"
        assert np.array_equal(c["model"]["V"], PAPER_V) and np.array_equal(c["model"]["B"], PAPER_B)
    def seeds(config):  # the seeds of a run's systems: seed … seed + systems − 1
        pt = config["particles"]
        return list(range(pt["seed"], pt["seed"] + pt["systems"]))

    tokens = paper.expand_sweep(paper.PAPER_TOKENS, tmp_path) + paper.expand_sweep(paper.PAPER_TOKENS_SHARP, tmp_path)
    assert len(tokens) == 12  # one batched run per law and β
    cases = {}
    for s in tokens:  # tokens alone, every law and β of paper_beta, 8 seeds each
        c = s.config
        assert not c["eulerian"]["enabled"] and c["particles"]["mode"] == "tokens" and c["particles"]["n"] == 2000
        # the step each β needs: dt 0.01 where the softmax is nearly discontinuous
        assert c["particles"]["dt"] == (0.05 if c["model"]["beta"] in (10.0, 30.0) else 0.01)
        cases.setdefault((s.params["initial"], c["model"]["beta"]), []).extend(seeds(c))
    assert set(cases) == {(s.params["initial"], s.config["model"]["beta"]) for s in specs}
    assert all(sorted(seeds) == list(range(1, 9)) for seeds in cases.values())
    by_n = {}
    for s in paper.expand_sweep(paper.PAPER_TOKENS_N, tmp_path):
        by_n.setdefault(s.config["particles"]["n"], []).extend(seeds(s.config))
    assert sorted(by_n) == [500, 1000, 2000, 4000, 8000] and all(v == list(range(1, 9)) for v in by_n.values())
    small = {k: v for k, v in paper.expand_sweep(paper.PAPER_TOKENS_N, tmp_path)[0].config.items()
             if k not in ("particles", "output")}
    by_n = {}
    for s in paper.expand_sweep(paper.PAPER_TOKENS_N_LARGE, tmp_path):  # the same case, continued in n
        assert {k: v for k, v in s.config.items() if k not in ("particles", "output")} == small
        by_n.setdefault(s.config["particles"]["n"], []).extend(seeds(s.config))
    assert sorted(by_n) == [16000, 32000] and all(v == list(range(1, 9)) for v in by_n.values())
    ablation = paper.expand_sweep(paper.PAPER_ABLATION, tmp_path)
    m = _matrices()
    assert [s.params["model"] for s in ablation] == list(m)
    for s in ablation:  # the matrices run are the documented ones
        assert np.array_equal(s.config["model"]["V"], m[s.params["model"]]["V"])
        assert np.array_equal(s.config["model"]["B"], m[s.params["model"]]["B"])


def test_large_n_tokens_run_only_with_slow_and_are_read_where_they_exist(tmp_path, monkeypatch):
    calls = []

    def fake_sweep_into(path, out_dir, label, workers, say, info, run=True):
        calls.append((Path(out_dir).name, run))
        return [], None

    monkeypatch.setattr(paper, "_sweep_into", fake_sweep_into)

    def large_calls(**kw):
        calls.clear()
        info = []
        paper._token_sweeps(tmp_path, False, {}, 2, lambda m: None, info, **kw)
        return [c for c in calls if c[0] == "paper_tokens_n_large"], info

    found, info = large_calls(run=True, slow=False)
    assert found == [] and any("paper_tokens_n_large" in line and "not run" in line for line in info)
    assert not (tmp_path / "paper_tokens_n_large").exists()  # nothing written for a sweep not run
    assert large_calls(run=True, slow=True)[0] == [("paper_tokens_n_large", True)]
    # its folder now exists: a full run without slow reads it and starts nothing
    assert large_calls(run=True, slow=False)[0] == [("paper_tokens_n_large", False)]
    assert large_calls(run=False, slow=True)[0] == [("paper_tokens_n_large", False)]


def test_derived_sweep_without_changes_is_the_sweep(tmp_path):
    """The report's copy of a sweep file expands to the same runs (ids and configs), so runs made
    with `spherepde sweep FILE --out DIR` are reused by `spherepde validate paper`."""
    import json

    for sweep in (paper.PAPER_BETA, paper.PAPER_ABLATION, paper.PAPER_TOKENS, paper.PAPER_TOKENS_N):
        a = paper.expand_sweep(sweep, tmp_path)
        b = paper.expand_sweep(paper.derive_sweep(sweep, tmp_path / "copy", {}), tmp_path)
        assert [s.run_id for s in a] == [s.run_id for s in b]
        assert [json.dumps(s.config, sort_keys=True) for s in a] == [json.dumps(s.config, sort_keys=True) for s in b]


def test_derived_sweep_overrides_base_and_grid(tmp_path):
    quick = dict(paper.QUICK_BASE, **{"eulerian.nside": 8})
    path = paper.derive_sweep(paper.PAPER_BETA, tmp_path / "q", quick, {"model.beta": [10.0, "inf"]})
    specs = paper.expand_sweep(path, tmp_path / "q")
    assert len(specs) == 6
    for s in specs:
        assert s.config["eulerian"]["nside"] == 8 and s.config["particles"]["dt"] == 0.05
        assert s.config["time"]["t_end"] == 8.0
    # a base value that a grid axis sets replaces the axis (dt = 0.01, systems = 8)
    path = paper.derive_sweep(paper.PAPER_TOKENS_SHARP, tmp_path / "t", dict(quick, **paper.QUICK_TOKENS))
    specs = paper.expand_sweep(path, tmp_path / "t")
    assert len(specs) == 6  # 3 laws × β ∈ {1000, ∞}, the seeds batched in each run
    assert {s.config["particles"]["n"] for s in specs} == {300} and {s.config["particles"]["dt"] for s in specs} == {0.05}
    assert {(s.config["particles"]["seed"], s.config["particles"]["systems"]) for s in specs} == {(1, paper.QUICK_SYSTEMS)}
    if paper.BETA_PHASE.is_file():  # grid axes that set a base value are replaced too; no particles added
        path = paper.derive_sweep(paper.BETA_PHASE, tmp_path / "p", quick)
        for s in paper.expand_sweep(path, tmp_path / "p"):
            assert s.config["eulerian"]["nside"] == 8 and s.config["time"]["t_end"] == 8.0
            assert s.config["particles"] is None


def test_paper_table_has_the_reported_rows():
    with open(ROOT / "data" / "paper_table.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["beta"] for r in rows] == ["10", "30", "1000", "inf"]
    assert [r["max_alignment_E"] for r in rows] == ["~0.72", "~0.89", ">0.98", "1.0"]
    assert all(r["source"] for r in rows)


def test_cli_accepts_paper_and_quick():
    from spherepde.cli import build_parser

    args = build_parser().parse_args(["validate", "paper", "exact", "--quick", "--out", "x"])
    assert args.suites == ["paper", "exact"] and args.quick


TINY = {"eulerian.nside": 4, "particles.n": 40, "particles.dt": 0.05, "time.t_end": 1.0, "time.save_every": 0.25}


def _tiny_runs(sweep_file, out, grid, tiny=TINY):
    """Runs of a derived tiny sweep, executed here one by one (no dask cluster: the sweep engine
    has its own tests), collected as report cases."""
    from spherepde.runner.run import execute

    path = paper.derive_sweep(sweep_file, out, tiny, grid)
    specs = paper.expand_sweep(path, out)
    for spec in specs:
        execute(spec.config, spec.config["output"]["path"], progress=False, log=None)
    return paper.collect(specs, out)


def test_report_from_tiny_runs(tmp_path):
    """The report machinery on tiny runs (nside 4, 40 tokens, t ≤ 1): every section is written,
    the paper's rows beside ours, and the runs' own numbers in the tables."""
    uniform = {"label": "uniform", "kind": "uniform"}
    beta_cases = _tiny_runs(paper.PAPER_BETA, tmp_path / "b", {"model.beta": [10.0, "inf"], "initial": [uniform]})
    with open(paper.PAPER_ABLATION, "rb") as fh:
        models = tomllib.load(fh)["sweep"]["grid"]["model"][2:4]  # rotation_V (dim E = 2), B = V
    ablation = _tiny_runs(paper.PAPER_ABLATION, tmp_path / "a", {"model": models})
    assert len(beta_cases) == 2 and len(ablation) == 2
    tokens = _tiny_runs(paper.PAPER_TOKENS, tmp_path / "t", {"model.beta": [10.0, "inf"], "initial": [uniform],
                                                            "particles.systems": [3]})
    n_cases = _tiny_runs(paper.PAPER_TOKENS_N, tmp_path / "n", {"particles.n": [20, 40], "particles.systems": [2]})
    # one case per seed of the batched runs
    assert len(tokens) == 6 and len(n_cases) == 4 and all(c.nside is None for c in tokens)
    assert sorted(c.seed for c in tokens) == [1, 1, 2, 2, 3, 3] and sorted(c.seed for c in n_cases) == [1, 1, 2, 2]
    phase = (paper._combined_from_cases(beta_cases), [(c.beta, math.nan) for c in beta_cases], "test")
    report = paper.write_report(tmp_path / "out", beta_cases, ablation, phase, True, ["- tiny"],
                                paper.read_paper_table(), tokens, n_cases)
    text = report.read_text()
    for heading in ("Quick run", "The paper's table beside ours", "Ablation", "Phase diagram", "Tokens against n",
                    "Where we disagree with the paper and why"):
        assert heading in text
    c10 = next(c for c in beta_cases if c.beta == 10.0)
    value, _ = paper.max_alignment(c10.ds)
    particles, _ = paper.max_alignment(c10.ds, "particle_")
    # the token cell: mean and 95 % Student-t half-width of the three samples' maxima, from the files
    maxima = [paper.max_alignment(c.ds, "particle_")[0] for c in tokens if c.beta == 10.0]
    half = stats.t.ppf(0.975, 2) * np.std(maxima, ddof=1) / math.sqrt(3)
    assert f"| 10 | ~0.72 | {value:.4f} | {particles:.4f} | {np.mean(maxima):.4f} ± {half:.4f} |" in text
    assert "| 30 | ~0.89 | not run" in text
    assert "| rotation_V |" in text and "complex_dominant_pair" in text
    assert (report.parent / "ablation.png").is_file() and (report.parent / "beta_uniform_nside4.png").is_file()


def test_cases_from_the_combined_file_read_no_run_file(tmp_path, monkeypatch):
    """With the sweep's combined file current, collect takes every metric from it (equal to the
    metrics from the run files) and opens a run file only when a case's fields are asked for;
    a run file newer than the combined file sends it back to the run files."""
    import os

    from spherepde.runner.sweep import combine
    from spherepde.storage import runfile

    uniform = {"label": "uniform", "kind": "uniform"}
    from_files = _tiny_runs(paper.PAPER_BETA, tmp_path / "b", {"model.beta": [10.0, "inf"], "initial": [uniform]})
    specs = [c.spec for c in from_files]
    combined = combine(specs, tmp_path / "b" / "paper_beta.nc", "paper_beta")
    opened = []
    real_open = runfile.open_run
    monkeypatch.setattr(runfile, "open_run", lambda path: opened.append(path) or real_open(path))
    cases = paper.collect(specs, tmp_path / "b", combined)
    assert opened == [] and len(cases) == len(from_files)
    for a, b in zip(cases, from_files):
        assert a.metrics == b.metrics and (a.t_end, a.complete, a.wall) == (b.t_end, b.complete, b.wall)
        np.testing.assert_array_equal(a.series.time.values, b.series.time.values)
    assert cases[0].ds.density.shape == from_files[0].ds.density.shape and len(opened) == 1
    os.utime(specs[1].path, ns=(combined.stat().st_mtime_ns + 10**9,) * 2)
    opened.clear()
    assert len(paper.collect(specs, tmp_path / "b", combined)) == 2 and len(opened) == 2


def test_the_systems_of_a_batched_run_are_the_single_runs_of_their_seeds(tmp_path):
    """A batched token run (`[particles] systems = 3`, seed 1) read by collect gives one case per
    seed with the metrics (F-onset, max alignment with E, min W₂ to Π#ρ₀) of the single run of that
    seed. The reason they must be equal exactly: system k of a batch is the single run with seed + k
    (same draws, same noise streams, same kernel: bit for bit with summation = "batched";
    tests/solvers/test_tokens_any_d.py). Also when the sweep's combined file is current: it keeps
    (time,) variables only, so the per-system diagnostics must come from the run file."""
    from spherepde.runner.sweep import combine

    law = next(g for g in paper._load_toml(paper.PAPER_TOKENS)["sweep"]["grid"]["initial"]
               if g["label"] == "projected_normal")
    tiny = {"particles.n": 60, "particles.dt": 0.05, "particles.summation": "batched", "time.t_end": 10.0,
            "time.save_every": 0.25}
    grid = {"model.beta": [10.0], "initial": [law]}
    batched = _tiny_runs(paper.PAPER_TOKENS, tmp_path / "batched", dict(grid, **{"particles.systems": [3]}), tiny)
    single = _tiny_runs(paper.PAPER_TOKENS, tmp_path / "single",
                        dict(grid, **{"particles.systems": [1], "particles.seed": [1, 2, 3]}), tiny)
    assert [c.seed for c in batched] == [c.seed for c in single] == [1, 2, 3]
    assert [c.system for c in batched] == [0, 1, 2] and {c.path for c in batched} == {batched[0].path}
    onsets = [c.metrics["particles"]["onset"] for c in single]
    assert sum(np.isfinite(onsets)) >= 2  # the onset is compared, not only NaN against NaN
    for a, b in zip(batched, single):
        assert (a.law, a.beta, a.n_tokens, a.nside, a.complete) == (b.law, b.beta, b.n_tokens, b.nside, b.complete)
        for name in ("onset", "max_E", "w2_min"):
            np.testing.assert_array_equal(a.metrics["particles"][name], b.metrics["particles"][name])
        np.testing.assert_array_equal(a.series.particle_alignment_F.values, b.series.particle_alignment_F.values)
        # the case's fields are its system's: the positions of the single run
        np.testing.assert_array_equal(a.ds.positions.values, b.ds.positions.values)
    specs = [batched[0].spec]
    path = combine(specs, tmp_path / "batched" / "paper_tokens.nc", "paper_tokens")
    assert "particle_alignment_E" not in xr.open_dataset(path)  # why the combined file cannot stand in
    again = paper.collect(specs, tmp_path / "batched", path)
    assert [c.metrics for c in again] == [c.metrics for c in batched] and len(again) == 3


def test_the_report_line_of_a_sweep_counts_runs_and_their_seeds(tmp_path, monkeypatch):
    """Batched runs give several cases per run: "What was run" counts the runs, names the seeds,
    and lists an unfinished run once, not once per system."""
    from types import SimpleNamespace

    specs = [SimpleNamespace(run_id=f"t-000{i}") for i in range(2)]
    cases = [SimpleNamespace(spec=specs[i], complete=i == 0) for i in (0, 0, 0, 1, 1, 1)]
    monkeypatch.setattr(paper, "run_sweep_files", lambda *args, **kw: (specs, None, []))
    monkeypatch.setattr(paper, "collect", lambda *args: cases)
    info = []
    assert paper._sweep_into(tmp_path / "t.toml", tmp_path, "t", 2, lambda msg: None, info)[0] == cases
    assert "t: 2 of 2 runs (6 seeds as batched systems)," in info[0]
    assert info[0].endswith("; not finished: t-0001")
    monkeypatch.setattr(paper, "collect", lambda *args: cases[::3])  # one case per run: no seed count
    paper._sweep_into(tmp_path / "t.toml", tmp_path, "t", 2, lambda msg: None, info)
    assert "t: 2 of 2 runs, " in info[1]


# ------------------------------------------------------------------ ensembles
def test_interval_is_the_student_t_interval():
    from spherepde.validation.ensembles import interval, onset_text

    iv = interval([1.0, 2.0, 3.0])  # s = 1; Student t with 2 degrees: t_p = (2p − 1)/√(2p(1 − p))
    assert iv.mean == 2.0 and iv.count == 3 and iv.std == pytest.approx(1.0)
    t = 0.95 / math.sqrt(2 * 0.975 * 0.025)
    assert iv.half_width == pytest.approx(t / math.sqrt(3), rel=1e-12)
    assert interval([math.nan, 5.0]).count == 1 and math.isnan(interval([5.0]).half_width)
    assert onset_text([math.nan, math.nan]) == "none (0 of 2)"
    assert onset_text([10.0, 12.0, math.nan]).endswith("(2 of 3)")
    # the coverage of the interval: 95 % of normal samples' intervals hold the mean (binomial ± 3σ)
    samples = np.random.default_rng(0).normal(5.0, 2.0, (2000, 8))
    hits = sum(abs(iv.mean - 5.0) <= iv.half_width for iv in map(interval, samples))
    assert abs(hits / 2000 - 0.95) < 3 * math.sqrt(0.95 * 0.05 / 2000)


def test_machine_names_the_cores_and_the_processor():
    import os

    text = paper.machine()
    assert text.startswith(f"{os.cpu_count()} cores (") and "\n" not in text
