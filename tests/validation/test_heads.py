"""spherepde/validation/heads.py: its exact references, and (slow) the quick report end to end."""

import math

import numpy as np
import pytest
import scipy.linalg

from spherepde.analysis.metrics import cell_quadrature_measure, zero_temperature_push
from spherepde.models.heads import theory_objects
from spherepde.validation import heads as vh


def test_flow_matrix_composes_the_layers_exact_flows():
    """A(t) of the β = ∞ layers is e^{(t−s)M_2}e^{sM_1} after the switch s, e^{tM_1} before it;
    the exact measure pushed by it equals the layer-by-layer push of spherepde.validation.paper."""
    schedule = vh.zero_temperature_layers()
    M1, M2 = (theory_objects(m).model.M for m in schedule.layers)
    s = vh.SWITCH
    np.testing.assert_allclose(vh.flow_matrix(schedule, 0.7 * s), scipy.linalg.expm(0.7 * s * M1), rtol=1e-13)
    A = scipy.linalg.expm(1.5 * M2) @ scipy.linalg.expm(s * M1)
    np.testing.assert_allclose(vh.flow_matrix(schedule, s + 1.5), A, rtol=1e-12)
    x, w = vh.exact_measure(schedule, s + 1.5, 4)
    x0, w0 = cell_quadrature_measure(vh.LAW, 4)
    stepwise = zero_temperature_push(theory_objects(schedule.layers[1]).model,
                                     zero_temperature_push(schedule.layers[0].heads[0], x0, s), 1.5)
    np.testing.assert_allclose(x, stepwise, atol=1e-12)
    np.testing.assert_array_equal(w, w0)
    heads = vh.two_orthogonal_heads()
    np.testing.assert_allclose(vh.flow_matrix(heads, 2.0), scipy.linalg.expm(2.0 * theory_objects(heads).model.M),
                               rtol=1e-13)


def test_plus_side_is_the_mass_beyond_the_separatrix():
    model = theory_objects(vh.two_orthogonal_heads()).model
    e = model.E.basis[:, 0]
    points = np.array([e, -e, e])
    assert vh.plus_side(points, [1.0, 2.0, 1.0], model) == pytest.approx(0.5)


@pytest.mark.slow
def test_quick_report(tmp_path):
    path = vh.run_suite(tmp_path, quick=True, progress=False)
    text = path.read_text()
    for title in ("## 1. Identical heads", "## 2. Two heads at β = ∞", "## 3. Two layers of equal weights",
                  "## 4. Two different layers", "## 5. Cost"):
        assert title in text
    assert text.count("0 (bitwise)") >= 10 and "nan" not in text.lower().replace("nanoseconds", "")
    assert math.isfinite(float(text.split("Total ")[1].split(" s")[0]))
