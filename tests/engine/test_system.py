"""Unreliable clients, smarter sampling and buffered asynchronous rounds, against hand-computed
numbers: the deadline, partial work, drop-outs, stratified quotas, failure decay, adaptive
epochs, step limits, FedBuff staleness weights."""

import json

import fl_helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_pfedes import aggregation
from fedjax_pfedes.algorithms import local_training
from fedjax_pfedes.data.federated import ClientArrays
from fedjax_pfedes.engine import client_system, sampling
from fedjax_pfedes.engine.asynchronous import rebase, staleness_weight
from fedjax_pfedes.engine.loop import run_experiment
from fedjax_pfedes.engine.validate import validate_config
from fedjax_pfedes.errors import ConfigError


def _system(**kw) -> client_system.SystemConfig:
    base = dict(speed_classes=(1.0, 2.0, 4.0), step_time_s=0.1, upload_mbps=(8.0,),
                download_mbps=(16.0,))
    return client_system.SystemConfig(**{**base, **kw})


def test_deadline_drops_exactly_the_clients_past_it():
    cfg = _system(deadline_s=3.0)
    profiles = client_system.client_profiles(cfg, 12, seed=3)
    clients = np.arange(12)
    steps = np.array([3, 5, 8, 10, 12, 4, 6, 9, 2, 7, 11, 1])
    up, down = np.full(12, 1e6), np.full(12, 2e6)  # 1 s up at 8 Mbit/s, 1 s down at 16 Mbit/s
    timing = client_system.simulate_round(cfg, profiles, 3, 0, clients, steps, up, down)
    step_s = 0.1 * np.array([1.0, 2.0, 4.0])[profiles.speed_class]
    total = 1.0 + 1.0 + steps * step_s  # by hand
    late = total > 3.0
    assert late.any() and (~late).any()
    np.testing.assert_array_equal(timing.status == client_system.PAST_DEADLINE, late)
    np.testing.assert_array_equal(timing.trains, ~late)
    np.testing.assert_allclose(timing.total_s[~late], total[~late])
    np.testing.assert_array_equal(timing.step_limit, np.where(late, 0, steps))
    assert timing.round_s == 3.0  # the server waited until the deadline


def test_partial_work_runs_the_steps_that_fit_before_the_deadline():
    cfg = _system(deadline_s=2.6, deadline_policy="partial")
    profiles = client_system.client_profiles(cfg, 9, seed=1)
    steps = np.full(9, 10)
    timing = client_system.simulate_round(cfg, profiles, 1, 0, np.arange(9), steps, np.full(9, 1e6),
                                   np.full(9, 2e6))
    step_s = 0.1 * np.array([1.0, 2.0, 4.0])[profiles.speed_class]
    fits = np.floor((2.6 - 2.0) / step_s).astype(int)  # 6, 3, 1 steps
    expected = np.where(2.0 + 10 * step_s > 2.6, np.minimum(fits, 10), 10)
    np.testing.assert_array_equal(timing.step_limit, expected)
    assert set(timing.status) == {client_system.PARTIAL}
    assert np.all(timing.total_s <= 2.6 + 1e-9)


def test_dropout_rate_and_availability_window():
    cfg = _system(dropout=0.3)
    profiles = client_system.client_profiles(cfg, 200, seed=0)
    dropped = [np.mean(client_system.simulate_round(cfg, profiles, 0, r, np.arange(200),
                                             np.ones(200), np.zeros(200), np.zeros(200)).status
                       == client_system.DROPPED_OUT) for r in range(50)]
    assert abs(np.mean(dropped) - 0.3) < 0.02  # 10,000 draws: 4.5 standard errors
    periodic = _system(availability=(1.0,), availability_period=4, availability_duty=0.5)
    prof = client_system.client_profiles(periodic, 30, seed=0)
    online = np.array([client_system.online_mask(periodic, prof, 0, r) for r in range(8)])
    for i in range(30):  # online exactly in rounds r with (r + phase) mod 4 < 2
        np.testing.assert_array_equal(online[:, i], (np.arange(8) + prof.phase[i]) % 4 < 2)


def test_stratified_sampling_keeps_every_client_within_its_quota_bounds():
    n, m, rounds = 50, 10, 400
    sizes = np.random.default_rng(0).lognormal(4, 1, n).astype(int) + 5
    avail_class = np.arange(n) % 2  # availability 0.9 / 0.4
    availability = np.where(avail_class == 0, 0.9, 0.4)
    strata = sampling.size_strata(sizes, 3, avail_class)
    state = sampling.SamplerState.create(n, int(strata.max()) + 1)
    uniform_counts = np.zeros(n, int)
    for r in range(rounds):
        online = np.random.default_rng([7, r]).random(n) < availability
        chosen = sampling.stratified_sample(0, r, m, online, np.ones(n), strata, state)
        assert len(chosen) == m and online[chosen].all()
        state.record(chosen, chosen)
        uniform_counts[sampling.weighted_uniform(0, r, m, online, np.ones(n))] += 1
    # Quota: each stratum gets m x its share of clients per round, so each client
    # R * m / N = 80 rounds; least-selected-first keeps every client within 2 of it.
    quota = rounds * m / n
    assert np.all(np.abs(state.selected - quota) <= 2), (state.selected.min(),
                                                          state.selected.max())
    # Uniform sampling among online clients starves the rarely-online half.
    assert uniform_counts[avail_class == 1].mean() < quota - 20
    assert uniform_counts.min() < quota - 30


