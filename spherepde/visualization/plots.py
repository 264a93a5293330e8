"""Figures of a run: Mollweide maps of the density, orthographic views of the sphere, time series
of the diagnostics (and, through spherepde.visualization.movie, a movie).

Every figure helper draws on axes it is given (ax=) or creates, and returns (fig, ax). Every
figure of a run carries a title with β, the initial law, the mesh and the spherepde version
(maps.figure_title), and, for an unfinished run, the partial-run note (partial_note).

`spherepde plot RUN.nc` writes, next to the run file (or into -o DIR):

- <stem>_density.png: Mollweide maps of up to six snapshots, one logarithmic colour scale for the
  mesh density, the atoms as red discs of area ∝ mass with a size key;
- <stem>_diagnostics.png: alignment with E and F, W₂ to Π#ρ₀ with its bound, the density lower
  bounds; t = log β and the atom events (atoms created or merged since the previous snapshot:
  W₂ jumps and the alignment kinks there) marked by vertical lines, explained in a caption line;
- <stem>_sphere.png: rows for the first snapshot, the one nearest t = log β (the concentration
  on E) and the last: a Mollweide map beside the two orthographic hemispheres centred on ±c
  (maps.view_centre: both the E-phase and the final clusters away from the limb), atoms drawn;
  each row with its own colour scale and colour bar, so that a near-uniform start is not drawn in
  one colour at the top of a scale set by the later clusters.

With --movie also <stem>_movie.mp4 and <stem>_movie.gif (spherepde.visualization.movie).

Colour scales: logarithmic when the positive densities span more than a decade (zeros drawn in
the lowest colour, capped at 10⁻⁶ of the maximum), else linear; NaN cells are left blank.
"""

from __future__ import annotations

import json

import math
import textwrap
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .maps import (
    DENSITY_LABEL,
    ProjectedGrid,
    SpherePanels,
    atom_legend,
    atom_markers,
    atom_scatter,
    atom_sizes,
    atom_text,
    atoms_at,
    clip_for,
    degrees,
    density_norm,
    figure_title,
    has_atoms,
    log_beta,
    lonlat,
    mass_axis,
    total_mass,
    view_centre,
)
from .movie import DEFAULT_MOVIE_FRAMES, density_movie, movie_frames

__all__ = [
    "DEFAULT_MOVIE_FRAMES",
    "AtomEvent",
    "ProjectedGrid",
    "SpherePanels",
    "atom_events",
    "atom_markers",
    "atom_sizes",
    "density_maps",
    "density_movie",
    "density_norm",
    "diagnostics_plot",
    "figure_title",
    "mass_axis",
    "mollweide",
    "movie_frames",
    "partial_note",
    "plot_run",
    "sphere_figure",
    "token_histogram",
    "view_centre",
]


TOKEN_NSIDE = 16  # the histogram of a run of the particles alone: cells of ≈ 3.7°
EVENT_COLOUR = "crimson"


def _axes(ax, figsize):
    import matplotlib.pyplot as plt

    if ax is None:
        fig, ax = plt.subplots(figsize=figsize)
        return fig, ax
    return ax.figure, ax


def mollweide(values, ax=None, vmin=None, vmax=None, cmap="viridis", xsize=600, title=None,
              colorbar=True):
    """Mollweide image of a NESTED HEALPix map (values (npix,)). Returns (fig, ax)."""
    import healpy as hp
    from healpy.projector import MollweideProj

    values = np.asarray(values, dtype=float)
    nside = hp.npix2nside(values.size)
    fig, ax = _axes(ax, (6, 3.4))
    proj = MollweideProj(xsize=xsize, flipconv="geo")
    image = proj.projmap(values, lambda x, y, z: hp.vec2pix(nside, x, y, z, nest=True))
    image = np.ma.masked_invalid(np.where(np.isinf(image), np.nan, image))
    im = ax.imshow(image, origin="lower", extent=proj.get_extent(), vmin=vmin, vmax=vmax, cmap=cmap,
                   interpolation="nearest")
    ax.set_axis_off()
    if title:
        ax.set_title(title, fontsize=9)
    if colorbar:
        fig.colorbar(im, ax=ax, orientation="horizontal", fraction=0.05, pad=0.04)
    return fig, ax




def add_title(fig, ds, subtitle=None):
    """The run's title (maps.figure_title) as the figure's suptitle, a subtitle line below it, and
    for an unfinished run the partial-run note first, the whole title then in crimson."""
    lines = [figure_title(ds)] + ([subtitle] if subtitle else [])
    note = partial_note(ds)
    if note:
        lines.insert(0, note)
    return fig.suptitle("\n".join(lines), fontsize=11, color="crimson" if note else "black")


