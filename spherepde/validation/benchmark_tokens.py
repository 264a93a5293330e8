"""Cost per pair of the batched token sum (spherepde.summation.batched) against one system and
against the S² direct sum of the Eulerian solver, in d = 3, 8, 16, 128, in one process:
`python -m spherepde.validation.benchmark_tokens [n]` prints a Markdown table.

Each entry is the best of `repeats` calls, the calls of one d interleaved (a busy spell of a
shared machine hits them alike); uniform tokens, B = V = I, β = 30, velocity only."""

from __future__ import annotations

import sys
import time

import numpy as np

from ..models.attention import AttentionModel
from ..summation import attention_field
from ..summation.batched import batched_softmax, log2_masses, source_rows

__all__ = ["per_pair_times", "main"]


def per_pair_times(n=2000, systems=8, dims=(3, 8, 16, 128), repeats=5, beta=30.0, seed=0):
    """{d: {"one": s, "batched": s, "blocked": s or None}}: seconds per pair (blocked: d = 3 only)."""
    rng = np.random.default_rng(seed)
    lam, ln_top = log2_masses(np.full(n, 1.0 / n))
    out = {}
    for d in dims:
        x = rng.normal(size=(systems, n, d))
        x /= np.linalg.norm(x, axis=-1, keepdims=True)
        one = np.ascontiguousarray(x[:1])
        eye, none = np.eye(d), np.empty((0, 0))
        calls = {"one": lambda: batched_softmax(one, source_rows(one), lam, eye, beta, eye, np.empty(one.shape),
                                                none, ln_top),
                 "batched": lambda: batched_softmax(x, source_rows(x), lam, eye, beta, eye, np.empty(x.shape),
                                                    none, ln_top)}
        if d == 3:
            model = AttentionModel(eye, eye, beta)
            calls["blocked"] = lambda: attention_field(model, one[0], np.full(n, 1.0 / n), one[0], method="direct")
        pairs = {"one": n * n, "batched": systems * n * n, "blocked": n * n}
        best = dict.fromkeys(calls, np.inf)
        for call in calls.values():
            call()  # compile
        for _ in range(repeats):
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                best[name] = min(best[name], time.perf_counter() - start)
        out[d] = {name: best[name] / pairs[name] for name in calls}
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    n = int(argv[0]) if argv else 2000
    times = per_pair_times(n)
    base = times[3]["batched"]
    print(f"n = {n}, M = 8 systems, beta = 30 (ns per pair; best of 5)\n")
    print("| d | one system | M = 8 batched | batched / one | batched / batched d = 3 | target (d/3 + 0.5) |"
          " S² direct sum (softmax_blocked) |")
    print("|---|---|---|---|---|---|---|")
    for d, t in times.items():
        blocked = f"{t['blocked'] * 1e9:.3f}" if "blocked" in t else "—"
        print(f"| {d} | {t['one'] * 1e9:.3f} | {t['batched'] * 1e9:.3f} | {t['batched'] / t['one']:.2f} | "
              f"{t['batched'] / base:.2f} | {d / 3 + 0.5:.2f} | {blocked} |")


if __name__ == "__main__":
    main()
