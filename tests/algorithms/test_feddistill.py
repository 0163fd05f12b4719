"""FedDistill against hand references: the local step, the uploaded class logits, the server."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from fl_helpers import SPEC, client_data

from configs import quickstart, tabular_hetero
from fedjax_pfedes.algorithms.feddistill import FedDistillConfig, feddistill
from fedjax_pfedes.engine.loop import run_experiment
from fedjax_pfedes.engine.validate import validate_config
from fedjax_pfedes.errors import ConfigError
from fedjax_pfedes.models import architectures


def _setup(lam=0.8):
    cfg = FedDistillConfig(num_classes=3, input_spec=SPEC, lr_local=0.1, batch_size=8,
                           local_epochs=1, lam=lam)
    alg = feddistill(cfg)
    program = alg.cohort_program("mlp")
    return cfg, alg, program, program.init_client(jax.random.key(1))


def test_one_step_and_the_upload_match_a_hand_reference():
    cfg, alg, program, client = _setup()
    data = client_data(n=8, capacity=8)  # one batch of all 8 rows
    targets = jnp.array([[2.0, -1.0, 0.0], [0.0, 0.0, 0.0], [-1.0, 0.5, 3.0]])
    available = jnp.array([True, False, True])  # class 1 has no global vector yet
    upload, new_client, metrics = program.client_update(
        {"logits": targets, "available": available}, client, data, jax.random.key(0))
    model = architectures.classifier_model("mlp", 3, SPEC)
    x, y = np.asarray(data.x), np.asarray(data.y)

    def loss(p):
        logits = model.apply(p, x)
        ce = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))
        rows = np.flatnonzero(np.asarray(available)[y])
        kd = jnp.mean(jnp.mean((logits[rows] - targets[y[rows]]) ** 2, axis=-1))
        return ce + cfg.lam * kd

    want = jax.tree.map(lambda p, g: p - cfg.lr_local * g, client.params,
                        jax.grad(loss)(client.params))
    chex.assert_trees_all_close(new_client.params, want, rtol=1e-5, atol=1e-6)
    logits = np.asarray(model.apply(new_client.params, x))
    for c in range(3):
        rows = y == c
        np.testing.assert_allclose(upload["counts"][c], rows.sum())
        if rows.any():
            np.testing.assert_allclose(upload["logits"][c], logits[rows].mean(0), rtol=1e-5,
                                       atol=1e-6)
    assert float(metrics["local_steps"]) == 1.0


def test_server_takes_count_weighted_class_means_and_keeps_unseen_classes():
    _, alg, _, _ = _setup()
    state = alg.init_server(jax.random.key(0))
    state = state.replace(logits=state.logits.at[2].set(7.0))
    a = {"logits": jnp.array([[[1.0, 0, 0], [0, 2.0, 0], [0, 0, 0]],
                              [[3.0, 0, 0], [0, 0, 0], [0, 0, 0]]]),
         "counts": jnp.array([[1.0, 4.0, 0.0], [3.0, 0.0, 0.0]])}
    new = alg.server_update(state, {"mlp": (a, jnp.array([1.0, 1.0]))})
    np.testing.assert_allclose(new.logits[0], [(1 * 1 + 3 * 3) / 4, 0, 0])
    np.testing.assert_allclose(new.logits[1], [0, 2.0, 0])
    np.testing.assert_allclose(new.logits[2], [7.0, 7.0, 7.0])  # nobody holds class 2
    np.testing.assert_array_equal(new.available, [True, True, False])


def test_its_config_section_is_checked_naming_the_field():
    config = quickstart.get_config()
    config.algorithm = "feddistill"
    config.feddistill.lam = -1.0
    with pytest.raises(ConfigError, match="config.feddistill.lam must be finite and >= 0"):
        validate_config(config)


@pytest.mark.slow
def test_feddistill_runs_and_beats_the_majority_class(tmp_path):
    config = tabular_hetero.get_config()
    config.algorithm = "feddistill"
    config.train.rounds = 10
    config.eval.every = 5
    summary = run_experiment(config, str(tmp_path), show_progress=False)
    final = summary["final"]
    assert set(final["personalized_accuracy_by_arch"]) == {"mlp", "mlp_small", "mlp_deep"}
    assert final["upload_params_per_client"] == 2 * 2 + 2  # 2 classes: logits + counts
    assert final["personalized_accuracy_mean"] > summary["majority_class_accuracy_mean"] + 0.05
