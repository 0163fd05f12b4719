"""The public share of the data, E_proxy pretraining and `config.proxy_init`."""

import jax
import numpy as np
import pytest

from configs import tabular_hetero
from fedjax_pfedes.algorithms.pfedes import proxy_init
from fedjax_pfedes.algorithms.pfedes.pretraining import (
    PretrainSettings,
    pretrain_proxy,
    save_pretrained,
)
from fedjax_pfedes.data.public import public_indices
from fedjax_pfedes.engine.build import (
    build_context,
    build_federated_data,
    load_pool,
    load_validated_pool,
)
from fedjax_pfedes.engine.sections import method_settings
from fedjax_pfedes.engine.validate import validate_config
from fedjax_pfedes.errors import ConfigError
from fedjax_pfedes.models import architectures


def _view(config):
    """pFedES's view of the config, as launch.pretrain_proxy passes it."""
    return method_settings(config, "pfedes")


def _config(fraction=0.2):
    config = tabular_hetero.get_config()
    config.data.public_fraction = fraction
    config.clients.architectures = "mlp_small"
    config.checkpoint.every = 0
    return config


def test_public_share_is_class_stratified_seeded_and_disjoint():
    y = np.repeat(np.arange(3), [50, 30, 20])
    idx = public_indices(y, 0.1, seed=4)
    assert np.bincount(y[idx], minlength=3).tolist() == [5, 3, 2]
    np.testing.assert_array_equal(idx, public_indices(y, 0.1, seed=4))
    assert not np.array_equal(idx, public_indices(y, 0.1, seed=5))
    assert len(public_indices(y, 0.0, seed=4)) == 0


def test_clients_never_own_a_public_sample():
    config = _config()
    central, (px, _) = load_pool(config)
    full, _ = load_pool(_config(0.0))
    assert len(central.y_train) + len(px) == len(full.y_train)
    data = build_federated_data(config)
    owned = np.concatenate([central.x_train[i] for i in data.train_indices])
    public_rows = {r.tobytes() for r in px}
    assert not any(r.tobytes() in public_rows for r in owned)


def test_pretrained_proxy_beats_the_majority_label_and_starts_the_run(tmp_path):
    config = _config()
    params, report = pretrain_proxy(_view(config), PretrainSettings(epochs=5),
        *load_validated_pool(config), show_progress=False)
    central, _ = load_pool(config)
    majority = np.bincount(central.y_test).max() / len(central.y_test)
    assert report["global_test_accuracy_linear_probe"] > majority + 0.1
    path = str(tmp_path / "proxy.msgpack")
    save_pretrained(path, _view(config), params, report)
    config.proxy_init = path
    validate_config(config)
    _, state = build_context(config, build_federated_data(config))
    for a, b in zip(jax.tree.leaves(state.server.proxy_params), jax.tree.leaves(params),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Without the file the round-0 E_proxy is a random one.
    config.proxy_init = ""
    _, random_state = build_context(config, build_federated_data(config))
    assert not np.array_equal(jax.tree.leaves(random_state.server.proxy_params)[0],
                              jax.tree.leaves(params)[0])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    config = _config()
    params, report = pretrain_proxy(_view(config), PretrainSettings(epochs=1),
        *load_validated_pool(config), show_progress=False)
    path = str(tmp_path_factory.mktemp("proxy") / "proxy.msgpack")
    save_pretrained(path, _view(config), params, report)
    return path


@pytest.mark.parametrize("change,message", [
    ({"proxy_dim": 16}, "holds an E_proxy with proxy_dim=32; this run has config.proxy_dim=16"),
    ({"data.public_fraction": 0.0}, "held out with config.data.public_fraction=0.2"),
    ({"seed": 3}, "held out with config.seed=0"),
    ({"algorithm": "fedavg"}, "only \\['pfedes'\\] start from a saved E_proxy"),
])
def test_a_file_that_does_not_fit_is_refused_naming_why(saved, change, message):
    config = _config()
    config.proxy_init = saved
    for key, value in change.items():
        section = config
        *parents, leaf = key.split(".")
        for p in parents:
            section = section[p]
        section[leaf] = value
    with pytest.raises(ConfigError, match=message):
        validate_config(config)


def test_missing_garbled_and_misshapen_files_name_the_problem(saved, tmp_path):
    with pytest.raises(ValueError, match="config.proxy_init: no file at"):
        proxy_init.read(str(tmp_path / "absent"))
    garbled = tmp_path / "garbled.msgpack"
    garbled.write_bytes(b"\x00not msgpack")
    with pytest.raises(ValueError, match="is not a saved E_proxy"):
        proxy_init.read(str(garbled))
    spec = load_pool(_config())[0].input_spec
    other = architectures.proxy_model("proxy_mlp", 16, spec).init(jax.random.key(0),
                                                              spec.dummy_batch())
    with pytest.raises(ValueError, match=r"parameter params/out/bias has shape \(32,\), "
                                         r"this run's E_proxy needs \(16,\)"):
        proxy_init.load(saved, other)


def test_pretraining_without_a_public_share_is_refused():
    with pytest.raises(ConfigError, match="config.data.public_fraction is 0"):
        pretrain_proxy(_view(_config(0.0)), PretrainSettings(epochs=1),
        *load_validated_pool(_config(0.0)), show_progress=False)


def test_a_seed_placeholder_names_one_pretrained_file_per_seed(tmp_path):
    """The public share depends on the seed, so each seed needs its own pretrained E_proxy:
    `{seed}` in config.proxy_init (and in launch.pretrain_proxy's --output) picks it."""
    pattern = str(tmp_path / "proxy_seed{seed}.msgpack")
    for seed in (0, 1):
        config = _config()
        config.seed = seed
        params, report = pretrain_proxy(_view(config), PretrainSettings(epochs=1),
        *load_validated_pool(config), show_progress=False)
        save_pretrained(proxy_init.resolve(pattern, seed), _view(config),
                        params, report)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["proxy_seed0.msgpack",
                                                          "proxy_seed1.msgpack"]
    for seed in (0, 1):
        config = _config()
        config.seed, config.proxy_init = seed, pattern
        validate_config(config)  # each seed reads its own file: its public share matches
    config.seed = 2
    with pytest.raises(ConfigError, match="proxy_seed2.msgpack"):
        validate_config(config)
