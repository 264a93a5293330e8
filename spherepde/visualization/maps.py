"""What the figures and the movie draw on the sphere: projections of a NESTED HEALPix map onto an
image, colour scales, the atoms as markers, the centre of the views, and the title of a figure.

Projections are computed once per figure (ProjectedGrid: the HEALPix pixel under each image
pixel); a frame is values[lookup]. Maps use healpy's projectors on our own axes, with
flipconv="geo" (longitude increasing to the east: this is not the astronomical sky).

The view centre (view_centre): the orthographic hemispheres are centred on ±c and the Mollweide
maps on the longitude of c, where c is the leading axis of the last snapshot's mass (mass_axis),
or, when the mass moved on the way there (the E-phase axis more than 30° from the final axis), the
bisector of the two axes. For the paper's matrices the clusters sit on ±e₁ (E) and later on ±e₂
(F): c = (e₁ + e₂)/√2 shows all four 45° from a view centre, none at a limb or a map edge.

Atoms: markers of area ∝ mass (atom_sizes), red with a white edge, with a size key (atom_legend).
"""

from __future__ import annotations

import json
import math

import numpy as np

__all__ = [
    "ATOM_AREA",
    "ATOM_COLOUR",
    "ATOM_MIN_AREA",
    "DENSITY_LABEL",
    "ProjectedGrid",
    "SpherePanels",
    "atom_legend",
    "atom_markers",
    "atom_sizes",
    "atoms_at",
    "density_norm",
    "figure_title",
    "has_atoms",
    "log_beta",
    "mass_axis",
    "total_mass",
    "view_centre",
]

DENSITY_LABEL = "density f_t (sr⁻¹)"
ATOM_COLOUR = "red"
ATOM_AREA = 500.0  # marker area (points²) of an atom holding the whole mass: a disc of ~25 pt
ATOM_MIN_AREA = 4.0  # the lightest atoms stay visible (a dot of ~2 pt)
SAME_AXIS_COS = math.cos(math.radians(30.0))  # E-phase and final axes closer than this: one axis


class ProjectedGrid:
    """One projection of a NESTED HEALPix mesh onto an image, computed once: pix is the pixel
    under each image pixel (0 where the image is off the sphere or on the hidden hemisphere,
    marked by ~inside); image(values) is then a lookup per frame.

    kind "mollweide": the whole sphere, centred on longitude lon (degrees, default 0) at the
    equator; kind "orthographic": the hemisphere centred on centre (a unit vector), seen from
    outside."""

    def __init__(self, nside, kind="mollweide", centre=None, xsize=400, lon=0.0):
        import healpy as hp
        from healpy.projector import MollweideProj, OrthographicProj

        self.nside, self.kind = int(nside), kind
        if kind == "mollweide":
            self.lon = float(lon)
            self.proj = MollweideProj(rot=(self.lon, 0.0, 0.0), xsize=xsize, flipconv="geo")
            self.centre = None
        elif kind == "orthographic":
            self.centre = np.asarray(centre, dtype=float) / np.linalg.norm(centre)
            c_lon, c_lat = hp.vec2dir(self.centre, lonlat=True)
            self.proj = OrthographicProj(rot=(float(c_lon), float(c_lat), 0.0), half_sky=True,
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
        """Lines of the graticule (every step degrees) as arrays (n, 2), NaN where hidden and where
        a line leaves one edge of a Mollweide map for the other (a rotated map cuts parallels)."""
        import healpy as hp

        lines = []
        t = np.linspace(-180.0, 180.0, samples)
        for lon in np.arange(-180.0, 180.0, step):
            lat = np.linspace(-90.0, 90.0, samples)
            lines.append(np.stack(hp.ang2vec(np.full_like(lat, lon), lat, lonlat=True), axis=0))
        for lat in np.arange(-90.0 + step, 90.0, step):
            lines.append(np.stack(hp.ang2vec(t, np.full_like(t, lat), lonlat=True), axis=0))
        width = self.extent[1] - self.extent[0]
        out = []
        for vec in lines:
            xy = self.xy(vec)
            xy[~self.visible(vec)] = np.nan
            jump = np.flatnonzero(np.abs(np.diff(xy[:, 0])) > 0.5 * width)
            xy[jump] = np.nan
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


def clip_for(norm, image):
    """Values below a LogNorm's vmin (zeros included) drawn in its lowest colour, not blank."""
    from matplotlib import colors

    if isinstance(norm, colors.LogNorm):
        return np.ma.maximum(image, norm.vmin)
    return image


def atom_sizes(masses, total_mass=1.0):
    """Marker areas (points²) of atoms of these masses: ATOM_AREA·m/total, proportional to the
    mass, and at least ATOM_MIN_AREA so that the lightest atoms stay visible."""
    total = float(total_mass) if np.isfinite(total_mass) and total_mass > 0 else 1.0
    return np.maximum(ATOM_AREA * np.asarray(masses, dtype=float) / total, ATOM_MIN_AREA)


def atom_markers(positions, masses, grid, total_mass=1.0):
    """The atoms to draw on one projection: living (mass > 0, finite position) and visible.

    positions (k, 3), masses (k,) of one snapshot (empty slots: NaN position, mass 0). Returns
    (xy (m, 2), sizes (m,), slots (m,)): image-plane positions, marker areas (atom_sizes) and
    the slot index of each drawn atom."""
    positions = np.asarray(positions, dtype=float).reshape(-1, 3)
    masses = np.nan_to_num(np.asarray(masses, dtype=float).reshape(-1), nan=0.0)
    slots = np.flatnonzero((masses > 0) & grid.visible(positions))
    return grid.xy(positions[slots]), atom_sizes(masses[slots], total_mass), slots


def atom_scatter(ax):
    """An empty scatter artist for the atoms of one panel (filled by set_offsets / set_sizes)."""
    return ax.scatter(np.zeros(0), np.zeros(0), s=np.zeros(0), c=ATOM_COLOUR, edgecolors="white",
                      linewidths=0.6, zorder=3)


def atom_legend(fig, total, fontsize=7, masses=(0.02, 0.1, 0.5)):
    """The size key of the atoms at the figure's bottom (needs a constrained layout)."""
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], ls="", marker="o", color=ATOM_COLOUR, markeredgecolor="white",
                      markersize=math.sqrt(float(atom_sizes(m, 1.0))), label=f"atom of mass {m:g}")
               for m in masses]
    return fig.legend(handles=handles, loc="outside lower center", fontsize=fontsize, frameon=False,
                      ncols=len(masses), title=f"atoms: marker area ∝ mass (total mass {total:.3g})",
                      title_fontsize=fontsize)


