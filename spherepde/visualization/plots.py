"""Figures of a run: Mollweide maps of the density, orthographic views of the sphere, a movie of
the density over time, and time series of the diagnostics.

Every figure helper draws on axes it is given (ax=) or creates, and returns (fig, ax). Maps use
healpy's projectors on our own axes (healpy.mollview draws through pyplot state), with
flip="geo" (longitude increasing to the east: this is not the astronomical sky).

`spherepde plot RUN.nc` writes, next to the run file (or into -o DIR):

- <stem>_density.png: Mollweide maps of up to six snapshots, one colour scale;
- <stem>_diagnostics.png: alignment, W₂ and density-bound time series;
- <stem>_sphere.png: for the first and the last snapshot, a Mollweide map beside two orthographic
  hemispheres, the one centred on the mass axis (below) and the opposite one, so that together
  they show the whole sphere; atoms drawn as points whose area grows with their mass.

With --movie also <stem>_movie.gif (matplotlib's PillowWriter, no system software needed) and,
when ffmpeg is on the PATH, <stem>_movie.mp4: the same three panels per frame, the time in the
title. One frame per snapshot, or for runs with more than --frames N snapshots (default
DEFAULT_MOVIE_FRAMES) N frames evenly spaced over the run, the first and the last included.

Colour scale: one for the whole figure or movie, logarithmic when the positive densities span
more than a decade (zeros are drawn in the lowest colour, capped at 10⁻⁶ of the maximum), else
linear; NaN cells are left blank.

The orthographic centre: the leading eigenvector of the second moment Σ wᵢ xᵢxᵢᵀ of the last
snapshot's mass (cells and atoms), the sign chosen towards the first moment. A single cluster is
then at the centre of the front view, two antipodal clusters at the centres of the front and back
views. The last snapshot decides, since that is where the mass concentrates, and the centre stays
fixed over the movie so that motion on the sphere is motion in the picture.

Projections are computed once per figure (ProjectedGrid: the HEALPix pixel under each image
pixel); a frame is values[lookup].
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

__all__ = ["mollweide", "density_maps", "diagnostics_plot", "sphere_figure", "density_movie",
           "ProjectedGrid", "SpherePanels", "atom_markers", "atom_sizes", "density_norm", "mass_axis",
           "movie_frames", "plot_run", "partial_note"]


DENSITY_LABEL = "density f_t (sr⁻¹)"
TOKEN_NSIDE = 16  # the histogram of a run of the particles alone: cells of ≈ 3.7°


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


def density_maps(ds, times=None, ncols=3, log=True, label=DENSITY_LABEL):
    """A grid of Mollweide maps of density snapshots with one shared colour scale."""
    import matplotlib.pyplot as plt
    from matplotlib import colors

    all_times = ds.time.values
    if times is None:
        idx = np.unique(np.linspace(0, all_times.size - 1, min(6, all_times.size)).round().astype(int))
    else:
        idx = [int(np.abs(all_times - t).argmin()) for t in times]
    maps = ds.density.values[idx]
    nrows = math.ceil(len(idx) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 2.6 * nrows + 0.8), squeeze=False)
    positive = maps[maps > 0]
    if log and positive.size:
        vmax = float(maps.max())
        vmin = max(float(positive.min()), vmax * 1e-6)
        norm = colors.LogNorm(vmin=vmin, vmax=vmax)
        maps = np.maximum(maps, vmin)
    else:
        norm = colors.Normalize(vmin=float(maps.min()), vmax=float(maps.max()))
    image = None
    for ax, k, fmap in zip(axes.flat, idx, maps):
        mollweide(fmap, ax=ax, colorbar=False, title=f"t = {all_times[k]:.3g}")
        image = ax.images[0]
        image.set_norm(norm)
    for ax in list(axes.flat)[len(idx):]:
        ax.set_axis_off()
    fig.colorbar(image, ax=axes, orientation="horizontal", fraction=0.04, pad=0.03, label=label)
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


def _log_beta(ds):
    value = ds.attrs.get("log_beta")
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.inf


def diagnostics_plot(ds, axes=None):
    """Time series: alignment with E and F; W₂ to Π#ρ₀ with its bound; density bounds.
    log β is marked on each panel. Returns (fig, axes)."""
    import matplotlib.pyplot as plt

    if axes is None:
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
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
    ax.set_title(f"alignment, β = {beta}")
    ax.set_ylabel(r"$\int |Q x|^2\, d\rho_t$ (Q: projection on E or F)")
    ax = axes[1]
    ax.semilogy(t, ds.w2_to_projection, "C0", label="W₂(ρ_t, Π#ρ₀)")
    if "particle_w2_to_projection" in ds:
        ax.semilogy(t, ds.particle_w2_to_projection, "C0--", label="W₂ (particles)")
        ax.semilogy(t, ds.w2_eulerian_particles, "C2-.", label="W₂(Eulerian, particles)")
    if "w2_bound_zero_temperature" in ds:
        # a bound on the β = ∞ dynamics: at finite β the curve may cross it, which violates nothing
        where = "" if _zero_temperature(beta) else " (bound at β = ∞ only)"
        ax.semilogy(t, ds.w2_bound_zero_temperature, "--",
                    label=r"$\sqrt{2V_p(\rho_0)}\,e^{-p\gamma t/\sigma_{\max}}$" + where)
    if "w2_bound_finite_beta" in ds:
        ax.semilogy(t, np.abs(ds.w2_bound_finite_beta), ":",
                    label=r"$2\sqrt{\log(\beta+1)/\beta}\,(e^{C_1 t} - e^{C_0 t})$")
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
    ax.set_title(f"alignment, β = {beta}")
    axes[1].semilogy(t, ds.particle_w2_to_projection, "C0", label="W₂(ρ_t, Π#ρ₀) (particles)")
    axes[1].set_title("distance to Π#ρ₀")
    axes[2].semilogy(t, ds.particle_lyapunov, "C3", label="V_p(ρ_t) (particles)")
    axes[2].set_title("Lyapunov functional")
    _finish_panels(ds, axes, fig, t)
    return fig, axes


def _finish_panels(ds, axes, fig, t):
    """t = log β marked, labels, grid, legends."""
    lb = _log_beta(ds)
    for ax in axes:
        if math.isfinite(lb) and t[0] <= lb <= t[-1]:
            ax.axvline(lb, color="grey", lw=0.8, ls="-.", label="t = log β")
        ax.set_xlabel("t")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()


DEFAULT_MOVIE_FRAMES = 200
ATOM_COLOUR = "red"


class ProjectedGrid:
    """One projection of a NESTED HEALPix mesh onto an image, computed once: pix is the pixel
    under each image pixel (0 where the image is off the sphere or on the hidden hemisphere,
    marked by ~inside); image(values) is then a lookup per frame.

    kind "mollweide": the whole sphere; kind "orthographic": the hemisphere centred on centre
    (a unit vector), seen from outside."""

    def __init__(self, nside, kind="mollweide", centre=None, xsize=400):
        import healpy as hp
        from healpy.projector import MollweideProj, OrthographicProj

        self.nside, self.kind = int(nside), kind
        if kind == "mollweide":
            self.proj = MollweideProj(xsize=xsize, flipconv="geo")
            self.centre = None
        elif kind == "orthographic":
            self.centre = np.asarray(centre, dtype=float) / np.linalg.norm(centre)
            lon, lat = hp.vec2dir(self.centre, lonlat=True)
            self.proj = OrthographicProj(rot=(float(lon), float(lat), 0.0), half_sky=True,
                                         xsize=xsize, flipconv="geo")
        else:
            raise ValueError(f"unknown projection {kind!r}")
        npix = hp.nside2npix(self.nside)
        index = self.proj.projmap(np.arange(npix, dtype=float),
                                  lambda x, y, z: hp.vec2pix(self.nside, x, y, z, nest=True))
        self.inside = np.isfinite(index) & (index >= 0)
        self.pix = np.where(self.inside, index, 0).astype(np.intp)
        self.extent = self.proj.get_extent()

    def image(self, values):
        """The image of one map (values (npix,)): a masked array, masked off the sphere and at NaN."""
        image = np.asarray(values, dtype=float)[self.pix]
        image[~self.inside] = np.nan
        return np.ma.masked_invalid(image)

    def visible(self, vectors):
        """Which points (k, 3) are drawn: finite, and on the front hemisphere of an orthographic view."""
        vectors = np.asarray(vectors, dtype=float).reshape(-1, 3)
        ok = np.all(np.isfinite(vectors), axis=1)
        if self.centre is not None:
            ok &= np.where(ok, np.nan_to_num(vectors) @ self.centre, -1.0) > 0
        return ok

    def xy(self, vectors):
        """Image-plane coordinates (k, 2) of unit vectors (k, 3) (in the extent's units)."""
        vectors = np.asarray(vectors, dtype=float).reshape(-1, 3)
        if not len(vectors):
            return np.zeros((0, 2))
        x, y = self.proj.vec2xy(vectors[:, 0], vectors[:, 1], vectors[:, 2])
        return np.column_stack([np.atleast_1d(x), np.atleast_1d(y)])

    def graticule(self, step=30.0, samples=181):
        """Lines of the graticule (every step degrees) as arrays (n, 2), NaN where hidden."""
        import healpy as hp

        lines = []
        t = np.linspace(-180.0, 180.0, samples)
        for lon in np.arange(-180.0, 180.0, step):
            lat = np.linspace(-90.0, 90.0, samples)
            lines.append(np.stack(hp.ang2vec(np.full_like(lat, lon), lat, lonlat=True), axis=0))
        for lat in np.arange(-90.0 + step, 90.0, step):
            lines.append(np.stack(hp.ang2vec(t, np.full_like(t, lat), lonlat=True), axis=0))
        out = []
        for vec in lines:
            xy = self.xy(vec)
            xy[~self.visible(vec)] = np.nan
            out.append(xy)
        return out


def density_norm(maps, log=True):
    """One colour scale for a set of maps: LogNorm when the positive finite values span more than
    a decade (from max(min positive, 10⁻⁶ max) to max), else a linear Normalize. NaN and ±inf are
    ignored; an all-NaN or constant set gets a valid (if uninformative) range."""
    from matplotlib import colors

    values = np.asarray(maps, dtype=float)
    values = values[np.isfinite(values)]
    if not values.size:
        return colors.Normalize(vmin=0.0, vmax=1.0)
    vmax = float(values.max())
    positive = values[values > 0]
    if log and positive.size and vmax > 10.0 * float(positive.min()):
        return colors.LogNorm(vmin=max(float(positive.min()), vmax * 1e-6), vmax=vmax)
    vmin = float(values.min())
    if vmin == vmax:
        vmin, vmax = vmin - 0.5 * (abs(vmin) or 1.0), vmax + 0.5 * (abs(vmax) or 1.0)
    return colors.Normalize(vmin=vmin, vmax=vmax)


def _clip_for(norm, image):
    """Values below a LogNorm's vmin (zeros included) drawn in its lowest colour, not blank."""
    from matplotlib import colors

    if isinstance(norm, colors.LogNorm):
        return np.ma.maximum(image, norm.vmin)
    return image


def atom_sizes(masses, total_mass=1.0):
    """Marker areas (points²) of atoms of these masses: 12 + 600·m/total, increasing with mass."""
    total = float(total_mass) if np.isfinite(total_mass) and total_mass > 0 else 1.0
    return 12.0 + 600.0 * np.asarray(masses, dtype=float) / total


def atom_markers(positions, masses, grid, total_mass=1.0):
    """The atoms to draw on one projection: living (mass > 0, finite position) and visible.

    positions (k, 3), masses (k,) of one snapshot (empty slots: NaN position, mass 0). Returns
    (xy (m, 2), sizes (m,), slots (m,)): image-plane positions, marker areas (atom_sizes) and
    the slot index of each drawn atom."""
    positions = np.asarray(positions, dtype=float).reshape(-1, 3)
    masses = np.nan_to_num(np.asarray(masses, dtype=float).reshape(-1), nan=0.0)
    slots = np.flatnonzero((masses > 0) & grid.visible(positions))
    return grid.xy(positions[slots]), atom_sizes(masses[slots], total_mass), slots


def _has_atoms(ds):
    return "atom_position" in ds and "atom_mass" in ds


def _atoms_at(ds, k):
    """(positions (k, 3), masses (k,)) of snapshot k; empty arrays for a run without atoms."""
    if not _has_atoms(ds):
        return np.zeros((0, 3)), np.zeros(0)
    return (np.asarray(ds["atom_position"].values[k], dtype=float),
            np.asarray(ds["atom_mass"].values[k], dtype=float))


def _total_mass(ds):
    if "mass" in ds:
        mass = np.asarray(ds["mass"].values, dtype=float)
        mass = mass[np.isfinite(mass) & (mass > 0)]
        if mass.size:
            return float(mass.max())
    return 1.0


def mass_axis(density, atom_positions=(), atom_masses=()):
    """The unit vector the orthographic views are centred on: the leading eigenvector of the
    second moment Σ wᵢ xᵢxᵢᵀ of the mass (cells: density × cell area at the pixel centres; atoms:
    their masses), its sign towards the first moment (or, for a symmetric state, making its
    largest component positive). The z axis when there is no mass to go by."""
    import healpy as hp

    density = np.asarray(density, dtype=float)
    nside = hp.npix2nside(density.size)
    x = np.column_stack(hp.pix2vec(nside, np.arange(density.size), nest=True))
    w = np.where(np.isfinite(density) & (density > 0), density, 0.0) * (4 * np.pi / density.size)
    a_pos = np.asarray(atom_positions, dtype=float).reshape(-1, 3)
    a_mass = np.nan_to_num(np.asarray(atom_masses, dtype=float).reshape(-1), nan=0.0)
    alive = (a_mass > 0) & np.all(np.isfinite(a_pos), axis=1)
    x = np.vstack([x, a_pos[alive]])
    w = np.concatenate([w, a_mass[alive]])
    if not w.sum() > 0:
        return np.array([0.0, 0.0, 1.0])
    second = (x * w[:, None]).T @ x
    axis = np.linalg.eigh(second)[1][:, -1]
    first = w @ x
    lean = float(first @ axis)
    if abs(lean) > 1e-9 * w.sum():
        sign = np.sign(lean)
    else:
        sign = np.sign(axis[np.argmax(np.abs(axis))]) or 1.0
    return sign * axis


def movie_frames(n_snapshots, max_frames=DEFAULT_MOVIE_FRAMES):
    """Snapshot indices of a movie: all of them, or max_frames evenly spaced ones (the first and
    the last included) when there are more."""
    n, cap = int(n_snapshots), int(max_frames)
    if cap < 1:
        raise ValueError(f"the number of movie frames must be >= 1, got {cap}")
    if n <= cap:
        return np.arange(n)
    if cap == 1:
        return np.array([n - 1])
    return np.floor(np.linspace(0, n - 1, cap) + 0.5).astype(int)


class SpherePanels:
    """A Mollweide map beside the front and back orthographic hemispheres of one snapshot, on three
    given axes, with the atoms; update(values, positions, masses) redraws the data only (the
    projections, graticules and colour scale are set up once)."""

    def __init__(self, axes, nside, centre, norm, cmap="viridis", total_mass=1.0, xsize=400,
                 disc_xsize=240):
        self.norm, self.total_mass = norm, total_mass
        centre = np.asarray(centre, dtype=float)
        self.grids = [ProjectedGrid(nside, "mollweide", xsize=xsize),
                      ProjectedGrid(nside, "orthographic", centre, xsize=disc_xsize),
                      ProjectedGrid(nside, "orthographic", -centre, xsize=disc_xsize)]
        self.axes = list(axes)
        self.images, self.markers = [], []
        lon, lat = _lonlat(centre)
        titles = ["Mollweide (lon 0 at the centre, east to the right)",
                  f"front: centred on lon {_degrees(lon)}°, lat {_degrees(lat)}°",
                  f"back: centred on lon {_degrees(_wrap(lon + 180))}°, lat {_degrees(-lat)}°"]
        blank = np.zeros(12 * nside * nside)
        for ax, grid, title in zip(self.axes, self.grids, titles):
            image = ax.imshow(_clip_for(norm, grid.image(blank)), origin="lower", extent=grid.extent,
                              norm=norm, cmap=cmap, interpolation="nearest")
            for line in grid.graticule():
                ax.plot(line[:, 0], line[:, 1], color="white", lw=0.4, alpha=0.35)
            if grid.kind == "orthographic":
                circle = np.linspace(0, 2 * np.pi, 361)
                ax.plot(np.cos(circle), np.sin(circle), color="0.3", lw=0.8)
            ax.set_xlim(grid.extent[0] * 1.02, grid.extent[1] * 1.02)
            ax.set_ylim(grid.extent[2] * 1.04, grid.extent[3] * 1.04)
            ax.set_aspect("equal")
            ax.set_axis_off()
            ax.set_title(title, fontsize=8)
            markers = ax.scatter(np.zeros(0), np.zeros(0), s=np.zeros(0), c=ATOM_COLOUR,
                                 edgecolors="white", linewidths=0.6, zorder=3)
            self.images.append(image)
            self.markers.append(markers)

    def update(self, values, positions=np.zeros((0, 3)), masses=np.zeros(0)):
        for grid, image, markers in zip(self.grids, self.images, self.markers):
            image.set_data(_clip_for(self.norm, grid.image(values)))
            xy, sizes, _ = atom_markers(positions, masses, grid, self.total_mass)
            markers.set_offsets(xy)
            markers.set_sizes(sizes)


def _nside(density):
    """nside of snapshots (time, npix), whatever the cell dimension is called."""
    import healpy as hp

    return hp.npix2nside(density.shape[-1])


def _lonlat(vector):
    import healpy as hp

    lon, lat = hp.vec2dir(np.asarray(vector, dtype=float), lonlat=True)
    return _wrap(float(lon)), float(lat)


def _wrap(lon):
    """Longitude in (-180, 180]."""
    return 180.0 - (180.0 - lon) % 360.0


def _degrees(angle) -> str:
    """An angle rounded to whole degrees, without the "-0" that rounding −0.3 gives."""
    return str(int(round(angle)))


def _atom_text(positions, masses, sep=", "):
    masses = np.nan_to_num(np.asarray(masses, dtype=float), nan=0.0)
    alive = masses > 0
    if not alive.any():
        return ""
    count = int(alive.sum())
    return f"{sep}{count} atom{'s' if count > 1 else ''} (mass {masses[alive].sum():.3g})"


def _atom_legend(fig, total_mass):
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], ls="", marker="o", color=ATOM_COLOUR, markeredgecolor="white",
                      markersize=math.sqrt(float(atom_sizes(m, 1.0))), label=f"atom, mass {m:g}")
               for m in (0.02, 0.1, 0.5)]
    fig.legend(handles=handles, loc="outside lower center", fontsize=7, frameon=False, ncols=3,
               title=f"atoms (area ∝ mass, total mass {total_mass:.3g})", title_fontsize=7)


