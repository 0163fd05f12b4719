"""Upload compression (`upload/compression.py`): top-k with error feedback, QSGD, encoded bytes."""


import math

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pfedes.config.defaults import UploadSection
from fedjax_pfedes.upload import compression


def test_topk_error_feedback_sends_every_coordinates_mass_eventually():
    rng = np.random.default_rng(0)
    memory = {"a": jnp.zeros((5, 4)), "b": jnp.zeros(7)}
    total_updates = jax.tree.map(jnp.zeros_like, memory)
    total_sent = jax.tree.map(jnp.zeros_like, memory)
    for _ in range(30):
        update = {"a": jnp.asarray(rng.normal(size=(5, 4)), jnp.float32),
                  "b": jnp.asarray(rng.normal(size=7), jnp.float32)}
        sent, memory = compression.topk_with_feedback(update, memory, 0.1)
        assert sum(int(jnp.sum(s != 0)) for s in jax.tree.leaves(sent)) == 3  # ceil(0.1 * 27)
        total_updates = jax.tree.map(jnp.add, total_updates, update)
        total_sent = jax.tree.map(jnp.add, total_sent, sent)
    jax.tree.map(lambda s, m, u: np.testing.assert_allclose(s + m, u, atol=1e-4),
                 total_sent, memory, total_updates)


def test_qsgd_is_unbiased_and_on_its_levels():
    v = {"w": jnp.array([0.3, -1.2, 0.05, 2.0, 0.0])}
    keys = jax.random.split(jax.random.key(0), 20000)
    draws = jax.vmap(lambda k: compression.qsgd(v, k, 4)["w"])(keys)
    norm = float(jnp.linalg.norm(v["w"]))
    np.testing.assert_allclose(draws.mean(0), v["w"], atol=4 * norm / 4 / math.sqrt(20000) * 2)
    levels = np.asarray(draws) / norm * 4
    np.testing.assert_allclose(levels, np.round(levels), atol=1e-4)


def test_encoded_bytes_count_the_encoded_form():
    tree = {"w": jnp.zeros((10, 10)), "b": jnp.zeros(10)}  # 110 float32 values
    assert compression.encoded_bytes(tree, UploadSection()) == 440
    assert compression.encoded_bytes(tree, UploadSection(value_encoding="bf16")) == 220
    # top 10%: ceil(11) = 11 values x (4 value + 4 index) bytes.
    assert compression.encoded_bytes(tree, UploadSection(topk_fraction=0.1)) == 88
    # QSGD s=16: 1 sign + 5 level bits per value, plus a float32 norm per leaf.
    assert compression.encoded_bytes(tree, UploadSection(
        value_encoding="qsgd", qsgd_levels=16)) == 110 * 6 / 8 + 8
