"""Robust aggregation and weights (`upload/robust.py`): median, trimmed mean, weightings."""


import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fl_helpers import upload_cohort, upload_pipeline

from fedjax_pfedes.upload import robust


def test_median_and_trimmed_mean_match_numpy_over_valid_clients():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(9, 4, 3)).astype(np.float32)
    valid = np.array([1, 1, 0, 1, 1, 1, 0, 1, 1], bool)
    got = robust.coordinate_median({"w": jnp.asarray(x)}, jnp.asarray(valid))["w"]
    np.testing.assert_allclose(got, np.median(x[valid], axis=0), rtol=1e-6)
    got = robust.trimmed_mean({"w": jnp.asarray(x)}, jnp.asarray(valid), 0.2)["w"]
    kept = np.sort(x[valid], axis=0)[1:-1]  # 7 valid: floor(0.2 * 7) = 1 cut at each end
    np.testing.assert_allclose(got, kept.mean(axis=0), rtol=1e-5)
    even = valid.copy()
    even[0] = False  # 6 valid: median = mean of the middle two
    got = robust.coordinate_median({"w": jnp.asarray(x)}, jnp.asarray(even))["w"]
    np.testing.assert_allclose(got, np.median(x[even], axis=0), rtol=1e-6)


def test_weight_smoothing():
    counts, valid = jnp.array([4.0, 9.0, 16.0]), jnp.array([True, False, True])
    np.testing.assert_array_equal(robust.smooth_weights(counts, valid, "samples"), [4, 0, 16])
    np.testing.assert_array_equal(robust.smooth_weights(counts, valid, "sqrt_samples"),
                                  [2, 0, 4])
    np.testing.assert_array_equal(robust.smooth_weights(counts, valid, "uniform"), [1, 0, 1])
    with pytest.raises(ValueError, match="config.upload.weighting"):
        robust.smooth_weights(counts, valid, "median")


def test_pipeline_median_hands_the_algorithm_the_median_in_every_slot():
    template = {"w": jnp.array([1.0, 1.0])}
    ups = {"w": jnp.array([[2.0, 1.0], [1.0, 5.0], [100.0, 1.5]])}
    pipe = upload_pipeline(aggregator="median", norm_outlier_factor=0.0)  # the median alone
    groups, _, _ = pipe.process(0, {"a": upload_cohort(ups, template, [1, 1, 1])},
                                {"a": {}}, {"a": 3}, jax.random.key(0))
    np.testing.assert_allclose(groups["a"][0]["w"], [[2.0, 1.5]] * 3, rtol=1e-6)


def test_trimmed_mean_trims_at_least_one_per_side_below_ten_uploads():
    """floor(0.1 * 9) = 0 made the default trimmed mean a plain mean with 9 uploads."""
    x = np.arange(9, dtype=np.float32)[:, None] ** 3  # one large outlier at the top
    valid = np.ones(9, bool)
    got = robust.trimmed_mean({"w": jnp.asarray(x)}, jnp.asarray(valid), 0.1)["w"]
    np.testing.assert_allclose(got, np.sort(x, axis=0)[1:-1].mean(axis=0), rtol=1e-6)
    assert int(robust.trim_count(jnp.int32(9), 0.1)) == 1
    assert int(robust.trim_count(jnp.int32(25), 0.1)) == 2
    assert int(robust.trim_count(jnp.int32(3), 0.4)) == 1
    assert int(robust.trim_count(jnp.int32(9), 0.0)) == 0  # 0 = no trimming, a plain mean


@pytest.mark.parametrize("aggregator", ["median", "trimmed_mean"])
def test_robust_aggregation_of_fewer_than_three_uploads_is_skipped_and_reported(aggregator):
    template = {"w": jnp.array([1.0, 1.0])}
    ups = {"w": jnp.array([[2.0, 1.0], [100.0, 5.0], [0.0, 0.0]])}
    pipe = upload_pipeline(aggregator=aggregator, norm_outlier_factor=0.0)
    groups, _, report = pipe.process(0, {"a": upload_cohort(ups, template, [1, 1, 1], [1, 1, 0])},
                                     {"a": {}}, {"a": 3}, jax.random.key(0))
    np.testing.assert_array_equal(groups["a"][1], [0, 0, 0])  # nobody counts: state kept
    assert report.record["robust_aggregation_skipped"] == [
        f"a: 2 valid upload(s), config.upload.aggregator='{aggregator}' needs >= 3"]
    groups, _, report = pipe.process(0, {"a": upload_cohort(ups, template, [1, 1, 1])},
                                     {"a": {}}, {"a": 3}, jax.random.key(0))
    assert "robust_aggregation_skipped" not in report.record and float(groups["a"][1].sum()) > 0


def test_all_samples_weighting_counts_training_and_local_test_rows():
    """The published pFedES code weighs an upload by all of its client's samples."""
    template = {"w": jnp.zeros(2)}
    ups = {"w": jnp.array([[1.0, 0.0], [0.0, 1.0]])}
    cohort = upload_cohort(ups, template, [8, 2])
    cohort = dataclasses.replace(cohort, all_sizes=jnp.asarray([10.0, 10.0]))
    for weighting, want in (("samples", [0.8, 0.2]), ("all_samples", [0.5, 0.5])):
        pipe = upload_pipeline(weighting=weighting, norm_outlier_factor=0.0)
        groups, _, _ = pipe.process(0, {"a": cohort}, {"a": {}}, {"a": 2}, jax.random.key(0))
        w = np.asarray(groups["a"][1])
        np.testing.assert_allclose(w / w.sum(), want, rtol=1e-6)
