"""What the validation suites share: where the repository's inputs are, and how numbers are
written in the reports. Suites import from here, never each other's private names."""

from __future__ import annotations

import math
from pathlib import Path

__all__ = ["REPO", "beta_text"]

# The suites read the repository's configs (solvers/) and tables (data/) and write reports beside
# validation/reports/: they run from a source checkout (pip install -e .).
REPO = Path(__file__).resolve().parents[2]


def beta_text(beta) -> str:
    """β as the reports write it: ∞, or the shortest decimal."""
    return "∞" if math.isinf(beta) else f"{beta:g}"
