"""`config.train.reset_local_optimizer`: private local-optimizer state kept or reset per round."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from fl_helpers import SPEC, client_data

from configs import tabular_hetero
from fedjax_pfedes.algorithms import local_training, registry
from fedjax_pfedes.algorithms.base import with_fresh_local_optimizer
from fedjax_pfedes.algorithms.pfedes import PFedESConfig, pfedes
from fedjax_pfedes.engine import sections
from fedjax_pfedes.engine.loop import run_experiment


def _tabular_config(algorithm):
    config = tabular_hetero.get_config()
    config.algorithm = algorithm
    config.clients.architectures = "mlp_small"
    config.train.rounds = 3
    config.eval.every = 3
    config.checkpoint.every = 0
    config.monitor.tensorboard = False
    return config


@pytest.mark.parametrize("name", sorted(registry.names()))
def test_private_optimizer_capability_matches_the_client_state(name):
    """An entry with private_optimizer=True has an `opt_state` in its client state (what the reset
    replaces); one without has none (nothing would be reset)."""
    entry = registry.get(name)
    if "tabular" not in entry.modalities:
        spec, arch = SPEC.__class__("image", (8, 8, 1), "float32", (0.0,), (1.0,)), "convnet3"
    else:
        spec, arch = SPEC, "mlp_small"
    config = _tabular_config(name)
    config.proxy_dim = 8
    algorithm = sections.build_algorithm(config, 3, spec, 1, collections.Counter({arch: 4}))
    state = jax.eval_shape(algorithm.cohort_program(arch).init_client, jax.random.key(0))
    assert hasattr(state, "opt_state") == entry.private_optimizer


def test_zeros_are_the_initial_state_of_the_local_optimizer():
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
    for opt in (local_training.sgd(0.1, 0.9), local_training.sgd(0.1, 0.0),
                optax.chain(optax.clip_by_global_norm(50.0), optax.add_decayed_weights(1e-3),
                            optax.sgd(0.01, momentum=0.9))):
        init = opt.init(params)
        _, used = opt.update(jax.tree.map(jnp.ones_like, params), init, params)
        zeros = jax.tree.map(jnp.zeros_like, used)
        assert jax.tree.structure(zeros) == jax.tree.structure(init)
        for a, b in zip(jax.tree.leaves(zeros), jax.tree.leaves(init), strict=True):
            np.testing.assert_array_equal(a, b)


def test_fresh_optimizer_trains_like_a_newly_initialized_one():
    cfg = PFedESConfig(num_classes=3, input_spec=SPEC, lr_local=0.1, local_momentum=0.9,
                       batch_size=4, local_epochs=2, proxy_arch="proxy_mlp", proxy_dim=4)
    algorithm = pfedes(cfg)
    program = algorithm.cohort_program("mlp_small")
    proxy = algorithm.broadcast(algorithm.init_server(jax.random.key(1)), "")
    data = client_data(n=8)
    state = program.init_client(jax.random.key(2))
    _, trained, _ = program.client_update(proxy, state, data, jax.random.key(3))
    assert any(bool(jnp.any(t != 0)) for t in jax.tree.leaves(trained.opt_state))
    rng = jax.random.key(4)
    # Reset: the trained private model with a fresh trace ...
    _, reset, _ = with_fresh_local_optimizer(program).client_update(proxy, trained, data, rng)
    fresh = trained.replace(opt_state=local_training.sgd(0.1, 0.9).init(trained.params))
    _, expected, _ = program.client_update(proxy, fresh, data, rng)
    for a, b in zip(jax.tree.leaves(reset), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(a, b)
    # ... differs from continuing with the kept momentum.
    _, kept, _ = program.client_update(proxy, trained, data, rng)
    assert not np.allclose(kept.params["params"]["classifier"]["kernel"],
                           reset.params["params"]["classifier"]["kernel"])


@pytest.mark.slow
def test_reset_changes_a_run_only_when_there_is_momentum(tmp_path):
    accuracies = {}
    for momentum in (0.9, 0.0):
        for reset in (False, True):
            config = _tabular_config("pfedes")
            config.train.local_momentum = momentum
            config.train.reset_local_optimizer = reset
            summary = run_experiment(config, str(tmp_path / f"{momentum}_{reset}"),
                                     show_progress=False)
            accuracies[momentum, reset] = summary["final"]["personalized_accuracy_mean"]
            assert summary["local_optimizer"]["state"] == (
                "reset every round" if reset
                else "kept across rounds")
    assert accuracies[0.0, False] == accuracies[0.0, True]
    assert accuracies[0.9, False] != accuracies[0.9, True]


@pytest.mark.slow
def test_fedavg_reports_a_fresh_optimizer_every_round(tmp_path):
    config = _tabular_config("fedavg")
    config.train.rounds = 1
    config.eval.every = 1
    summary = run_experiment(config, str(tmp_path), show_progress=False)
    assert summary["local_optimizer"]["state"].startswith("fresh every round")


def test_method_sections_override_the_local_optimizer():
    config = _tabular_config("scaffold")
    assert sections.local_optimizer(config) == {
        "lr_local": config.train.lr_local, "local_momentum": 0.0,
        "reset_local_optimizer": False, "batch_size": config.train.batch_size}
    config.scaffold.local_momentum = -1.0  # inherit config.train's
    assert sections.local_optimizer(config)["local_momentum"] == config.train.local_momentum
    config = _tabular_config("pfedes_paper")
    assert sections.local_optimizer(config) == {
        "lr_local": 0.01, "local_momentum": 0.9, "reset_local_optimizer": True,
        "batch_size": config.train.batch_size}
    config.train.lr_local = 0.3  # the section's own value wins
    assert sections.local_optimizer(config)["lr_local"] == 0.01
    config.pfedes_paper.batch_size = 512  # the authors' batch, for this method only
    assert sections.local_optimizer(config)["batch_size"] == 512


@pytest.mark.parametrize("field,value,message", [
    ("lr_local", 0.0, "config.fedmrl.lr_local must be > 0"),
    ("local_momentum", 1.0, r"config.fedmrl.local_momentum must be in \[0, 1\)"),
    ("batch_size", 0, r"config.fedmrl.batch_size must be an integer >= 1"),
])
def test_bad_optimizer_override_names_the_field(field, value, message):
    from fedjax_pfedes.engine.validate import validate_config
    from fedjax_pfedes.errors import ConfigError

    config = _tabular_config("fedmrl")
    config.fedmrl[field] = value
    with pytest.raises(ConfigError, match=message):
        validate_config(config)
