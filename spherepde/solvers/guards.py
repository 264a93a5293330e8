"""Run guards: checks after every step that stop a run which has gone wrong, and say where.

A guard that fires raises RunFailure with the reason, the time, the place (a cell, a particle,
or none for a global quantity such as the mass) and the state at failure, which the run writes
as its last snapshot. The checks (tolerances from the [guards] section of a run config):

- non-finite density (NaN or ±Inf) in a cell, non-finite sup div v, non-finite particle
  position or carried log-density (−inf is allowed there: log of a zero density);
- negative density below round-off: min f < −negative_tolerance · max f (the schemes keep
  f ≥ 0 up to round-off);
- mass drift: |∫f_t − ∫f_0| > mass_tolerance · ∫f_0 (the fluxes conserve mass to round-off);
- CFL violation: an accepted step whose stage Courant number exceeds the scheme's bound
  max(cfl, positivity bound) (the stepper rejects such steps: this is the independent check);
- step-size collapse: a Courant-limited dt below dt_floor (the stepper raises StepSizeCollapse,
  the Eulerian solver reports it as a RunFailure).

"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["RunFailure", "Guards"]

class RunFailure(Exception):
    """A guard fired. reason, time, where ("cell 17", "particle 3", or None for a global
    quantity); density, positions, log_density: the state at failure (None if not available).
    kept: set by the run that records the failure, the number of regular snapshots in its file."""

    kept = None

    def __init__(self, reason, time, where=None, density=None, positions=None, log_density=None):
        self.reason, self.time, self.where = reason, float(time), where
        self.density, self.positions, self.log_density = density, positions, log_density
        super().__init__(f"{reason} at t = {self.time:.6g}" + (f", {where}" if where else ""))


@dataclass(frozen=True)
class Guards:
    """Tolerances of the run guards (defaults never fire on a healthy run)."""

    mass_tolerance: float = 1e-10  # relative to the initial mass
    negative_tolerance: float = 1e-14  # relative to max f
    dt_floor: float = 1e-12  # smallest Courant-limited time step

    def density(self, t, f, mass, mass0):
        """Finite, non-negative up to round-off, mass conserved to mass_tolerance."""
        bad = np.flatnonzero(~np.isfinite(f))
        if bad.size:
            raise RunFailure(f"non-finite density f = {f[bad[0]]} ({bad.size} cells)", t,
                             f"cell {bad[0]}", density=f)
        cell = int(np.argmin(f))
        floor = -self.negative_tolerance * float(f.max())
        if f[cell] < floor:
            raise RunFailure(f"negative density f = {f[cell]:.3e} below −{self.negative_tolerance:g}·max f",
                             t, f"cell {cell}", density=f)
        drift = abs(mass - mass0) / (abs(mass0) or 1.0)
        if not drift <= self.mass_tolerance:
            raise RunFailure(f"relative mass drift {drift:.2e} exceeds mass_tolerance {self.mass_tolerance:g}",
                             t, "a global quantity: no single cell", density=f)

    @staticmethod
    def courant(t, f, courant, cell, limit):
        """The accepted step's largest stage Courant number is within the scheme's bound."""
        if courant > limit * (1.0 + 1e-12):
            raise RunFailure(f"CFL violation: step Courant number {courant:.4g} > {limit:g}", t,
                             f"cell {cell}", density=f)

    @staticmethod
    def divergence(t, f, div):
        """sup div v enters the a-posteriori bound: it must be finite."""
        bad = np.flatnonzero(~np.isfinite(div))
        if bad.size:
            raise RunFailure(f"non-finite div v = {div[bad[0]]}", t, f"cell {bad[0]}", density=f)

    @staticmethod
    def particles(t, x, log_f):
        """Finite positions; carried log-density not NaN or +inf."""
        bad = np.flatnonzero(~np.all(np.isfinite(x), axis=1))
        if bad.size:
            raise RunFailure("non-finite particle position", t, f"particle {bad[0]}",
                             positions=x, log_density=log_f)
        if log_f is not None:
            bad = np.flatnonzero(np.isnan(log_f) | (log_f == np.inf))
            if bad.size:
                raise RunFailure(f"carried log-density {log_f[bad[0]]}", t, f"particle {bad[0]}",
                                 positions=x, log_density=log_f)
