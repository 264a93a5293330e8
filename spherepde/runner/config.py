"""Run configuration: TOML files, `--set` overrides, validation with one-line errors.

A config has the sections

    [model]        beta (number or "inf"), B, V (d×d nested lists, d = 3 on S², or a random law: "gaussian" |
                   "goe" | "wigner" | "orthogonal" | "identity", or the other matrix: "B", "-B", "V",
                   "-V"; spherepde.models.weights), weight_seed (integer ≥ 0) and weight_scale (> 0) of
                   the random laws. The resolved config holds the matrices, and `weights` records
                   the laws and seed they came from ("given" for two matrices).
                   dimension d (integer in [2, 4096]): tokens on S^{d−1}; the size of the given
                   matrices, else 3; random laws draw d×d. With d ≠ 3 only tokens run ([eulerian]
                   enabled defaults to false and true is refused, quadrature particles are refused),
                   and mu, mean and cov of [initial] have length d.
                   normalisation = "softmax" (default) | "unnormalised" (no division by the
                   partition function; finite beta only) and unnormalised_scale = "none" (default;
                   beta·‖B‖₂ ≤ 600) | "exp_beta" (the unnormalised field divided by e^{beta·‖B‖₂}).
                   noise (ν₀ ≥ 0, default 0: ∂_t f + div_S(f v) = ν(t)Δ_S f, Brownian tokens) with
                   noise_schedule ("constant" | "exponential" | "linear" | "piecewise"),
                   noise_time (τ > 0, for exponential and linear; recorded as none otherwise) and
                   noise_breakpoints ([[0, s₀], [t₁, s₁], …], factors of ν₀, for piecewise);
                   spherepde.models.noise. With ν₀ > 0: [eulerian] atoms defaults to false (true is
                   refused) and rk_order must be 2; quadrature particles drop their density.
    [[model.heads]]  several heads instead of B, V (spherepde.models.heads; the velocity is the SUM of the
                   heads' fields): tables of B, V (matrices or laws, as above) and beta (optional,
                   default [model] beta); at most 64.
    [[model.layers]] weights piecewise constant in depth instead of B, V: tables of start (the first
                   0, strictly increasing, < t_end), and B, V (and beta) or their own
                   [[model.layers.heads]]; at most 1000. The resolved config holds both as lists of
                   {start, heads = [{B, V, beta}]} (heads: [{B, V, beta}]), every β explicit.
    [initial]      kind = "uniform" | "vmf" (mu, kappa) | "mixture" (weights, components:
                   a list of {mu, kappa} tables) | "projected_normal" (mean, cov)
    [eulerian]     enabled (false: no Eulerian solve, the particles alone; needs [particles]),
                   nside (power of two; with enabled = false, the mesh of quadrature particles), scheme ("muscl" | "upwind"), cfl, rk_order (2 | 3),
                   summation ("auto" | "direct" | "tree" | "harmonic"), tolerance (of the tree, relative, in
                   (0, 1e-3]), near_field (true: exact kernel integrals near the peak),
                   velocity_tolerance (default 1e-3; ε in (0, 0.1]: evaluate the velocity every Δ
                   and extrapolate, relative edge-flux error ≈ ε/2; 0: exact at every stage), atoms (true: density
                   plus point masses for the clusters the mesh cannot resolve, spherepde.solvers.atoms)
                   with atom_width (creation threshold on the peak's width, cell sizes, (0, 3]),
                   atom_min_mass (in [0, 1)), atom_merge (merge distance, cell sizes, [0, 4]),
                   max_atoms (slots, 1 … 4096), atom_feeding (default false: atoms grow by
                   creation and merging only; true: mesh mass flowing into an atom's cell joins it),
                   atom_stalled_width (default 1.7; 0: off; else in [atom_width, 3]: a peak up to
                   this width whose maximum grows at less than half the flow's compression also
                   becomes an atom), atom_join (default 4; 0: off; at most 8: a stalled peak within
                   this many cell sizes of a heavier atom joins it instead of making a new atom);
                   both default to 0 below nside 8, whose cells are too wide for the rule;
                   atom_cut ("floor": a new atom's patch keeps min(f, its outer ring's least f);
                   "tail": min(f, the e^{linear} fit of its outer ring), which leaves a steep
                   background in place where the floor cuts a notch; default "tail" with
                   tails = "log", else "floor"); atom_shape ("point": a new atom is one point mass;
                   "sigma": four points of equal mass with the peak's centre and tangential
                   covariance, which move with the field averaged over the collapsing cluster and
                   merge as it collapses; default "sigma" with tails = "log", else "point"); tails ("finite_volume"
                   (default) | "log": the tails of f from log f carried along characteristics,
                   spherepde.solvers.tails; needs atoms, one head, no layers, no noise) with
                   tail_interval (longest time between couplings, default 0.2, (0, 1]; the save
                   times cut it too), tail_level (tail cells:
                   below this × the mesh's largest density, (0, 1)), tail_exclusion (cell sizes
                   around an atom kept by the finite volumes, [0, 8]), tail_exclusion_width
                   (default 1; the same neighbourhood at least this many kernel widths
                   (β σ_max(B))^{-1/2} wide, [0, 4]; 0: cell sizes only), tail_follow (default true:
                   between couplings the tail cells follow g's rate over the last interval;
                   false: the finite volumes move them), tail_anchor (time between two
                   interpolations of g, default 5.0, [0, 5]: a coupling in between follows its
                   paths back to the last one; 0: at every coupling), tail_path_step (longest RK4
                   step of those paths, default 0.05, (0, 1]), tail_path_tolerance (default 0: fixed
                   steps; > 0: a step is halved on the paths whose error estimate, Simpson's rule
                   minus the trapezoidal rule on div v, exceeds this many decades of g per unit
                   time, [0, 1]), tail_mass_correction ("downstream" (default since 2026-12-08):
                   the mass the tail cells gain at a substitution is paid by the bulk cell or atom
                   nearest to where the flow carries the cell in 2.0, shared with the payers
                   within 0.1 rad of it in proportion to their mass; "global": by the bulk and
                   the atoms in proportion to their mass; "local": by the nearest bulk cell or
                   atom, at most half of its mass, the rest globally), tail_paths (how a coupling
                   between anchors gets its paths: "maps" composes the last coupling's with its
                   own interval's, "retrace" retraces them to the anchor, "selective" composes
                   them and retraces a centroid once its map's error budget, carried along its
                   path, exceeds tail_retrace_tolerance decades of g, default 0.01, (0, 1];
                   "backtrack" (default) composes them where the map resolves the path (its quadratic and
                   cubic interpolants within tail_retrace_tolerance decades of g) and traces the
                   others on through the coupling interval before, back to the anchor at most),
                   tail_follow_bounds ("neighbours" (default): each followed tail cell stays
                   within the range of f over itself and its 8 neighbours at the last coupling,
                   so a front that has just passed is not extrapolated; "none": g's rate alone,
                   as before the bound), tail_path_scheme ("rk4" (default): g's paths in RK4
                   steps, Simpson on div v; "heun": the trapezoidal rule, a third of the
                   attention sums), tail_substeps (1: g's
                   paths see the states at the couplings, linear in time between them; k > 1:
                   the states after every step, k times the path steps), tail_step_states
                   (which coupling intervals cross the states after every step: "all"
                   (default; with tail_substeps > 1) or "atom_events", those in which an atom
                   was made or merged, tail_substeps RK4 steps between each two states),
                   tail_field_between (the field of g's paths between two couplings' states where
                   no step's state is kept: "steps" (default), the measure the solver held after
                   its steps (recorded at least 0.0125 apart), linear in time between them;
                   "measure", the field of the measure the solver holds then, the followed tail
                   cells exponential in time, the rest linear between the couplings' states;
                   "linear", the two fields linear in time, as runs before 2026-12-07),
                   tail_reference (what
                   tail_level is relative to: "mesh", the mesh's largest f, or "clusters"
                   (default), the largest of it and the peak density of every atom's cluster,
                   carried by Liouville along the atom's path; docs/numerics.md). The defaults
                   before 2026-12-07 (the third of them): tail_reference "mesh", tail_paths
                   "maps", tail_anchor 1.0, tail_path_step 0.1, tail_field_between "measure";
                   near_field_profile (the density inside a
                   near cell of the sums at the atoms, where the kernel is narrower than a cell:
                   "constant" (f_c) | "log_linear" (f_c e^{⟨γ, y − y_c⟩}/N_c, γ the limited slope
                   of ln f); default "log_linear" with tails = "log", else "constant")
    [particles]    optional: mode ("tokens": n i.i.d. samples of ρ₀ | "quadrature": one particle per
                   Eulerian cell carrying its density), n, seed, scheme ("euler" | "rk4": fixed step
                   dt | "dopri5" | "bs32": embedded pairs with error control, dt the first step,
                   rtol and atol (>= 0, 1e-14 <= atol + rtol <= 0.1) the tolerance of the error
                   norm, no noise; spherepde.solvers.adaptive),
                   systems (M ≥ 1: M independent draws of the tokens, seeds seed … seed + M − 1,
                   advanced together; M > 1 runs the tokens alone), summation ("auto": one system
                   on S² uses the summation of the Eulerian solver, everything else the batched
                   direct sum | "batched": always the batched direct sum), backend ("auto"
                   (default): the GPU when numba sees one and the run can use it, else the CPU |
                   "cpu" | "cuda": the tokens on the GPU, spherepde.solvers.device; refused without
                   a visible GPU, with noise and for quadrature particles). The resolved config
                   keeps the backend asked for, the run file's attribute particle_backend the one used.
                   precision ("fp64" (default) | "fp32": the GPU's sums in single precision;
                   needs backend = "cuda")
    [time]         t_end > 0, save_every in (0, t_end]
    [diagnostics]  p in (0, 1] (Lyapunov exponent), C0, C1 (optional constants of the bounds),
                   w2_nside (HEALPix level of the discrete OT when dim E > 1)
    [guards]       optional run guards: mass_tolerance (relative mass drift, default 1e-10),
                   negative_tolerance (f < −tol·max f fails, default 1e-14), dt_floor (smallest
                   Courant-limited step, default 1e-12); see spherepde.solvers.guards
    [output]       path of the NetCDF file

Every problem raises ConfigError with a message that names the key, e.g.
"[model] beta: must be a positive number or "inf", got -1". `resolve` fills in defaults and returns
plain Python data (JSON-serialisable), which is what the output file records.
"""

