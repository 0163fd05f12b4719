"""Label-coverage client selection (`config.train.sampling='coverage'`)."""

import json

import numpy as np
import pytest
from fl_helpers import tiny_config

from fedjax_pfedes.engine import sampling
from fedjax_pfedes.engine.loop import run_experiment
from fedjax_pfedes.engine.validate import validate_config
from fedjax_pfedes.errors import ConfigError


def _one_class_population(clients_per_class=3, classes=4, samples=10):
    """Every client holds `samples` examples of one class."""
    counts = np.zeros((clients_per_class * classes, classes), np.int64)
    for k in range(len(counts)):
        counts[k, k % classes] = samples
    return counts


def test_coverage_fills_every_missing_label_on_a_hand_made_population():
    counts = _one_class_population()
    eligible = np.ones(len(counts), bool)
    weights = np.ones(len(counts))
    misses_uniform = 0
    for r in range(50):
        picked = sampling.coverage_sample(0, r, 4, eligible, weights, counts, len(counts))
        assert sorted(np.flatnonzero(counts[picked].sum(0))) == [0, 1, 2, 3]
        assert sampling.label_coverage(counts, picked) == 1.0
        uniform = sampling.uniform_sample(0, r, len(counts), 4 / len(counts))
        misses_uniform += sampling.label_coverage(counts, uniform) < 1.0
    assert misses_uniform > 10  # uniform selection often misses a class (P = 1 - 81/165)


def test_coverage_prefers_the_client_with_the_lacking_labels():
    # Client 0 holds classes 0/1; client 1 mostly class 0; client 2 classes 2/3. Once any of
    # them is chosen, the next must bring the classes still missing.
    counts = np.array([[5, 5, 0, 0], [9, 1, 0, 0], [0, 0, 5, 5]])
    for r in range(20):
        picked = sampling.coverage_sample(1, r, 2, np.ones(3, bool), np.ones(3), counts, 3)
        assert 2 in picked


def test_coverage_respects_eligibility_and_weights():
    counts = _one_class_population()
    eligible = np.ones(len(counts), bool)
    eligible[[1, 5, 9]] = False  # every client of class 1 is offline
    picked = sampling.coverage_sample(0, 3, 4, eligible, np.ones(len(counts)), counts, 12)
    assert not set(picked.tolist()) & {1, 5, 9}
    assert sampling.label_coverage(counts, picked) == 0.75
    few = sampling.coverage_sample(0, 3, 20, eligible, np.ones(len(counts)), counts, 40)
    np.testing.assert_array_equal(few, np.flatnonzero(eligible))  # m >= eligible: all of them


def test_candidate_set_bounds_starvation_and_m_candidates_is_uniform():
    """From 2m random candidates every client keeps being chosen; m candidates = uniform."""
    counts = np.zeros((20, 4), np.int64)
    counts[:, 0] = 10
    counts[:2, 1] = 10  # two clients hold the only class-1 samples
    chosen = np.zeros(20, int)
    for r in range(200):
        chosen[sampling.coverage_sample(0, r, 5, np.ones(20, bool), np.ones(20), counts)] += 1
    assert chosen.min() > 0  # nobody starved ...
    assert chosen[:2].mean() > 1.5 * chosen[2:].mean()  # ... and the rare labels are favoured
    for r in range(5):
        np.testing.assert_array_equal(
            sampling.coverage_sample(3, r, 5, np.ones(20, bool), np.ones(20), counts, 5),
            sampling.uniform_sample(3, r, 20, 5 / 20))


@pytest.mark.slow
def test_a_coverage_run_reports_full_label_coverage(tmp_path):
    config = tiny_config(rounds=3, num_clients=8)
    config.data.partition = "pathological"
    config.train.sampling = "coverage"
    config.train.client_fraction = 0.5
    config.train.coverage_candidates = 8  # every client a candidate: the full greedy pass
    run_experiment(config, str(tmp_path), show_progress=False)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    coverage = [row["selected_label_coverage"] for row in rows]
    assert len(coverage) == 3 and min(coverage) >= 0.8  # digits: 8 clients x 2 of 10 classes


@pytest.mark.parametrize("section", ["dp", "dp_sgd"])
def test_coverage_sampling_is_refused_with_dp(section):
    config = tiny_config()
    config.train.sampling = "coverage"
    config[section].enabled = True
    config.upload.weighting = "uniform"
    with pytest.raises(ConfigError, match="sampling='coverage' picks clients by their label"):
        validate_config(config)
