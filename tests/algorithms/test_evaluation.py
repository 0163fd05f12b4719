"""Every method's `predict` is the model its `evaluate` scores, so the engine's global accuracy
(`base.global_accuracy`) measures the same predictions as the personalized accuracy."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fl_helpers import small_config

from fedjax_pfedes.algorithms import registry as algorithm_registry
from fedjax_pfedes.algorithms.base import global_accuracy
from fedjax_pfedes.data.federated import ClientArrays
from fedjax_pfedes.data.spec import InputSpec
from fedjax_pfedes.engine import sections

SPEC = InputSpec("image", (8, 8, 1), "float32", (0.3,), (0.3,))  # pfedes_paper needs images


@pytest.mark.parametrize("name", algorithm_registry.names())
def test_global_accuracy_scores_the_predictions_evaluate_scores(name):
    config = small_config()
    config.algorithm = name
    config.clients.architectures = "mlp"
    config.proxy_arch = "proxy_cnn"
    algorithm = sections.build_algorithm(config, 3, SPEC, 1, collections.Counter({"mlp": 4}))
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


def test_participants_are_scored_right_after_training_when_asked():
    """eval.after_training: the round's participants on their local test splits with their new
    private models. pFedES predicts with the private model alone, which the server step does not
    change, so the figure equals each participant's accuracy recomputed here from its stored
    parameters (numpy argmax over its real test rows), averaged over the participants."""
    from fedjax_pfedes.engine import rounds
    from fedjax_pfedes.engine.build import build_context, build_federated_data
    from fedjax_pfedes.engine.validate import validate_config
    from fedjax_pfedes.errors import ConfigError
    from fedjax_pfedes.execution import offload
    from fedjax_pfedes.models import architectures

    config = small_config()
    config.clients.architectures = "mlp"
    config.train.client_fraction = 0.5
    config.eval.after_training = True
    data = build_federated_data(config)
    ctx, state = build_context(config, data)
    state, record, rows, _ = rounds.sync_round(ctx, state, 0)
    (cohort,) = ctx.cohorts
    model = architectures.client_model("mlp", data.central.num_classes, config.proxy_dim,
                                  data.central.input_spec)
    accs = []
    for row in rows:
        if row["local_steps"] == 0:
            continue
        local = int(np.flatnonzero(cohort.client_ids == row["client"])[0])
        params = offload.read_rows(state.clients["mlp"], np.array([local])).params
        params = jax.tree.map(lambda a: a[0], params)
        idx = data.test_indices[row["client"]]
        logits, _ = model.apply(params, jnp.asarray(data.central.x_train[idx]))
        accs.append(np.mean(np.argmax(np.asarray(logits), -1) == data.central.y_train[idx]))
    assert len(accs) == 3
    assert record["participants_accuracy_after_training"] == pytest.approx(np.mean(accs),
                                                                           abs=1e-6)
    config.asynchronous.enabled, config.asynchronous.concurrency = True, 6
    with pytest.raises(ConfigError, match="config.eval.after_training"):
        validate_config(config)
