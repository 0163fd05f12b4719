"""Every method's `predict` is the model its `evaluate` scores, so the engine's global accuracy
(`base.global_accuracy`) measures the same predictions as the personalized accuracy."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_pfedes.algorithms import registry as algorithm_registry
from fedjax_pfedes.algorithms.base import global_accuracy
from fedjax_pfedes.data.federated import ClientArrays
from fedjax_pfedes.data.spec import InputSpec
from tests.fl_helpers import small_config

SPEC = InputSpec("image", (8, 8, 1), "float32", (0.3,), (0.3,))  # pfedes_paper needs images


@pytest.mark.parametrize("name", algorithm_registry.names())
def test_global_accuracy_scores_the_predictions_evaluate_scores(name):
    config = small_config()
    config.algorithm = name
    config.clients.architectures = "mlp"
    config.proxy_arch = "proxy_cnn"
    algorithm = algorithm_registry.build(config, 3, SPEC, 1, collections.Counter({"mlp": 4}))
    program = algorithm.cohort_program("mlp")
    state = program.init_client(jax.random.key(0))
    broadcast = algorithm.broadcast(algorithm.init_server(jax.random.key(1), ("mlp",)), "mlp")
    rng = np.random.default_rng(2)
    x = rng.uniform(size=(40, 8, 8, 1)).astype(np.float32)
    y = rng.integers(0, 3, 40).astype(np.int32)
    # The global set as a local test split padded past 33 samples: evaluate masks the rest.
    test = ClientArrays(jnp.asarray(x), jnp.asarray(y), jnp.int32(33))
    local = program.evaluate(broadcast, state, test)
    engine = global_accuracy(program, broadcast, state, jnp.asarray(x[:33]), jnp.asarray(y[:33]))
    scores = np.asarray(program.predict(broadcast, state, jnp.asarray(x[:33])))
    assert scores.shape == (33, 3)
    expected = np.mean(np.argmax(scores, -1) == y[:33])
    np.testing.assert_allclose(float(local["personalized_accuracy"]), expected, atol=1e-6)
    np.testing.assert_allclose(float(engine), expected, atol=1e-6)