from __future__ import annotations

import copy
import difflib
import math
import tomllib
from pathlib import Path

import numpy as np

from ..models import weights
from ..models.attention import UNSCALED_EXPONENT_MAX
from ..models.checks import check_model
from ..models.heads import MAX_HEADS
from ..models.noise import SCHEDULES, NoiseSchedule
from ..solvers.particles import ADAPTIVE_SCHEMES, SCHEMES
from ..solvers.tails import (TAIL_EXCLUSION_WIDTH, TAIL_FIELD_BETWEEN, TAIL_FOLLOW_BOUNDS, TAIL_MASS_CORRECTIONS,
                             TAIL_PATH_SCHEMES, TAIL_PATHS, TAIL_RETRACE_TOLERANCE, TAIL_STEP_STATES)
from ..solvers.velocity import NEAR_FIELD_PROFILES
from .build import build_initial_law, build_model

__all__ = ["ConfigError", "DEFAULTS", "load", "parse_override", "apply_overrides", "resolve", "difference"]


class ConfigError(ValueError):
    """A bad configuration value; str(error) names the offending key."""


DEFAULTS = {
    "model": {"beta": None, "B": None, "V": None, "dimension": None, "weight_seed": 0, "weight_scale": 1.0,
              "weights": None,
              "normalisation": "softmax", "unnormalised_scale": "none",
              "noise": 0.0, "noise_schedule": "constant", "noise_time": None, "noise_breakpoints": None,
              "heads": None, "layers": None},
    "initial": {"kind": "uniform"},
    # velocity_tolerance 1e-3: the answers (F-onset, max alignment, min W₂, atom masses) stay
    # within 1e-3 of exact velocities at every stage, at a fraction of the time (docs/performance.md).
    # With tails = "log": the composed maps between anchors (1.03x the cost of interpolating g at
    # every coupling, where retracing costs 1.45x and more with the mesh), sigma atoms and the tail
    # cut (atom_shape, atom_cut: None resolves to them), the set whose F-onset converges at β = 30
    # (docs/numerics.md#atoms-that-keep-their-clusters-spread-atom_shape--sigma)
    "eulerian": {"enabled": True, "nside": 16, "scheme": "muscl", "cfl": 0.5, "rk_order": 2, "summation": "auto",
                 "tolerance": 1e-10, "near_field": True, "velocity_tolerance": 1e-3,
                 "atoms": True, "atom_width": 1.3, "atom_min_mass": 1e-4, "atom_merge": 0.5, "max_atoms": 64,
                 "atom_feeding": False, "atom_stalled_width": 1.7, "atom_join": 4.0,
                 "atom_cut": None, "atom_shape": None, "tails": "finite_volume", "tail_interval": 0.2, "tail_level": 1e-3,
                 "tail_exclusion": 3.0, "tail_exclusion_width": TAIL_EXCLUSION_WIDTH, "tail_follow": True,
                 # g within 0.05 decades of its own characteristics at β = 30 and 1000 (docs/numerics.md,
                 # backtracked maps through the steps' states); LogTails' own defaults are older
                 "tail_anchor": 5.0, "tail_path_step": 0.05, "tail_path_tolerance": 0.0,
                 "tail_mass_correction": "downstream", "tail_paths": "backtrack", "tail_field_between": "steps",
                 "tail_reference": "clusters", "tail_substeps": 1, "tail_step_states": "all",
                 "tail_retrace_tolerance": TAIL_RETRACE_TOLERANCE, "tail_follow_bounds": "neighbours",
                 "tail_path_scheme": "rk4", "near_field_profile": None},
    "time": {"t_end": None, "save_every": None},
    "particles": {"mode": "tokens", "n": 2000, "seed": 0, "scheme": "rk4", "dt": 0.01, "systems": 1,
                  "summation": "auto", "backend": "auto", "precision": "fp64", "rtol": 1e-6, "atol": 0.0},
    "diagnostics": {"p": 0.25, "C0": None, "C1": None, "w2_nside": 8},
    "guards": {"mass_tolerance": 1e-10, "negative_tolerance": 1e-14, "dt_floor": 1e-12},
    "output": {"path": None},
}

INITIAL_KEYS = {
    "uniform": set(),
    "vmf": {"mu", "kappa"},
    "mixture": {"weights", "components"},
    "projected_normal": {"mean", "cov"},
}

BETA_RANGE = (1e-3, 1e6)
# Largest noise ν: it makes any density uniform by t ~ 1/(2ν) = 5e-4, and the heat flow costs about
# 4 ν dt / h² sparse products per step (spherepde.transport.diffusion), so beyond it a run only slows.
NOISE_MAX = 1e3

BACKENDS = ("auto", "cpu", "cuda")  # [particles] backend (spherepde.solvers.device.BACKENDS)
PRECISIONS = ("fp64", "fp32")  # [particles] precision (spherepde.summation.cuda.PRECISIONS)
# [particles] rtol + atol: below 1e-14 the error norm is round-off; above 0.1 (a chord of 0.1
# per step on the unit sphere) it controls nothing
TOLERANCE_MIN, TOLERANCE_MAX = 1e-14, 0.1

MAX_DIMENSION = 4096
MAX_SYSTEMS = 4096
MAX_STATE = 2**26  # systems × n × d: one copy of the positions is at most 512 MiB

REQUIRED = [("model", "beta"), ("model", "B"), ("model", "V"), ("time", "t_end"), ("time", "save_every")]
MAX_LAYERS = 1000


