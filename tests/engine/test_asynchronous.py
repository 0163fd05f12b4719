"""Buffered asynchronous rounds (`engine/asynchronous.py`, FedBuff): staleness weights and the
rebase by hand, a run and its resume.
"""


import json

import fl_helpers
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_pfedes import aggregation
from fedjax_pfedes.engine.asynchronous import rebase, staleness_weight
from fedjax_pfedes.engine.loop import run_experiment
from fedjax_pfedes.io.metrics import WALL_CLOCK_FIELDS


def test_fedbuff_staleness_weights_and_rebase_by_hand():
    np.testing.assert_allclose(staleness_weight([0, 1, 3], "polynomial", 0.5),
                               [1, 1 / np.sqrt(2), 0.5])
    np.testing.assert_allclose(staleness_weight([4, 5, 6], "hinge", hinge_a=10, hinge_b=4),
                               [1, 1 / 11, 1 / 21])
    np.testing.assert_allclose(staleness_weight([0, 7], "constant"), [1, 1])
    template = {"w": jnp.array([1.0, 2.0])}
    deltas = {"w": jnp.array([[1.0, 1.0], [2.0, 0.0]])}
    rebased = rebase(deltas, template, jnp.array([1.0, 0.5]))
    np.testing.assert_allclose(rebased["w"], [[2, 3], [2, 2]])
    # Sample weights 1 and 3: x + (1 * 1 * [1, 1] + 3 * 0.5 * [2, 0]) / 4 = [2, 2.25].
    mean, _ = aggregation.weighted_mean([(rebased, jnp.array([1.0, 3.0]))])
    np.testing.assert_allclose(mean["w"], [2.0, 2.25])


@pytest.mark.slow
def test_asynchronous_rounds_and_their_resume(tmp_path):
    def config(rounds):
        c = fl_helpers.tiny_config(rounds)
        c.asynchronous.enabled = True
        c.asynchronous.concurrency = 5
        c.asynchronous.buffer_size = 2
        c.system.speed_classes = "1,6"
        c.system.time_jitter = 0.3
        c.checkpoint.every = 2
        return c

    run_experiment(config(6), str(tmp_path / "unbroken"), show_progress=False)
    run_experiment(config(4), str(tmp_path / "resumed"), show_progress=False)
    run_experiment(config(6), str(tmp_path / "resumed"), show_progress=False)
    rows = [json.loads(line) for line in open(tmp_path / "unbroken" / "metrics.jsonl")]
    clients = [json.loads(line) for line in open(tmp_path / "unbroken" / "clients.jsonl")]
    assert all(r["participants"] == 2 and r["in_flight"] == 3 for r in rows)
    assert max(r["staleness_max"] for r in rows) >= 1  # slow clients arrive late
    clock = [r["simulated_clock_s"] for r in rows]
    assert clock == sorted(clock) and clock[-1] > 0
    for c in clients:  # staleness = rounds since the client started; weight (1 + tau)^-0.5
        assert c["staleness"] >= 0
    skip = {*WALL_CLOCK_FIELDS, "personalized_accuracy_mean"}
    resumed = [json.loads(line) for line in open(tmp_path / "resumed" / "metrics.jsonl")]
    for a, b in zip(rows, resumed, strict=True):  # round 4 is evaluated only in the short run
        assert {k: v for k, v in a.items() if k not in skip and k in b} == \
            {k: v for k, v in b.items() if k not in skip and k in a}
