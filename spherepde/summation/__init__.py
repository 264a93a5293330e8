"""The attention summation: the velocity field v(x) = P_x(V m_β(x)) of a measure on S², its
surface divergence and the softmax mean m_β(x) = Σ_j ω_j y_j, ω_j ∝ μ_j e^{β⟨Bᵀx, y_j⟩}.

Layers, each importing only from those below it (tests/test_layering.py checks this):

    field        attention_field / AttentionField: the one entry point, the method choice and
                 cost model, PreparedSources (built once for many calls), mesh_sources
                                                                (imports the sums and kernels)
    direct, tree, harmonic, near_field, points, clustered
                 the sums side by side: direct O(N·T), tree pruning, Funk–Hecke expansion, the
                 near-field cell integrals, a few point sources added exactly to a finished
                 sum (the atoms' split sums), and tight groups of sources as one term each
                 (concentrated tokens)                 (import kernels, fastmath, spherepde.geometry.mesh)
    kernels      shared numba kernels: source arrays, block maxima and moments, finishing
    fastmath     the vectorisable exp / exp2 and maxnum of the kernels

The solvers (spherepde.solvers.eulerian, spherepde.solvers.particles) and validation/ sit on top and import from
here.
"""

from .direct import softmax_blocked, softmax_direct_reference, zero_temperature_field
from .field import (
           DEFAULT_TOL,
           METHODS,
           AttentionField,
           PreparedSources,
           attention_field,
           choose_method,
           mesh_sources,
)
from .kernels import project_velocity, source_arrays
from .near_field import NearField, table_bytes

__all__ = ["attention_field", "AttentionField", "PreparedSources", "mesh_sources", "choose_method", "METHODS", "DEFAULT_TOL",
           "NearField", "table_bytes", "project_velocity", "zero_temperature_field", "softmax_blocked",
           "softmax_direct_reference", "source_arrays"]
