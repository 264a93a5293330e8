"""`spherepde plot`: the orthographic sphere figure and the movie (--movie). Expectations come
from the run file (its snapshots, its atoms), not from the plotting code."""

import math

import healpy as hp
import numpy as np
import pytest
from run_configs import PAPER_VMF_CONFIG
from run_helpers import run_config_text

from spherepde.cli import main
from spherepde.storage.runfile import open_run

PIL = pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

# the paper's matrices from a vMF start: one atom by t = 0.75, two (antipodal) by t = 1.5 at nside 4
CONFIG = PAPER_VMF_CONFIG + """
[eulerian]
nside = 4

[time]
t_end = 1.5
save_every = 0.25
"""


@pytest.fixture(scope="module")
def atom_run(tmp_path_factory):
    return run_config_text(tmp_path_factory.mktemp("plots"), "atoms", CONFIG)


@pytest.fixture(scope="module")
def agg():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    yield plt
    plt.close("all")


def living(ds, k):
    mass = ds["atom_mass"].values[k]
    alive = mass > 0
    return ds["atom_position"].values[k][alive], mass[alive]


def gif_frames(path):
    im = Image.open(path)
    frames = []
    for i in range(im.n_frames):
        im.seek(i)
        frames.append(np.asarray(im.convert("RGB"), dtype=float))
    return frames


def test_the_run_has_atoms(atom_run):
    """The premise of the atom tests: some snapshot has living atoms, not all the same number."""
    ds = open_run(atom_run)
    counts = [(ds["atom_mass"].values[k] > 0).sum() for k in range(ds.sizes["time"])]
    assert counts[0] == 0 and max(counts) >= 2, counts


def test_plot_movie_writes_every_file(atom_run, tmp_path, capsys):
    assert main(["plot", str(atom_run), "-o", str(tmp_path), "--movie"]) == 0
    printed = [line.removeprefix("spherepde plot: wrote ") for line in capsys.readouterr().out.splitlines()]
    names = ["density.png", "diagnostics.png", "sphere.png", "movie.mp4", "movie.gif"]
    assert printed == [str(tmp_path / f"atoms_{name}") for name in names]
    for name in names:
        assert (tmp_path / f"atoms_{name}").stat().st_size > 10_000, name
    # one frame per snapshot of the file
    n_snapshots = open_run(atom_run).sizes["time"]
    assert Image.open(tmp_path / "atoms_movie.gif").n_frames == n_snapshots
    # without --movie: no movie, the rest as before
    other = tmp_path / "still"
    assert main(["plot", str(atom_run), "-o", str(other)]) == 0
    assert sorted(p.name for p in other.iterdir()) == [f"atoms_{n}" for n in names[:3]]


def test_movie_frame_cap_subsamples_evenly(atom_run, tmp_path):
    from spherepde.visualization.plots import movie_frames

    n = open_run(atom_run).sizes["time"]
    assert main(["plot", str(atom_run), "-o", str(tmp_path), "--movie", "--frames", "3"]) == 0
    assert Image.open(tmp_path / "atoms_movie.gif").n_frames == 3
    for total in (1, 2, 7, 100, 201, 1001):
        for cap in (1, 2, 3, 50, 200):
            got = movie_frames(total, cap)
            assert len(got) == min(total, cap)
            assert np.all(np.diff(got) > 0) and got[-1] == total - 1
            if len(got) > 1:
                assert got[0] == 0
                assert np.ptp(np.diff(got)) <= 1  # evenly spaced
    assert list(movie_frames(n, 1000)) == list(range(n))


