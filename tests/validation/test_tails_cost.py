"""spherepde.validation.tails_cost: one process runs the finite volumes, the tails' defaults and each
variant on the same case, and gives the CPU ratios to the finite volumes."""

import json

from spherepde.validation import tails_cost


def test_cost_rows_run_the_three_settings_and_give_ratios(monkeypatch):
    made = []
    real = tails_cost.config_for

    def recording(nside, t_end, law, overrides=(), beta=30.0):
        config = real(nside, t_end, law, overrides, beta)
        made.append(json.loads(json.dumps(config)))
        return config

    monkeypatch.setattr(tails_cost, "config_for", recording)
    rows = tails_cost.compare(nside=4, t_end=0.4, law="projected_normal",
                              variants=[("eulerian.tail_exclusion_width=0.0",)], say=lambda *_: None)
    assert [r[0] for r in rows] == ["finite volumes + atoms", 'tails = "log", defaults', "eulerian.tail_exclusion_width=0.0"]
    assert rows[0][2] == 1.0 and all(r[1] > 0 and r[2] > 0 for r in rows)
    measured = made[2:]  # after the two warm-up runs
    assert [c["eulerian"]["tails"] for c in measured] == ["finite_volume", "log", "log"]
    assert [c["eulerian"]["tail_exclusion_width"] for c in measured[1:]] == [1.0, 0.0]
    assert all(c["initial"]["kind"] == "projected_normal" and c["model"]["beta"] == 30.0 for c in measured)
    # another β reaches every run, the warm-ups too
    made.clear()
    tails_cost.compare(nside=4, t_end=0.2, law="vmf", say=lambda *_: None, beta=1000.0)
    assert len(made) == 4 and all(c["model"]["beta"] == 1000.0 for c in made)
