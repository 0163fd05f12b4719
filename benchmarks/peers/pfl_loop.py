"""FedAvg in pfl-research (Apple's `pfl` package, PyTorch backend), as its own benchmarks run it.

Used by `benchmarks.peers.cross_device --pfl`. pfl 0.6 pins dp-accounting < 0.6, which pins absl-py
1.x, while this project needs absl-py >= 2.1, so it is not in an extra; install it beside the
project without its pins (it runs with dp-accounting 0.6 and absl-py 2):

  pip install -e ".[bench]" && pip install --no-deps pfl==0.6.0 prv-accountant==0.2.0 multiprocess
 The set-up follows
pfl-research's `benchmarks/image_classification/pytorch/train.py`: a `FederatedDataset` from
per-user tensors with a random user sampler, a `PyTorchModel` whose local optimizer is SGD and
whose central optimizer is SGD at rate 1 (the server applies the weighted mean update), the
`SimulatedBackend` with `WeightByDatapoints`, and `FederatedAveraging` with `NNAlgorithmParams`.
No evaluation, no privacy, no callbacks but a stopwatch of each central iteration.

pfl simulates a round by training the cohort's users one after another in one process; under
`torchrun` several processes share the cohort (each trains its part, then they all-reduce).
Run as a module for the cross-device work in either configuration:

  python -m benchmarks.peers.pfl_loop --participants=100                      # one process
  torchrun --nproc_per_node=2 -m benchmarks.peers.pfl_loop --participants=100 # two processes
  torchrun --nproc_per_node=2 -m benchmarks.peers.pfl_loop --pfl_work=fedavg --rounds=8  # work A
  torchrun --nproc_per_node=2 -m benchmarks.peers.pfl_loop --pfl_work=pfl_cifar --rounds=8

`benchmarks.peers.compare_frameworks --work=fedavg` also runs it in one process, beside the engine.
"""

from __future__ import annotations

import contextlib
import io
import time

import numpy as np

from benchmarks import works


def run_fedavg(clients: list[tuple[np.ndarray, np.ndarray]], mean, std, num_classes: int,
               rounds: int, per_round: int, batch_size: int, epochs: int, lr: float,
               seed: int = 0, hidden: int = 64, make_model=None) -> dict:
    """FedAvg over `clients` ([(x uint8 [n, H, W, C], y [n])]) in pfl-research: of the
    cross-device work (MLP 784-`hidden`-`num_classes` on flattened inputs) by default, or of
    `make_model(in_ch, spatial, num_classes)` on NCHW inputs (`torch_loop.fedavg_model`: work
    A's `convnet3`). Returns per-round wall times (the central iterations'), the client-steps
    run and the set-up time before the first iteration.

    Raises:
      ImportError naming the `bench` extra when pfl or PyTorch is not installed.
    """
    try:
        import torch
        from pfl.aggregate.simulate import SimulatedBackend
        from pfl.aggregate.weighting import WeightByDatapoints
        from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
        from pfl.callback.base import TrainingProcessCallback
        from pfl.data import FederatedDataset
        from pfl.data.sampling import get_user_sampler
        from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
        from pfl.metrics import Metrics, Weighted
        from pfl.model.pytorch import PyTorchModel
    except ImportError as e:
        raise ImportError(f"pfl-research is not installed ({e}): pip install -e \".[bench]\" "
                          "&& pip install --no-deps pfl==0.6.0 prv-accountant==0.2.0 "
                          "multiprocess") from None

    start = time.perf_counter()
    torch.manual_seed(seed)
    np.random.seed(seed)
    from benchmarks.peers import torch_loop
    users = {}
    for u, (x, y) in enumerate(clients):
        if make_model is not None:
            users[u] = torch_loop._to_tensors(x, y, mean, std)  # noqa: SLF001 - same inputs
            continue
        xf = (x.astype(np.float32) / 255.0 - np.float32(mean[0])) / np.float32(std[0])
        users[u] = (torch.from_numpy(xf.reshape(len(xf), -1)),
                    torch.from_numpy(y.astype(np.int64)))
    dataset = FederatedDataset.from_slices(users, get_user_sampler("random", list(users)))

    if make_model is None:
        model = torch.nn.Sequential(torch.nn.Linear(users[0][0].shape[1], hidden),
                                    torch.nn.ReLU(), torch.nn.Linear(hidden, num_classes))
    else:
        model = make_model(users[0][0].shape[1], users[0][0].shape[2], num_classes)

    def loss(self, inputs, targets, eval=False):  # noqa: A002 - pfl's keyword
        self.eval() if eval else self.train()
        return torch.nn.functional.cross_entropy(self(inputs), targets)

    @torch.no_grad()
    def metrics(self, inputs, targets, eval=True):  # noqa: A002
        logits = self(inputs)
        n = len(inputs)
        return {"loss": Weighted(float(torch.nn.functional.cross_entropy(
            logits, targets, reduction="sum")), n),
            "accuracy": Weighted(float((logits.argmax(-1) == targets).sum()), n)}

    model.loss = loss.__get__(model)
    model.metrics = metrics.__get__(model)
    params = [p for p in model.parameters() if p.requires_grad]
    pfl_model = PyTorchModel(model=model, local_optimizer_create=torch.optim.SGD,
                             central_optimizer=torch.optim.SGD(params, 1.0))
    backend = SimulatedBackend(training_data=dataset, val_data=None,
                               postprocessors=[WeightByDatapoints()])
    times: list[float] = []
    setup: list[float] = []

    class Stopwatch(TrainingProcessCallback):
        def on_train_begin(self, *, model):
            self.t = time.perf_counter()
            setup.append(self.t - start)
            return super().on_train_begin(model=model)

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            now = time.perf_counter()
            times.append(now - self.t)
            self.t = now
            return False, Metrics()

    with contextlib.redirect_stdout(io.StringIO()):  # pfl prints every iteration's metrics
        FederatedAveraging().run(
            algorithm_params=NNAlgorithmParams(central_num_iterations=rounds,
                                               evaluation_frequency=rounds + 1,
                                               train_cohort_size=per_round, val_cohort_size=0),
            backend=backend, model=pfl_model,
            model_train_params=NNTrainHyperParams(local_learning_rate=lr,
                                                  local_num_epochs=epochs,
                                                  local_batch_size=batch_size),
            model_eval_params=NNEvalHyperParams(local_batch_size=256),
            callbacks=[Stopwatch()])
    steps = rounds * per_round * epochs * int(np.ceil(len(clients[0][1]) / batch_size))
    return {"round_s": times, "client_steps": steps, "setup_s": setup[0]}


