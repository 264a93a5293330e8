"""One schema for every run file and in-memory dataset: dimension and coordinate names, the
grid's attributes, and the name, long_name and units of every variable a solver or a run
records (docs/file_format.md is the user's page).

Readers this layout is checked against: xdggs 0.6 (cell_ids attributes), CF-1.13 (the healpix
grid mapping, the healpix_index coordinate), CDO 2.1 and 2.6 (32-bit integer attributes, the
`cell` dimension), cf-python 3.21, uxarray, easygems.
"""

from __future__ import annotations

import json

import numpy as np

__all__ = ["CELL_DIM", "OLD_CELL_DIM", "CELL_INDEX_ATTRS", "TIME_ATTRS", "DENSITY_ATTRS", "int_attr", "attr_value",
           "xdggs_attrs", "crs_attrs", "SNAPSHOT_META", "NOISE_META", "ATOM_META", "ATOM_ARRAYS", "ATOM_DIAGNOSTICS",
           "TAIL_META", "TAIL_ARRAYS", "TAIL_PEAK_ARRAYS", "DIAGNOSTIC_META", "SOLVER_META", "PARTICLE_META", "CARRIED_META", "PARTICLE_ARRAYS",
           "CARRIED_ARRAYS", "PARTICLE_WEIGHTS", "component_dim", "particle_arrays", "TOKEN_META", "TOKEN_CLUSTER_MASS",
           "SYSTEM_DIM", "CLUSTER_DIM", "ADAPTIVE_META"]

# ---------------------------------------------------------------------- the grid and time
CELL_DIM = "cell"  # what uxarray (from_healpix's face_dim), easygems and CDO's own output use
OLD_CELL_DIM = "cells"  # files written before the rename
CELL_INDEX_ATTRS = {"standard_name": "healpix_index", "long_name": "HEALPix cell index (nested)", "units": "1"}
# The depth t of the network is dimensionless: units "1". No axis = "T" and no standard_name
# "time": CF keeps both for calendar time with a reference date ("days since ..."), which CF
# checkers then demand. xarray decodes only units with "since" as dates, so it leaves these
# values alone, without a warning. CDO takes the unlimited dimension `time` as its time axis
# whatever the attributes say: it warns "Unsupported TIMEUNIT: 1!" and writes zero time values
# in its output (the steps stay in order); docs/file_format.md says so.
TIME_ATTRS = {"long_name": "time t of the dynamics (depth of the network)", "units": "1"}
# the density on the cells (a file adds coordinates = "cell_ids crs")
DENSITY_ATTRS = {"long_name": "density f_t w.r.t. surface measure (cell average)", "units": "sr-1",
                 "grid_mapping": "crs"}


INT32 = np.iinfo(np.int32)


def int_attr(value):
    """An integer attribute as a 32-bit int: CDO drops int64 global attributes from the files it
    writes, and its HEALPix detection wants a plain int refinement_level. A value beyond int32
    (none of ours in practice) stays int64 rather than being changed."""
    value = int(value)
    return np.int32(value) if INT32.min <= value <= INT32.max else np.int64(value)


def attr_value(value):
    """NetCDF attributes cannot be bool, None or dict; integers are stored as 32-bit ints."""
    if isinstance(value, (bool, np.bool_)):
        return np.int32(value)
    if isinstance(value, (int, np.integer)):
        return int_attr(value)
    if value is None:
        return ""
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value)
    return value


def xdggs_attrs(level) -> dict:
    """The attributes of cell_ids: exactly these three (xdggs 0.6 passes every attribute of the
    variable into its grid info and refuses an unknown one, standard_name included)."""
    return {"grid_name": "healpix", "level": int_attr(level), "indexing_scheme": "nested"}


def crs_attrs(level) -> dict:
    """The CF-1.13 healpix grid mapping, and nothing else (xdggs' CF decoder passes every
    attribute of crs on to its grid info)."""
    return {"grid_mapping_name": "healpix", "refinement_level": int_attr(level), "indexing_scheme": "nested"}


