"""The default norm-outlier rule leaves honest heterogeneity alone and still stops a wild client
(U23 of docs/threat_model.md)."""

import json

import numpy as np
import pytest
from fl_helpers import tiny_config

from fedjax_pfedes.engine.loop import run_experiment


@pytest.mark.slow
def test_U23_quantity_skew_sigma_2_rejects_no_honest_client_and_still_the_attacker(tmp_path):
    """FedAvg on mnist5k, 20 clients of LogNormal(0, 2) sizes (40 to 834 samples), 20 rounds:
    raw update norms of one round differ ~20x and the raw 10x-median rule rejected the largest
    honest clients 9 times here; judged per local sample, none is, while a 1e4 attacker is
    rejected in every round it takes part."""
    config = tiny_config(rounds=20, num_clients=20)
    config.algorithm = "fedavg"
    config.data.name = "mnist5k"
    config.data.partition = "quantity_skew"
    config.data.quantity_sigma = 2.0
    config.data.min_samples_per_client = 40
    config.train.client_fraction = 0.5
    config.eval.every = 20
    config.attack.clients = "3"
    config.attack.kind = "constant"
    config.attack.value = 1e4
    run_experiment(config, str(tmp_path), show_progress=False)
    rows = [json.loads(line) for line in open(tmp_path / "clients.jsonl")]
    sizes = {r["client"]: r["samples"] for r in rows}
    assert max(sizes.values()) / min(sizes.values()) > 10  # the skew the test is about
    rejected = [r for r in rows if not r["accepted"]]
    assert rejected and {r["client"] for r in rejected} == {3}
    assert len(rejected) == sum(r["client"] == 3 for r in rows)


def test_the_rules_decision_by_hand():
    """Median of the valid norms (the mean of the two middle ones for an even count), flags
    above factor x median, nothing with fewer than 3 valid norms."""
    from fedjax_pfedes.upload.validation import norm_outliers

    flags = norm_outliers(np.array([1, 2, 3, 4, 100], np.float32), np.ones(5, bool), 10.0)
    np.testing.assert_array_equal(flags, [False, False, False, False, True])  # median 3
    flags = norm_outliers(np.array([1, 2, 3, 4, 35, 36], np.float32), np.ones(6, bool), 10.0)
    np.testing.assert_array_equal(flags, [False] * 5 + [True])  # median 3.5: 35 is not above
    valid = np.array([True, True, False, True, True])
    flags = norm_outliers(np.array([1, 2, 1e9, 3, 31], np.float32), valid, 10.0)
    np.testing.assert_array_equal(flags, [False, False, False, False, True])  # median 2.5
    np.testing.assert_array_equal(
        norm_outliers(np.array([1, 1e9], np.float32), np.ones(2, bool), 10.0), [False, False])
    np.testing.assert_array_equal(norm_outliers(np.zeros(3, np.float32), np.zeros(3, bool),
                                                10.0), [False] * 3)


# One round of honest uploads of the published pFedES (`pfedes_paper`, its 153-parameter proxy
# G) on the 2-class-per-client collaboration population, round 98 of seed 0 with the rule off:
# norms spread over three orders of magnitude; the 10x-median rule alone rejected the top three.
HONEST_SPREAD = [0.002, 0.004, 0.005, 0.006, 0.012, 0.029, 0.111, 0.383, 0.418, 2.526]


def _robust_z_reference(values):
    """(log x - median log) / (1.4826 MAD), with the standard library alone."""
    import math
    import statistics
    logs = [math.log(v) for v in values]
    center = statistics.median(logs)
    mad = statistics.median([abs(v - center) for v in logs])
    return [(v - center) / (1.4826 * mad) for v in logs]


