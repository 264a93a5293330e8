"""The movie of a run (`spherepde plot RUN.nc --movie`): per frame the SpherePanels of one snapshot
(a Mollweide map and the two orthographic hemispheres, atoms drawn), the run's title and the time
above them, one colour scale for the whole movie.

Written as <stem>_movie.mp4 (H.264, yuv420p) through imageio with the ffmpeg binary of the
imageio-ffmpeg wheel (no system software needed) and, as the fallback for viewers without video
(Markdown pages, some slide tools), <stem>_movie.gif. The GIF uses one fixed palette built from
the colour map (MOVIE_LEVELS levels, the maps are drawn with exactly those colours) plus greys and
reds for text, graticule and atoms, with dithering off: a smooth density keeps all its levels,
where a per-frame adaptive palette band-limits it to a few dozen shades and makes them flicker.

Frames: all snapshots, or for runs with more than max_frames snapshots (default
DEFAULT_MOVIE_FRAMES) max_frames evenly spaced ones, the first and the last included.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .maps import (
    DENSITY_LABEL,
    SpherePanels,
    atom_text,
    atoms_at,
    density_norm,
    figure_title,
    total_mass,
    view_centre,
)

__all__ = ["DEFAULT_MOVIE_FRAMES", "MOVIE_LEVELS", "density_movie", "movie_frames", "movie_palette"]

DEFAULT_MOVIE_FRAMES = 200
MOVIE_LEVELS = 200  # colours of the colour map in the movie (the rest of the 256 of a GIF palette: greys, reds)
FRAME_INCHES = (12.8, 4.64)  # at dpi 100: 1280 × 464 pixels, multiples of 16 as H.264 encoders like


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


def movie_palette(cmap):
    """The GIF palette (256 RGB triples, uint8): the cmap's MOVIE_LEVELS colours (as drawn), 40 greys
    from black to white (text, graticule, background) and 16 shades from the atoms' red to white
    (their edges)."""
    from matplotlib import colors

    levels = np.asarray(cmap(np.arange(cmap.N), bytes=True))[:, :3]  # as Agg draws them
    greys = np.repeat(np.linspace(0, 255, 40).round()[:, None], 3, axis=1)
    red = np.asarray(colors.to_rgb("red")) * 255
    reds = red + np.linspace(0, 1, 16)[:, None] * (255 - red)
    palette = np.vstack([levels, greys, reds]).round().astype(np.uint8)
    assert len(palette) == 256, len(palette)
    return palette


def _quantize(rgb, palette_image):
    """An RGB frame (h, w, 3) uint8 mapped to the fixed palette, each pixel to its nearest entry."""
    from PIL import Image

    return Image.fromarray(rgb, "RGB").quantize(palette=palette_image, dither=Image.Dither.NONE)


def _frame(fig):
    """The figure's pixels as RGB uint8 (h, w, 3), cropped to even sizes (yuv420p needs them)."""
    fig.canvas.draw()
    rgb = np.asarray(fig.canvas.buffer_rgba())[..., :3]
    h, w = rgb.shape[0] // 2 * 2, rgb.shape[1] // 2 * 2
    return np.ascontiguousarray(rgb[:h, :w])


def density_movie(ds, stem, max_frames=DEFAULT_MOVIE_FRAMES, fps=8, log=True, mp4=True, gif=True,
                  dpi=100, label=DENSITY_LABEL):
    """Write stem + "_movie.mp4" (mp4=True) and stem + "_movie.gif" (gif=True) of the density
    over time (see the module docstring). Returns the paths written, the MP4 first."""
    import healpy as hp
    import matplotlib.pyplot as plt
    from PIL import Image

    if not (mp4 or gif):
        raise ValueError("density_movie: neither mp4 nor gif asked for")
    all_times = ds.time.values
    density = np.asarray(ds["density"].values, dtype=float)
    frames = movie_frames(all_times.size, max_frames)
    cmap = plt.get_cmap("viridis").resampled(MOVIE_LEVELS)  # the GIF palette holds each of its colours
    norm = density_norm(density[frames], log=log)
    with plt.rc_context({"font.size": 11}):
        fig, axes = plt.subplots(1, 3, figsize=FRAME_INCHES, gridspec_kw={"width_ratios": [2, 1, 1]})
        fig.subplots_adjust(left=0.01, right=0.89, bottom=0.02, top=0.83, wspace=0.05)
        panels = SpherePanels(axes, hp.npix2nside(density.shape[-1]), view_centre(ds), norm, cmap=cmap,
                              total_mass=total_mass(ds), fontsize=11)
        cax = fig.add_axes([0.905, 0.1, 0.014, 0.7])
        fig.colorbar(panels.images[0], cax=cax, label=f"mesh {label}")
        _freeze_ticks(cax)
        fig.text(0.5, 0.985, figure_title(ds), ha="center", va="top", fontsize=12)
        clock = fig.text(0.5, 0.93, "", ha="center", va="top", fontsize=15, fontweight="bold")
    stem = Path(stem)
    paths = {"mp4": stem.with_name(stem.name + "_movie.mp4"), "gif": stem.with_name(stem.name + "_movie.gif")}
    palette = Image.new("P", (1, 1))
    palette.putpalette(movie_palette(cmap).ravel().tolist())
    video, stills = None, []
    try:
        if mp4:
            import imageio.v2 as imageio

            # macro_block_size 2: the frame is cropped to even sizes and never rescaled
            video = imageio.get_writer(paths["mp4"], format="FFMPEG", fps=fps, codec="libx264",
                                       pixelformat="yuv420p", quality=8, macro_block_size=2)
        for k in frames:
            positions, masses = atoms_at(ds, k)
            panels.update(density[k], positions, masses)
            clock.set_text(f"t = {all_times[k]:.2f}{atom_text(masses)}")
            rgb = _frame(fig)
            if video is not None:
                video.append_data(rgb)
            if gif:
                stills.append(_quantize(rgb, palette))
    finally:
        plt.close(fig)
        if video is not None:
            video.close()
    if gif:
        stills[0].save(paths["gif"], save_all=True, append_images=stills[1:], duration=round(1000 / fps),
                       loop=0, optimize=False)
    return [paths[kind] for kind, wanted in (("mp4", mp4), ("gif", gif)) if wanted]


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
