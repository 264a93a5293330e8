"""Diagnostics of token systems on S^{d−1}, any d, one system or M batched: clusters, the
interaction energy, and the measure diagnostics of each system.

- Clusters (threshold rule): tokens i and j are linked when ⟨x_i, x_j⟩ ≥ CLUSTER_THRESHOLD = 0.999
  (an angle ≤ 2.56°), and the clusters are the connected components of that graph (the rank of
  the thresholded Gram matrix that borjanG/2023-transformers-rotf counts is the same number when
  the clusters are tight and apart). threshold_components finds them exactly by union–find over
  every pair: O(n² d) time per system (about one field evaluation), O(n) memory, no n × n array.
  The masses of the CLUSTER_SLOTS largest clusters are recorded, decreasing (0 in unused slots).
  clustered_pair_counts counts the linked pairs themselves (i < j), the statistic whose fraction
  of the n(n−1)/2 pairs the rotf phase diagrams colour: O(n² d) time per system, no n × n array.
- Energy: (1/β) ln ∬ e^{β⟨x, By⟩} dρ(x) dρ(y), the interaction energy ½β⁻¹∬e^{β⟨x,By⟩}dρdρ of
  the rotf papers on a log scale (the energy itself overflows at large β). Its log-partition
  sums come from spherepde.summation.batched (one extra O(n²) sum per snapshot). Defined for one
  head at finite β; NaN otherwise (several heads: no single energy; β = ∞: no partition function).
- The measure diagnostics (spherepde.analysis.diagnostics.MeasureDiagnostics) per system: the
  alignments with E and F in any d; W₂ to Π#ρ₀ exactly when dim E = 1 (two antipodal atoms:
  the threshold plan holds in any d), binned on HEALPix only on S² (NaN for dim E > 1, d ≠ 3);
  V_p as the point sum.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange
from scipy.special import logsumexp

from ..storage.schema import TOKEN_CLUSTER_MASS
from ..summation.batched import batched_softmax, log2_masses, source_rows
from .diagnostics import MeasureDiagnostics

__all__ = ["CLUSTER_THRESHOLD", "CLUSTER_SLOTS", "threshold_components", "clustered_pair_counts", "cluster_masses", "interaction_energy",
           "SystemDiagnostics"]

CLUSTER_THRESHOLD = 0.999
CLUSTER_SLOTS = 16


@njit(cache=True)
def _root(parent, i):
    while parent[i] != i:
        parent[i] = parent[parent[i]]  # path halving
        i = parent[i]
    return i


@njit(cache=True, parallel=True)
def threshold_components(x, threshold, labels):
    """Connected components of ⟨x_i, x_j⟩ ≥ threshold in each system of x (M, n, d): labels
    (M, n) receives, per token, the smallest index of its component; returns the counts (M,)."""
    nsys, n, d = x.shape
    counts = np.zeros(nsys, dtype=np.int64)
    for k in prange(nsys):
        parent = labels[k]
        for i in range(n):
            parent[i] = i
        for i in range(n):
            for j in range(i + 1, n):
                s = 0.0
                for q in range(d):
                    s += x[k, i, q] * x[k, j, q]
                if s >= threshold:
                    ri = _root(parent, i)
                    rj = _root(parent, j)
                    if ri != rj:  # the smaller index becomes the root
                        if ri < rj:
                            parent[rj] = ri
                        else:
                            parent[ri] = rj
        c = 0
        for i in range(n):
            r = _root(parent, i)
            parent[i] = r
            if r == i:
                c += 1
        counts[k] = c
    return counts


@njit(cache=True, parallel=True)
def clustered_pair_counts(x, threshold, counts):
    """counts[k] = #{(i, j): i < j, ⟨x_i, x_j⟩ ≥ threshold} in each system k of x (M, n, d);
    counts (M,) int64, written."""
    nsys, n, d = x.shape
    for k in prange(nsys):
        c = 0
        for i in range(n):
            for j in range(i + 1, n):
                s = 0.0
                for q in range(d):
                    s += x[k, i, q] * x[k, j, q]
                if s >= threshold:
                    c += 1
        counts[k] = c


def cluster_masses(labels, weights, slots=CLUSTER_SLOTS):
    """(M, slots): the masses (weights normalised to 1) of each system's largest clusters,
    decreasing, 0 where a system has fewer clusters."""
    w = np.asarray(weights, dtype=float) / np.sum(weights)
    out = np.zeros((labels.shape[0], slots))
    for k in range(labels.shape[0]):
        mass = np.bincount(labels[k], weights=w, minlength=labels.shape[1])
        top = np.sort(mass[mass > 0])[::-1][:slots]
        out[k, :top.size] = top
    return out


def interaction_energy(model, x, weights):
    """(1/β) ln ∬ e^{β⟨x, By⟩} dρ dρ for each system of x (M, n, d) (weights (n,), normalised
    here): an array (M,); NaN for model None or β = ∞ (module docstring)."""
    x = np.ascontiguousarray(x, dtype=float)
    if model is None or model.zero_temperature:
        return np.full(x.shape[0], math.nan)
    w = np.asarray(weights, dtype=float) / np.sum(weights)
    lam, ln_top = log2_masses(w)
    logz = np.empty(x.shape[:2])
    velocity = np.empty(x.shape)
    batched_softmax(x, source_rows(x), lam, np.ascontiguousarray(model.B.T), float(model.beta), model.V,
                    velocity, logz, ln_top)
    with np.errstate(divide="ignore"):
        return logsumexp(logz + np.log(w), axis=1) / model.beta


class SystemDiagnostics:
    """Per-system diagnostics of tokens (module docstring), relative to each system's initial
    measure.

    theory: the model whose E, F, Π the measure diagnostics use (None: not defined) and has_F,
    as spherepde.models.heads.theory_objects gives them; energy_model: the single head whose
    energy is recorded (None: NaN). x0 (M, n, d); weights (n,) shared. Calling it with x (M, n, d)
    gives name → array (M,) (cluster masses (M, CLUSTER_SLOTS)).
    """

    def __init__(self, theory_model, has_F, energy_model, x0, weights, p=0.25, w2_nside=8):
        x0 = np.asarray(x0, dtype=float)
        self.weights = np.asarray(weights, dtype=float)
        self.energy_model = energy_model
        self.systems = [MeasureDiagnostics(theory_model, x0[k], self.weights, p=p, w2_nside=w2_nside, has_F=has_F)
                        for k in range(x0.shape[0])]

    @property
    def lyapunov0(self):
        """V_p(ρ₀) of each system: a float for one system, else a list."""
        values = [diag.lyapunov0 for diag in self.systems]
        return values[0] if len(values) == 1 else values

    def __call__(self, x) -> dict:
        x = np.ascontiguousarray(x, dtype=float)
        rows = [diag(x[k], self.weights) for k, diag in enumerate(self.systems)]
        out = {f"particle_{name}": np.array([r[name] for r in rows]) for name in rows[0]}
        labels = np.empty(x.shape[:2], dtype=np.int64)
        counts = threshold_components(x, CLUSTER_THRESHOLD, labels)
        out["particle_energy"] = interaction_energy(self.energy_model, x, self.weights)
        out["particle_cluster_count"] = counts.astype(float)
        out[TOKEN_CLUSTER_MASS[0]] = cluster_masses(labels, self.weights)
        return out
