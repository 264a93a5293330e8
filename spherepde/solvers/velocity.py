"""The velocity of the Eulerian solver: edge fluxes and cell velocities of the measure f dA (+ atoms).

For the layer of the schedule in force (rebuilt at each switch, `use`), the attention sums of
every head at the edge quadrature points and at the cell centroids (spherepde.summation.heads).
By default the velocity is exact at every Runge–Kutta stage (`edge_flux`). With a velocity
tolerance ε > 0 it is evaluated exactly only every Δ in time and extrapolated in between
(spherepde.transport.extrapolated: `stage_flux`, `refresh`), Δ steered so that the measured
relative extrapolation error stays near ε/2.

With atoms and ε > 0 the sums are split: the extrapolation history holds, per head, the softmax
mean and log-partition of the mesh density alone at the edge points, and the atoms are added to
them exactly at every stage (spherepde.summation.points). The atoms move, and at large β the
softmax weights between them change fast, while the background changes slowly; the mesh part
is then extrapolated over intervals as long as without atoms. The error e is still measured on
the edge fluxes. (Split only when every head has finite β and every layer as many heads: else
the whole fluxes are extrapolated.)

Units: positions unit vectors, fluxes un = w (v·n) per edge quadrature point (w the arc-length
weight), velocities tangent vectors in units of the dynamics' time.
"""

from __future__ import annotations

import math

import healpy as hp
import numpy as np

from ..summation import NearField, attention_field, mesh_sources, table_bytes
from ..summation.near_field import MAX_RINGS
from ..summation.field import NEAR_FIELD_MAX_BYTES
from ..summation.heads import HeadsField, heads_field
from ..summation.kernels import unnormalise
from ..summation.points import add_point_sources, point_log_partition
from ..transport import kernels
from ..transport.extrapolated import ExtrapolatedFlux
from ..transport.semi_lagrangian import PolynomialInterpolant

__all__ = ["EulerianVelocity", "NEAR_FIELD_PROFILES"]

NEAR_FIELD_PROFILES = ("constant", "log_linear")