def sphere_figure(ds, times=None, centre=None, log=True, label=DENSITY_LABEL):
    """Rows of [Mollweide | front hemisphere | back hemisphere] for some snapshots (default: the
    first, the one nearest t = log β when it lies inside the run, the E-phase, and the last),
    one colour scale, atoms as points with area growing with mass. The
    hemispheres are centred on ±centre (default: mass_axis of the last snapshot). Returns
    (fig, axes (rows, 3))."""
    import matplotlib.pyplot as plt

    all_times = ds.time.values
    density = np.asarray(ds["density"].values, dtype=float)
    if times is None:
        idx = {0, all_times.size - 1}
        lb = _log_beta(ds)
        if math.isfinite(lb) and all_times[0] < lb < all_times[-1]:
            idx.add(int(np.abs(all_times - lb).argmin()))
        idx = sorted(idx)
    else:
        idx = [int(np.abs(all_times - t).argmin()) for t in times]
    if centre is None:
        centre = mass_axis(density[-1], *_atoms_at(ds, all_times.size - 1))
    nside = _nside(density)
    norm = density_norm(density[idx], log=log)
    total = _total_mass(ds)
    fig, axes = plt.subplots(len(idx), 3, figsize=(11, 2.9 * len(idx) + 0.9), squeeze=False,
                             gridspec_kw={"width_ratios": [2, 1, 1]}, layout="constrained")
    for r, (row, k) in enumerate(zip(axes, idx)):
        panels = SpherePanels(row, nside, centre, norm, total_mass=total)
        positions, masses = _atoms_at(ds, k)
        panels.update(density[k], positions, masses)
        if r:  # the column titles once, on the top row
            for ax in row:
                ax.set_title("")
        row[0].text(-0.03, 0.5, f"t = {all_times[k]:.3g}{_atom_text(positions, masses, sep=chr(10))}",
                    transform=row[0].transAxes, rotation=90, ha="right", va="center", fontsize=9,
                    fontweight="bold")
    fig.colorbar(axes[0, 0].images[0], ax=axes, orientation="vertical", fraction=0.025, pad=0.02,
                 label=label)
    if _has_atoms(ds):
        _atom_legend(fig, total)
    return fig, axes


