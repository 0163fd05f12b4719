"""The works `benchmarks.compare_frameworks` and `benchmarks.pfl_loop` time, as engine configs
(no command-line flags here, so both can import them)."""

from __future__ import annotations

import numpy as np

from configs import quickstart


def fedavg_config(rounds: int):
    """Work A: FedAvg, `convnet3`, MNIST-5k IID, 20 clients, 10 per round, 1 epoch of batch 32
    (5 steps), lr 0.05, no momentum."""
    config = quickstart.get_config()
    config.algorithm = "fedavg"
    config.clients.architectures = "convnet3"
    config.data.partition = "iid"
    config.train.local_epochs = 1
    config.train.local_momentum = 0.0
    config.train.lr_local = 0.05
    config.train.batch_size = 32
    config.train.client_fraction = 0.5
    return _quiet(config, rounds)


def pfedes_config(rounds: int, npz_path: str, clients: int = 20):
    """pFedES on CIFAR-shaped inputs (`write_cifar_shaped`), `clients` cycling CNN-1..5, all of
    them every round, 5 steps of 64, d = 128, plain SGD."""
    config = quickstart.get_config()
    config.data.name = "npz"
    config.data.path = npz_path
    config.data.partition = "iid"
    config.data.num_clients = clients
    config.clients.architectures = "cnn1,cnn2,cnn3,cnn4,cnn5"
    config.train.client_fraction = 1.0
    config.train.local_epochs = 1
    config.train.batch_size = 64
    config.train.local_momentum = 0.0
    config.proxy_dim = 128
    return _quiet(config, rounds)


def _quiet(config, rounds: int):
    config.train.rounds = rounds
    config.eval.every = rounds
    config.checkpoint.every = 0
    config.monitor.aggregation_loss = False
    config.monitor.tensorboard = False
    config.execution.compilation_cache_dir = ""  # round 1 as a first run on a machine sees it
    return config


def write_cifar_shaped(path: str, clients: int = 20, per_client: int = 400) -> None:
    """Random 32x32x3 uint8 images, 10 classes: 400 per client -> 320 local train = 5 x 64."""
    rng = np.random.default_rng(0)
    n = clients * per_client
    np.savez(path, x_train=rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8),
             y_train=rng.integers(0, 10, n), x_test=rng.integers(0, 256, (500, 32, 32, 3),
                                                                   dtype=np.uint8),
             y_test=rng.integers(0, 10, 500))
