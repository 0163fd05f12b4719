"""Config validation: each bad field is rejected up front with an error that names it."""

import subprocess
import sys
import time

import pytest

from configs import cifar_hetero, quickstart
from fedjax_pfedes.config.defaults import read_section
from fedjax_pfedes.data.catalog import load_dataset
from fedjax_pfedes.engine.validate import check_against_data, validate_config
from fedjax_pfedes.errors import ConfigError

MNIST5K = load_dataset("mnist5k")  # 4,000 pool samples after the 20% global hold-out


def _config(**overrides):
    config = quickstart.get_config()
    for dotted, value in overrides.items():
        node = config
        *parents, leaf = dotted.split("__")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return config


def test_shipped_configs_are_valid():
    validate_config(quickstart.get_config())
    validate_config(cifar_hetero.get_config())


@pytest.mark.parametrize("overrides,field", [
    ({"clients__architectures": "convnet3,resnet152"}, "config.clients.architectures"),
    ({"lam": -0.1}, "config.lam"),
    ({"train__client_fraction": 0.0}, "config.train.client_fraction"),
    ({"train__client_fraction": 1.5}, "config.train.client_fraction"),
    ({"proxy_dim": 0}, "config.proxy_dim"),
    ({"proxy_dim": -8}, "config.proxy_dim"),
    ({"align": "l1"}, "config.align"),
    ({"proxy_arch": "resnet"}, "config.proxy_arch"),
    ({"server_momentum": 1.0}, "config.server_momentum"),
    ({"execution__strategy": "pmap"}, "config.execution.strategy"),
    ({"execution__cpu_kernels": "onednn"}, "config.execution.cpu_kernels"),
    ({"data__name": "imagenet"}, "config.data.name"),
    ({"clients__architectures": "vit:3,mlp:3"}, "config.clients.architectures"),
    ({"algorithm": "fedsgd"}, "config.algorithm"),
])
def test_bad_fields_are_named(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        validate_config(_config(**overrides))


def test_a_methods_own_fields_are_checked_by_that_method_only():
    """pFedES's fields (lam, align, proxy_arch, ...) are checked by pFedES's registry entry:
    another method that never reads them is not refused for them."""
    config = quickstart.get_config()
    config.lam, config.align = -1.0, "no_such_loss"
    with pytest.raises(ConfigError, match=r"config\.lam must be >= 0, got -1\.0"):
        validate_config(config)
    config.algorithm = "fedavg"
    validate_config(config)


def test_more_clients_than_samples_is_named():
    config = _config(data__num_clients=5000)
    validate_config(config)
    with pytest.raises(ConfigError, match=r"config\.data\.num_clients=5000 exceeds the 4000"):
        check_against_data(config, MNIST5K)


def test_dirichlet_minimum_beyond_the_pool_is_named():
    config = _config(data__num_clients=100, data__min_samples_per_client=50)
    with pytest.raises(ConfigError, match=r"config\.data\.min_samples_per_client=50"):
        check_against_data(config, MNIST5K)


def test_models_of_another_modality_are_refused_once_the_data_is_known():
    config = _config(data__name="breast_cancer", data__min_samples_per_client=10)
    validate_config(config)
    with pytest.raises(ConfigError, match=r"config\.clients\.architectures: model 'convnet3' "
                                          r"takes image inputs but the dataset is tabular"):
        check_against_data(config, load_dataset("breast_cancer"))
    config = _config(data__name="breast_cancer", data__min_samples_per_client=10,
                     clients__architectures="mlp,mlp_small")
    with pytest.raises(ConfigError, match=r"config\.proxy_arch: proxy extractor 'proxy_cnn'"):
        check_against_data(config, load_dataset("breast_cancer"))


def test_pathological_classes_beyond_the_dataset_are_named():
    config = _config(data__partition="pathological", data__classes_per_client=11)
    with pytest.raises(ConfigError, match=r"config\.data\.classes_per_client=11 exceeds the 10"):
        check_against_data(config, MNIST5K)


def _run_main(*args, timeout=120):
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "launch.main", *args], capture_output=True,
                          text=True, timeout=timeout)
    return proc, time.time() - start


@pytest.mark.slow
def test_cli_reports_a_bad_override_and_exits_2(tmp_path):
    proc, _ = _run_main("--config=configs/quickstart.py", "--config.lam=-1",
                        f"--workdir={tmp_path}")
    assert proc.returncode == 2
    assert "config.lam must be >= 0, got -1" in proc.stderr


@pytest.mark.slow
def test_cifar_config_stops_with_preparation_instructions(tmp_path):
    empty = tmp_path / "tfds"
    empty.mkdir()
    proc, _ = _run_main("--config=configs/cifar_hetero.py", f"--workdir={tmp_path / 'run'}",
                        f"--config.data.data_dir={empty}")
    assert proc.returncode == 2, proc.stderr
    assert "'cifar10' is not prepared in " + str(empty) in proc.stderr
    assert "nothing was attempted" in proc.stderr
    assert f"tfds build cifar10 --file_format=array_record --data_dir={empty}" in proc.stderr


def test_round_settings_read_their_sections_and_nothing_else():
    from fedjax_pfedes.config.defaults import AsynchronousSection
    from fedjax_pfedes.engine.sections import round_settings

    config = quickstart.get_config()
    config.seed, config.train.rounds, config.train.sampling = 7, 12, "poisson"
    config.train.client_fraction, config.monitor.aggregation_loss = 0.25, True
    s = round_settings(config)
    assert (s.seed, s.train.rounds, s.train.sampling, s.train.client_fraction) == (
        7, 12, "poisson", 0.25)
    assert s.monitor.aggregation_loss and s.asynchronous is None
    assert s.execution.scan_chunk == config.execution.scan_chunk
    config.asynchronous.enabled, config.asynchronous.buffer_size = True, 3
    config.asynchronous.staleness = "hinge"
    a = round_settings(config).asynchronous
    assert isinstance(a, AsynchronousSection) and (a.buffer_size, a.staleness) == (3, "hinge")
    assert a.concurrency == config.asynchronous.concurrency
    before = round_settings(config)
    config.lam, config.upload.norm_outlier_factor = 123.0, 0.0  # other sections' fields
    assert round_settings(config) == before


def test_a_field_a_core_section_does_not_have_is_named():
    """A config file may add fields a ConfigDict accepts; the section's dataclass names them."""
    config = _config()
    with config.unlocked():
        config.train.lr_locl = 0.1
    with pytest.raises(ConfigError, match=r"config\.train\.lr_locl: not a field of"):
        validate_config(config)
    with pytest.raises(ValueError, match=r"config\.train\.lr_locl: not a field of config\.train"):
        read_section(config, "train")


def test_a_field_the_schema_does_not_have_is_named():
    """A config file may add any field to a ConfigDict: a typo in a method's section or at the
    top level is named, not silently ignored."""
    for path in ("fedprox.muu", "lamb"):
        config = _config()
        with config.unlocked():
            *parents, leaf = path.split(".")
            node = config
            for part in parents:
                node = node[part]
            node[leaf] = 0.1
        with pytest.raises(ConfigError, match=rf"config\.{path}: not a field of the config"):
            validate_config(config)