def _snapshot_indices(ds, times, count):
    """Indices of the snapshots nearest the times asked for, or count evenly spaced ones."""
    all_times = ds.time.values
    if times is None:
        return np.unique(np.linspace(0, all_times.size - 1, min(count, all_times.size)).round().astype(int))
    return [int(np.abs(all_times - t).argmin()) for t in times]


def density_maps(ds, times=None, ncols=3, log=True, label=DENSITY_LABEL):
    """A grid of Mollweide maps of density snapshots (default: six, evenly spaced) with one shared
    colour scale for the mesh density, the atoms as discs of area ∝ mass and their size key; the
    maps are centred on the longitude of view_centre(ds). Returns (fig, axes)."""
    import healpy as hp
    import matplotlib.pyplot as plt

    all_times = ds.time.values
    idx = _snapshot_indices(ds, times, 6)
    maps = np.asarray(ds["density"].values, dtype=float)[idx]
    nrows = math.ceil(len(idx) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 2.3 * nrows + 1.6), squeeze=False,
                             layout="constrained")
    norm = density_norm(maps, log=log)
    lon = lonlat(view_centre(ds))[0]
    grid = ProjectedGrid(hp.npix2nside(maps.shape[-1]), "mollweide", xsize=600, lon=lon)
    total = total_mass(ds)
    lines = grid.graticule()
    image = None
    for ax, k, fmap in zip(axes.flat, idx, maps):
        image = ax.imshow(clip_for(norm, grid.image(fmap)), origin="lower", extent=grid.extent, norm=norm,
                          cmap="viridis", interpolation="nearest")
        for line in lines:
            ax.plot(line[:, 0], line[:, 1], color="white", lw=0.3, alpha=0.3)
        positions, masses = atoms_at(ds, k)
        xy, sizes, _ = atom_markers(positions, masses, grid, total)
        atom_scatter(ax).set(offsets=xy, sizes=sizes)
        ax.set_xlim(grid.extent[0] * 1.02, grid.extent[1] * 1.02)
        ax.set_ylim(grid.extent[2] * 1.04, grid.extent[3] * 1.04)
        ax.set_aspect("equal")
        ax.set_axis_off()
        ax.set_title(f"t = {all_times[k]:.3g}{atom_text(masses)}", fontsize=9)
    for ax in list(axes.flat)[len(idx):]:
        ax.set_axis_off()
    fig.colorbar(image, ax=axes, orientation="horizontal", fraction=0.04, pad=0.02, aspect=50,
                 label=f"mesh {label}")
    if has_atoms(ds):
        atom_legend(fig, total)
    add_title(fig, ds, f"Mollweide maps centred on lon {degrees(lon)}° (east to the right), "
                       "one colour scale; graticule every 30°")
    return fig, axes


def token_histogram(ds, nside=TOKEN_NSIDE):
    """A run of the particles alone as a run with a density: the particle weights binned into
    the cells of a NESTED HEALPix mesh, divided by the cell area (sr⁻¹), as `density`(time, cell)."""
    import healpy as hp

    positions = ds["positions"].values
    weights = ds["particle_weights"].values
    npix = 12 * nside**2
    density = np.empty((positions.shape[0], npix))
    for k, x in enumerate(positions):
        cells = hp.vec2pix(nside, x[:, 0], x[:, 1], x[:, 2], nest=True)
        density[k] = np.bincount(cells, weights=weights, minlength=npix) / (4 * np.pi / npix)
    return ds.assign(density=(("time", "cell"), density))




class AtomEvent(NamedTuple):
    """Atoms created or merged between snapshots k − 1 and k (time: that of snapshot k)."""
    index: int
    time: float
    created: int
    merged: int
    count: int  # living atoms at snapshot k


def atom_events(ds) -> list[AtomEvent]:
    """The snapshots at which atoms were created or merged since the previous one, from the run's
    cumulative counters atoms_created and atoms_merged (a file without them: from the changes of
    the number of living atoms, a rise counted as creations, a fall as merges)."""
    if not has_atoms(ds):
        return []
    t = np.asarray(ds["time"].values, dtype=float)
    count = (np.nan_to_num(np.asarray(ds["atom_mass"].values, dtype=float)) > 0).sum(axis=1)
    if "atoms_created" in ds and "atoms_merged" in ds:
        created = np.diff(np.nan_to_num(ds["atoms_created"].values)).round().astype(int)
        merged = np.diff(np.nan_to_num(ds["atoms_merged"].values)).round().astype(int)
    else:
        change = np.diff(count)
        created, merged = np.maximum(change, 0), np.maximum(-change, 0)
    return [AtomEvent(k + 1, float(t[k + 1]), int(created[k]), int(merged[k]), int(count[k + 1]))
            for k in np.flatnonzero((created > 0) | (merged > 0))]


