"""Does the F-onset at β = 30 depend on the background? Scale it and see.

spherepde/validation/background.py shows that at β = 30 the mesh density far from the clusters is the one
the continuity equation carries in the run's own field (not numerical diffusion), and that a
background 10⁻¹⁵ below the clusters competes with them in the softmax. The quadrature particles
carry no background there. If that background is what sets the F-onset, the Eulerian and the
particle onsets differ because the particles cannot represent it, and the particles are then not
a reference for the mean field at this β. The experiment:

- run the Eulerian solver with atoms (solvers/atoms_base.toml without its particles) to t₀;
- at t₀ multiply the mesh density by s and give the removed mass (1 − s)·M_mesh to the living
  atoms in proportion to their masses (total mass exact; the atoms stay where they are);
- continue to t_end from that state (spherepde.solvers.eulerian.SolverState, as a resume does) and
  measure the F-onset, the max alignment with E and the share of the softmax weight at the
  heavier atom that comes from the mesh.

s = 1 is the unperturbed run (resume equals the uninterrupted run: tests/solvers/test_atoms.py). If the
onset moves from the unperturbed Eulerian value toward the particles' as s → 0, the difference
between the two discretisations at this β is the background, which only the mesh carries.

    python -m spherepde.validation.background_scaling [--nside 16] [--law projected_normal vmf]
        [--beta 30] [--t0 4] [--scales 1e-1 1e-3 1e-12] [--out DIR]

writes DIR/background_scaling.md (default validation/reports/atoms/).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import xarray as xr

from .common import REPO

LAWS = {  # the two laws of solvers/sweeps/atoms_convergence.toml
    "projected_normal": {"kind": "projected_normal", "mean": [0.3, 0.2, 0.1],
                         "cov": [[1.0, 0.2, 0.0], [0.2, 0.8, 0.0], [0.0, 0.0, 0.6]]},
    "vmf": {"kind": "vmf", "mu": [0.57735026918962573] * 3, "kappa": 2.0},
}


def config_for(law, nside, beta, t_end, save_every=0.1):
    """The resolved config of atoms_base.toml for one case, without its quadrature particles."""
    from ..runner import config as C

    raw = C.apply_overrides(C.load(REPO / "solvers" / "atoms_base.toml"),
                            [f"eulerian.nside={nside}", f"model.beta={beta}", f"time.t_end={t_end}",
                             f"time.save_every={save_every}"])
    raw["initial"] = dict(LAWS[law])
    raw.pop("particles", None)
    return C.resolve(raw)


def rescaled_state(k0, f, record, atom_state, mesh, s):
    """SolverState at snapshot k0 with the mesh density scaled by s and the removed mass given to
    the living atoms in proportion to their masses (mesh + atoms mass unchanged)."""
    from ..solvers.controller import SolverState

    masses = np.array(atom_state["atom_mass"], dtype=float)
    alive = masses > 0
    if not alive.any():
        raise ValueError(f"no atom at snapshot {k0}: nothing can take the background's mass")
    removed = (1.0 - s) * float(mesh.integrate(f))
    masses[alive] += removed * masses[alive] / masses[alive].sum()
    arrays = dict(atom_state, atom_mass=masses)
    return SolverState.from_record(k0, s * np.asarray(f), record, arrays)


class _Series:
    """alignment_E, alignment_F and the background's weight share per snapshot."""

    def __init__(self):
        self.t, self.e, self.f, self.share = [], [], [], []

    def add(self, setup, t, f, rec):
        from .background import AWAY, weight_share

        values, _ = setup.snapshot(t, f, rec, 1.0, None)
        self.t.append(t)
        self.e.append(values["alignment_E"])
        self.f.append(values["alignment_F"])
        xa, ma = setup.solver.atoms.points()
        self.share.append(weight_share(setup.schedule.single_head, setup.mesh, f, xa, ma, AWAY) if ma.size else 1.0)

    def dataset(self):
        return xr.Dataset({"alignment_E": ("time", np.array(self.e)), "alignment_F": ("time", np.array(self.f))},
                          coords={"time": np.array(self.t)})

    def share_at(self, t):
        return self.share[int(np.argmin(np.abs(np.array(self.t) - t)))]