def test_movie_frames_show_the_density(atom_run, tmp_path, agg):
    """Every frame has contrast; the map area (below the title) changes between snapshots whose
    density differs, and does not for a run whose density stands still (up to the GIF's palette,
    chosen per frame: measured 5 to 11 grey levels of mean change against below 0.02)."""
    from spherepde.visualization.plots import density_movie

    ds = open_run(atom_run)
    density = ds["density"].values
    path, = density_movie(ds, tmp_path / "moving", mp4=False)
    frames = gif_frames(path)
    assert len(frames) == ds.sizes["time"]
    maps = [f[int(0.25 * f.shape[0]):] for f in frames]  # below the suptitle
    for k, f in enumerate(frames):
        assert f.std() > 10, k
    for k in range(len(frames) - 1):
        if np.abs(density[k + 1] - density[k]).max() > 1e-3 * density.max():
            assert np.abs(maps[k + 1] - maps[k]).mean() > 1.0, k
    # the same movie of a frozen run (every snapshot = the first): the maps do not change
    frozen = ds.copy(deep=True)
    frozen["density"].values[:] = density[0]
    frozen["atom_mass"].values[:] = ds["atom_mass"].values[0]
    frozen["atom_position"].values[:] = ds["atom_position"].values[0]
    path, = density_movie(frozen, tmp_path / "frozen", mp4=False)
    still = [f[int(0.25 * f.shape[0]):] for f in gif_frames(path)]
    for k in range(len(still) - 1):
        assert np.abs(still[k + 1] - still[k]).mean() < 0.2, k


def test_mp4_always(atom_run, tmp_path, agg):
    """The MP4 needs no system ffmpeg (the imageio-ffmpeg wheel brings one): an H.264 file in an
    MP4 container with one frame per snapshot, whatever is on the PATH."""
    import imageio_ffmpeg

    from spherepde.visualization.plots import density_movie

    ds = open_run(atom_run)
    paths = density_movie(ds, tmp_path / "m", gif=False)
    mp4 = tmp_path / "m_movie.mp4"
    assert paths == [mp4] and mp4.stat().st_size > 5_000
    assert mp4.read_bytes()[4:8] == b"ftyp"
    frames, _ = imageio_ffmpeg.count_frames_and_secs(str(mp4))
    assert frames == ds.sizes["time"]


def test_sphere_figure_is_not_blank(atom_run, tmp_path, agg):
    from spherepde.visualization.plots import sphere_figure

    ds = open_run(atom_run)
    fig, axes = sphere_figure(ds)
    assert axes.shape == (2, 3)  # first and last snapshot
    fig.savefig(tmp_path / "s.png", dpi=60)
    image = np.asarray(Image.open(tmp_path / "s.png").convert("RGB"), dtype=float)
    assert image.std() > 10
    for ax in axes.flat:  # every panel's image has colour variation on the sphere
        data = ax.images[0].get_array()
        assert data.count() > 100 and data.std() > 0
    titles = " ".join(ax.get_title() for ax in axes.flat)
    assert "centred on lon" in titles and "-0°" not in titles  # no negative zero from rounding


def test_projected_grid_puts_each_pixel_where_it_is(agg):
    """The lookup image shows, at the image position of a point, the HEALPix pixel holding it;
    an orthographic view covers a disc (π/4 of its square) and hides the far hemisphere."""
    from spherepde.visualization.plots import ProjectedGrid

    nside = 8
    rng = np.random.default_rng(3)
    points = rng.normal(size=(200, 3))
    points /= np.linalg.norm(points, axis=1, keepdims=True)
    centre = np.array([0.3, -0.5, 0.8])
    for grid in (ProjectedGrid(nside, "mollweide", xsize=800),
                 ProjectedGrid(nside, "orthographic", centre, xsize=400)):
        seen = grid.visible(points)
        if grid.kind == "orthographic":
            np.testing.assert_array_equal(seen, points @ centre > 0)
            assert grid.inside.mean() == pytest.approx(np.pi / 4, abs=0.01)
        else:
            assert seen.all()
        xy = grid.xy(points[seen])
        ny, nx = grid.pix.shape
        x0, x1, y0, y1 = grid.extent
        j = np.clip(((xy[:, 0] - x0) / (x1 - x0) * nx).astype(int), 0, nx - 1)
        i = np.clip(((xy[:, 1] - y0) / (y1 - y0) * ny).astype(int), 0, ny - 1)
        want = hp.vec2pix(nside, *points[seen].T, nest=True)
        hit = grid.inside[i, j] & (grid.pix[i, j] == want)
        assert hit.mean() > 0.9, (grid.kind, hit.mean())  # points on a pixel edge may round over
        image = grid.image(np.where(np.arange(12 * nside**2) % 2, np.nan, 1.0))
        assert image.mask[~grid.inside].all() and 0 < image.count() < grid.inside.sum()