def load(path) -> dict:
    """Read a run config (or sweep) TOML file, unchecked.

    Args:
        path: the TOML file (str or Path).

    Returns:
        The parsed document: section name → table (a dict of plain Python values), as written;
        `resolve` checks it and fills in the defaults.

    Raises:
        ConfigError: the file cannot be read, is not UTF-8 text, or is not valid TOML (the
            message names the path).
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a UTF-8 text file") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: malformed TOML ({exc})") from None


def parse_override(text: str):
    """Split one `--set` override.

    Args:
        text: `section.key=value`, the value in TOML syntax (`3.0`, `"inf"`, `[1, 2, 3]`,
            `true`); a value that is no TOML is taken as a bare string (`model.beta=inf`).

    Returns:
        (section, key, value).

    Raises:
        ConfigError: the text is not of the form `section.key=value`.
    """
    name, sep, raw = text.partition("=")
    parts = name.strip().split(".")
    if not sep or len(parts) != 2 or not all(parts):
        raise ConfigError(f"--set {text}: expected section.key=value")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return parts[0], parts[1], value


def apply_overrides(config: dict, overrides) -> dict:
    """A copy of a parsed config with `--set` overrides applied, in order (the last wins).

    Args:
        config: a parsed config (`load`), not changed.
        overrides: `section.key=value` strings (`parse_override`), or None.

    Returns:
        The new parsed config; a section the overrides name is created if missing (so
        `particles.n=500` adds a particle solver to a config without one).

    Raises:
        ConfigError: a malformed override, or one whose section is not a table.
    """
    config = copy.deepcopy(config)
    for text in overrides or ():
        section, key, value = parse_override(text)
        target = config.setdefault(section, {})
        if not isinstance(target, dict):
            raise ConfigError(f"--set {text}: [{section}] is not a section")
        target[key] = value
    return config


# ------------------------------------------------------------------ checks
def _number(section, key, value, *, positive=False, allow_inf=False, low=None, high=None):
    where = f"[{section}] {key}"
    if allow_inf and isinstance(value, str) and value.strip().lower() in ("inf", "infinity"):
        return math.inf
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        expect = 'a number or "inf"' if allow_inf else "a number"
        raise ConfigError(f"{where}: must be {expect}, got {value!r}")
    try:
        value = float(value)
    except OverflowError:  # an integer beyond double range
        raise ConfigError(f"{where}: must be finite, got an integer of {len(str(value))} digits") from None
    if math.isnan(value) or (math.isinf(value) and not (allow_inf and value > 0)):
        raise ConfigError(f"{where}: must be finite{' or +inf' if allow_inf else ''}, got {value!r}")
    if positive and value <= 0:
        raise ConfigError(f"{where}: must be > 0, got {value:g}")
    if low is not None and value < low:
        raise ConfigError(f"{where}: must be >= {low:g}, got {value:g}")
    if high is not None and value > high:
        raise ConfigError(f"{where}: must be <= {high:g}, got {value:g}")
    return value


def _vector(section, key, value, length=3):
    where = f"[{section}] {key}"
    if not isinstance(value, list) or len(value) != length:
        hint = "" if length == 3 else f" (d = {length}, [model] dimension)"
        raise ConfigError(f"{where}: must be a list of {length} numbers{hint}, got {value!r}")
    return [_number(section, f"{key}[{i}]", v) for i, v in enumerate(value)]


def _matrix(section, key, value, d=3):
    where = f"[{section}] {key}"
    if (not isinstance(value, list) or len(value) != d
            or not all(isinstance(row, list) and len(row) == d for row in value)):
        shape = _shape(value)
        rows = "three rows of three numbers" if d == 3 else f"{d} rows of {d} numbers; d = [model] dimension"
        raise ConfigError(f"{where}: must be a {d}×{d} matrix ({rows}), got shape {shape}")
    return [[_number(section, f"{key}[{i}][{j}]", v) for j, v in enumerate(row)] for i, row in enumerate(value)]


def _shape(value):
    if not isinstance(value, list):
        return type(value).__name__
    inner = {len(r) if isinstance(r, list) else None for r in value}
    return f"({len(value)}, {inner.pop()})" if len(inner) == 1 and None not in inner else f"({len(value)}, ragged)"


def _did_you_mean(name, allowed) -> str:
    """' (did you mean X?)' for the closest allowed name (difflib), else ''."""
    close = difflib.get_close_matches(str(name), [str(a) for a in allowed], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _check_keys(section, table, allowed):
    for key in table:
        if key not in allowed:
            raise ConfigError(f"[{section}] {key}: unknown key{_did_you_mean(key, allowed)} "
                              f"(allowed: {', '.join(sorted(allowed)) or 'none'})")


def _weight_settings(model, given):
    """Check weight_seed and weight_scale (and refuse a given `weights`)."""
    if "weights" in given:
        raise ConfigError("[model] weights: set by spherepde (the record of the laws of B and V); "
                          "give B, V and weight_seed instead")
    seed = model["weight_seed"]
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"[model] weight_seed: must be an integer >= 0, got {seed!r}")
    model["weight_scale"] = _number("model", "weight_scale", model["weight_scale"], positive=True)


def _resolve_weights(model, given):
    """B and V as matrices (a law of spherepde.models.weights drawn with weight_seed, or the other
    matrix); model["weights"] records where they came from."""
    _weight_settings(model, given)
    seed, d = model["weight_seed"], model["dimension"]
    names = weights.LAWS + weights.REFERENCES
    for key in ("B", "V"):
        if isinstance(model[key], str):
            if model[key] not in names:
                raise ConfigError(f"[model] {key}: must be a {d}×{d} matrix or one of "
                                  f"{', '.join(map(repr, names))}, got {model[key]!r}")
        else:
            model[key] = _matrix("model", key, model[key], d)
    laws = {k: model[k] for k in ("B", "V") if isinstance(model[k], str)}
    try:
        B, V = weights.resolve_weights(model["B"], model["V"], seed, model["weight_scale"], dim=d)
    except ValueError as exc:
        raise ConfigError(f"[model] {exc}") from None
    model["B"], model["V"] = B.tolist(), V.tolist()
    model["weights"] = "given"
    if laws:
        model["weights"] = (", ".join(f"{k} = {v}" for k, v in laws.items())
                            + f" (weight_seed {seed}, weight_scale {model['weight_scale']:g})")


def _beta_value(section, value):
    """A β: a positive number in BETA_RANGE or "inf"."""
    beta = _number(section, "beta", value, positive=True, allow_inf=True)
    if not math.isinf(beta) and not (BETA_RANGE[0] <= beta <= BETA_RANGE[1]):
        raise ConfigError(f'[{section}] beta: must be in [{BETA_RANGE[0]:g}, {BETA_RANGE[1]:g}] or "inf" '
                          f"(the validated range of the attention sum), got {beta:g}")
    return beta


def _combined(model) -> bool:
    return model.get("heads") is not None or model.get("layers") is not None


def _resolve_head(section, table, beta, seed, scale, key, laws, d=3):
    """One head {B, V, beta} of a combined model (spherepde.models.heads), checked as [model] is; the
    laws drawn from the stream `key`, recorded in laws."""
    for name in ("B", "V"):
        if name not in table:
            raise ConfigError(f"[{section}] {name}: required")
    given = {}
    names = weights.LAWS + weights.REFERENCES
    for name in ("B", "V"):
        value = table[name]
        if isinstance(value, str):
            if value not in names:
                raise ConfigError(f"[{section}] {name}: must be a {d}×{d} matrix or one of "
                                  f"{', '.join(map(repr, names))}, got {value!r}")
            given[name] = value
        else:
            given[name] = _matrix(section, name, value, d)
    beta = _beta_value(section, table["beta"]) if "beta" in table else beta
    try:
        B, V = weights.resolve_weights(given["B"], given["V"], seed, scale, key, dim=d)
        check_model(B, V, beta)
    except ValueError as exc:
        raise ConfigError(f"[{section}] {exc}") from None
    if math.isinf(beta) and np.linalg.matrix_rank(B) < d:
        raise ConfigError(f'[{section}] B: beta = "inf" needs an invertible B (the field divides by |Bᵀx|)')
    drawn = [f"{name} = {given[name]}" for name in ("B", "V") if isinstance(given[name], str)]
    if drawn:
        laws.append(f"{section.removeprefix('model.')}: {', '.join(drawn)}")
    return {"B": B.tolist(), "V": V.tolist(), "beta": "inf" if math.isinf(beta) else beta}


def _resolve_heads(section, value, beta, seed, scale, key, laws, d=3):
    """The heads list of [model] or of a layer: [{B, V, beta}], each β explicit."""
    where = f"{section}.heads"
    if not isinstance(value, list) or not value or not all(isinstance(h, dict) for h in value):
        raise ConfigError(f"[{section}] heads: must be a non-empty list of tables [[{where}]] with B, V "
                          f"(and beta), got {value!r}"[:300])
    if len(value) > MAX_HEADS:
        raise ConfigError(f"[{section}] heads: at most {MAX_HEADS} heads are supported, got {len(value)}")
    out = []
    for h, table in enumerate(value):
        head_section = f"{where}[{h}]"
        _check_keys(head_section, table, {"B", "V", "beta"})
        out.append(_resolve_head(head_section, table, beta, seed, scale, key + (h,), laws, d))
    return out


def _resolve_layers(value, beta, seed, scale, laws, d=3):
    """[[model.layers]] as [{start, heads: [{B, V, beta}]}] (start < t_end is checked with [time])."""
    if not isinstance(value, list) or not value or not all(isinstance(k, dict) for k in value):
        raise ConfigError("[model] layers: must be a non-empty list of tables [[model.layers]] with start "
                          f"and B, V (or heads), got {value!r}"[:300])
    if len(value) > MAX_LAYERS:
        raise ConfigError(f"[model] layers: at most {MAX_LAYERS} layers are supported, got {len(value)}")
    out = []
    for k, table in enumerate(value):
        section = f"model.layers[{k}]"
        _check_keys(section, table, {"start", "B", "V", "beta", "heads"})
        if "start" not in table:
            raise ConfigError(f"[{section}] start: required (the time at which the layer begins)")
        start = _number(section, "start", table["start"], low=0.0)
        if k == 0 and start != 0.0:
            raise ConfigError(f"[{section}] start: the first layer must start at 0, got {start:g}")
        if k > 0 and not start > out[-1]["start"]:
            raise ConfigError(f"[{section}] start: must be > the previous layer's start "
                              f"{out[-1]['start']:g} (strictly increasing), got {start:g}")
        layer_beta = _beta_value(section, table["beta"]) if "beta" in table else beta
        if "heads" in table:
            for name in ("B", "V"):
                if name in table:
                    raise ConfigError(f"[{section}] {name}: not with heads (give B and V in each "
                                      "[[model.layers.heads]] table)")
            heads = _resolve_heads(section, table["heads"], layer_beta, seed, scale, (3, k, 2), laws, d)
        else:
            head = {name: table[name] for name in ("B", "V") if name in table}
            for name in ("B", "V"):
                if name not in table:
                    raise ConfigError(f"[{section}] {name}: required (or the layer's [[model.layers.heads]])")
            heads = [_resolve_head(section, head, layer_beta, seed, scale, (3, k), laws, d)]
        out.append({"start": start, "heads": heads})
    return out


def _resolve_combined(model, given):
    """[[model.heads]] or [[model.layers]] (spherepde.models.heads) in place of B and V."""
    for name in ("B", "V"):
        if given.get(name) is not None:
            which = "layers" if model["layers"] is not None else "heads"
            raise ConfigError(f"[model] {name}: not with [[model.{which}]] (give B and V in each "
                              f"[[model.{which}]] table instead)")
    if model["heads"] is not None and model["layers"] is not None:
        raise ConfigError("[model] layers: not with [[model.heads]] as well (give each layer its own "
                          "[[model.layers.heads]])")
    _weight_settings(model, given)
    seed, scale, laws = model["weight_seed"], model["weight_scale"], []
    if model["heads"] is not None:
        model["heads"] = _resolve_heads("model", model["heads"], model["beta"], seed, scale, (2,), laws,
                                        model["dimension"])
    else:
        model["layers"] = _resolve_layers(model["layers"], model["beta"], seed, scale, laws, model["dimension"])
    model["weights"] = "given" if not laws else "; ".join(laws) + f" (weight_seed {seed}, weight_scale {scale:g})"


def _resolve_normalisation(model):
    """[model] normalisation and unnormalised_scale (spherepde.models.attention.AttentionModel)."""
    if model["normalisation"] not in ("softmax", "unnormalised"):
        raise ConfigError('[model] normalisation: must be "softmax" or "unnormalised", '
                          f'got {model["normalisation"]!r}')
    if model["unnormalised_scale"] not in ("none", "exp_beta"):
        raise ConfigError('[model] unnormalised_scale: must be "none" or "exp_beta", '
                          f'got {model["unnormalised_scale"]!r}')
    if model["normalisation"] != "unnormalised":
        return
    # every head of every layer: one normalisation for the whole model (spherepde.models.heads)
    for section, beta, B in _heads_for_checks(model):
        if math.isinf(beta):
            raise ConfigError(f'[{section}] beta: normalisation = "unnormalised" has no beta = "inf" limit '
                              '(the field grows like e^beta); give a finite beta or normalisation = "softmax"')
        exponent = beta * float(np.linalg.norm(np.array(B), 2))
        if model["unnormalised_scale"] == "none" and exponent > UNSCALED_EXPONENT_MAX:
            raise ConfigError(f'[model] unnormalised_scale: "none" overflows for beta·‖B‖₂ = {exponent:.4g} > '
                              f'{UNSCALED_EXPONENT_MAX:g} ([{section}]); use "exp_beta"')


def _heads_for_checks(model):
    """(section, β, B) of every head of a resolved [model]: the model itself, its heads, or the
    heads of its layers."""
    def beta_of(value):
        return math.inf if value == "inf" else float(value)

    if model.get("heads") is not None:
        return [(f"model.heads[{h}]", beta_of(head["beta"]), head["B"]) for h, head in enumerate(model["heads"])]
    if model.get("layers") is not None:
        return [(f"model.layers[{k}]" + (f".heads[{h}]" if len(layer["heads"]) > 1 else ""),
                 beta_of(head["beta"]), head["B"])
                for k, layer in enumerate(model["layers"]) for h, head in enumerate(layer["heads"])]
    return [("model", beta_of(model["beta"]), model["B"])]


def resolve(raw: dict) -> dict:
    """Check a parsed config and fill in the defaults: what `spherepde run` runs.

    Every section is checked in turn ([model], [initial], [eulerian], [time], [particles],
    [diagnostics], [guards], [output]; the keys and their ranges are in the module docstring and
    docs/running.md), random weight laws are drawn (`weight_seed`), and the model and the
    initial law are built once to make sure they can be.

    Args:
        raw: a parsed config, from `load` / `apply_overrides` or written as a dict of sections,
            e.g. `{"model": {"beta": 10.0, "B": ..., "V": ...}, "time": {"t_end": 4.0,
            "save_every": 0.5}}`. Not changed.

    Returns:
        The resolved config: every section with every key, plain JSON-serialisable data (the
        run file stores it as its `config` attribute); `particles` is None without a
        [particles] section. This is what `spherepde.runner.run.execute` takes.

    Raises:
        ConfigError: the first bad, unknown or missing key; the message names it, e.g.
            `[model] beta: must be a positive number or "inf", got -1`.
    """
    cfg = _with_defaults(raw)
    given = {section: raw.get(section, {}) for section in DEFAULTS}  # the keys the file sets
    noisy = _resolve_model(cfg["model"], given["model"])
    cfg["initial"] = _resolve_initial(cfg["initial"], cfg["model"]["dimension"])
    _resolve_eulerian(cfg["eulerian"], given["eulerian"], cfg["model"], noisy, cfg["particles"])
    _resolve_time(cfg["time"], cfg["model"])
    if cfg["particles"] is not None:
        zero_temperature = any(math.isinf(beta) for _, beta, _ in _heads_for_checks(cfg["model"]))
        _resolve_particles(cfg["particles"], cfg["time"], cfg["model"]["dimension"], cfg["eulerian"]["enabled"],
                           noisy, zero_temperature)
        _resolve_backend(cfg["particles"], noisy)
    _resolve_diagnostics(cfg["diagnostics"])
    _resolve_guards(cfg["guards"])
    _resolve_output(cfg["output"])
    # a config that resolves must build: the model and the law refuse what the checks above
    # let through (e.g. mu = [0, 0, 1e-162], whose norm underflows)
    builders = (("model", build_model), ("initial", lambda spec: build_initial_law(spec, cfg["model"]["dimension"])))
    for section, build in builders:
        try:
            build(cfg[section])
        except ValueError as exc:
            raise ConfigError(f"[{section}] {exc}") from None
    return cfg


def _with_defaults(raw) -> dict:
    """The sections of a parsed config over the defaults: unknown sections and keys refused
    ([initial] keys depend on its kind: checked there), required keys present."""
    if not isinstance(raw, dict):
        raise ConfigError("config: must be a TOML document of sections")
    for section, table in raw.items():
        if section not in DEFAULTS:
            raise ConfigError(f"[{section}]: unknown section{_did_you_mean(section, DEFAULTS)} "
                              f"(allowed: {', '.join(DEFAULTS)})")
        if not isinstance(table, dict):
            raise ConfigError(f"[{section}]: must be a table of keys, got {table!r}")
    cfg = {s: dict(d) for s, d in DEFAULTS.items()}
    if "particles" not in raw:
        cfg["particles"] = None  # optional section: no particle solver
    for section, table in raw.items():
        if section != "initial":
            _check_keys(section, table, DEFAULTS[section])
        cfg[section].update(table)
    for section, key in REQUIRED:
        if cfg[section][key] is None:
            if section == "model" and key in ("B", "V") and _combined(cfg["model"]):
                continue  # each head or layer has its own
            raise ConfigError(f"[{section}] {key}: required")
    return cfg


def _resolve_model(model, given) -> bool:
    """[model] in place: β, the matrices (or heads, layers), normalisation, noise. True when there
    is noise."""
    model["beta"] = _beta_value("model", model["beta"])
    model["dimension"] = _dimension(model, given)
    if _combined(model):  # several heads or layers (spherepde.models.heads): each checked like [model]
        _resolve_combined(model, given)
    else:
        _resolve_weights(model, given)
        try:
            check_model(model["B"], model["V"], model["beta"])
        except ValueError as exc:
            raise ConfigError(f"[model] {exc}") from None
        if math.isinf(model["beta"]) and np.linalg.matrix_rank(np.array(model["B"])) < model["dimension"]:
            raise ConfigError('[model] B: beta = "inf" needs an invertible B (the field divides by |Bᵀx|)')
    _resolve_normalisation(model)
    if math.isinf(model["beta"]):
        model["beta"] = "inf"  # JSON has no infinity
    return _resolve_noise(model)


def _dimension(model, given) -> int:
    """d of [model]: `dimension` when given, else the size of the first given matrix (B, V, of a
    head or a layer), else 3. The matrices are checked against it afterwards."""
    if "dimension" in given:
        d = given["dimension"]
        if isinstance(d, bool) or not isinstance(d, int) or not 2 <= d <= MAX_DIMENSION:
            raise ConfigError(f"[model] dimension: must be an integer in [2, {MAX_DIMENSION}] (tokens on "
                              f"S^(d-1)), got {d!r}")
        return d
    tables = [model]
    entries = [e for key in ("heads", "layers") if isinstance(model.get(key), list) for e in model[key]]
    for entry in entries:  # (malformed lists are refused when the heads and layers are resolved)
        if isinstance(entry, dict):
            tables.append(entry)
            heads = entry.get("heads")
            tables.extend(h for h in (heads if isinstance(heads, list) else []) if isinstance(h, dict))
    for table in tables:
        for name in ("B", "V"):
            value = table.get(name)
            if isinstance(value, list) and len(value) >= 2:
                return len(value)
    return 3


def _resolve_eulerian(eul, given, model, noisy, particles):
    """[eulerian] in place (given: the keys the file sets, on which some defaults depend)."""
    d = model["dimension"]
    if d != 3:  # the mesh is S²: tokens alone
        if particles is None:
            raise ConfigError(f"[particles]: required for d = {d} ([model] dimension): off S² only tokens run")
        if given.get("enabled") is True:
            raise ConfigError(f"[eulerian] enabled: the Eulerian solver is on S² (d = 3), but [model] dimension "
                              f"d = {d}: set enabled = false (the default for d != 3)")
        eul["enabled"] = eul["enabled"] if "enabled" in given else False
    if not isinstance(eul["enabled"], bool):
        raise ConfigError(f"[eulerian] enabled: must be true or false, got {eul['enabled']!r}")
    if not eul["enabled"] and particles is None:
        raise ConfigError("[eulerian] enabled: false needs a [particles] section (the run would solve nothing)")
    nside = eul["nside"]
    if isinstance(nside, bool) or not isinstance(nside, int) or nside < 1 or nside & (nside - 1):
        raise ConfigError(f"[eulerian] nside: must be a positive power of two, got {nside!r}")
    if nside > 1024:
        raise ConfigError(f"[eulerian] nside: at most 1024 is supported, got {nside}")
    if eul["scheme"] not in ("muscl", "upwind"):
        raise ConfigError(f'[eulerian] scheme: must be "muscl" or "upwind", got {eul["scheme"]!r}')
    eul["cfl"] = _number("eulerian", "cfl", eul["cfl"], positive=True, high=1.0)
    if eul["rk_order"] not in (2, 3) or isinstance(eul["rk_order"], bool):
        raise ConfigError(f"[eulerian] rk_order: must be 2 or 3, got {eul['rk_order']!r}")
    if eul["summation"] not in ("auto", "direct", "tree", "harmonic"):
        raise ConfigError('[eulerian] summation: must be "auto", "direct", "tree" or "harmonic", '
                          f'got {eul["summation"]!r}')
    eul["tolerance"] = _number("eulerian", "tolerance", eul["tolerance"], positive=True, high=1e-3)
    eul["velocity_tolerance"] = _number("eulerian", "velocity_tolerance", eul["velocity_tolerance"],
                                        low=0.0, high=0.1)
    if not isinstance(eul["near_field"], bool):
        raise ConfigError(f"[eulerian] near_field: must be true or false, got {eul['near_field']!r}")
    if not isinstance(eul["atoms"], bool):
        raise ConfigError(f"[eulerian] atoms: must be true or false, got {eul['atoms']!r}")
    eul["atom_width"] = _number("eulerian", "atom_width", eul["atom_width"], positive=True, high=3.0)
    eul["atom_min_mass"] = _number("eulerian", "atom_min_mass", eul["atom_min_mass"], low=0.0, high=1.0)
    if eul["atom_min_mass"] >= 1.0:
        raise ConfigError(f"[eulerian] atom_min_mass: must be < 1 (a fraction of the total mass), "
                          f"got {eul['atom_min_mass']:g}")
    eul["atom_merge"] = _number("eulerian", "atom_merge", eul["atom_merge"], low=0.0, high=4.0)
    if nside < STALLED_RULE_MIN_NSIDE:
        # a cell of nside ≤ 4 is ≥ 0.5 rad wide: a peak 1.7 cells wide is a third of a hemisphere,
        # not a cluster (measured: tests/models/test_schedule.py's vMF κ = 3 run made half its mass one atom
        # at t = 0.4 and W₂ to Π#ρ jumped by 0.085; at nside 8 and 16 it makes none). Off unless set.
        for key in ("atom_stalled_width", "atom_join"):
            if key not in given:
                eul[key] = 0.0
    eul["atom_stalled_width"] = _number("eulerian", "atom_stalled_width", eul["atom_stalled_width"], low=0.0,
                                        high=3.0)
    if "atom_stalled_width" not in given and eul["atom_stalled_width"] > 0.0:
        # the default band (atom_width, 1.7] is empty for a wider atom_width: the rule then adds nothing
        eul["atom_stalled_width"] = max(eul["atom_stalled_width"], eul["atom_width"])
    if 0.0 < eul["atom_stalled_width"] < eul["atom_width"]:
        raise ConfigError(f"[eulerian] atom_stalled_width: must be 0 (off) or ≥ atom_width = {eul['atom_width']:g}, "
                          f"got {eul['atom_stalled_width']:g}")
    eul["atom_join"] = _number("eulerian", "atom_join", eul["atom_join"], low=0.0, high=8.0)
    if eul["atom_join"] > 0.0 and eul["atom_stalled_width"] == 0.0 and "atom_join" in given:
        raise ConfigError(f"[eulerian] atom_join: acts on stalled peaks only, so it needs atom_stalled_width > 0 "
                          f"(got atom_join = {eul['atom_join']:g} with atom_stalled_width = 0; it is 0 by "
                          f"default below nside {STALLED_RULE_MIN_NSIDE})")
    if not isinstance(eul["atom_feeding"], bool):
        raise ConfigError(f"[eulerian] atom_feeding: must be true or false, got {eul['atom_feeding']!r}")
    if eul["tails"] not in TAIL_KINDS:
        raise ConfigError(f'[eulerian] tails: must be "finite_volume" or "log", got {eul["tails"]!r}')
    # with the tails from log f the background beside a cluster steers the F-phase: a new atom keeps
    # its cluster's spread and leaves that background in place, which is what makes the F-onset
    # converge with the mesh (docs/numerics.md#atoms-that-keep-their-clusters-spread-atom_shape--sigma)
    if eul["atom_cut"] is None:
        eul["atom_cut"] = "tail" if eul["tails"] == "log" else "floor"
    if eul["atom_shape"] is None:
        eul["atom_shape"] = "sigma" if eul["tails"] == "log" else "point"
    if eul["atom_cut"] not in ATOM_CUTS:
        raise ConfigError(f'[eulerian] atom_cut: must be "floor" or "tail", got {eul["atom_cut"]!r}')
    if eul["atom_shape"] not in ATOM_SHAPES:
        raise ConfigError(f'[eulerian] atom_shape: must be "point" or "sigma", got {eul["atom_shape"]!r}')
    eul["tail_interval"] = _number("eulerian", "tail_interval", eul["tail_interval"], positive=True, high=1.0)
    eul["tail_level"] = _number("eulerian", "tail_level", eul["tail_level"], positive=True, high=1.0)
    if eul["tail_level"] >= 1.0:
        raise ConfigError(f"[eulerian] tail_level: must be < 1 (a fraction of the largest density), "
                          f"got {eul['tail_level']:g}")
    eul["tail_exclusion"] = _number("eulerian", "tail_exclusion", eul["tail_exclusion"], low=0.0, high=8.0)
    eul["tail_exclusion_width"] = _number("eulerian", "tail_exclusion_width", eul["tail_exclusion_width"],
                                          low=0.0, high=4.0)
    if not isinstance(eul["tail_follow"], bool):
        raise ConfigError(f"[eulerian] tail_follow: must be true or false, got {eul['tail_follow']!r}")
    eul["tail_anchor"] = _number("eulerian", "tail_anchor", eul["tail_anchor"], low=0.0, high=5.0)
    eul["tail_path_step"] = _number("eulerian", "tail_path_step", eul["tail_path_step"], positive=True, high=1.0)
    eul["tail_path_tolerance"] = _number("eulerian", "tail_path_tolerance", eul["tail_path_tolerance"], low=0.0,
                                         high=1.0)
    if eul["tail_paths"] not in TAIL_PATHS:
        raise ConfigError(f'[eulerian] tail_paths: must be "retrace", "maps", "selective" or "backtrack", '
                          f'got {eul["tail_paths"]!r}')
    if eul["tail_path_scheme"] not in TAIL_PATH_SCHEMES:
        raise ConfigError(f'[eulerian] tail_path_scheme: must be "rk4" or "heun", got {eul["tail_path_scheme"]!r}')
    if eul["tail_mass_correction"] not in TAIL_MASS_CORRECTIONS:
        raise ConfigError(f'[eulerian] tail_mass_correction: must be "global", "local" or "downstream", '
                          f'got {eul["tail_mass_correction"]!r}')
    if eul["tail_path_tolerance"] > 0.0 and eul["tail_path_scheme"] != "rk4":
        raise ConfigError(f'[eulerian] tail_path_tolerance: halves RK4 steps only (tail_path_scheme "rk4"), '
                          f'got {eul["tail_path_tolerance"]:g} with tail_path_scheme {eul["tail_path_scheme"]!r}')
    if eul["tail_follow_bounds"] not in TAIL_FOLLOW_BOUNDS:
        raise ConfigError(f'[eulerian] tail_follow_bounds: must be "none" or "neighbours", '
                          f'got {eul["tail_follow_bounds"]!r}')
    eul["tail_retrace_tolerance"] = _number("eulerian", "tail_retrace_tolerance", eul["tail_retrace_tolerance"],
                                            positive=True, high=1.0)
    if eul["tail_reference"] not in TAIL_LEVEL_REFERENCES:
        raise ConfigError(f'[eulerian] tail_reference: must be "mesh" or "clusters", got {eul["tail_reference"]!r}')
    substeps = eul["tail_substeps"]
    if isinstance(substeps, bool) or not isinstance(substeps, int) or not 1 <= substeps <= 16:
        raise ConfigError(f"[eulerian] tail_substeps: must be an integer from 1 to 16, got {substeps!r}")
    if eul["tail_step_states"] not in TAIL_STEP_STATES:
        raise ConfigError(f'[eulerian] tail_step_states: must be "all" or "atom_events", got {eul["tail_step_states"]!r}')
    if eul["tail_field_between"] not in TAIL_FIELD_BETWEEN:
        raise ConfigError(f'[eulerian] tail_field_between: must be "linear", "measure" or "steps", '
                          f'got {eul["tail_field_between"]!r}')
    if eul["near_field_profile"] is None:  # the tails' slopes are accurate; the finite volumes' are not
        eul["near_field_profile"] = "log_linear" if eul["tails"] == "log" else "constant"
    if eul["near_field_profile"] not in NEAR_FIELD_PROFILES:
        raise ConfigError(f'[eulerian] near_field_profile: must be "constant" or "log_linear", '
                          f'got {eul["near_field_profile"]!r}')
    if eul["tails"] == "log":
        if not eul["atoms"] or noisy:
            raise ConfigError('[eulerian] tails: "log" needs atoms = true and no noise ([eulerian] atoms, '
                              '[model] noise)')
        if model.get("layers") is not None or len(model.get("heads") or [None]) > 1:
            raise ConfigError('[eulerian] tails: "log" needs one head and no layers ([model] heads, [model] layers)')
    cap = eul["max_atoms"]
    if isinstance(cap, bool) or not isinstance(cap, int) or not 1 <= cap <= 4096:
        raise ConfigError(f"[eulerian] max_atoms: must be an integer in [1, 4096], got {cap!r}")
    if noisy:
        if eul["atoms"] and "atoms" in given:
            raise ConfigError(f"[eulerian] atoms: point masses do not survive noise ([model] noise = "
                              f"{model['noise']:g} > 0): set atoms = false, the default with noise")
        eul["atoms"] = False
        if eul["rk_order"] != 2:
            raise ConfigError(f"[eulerian] rk_order: must be 2 with noise ([model] noise = {model['noise']:g} > 0: "
                              f"the integrating-factor step of the diffusion), got {eul['rk_order']}")


def _resolve_time(tm, model):
    """[time] in place; every layer must start before t_end."""
    tm["t_end"] = _number("time", "t_end", tm["t_end"], positive=True)
    tm["save_every"] = _number("time", "save_every", tm["save_every"], positive=True)
    if tm["save_every"] > tm["t_end"]:
        raise ConfigError(f"[time] save_every: must be <= t_end = {tm['t_end']:g}, got {tm['save_every']:g}")
    if tm["t_end"] / tm["save_every"] > 100_000:
        raise ConfigError(f"[time] save_every: more than 100000 snapshots ({tm['t_end']:g}/{tm['save_every']:g})")
    for k, layer in enumerate(model["layers"] or ()):
        if layer["start"] >= tm["t_end"]:
            raise ConfigError(f"[model.layers[{k}]] start: must be < t_end = {tm['t_end']:g}, got {layer['start']:g}")


def _resolve_diagnostics(dg):
    """[diagnostics] in place."""
    dg["p"] = _number("diagnostics", "p", dg["p"], positive=True, high=1.0)
    for key in ("C0", "C1"):
        if dg[key] is not None:
            dg[key] = _number("diagnostics", key, dg[key])
    w2 = dg["w2_nside"]
    if isinstance(w2, bool) or not isinstance(w2, int) or w2 < 1 or w2 & (w2 - 1) or w2 > 32:
        raise ConfigError(f"[diagnostics] w2_nside: must be a power of two <= 32, got {w2!r}")


def _resolve_guards(gd):
    """[guards] in place."""
    gd["mass_tolerance"] = _number("guards", "mass_tolerance", gd["mass_tolerance"], positive=True)
    gd["negative_tolerance"] = _number("guards", "negative_tolerance", gd["negative_tolerance"], low=0.0)
    gd["dt_floor"] = _number("guards", "dt_floor", gd["dt_floor"], positive=True)


def _resolve_output(out):
    """[output] in place."""
    if out["path"] is not None and (not isinstance(out["path"], str) or not out["path"].strip()):
        raise ConfigError(f"[output] path: must be a non-empty string, got {out['path']!r}")


def _resolve_noise(model) -> bool:
    """Check the noise keys of [model] in place; True when there is noise (ν ≢ 0). Keys that the
    schedule does not use are recorded as None."""
    model["noise"] = _number("model", "noise", model["noise"], low=0.0, high=NOISE_MAX)
    schedule = model["noise_schedule"]
    if not isinstance(schedule, str) or schedule not in SCHEDULES:
        raise ConfigError(f"[model] noise_schedule: must be one of {', '.join(map(repr, SCHEDULES))}, "
                          f"got {schedule!r}")
    if model["noise_time"] is not None:
        model["noise_time"] = _number("model", "noise_time", model["noise_time"], positive=True)
    if schedule in ("exponential", "linear"):
        if model["noise_time"] is None:
            raise ConfigError(f'[model] noise_time: required by noise_schedule = "{schedule}" '
                              "(the time scale τ of the decay)")
    else:
        model["noise_time"] = None
    points = model["noise_breakpoints"]
    if schedule == "piecewise":
        if points is None:
            raise ConfigError('[model] noise_breakpoints: required by noise_schedule = "piecewise" '
                              "([[0, s0], [t1, s1], ...]: times and factors of noise)")
        if not isinstance(points, list) or not points:
            raise ConfigError(f"[model] noise_breakpoints: must be a non-empty list of [t, factor] pairs, "
                              f"got {points!r}")
        checked = []
        for i, pair in enumerate(points):
            if not isinstance(pair, list) or len(pair) != 2:
                raise ConfigError(f"[model] noise_breakpoints[{i}]: must be a pair [t, factor], got {pair!r}")
            t = _number("model", f"noise_breakpoints[{i}][0]", pair[0], low=0.0)
            factor = _number("model", f"noise_breakpoints[{i}][1]", pair[1], low=0.0)
            if i == 0 and t != 0.0:
                raise ConfigError(f"[model] noise_breakpoints[0][0]: the first time must be 0, got {t:g}")
            if i > 0 and t <= checked[-1][0]:
                raise ConfigError(f"[model] noise_breakpoints[{i}][0]: times must increase, got {t:g} "
                                  f"after {checked[-1][0]:g}")
            checked.append([t, factor])
        largest = model["noise"] * max(f for _, f in checked)
        if largest > NOISE_MAX:
            raise ConfigError(f"[model] noise_breakpoints: noise × the largest factor = {largest:g}, must be "
                              f"<= {NOISE_MAX:g} (as noise itself)")
        model["noise_breakpoints"] = checked
    else:
        model["noise_breakpoints"] = None
    return not NoiseSchedule(model["noise"], schedule, model["noise_time"], model["noise_breakpoints"]).is_zero


def _resolve_particles(pt, tm, d=3, eulerian=True, noisy=False, zero_temperature=False):
    if pt["mode"] not in ("tokens", "quadrature"):
        raise ConfigError(f'[particles] mode: must be "tokens" or "quadrature", got {pt["mode"]!r}')
    if pt["mode"] == "quadrature" and d != 3:
        raise ConfigError(f'[particles] mode: quadrature particles live on the HEALPix mesh of S² (d = 3), but '
                          f'[model] dimension d = {d}: use mode = "tokens"')
    n = pt["n"]
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 1_000_000:
        raise ConfigError(f"[particles] n: must be an integer in [1, 1000000], got {n!r}")
    seed = pt["seed"]
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"[particles] seed: must be an integer >= 0, got {seed!r}")
    if pt["scheme"] not in SCHEMES:
        raise ConfigError(f'[particles] scheme: must be one of {", ".join(map(repr, SCHEMES))}, got {pt["scheme"]!r}')
    if pt["scheme"] in ADAPTIVE_SCHEMES and noisy:
        raise ConfigError(f'[particles] scheme: the adaptive scheme {pt["scheme"]!r} takes no noise ([model] noise '
                          '> 0; its error control sees the drift alone): use "euler" or "rk4"')
    if pt["scheme"] in ADAPTIVE_SCHEMES and zero_temperature and pt["mode"] == "tokens":
        raise ConfigError(f'[particles] scheme: the adaptive scheme {pt["scheme"]!r} needs a smooth field, but tokens '
                          'at beta = "inf" follow the hardmax rule, whose argmax switches and chatters (steps '
                          'collapse to ~1e-5): use "rk4"')
    pt["rtol"] = _number("particles", "rtol", pt["rtol"], low=0.0, high=TOLERANCE_MAX)
    pt["atol"] = _number("particles", "atol", pt["atol"], low=0.0, high=TOLERANCE_MAX)
    if not TOLERANCE_MIN <= pt["rtol"] + pt["atol"] <= TOLERANCE_MAX:
        raise ConfigError(f"[particles] rtol: rtol + atol must be in [{TOLERANCE_MIN:g}, {TOLERANCE_MAX:g}] (the "
                          f"error norm's unit), got {pt['rtol']:g} + {pt['atol']:g}")
    pt["dt"] = _number("particles", "dt", pt["dt"], positive=True)
    if pt["dt"] > tm["save_every"]:
        raise ConfigError(f"[particles] dt: must be <= save_every = {tm['save_every']:g}, got {pt['dt']:g}")
    systems = pt["systems"]
    if isinstance(systems, bool) or not isinstance(systems, int) or not 1 <= systems <= MAX_SYSTEMS:
        raise ConfigError(f"[particles] systems: must be an integer in [1, {MAX_SYSTEMS}], got {systems!r}")
    if systems > 1 and pt["mode"] != "tokens":
        raise ConfigError(f'[particles] systems: {systems} systems need mode = "tokens" (quadrature particles '
                          "are one deterministic system)")
    if systems > 1 and eulerian:
        raise ConfigError(f"[particles] systems: {systems} systems run the tokens alone: set [eulerian] "
                          "enabled = false")
    if systems * n * d > MAX_STATE:
        raise ConfigError(f"[particles] systems: systems × n × d = {systems} × {n} × {d} exceeds {MAX_STATE} "
                          "(512 MiB per copy of the positions)")
    if pt["summation"] not in ("auto", "batched"):
        raise ConfigError(f'[particles] summation: must be "auto" or "batched", got {pt["summation"]!r}')


def _resolve_backend(pt, noisy):
    """[particles] backend: one of BACKENDS; "cuda" needs a GPU that numba sees and a run the
    device solver runs (spherepde.solvers.device), checked here so that nothing is written."""
    backend, precision = pt["backend"], pt["precision"]
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ConfigError(f"[particles] backend: must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}"
                          f"{_did_you_mean(backend, BACKENDS)}")
    if precision not in PRECISIONS:
        raise ConfigError(f"[particles] precision: must be one of {', '.join(map(repr, PRECISIONS))}, got {precision!r}")
    if precision != "fp64" and backend != "cuda":
        raise ConfigError(f'[particles] precision: "{precision}" is an option of the GPU\'s sums: it needs backend = '
                          f'"cuda", got backend = "{backend}"')
    if backend != "cuda":
        return
    from ..solvers.device import backend_for, device_problem  # imports numba.cuda: only when asked

    try:
        backend_for(backend, device_problem(noisy, pt["mode"] == "quadrature", scheme=pt["scheme"]))
    except ValueError as exc:
        raise ConfigError(f"[particles] backend: {exc}; use \"auto\" or \"cpu\"") from None


def _resolve_initial(table, d=3):
    kind = table.get("kind", "uniform")
    if not isinstance(kind, str) or kind not in INITIAL_KEYS:
        raise ConfigError(f"[initial] kind: unknown initial law {kind!r}{_did_you_mean(kind, INITIAL_KEYS)} "
                          f"(allowed: {', '.join(INITIAL_KEYS)})")
    _check_keys("initial", table, INITIAL_KEYS[kind] | {"kind"})
    out = {"kind": kind}
    if kind == "vmf":
        out.update(_vmf("initial", table, d))
    elif kind == "mixture":
        comps = table.get("components")
        if not isinstance(comps, list) or not comps or not all(isinstance(c, dict) for c in comps):
            raise ConfigError("[initial] components: must be a non-empty list of {mu, kappa} tables")
        out["components"] = []
        for i, comp in enumerate(comps):
            _check_keys(f"initial.components[{i}]", comp, {"mu", "kappa"})
            out["components"].append(_vmf(f"initial.components[{i}]", comp, d))
        weights = table.get("weights", [1.0] * len(comps))
        if not isinstance(weights, list) or len(weights) != len(comps):
            raise ConfigError(f"[initial] weights: must be a list of {len(comps)} numbers, got {weights!r}")
        out["weights"] = [_number("initial", f"weights[{i}]", w, low=0.0) for i, w in enumerate(weights)]
        if sum(out["weights"]) <= 0:
            raise ConfigError("[initial] weights: must not all be zero")
    elif kind == "projected_normal":
        out["mean"] = _vector("initial", "mean", table.get("mean", [0.0] * d), d)
        out["cov"] = _matrix("initial", "cov", table.get("cov", np.eye(d).tolist()), d)
        cov = np.array(out["cov"])
        if not np.allclose(cov, cov.T):
            raise ConfigError("[initial] cov: must be symmetric")
        if np.linalg.eigvalsh(cov).min() <= 0:
            raise ConfigError("[initial] cov: must be positive definite")
    return out


def _vmf(section, table, d=3):
    for key in ("mu", "kappa"):
        if key not in table:
            raise ConfigError(f"[{section}] {key}: required for a von Mises–Fisher law")
    mu = _vector(section, "mu", table["mu"], d)
    if math.hypot(*mu) == 0:
        raise ConfigError(f"[{section}] mu: must be a non-zero vector")
    return {"mu": mu, "kappa": _number(section, "kappa", table["kappa"], low=0.0, high=1e6)}


# sections a resumed run may change: where the file is, and the guards' tolerances (they stop a
# run, they do not change its numbers)
RESUME_MAY_CHANGE = ("output", "guards")
# keys added to the resolved config after files were written without them, and the value such a
# file implies (random weights came later: its B and V were given)
ADDED_KEYS = {("eulerian", "enabled"): True, ("model", "weight_seed"): 0, ("model", "weight_scale"): 1.0,
              ("model", "weights"): "given", ("model", "normalisation"): "softmax",
              ("model", "unnormalised_scale"): "none", ("model", "noise"): 0.0,
              ("model", "noise_schedule"): "constant", ("model", "noise_time"): None,
              ("model", "noise_breakpoints"): None}
ADDED_KEYS.update({("model", "heads"): None, ("model", "layers"): None})  # several heads, layers came later
ADDED_KEYS[("eulerian", "atom_stalled_width")] = 0.0  # the stalled-peak rule came later, off
ADDED_KEYS[("eulerian", "atom_join")] = 0.0  # so did joining a stalled peak to the atom beside it
ADDED_KEYS[("eulerian", "atom_cut")] = "floor"  # and the choice of what a new atom's patch keeps
ADDED_KEYS.update({("eulerian", "tails"): "finite_volume", ("eulerian", "tail_interval"): 0.1,  # tails from log f
                   ("eulerian", "tail_level"): 1e-3, ("eulerian", "tail_exclusion"): 3.0})
ADDED_KEYS[("eulerian", "tail_follow")] = False  # tail cells following g between couplings came later
ADDED_KEYS[("eulerian", "near_field_profile")] = "constant"  # and the log-linear profile at the atoms
# and g interpolated at anchors only: before, at every coupling, its paths in one RK4 step each
ADDED_KEYS.update({("eulerian", "tail_anchor"): 0.0, ("eulerian", "tail_path_step"): 1.0})
ADDED_KEYS[("eulerian", "tail_paths")] = "retrace"  # and the composed maps between anchors
ADDED_KEYS[("eulerian", "tail_substeps")] = 1  # and the states after every step in g's paths
ADDED_KEYS.update({("model", "dimension"): 3, ("particles", "systems"): 1,  # any d and batched systems
                   ("particles", "summation"): "auto"})
# the GPU backend came later: a file without the key ran on the CPU, as "auto" does without a GPU
# (the run file's particle_backend attribute says which one a run used)
ADDED_KEYS[("particles", "backend")] = "auto"
ADDED_KEYS[("particles", "precision")] = "fp64"
ADDED_KEYS.update({("particles", "rtol"): 1e-6, ("particles", "atol"): 0.0})  # adaptive steps came later
ADDED_KEYS[("eulerian", "atom_shape")] = "point"  # the atoms were points before the "sigma" shape
ADDED_KEYS[("eulerian", "tail_reference")] = "mesh"  # the tail level was relative to the mesh's largest f
# the selective paths came later; the tolerance acts with them only, so old files imply the default
ADDED_KEYS[("eulerian", "tail_retrace_tolerance")] = TAIL_RETRACE_TOLERANCE
ADDED_KEYS[("eulerian", "tail_follow_bounds")] = "none"  # the followed tail cells were unbounded before the key
ADDED_KEYS[("eulerian", "tail_path_scheme")] = "rk4"  # g's paths were RK4 steps
ADDED_KEYS[("eulerian", "tail_exclusion_width")] = 0.0  # the neighbourhoods were in cells only
ADDED_KEYS[("eulerian", "tail_step_states")] = "all"  # the substeps crossed every coupling interval
ADDED_KEYS[("eulerian", "tail_field_between")] = "linear"  # the couplings' fields linear in time between them
ADDED_KEYS[("eulerian", "tail_path_tolerance")] = 0.0  # g's paths in fixed steps
ADDED_KEYS[("eulerian", "tail_mass_correction")] = "global"  # the tail cells' mass paid by all of the rest


STALLED_RULE_MIN_NSIDE = 8  # below it atom_stalled_width and atom_join default to 0 (resolve)
ATOM_KEYS = ("atom_width", "atom_min_mass", "atom_merge", "max_atoms", "atom_feeding", "atom_stalled_width",
             "atom_join", "atom_cut", "atom_shape", "near_field_profile")  # the profile acts at the atoms only
ATOM_CUTS = ("floor", "tail")
ATOM_SHAPES = ("point", "sigma")  # spherepde.solvers.atoms.SHAPES
TAIL_KINDS = ("finite_volume", "log")
TAIL_KEYS = ("tail_interval", "tail_level", "tail_exclusion", "tail_exclusion_width", "tail_follow", "tail_anchor", "tail_path_step",
             "tail_path_tolerance", "tail_mass_correction", "tail_paths", "tail_substeps", "tail_reference",
             "tail_retrace_tolerance", "tail_follow_bounds",
             "tail_path_scheme", "tail_step_states", "tail_field_between")
TAIL_LEVEL_REFERENCES = ("mesh", "clusters")  # LogTails' reference ("measure" is a validation variant only)
EULERIAN_KEYS_WITHOUT_SOLVE = ("enabled", "nside")  # nside: the mesh of quadrature particles


def _idle_keys(section, a, b):
    """[eulerian] keys of a solver part that runs in neither config and so cannot change the
    run: everything but enabled and nside when both have enabled = false (token runs), the atom
    keys when both have atoms = false, the tail keys when both keep the finite volumes' tails. A changed default of such a key leaves old files valid."""
    if section != "eulerian":
        return set()
    keys = set(a) | set(b)
    if a.get("enabled") is False and b.get("enabled") is False:
        return keys - set(EULERIAN_KEYS_WITHOUT_SOLVE)
    idle = set()
    if a.get("atoms") is False and b.get("atoms") is False:
        idle |= keys & set(ATOM_KEYS)
    if a.get("tails") == "finite_volume" and b.get("tails") == "finite_volume":
        idle |= keys & set(TAIL_KEYS)
    return idle


def difference(stored: dict, given: dict, ignore=RESUME_MAY_CHANGE) -> str | None:
    """The first setting in which two resolved configs differ ("[section] key: a in the file,
    b now"), or None when they agree outside the ignored sections and the idle keys (_idle_keys)."""
    for section in sorted(set(stored) | set(given)):
        a, b = stored.get(section), given.get(section)
        if isinstance(a, dict) and isinstance(b, dict):  # keys added since the file was written
            a = {**{k: v for (sec, k), v in ADDED_KEYS.items() if sec == section and k not in a and k in b}, **a}
            idle = _idle_keys(section, a, b)
            a = {k: v for k, v in a.items() if k not in idle}
            b = {k: v for k, v in b.items() if k not in idle}
        if section in ignore or a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            key = next(k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))
            return f"[{section}] {key}: {a.get(key)!r} in the file, {b.get(key)!r} now"
        return f"[{section}]: {a!r} in the file, {b!r} now"
    return None
