"""Figures of a run file: density maps, sphere views, diagnostics, movies (`spherepde plot`)."""
