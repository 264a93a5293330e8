"""The model variants against their exact references (`spherepde validate variants`).

One suite per variant, each a module with its own report and its own docstring:

- spherepde.validation.unnormalised: the log-partition function of every summation path, unnormalised
  attention (vMF closed form, Funk–Hecke growth rates ℓ(ℓ+1)i_ℓ(β)/β, the interaction energy
  non-decreasing for B = V symmetric) → DIR/unnormalised.md;
- spherepde.validation.noise: the heat equation on the mesh (Y_ℓ decay, observed orders), growth rates with
  noise (minus νℓ(ℓ+1)), E[x_t] = e^{−2νt}x₀ for Brownian particles → DIR/noise.md;
- spherepde.validation.heads: several heads and layers (identical heads, the exact push-forward of
  orthogonal heads and of composed layers at β = ∞, cost per head) → DIR/heads.md.

DIR/variants.md lists them with the time each took. `quick` gives CI-sized runs of each.
"""

from __future__ import annotations

import time
from pathlib import Path

from .suites import SUITES, run

__all__ = ["run_suite"]


def run_suite(out, quick=False, progress=True, **_):
    """Run every variant's suite (those of the registry that are part of this one) into OUT and
    write OUT/variants.md; returns its path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    say = (lambda msg: print(msg, flush=True)) if progress else (lambda msg: None)
    lines = ["# The model variants", "", f"`spherepde validate variants{' --quick' if quick else ''} --out DIR`: "
             "one report per variant.", "", "| variant | report | wall time (s) |", "|---|---|---|"]
    for suite in SUITES.values():
        if suite.part_of != "variants":
            continue
        start = time.perf_counter()
        say(f"  variants: {suite.name}")
        run(suite.name, out, quick=quick, progress=progress)
        lines.append(f"| {suite.what} | [{suite.report}]({suite.report}) | {time.perf_counter() - start:.0f} |")
    path = out / "variants.md"
    path.write_text("\n".join(lines) + "\n")
    return path