class EulerianVelocity:
    """The attention velocity of the Eulerian state on a mesh (module docstring).

    schedule: a Schedule or CallableSchedule (spherepde.models.schedule); atoms: the solver's
    Atoms or None (their current positions and masses are read at every evaluation);
    summation, tolerance, near_field: the attention sums (attention_field, AttentionField);
    near_field_profile: the density inside a near cell of the sums at the atoms (atom_velocity,
    background_share): "constant" (f_c) or "log_linear" (f_c e^{⟨γ_c, y − y_c⟩}/N_c, γ_c the
    limited slope of ln f, PolynomialInterpolant.slopes): a kernel narrower than a cell then sees
    how the tails fall across it (β = 1000: a decade per cell; docs/numerics.md#near-field-in-the-tails-near_field_profile);
    velocity_tolerance: 0 (exact at every stage) or ε > 0 (ExtrapolatedFlux).
    `stage_flux` is what the stepper calls for the edge fluxes of a stage, `atom_velocity` what it
    calls for the atoms' velocities.
    """

    def __init__(self, mesh, schedule, atoms=None, summation: str = "auto", tolerance: float = 1e-10,
                 near_field: bool = True, velocity_tolerance: float = 0.0, near_field_profile: str = "constant"):
        if near_field_profile not in NEAR_FIELD_PROFILES:
            raise ValueError(f"near_field_profile must be one of {NEAR_FIELD_PROFILES}, got {near_field_profile!r}")
        self.mesh, self.schedule, self.atoms = mesh, schedule, atoms
        self.near_field_profile = near_field_profile
        self._slopes_of = None  # the log-density fits of the log-linear profile, built on first use
        self.summation, self.tolerance, self.near_field = summation, tolerance, near_field
        self._field_options = dict(method=summation, tol=tolerance, near_field=near_field)
        self.key = None
        self.use(0.0)  # the summation objects of the layer at t = 0
        # whether any target gets near-field corrections (recorded in the output file)
        later = {(h.B.tobytes(), h.beta): h for layer in (schedule.layers or ())[1:] for h in layer.heads}
        self.near_field_active = (self.edge_field.near is not None or self.cell_field.near is not None
                                  or any(self._needs_near(h) for h in later.values()))
        self._un = np.empty(mesh.edge_weights.shape)
        self.velocity_tolerance = float(velocity_tolerance)
        self.lag = None
        # edges whose fluxes move nothing the solver keeps (both cells overwritten after every step:
        # tail cells that follow g, spherepde.solvers.tails), left out of the measured lag error
        self.unmeasured = None
        self.stage_flux = self.edge_flux
        if self.velocity_tolerance > 0:
            self.lag = ExtrapolatedFlux(self.velocity_tolerance, mesh.edge_weights.shape)
            self.stage_flux = self._extrapolated_flux
        self.split = None
        if self.lag is not None and atoms is not None:
            self.split = self._split_buffers()
            if self.split is not None:
                self.lag = ExtrapolatedFlux(self.velocity_tolerance, self.split["part"].shape)

    # ------------------------------------------------------------------ the layer in force
    def use(self, t) -> bool:
        """Take the layer of a step starting at t (spherepde.models.schedule): rebuild the
        summation objects when it is not the current one; True then."""
        key = self.schedule.key_at(t)
        if key == self.key:
            return False
        layer = self.schedule.model_at(t)
        self.key, self.layer = key, layer
        self.heads = layer.heads
        self.edge_field = heads_field(layer, self.mesh, self.mesh.edge_points.reshape(-1, 3), **self._field_options)
        # one AttentionField per head (the split sums take each head's mesh part), and what the
        # split sums need of each head: B, Bᵀ, β, V, and the log field scale if unnormalised
        self.edge_heads = self.edge_field.fields if isinstance(self.edge_field, HeadsField) else [self.edge_field]
        self._split_heads = [(np.ascontiguousarray(h.B, dtype=float), np.ascontiguousarray(h.B.T, dtype=float),
                              float(h.beta), np.ascontiguousarray(h.V, dtype=float),
                              float(h.log_field_scale) if h.unnormalised else None) for h in self.heads]
        self.cell_field = heads_field(layer, self.mesh, self.mesh.centroids, **self._field_options)
        return True

    def _needs_near(self, head) -> bool:
        """Whether the summation objects of a head would carry near-field tables (they depend on
        its B and β only)."""
        if not self.near_field or head.zero_temperature:
            return False
        return any(0 < table_bytes(self.mesh, head, targets) <= NEAR_FIELD_MAX_BYTES
                   for targets in (self.mesh.edge_points.reshape(-1, 3), self.mesh.centroids))

    def switch(self, t, f):
        """After a step that ended at a switch time t: the new layer's summation objects and its
        exact fluxes, which start a new extrapolation history."""
        self.use(t)
        if self.lag is not None:
            self.lag.forget()
            self.refresh(t, f)

    # ------------------------------------------------------------------ exact evaluations
    def point_sources(self, points):
        """(positions, masses) of the atoms as point sources: at the stage positions `points`
        when given, else where the atoms are; (None, None) without atoms."""
        if self.atoms is None or self.atoms.count == 0:
            return None, None
        x, m = self.atoms.points()
        return (x if points is None else points), m

    def edge_flux(self, t, f, points=None):
        """Edge fluxes un = w (v[ρ]·n) at the edge quadrature points for ρ = f dA (+ the atoms,
        at the stage positions points) (the flow is autonomous)."""
        x, m = self.point_sources(points)
        v, _, _ = self.edge_field(f) if x is None else self.edge_field(f, False, x, m)
        kernels.edge_normal_flux(v.reshape(self.mesh.edge_points.shape), self.mesh.edge_normals,
                                 self.mesh.edge_weights, self._un)
        return self._un

    def at_cells(self, f):
        """(v, div_S v, m_β) at the cell centroids for the density f (and the atoms)."""
        x, m = self.point_sources(None)
        return self.cell_field(f, want_div=True) if x is None else self.cell_field(f, True, x, m)

    def atom_velocity(self, t, f, points):
        """Tangent velocities (n, 3) of atoms at points in the field of f dA + Σ m_k δ_{points_k}:
        the atoms are point sources and targets (the local field at β = ∞). The mesh part gets
        the near-field corrections where the kernel is narrower than a cell."""
        x, m = self.point_sources(points)
        sources, masses = mesh_sources(self.mesh, f, x, m)
        total = None
        for head in self.heads:  # every head's field at the atoms, summed (spherepde.models.heads)
            near = None
            if self.near_field and not head.zero_temperature:
                if table_bytes(self.mesh, head, points) > 0:
                    near = NearField(self.mesh, head, points, slopes=self.log_slopes(f, head, points))
            v, _, _ = attention_field(head, sources, masses, points, method=self.summation,
                                      tol=self.tolerance, near=near)
            total = v if total is None else total + v
        return total

    def log_slopes(self, f, head, points):
        """The tangent slopes γ_c of ln f (npix, 3) in the cells that the near field of head at
        points can reach (the others 0), or None with the constant profile (cells whose stencil
        holds an f ≤ 0 get γ_c = 0)."""
        if self.near_field_profile == "constant":
            return None
        if self._slopes_of is None:
            self._slopes_of = PolynomialInterpolant(self.mesh)
        peaks = points @ head.B  # rows (Bᵀx)ᵀ: the kernels' peaks, up to their norms
        reach = (MAX_RINGS + 1.5) * math.sqrt(self.mesh.area)  # MAX_RINGS rings around the home cell
        cells = np.unique(np.concatenate([hp.query_disc(self.mesh.nside, p, reach, inclusive=True, nest=True)
                                          for p in peaks / np.linalg.norm(peaks, axis=1, keepdims=True)]))
        with np.errstate(divide="ignore", invalid="ignore"):
            return self._slopes_of.slopes(np.log(np.asarray(f)), cells=cells)

    def background_share(self, f):
        """The mesh's share of the softmax weight at each living atom (slot order), the largest
        over the heads of the layer in force:

            s_k = Z_mesh(x_k) / (Z_mesh(x_k) + Z_atoms(x_k)),  Z_mesh(x) = Σ_c f_c A e^{β⟨Bᵀx, y_c⟩}
            (near-field cell integrals where the kernel is narrower than a cell), Z_atoms(x) = Σ_j m_j e^{β⟨Bᵀx, x_j⟩}.

        The atoms move with the softmax mean of the whole measure, so s_k is how much of an atom's
        velocity the background decides (1: all of it). NaN for a head at β = ∞ (no softmax
        weights) and an empty array without atoms."""
        x, m = self.point_sources(None)
        if x is None:
            return np.empty(0)
        if not np.any(f > 0):
            return np.zeros(len(x))  # no background at all
        share = np.full(len(x), -np.inf)
        sources, masses = self.mesh.centroids, f * self.mesh.area
        for head in self.heads:
            if head.zero_temperature:
                return np.full(len(x), np.nan)
            near = None
            if self.near_field and table_bytes(self.mesh, head, x) > 0:
                near = NearField(self.mesh, head, x, slopes=self.log_slopes(f, head, x))
            log_mesh = np.empty(len(x))
            attention_field(head, sources, masses, x, method=self.summation, tol=self.tolerance, near=near,
                            log_partition=log_mesh)
            scores = head.beta * (x @ head.B) @ x.T  # β⟨Bᵀx_k, x_j⟩ = β x_kᵀ B x_j
            log_atoms = np.log(np.exp(scores - scores.max(axis=1, keepdims=True)) @ m) + scores.max(axis=1)
            share = np.maximum(share, 1.0 / (1.0 + np.exp(log_atoms - log_mesh)))
        return share

    def forget_routes(self):
        """Snapshot boundary: the summation's routing restarts (AttentionField), like the
        extrapolation history, so that a run resumed here repeats the uninterrupted one."""
        self.edge_field.forget_route()
        self.cell_field.forget_route()

    # ------------------------------------------------------------------ extrapolated fluxes
    def _extrapolated_flux(self, t, f, points=None):
        """Stage fluxes when the velocity is extrapolated: the stored exact fluxes at the last
        refresh, the extrapolation where it is usable, else the exact fluxes (cold: they start
        the history, ExtrapolatedFlux.record_stage). Split sums: the same for the mesh part,
        the atoms at their stage positions added exactly."""
        lag = self.lag
        flux = (lambda state: state) if self.split is None else (lambda part: self.split_flux(part, points))
        if t == lag.last_time:
            return flux(lag.latest)
        if lag.usable(t):
            return flux(lag.predict(t))
        if self.split is None:
            un = self.edge_flux(t, f, points)
            lag.record_stage(t, un)
            return un
        part = self.mesh_part(f)
        lag.record_stage(t, part)
        return flux(part)

    def refresh(self, t, f) -> float:
        """Exact edge fluxes (split sums: the mesh part) at (t, f) into the extrapolation history;
        the edges in `unmeasured` (None: none) are left out of the measured extrapolation error."""
        if self.split is None:
            return self.lag.refresh(t, self.edge_flux(t, f), unmeasured=self.unmeasured)
        return self.lag.refresh(t, self.mesh_part(f), to_flux=lambda part: self.split_flux(part, None),
                                unmeasured=self.unmeasured)

    # ------------------------------------------------------------------ split sums
    def _split_buffers(self):
        """The work arrays of the split sums (module docstring), or None where they do not apply:
        a head at β = ∞ (its field is local: nothing to split), layers with different head
        counts, or weights from a callable (not known in advance)."""
        layers = self.schedule.layers
        if layers is None:
            return None
        counts = {layer.count for layer in layers}
        if len(counts) != 1 or any(h.zero_temperature for h in self.schedule.heads):
            return None
        targets = np.ascontiguousarray(self.mesh.edge_points.reshape(-1, 3))
        n = targets.shape[0]
        return {"part": np.empty((counts.pop(), n, 4)), "velocity": np.empty((n, 3)), "head": np.empty((n, 3)),
                "targets": targets,
                "mean": np.empty((n, 3)), "logz": np.empty(n), "added": np.empty(n), "no_div": np.empty(0),
                "no_points": (np.empty((0, 3)), np.empty(0))}

    def mesh_part(self, f):
        """Every head's softmax mean and log-partition of the mesh density alone at the edge
        points: part[h, :, 0:3] = m, part[h, :, 3] = ln Z (a buffer, copied by the history).

        Held to the summation tolerance relative to the whole measure, mesh and atoms: the
        atoms' partition function at each edge point goes with the sums (added_log_partition of
        attention_field), so that where the atoms dominate (around them: late, most targets) the
        mesh part needs no costly re-summing. Half of it, since the atoms move until the next
        refresh; the extrapolation's own error ε ≫ the summation tolerance anyway."""
        work = self.split
        part = work["part"]
        x, m = self.point_sources(None)
        added = None
        if x is not None:
            x = np.ascontiguousarray(x, dtype=float)
            log_m = np.log(m) - math.log(2.0)
            added = work["added"]
        for h, field in enumerate(self.edge_heads):
            if added is not None:
                _, BT, beta, _, _ = self._split_heads[h]
                point_log_partition(work["targets"], BT, beta, x, log_m, added)
            _, _, mean = field(f, False, log_partition=work["logz"], added_log_partition=added)
            part[h, :, :3] = mean
            part[h, :, 3] = work["logz"]
        return part

    def split_flux(self, part, points):
        """Edge fluxes of the mesh part (from mesh_part or extrapolated) plus the atoms at points
        (None: where they are), summed exactly (spherepde.summation.points); every head's
        velocity, unnormalised where the head is, summed over the heads."""
        work = self.split
        x, m = self.point_sources(points)
        if x is None:
            x, log_m = work["no_points"]
        else:
            x = np.ascontiguousarray(x, dtype=float)
            log_m = np.log(m)
        total = work["velocity"]
        for h, (B, BT, beta, V, scale) in enumerate(self._split_heads):
            v = total if h == 0 else work["head"]
            add_point_sources(work["targets"], BT, beta, V, part[h], x, log_m, v, work["mean"], work["logz"])
            if scale is not None:  # an unnormalised head
                unnormalise(B, beta, scale, work["logz"], False, v, work["no_div"], work["mean"])
            if h:
                total += v
        kernels.edge_normal_flux(total.reshape(self.mesh.edge_points.shape), self.mesh.edge_normals,
                                 self.mesh.edge_weights, self._un)
        return self._un