def _event_text(event):
    parts = ([f"+{event.created}"] if event.created else []) + ([f"{event.merged} merged"] if event.merged else [])
    return f"{event.time:.3g} ({', '.join(parts)})"


def _events_caption(events, lb, most=10):
    """The caption line of the time series: what the vertical lines are."""
    text = []
    if events:
        listed = ", ".join(_event_text(e) for e in events[:most]) + (", …" if len(events) > most else "")
        text.append("Dotted crimson lines: atom events, at the first snapshot after atoms were created (+n) "
                    f"or merged: t = {listed}. An atom holds its cluster's mass at one point, so W₂ jumps "
                    "and the alignment kinks there.")
    if math.isfinite(lb):
        text.append(f"Dash-dot grey: t = log β = {lb:.3g}, the time scale of the concentration on E.")
    return textwrap.fill(" ".join(text), 200)


def diagnostics_plot(ds, axes=None):
    """Time series: alignment with E and F; W₂ to Π#ρ₀ with its bound; density bounds. t = log β
    and the atom events (atom_events) are marked on each panel and explained in a caption line.
    Returns (fig, axes)."""
    import matplotlib.pyplot as plt

    if axes is None:
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    else:
        fig = axes[0].figure
    t = ds.time.values
    beta = ds.attrs.get("beta")
    if "alignment_E" not in ds:  # the particles alone
        return _particle_diagnostics(ds, axes, fig, t, beta)
    ax = axes[0]
    ax.plot(t, ds.alignment_E, "C0", label="alignment with E")
    ax.plot(t, ds.alignment_F, "C1", label="alignment with F")
    if "particle_alignment_E" in ds:  # particles: same colours, dashed
        ax.plot(t, ds.particle_alignment_E, "C0--", label="E (particles)")
        ax.plot(t, ds.particle_alignment_F, "C1--", label="F (particles)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("alignment with E and F")
    ax.set_ylabel(r"$\int |Q x|^2\, d\rho_t$ (Q: projection on E or F)")
    ax = axes[1]
    measured = [ds.w2_to_projection.values]
    ax.semilogy(t, ds.w2_to_projection, "C0", label="W₂(ρ_t, Π#ρ₀)")
    if "particle_w2_to_projection" in ds:
        ax.semilogy(t, ds.particle_w2_to_projection, "C0--", label="W₂ (particles)")
        ax.semilogy(t, ds.w2_eulerian_particles, "C2-.", label="W₂(Eulerian, particles)")
        measured += [ds.particle_w2_to_projection.values, ds.w2_eulerian_particles.values]
    if "w2_bound_zero_temperature" in ds:
        # a bound on the β = ∞ dynamics: at finite β the curve may cross it, which violates nothing
        where = "" if _zero_temperature(beta) else " (bound at β = ∞ only)"
        ax.semilogy(t, ds.w2_bound_zero_temperature, "--",
                    label=r"$\sqrt{2V_p(\rho_0)}\,e^{-p\gamma t/\sigma_{\max}}$" + where)
    if "w2_bound_finite_beta" in ds:
        ax.semilogy(t, np.abs(ds.w2_bound_finite_beta), ":",
                    label=r"$2\sqrt{\log(\beta+1)/\beta}\,(e^{C_1 t} - e^{C_0 t})$")
    # the axis follows the measured distances (a fifth of their least at the bottom); a bound
    # that decays faster leaves it there
    values = np.concatenate([np.ravel(m) for m in measured])
    values = values[np.isfinite(values) & (values > 0)]
    if values.size:
        ax.set_ylim(bottom=0.2 * values.min())
    ax.set_title("distance to Π#ρ₀")
    ax.set_ylabel("W₂ (rad)")
    ax = axes[2]
    ax.semilogy(t, ds.min_density, label="min f_t")
    ax.semilogy(t, ds.lower_bound_aposteriori, "--", label=r"$\ell_0\, e^{-\int_0^t \sup\, \mathrm{div}\, v}$")
    ax.semilogy(t, ds.lower_bound_paper, ":", label=r"$\frac{1}{2}\ell_0 e^{-C_0 t}$")
    # the paper's bound may fall tens of decades below min f: the axis follows min f and the
    # a-posteriori bound (four decades below them at most), the paper's bound leaves it there
    floor = np.nanmin([np.nanmin(ds.min_density.values), np.nanmin(ds.lower_bound_aposteriori.values)])
    if np.isfinite(floor) and floor > 0:
        ax.set_ylim(bottom=floor * 1e-4)
    ax.set_title("density lower bound")
    ax.set_ylabel("density (sr⁻¹)")
    _finish_panels(ds, axes, fig, t)
    return fig, axes


def _zero_temperature(beta) -> bool:
    """Whether a run file's beta attribute is β = ∞ ("inf", inf; "mixed" and finite values are not)."""
    try:
        return math.isinf(float(beta))
    except (TypeError, ValueError):
        return False


def _particle_diagnostics(ds, axes, fig, t, beta):
    """diagnostics_plot of a run of the particles alone: alignment, W₂ to Π#ρ₀, V_p."""
    ax = axes[0]
    ax.plot(t, ds.particle_alignment_E, "C0", label="alignment with E (particles)")
    ax.plot(t, ds.particle_alignment_F, "C1", label="alignment with F (particles)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("alignment with E and F")
    ax.set_ylabel(r"$\int |Q x|^2\, d\rho_t$ (Q: projection on E or F)")
    axes[1].semilogy(t, ds.particle_w2_to_projection, "C0", label="W₂(ρ_t, Π#ρ₀) (particles)")
    axes[1].set_title("distance to Π#ρ₀")
    axes[1].set_ylabel("W₂ (rad)")
    axes[2].semilogy(t, ds.particle_lyapunov, "C3", label="V_p(ρ_t) (particles)")
    axes[2].set_title("Lyapunov functional")
    axes[2].set_ylabel("V_p")
    _finish_panels(ds, axes, fig, t)
    return fig, axes


def _finish_panels(ds, axes, fig, t):
    """t = log β and the atom events marked, labels, grid, legends, title and caption."""
    lb = log_beta(ds)
    events = atom_events(ds)
    for ax in axes:
        if math.isfinite(lb) and t[0] <= lb <= t[-1]:
            ax.axvline(lb, color="grey", lw=0.8, ls="-.", label="t = log β")
        for n, event in enumerate(events):
            ax.axvline(event.time, color=EVENT_COLOUR, lw=0.7, ls=":", alpha=0.8,
                       label="atom event" if n == 0 else None)
        ax.set_xlim(t[0], t[-1])
        ax.set_xlabel("t")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    add_title(fig, ds)
    caption = _events_caption(events, lb if t[0] <= lb <= t[-1] else math.inf)
    lines = caption.count("\n") + 1 if caption else 0
    bottom = (0.02 + 0.16 * lines / fig.get_figheight()) if caption else 0.0
    if caption:
        fig.text(0.01, 0.01, caption, ha="left", va="bottom", fontsize=8)
    fig.tight_layout(rect=(0.0, bottom, 1.0, 1.0))


def sphere_figure(ds, times=None, centre=None, log=True, label=DENSITY_LABEL):
    """Rows of [Mollweide | front hemisphere | back hemisphere] for some snapshots (default: the
    first, the one nearest t = log β when it lies inside the run, the E-phase, and the last),
    each row with its own colour scale and colour bar, atoms as discs of area ∝ mass. The views
    are centred on ±centre (default: view_centre(ds)). Returns (fig, axes (rows, 3))."""
    import matplotlib.pyplot as plt

    all_times = ds.time.values
    density = np.asarray(ds["density"].values, dtype=float)
    lb = log_beta(ds)
    inside = math.isfinite(lb) and all_times[0] < lb < all_times[-1]
    at_log_beta = int(np.abs(all_times - lb).argmin()) if inside else None  # the row labelled "≈ log β"
    if times is None:
        idx = sorted({0, all_times.size - 1} | ({at_log_beta} if inside else set()))
    else:
        idx = [int(np.abs(all_times - t).argmin()) for t in times]
    if centre is None:
        centre = view_centre(ds)
    nside = _nside(density)
    total = total_mass(ds)
    fig, axes = plt.subplots(len(idx), 3, figsize=(11.5, 2.9 * len(idx) + 1.2), squeeze=False,
                             gridspec_kw={"width_ratios": [2, 1, 1]}, layout="constrained")
    for r, (row, k) in enumerate(zip(axes, idx)):
        # a scale per row: the later clusters would put a near-uniform start at the top of a shared one
        panels = SpherePanels(row, nside, centre, density_norm(density[k], log=log), total_mass=total)
        positions, masses = atoms_at(ds, k)
        panels.update(density[k], positions, masses)
        if r:  # the column titles once, on the top row
            for ax in row:
                ax.set_title("")
        when = f"t = {all_times[k]:.3g}" + (" ≈ log β" if k == at_log_beta else "")
        row[0].text(-0.03, 0.5, f"{when}{atom_text(masses, sep=chr(10))}",
                    transform=row[0].transAxes, rotation=90, ha="right", va="center", fontsize=9,
                    fontweight="bold")
        fig.colorbar(panels.images[0], ax=list(row), orientation="vertical", fraction=0.025, pad=0.01,
                     label=f"mesh {label}" if r == len(idx) // 2 else None)
    if has_atoms(ds):
        atom_legend(fig, total)
    add_title(fig, ds, "each row with its own colour scale")
    return fig, axes


def _nside(density):
    """nside of snapshots (time, npix), whatever the cell dimension is called."""
    import healpy as hp

    return hp.npix2nside(density.shape[-1])


def partial_note(ds) -> str | None:
    """What a figure of an unfinished run says about it (None for a finished run): the last time
    on file, the end the config asked for, and the failure message when there is one."""
    if int(ds.attrs.get("complete", 1)):
        return None
    import json

    t_end = json.loads(ds.attrs["config"])["time"]["t_end"] if "config" in ds.attrs else None
    last = float(ds["time"].values[-1]) if ds.sizes.get("time", 0) else math.nan
    note = f"partial run: stopped at t = {last:g}" + (f" of {t_end:g}" if t_end is not None else "")
    failure = str(ds.attrs.get("failure", "")).strip()
    return note + (f" ({failure})" if failure else " (interrupted; --resume continues it)")


class NotPlottable(ValueError):
    """A valid run file that these figures cannot show (tokens off S², a system out of range)."""


def select_system(ds, system: int):
    """One system of a run file of batched systems (`[particles] systems = M`): its positions and
    per-system diagnostics as those of a single run, its number and seed in attrs["plotted_system"];
    a file without a system dimension is returned as it is."""
    if "system" not in ds.dims:
        return ds
    count = ds.sizes["system"]
    if not 0 <= system < count:
        raise NotPlottable(f"--system: the file holds systems 0 … {count - 1}, got {system}")
    seed = json.loads(ds.attrs["config"]).get("particles", {}).get("seed", 0) if "config" in ds.attrs else 0
    one = ds.isel(system=system)
    one.attrs["plotted_system"] = f"system {system} of {count} (seed {int(seed) + system})"
    return one


def plot_run(run_file, out_dir, movie=False, max_frames=DEFAULT_MOVIE_FRAMES, fps=8, dpi=110,
             system: int = 0) -> list[Path]:
    """Write `<stem>_density.png`, `<stem>_diagnostics.png` and `<stem>_sphere.png` for a run file
    (stem: the run file's name without .nc) into out_dir, and with movie=True `<stem>_movie.mp4` and
    `<stem>_movie.gif`; returns the paths. A file of batched systems: system number `system`
    (select_system). Tokens on S^{d−1}, d ≠ 3: NotPlottable (the maps are of S²)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..storage.runfile import open_run

    if int(max_frames) < 1:
        raise ValueError(f"the number of movie frames must be >= 1, got {max_frames}")
    ds = select_system(open_run(run_file), int(system))
    if "positions" in ds and ds["positions"].shape[-1] != 3:  # tokens on S^{d−1}, d ≠ 3
        raise NotPlottable(f"its tokens live on the sphere in R^{ds['positions'].shape[-1]}, and these figures "
                           "map S²; its diagnostics are variables of the file")
    label = DENSITY_LABEL
    if "density" not in ds and "positions" in ds:  # the particles alone: their histogram
        ds = token_histogram(ds)
        label = f"particles per cell area, HEALPix nside {TOKEN_NSIDE} (sr⁻¹)"
    if "density" not in ds or ds.sizes.get("time", 0) == 0:
        raise ValueError("no density snapshots")
    out = Path(out_dir)
    stem = Path(run_file).stem
    paths = []
    figures = {"density": lambda: density_maps(ds, label=label),
               "diagnostics": lambda: diagnostics_plot(ds),
               "sphere": lambda: sphere_figure(ds, label=label)}
    for name, make in figures.items():  # one figure in memory at a time
        fig, _ = make()
        paths.append(out / f"{stem}_{name}.png")
        fig.savefig(paths[-1], dpi=dpi)
        plt.close(fig)
    if movie:
        paths.extend(density_movie(ds, out / stem, max_frames=max_frames, fps=fps, label=label))
    return paths