def has_atoms(ds):
    return "atom_position" in ds and "atom_mass" in ds


def atoms_at(ds, k):
    """(positions (k, 3), masses (k,)) of snapshot k; empty arrays for a run without atoms."""
    if not has_atoms(ds):
        return np.zeros((0, 3)), np.zeros(0)
    return (np.asarray(ds["atom_position"].values[k], dtype=float),
            np.asarray(ds["atom_mass"].values[k], dtype=float))


def atom_text(masses, sep=", "):
    """', 2 atoms (mass 0.57)' for the living atoms of a snapshot; '' without any."""
    masses = np.nan_to_num(np.asarray(masses, dtype=float), nan=0.0)
    alive = masses > 0
    if not alive.any():
        return ""
    count = int(alive.sum())
    return f"{sep}{count} atom{'s' if count > 1 else ''} (mass {masses[alive].sum():.3g})"


def total_mass(ds):
    """The run's total mass (largest of the recorded totals; 1 when none is recorded)."""
    if "mass" in ds:
        mass = np.asarray(ds["mass"].values, dtype=float)
        mass = mass[np.isfinite(mass) & (mass > 0)]
        if mass.size:
            return float(mass.max())
    return 1.0


def log_beta(ds):
    """t = log β of the run (inf at β = ∞ or for several β)."""
    try:
        return float(ds.attrs.get("log_beta"))
    except (TypeError, ValueError):
        return math.inf


def mass_axis(density, atom_positions=(), atom_masses=()):
    """The leading eigenvector of the second moment Σ wᵢ xᵢxᵢᵀ of the mass (cells: density × cell
    area at the pixel centres; atoms: their masses), its sign towards the first moment (or, for a
    symmetric state, making its largest component positive). The z axis when there is no mass."""
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


def view_centre(ds):
    """The centre of the views of a run (see the module docstring): the mass axis of the last
    snapshot, or its bisector with the mass axis of the E-phase (the snapshot of largest
    alignment with E; without that diagnostic, the one nearest t = log β) when they are more than
    30° apart."""
    density = np.asarray(ds["density"].values, dtype=float)
    last = density.shape[0] - 1
    final = mass_axis(density[last], *atoms_at(ds, last))
    if "alignment_E" in ds and np.any(np.isfinite(ds["alignment_E"].values)):
        k = int(np.nanargmax(ds["alignment_E"].values))
    else:
        lb = log_beta(ds)
        k = int(np.abs(ds["time"].values - lb).argmin()) if math.isfinite(lb) else 0
    early = mass_axis(density[k], *atoms_at(ds, k))
    cos = float(early @ final)
    if abs(cos) >= SAME_AXIS_COS:
        return final
    centre = final + (np.sign(cos) or 1.0) * early  # an axis has two signs: take the nearer one
    return centre / np.linalg.norm(centre)