def density_movie(ds, stem, max_frames=DEFAULT_MOVIE_FRAMES, fps=8, log=True, mp4=None,
                  dpi=100, label=DENSITY_LABEL):
    """Write stem + "_movie.gif" (and "_movie.mp4" when ffmpeg is available; mp4=False: never,
    True: required) of the density over time: per frame the SpherePanels of one snapshot, the time
    in the title; frames as movie_frames(n, max_frames); one colour scale for the movie. Returns
    the paths written."""
    import matplotlib.pyplot as plt
    from matplotlib.animation import FFMpegWriter, PillowWriter

    all_times = ds.time.values
    density = np.asarray(ds["density"].values, dtype=float)
    frames = movie_frames(all_times.size, max_frames)
    centre = mass_axis(density[-1], *_atoms_at(ds, all_times.size - 1))
    nside = _nside(density)
    norm = density_norm(density[frames], log=log)
    total = _total_mass(ds)
    # 1000 × 340 pixels at dpi 100: even sizes, as H.264 wants
    fig, axes = plt.subplots(1, 3, figsize=(10.0, 3.4), gridspec_kw={"width_ratios": [2, 1, 1]})
    fig.subplots_adjust(left=0.01, right=0.9, bottom=0.02, top=0.8, wspace=0.05)
    panels = SpherePanels(axes, nside, centre, norm, total_mass=total)
    cax = fig.add_axes([0.915, 0.12, 0.012, 0.62])
    fig.colorbar(panels.images[0], cax=cax, label=label)
    _freeze_ticks(cax)
    title = fig.suptitle("", fontsize=11, fontweight="bold", y=0.97)
    stem = Path(stem)
    writers = [(PillowWriter(fps=fps), stem.with_name(stem.name + "_movie.gif"))]
    if mp4 is None:
        mp4 = FFMpegWriter.isAvailable()
    if mp4:
        writers.append((FFMpegWriter(fps=fps, codec="h264", extra_args=["-pix_fmt", "yuv420p"]),
                        stem.with_name(stem.name + "_movie.mp4")))
    try:
        from contextlib import ExitStack

        with ExitStack() as stack:
            for writer, path in writers:
                stack.enter_context(writer.saving(fig, str(path), dpi))
            for k in frames:
                positions, masses = _atoms_at(ds, k)
                panels.update(density[k], positions, masses)
                title.set_text(f"t = {all_times[k]:.3g}{_atom_text(positions, masses)}")
                for writer, _ in writers:
                    writer.grab_frame()
    finally:
        plt.close(fig)
    return [path for _, path in writers]