def test_failing_clients_are_sampled_less():
    state = sampling.SamplerState.create(4, 1)
    state.record(np.array([0, 1, 2, 3]), np.array([0, 1]))
    state.record(np.array([2, 3]), np.array([2]))  # client 3 failed twice in a row
    np.testing.assert_array_equal(state.failure_streak, [0, 0, 0, 2])
    weights = sampling.reliability_weights(state, 0.5)
    np.testing.assert_allclose(weights, [1, 1, 1, 0.25])
    picks = np.zeros(4)
    for r in range(4000):
        picks[sampling.weighted_uniform(0, r, 1, np.ones(4, bool), weights)] += 1
    np.testing.assert_allclose(picks / 4000, weights / weights.sum(), atol=0.02)


def test_equal_weights_reproduce_uniform_sampling():
    for r in range(5):
        np.testing.assert_array_equal(
            sampling.weighted_uniform(3, r, 4, np.ones(10, bool), np.ones(10)),
            sampling.uniform_sample(3, r, 10, 0.4))


def test_adaptive_epochs_and_minimum_samples():
    sizes = np.array([25, 100, 400, 1600])  # median 250
    e = sampling.local_epochs_per_client(sizes, 2, True, 1, 4, 0, "skip")
    # round(2 * sqrt(250 / n)) clipped to [1, 4]: 6.3 -> 4, 3.16 -> 3, 1.58 -> 2, 0.79 -> 1
    np.testing.assert_array_equal(e, [4, 3, 2, 1])
    e = sampling.local_epochs_per_client(sizes, 2, False, 1, 4, 50, "one_epoch")
    np.testing.assert_array_equal(e, [1, 2, 2, 2])
    np.testing.assert_array_equal(sampling.planned_steps(sizes, np.full(4, 1600), 32, e),
                                  [1, 8, 26, 100])


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
@pytest.mark.parametrize("dropout", [0.3, 0.6])
def test_dropouts_never_crash_and_are_counted(tmp_path, dropout):
    config = fl_helpers.tiny_config(rounds=6)
    config.system.dropout = dropout
    config.system.deadline_s = 0.9
    config.system.speed_classes = "1,8"
    summary = run_experiment(config, str(tmp_path), show_progress=False)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    clients = [json.loads(line) for line in open(tmp_path / "clients.jsonl")]
    for r in rows:
        mine = [c for c in clients if c["round"] == r["round"]]
        status = [c["status"] for c in mine]
        assert r["selected"] == len(mine) == r["planned_participants"] == 4
        assert r["dropped_out"] == status.count("dropped_out")
        assert r["past_deadline"] == status.count("deadline")
        assert r["participants"] == status.count("delivered") == r["uploads_accepted"]
        assert r["selected"] == r["participants"] + r["dropped_out"] + r["past_deadline"]
        assert r["upload_success_rate"] == r["uploads_accepted"] / r["selected"]
        late = [c for c in mine if c["status"] == "deadline"]
        assert all(c["total_s"] > 0.9 for c in late)
        assert all(c["total_s"] <= 0.9 for c in mine if c["status"] == "delivered")
    lost = sum(r["dropped_out"] for r in rows)
    assert lost > 0 and np.isfinite(summary["final"]["personalized_accuracy_mean"])
    assert sum(summary["participation"]["selected"]) == 24
    assert sum(summary["participation"]["completed"]) == sum(r["participants"] for r in rows)


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
    skip = {"round_time_s", "elapsed_s", "personalized_accuracy_mean"}
    resumed = [json.loads(line) for line in open(tmp_path / "resumed" / "metrics.jsonl")]
    for a, b in zip(rows, resumed, strict=True):  # round 4 is evaluated only in the short run
        assert {k: v for k, v in a.items() if k not in skip and k in b} == \
            {k: v for k, v in b.items() if k not in skip and k in a}


def test_bad_runtime_fields_are_refused_with_the_field_named():
    from configs import quickstart

    for field, value, message in [
        ("system.dropout", 1.0, "config.system.dropout"),
        ("system.speed_classes", "1,x", "config.system.speed_classes"),
        ("system.upload_mbps", "1,2", "config.system.upload_mbps"),
        ("system.deadline_policy", "wait", "config.system.deadline_policy"),
        ("train.sampling", "roundrobin", "config.train.sampling"),
        ("train.below_min", "drop", "config.train.below_min"),
        ("checkpoint.every", -1, "config.checkpoint.every"),
    ]:
        config = quickstart.get_config()
        section, name = field.split(".")
        config[section][name] = value
        with pytest.raises(ConfigError, match=message):
            validate_config(config)
    config = quickstart.get_config()
    config.asynchronous.enabled = True
    config.algorithm = "scaffold"
    with pytest.raises(ConfigError, match="config.asynchronous.enabled"):
        validate_config(config)


@pytest.mark.slow
def test_poisson_sampling_runs_and_its_pld_epsilon_equals_dp_accounting(tmp_path):
    """Poisson sampling: each client joins each round independently with probability q, so the
    round size varies; client-level DP is accounted as a Poisson-sampled Gaussian with PLD."""
    import dp_accounting
    from dp_accounting import pld

    config = fl_helpers.tiny_config(rounds=6, num_clients=8)
    config.train.sampling = "poisson"
    config.train.client_fraction = 0.5
    config.upload.weighting = "uniform"
    config.dp.enabled = True
    config.dp.accountant = "pld"
    config.dp.noise_multiplier = 1.3
    config.eval.every = 6
    summary = run_experiment(config, str(tmp_path), show_progress=False)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    sizes = [r["selected"] for r in rows]
    assert len(set(sizes)) > 1 and all(0 <= s <= 8 for s in sizes), sizes
    assert summary["dp_accounting_sampling"] == "poisson"
    accountant = pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    accountant.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        0.5, dp_accounting.GaussianDpEvent(1.3)), 6))
    assert summary["final"]["dp_epsilon"] == pytest.approx(accountant.get_epsilon(1e-5),
                                                           rel=1e-9)


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
