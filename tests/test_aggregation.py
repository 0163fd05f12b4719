"""Upload checks and the aggregation math, against numpy."""

import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_pfedes import aggregation

GLOBAL = {"conv": {"kernel": jnp.zeros((3, 3, 1, 4)), "bias": jnp.zeros((4,))},
          "out": {"kernel": jnp.zeros((4, 2))}}


def _like(tree, lead=None, dtype=None):
    def make(a):
        shape = a.shape if lead is None else (lead,) + a.shape
        return jnp.ones(shape, dtype or a.dtype)
    return {k: {kk: make(vv) for kk, vv in v.items()} for k, v in tree.items()}


def test_matching_uploads_pass():
    aggregation.check_upload(GLOBAL, _like(GLOBAL), "client 3")
    aggregation.check_upload(GLOBAL, _like(GLOBAL, lead=5), "clients [1, 2]", stacked=5)


def test_shape_mismatch_names_client_and_leaf():
    bad = _like(GLOBAL)
    bad["conv"]["kernel"] = jnp.ones((3, 3, 1, 8))
    with pytest.raises(aggregation.UploadMismatchError,
                       match=r"client 7: leaf 'conv/kernel' has shape \(3, 3, 1, 8\), "
                             r"expected \(3, 3, 1, 4\)"):
        aggregation.check_upload(GLOBAL, bad, "client 7")


def test_dtype_mismatch_names_client_and_leaf():
    bad = _like(GLOBAL)
    bad["out"]["kernel"] = bad["out"]["kernel"].astype(jnp.bfloat16)
    with pytest.raises(aggregation.UploadMismatchError,
                       match=r"client 2: leaf 'out/kernel' has dtype bfloat16, expected float32"):
        aggregation.check_upload(GLOBAL, bad, "client 2")


def test_missing_and_extra_leaves_are_listed():
    bad = _like(GLOBAL)
    del bad["conv"]["bias"]
    bad["conv"]["scale"] = jnp.ones((4,))
    with pytest.raises(aggregation.UploadMismatchError,
                       match=r"client 0 .*missing leaves \['conv/bias'\].*\['conv/scale'\]"):
        aggregation.check_upload(GLOBAL, bad, "client 0")


def test_stacked_upload_with_wrong_client_axis_is_rejected():
    with pytest.raises(aggregation.UploadMismatchError,
                       match=r"leaf .conv/bias. has shape \(3, 4\), expected \(4, 4\)"):
        aggregation.check_upload(GLOBAL, _like(GLOBAL, lead=3), "clients [4]", stacked=4)


def test_weighted_mean_over_groups_matches_numpy_and_accumulates_in_float32():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(3, 5)).astype(np.float32)
    b = rng.normal(size=(2, 5)).astype(np.float32)
    wa, wb = np.array([1.0, 2.0, 3.0]), np.array([4.0, 0.0])
    mean, total = aggregation.weighted_mean(
        [({"w": jnp.asarray(a, jnp.bfloat16)}, jnp.asarray(wa)), ({"w": jnp.asarray(b)},
                                                                  jnp.asarray(wb))])
    assert mean["w"].dtype == jnp.float32
    ref = (np.tensordot(wa, np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64), 1)
           + np.tensordot(wb, b, 1)) / 10.0
    np.testing.assert_allclose(mean["w"], ref, rtol=1e-6)
    assert float(total) == 10.0


def test_momentum_smoothing_matches_formula_and_keeps_dtype():
    old = {"w": jnp.array([1.0, 2.0], jnp.bfloat16)}
    avg = {"w": jnp.array([3.0, -2.0], jnp.float32)}
    new = aggregation.momentum_smoothing(old, avg, beta=0.25)
    assert new["w"].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(new["w"], np.float32), [2.5, -1.0])


def test_client_weights_are_sample_counts_and_zero_for_padding():
    w = aggregation.client_weights(jnp.array([10, 20, 30]), jnp.array([True, False, True]))
    np.testing.assert_array_equal(w, [10.0, 0.0, 30.0])
