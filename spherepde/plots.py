"""Figures of a run: Mollweide maps of the density and time series of the diagnostics.

Every helper draws on axes it is given (ax=) or creates, and returns (fig, ax). Maps use
healpy's Mollweide projector on our own axes (healpy.mollview draws through pyplot state),
with flip="geo" (longitude increasing to the east: this is not the astronomical sky).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

__all__ = ["mollweide", "density_maps", "diagnostics_plot", "plot_run"]


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


def density_maps(ds, times=None, ncols=3, log=True):
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
    fig.colorbar(image, ax=axes, orientation="horizontal", fraction=0.04, pad=0.03,
                 label="density f_t (sr⁻¹)")
    return fig, axes


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
    ax = axes[0]
    ax.plot(t, ds.alignment_E, "C0", label="alignment with E")
    ax.plot(t, ds.alignment_F, "C1", label="alignment with F")
    if "particle_alignment_E" in ds:  # particles: same colours, dashed
        ax.plot(t, ds.particle_alignment_E, "C0--", label="E (particles)")
        ax.plot(t, ds.particle_alignment_F, "C1--", label="F (particles)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"alignment, β = {beta}")
    ax = axes[1]
    ax.semilogy(t, ds.w2_to_projection, "C0", label="W₂(ρ_t, Π#ρ₀)")
    if "particle_w2_to_projection" in ds:
        ax.semilogy(t, ds.particle_w2_to_projection, "C0--", label="W₂ (particles)")
        ax.semilogy(t, ds.w2_eulerian_particles, "C2-.", label="W₂(Eulerian, particles)")
    if "w2_bound_zero_temperature" in ds:
        ax.semilogy(t, ds.w2_bound_zero_temperature, "--", label="√(2V_p(ρ₀)) e^{−pγt/σ_max}")
    if "w2_bound_finite_beta" in ds:
        ax.semilogy(t, np.abs(ds.w2_bound_finite_beta), ":", label="2√(log(β+1)/β)(e^{C₁t} − e^{C₀t})")
    ax.set_title("distance to Π#ρ₀")
    ax = axes[2]
    ax.semilogy(t, ds.min_density, label="min f_t")
    ax.semilogy(t, ds.lower_bound_aposteriori, "--", label="ℓ₀ exp(−∫ sup div v)")
    ax.semilogy(t, ds.lower_bound_paper, ":", label="½ℓ₀e^{−C₀t}")
    ax.set_title("density lower bound")
    lb = _log_beta(ds)
    for ax in axes:
        if math.isfinite(lb) and t[0] <= lb <= t[-1]:
            ax.axvline(lb, color="grey", lw=0.8, ls="-.", label="t = log β")
        ax.set_xlabel("t")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig, axes


def plot_run(run_file, out_dir) -> list[Path]:
    """Write <stem>_density.png and <stem>_diagnostics.png for a run file; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .io import open_run

    ds = open_run(run_file)
    if "density" not in ds or ds.sizes.get("time", 0) == 0:
        raise ValueError("no density snapshots")
    out = Path(out_dir)
    stem = Path(run_file).stem
    paths = []
    fig, _ = density_maps(ds)
    paths.append(out / f"{stem}_density.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    fig, _ = diagnostics_plot(ds)
    paths.append(out / f"{stem}_diagnostics.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
