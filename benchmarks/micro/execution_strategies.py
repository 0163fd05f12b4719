"""Times one round of local updates per cohort under the 'loop' strategy and another one
('vmap' unless --against says otherwise).

Workloads:
  quickstart: the cohorts of configs/quickstart.py on real MNIST-5k, one round's participants.
  cifar: CIFAR-shaped inputs (32x32x3, 10 classes; synthetic pixels, the timing does not depend
    on them), CNN-1..CNN-5, 20 participants (4 per cohort; --cifar_clients), 200 samples each.

  python -m benchmarks.micro.execution_strategies --workload=quickstart,cifar --repeats=3
  python -m benchmarks.micro.execution_strategies --workload=cifar --cifar_clients=20  # 100 clients
  python -m benchmarks.micro.execution_strategies --workload=quickstart --against=scan \
      --loop_threads=0   # 'scan' in lanes against 'loop' on threads, as runs use them

Prints a Markdown table: compile time (first call minus a steady call), steady time per round,
client-steps per second for each strategy, and the other/loop throughput ratio.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from configs import quickstart
from fedjax_pfedes.algorithms.pfedes import PFedESConfig, pfedes
from fedjax_pfedes.data.federated import stack_clients
from fedjax_pfedes.data.spec import InputSpec
from fedjax_pfedes.engine.build import build_algorithm, build_federated_data
from fedjax_pfedes.engine.cohorts import assign_architectures
from fedjax_pfedes.execution import runners

_WORKLOAD = flags.DEFINE_list("workload", ["quickstart", "cifar"], "Workloads to time.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Steady-state repetitions per measurement.")
_CIFAR_CLIENTS = flags.DEFINE_integer("cifar_clients", 4, "cifar workload: participants per "
                                      "cohort (5 cohorts; 20 = cifar_hetero-sized, 100 clients).")
_AGAINST = flags.DEFINE_enum("against", "vmap", ["vmap", "scan"], "The strategy timed against "
                              "'loop' (the table's 'other' columns).")
_LOOP_THREADS = flags.DEFINE_integer("loop_threads", 1, "Host threads of 'loop' (1: one client "
                                     "after another, as the tables in docs were measured; 0 = the "
                                     "CPU cores, as runs use by default).")


def _time_strategy(program, strategy, broadcast, states, train, slots, keys, repeats):
    runner = runners.make_runner(program, strategy, loop_threads=_LOOP_THREADS.value)
    states = jax.tree.map(jnp.array, states)
    t0 = time.perf_counter()
    uploads, states, _ = runner.update(broadcast, states, train, slots, keys)
    jax.block_until_ready((uploads, states))
    first = time.perf_counter() - t0
    steady = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        uploads, states, _ = runner.update(broadcast, states, train, slots, keys)
        jax.block_until_ready((uploads, states))
        steady.append(time.perf_counter() - t0)
    best = min(steady)
    return first - best, best


def _cohorts_quickstart():
    config = quickstart.get_config()
    data = build_federated_data(config)
    algorithm = build_algorithm(config, data)
    archs = assign_architectures(config.clients.architectures, data.num_clients)
    m = max(1, round(config.train.client_fraction * data.num_clients))
    participants = np.sort(np.random.default_rng(0).choice(data.num_clients, m, replace=False))
    for arch in dict.fromkeys(archs):
        ids = np.array([k for k, a in enumerate(archs) if a == arch])
        slots = np.flatnonzero(np.isin(ids, participants)).astype(np.int32)
        yield (f"quickstart/{arch}", algorithm, arch, data.client_arrays(ids, "train"), slots,
               config.train.batch_size, config.train.local_epochs)


def _cohorts_cifar():
    spec = InputSpec("image", (32, 32, 3), "float32", (0.5,) * 3, (0.25,) * 3)
    cfg = PFedESConfig(num_classes=10, input_spec=spec, batch_size=64, local_epochs=1,
                       lr_local=0.01)
    algorithm = pfedes(cfg)
    rng = np.random.default_rng(0)
    n, clients = 200, _CIFAR_CLIENTS.value
    x = rng.uniform(size=(n * clients, 32, 32, 3)).astype(np.float32)
    y = rng.integers(0, 10, n * clients).astype(np.int32)
    arrays = stack_clients(x, y, np.split(np.arange(n * clients), clients))
    for arch in ("cnn1", "cnn2", "cnn3", "cnn4", "cnn5"):
        yield (f"cifar/{arch}", algorithm, arch, arrays, np.arange(clients, dtype=np.int32),
               cfg.batch_size, cfg.local_epochs)


def main(argv):
    del argv
    sources = {"quickstart": _cohorts_quickstart, "cifar": _cohorts_cifar}
    print(f"platform: {jax.default_backend()}, devices: {jax.device_count()}")
    o = _AGAINST.value
    print(f"| cohort | clients | steps/client | compile {o} s | compile loop s | round {o} s "
          f"| round loop s | client-steps/s {o} | client-steps/s loop | {o}/loop |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for workload in _WORKLOAD.value:
        for name, algorithm, arch, train, slots, batch, epochs in sources[workload]():
            program = algorithm.cohort_program(arch)
            server = algorithm.init_server(jax.random.key(0))
            states = jax.vmap(program.init_client)(jax.random.split(jax.random.key(1),
                                                                    train.num_clients))
            train = jax.device_put(train)
            keys = jax.random.split(jax.random.key(2), len(slots))
            sizes = np.asarray(train.sizes)[slots]
            steps = int(sum(epochs * -(-s // min(batch, train.y.shape[1])) for s in sizes))
            result = {}
            for strategy in (o, "loop"):
                result[strategy] = _time_strategy(program, strategy, server.proxy_params, states,
                                                  train, slots, keys, _REPEATS.value)
            (cv, rv), (cl, rl) = result[o], result["loop"]
            print(f"| {name} | {len(slots)} | {steps / len(slots):.1f} | {cv:.1f} | {cl:.1f} "
                  f"| {rv:.3f} | {rl:.3f} | {steps / rv:.0f} | {steps / rl:.0f} | {rl / rv:.2f} |",
                  flush=True)


if __name__ == "__main__":
    app.run(main)
