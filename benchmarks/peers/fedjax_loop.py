"""FedAvg in FedJAX (Ro et al., "FedJAX: Federated learning simulation with JAX", 2021), on the
clients and model the other peers use.

Used by `benchmarks.peers.compare_frameworks --fedjax_python=...` (work A: `convnet3`, 10 of 20
clients, 5 steps of 32; work B's `mlp_small` runs too). FedJAX 0.0.17, its last release, builds
its models with dm-haiku and was released against JAX 0.4; it runs in its own virtual
environment, which needs nothing of this project's: the benchmark writes the work's clients to
an .npz (`work_file.write_work`) and runs this module with that environment's Python, which
prints one JSON line back.

  python -m venv /tmp/fedjax_venv
  /tmp/fedjax_venv/bin/pip install "jax[cpu]==0.4.38" dm-haiku==0.0.13 fedjax==0.0.17
  python -m benchmarks.peers.compare_frameworks --work=fedavg \
      --fedjax_python=/tmp/fedjax_venv/bin/python
  # by hand, from the repository root, on an .npz written by `work_file.write_work`:
  /tmp/fedjax_venv/bin/python -m benchmarks.peers.fedjax_loop --work=/tmp/work.npz --rounds=12

The set-up follows FedJAX's FedAvg tutorial: the model as a haiku function made a FedJAX
`Model` (`fedjax.create_model_from_haiku`, cross-entropy loss), the clients as
`fedjax.InMemoryFederatedData` of the normalized channels-last arrays, FedJAX's own
`fed_avg.federated_averaging` with SGD at the work's rate on the clients and SGD at rate 1 on
the server (the sample-weighted mean of the clients' models), each client one pass of shuffled
batches (`ShuffleRepeatBatchHParams`, the last batch partial), and the participants drawn by
`fedjax.client_samplers.UniformGetClientSampler`. A round is `algorithm.apply` on the drawn
clients until its new parameters are ready; set-up is everything before round 1.
"""

from __future__ import annotations

import time

import numpy as np

from benchmarks.peers import work_file
from benchmarks.peers.work_file import load_work

MODELS = ("convnet3", "mlp_small")  # the peer models (`works.PEER_MODELS`) written in haiku here


def _forward(model: str, num_classes: int):
    """The work's model as a haiku function of a batch (FedJAX's convention: its inputs are
    `batch['x']`): `convnet3` (3x3 'same'
    convolutions of 16, 32, 64 channels with ReLU, 2x2 max pooling after the first two, Dense
    128 + ReLU, Dense classes; as `models.backbones.ConvStack`) or `mlp_small` (Dense 64 + ReLU,
    Dense classes)."""
    if model not in MODELS:
        raise ValueError(f"model: FedJAX runs {', '.join(MODELS)}, not {model!r}")
    import haiku as hk
    import jax

    def convnet3(batch):
        x = batch["x"]
        for i, features in enumerate((16, 32, 64)):
            x = jax.nn.relu(hk.Conv2D(features, 3, padding="SAME")(x))
            if i < 2:
                x = hk.max_pool(x, 2, 2, "VALID")
        return hk.Linear(num_classes)(jax.nn.relu(hk.Linear(128)(hk.Flatten()(x))))

    def mlp_small(batch):
        return hk.Linear(num_classes)(jax.nn.relu(hk.Linear(64)(hk.Flatten()(batch["x"]))))

    return {"convnet3": convnet3, "mlp_small": mlp_small}[model]


def run(work_path: str, rounds: int) -> dict:
    """Runs the work at `work_path` for `rounds` rounds of FedJAX's FedAvg. Returns per-round
    wall times, the client-steps run and the set-up time.

    Raises:
      ImportError naming the install command when FedJAX or haiku is missing.
    """
    start = time.perf_counter()
    try:
        import fedjax
        import haiku as hk
        import jax
        from fedjax.algorithms import fed_avg
    except ImportError as e:
        raise ImportError(f"FedJAX is not installed here ({e}): python -m venv "
                          "/tmp/fedjax_venv && /tmp/fedjax_venv/bin/pip install "
                          "\"jax[cpu]==0.4.38\" dm-haiku==0.0.13 fedjax==0.0.17") from None
    w = load_work(work_path)
    x = w["x"].astype(np.float32)
    if w["x"].dtype == np.uint8:
        x = x / 255.0
    x = (x - w["mean"]) / w["std"]
    offsets, per_round = w["offsets"], int(w["per_round"])
    clients = {str(k).encode(): {"x": x[lo:hi], "y": w["y"][lo:hi].astype(np.int32)}
               for k, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:], strict=True))}
    data = fedjax.InMemoryFederatedData(clients)
    forward = hk.transform(_forward(str(w["model"]), int(w["num_classes"])))
    model = fedjax.create_model_from_haiku(
        transformed_forward_pass=forward, sample_batch={"x": x[:1], "y": w["y"][:1]},
        train_loss=lambda batch, preds: fedjax.metrics.unreduced_cross_entropy_loss(
            batch["y"], preds))
    algorithm = fed_avg.federated_averaging(
        fedjax.model_grad(model), fedjax.optimizers.sgd(float(w["lr"])),
        fedjax.optimizers.sgd(1.0),
        fedjax.ShuffleRepeatBatchHParams(batch_size=int(w["batch_size"]),
                                         num_epochs=int(w["epochs"])))
    state = algorithm.init(model.init(jax.random.PRNGKey(0)))
    sampler = fedjax.client_samplers.UniformGetClientSampler(data, per_round, seed=0)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        state, _ = algorithm.apply(state, sampler.sample())
        jax.block_until_ready(state.params)
        times.append(time.perf_counter() - t0)
    return {"round_s": times, "setup_s": time.perf_counter() - start - sum(times),
            "client_steps": work_file.client_steps(w, rounds)}


def run_in(python: str, clients: list[tuple[np.ndarray, np.ndarray]], mean, std,
           num_classes: int, model: str, per_round: int, batch_size: int, epochs: int,
           lr: float, rounds: int) -> dict:
    """Runs the FedAvg work (`work_file.write_work`'s arguments) for `rounds` rounds with the
    Python interpreter `python` of an environment that has FedJAX (`work_file.run_in`, whose
    errors it raises). Returns `run`'s dict."""
    return work_file.run_in(python, "benchmarks.peers.fedjax_loop", "fedjax_python", clients,
                            mean, std, num_classes, model, per_round, batch_size, epochs, lr,
                            rounds)


def main() -> None:
    work_file.main(run, __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