def test_atom_markers_count_and_size(atom_run, agg):
    """Markers: one per living atom on the visible hemisphere (all of them on the Mollweide map),
    the area increasing with the mass; and the sphere figure draws exactly those."""
    from spherepde.visualization.plots import (
        ProjectedGrid,
        atom_markers,
        atom_sizes,
        mass_axis,
        sphere_figure,
    )

    ds = open_run(atom_run)
    last = ds.sizes["time"] - 1
    positions, masses = ds["atom_position"].values[last], ds["atom_mass"].values[last]
    pos, mass = living(ds, last)
    centre = mass_axis(ds["density"].values[last], positions, masses)
    grids = [ProjectedGrid(4, "mollweide"), ProjectedGrid(4, "orthographic", centre),
             ProjectedGrid(4, "orthographic", -centre)]
    expected = [len(mass), int((pos @ centre > 0).sum()), int((pos @ centre < 0).sum())]
    assert expected[0] >= 2
    for grid, count in zip(grids, expected):
        xy, sizes, slots = atom_markers(positions, masses, grid)
        assert len(xy) == len(sizes) == len(slots) == count
        assert np.all(masses[slots] > 0) and np.all(np.isfinite(xy))
    # the figure: the last row's markers are these
    fig, axes = sphere_figure(ds)
    for ax, count in zip(axes[-1], expected):
        assert len(ax.collections[-1].get_offsets()) == count
    assert all(len(ax.collections[-1].get_offsets()) == 0 for ax in axes[0])  # t = 0: no atoms
    # sizes grow with the mass; empty slots (mass 0, NaN position) are not drawn
    rng = np.random.default_rng(0)
    pts = rng.normal(size=(6, 3))
    pts /= np.linalg.norm(pts, axis=1, keepdims=True)
    m = np.array([0.3, 0.0, 0.05, 0.2, 0.6, 0.01])
    pts[1] = np.nan
    xy, sizes, slots = atom_markers(pts, m, grids[0])
    assert list(slots) == [0, 2, 3, 4, 5]
    assert np.all(np.diff(sizes[np.argsort(m[slots])]) > 0)
    assert np.all(np.diff(atom_sizes(np.linspace(0, 1, 11))) > 0)


def test_mass_axis_points_at_the_mass():
    from spherepde.visualization.plots import mass_axis

    nside = 8
    x = np.column_stack(hp.pix2vec(nside, np.arange(12 * nside**2), nest=True))
    mu = np.array([0.6, 0.0, 0.8])
    blob = np.exp(10 * (x @ mu))
    blob /= blob.sum() * 4 * np.pi / blob.size
    assert mass_axis(blob) @ mu > 0.99
    # two antipodal atoms over a uniform background: the axis through them, towards the heavier
    a = np.array([0.0, 0.6, -0.8])
    axis = mass_axis(np.full(x.shape[0], 0.01), [a, -a, [np.nan] * 3], [0.3, 0.2, 0.0])
    assert axis @ a > 0.99
    np.testing.assert_allclose(np.linalg.norm(axis), 1.0)


def test_colour_scale_handles_zeros_and_nan():
    from matplotlib import colors

    from spherepde.visualization.plots import density_norm

    maps = np.array([[0.0, 1e-4, 0.5, np.nan], [2.0, 1e-3, 0.0, np.inf]])
    norm = density_norm(maps)
    assert isinstance(norm, colors.LogNorm) and norm.vmin == pytest.approx(1e-4) and norm.vmax == 2.0
    norm = density_norm(np.array([0.5, 0.6, np.nan]))  # less than a decade: linear
    assert not isinstance(norm, colors.LogNorm) and (norm.vmin, norm.vmax) == (0.5, 0.6)
    for flat in (np.full(4, np.nan), np.zeros(4), np.full(4, 0.3)):
        norm = density_norm(flat)
        assert np.isfinite(norm.vmin) and norm.vmin < norm.vmax


def test_plot_without_atom_variables(atom_run, tmp_path, agg):
    from spherepde.visualization.plots import density_movie, sphere_figure

    ds = open_run(atom_run)
    ds = ds.drop_vars([v for v in ds.data_vars if v.startswith("atom")])
    fig, axes = sphere_figure(ds)
    assert all(len(ax.collections[-1].get_offsets()) == 0 for ax in axes.flat)
    path, = density_movie(ds, tmp_path / "plain", max_frames=2, mp4=False)
    assert Image.open(path).n_frames == 2