def lonlat(vector):
    """(longitude in (-180, 180], latitude) of a unit vector, degrees."""
    import healpy as hp

    lon, lat = hp.vec2dir(np.asarray(vector, dtype=float), lonlat=True)
    return wrap(float(lon)), float(lat)


def wrap(lon):
    """Longitude in (-180, 180]."""
    return 180.0 - (180.0 - lon) % 360.0


def degrees(angle) -> str:
    """An angle rounded to whole degrees, without the "-0" that rounding −0.3 gives."""
    return str(int(round(angle)))


def _number(value) -> str:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return str(value)
    return "∞" if math.isinf(x) else f"{x:g}"


LAW_NAMES = {"uniform": "uniform", "vmf": "von Mises–Fisher", "projected_normal": "projected normal",
             "mixture": "mixture"}


def figure_title(ds) -> str:
    """The title of every figure of a run: β, the initial law, the mesh and the spherepde version
    that wrote the run, e.g. 'β = 10, projected normal initial law, HEALPix nside 16 · spherepde 0.1.0'."""
    config = json.loads(ds.attrs["config"]) if "config" in ds.attrs else {}
    initial = config.get("initial", {})
    kind = initial.get("kind")
    law = LAW_NAMES.get(kind, str(kind).replace("_", " ")) if kind else "initial law unknown"
    if kind == "vmf" and "kappa" in initial:
        law += f" (κ = {_number(initial['kappa'])})"
    if kind:
        law += " initial law"
    eulerian = config.get("eulerian", {})
    if eulerian.get("enabled", True) is False:
        particles = config.get("particles", {})
        mesh = f"{particles.get('mode', 'particles')} alone" + (
            f" (n = {particles['n']})" if particles.get("mode") == "tokens" and "n" in particles else "")
    else:
        nside = ds.attrs.get("nside", eulerian.get("nside"))
        mesh = f"HEALPix nside {nside}" if nside is not None else "mesh unknown"
    if "plotted_system" in ds.attrs:  # one system of a batched run (visualization.plots.select_system)
        mesh += f", {ds.attrs['plotted_system']}"
    version = ds.attrs.get("spherepde_version")
    if version is None:
        from ..version import __version__ as version
    return f"β = {_number(ds.attrs.get('beta'))}, {law}, {mesh} · spherepde {version}"


class SpherePanels:
    """A Mollweide map beside the front and back orthographic hemispheres of one snapshot, on three
    given axes, with the atoms; update(values, positions, masses) redraws the data only (the
    projections, graticules and colour scale are set up once). The Mollweide map is centred on the
    longitude of centre, the hemispheres on ±centre."""

    def __init__(self, axes, nside, centre, norm, cmap="viridis", total_mass=1.0, xsize=400,
                 disc_xsize=240, fontsize=8):
        self.norm, self.total_mass = norm, total_mass
        centre = np.asarray(centre, dtype=float)
        lon, lat = lonlat(centre)
        self.grids = [ProjectedGrid(nside, "mollweide", xsize=xsize, lon=lon),
                      ProjectedGrid(nside, "orthographic", centre, xsize=disc_xsize),
                      ProjectedGrid(nside, "orthographic", -centre, xsize=disc_xsize)]
        self.axes = list(axes)
        self.images, self.markers = [], []
        titles = [f"Mollweide, centred on lon {degrees(lon)}° (east to the right)",
                  f"front: centred on lon {degrees(lon)}°, lat {degrees(lat)}°",
                  f"back: centred on lon {degrees(wrap(lon + 180))}°, lat {degrees(-lat)}°"]
        blank = np.zeros(12 * nside * nside)
        for ax, grid, title in zip(self.axes, self.grids, titles):
            image = ax.imshow(clip_for(norm, grid.image(blank)), origin="lower", extent=grid.extent,
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
            ax.set_title(title, fontsize=fontsize)
            self.images.append(image)
            self.markers.append(atom_scatter(ax))

    def update(self, values, positions=np.zeros((0, 3)), masses=np.zeros(0)):
        for grid, image, markers in zip(self.grids, self.images, self.markers):
            image.set_data(clip_for(self.norm, grid.image(values)))
            xy, sizes, _ = atom_markers(positions, masses, grid, self.total_mass)
            markers.set_offsets(xy)
            markers.set_sizes(sizes)