def test_the_robust_z_score_and_the_combined_rule_by_hand():
    from fedjax_pfedes.upload.validation import norm_outliers, robust_log_z

    values = np.array(HONEST_SPREAD + [4.0, 400.0], np.float32)
    valid = np.ones(len(values), bool)
    z = _robust_z_reference(values)
    np.testing.assert_allclose(robust_log_z(values, valid), z, rtol=1e-4)
    median = float(np.median(values))
    for factor, z_threshold, hard in [(10, 2.0, 0), (10, 2.0, 1000), (10, 6, 1000), (10, 0, 0)]:
        expected = [v > factor * median and (z_threshold == 0 or zi > z_threshold
                                             or (hard > 0 and v > hard * median))
                    for v, zi in zip(values, z, strict=True)]
        np.testing.assert_array_equal(norm_outliers(values, valid, factor, z_threshold, hard),
                                      expected, err_msg=f"{factor} {z_threshold} {hard}")
    # median 0.07: 2.526 and 4 are beyond 10x it, 400 beyond 1000x; z of 400 is 2.56
    assert norm_outliers(values, valid, 10).sum() == 3  # the factor alone
    assert norm_outliers(values, valid, 10, 2.0).tolist()[-1:] == [True]  # 400 by its z
    assert norm_outliers(values, valid, 10, 2.0).sum() == 1
    assert norm_outliers(values, valid, 10, 6.0).sum() == 0
    assert norm_outliers(values, valid, 10, 6.0, 1000).sum() == 1  # 400 by the hard bound
    # an invalid slot counts in neither statistic
    masked = np.concatenate([values, [1e-9]]).astype(np.float32)
    np.testing.assert_array_equal(
        robust_log_z(masked, np.append(valid, False))[:-1], robust_log_z(values, valid))


def test_an_honest_round_spread_over_orders_of_magnitude_is_left_alone_by_default():
    from fedjax_pfedes.upload.pipeline import (
        NORM_OUTLIER_FACTOR,
        NORM_OUTLIER_HARD_FACTOR,
        NORM_OUTLIER_Z,
    )
    from fedjax_pfedes.upload.validation import norm_outliers, robust_log_z

    rule = (NORM_OUTLIER_FACTOR, NORM_OUTLIER_Z, NORM_OUTLIER_HARD_FACTOR)
    honest = np.array(HONEST_SPREAD, np.float32)
    valid = np.ones(len(honest), bool)
    g_norm = np.float32(3.2)  # the norm of pfedes_paper's proxy G that round
    assert norm_outliers(honest, valid, NORM_OUTLIER_FACTOR).sum() == 3  # the factor alone
    assert norm_outliers(honest, valid, *rule).sum() == 1  # 2.526 is 123x the median
    # pfedes_paper's uploads are judged by G's norm alone (`norm_by_model_only`): kept
    assert not norm_outliers(honest, valid, *rule, honest / g_norm, 1.0, True).any()
    # a boosted update (the threat model's 1e4 in each of G's 153 values) among them is only
    # ~5 robust deviations off, and the hard factor catches it
    boosted = np.append(honest, 1e4 * np.sqrt(153)).astype(np.float32)
    assert robust_log_z(boosted, np.ones(11, bool))[-1] < NORM_OUTLIER_Z
    np.testing.assert_array_equal(
        norm_outliers(boosted, np.ones(11, bool), *rule, boosted / g_norm, 1.0, True),
        [False] * len(honest) + [True])
    # and among like-sized honest updates a model-replacement x100 one is, by its z (U03)
    like = np.random.default_rng(0).uniform(0.9, 1.1, 9).astype(np.float32)
    np.testing.assert_array_equal(
        norm_outliers(np.append(like, 100.0).astype(np.float32), np.ones(10, bool), *rule),
        [False] * 9 + [True])