@pytest.mark.parametrize("case", ["missing", "not a run file", "unwritable out", "zero frames", "frames without movie"])
def test_plot_movie_bad_input_exit_2(atom_run, tmp_path, capsys, case):
    args = {"missing": [str(tmp_path / "missing.nc"), "--movie"],
            "not a run file": [str(tmp_path / "x.nc"), "--movie"],
            "unwritable out": [str(atom_run), "-o", str(tmp_path / "file" / "sub"), "--movie"],
            "zero frames": [str(atom_run), "--movie", "--frames", "0"],
            "frames without movie": [str(atom_run), "--frames", "5"]}[case]
    (tmp_path / "x.nc").write_text("not netcdf")
    (tmp_path / "file").write_text("a file, not a folder")
    assert main(["plot", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("spherepde: error:"), err
    assert not list(tmp_path.glob("*.gif")) and not list(atom_run.parent.glob("*.gif"))


def test_the_figures_of_an_interrupted_run_say_so(tmp_path, agg):
    """A run stopped after 3 snapshots: partial_note names the last time and the end asked for,
    the plots are written; a finished run gets no note."""
    from run_helpers import interrupt_after

    from spherepde.storage.runfile import open_run
    from spherepde.visualization.plots import partial_note, plot_run

    cfg = tmp_path / "partial.toml"
    cfg.write_text(CONFIG)
    out = tmp_path / "partial.nc"
    interrupt_after(cfg, out, 3)
    ds = open_run(out)
    assert int(ds.attrs["complete"]) == 0
    note = partial_note(ds)
    assert note.startswith(f"partial run: stopped at t = {float(ds.time.values[-1]):g} of 1.5")
    assert "--resume" in note
    assert len(plot_run(out, tmp_path)) == 3
    from spherepde.visualization.plots import density_maps, diagnostics_plot, sphere_figure

    for make in (density_maps, diagnostics_plot, sphere_figure):  # the note heads every figure's title
        assert make(ds)[0].get_suptitle().splitlines()[0] == note, make.__name__
    assert partial_note(open_run(run_config_text(tmp_path, "done", CONFIG))) is None


def test_diagnostics_label_their_bounds_with_the_condition_they_need(atom_run, agg):
    """The β = ∞ bound on W₂ says so at finite β (a finite-β curve may cross it), not at β = ∞;
    the formulas are mathtext; the density axis follows min f and the a-posteriori bound (the
    paper's bound may fall below it), and every panel has a y-label."""
    from spherepde.storage.runfile import open_run
    from spherepde.visualization.plots import diagnostics_plot

    ds = open_run(atom_run)
    assert math.isfinite(float(ds.attrs["beta"]))
    fig, axes = diagnostics_plot(ds)
    labels = [h.get_label() for h in axes[1].get_lines()]
    assert any("bound at β = ∞ only" in s and s.startswith("$") for s in labels), labels
    assert all(ax.get_ylabel() for ax in axes)
    floor = min(ds.min_density.values.min(), ds.lower_bound_aposteriori.values.min())
    assert axes[2].get_ylim()[0] == pytest.approx(floor * 1e-4)
    ds.attrs["beta"] = "inf"
    _, axes = diagnostics_plot(ds)
    assert not any("only" in h.get_label() for h in axes[1].get_lines())


def test_sphere_figure_shows_the_snapshot_at_log_beta(atom_run, agg):
    """With t = log β inside the run, the default rows are the first snapshot, the one nearest
    log β (the concentration on E) and the last; outside it, first and last only."""
    from spherepde.visualization.plots import sphere_figure

    ds = open_run(atom_run)
    _, axes = sphere_figure(ds)
    assert float(ds.attrs["log_beta"]) > 1.5 and axes.shape == (2, 3)  # log 10 = 2.3 is after t_end
    ds.attrs["log_beta"] = 0.69  # log 2: nearest save time 0.75
    _, axes = sphere_figure(ds)
    assert axes.shape == (3, 3)
    labels = [ax.texts[0].get_text().split("\n")[0] for ax in axes[:, 0]]
    assert labels == ["t = 0", "t = 0.75 ≈ log β", "t = 1.5"]


def test_gif_has_no_palette_banding(tmp_path, agg):
    """The GIF keeps the shades the map is drawn with. A smooth nside-16 density over three
    decades: the colours of its cells under the movie's colour scale (the colour map at
    MOVIE_LEVELS levels, as Agg draws them) appear in the GIF frames exactly, 85 % of them at
    least (measured 91-98 %; the rest one level off, where the image's float32 resampling rounds a
    value across a level boundary). Pillow's per-frame adaptive palette (the PillowWriter route)
    kept 56-76 % of them on the same frames, merging neighbouring shades into bands."""
    import matplotlib.pyplot as plt
    import xarray as xr

    from spherepde.visualization.movie import MOVIE_LEVELS
    from spherepde.visualization.plots import density_movie, density_norm

    nside = 16
    x = np.column_stack(hp.pix2vec(nside, np.arange(12 * nside**2), nest=True))
    density = np.array([np.exp(kappa * (x @ np.array([0.6, 0.0, 0.8]) - 1.0)) for kappa in (2.0, 6.0, 12.0)])
    ds = xr.Dataset({"density": (("time", "cell"), density)}, coords={"time": [0.0, 1.0, 2.0]})
    path, = density_movie(ds, tmp_path / "bands", mp4=False)
    cmap = plt.get_cmap("viridis").resampled(MOVIE_LEVELS)
    level = {c: i for i, c in enumerate(map(tuple, cmap(np.arange(MOVIE_LEVELS), bytes=True)[:, :3].astype(int)))}
    norm = density_norm(density)
    for k, frame in enumerate(gif_frames(path)):
        drawn = {tuple(c) for c in frame.reshape(-1, 3).astype(int)}
        want = {tuple(c) for c in cmap(norm(np.maximum(density[k], norm.vmin)), bytes=True)[:, :3].astype(int)}
        assert len(want) > 50, k  # the premise: a map of many shades
        assert len(want & drawn) >= 0.85 * len(want), (k, len(want & drawn), len(want))
        drawn_levels = {level[c] for c in drawn if c in level}
        assert all({level[c] - 1, level[c] + 1} & drawn_levels for c in want - drawn), k


def test_every_figure_has_the_run_title(atom_run, tmp_path, agg):
    """β, the initial law, nside and the version that wrote the run, on every figure (suptitle)
    and every movie frame."""
    from spherepde.visualization.plots import density_maps, diagnostics_plot, figure_title, sphere_figure

    ds = open_run(atom_run)
    title = figure_title(ds)
    for part in ("β = 10", "von Mises–Fisher (κ = 3) initial law", "HEALPix nside 4",
                 f"spherepde {ds.attrs['spherepde_version']}"):
        assert part in title, (part, title)
    for make in (density_maps, diagnostics_plot, sphere_figure):
        fig, _ = make(ds)
        assert fig.get_suptitle().splitlines()[0] == title, make.__name__
    ds.attrs["beta"] = "inf"
    assert figure_title(ds).startswith("β = ∞,")


def test_density_maps_draw_the_atoms_with_area_proportional_to_mass(atom_run, agg):
    """Every Mollweide map of the density figure carries one marker per living atom, at the
    atom's projected position, its area ∝ mass (above the visibility floor), and a size key."""
    from spherepde.visualization.maps import ATOM_AREA, ATOM_MIN_AREA, ProjectedGrid, lonlat, view_centre
    from spherepde.visualization.plots import density_maps

    ds = open_run(atom_run)
    fig, axes = density_maps(ds)
    times = ds.time.values
    grid = ProjectedGrid(4, "mollweide", lon=lonlat(view_centre(ds))[0])
    seen = 0
    for ax in axes.flat:
        if not ax.images:
            continue
        k = int(np.argmin(np.abs(times - float(ax.get_title().split(",")[0].removeprefix("t = ")))))
        pos, mass = living(ds, k)
        markers = ax.collections[-1]
        assert len(markers.get_offsets()) == len(mass)
        if len(mass):
            np.testing.assert_allclose(markers.get_offsets(), grid.xy(pos), atol=1e-12)
            sizes = markers.get_sizes()
            big = mass * ATOM_AREA > ATOM_MIN_AREA
            np.testing.assert_allclose(sizes[big], ATOM_AREA * mass[big] / float(ds["mass"].max()), rtol=1e-12)
            assert np.all(sizes[~big] == ATOM_MIN_AREA)
            seen += len(mass)
    assert seen >= 2
    assert fig.legends and "area ∝ mass" in fig.legends[0].get_title().get_text()


def test_atom_events_are_marked_where_atoms_are_created_or_merged(atom_run, agg):
    """The vertical event lines of the time series sit at the snapshots where the counters of
    created or merged atoms change (every change of the number of atoms among them), on each
    panel, and the caption line names them."""
    from spherepde.visualization.plots import atom_events, diagnostics_plot

    ds = open_run(atom_run)
    t = ds.time.values
    counters = ds["atoms_created"].values + ds["atoms_merged"].values
    want = [k for k in range(1, t.size) if counters[k] != counters[k - 1]]
    count = (ds["atom_mass"].values > 0).sum(axis=1)
    assert {k for k in range(1, t.size) if count[k] != count[k - 1]} <= set(want) and want
    events = atom_events(ds)
    assert [e.index for e in events] == want
    assert [e.created for e in events] == [int(ds["atoms_created"].values[k] - ds["atoms_created"].values[k - 1])
                                          for k in want]
    fig, axes = diagnostics_plot(ds)
    for ax in axes:
        lines = [ln for ln in ax.get_lines() if ln.get_color() == "crimson"]
        assert sorted(float(ln.get_xdata()[0]) for ln in lines) == pytest.approx(t[want])
    caption = " ".join(text.get_text() for text in fig.texts)
    assert "atom events" in caption
    for k in want:
        assert f"{t[k]:.3g} (" in caption
    # a run without the counters: the changes of the number of living atoms
    plain = ds.drop_vars(["atoms_created", "atoms_merged"])
    assert [e.index for e in atom_events(plain)] == [k for k in range(1, t.size) if count[k] != count[k - 1]]


def test_view_centre_shows_the_e_phase_and_the_final_clusters():
    """Atoms on ±e₁ at the largest alignment with E and on ±e₂ at the end: the views are centred
    between the axes, 45° from both (no cluster on a limb); one axis throughout: centred on it."""
    import xarray as xr

    from spherepde.visualization.maps import view_centre

    npix = 12 * 4**2
    e1, e2 = np.eye(3)[0], np.eye(3)[1]
    positions = np.array([[e1, -e1], [e1, -e1], [e2, -e2]])
    ds = xr.Dataset({"density": (("time", "cell"), np.zeros((3, npix))),
                     "alignment_E": ("time", [0.5, 1.0, 0.0]),
                     "atom_position": (("time", "atom", "xyz"), positions),
                     "atom_mass": (("time", "atom"), np.full((3, 2), 0.5))},
                    coords={"time": [0.0, 1.0, 2.0]})
    centre = view_centre(ds)
    np.testing.assert_allclose(np.abs(centre @ np.array([e1, e2]).T), [2**-0.5, 2**-0.5], atol=1e-12)
    np.testing.assert_allclose(centre[2], 0.0, atol=1e-12)
    ds["atom_position"].values[2] = [e1, -e1]
    assert abs(view_centre(ds) @ e1) == pytest.approx(1.0)


def test_sphere_figure_scales_each_row_on_its_own(atom_run, agg):
    """Each row's colour scale spans that snapshot's mesh density, with its own colour bar, so a
    uniform start sits mid-scale, not at the top of a scale set by later snapshots."""
    from matplotlib import colors

    from spherepde.visualization.plots import sphere_figure

    ds = open_run(atom_run).copy(deep=True)
    density = ds["density"].values
    density[0] = 1.0 / (4.0 * np.pi)  # a uniform start
    fig, axes = sphere_figure(ds)
    assert len(fig.axes) == axes.size + axes.shape[0]  # a colour bar per row
    norm0 = axes[0, 0].images[0].norm
    assert not isinstance(norm0, colors.LogNorm)
    assert 0.2 < norm0(1.0 / (4.0 * np.pi)) < 0.8
    last = axes[-1, 0].images[0].norm
    assert last.vmax == pytest.approx(density[-1].max())
