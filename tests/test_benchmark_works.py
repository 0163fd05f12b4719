"""The peer benchmarks' works: the engine's copy of pfl-research's CNN and the Flower work file.

The timings themselves are commands (docs/performance.md), never tests; these check that the
works the peers and the engine run are the same work.
"""

import jax
import numpy as np
import pytest

from benchmarks import works
from benchmarks.peers import fedjax_loop, flower_loop
from fedjax_pfedes.data.spec import InputSpec
from fedjax_pfedes.models.architectures import ClientModel
from fedjax_pfedes.models.backbones import BACKBONES


@pytest.fixture
def pfl_cnn():
    works.register_pfl_simple_cnn()
    yield "pfl_simple_cnn"
    BACKBONES.pop("pfl_simple_cnn", None)


def test_pfl_simple_cnn_has_pfl_researchs_layers(pfl_cnn):
    """pfl-research's simple_cnn on 32x32x3 (benchmarks/model/pytorch/cnn.py), counted by hand
    from its layer list: conv 3x3 3->32, conv 3x3 32->64 (no padding: 28x28), 2x2 pool (14x14),
    Linear 14*14*64 -> 128, Linear 128 -> 10."""
    hand = {"conv1": 3 * 3 * 3 * 32 + 32, "conv2": 3 * 3 * 32 * 64 + 64,
            "fc": 14 * 14 * 64 * 128 + 128}
    spec = InputSpec("image", (32, 32, 3), "float32", (0.5,) * 3, (0.25,) * 3)
    model = ClientModel(pfl_cnn, num_classes=10, proxy_dim=16, spec=spec)
    params = model.init(jax.random.PRNGKey(0), np.zeros((2, 32, 32, 3), np.float32))["params"]
    counted = {name: sum(x.size for x in jax.tree.leaves(layer))
               for name, layer in params["backbone"].items()}
    assert counted == hand
    assert sum(x.size for x in jax.tree.leaves(params["classifier"])) == 128 * 10 + 10
    logits, _ = model.apply({"params": params}, np.zeros((2, 32, 32, 3), np.float32))
    assert logits.shape == (2, 10)


def test_pfl_cifar_config_is_pfl_researchs_setting(pfl_cnn):
    del pfl_cnn
    c = works.pfl_cifar_config(5, "/tmp/x.npz")
    assert round(c.train.client_fraction * c.data.num_clients) == 50  # cohort
    assert (c.train.batch_size, c.train.local_epochs, c.train.lr_local) == (10, 1, 0.1)
    assert (c.upload.weighting, c.train.local_momentum) == ("uniform", 0.0)


def test_flower_work_file_round_trips(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    clients = [(rng.integers(0, 256, (n, 4, 4, 1), dtype=np.uint8), rng.integers(0, 10, n))
               for n in (3, 5, 2)]
    path = str(tmp_path / "work.npz")
    flower_loop.write_work(path, clients, [0.5], [0.25], 10, "mlp_small", 2, 32, 1, 0.05)
    monkeypatch.setenv(flower_loop._WORK_ENV, path)  # noqa: SLF001 - what the workers read
    monkeypatch.setattr(flower_loop, "_cache", {})
    w = flower_loop._work()  # noqa: SLF001
    for k, (x, y) in enumerate(clients):
        lo, hi = w["offsets"][k], w["offsets"][k + 1]
        np.testing.assert_array_equal(w["x"][lo:hi], x)
        np.testing.assert_array_equal(w["y"][lo:hi], y)
    assert (int(w["per_round"]), str(w["model"]), float(w["lr"])) == (2, "mlp_small", 0.05)


def test_flower_names_a_missing_interpreter_and_model(tmp_path):
    with pytest.raises(FileNotFoundError, match="--flower_python: no such interpreter"):
        flower_loop.run_in(str(tmp_path / "nope"), [], [0.5], [0.25], 10, "mlp_small", 1, 32,
                           1, 0.05, 3)
    with pytest.raises(ValueError, match="model: expected one of"):
        flower_loop.write_work(str(tmp_path / "w.npz"), [(np.zeros((1, 4, 4, 1), np.uint8),
                                                          np.zeros(1))],
                               [0.5], [0.25], 10, "resnet", 1, 32, 1, 0.05)


def test_fedjax_names_a_missing_interpreter_and_a_model_it_does_not_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="--fedjax_python: no such interpreter"):
        fedjax_loop.run_in(str(tmp_path / "nope"), [], [0.5], [0.25], 10, "convnet3", 1, 32,
                           1, 0.05, 3)
    with pytest.raises(ValueError, match="model: FedJAX runs convnet3, mlp_small"):
        fedjax_loop._forward("pfl_simple_cnn", 10)  # noqa: SLF001


def test_peer_models_are_the_pytorch_peers_models():
    pytest.importorskip("torch")  # the bench extra; CI installs only dev
    from benchmarks.peers import torch_loop
    assert tuple(torch_loop.MODELS) == works.PEER_MODELS


def test_the_defaults_benchmark_compares_every_explicit_choice_of_this_backend(tmp_path):
    """`benchmarks.defaults` runs each work with its config's own execution settings and with
    every (strategy, kernels) pair a user may give on this backend: loop, vmap and scan with
    each kernel set ('shard' only with several devices)."""
    from benchmarks import defaults
    pairs = defaults.explicit_choices()
    strategies = {s for s, _ in pairs}
    assert {"loop", "vmap", "scan"} <= strategies
    assert ("shard" in strategies) == (len(jax.devices()) > 1)
    kernel_sets = ("xla", "eigen") if jax.default_backend() == "cpu" else ("xla",)
    assert len(pairs) == len(strategies) * len(kernel_sets)
    assert defaults.explicit_choices(["scan/xla", "loop/xla"]) == [("loop", "xla"),
                                                                    ("scan", "xla")]
    with pytest.raises(Exception, match="--choices: loop/cuda not among"):
        defaults.explicit_choices(["loop/cuda"])
    config = defaults.work_config("a", 5, str(tmp_path))
    assert (config.train.rounds, config.eval.every, config.checkpoint.every) == (5, 5, 0)
    assert config.execution.strategy == defaults.quickstart.get_config().execution.strategy
    with pytest.raises(Exception, match="unknown work 'z'"):
        defaults.work_config("z", 5, str(tmp_path))
