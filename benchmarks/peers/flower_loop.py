"""FedAvg in Flower's simulation engine (Ray backend), on the clients and model the other peers use.

Used by `benchmarks.peers.cross_device --flower_python=...` (work B: the MLP, 100 of 1,000 clients
per round, one local step) and `benchmarks.peers.compare_frameworks --flower_python=...` (work A:
`convnet3`, 10 of 20 clients, 5 steps of 32). Flower 1.42 pins protobuf < 7 and rich < 15, which
the project's own environment has newer, so it runs in its own virtual environment, which needs
no JAX: the benchmark writes the work's clients to an .npz (`write_work`) and runs this module
with that environment's Python, which prints one JSON line back.

  python -m venv /tmp/flwr_venv
  /tmp/flwr_venv/bin/pip install "flwr[simulation]==1.42.0" torch
  python -m benchmarks.peers.cross_device --strategies=scan \
      --flower_python=/tmp/flwr_venv/bin/python
  # by hand, from the repository root, on an .npz written by `write_work`:
  /tmp/flwr_venv/bin/python -m benchmarks.peers.flower_loop --work=/tmp/work.npz --rounds=12

The set-up follows Flower's PyTorch tutorial with the Message API: a `ClientApp` whose
`@app.train()` function builds the model, loads the `ArrayRecord` it was sent, trains its
partition (`context.node_config['partition-id']`) and replies with its arrays and
`num-examples`; a `ServerApp` running the built-in `flwr.serverapp.strategy.FedAvg` (weighted by
`num-examples`, `fraction_train` = participants / clients, no federated evaluation); both
launched by `flwr.simulation.run_simulation` with one virtual SuperNode per client and the Ray
backend, one CPU per client (`client_resources`), i.e. as many Ray workers as cores. The local
update is `benchmarks.peers.torch_loop`'s (same model, normalization, shuffled batches, plain SGD);
each worker keeps its clients' tensors after first use, as a dataset cache would. Round times
are the intervals between the strategy's `evaluate_fn` calls (it runs before round 1 and after
every round and does nothing here); set-up is the time to the first call.
"""

from __future__ import annotations

import os
import time

import numpy as np

from benchmarks.peers import work_file
from benchmarks.peers.work_file import load_work, write_work  # noqa: F401 - its work file

_WORK_ENV = "FEDJAX_PFEDES_FLOWER_WORK"  # the .npz path, read by the Ray workers too
_cache: dict = {}


def _work() -> dict:
    """The work's scalars and arrays, loaded once per process (driver and each Ray worker)."""
    if "work" not in _cache:
        _cache["work"] = load_work(os.environ[_WORK_ENV])
    return _cache["work"]


def _model():
    from benchmarks.peers import torch_loop
    w = _work()
    in_ch, spatial = w["x"].shape[3], w["x"].shape[1]
    return torch_loop.MODELS[str(w["model"])](in_ch, spatial, int(w["num_classes"]))


def _client_tensors(k: int):
    """Client k's normalized channels-first tensors (`torch_loop._to_tensors`), kept per
    worker after first use."""
    from benchmarks.peers import torch_loop
    key = ("client", k)
    if key not in _cache:
        w = _work()
        lo, hi = int(w["offsets"][k]), int(w["offsets"][k + 1])
        _cache[key] = torch_loop._to_tensors(w["x"][lo:hi], w["y"][lo:hi],  # noqa: SLF001
                                             w["mean"], w["std"])
    return _cache[key]


def _apps(rounds: int, stamps: list[float]):
    """The Flower `ClientApp` and `ServerApp` of the work; `stamps` gets the time of each
    `evaluate_fn` call."""
    import torch
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg

    from benchmarks.peers import torch_loop

    client_app = ClientApp()

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        torch.set_num_threads(1)
        w = _work()
        x, y = _client_tensors(int(context.node_config["partition-id"]))
        model = _model()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        opt = torch.optim.SGD(model.parameters(), lr=float(w["lr"]))
        for idx in torch_loop._batches(len(y), int(w["batch_size"]),  # noqa: SLF001
                                       int(w["epochs"])):
            torch_loop.fedavg_step(model, opt, x[idx], y[idx])
        content = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                              "metrics": MetricRecord({"num-examples": len(y)})})
        return Message(content=content, reply_to=msg)

    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        del context
        w = _work()
        clients, per_round = len(w["offsets"]) - 1, int(w["per_round"])
        torch.manual_seed(0)
        strategy = FedAvg(fraction_train=per_round / clients, fraction_evaluate=0.0,
                          min_train_nodes=per_round, min_available_nodes=clients)

        def stopwatch(server_round, arrays):
            del server_round, arrays
            stamps.append(time.perf_counter())

        strategy.start(grid=grid, initial_arrays=ArrayRecord(_model().state_dict()),
                       num_rounds=rounds, evaluate_fn=stopwatch)

    return client_app, server_app


def run(work_path: str, rounds: int, cpus_per_client: float = 1.0) -> dict:
    """Runs the work at `work_path` for `rounds` rounds in Flower's simulation engine (Ray
    backend). Returns per-round wall times, the client-steps run and the set-up time.

    Raises:
      ImportError naming the install commands when Flower or PyTorch is missing.
    """
    start = time.perf_counter()
    try:
        import torch  # noqa: F401 - the clients' framework
        from flwr.simulation import run_simulation
    except ImportError as e:
        raise ImportError(f"Flower is not installed here ({e}): python -m venv /tmp/flwr_venv "
                          "&& /tmp/flwr_venv/bin/pip install \"flwr[simulation]==1.42.0\" "
                          "torch") from None
    import logging
    logging.getLogger("flwr").setLevel(logging.WARNING)  # Flower logs every round at INFO
    os.environ[_WORK_ENV] = os.path.abspath(work_path)
    # The Ray workers import this module and benchmarks.peers.torch_loop by name.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    w = _work()
    stamps: list[float] = []
    client_app, server_app = _apps(rounds, stamps)
    clients = len(w["offsets"]) - 1
    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=clients,
                   backend_name="ray",
                   backend_config={"client_resources": {"num_cpus": cpus_per_client,
                                                        "num_gpus": 0.0}})
    if len(stamps) != rounds + 1:
        raise RuntimeError(f"Flower ran {max(len(stamps) - 1, 0)} of {rounds} rounds "
                           "(its log above says why)")
    return {"round_s": list(np.diff(stamps)), "setup_s": stamps[0] - start,
            "client_steps": work_file.client_steps(w, rounds)}


def run_in(python: str, clients: list[tuple[np.ndarray, np.ndarray]], mean, std,
           num_classes: int, model: str, per_round: int, batch_size: int, epochs: int,
           lr: float, rounds: int) -> dict:
    """Runs the FedAvg work (`work_file.write_work`'s arguments) for `rounds` rounds with the
    Python interpreter `python` of an environment that has Flower and PyTorch, from the
    environment the caller runs in (which needs neither). Returns `run`'s dict
    (`work_file.run_in`, whose errors it raises)."""
    return work_file.run_in(python, "benchmarks.peers.flower_loop", "flower_python", clients,
                            mean, std, num_classes, model, per_round, batch_size, epochs, lr,
                            rounds)


def main() -> None:
    work_file.main(run, __doc__.splitlines()[0], lambda parser: parser.add_argument(
        "--cpus_per_client", type=float, default=1.0,
        help="Ray CPUs per client: workers = cores / this."))


if __name__ == "__main__":
    main()