def _freeze_ticks(ax):
    """Fix an axes' tick positions and labels as they are now: a movie redraws its colour bar on
    every frame, and locating and formatting log ticks anew was a fifth of a frame's time."""
    from matplotlib import ticker

    ax.figure.canvas.draw()
    for axis in (ax.xaxis, ax.yaxis):
        for which in ("major", "minor"):
            ticks = axis.get_ticklocs(minor=which == "minor")
            labels = [t.get_text() for t in axis.get_ticklabels(minor=which == "minor")]
            getattr(axis, f"set_{which}_locator")(ticker.FixedLocator(ticks))
            getattr(axis, f"set_{which}_formatter")(ticker.FixedFormatter(labels))


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


def _mark_partial(fig, note, top=True):
    """The note at the figure's top edge (above the panel titles of the maps, whose bottom holds
    legends) or at its bottom edge (below the x-labels of the time series, whose top holds titles)."""
    if note:
        fig.text(0.5, 0.999 if top else 0.003, note, ha="center", va="top" if top else "bottom", fontsize=8,
                 color="crimson", fontweight="bold",
                 bbox={"facecolor": "white", "edgecolor": "crimson", "pad": 1.5, "linewidth": 0.6})


def plot_run(run_file, out_dir, movie=False, max_frames=DEFAULT_MOVIE_FRAMES, fps=8) -> list[Path]:
    """Write `<stem>_density.png`, `<stem>_diagnostics.png` and `<stem>_sphere.png` for a run file
    (stem: the run file's name without .nc) into out_dir, and with movie=True `<stem>_movie.gif`
    (and .mp4 when ffmpeg is present); returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..storage.runfile import open_run

    if int(max_frames) < 1:
        raise ValueError(f"the number of movie frames must be >= 1, got {max_frames}")
    ds = open_run(run_file)
    label = DENSITY_LABEL
    if "density" not in ds and "positions" in ds:  # the particles alone: their histogram
        ds = token_histogram(ds)
        label = f"particles per cell area, HEALPix nside {TOKEN_NSIDE} (sr⁻¹)"
    if "density" not in ds or ds.sizes.get("time", 0) == 0:
        raise ValueError("no density snapshots")
    out = Path(out_dir)
    stem = Path(run_file).stem
    paths = []
    note = partial_note(ds)  # every figure of an unfinished run says so
    figures = {"density": (lambda: density_maps(ds, label=label), True),
               "diagnostics": (lambda: diagnostics_plot(ds), False),
               "sphere": (lambda: sphere_figure(ds, label=label), True)}
    for name, (make, top) in figures.items():  # one figure in memory at a time
        fig, _ = make()
        _mark_partial(fig, note, top)
        paths.append(out / f"{stem}_{name}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    if movie:
        paths.extend(density_movie(ds, out / stem, max_frames=max_frames, fps=fps, label=label))
    return paths
