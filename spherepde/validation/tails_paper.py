"""The paper's question in the mean field with the tails, from run files: per β, initial law and
mesh, the F-onset, the max alignment with E and the bottom of the W₂ U-curve (spherepde.analysis.
metrics), with the differences between successive meshes and their observed order
p = log₂(|d_coarse| / |d_fine|).

The run files are those of `spherepde sweep` with `[eulerian] tails = "log"`
(solvers/sweeps/tails_sigma.toml and tails_paper_sigma.toml with the solver's defaults;
tails_paper.toml, tails_convergence.toml, tails_beta1000.toml with the atoms and paths of before):
complete files only (with --partial, unfinished ones too, as far as they got), grouped by β,
`[initial] kind`, the settings that shape the answer (how atoms are made, how g's paths are
taken: `settings_label`) and nside; where two files give the same group the one that runs
longer is kept. Writes validation/reports/tails/paper.md:

    python -m spherepde.validation.tails_paper --runs results/tails_sigma results/tails_paper_sigma --partial
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from ..analysis.metrics import f_phase_onset, max_alignment, u_curve_minimum
from ..storage.runfile import open_run
from .common import REPO, beta_text
from .tails import hybrid_series_of_run, hybrid_summary

__all__ = ["paper_metrics", "settings_label", "collect_runs", "differences", "paper_report"]

LAW_NAMES = {"projected_normal": "projected normal", "vmf": "von Mises–Fisher"}  # [initial] kind → row label


def paper_metrics(ds):
    """{"onset", "max_E", "t_max_E", "w2_min", "t_w2_min", "t_end"} of a run Dataset."""
    e, t_e = max_alignment(ds)
    w, t_w = u_curve_minimum(ds)
    return {"onset": f_phase_onset(ds), "max_E": e, "t_max_E": t_e, "w2_min": w, "t_w2_min": t_w,
            "t_end": float(ds["time"].values[-1])}


def settings_label(eul):
    """The [eulerian] settings of a tails run that shape the answer, in words: how a new atom is
    made (`atom_shape`, `atom_cut`), how g reaches a coupling (`tail_anchor`, `tail_paths`,
    `tail_retrace_tolerance`, `tail_path_step` where not 0.1, `tail_path_tolerance` where > 0), and,
    where they differ from the
    couplings every 0.2 at the mesh's level followed unbounded that the first runs had,
    `tail_interval`, `tail_reference`,
    `tail_follow_bounds`, `tail_exclusion_width`, `tail_path_scheme`, `tail_substeps`
    (`tail_step_states`), `tail_mass_correction` and `tail_field_between`. Keys a file lacks take the value such a file implies
    (spherepde.runner.config.ADDED_KEYS)."""
    atoms = f"{eul.get('atom_shape', 'point')} atoms, {eul.get('atom_cut', 'floor')} cut"
    anchor = float(eul.get("tail_anchor", 0.0))
    if anchor == 0.0:
        label = f"{atoms}, g interpolated at every coupling"
    else:
        kind = eul.get("tail_paths", "retrace")
        budget = f"(budget {eul.get('tail_retrace_tolerance', 0.01):g} decades)"
        paths = {"maps": "composed maps", "retrace": "retraced paths", "backtrack": f"backtracked maps {budget}"}.get(
            kind, f"selective paths {budget}")
        label = f"{atoms}, anchors every {anchor:g} with {paths}"
        if float(eul.get("tail_path_step", 0.1)) != 0.1:
            label += f" in RK4 steps of {float(eul['tail_path_step']):g}"
        if float(eul.get("tail_path_tolerance", 0.0)) > 0.0:
            label += f" halved above {float(eul['tail_path_tolerance']):g} decades per unit time"
    if float(eul.get("tail_interval", 0.2)) != 0.2:
        label += f", couplings every {float(eul['tail_interval']):g}"
    if eul.get("tail_reference", "mesh") == "clusters":
        label += ", level relative to the clusters' peaks"
    if eul.get("tail_follow_bounds", "none") == "neighbours":
        label += ", followed within the neighbours"
    if float(eul.get("tail_exclusion_width", 0.0)) > 0.0:
        width = float(eul["tail_exclusion_width"])
        label += f", finite volumes within {width:g} kernel width{'' if width == 1 else 's'} of the atoms"
    if eul.get("tail_path_scheme", "rk4") != "rk4":
        label += f", paths by {eul['tail_path_scheme']}"
    if int(eul.get("tail_substeps", 1)) > 1:
        where = "at atom events" if eul.get("tail_step_states", "all") == "atom_events" else "everywhere"
        label += f", paths through every step's state {where} ({int(eul['tail_substeps'])} substeps)"
    payment = eul.get("tail_mass_correction", "global")
    if payment != "global":
        label += {"local": ", the tail cells' mass paid locally",
                  "downstream": ", the tail cells' mass paid where their flow goes"}[payment]
    field = eul.get("tail_field_between", "linear")
    if field != "linear":
        label += {"measure": ", the field of the measure between couplings",
                  "steps": ", the steps' states between couplings"}[field]
    return label


def collect_runs(folders, partial=False):
    """{(β, law kind, settings_label, nside): metrics} of the complete run files with tails from
    log f in the folders (a sweep's run ids <name>-<index:04d>.nc; a file being written, with its
    .lock, is skipped); partial: unfinished files too, as far as they got (metrics["partial"]);
    the longer run where two give the same key."""
    found = {}
    for folder in folders:
        for path in sorted(Path(folder).glob("*-[0-9][0-9][0-9][0-9].nc")):
            if Path(f"{path}.lock").exists() and not partial:
                continue
            with open_run(path) as ds:
                complete = int(ds.attrs.get("complete", 0)) == 1
                if (not complete and not partial) or ds.attrs.get("tails") != "log":
                    continue
                if ds.sizes["time"] < 2:
                    continue
                config = json.loads(ds.attrs["config"])
                metrics = dict(paper_metrics(ds), path=str(path), partial=not complete)
            if not math.isfinite(metrics["onset"]):  # why none: how far the heavier atom is from the cone
                summary = hybrid_summary(hybrid_series_of_run(path, partial=True)["rows"])
                metrics.update(q_end=summary["q_end"], q_rate=summary["q_rate"])
            eul = config["eulerian"]
            key = (float(config["model"]["beta"]), config["initial"]["kind"], settings_label(eul), int(eul["nside"]))
            if key not in found or metrics["t_end"] > found[key]["t_end"]:
                found[key] = metrics
    return found


def differences(values):
    """Successive differences d_k = v_{k+1} − v_k of a sequence (NaN where either is NaN) and the
    observed orders log₂(|d_k| / |d_{k+1}|) of mesh halvings (NaN where undefined)."""
    d = [b - a for a, b in zip(values, values[1:])]
    orders = [math.log2(abs(a) / abs(b)) if a and b and math.isfinite(a) and math.isfinite(b) else math.nan
              for a, b in zip(d, d[1:])]
    return d, orders


def _fmt(x, digits=2):
    return "none" if not math.isfinite(x) else f"{x:.{digits}f}"


def _why_none(beta, nsides, rows):
    """The reason a run has no F-onset: ⟨Bz, z⟩ of its heavier atom at the end, which is < 0 while
    the atom is on E's side of the cone ⟨Bz, z⟩ = 0 where the way to F starts, and its drift over
    the second half of the run (hybrid_summary), with the time it would reach the cone at that rate
    where that half starts after t = log β (the clusters formed; earlier it is their transient)."""
    parts = []
    for n, r in zip(nsides, rows):
        q, rate = r.get("q_end", math.nan), r.get("q_rate", math.nan)
        if math.isfinite(r["onset"]) or not (math.isfinite(q) and math.isfinite(rate)):
            continue
        text = f"nside {n}: {q:+.3f} at t = {r['t_end']:g}, {rate:+.4f} per unit time"
        if q < 0 < rate and r["t_end"] / 2 >= math.log(beta):
            text += f" (at the cone at t ≈ {r['t_end'] - q / rate:.0f})"
        parts.append(text)
    if not parts:
        return ""
    return ("⟨Bz, z⟩ of the heavier atom at the end (< 0: on E's side of the cone ⟨Bz, z⟩ = 0, where the way "
            "to F starts) and its drift over the second half of the run: " + "; ".join(parts) + ".")


def paper_report(folders, out=None, partial=False, say=print):
    """OUT/paper.md (default validation/reports/tails/): one table per β, law and settings
    (module docstring); partial: unfinished runs too, their t_end marked."""
    out = Path(out) if out else REPO / "validation" / "reports" / "tails"
    runs = collect_runs(folders, partial=partial)
    lines = []
    for beta, kind, settings in sorted({k[:3] for k in runs}):
        nsides = sorted(n for b, k, s, n in runs if (b, k, s) == (beta, kind, settings))
        rows = [runs[(beta, kind, settings, n)] for n in nsides]
        lines += [f"## β = {beta_text(beta)}, {LAW_NAMES.get(kind, kind)}: {settings}", "",
                  "| nside | F-onset | max alignment with E (t) | min W₂(ρ_t, Π#ρ₀) (t) | t_end |", "|---|---|---|---|---|"]
        lines += [f"| {n} | {_fmt(r['onset'])} | {r['max_E']:.4f} ({r['t_max_E']:g}) | {r['w2_min']:.4f} "
                  f"({r['t_w2_min']:g}) | {r['t_end']:g}{' (unfinished)' if r['partial'] else ''} |"
                  for n, r in zip(nsides, rows)]
        for name, digits in (("onset", 2), ("max_E", 4), ("w2_min", 4)):
            d, p = differences([r[name] for r in rows])
            if d:
                lines.append(f"\n{name}: differences {', '.join(_fmt(x, digits) for x in d)}"
                             + (f"; observed orders {', '.join(_fmt(x, 1) for x in p)}" if p else ""))
        if any(math.isnan(r["onset"]) for r in rows):
            lines.append("\nnone: no F-onset by the run's end (its t_end). " + _why_none(beta, nsides, rows))
        lines.append("")
    command = f"python -m spherepde.validation.tails_paper --runs {' '.join(map(str, folders))}"
    out.mkdir(parents=True, exist_ok=True)
    path = out / "paper.md"
    path.write_text(
        "# The paper's question in the mean field with the tails from log f\n\n"
        f"`{command}{' --partial' if partial else ''}` ({time.strftime('%Y-%m-%d')}). The paper's matrices and "
        "the laws of `solvers/paper_beta.toml`, `[eulerian] tails = \"log\"` with couplings every 0.2 (unless said) and saves "
        "every 0.2, from the run files of the sweeps named; each table heads the settings its runs share: how a "
        "new atom is made (`atom_shape`, `atom_cut`), how g reaches a coupling (`tail_anchor`, `tail_paths`), and, "
        "where they are not those of the first runs, the couplings, the tail level and the following between them "
        "(`tail_interval`, `tail_reference`, `tail_follow_bounds`; docs/numerics.md). \"unfinished\": a run kept as far as it got (--partial): its F-onset and maximum "
        "alignment with E are final once past, the W₂ bottom is final when its t is well before t_end. "
        "Differences are between successive meshes (finer − coarser), orders log₂ of the ratio of successive "
        "differences. The metrics are those of the paper report (spherepde.analysis.metrics); what they mean "
        "for the mean field and the finite-n systems: docs/theory.md#tails-at-large-β.\n\n" + "\n".join(lines))
    say(f"wrote {path} ({len(runs)} runs)")
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="+", required=True, help="folders of sweep run files")
    parser.add_argument("--partial", action="store_true", help="unfinished runs too, as far as they got")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    paper_report(args.runs, args.out, partial=args.partial)


if __name__ == "__main__":
    main()
