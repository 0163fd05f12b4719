"""Client sampling (`engine/sampling.py`) against hand-computed numbers: stratified quotas, failure
decay, adaptive epochs, Poisson sampling and its accountant.
"""


import json

import fl_helpers
import numpy as np
import pytest

from fedjax_pfedes.engine import sampling
from fedjax_pfedes.engine.loop import run_experiment


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