def _run_config(config, threads: int | None, make_model) -> dict:
    """pfl-research's FedAvg on the clients of an engine `config` (its rounds, participants
    and local optimization), with `threads` PyTorch intra-op threads (None: the default)."""
    import torch

    from fedjax_pfedes.engine.build import build_federated_data
    data = build_federated_data(config)
    c, t = data.central, config.train
    if threads:
        torch.set_num_threads(threads)
    clients = [(c.x_train[i], c.y_train[i]) for i in data.train_indices]
    return run_fedavg(clients, c.input_spec.mean, c.input_spec.std, c.num_classes, t.rounds,
                      round(t.client_fraction * len(clients)), t.batch_size, t.local_epochs,
                      t.lr_local, make_model=make_model)


def work_a(rounds: int, threads: int | None = None) -> dict:
    """pfl-research on `benchmarks.peers.compare_frameworks`' FedAvg work (work A: `convnet3`,
    MNIST-5k IID, 20 clients, 10 per round, 5 steps of 32, lr 0.05), with `threads` PyTorch
    intra-op threads (None: PyTorch's default)."""
    from benchmarks import works
    from benchmarks.peers import torch_loop
    return _run_config(works.fedavg_config(rounds), threads, torch_loop.fedavg_model)


def pfl_cifar(rounds: int, threads: int | None = None) -> dict:
    """pfl-research on its own CIFAR-10 cross-device setting (`works.pfl_cifar_config`: cohort
    50 of 1,000 users with ≈ 50 CIFAR-shaped random images, 1 epoch of batch 10, local SGD 0.1,
    its `simple_cnn` without dropout), with `threads` PyTorch intra-op threads (None: PyTorch's
    default)."""
    import os
    import tempfile

    from benchmarks import works
    from benchmarks.peers import torch_loop
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "cifar_shaped_users.npz")
        works.write_cifar_shaped(path, clients=works.PFL_CIFAR_USERS, per_client=62)
        return _run_config(works.pfl_cifar_config(rounds, path), threads,
                           torch_loop.pfl_simple_cnn_model)


def main(argv) -> None:
    """Prints pfl-research's median s/round (rounds 3..) on `benchmarks.peers.cross_device`'s work,
    or with --pfl_work=fedavg on `benchmarks.peers.compare_frameworks`' FedAvg work (rank 0 only
    under torchrun)."""
    del argv
    import os

    import torch
    from absl import flags

    rounds = max(flags.FLAGS.rounds, 4)
    processes = int(os.environ.get("WORLD_SIZE", 1))
    if flags.FLAGS.pfl_work in ("fedavg", "pfl_cifar"):
        # One intra-op thread per process when several share the cores, PyTorch's default alone.
        run = work_a if flags.FLAGS.pfl_work == "fedavg" else pfl_cifar
        result = run(rounds, 1 if processes > 1 else None)
        label = ("work A (convnet3, 10 participants x 5 steps)" if run is work_a else
                 "its CIFAR-10 setting (simple_cnn, cohort 50, batch 10)")
    else:
        participants = flags.FLAGS.participants
        data = works.cross_device_data(max(1000, 10 * participants))
        c = data.central
        torch.set_num_threads(1)
        clients = works.client_arrays(data)
        result = run_fedavg(clients, c.input_spec.mean, c.input_spec.std, c.num_classes,
                            rounds, participants, 32, 1, works.CROSS_DEVICE_LR)
        label = f"{participants} participants"
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"pfl-research, {processes} process(es), {label}: "
              f"{float(np.median(result['round_s'][2:])):.4f} s/round", flush=True)


if __name__ == "__main__":
    from absl import app, flags

    flags.DEFINE_integer("participants", 100, "Clients per round of work B (cross_device).")
    flags.DEFINE_integer("rounds", 12, "Rounds per measurement (>= 4).")
    flags.DEFINE_enum("pfl_work", "cross_device", ["cross_device", "fedavg", "pfl_cifar"],
                      "cross_device: benchmarks.peers.cross_device's work B; fedavg: "
                      "benchmarks.peers.compare_frameworks' FedAvg work A; pfl_cifar: its own "
                      "CIFAR-10 cross-device setting (works.pfl_cifar_config).")
    app.run(main)
