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


def test_client_metrics_columns_read_as_the_set_of_trained_clients():
    from fedjax_pfedes.engine.records import ClientMetrics, client_means

    a = ClientMetrics(np.array([7, 2]), {"train_ce_loss": np.array([1.0, 3.0]),
                                         "update_norm": np.array([0.5, 1.5])})
    b = ClientMetrics(np.array([5]), {"train_ce_loss": np.array([2.0]),
                                      "update_norm": np.array([4.0])})
    both = ClientMetrics.concatenate([a, ClientMetrics.empty(), b])
    assert list(both) == [7, 2, 5] and sorted(both) == [2, 5, 7] and len(both) == 3
    assert 5 in both and 3 not in both
    assert both[2] == {"train_ce_loss": 3.0, "update_norm": 1.5}
    np.testing.assert_array_equal(both.positions(np.array([5, 3, 7])), [2, -1, 0])
    # Against the per-client dicts the means were once computed from.
    rows = [{"train_ce_loss": 1.0, "update_norm": 0.5}, {"train_ce_loss": 3.0, "update_norm": 1.5},
            {"train_ce_loss": 2.0, "update_norm": 4.0}]
    assert client_means(both) == {
        "train_ce_loss_mean": np.mean([r["train_ce_loss"] for r in rows]),
        "client_loss_var": np.var([r["train_ce_loss"] for r in rows]),
        "update_norm_min": 0.5, "update_norm_median": 1.5, "update_norm_max": 4.0}
    assert client_means(ClientMetrics.empty()) == {}


def test_the_client_report_has_one_row_per_selected_client_by_hand():
    """Selected 4, 9 and 1: 4 and 1 trained (1's upload rejected), 9 dropped out before
    training; the rows written out by hand."""
    import types

    from fedjax_pfedes.engine import client_system
    from fedjax_pfedes.engine.rounds import ClientMetrics, Trained, client_report

    ctx = types.SimpleNamespace(
        client_arch=["a"] * 5 + ["b"] * 5, sizes=np.arange(10) * 10, epochs=np.full(10, 2),
        algorithm=types.SimpleNamespace(client_report_metrics=("align_loss_at_end",)))
    ctx.arch_of = lambda clients: [ctx.client_arch[int(c)] for c in clients]
    timing = client_system.RoundTiming(
        np.array([4, 9, 1]), np.array(["delivered", "dropped_out", "delivered"]),
        np.array([3, 0, 6]), np.array([0.5, 0.25, 1.0], np.float32), np.array([1.0, 0.0, 2.0]),
        np.array([0.1, 0.0, 0.2]), np.array([1.6, 0.25, 3.2]), 3.2)
    metrics = ClientMetrics(np.array([1, 4]), {
        "train_ce_loss": np.array([0.7, 0.3]), "local_steps": np.array([6.0, 3.0]),
        "align_loss_at_end": np.array([0.02, 0.01]), "update_norm": np.array([2.0, 1.0])})
    rows = client_report(ctx, timing, Trained({}, metrics, []), rejected={1},
                         staleness={4: 2})
    times = {"download_s": 0.5, "compute_s": 1.0, "upload_s": 0.1, "total_s": 1.6}
    assert rows == [
        {"client": 4, "arch": "a", "status": "delivered", "accepted": True, "samples": 40,
         "epochs": 2, "local_steps": 3, "train_loss": 0.3, "update_norm": 1.0, **times,
         "align_loss_at_end": 0.01, "staleness": 2},
        {"client": 9, "arch": "b", "status": "dropped_out", "accepted": False, "samples": 90,
         "epochs": 2, "local_steps": 0, "train_loss": None, "update_norm": None,
         "download_s": 0.25, "compute_s": 0.0, "upload_s": 0.0, "total_s": 0.25},
        {"client": 1, "arch": "a", "status": "delivered", "accepted": False, "samples": 10,
         "epochs": 2, "local_steps": 6, "train_loss": 0.7, "update_norm": 2.0,
         "download_s": 1.0, "compute_s": 2.0, "upload_s": 0.2, "total_s": 3.2,
         "align_loss_at_end": 0.02}]
    assert [type(r["samples"]) for r in rows] == [int] * 3
