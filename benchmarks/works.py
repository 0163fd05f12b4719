"""The works `benchmarks.peers.compare_frameworks`, `benchmarks.peers.cross_device` and
`benchmarks.peers.pfl_loop` time, as engine configs (no command-line flags here, so all of them
can import them)."""

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
    return quiet(config, rounds)


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
    return quiet(config, rounds)


# The engine architectures the PyTorch-based peers also have (`torch_loop.MODELS`).
PEER_MODELS = ("mlp_small", "convnet3", "pfl_simple_cnn")
CROSS_DEVICE_LR = 0.05
CROSS_DEVICE_SAMPLES = 25  # rows per client: 20 local train, 5 local test


def cross_device_config(rounds: int, clients: int, participants: int, npz_path: str = "",
                        model: str = "mlp_small", local_steps: int = 1,
                        algorithm: str = "fedavg"):
    """Work B: FedAvg of `mlp_small` (784-64 ReLU, then the 10-way classifier) on MNIST-shaped
    data (`write_mnist_shaped`) IID over `clients` clients with 20 local train samples each,
    `participants` per round, `local_steps` epochs of batch 32 (a client's data is one batch),
    lr 0.05, no momentum; `model` and `algorithm` change those axes."""
    config = quickstart.get_config()
    config.algorithm = algorithm
    config.data.name, config.data.path = "npz", npz_path
    config.data.num_clients, config.data.partition = clients, "iid"
    config.data.min_samples_per_client = 1
    config.clients.architectures = model
    config.train.client_fraction = participants / clients
    config.train.local_epochs = local_steps
    config.train.local_momentum = 0.0
    config.train.lr_local = CROSS_DEVICE_LR
    config.train.batch_size = 32
    return quiet(config, rounds)


PFL_CIFAR_USERS = 1000


def pfl_cifar_config(rounds: int, npz_path: str):
    """pfl-research's own CIFAR-10 cross-device setting (its `benchmarks/image_classification`,
    `configs/baseline.yaml`: `cifar10_iid`, 50 datapoints per user, cohort 50, 1 local epoch of
    batch 10, local SGD at 0.1, central SGD at 1.0, users weighted equally, `simple_cnn`) on
    CIFAR-shaped random data (`write_cifar_shaped` with 62 rows per user: ≈ 50 local train).
    The model is `simple_cnn` without its two dropout layers (`register_pfl_simple_cnn`: the
    engine's client models have none), on every side of the comparison."""
    register_pfl_simple_cnn()
    config = quickstart.get_config()
    config.algorithm = "fedavg"
    config.data.name, config.data.path = "npz", npz_path
    config.data.num_clients, config.data.partition = PFL_CIFAR_USERS, "iid"
    config.data.min_samples_per_client = 1
    config.clients.architectures = "pfl_simple_cnn"
    config.train.client_fraction = 50 / PFL_CIFAR_USERS
    config.train.local_epochs = 1
    config.train.batch_size = 10
    config.train.local_momentum = 0.0
    config.train.lr_local = 0.1
    config.upload.weighting = "uniform"
    return quiet(config, rounds)


def register_pfl_simple_cnn() -> None:
    """Registers pfl-research's `simple_cnn` (`benchmarks/model/pytorch/cnn.py`: conv 3x3 32,
    ReLU, conv 3x3 64, ReLU, 2x2 max pool, dense 128, ReLU; 'VALID' convolutions) as the
    engine architecture `pfl_simple_cnn`, through the public `register_architecture`. Its
    dropout layers are left out (see `pfl_cifar_config`)."""
    from flax import linen as nn

    from fedjax_pfedes import register_architecture
    from fedjax_pfedes.models.layers import Conv, max_pool_2x2

    class PflSimpleCNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(Conv(32, (3, 3), padding="VALID", name="conv1")(x))
            x = max_pool_2x2(nn.relu(Conv(64, (3, 3), padding="VALID", name="conv2")(x)))
            return nn.relu(nn.Dense(128, name="fc")(x.reshape(x.shape[0], -1)))

    register_architecture("pfl_simple_cnn", PflSimpleCNN())


def quiet(config, rounds: int):
    """`config` for a timing run of `rounds` rounds: evaluation only after the last round, no
    checkpoints, monitoring losses or TensorBoard, and no compilation cache (round 1 compiles as
    a first run on a machine does)."""
    config.train.rounds = rounds
    config.eval.every = rounds
    config.checkpoint.every = 0
    config.monitor.aggregation_loss = False
    config.monitor.tensorboard = False
    config.execution.compilation_cache_dir = ""  # round 1 as a first run on a machine sees it
    return config


def _write_random_images(path: str, shape: tuple[int, ...], rows: int, test_rows: int) -> None:
    """Random uint8 images of `shape`, 10 classes: `rows` to partition, `test_rows` global test."""
    rng = np.random.default_rng(0)
    np.savez(path, x_train=rng.integers(0, 256, (rows,) + shape, dtype=np.uint8),
             y_train=rng.integers(0, 10, rows),
             x_test=rng.integers(0, 256, (test_rows,) + shape, dtype=np.uint8),
             y_test=rng.integers(0, 10, test_rows))


def write_mnist_shaped(path: str, clients: int,
                       per_client: int = CROSS_DEVICE_SAMPLES) -> None:
    """Random 28x28x1 uint8 images, 10 classes, `per_client` rows per client."""
    _write_random_images(path, (28, 28, 1), clients * per_client, 100)


def write_cifar_shaped(path: str, clients: int = 20, per_client: int = 400) -> None:
    """Random 32x32x3 uint8 images, 10 classes: 400 per client -> 320 local train = 5 x 64."""
    _write_random_images(path, (32, 32, 3), clients * per_client, 500)


def cross_device_data(clients: int):
    """Work B's clients: `clients` of `CROSS_DEVICE_SAMPLES` random 28x28 images each, IID."""
    from fedjax_pfedes.data.federated import partition_dataset
    from fedjax_pfedes.data.sources import make_dataset
    rng = np.random.default_rng(0)
    rows = clients * CROSS_DEVICE_SAMPLES
    x = rng.integers(0, 256, (rows, 28, 28, 1), dtype=np.uint8)
    y = rng.integers(0, 10, rows).astype(np.int32)
    return partition_dataset(make_dataset("synthetic_mnist", "image", x, y, x[:100], y[:100],
                                          10), clients, "iid", 0, local_test_fraction=0.2,
                             min_samples_per_client=1)


def client_arrays(data) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every client's (x, y) train arrays of `data`, for the peers that take plain arrays."""
    c = data.central
    return [(c.x_train[np.asarray(i)], c.y_train[np.asarray(i)]) for i in data.train_indices]