def scaled_runs(law, nside, beta, t0, scales, t_end=20.0, say=print):
    """{s: _Series} for s = 1 (the unperturbed run) and each scale, and the mesh mass at t0."""
    from ..runner.run import build_run, run_times

    cfg = config_for(law, nside, beta, t_end)
    times = run_times(cfg)
    k0 = int(np.argmin(np.abs(np.array(times) - t0)))
    setup = build_run(cfg)
    solver = setup.solver
    base, saved = _Series(), None
    w0 = time.perf_counter()
    for k, t, f, rec in solver.snapshots(setup.f0, times):
        base.add(setup, t, f, rec)
        if k == k0:
            saved = (np.array(f), dict(rec), solver.atoms.state())
    say(f"  {law}, β = {beta:g}, nside {nside}: unperturbed run to t = {t_end:g} in {time.perf_counter() - w0:.0f} s")
    series = {1.0: base}
    f, rec, atom_state = saved
    mesh_mass = float(setup.mesh.integrate(f))
    for s in scales:
        run = _Series()
        for j in range(k0 + 1):  # the common history up to t0
            run.t.append(base.t[j]), run.e.append(base.e[j]), run.f.append(base.f[j]), run.share.append(base.share[j])
        start = rescaled_state(k0, f, rec, atom_state, setup.mesh, s)
        w0 = time.perf_counter()
        for _, t, g, r in solver.snapshots(setup.f0, times, start=start):
            run.add(setup, t, g, r)
        series[s] = run
        say(f"    s = {s:g}: t0 = {times[k0]:g} → {t_end:g} in {time.perf_counter() - w0:.0f} s")
    return series, mesh_mass, times[k0]


def report(laws=("projected_normal", "vmf"), nsides=(16,), beta=30.0, t0=4.0, scales=(1e-1, 1e-3, 1e-12),
           out=None, t_end=20.0, say=print):
    from ..analysis.metrics import f_phase_onset, max_alignment
    from .background import AWAY

    out = Path(out) if out else REPO / "validation" / "reports" / "atoms"
    out.mkdir(parents=True, exist_ok=True)
    share_times = (6.0, 8.0, 10.0)
    rows = []
    for law in laws:
        for nside in nsides:
            series, mesh_mass, t_start = scaled_runs(law, nside, beta, t0, scales, t_end, say=say)
            for s, run in series.items():
                ds = run.dataset()
                onset = f_phase_onset(ds)
                top, at = max_alignment(ds)
                shares = " | ".join(f"{run.share_at(t):.2g}" for t in share_times)
                rows.append(f"| {law} | {nside} | {s:g} | {mesh_mass * s:.1e} | {onset:.3f} | {top:.4f} ({at:.1f}) | {shares} |")
    head = " | ".join(f"mesh weight share, t = {t:g}" for t in share_times)
    lines = [
        f"# The background at β = {beta:g}: the F-onset with the mesh density scaled at t = {t_start:g}", "",
        "Written by `python -m spherepde.validation.background_scaling` (module docstring). Eulerian solver with atoms, "
        f"solvers/atoms_base.toml without its particles, β = {beta:g}, snapshots every 0.1, t ≤ {t_end:g}. At "
        f"t₀ = {t_start:g} the mesh density is multiplied by s and the removed mass goes to the atoms in "
        "proportion to their masses; s = 1 is the unperturbed run. Mesh weight share: the part of the "
        "softmax weight at the heavier atom that comes from the mesh density in cells farther than "
        f"{AWAY} rad from every atom (spherepde/validation/background.py).", "",
        f"| law | nside | s | mesh mass after t₀ | F-onset | max alignment with E (t) | {head} |",
        "|---|---|---|---|---|---|" + "---|" * len(share_times), *rows, "",
    ]
    path = out / "background_scaling.md"
    path.write_text("\n".join(lines))
    say(f"  wrote {path}")
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--law", nargs="+", default=["projected_normal", "vmf"], choices=sorted(LAWS))
    parser.add_argument("--nside", type=int, nargs="+", default=[16])
    parser.add_argument("--beta", type=float, default=30.0)
    parser.add_argument("--t0", type=float, default=4.0)
    parser.add_argument("--scales", type=float, nargs="+", default=[1e-1, 1e-3, 1e-12])
    parser.add_argument("--t-end", type=float, default=20.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    report(tuple(args.law), tuple(args.nside), args.beta, args.t0, tuple(args.scales), args.out, args.t_end)


if __name__ == "__main__":
    main()