# ---------------------------------------------------------------------- the Eulerian solver
# per-snapshot records of a run: name → (long_name, units)
SNAPSHOT_META = {
    "mass": ("total mass ∫f dA (+ Σ m_k of the atoms, when on)", "1"),
    "min_density": ("min over cells of f_t", "sr-1"),
    "max_density": ("max over cells of f_t", "sr-1"),
    "sup_div": ("sup over cell centroids of div_S v", "1"),
    "integrated_sup_div": ("∫_0^t sup_x div_S v ds (trapezoidal over steps, or over exact velocity evaluations)", "1"),
    "lower_bound_aposteriori": ("ℓ₀ exp(−∫_0^t sup div_S v ds): a-posteriori density lower bound", "sr-1"),
    "steps": ("time steps taken since t = 0", "1"),
    # the rest of the solver state, so that a run can continue from any snapshot (--resume)
    "steps_rejected": ("rejected time steps since t = 0", "1"),
    "step_safety": ("factor of the step-size controller after the last step", "1"),
    "max_sup_div": ("largest sup div v over all steps so far", "1"),
    "velocity_interval": ("time between exact velocity evaluations, quadratic extrapolation "
                          "(0: every Runge–Kutta stage)", "1"),
    "velocity_interval_linear": ("time between exact velocity evaluations, linear extrapolation (the "
                                 "cold start after each snapshot)", "1"),
    "velocity_lag_error": ("largest measured relative error of the extrapolated edge fluxes since the "
                           "previous snapshot (0: exact velocity at every stage)", "1"),
}

# per-snapshot records of a run with noise (only then: files without noise keep their layout)
NOISE_META = {
    "noise": ("diffusion coefficient ν(t) of the noise at the snapshot", "1"),
    "noise_integral": ("∫_0^t ν ds: the heat flow so far is exp(∫ν · Δ_S)", "1"),
    "heat_products": ("sparse products of the heat flow (uniformisation) since t = 0", "1"),
}

# per-snapshot records of the atoms: name → (long_name, units)
ATOM_META = {
    "atom_count": ("number of atoms", "1"),
    "atom_mass_total": ("total mass of the atoms Σ m_k", "1"),
    "mesh_mass": ("mass of the mesh density ∫f dA", "1"),
    "atoms_created": ("atoms created since t = 0", "1"),
    "atoms_merged": ("atom merges since t = 0", "1"),
    "atoms_refused": ("unresolved peaks left on the mesh since t = 0 because every atom slot was alive", "1"),
    "background_share_max": ("largest share of the mesh density in the softmax weight at an atom "
                             "(atom_background_share; NaN: no atom)", "1"),
}
# per-snapshot arrays of the atoms (one slot each): name → (dims without time, long_name, units)
ATOM_ARRAYS = {
    "atom_position": (("atom", "xyz"), "atom positions on the unit sphere (NaN: no atom in the slot)", "1"),
    "atom_mass": (("atom",), "atom masses (0: no atom in the slot)", "1"),
    "atom_created": (("atom",), "creation time of the slot's atom (NaN: slot never used)", "1"),
}
# per-snapshot diagnostics of the atoms (one slot each), not part of the state a resume restores
ATOM_DIAGNOSTICS = {
    "atom_background_share": (("atom",), "share of the mesh density in the softmax weight at the atom, "
                              "Z_mesh / (Z_mesh + Z_atoms), largest over the heads (NaN: no atom, or beta = inf)", "1"),
}

# per-snapshot records of the tails from log f ([eulerian] tails = "log"): name → (long_name, units)
TAIL_META = {
    "tail_cells": ("cells whose density was taken from log f at the last coupling", "1"),
    "tail_mass_moved": ("mass the tail cells gained at the last coupling (taken from the bulk and the atoms)", "1"),
    "tail_drift": ("90th percentile over the tail cells of |log10(f_fv / f_log)| before the last coupling: the "
                   "finite volumes' drift from the characteristics over one coupling interval", "1"),
    "tail_retraced": ("centroids whose paths the last coupling retraced to the anchor, where the composed map "
                      "bends (tail_paths = selective), or traced back beyond its interval, where the maps do not "
                      "resolve them (tail_paths = backtrack)", "1"),
    "log_density_time": ("time of the last coupling, at which log_density and log_density_rate hold; a run "
                         "continues from the snapshots where it equals the time", "time"),
    "log_density_anchor": ("time of the last anchor, at which g was last interpolated and from which the paths "
                           "of the couplings since start; a run continues from the snapshots where it equals the "
                           "time", "time"),
}
# per-snapshot arrays of the tails (part of the state a resume restores)
TAIL_ARRAYS = {
    "log_density": (("cell",), "log f at the cell centroids, carried along characteristics (f in sr-1)", "1"),
    "log_density_rate": (("cell",), "rate of log f at the centroids over the last coupling interval, which the "
                         "tail cells follow until the next coupling", "1/time"),
}
# with tail_reference = "clusters": part of the state a resume restores
TAIL_PEAK_ARRAYS = {
    "atom_peak_log_density": (("atom",), "log of the peak density of the cluster each atom stands for (f in sr-1), "
                              "carried by Liouville along the atom's path since the coupling before its creation; "
                              "the reference of the tail level (NaN: no atom, or one made since the last coupling)", "1"),
}