def test_only_the_published_pfedes_is_judged_by_its_model_alone():
    """The model-size bound is on for every method (`norm_outlier_model_ratio` 1); the
    published pFedES, whose small proxy's honest updates spread over orders of magnitude, is
    judged by it alone (`AlgorithmEntry.norm_by_model_only`)."""
    import fedjax_pfedes
    from fedjax_pfedes.engine.sections import pipeline_config

    config = fedjax_pfedes.default_config()
    assert config.upload.norm_outlier_model_ratio == 1.0
    judged = {}
    for method in ("pfedes_paper", "pfedes", "fedavg"):
        config.algorithm = method
        c = pipeline_config(config)
        judged[method] = (c.norm_outlier_model_ratio, c.norm_by_model_only)
    assert judged == {"pfedes_paper": (1.0, True), "pfedes": (1.0, False),
                      "fedavg": (1.0, False)}
    config.upload.norm_outlier_model_ratio = 0.5
    assert pipeline_config(config).norm_outlier_model_ratio == 0.5


def test_the_model_ratio_condition_by_hand():
    from fedjax_pfedes.upload.validation import norm_outliers

    norms = np.array([1, 1, 1, 1, 100, 200], np.float32)
    valid = np.ones(6, bool)
    relative = norms / np.float32(150.0)  # the model's norm: 150
    np.testing.assert_array_equal(norm_outliers(norms, valid, 10, 8), [0, 0, 0, 0, 1, 1])
    # by the model alone: 100 < 150 <= 200
    np.testing.assert_array_equal(
        norm_outliers(norms, valid, 10, 8, 1000, relative, 1.0, True), [0, 0, 0, 0, 0, 1])
    # 0: not applied (by the model alone nothing is judged)
    np.testing.assert_array_equal(norm_outliers(norms, valid, 10, 8, 1000, relative, 0.0),
                                  [0, 0, 0, 0, 1, 1])
    assert not norm_outliers(norms, valid, 10, 8, 1000, relative, 0.0, True).any()
    # no model to compare with (a template of zeros: inf, NaN): the spread alone decides
    for no_model in (np.inf, np.nan):
        np.testing.assert_array_equal(
            norm_outliers(norms, valid, 10, 8, 1000, np.full(6, no_model, np.float32), 1.0),
            [0, 0, 0, 0, 1, 1])


def test_a_model_sized_update_in_a_small_or_spread_round_is_rejected():
    """The real-run case that the spread alone missed (docs/threat_model.md): FedAvg, a cohort
    of 3 uploads in round 17, the attacker's x100 sign flip 48x the median but only 4.9 robust
    deviations out (a MAD of 3 values); its update is larger than the model it replaces."""
    from fedjax_pfedes.upload.pipeline import (
        NORM_OUTLIER_FACTOR,
        NORM_OUTLIER_HARD_FACTOR,
        NORM_OUTLIER_MODEL_RATIO,
        NORM_OUTLIER_Z,
    )
    from fedjax_pfedes.upload.validation import norm_outliers, robust_log_z

    rule = (NORM_OUTLIER_FACTOR, NORM_OUTLIER_Z, NORM_OUTLIER_HARD_FACTOR)
    per_sample = np.array([0.010, 0.017, 0.48], np.float32)  # the attacker last: 48x
    valid = np.ones(3, bool)
    assert 4 < robust_log_z(per_sample, valid)[-1] < NORM_OUTLIER_Z
    assert not norm_outliers(per_sample, valid, *rule).any()  # the spread alone: kept
    model_norm = np.float32(30.0)
    updates = per_sample * np.float32(250.0)  # 250 local samples each: 2.5, 4.25, 120
    np.testing.assert_array_equal(
        norm_outliers(per_sample, valid, *rule, updates / model_norm, NORM_OUTLIER_MODEL_RATIO),
        [False, False, True])
    # an honest update beyond the factor but below the model's norm stays (the largest
    # measured: 0.75 of it)
    honest = np.array([0.010, 0.017, 0.2], np.float32)  # 12x the median
    assert norm_outliers(honest, valid, NORM_OUTLIER_FACTOR).any()  # beyond the factor
    model_norm = np.float32(0.2 * 250 / 0.75)  # the update is 0.75 of the model
    assert not norm_outliers(honest, valid, *rule, honest * 250 / model_norm,
                             NORM_OUTLIER_MODEL_RATIO).any()


