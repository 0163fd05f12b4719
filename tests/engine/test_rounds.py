"""A round's local work (`engine/rounds.py` and the local schedule it runs): step limits and whole
batches, against hand counts.
"""


import json

import fl_helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_pfedes.algorithms import local_training
from fedjax_pfedes.data.federated import ClientArrays
from fedjax_pfedes.engine.loop import run_experiment


def test_step_limit_caps_the_active_local_steps():
    schedule = local_training.batch_schedule(jax.random.key(0), jnp.int32(50), 64, 16, 3,
                                             jnp.int32(5))
    # 50 real rows, B = 16: 4 real steps per epoch (of 4), 12 in all; the cap keeps the first 5.
    np.testing.assert_array_equal(np.flatnonzero(schedule.step_active), [0, 1, 2, 3, 4])
    full = local_training.batch_schedule(jax.random.key(0), jnp.int32(50), 64, 16, 3)
    np.testing.assert_array_equal(schedule.indices, full.indices)
    assert int(full.step_active.sum()) == 12


def test_step_limit_in_a_client_update():
    from fedjax_pfedes.algorithms.fedavg import fedavg

    algorithm = fedavg(fl_helpers.fedavg_config(local_epochs=2))
    prog = algorithm.cohort_program("mlp")
    broadcast = algorithm.broadcast(algorithm.init_server(jax.random.key(0), ("mlp",)), "mlp")
    state = prog.init_client(jax.random.key(1))
    data = fl_helpers.client_data(40, 64)  # B = 8: 5 steps per epoch, 10 in all
    key = jax.random.key(1)
    update = jax.jit(prog.client_update)
    up_b, _, free = update(broadcast, state, data, key)
    uncapped = ClientArrays(data.x, data.y, data.sizes, jnp.int32(10 ** 6))
    up_a, _, m_a = update(broadcast, state, uncapped, key)
    assert float(m_a["local_steps"]) == float(free["local_steps"]) == 10.0
    for a, b in zip(jax.tree.leaves(up_a), jax.tree.leaves(up_b), strict=True):
        np.testing.assert_array_equal(a, b)
    capped = ClientArrays(data.x, data.y, data.sizes, jnp.int32(1))
    _, _, m_c = update(broadcast, state, capped, key)
    assert float(m_c["local_steps"]) == 1.0


@pytest.mark.slow
def test_drop_partial_batch_runs_whole_batches_only(tmp_path):
    """config.train.drop_partial_batch: a client of n >= B rows takes E * floor(n / B) steps,
    one below B takes E."""
    config = fl_helpers.tiny_config(rounds=2, num_clients=6)
    config.train.drop_partial_batch = True
    config.train.batch_size = 16
    config.train.client_fraction = 1.0
    run_experiment(config, str(tmp_path), show_progress=False)
    rows = [json.loads(line) for line in open(tmp_path / "clients.jsonl")]
    assert rows
    for r in rows:
        n, e = r["samples"], r["epochs"]
        assert r["local_steps"] == e * (n // 16 if n >= 16 else 1), r