# ---------------------------------------------------------------------- diagnostics of a measure
# name → (long_name, units) of the per-snapshot diagnostics of a measure
DIAGNOSTIC_META = {
    "alignment_E": ("∫|Q_E x|² dρ_t, Q_E orthogonal projector onto E (principal eigenspace of VBᵀ)", "1"),
    "alignment_F": ("∫|Q_F x|² dρ_t, Q_F orthogonal projector onto F (principal eigenspace of V)", "1"),
    "w2_to_projection": ("W₂(ρ_t, Π#ρ₀), chordal metric", "1"),
    "w2_across_E_perp": ("√(the part of W₂(ρ_t, Π#ρ₀)² paid by the mass that the optimal plan sends across "
                         "the hyperplane E⊥ (dim E = 1; NaN otherwise)): that mass costs ≥ 2 per unit", "1"),
    "lyapunov": ("V_p(ρ_t) = ∫ (|(I−P_E)x|²/|P_E x|²)^p dρ_t", "1"),
}

# ---------------------------------------------------------------------- a run: both solvers
SOLVER_META = dict(SNAPSHOT_META,
                   lower_bound_paper=("½ ℓ₀ exp(−C₀ t): the paper's density lower bound", "sr-1"))

PARTICLE_META = {f"particle_{k}": (f"particles: {v[0]}", v[1]) for k, v in DIAGNOSTIC_META.items()}
PARTICLE_META["w2_eulerian_particles"] = (
    "W₂ between the Eulerian and the particle measures (discrete OT on HEALPix bins)", "1")
PARTICLE_META["particle_field_evaluations"] = ("particle field evaluations since t = 0", "1")
CARRIED_META = {
    "particle_min_density": ("min over quadrature particles of the carried density", "sr-1"),
    "particle_max_density": ("max over quadrature particles of the carried density", "sr-1"),
}
# per-snapshot arrays of the particles: name → (dims without time, long_name, units)
PARTICLE_ARRAYS = {"positions": (("particle", "xyz"), "particle positions on the unit sphere", "1")}
SYSTEM_DIM = "system"  # batched token systems ([particles] systems > 1)
CLUSTER_DIM = "cluster"  # slots of the largest clusters


def component_dim(d: int) -> str:
    """The dimension of a position's coordinates: xyz on S² (the layout readers know), component
    for tokens on S^{d−1}, d ≠ 3."""
    return "xyz" if d == 3 else "component"


def particle_arrays(d: int = 3, systems: bool = False) -> dict:
    """The positions array: (particle, xyz) on S² for one system (PARTICLE_ARRAYS, unchanged),
    (particle, component) for d ≠ 3, with a leading system dimension for batched systems."""
    if d == 3 and not systems:
        return dict(PARTICLE_ARRAYS)
    dims = ((SYSTEM_DIM,) if systems else ()) + ("particle", component_dim(d))
    return {"positions": (dims, f"particle positions on the unit sphere S^{d - 1} in R^{d}", "1")}


# per-snapshot diagnostics of tokens in any d or batched (files of one system on S² keep the
# layout above without them): name → (long_name, units)
TOKEN_META = {
    "particle_energy": ("(1/β) ln ∬ e^{β⟨x, By⟩} dρ(x) dρ(y): the interaction energy ½β⁻¹∬e^{β⟨x,By⟩}dρdρ "
                        "on a log scale (one head at finite β; NaN otherwise)", "1"),
    "particle_cluster_count": ("number of clusters: connected components of the graph ⟨x_i, x_j⟩ ≥ 0.999", "1"),
}
TOKEN_CLUSTER_MASS = ("particle_cluster_mass", "masses of the largest clusters, decreasing (0: no such cluster)", "1")
CARRIED_ARRAYS = {
    "particle_density": (("particle",), "density carried along the characteristic", "sr-1"),
    # the state itself: exp and log do not round-trip exactly
    "particle_log_density": (("particle",), "log of the carried density", "1"),
}
PARTICLE_WEIGHTS = ("particle_weights", ("particle",), "particle weights (mass)", "1")
# per snapshot with an adaptive particle scheme (spherepde.solvers.adaptive): the step-size
# controller's state (what --resume reads back) and its counts; per system when batched
ADAPTIVE_META = {
    "particle_step_size": ("the step-size controller's next step (its state)", "1"),
    "particle_error_memory": ("the controller's memory: max(error ratio of the last accepted step, 1e-4)", "1"),
    "particle_steps": ("accepted adaptive steps since t = 0", "1"),
    "particle_steps_rejected": ("rejected adaptive steps since t = 0", "1"),
}
