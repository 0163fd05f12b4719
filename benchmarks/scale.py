"""Populations of 1,000 to 100,000 clients: round time, peak resident memory and disk per size.

  python -m benchmarks.scale --clients=1000,10000,100000 --models=mlp_small,convnet3

Synthetic MNIST-shaped data (uint8 28x28x1, random labels; `--samples` train rows per client,
a fifth more for the local test split), IID over N clients, pFedES with SGD momentum 0.9 (so every
client's private state is its model plus a momentum buffer of the same size),
`--participants` clients per round whatever N is, `config.execution.client_states='offload'`
with `--budget_gb` of host memory for the states (above it they are memory-mapped files under
`--state_dir`). Each (model, N) runs in its own process, so its peak resident memory
(ru_maxrss) is its own. A size whose states would not fit on the free disk is skipped with the
estimate. Round time is the median of rounds 2..R (round 1 compiles); no evaluation runs.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
from absl import app, flags

_CLIENTS = flags.DEFINE_list("clients", ["1000", "10000", "100000"], "Population sizes N.")
_MODELS = flags.DEFINE_list("models", ["mlp_small", "convnet3"], "Client architectures.")
_PARTICIPANTS = flags.DEFINE_integer("participants", 10, "Clients per round (every N).")
_ROUNDS = flags.DEFINE_integer("rounds", 6, "Rounds per run (the first compiles).")
_SAMPLES = flags.DEFINE_integer("samples", 20, "Local train samples per client.")
_BUDGET = flags.DEFINE_float("budget_gb", 4.0, "config.execution.client_state_budget_gb.")
_STATE_DIR = flags.DEFINE_string("state_dir", "", "Where memory-mapped states go ('' = a "
                                 "temporary folder, removed after each run).")
_ONE = flags.DEFINE_string("one", "", "internal: run one MODEL:N in this process, print JSON.")


def _config(model: str, n: int):
    from configs import quickstart
    c = quickstart.get_config()
    c.data.name, c.data.num_clients, c.data.partition = "npz", n, "iid"
    c.data.min_samples_per_client = 1
    c.clients.architectures = model
    c.train.client_fraction = _PARTICIPANTS.value / n
    c.train.local_epochs, c.train.local_momentum = 1, 0.9
    c.train.rounds = _ROUNDS.value
    c.eval.every = _ROUNDS.value  # never reached: the benchmark runs rounds only
    c.checkpoint.every = 0
    c.monitor.aggregation_loss = False
    c.execution.client_states = "offload"
    c.execution.client_state_budget_gb = _BUDGET.value
    return c


def _synthetic(n: int):
    from fedjax_pfedes.data.sources import make_dataset
    rng = np.random.default_rng(0)
    rows = n * _SAMPLES.value * 5 // 4
    x = rng.integers(0, 256, (rows, 28, 28, 1), dtype=np.uint8)
    y = rng.integers(0, 10, rows).astype(np.int32)
    return make_dataset("synthetic_mnist", "image", x, y, x[:100], y[:100], 10)


def run_one(model: str, n: int) -> dict:
    from fedjax_pfedes.data.federated import partition_dataset
    from fedjax_pfedes.engine import rounds
    from fedjax_pfedes.engine.build import build_context
    config = _config(model, n)
    state_dir = _STATE_DIR.value or tempfile.mkdtemp(prefix="scale_states_")
    config.execution.client_state_dir = os.path.join(state_dir, f"{model}_{n}")
    t0 = time.perf_counter()
    data = partition_dataset(_synthetic(n), n, "iid", 0, local_test_fraction=0.2,
                             min_samples_per_client=1)
    ctx, state = build_context(config, data)
    setup_s = time.perf_counter() - t0
    times = []
    for r in range(_ROUNDS.value):
        t = time.perf_counter()
        state, record, _, _ = rounds.sync_round(ctx, state, r)
        jax.block_until_ready(state.server)
        times.append(time.perf_counter() - t)
    disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in
               os.walk(config.execution.client_state_dir) for f in fs)
    state_bytes = sum(a.nbytes for a in jax.tree.leaves(state.clients))
    if not _STATE_DIR.value:
        shutil.rmtree(state_dir, ignore_errors=True)
    return {"model": model, "clients": n, "participants": int(record["participants"]),
            "state_gib": state_bytes / 2**30, "on_disk": disk > 0, "disk_gib": disk / 2**30,
            "setup_s": setup_s, "round1_s": times[0], "round_s": float(np.median(times[1:])),
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "train_loss": record.get("train_ce_loss_mean")}


def _state_estimate_gib(model: str) -> float:
    """One client's state (model + momentum), from an initialized client of a tiny run."""
    from fedjax_pfedes.data.spec import InputSpec
    from fedjax_pfedes.engine import sections
    from fedjax_pfedes.tree_util import tree_size
    spec = InputSpec("image", (28, 28, 1), "uint8", (0.5,), (0.25,))
    algorithm = sections.build_algorithm(_config(model, 1000), 10, spec, 1, {model: 1000})
    row = jax.eval_shape(algorithm.cohort_program(model).init_client, jax.random.key(0))
    return tree_size(row)[1] / 2**30


def main(argv):
    del argv
    if _ONE.value:
        model, n = _ONE.value.split(":")
        print(json.dumps(run_one(model, int(n))))
        return
    results = []
    free = shutil.disk_usage(_STATE_DIR.value or tempfile.gettempdir()).free / 2**30
    for model in _MODELS.value:
        per_client = _state_estimate_gib(model)
        for n in map(int, _CLIENTS.value):
            need = per_client * n
            if need > _BUDGET.value and need > 0.9 * free:
                print(f"skip {model} x {n}: its states need {need:.1f} GiB, over the budget and "
                      f"the {free:.1f} GiB free on disk", file=sys.stderr)
                continue
            args = [sys.executable, "-m", "benchmarks.scale", f"--one={model}:{n}"] + [
                f"--{f.name}={f.value if not isinstance(f.value, list) else ','.join(f.value)}"
                for f in (_PARTICIPANTS, _ROUNDS, _SAMPLES, _BUDGET, _STATE_DIR)]
            out = subprocess.run(args, capture_output=True, text=True)
            if out.returncode != 0:
                print(f"{model} x {n} failed:\n{out.stderr[-2000:]}", file=sys.stderr)
                continue
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(results[-1]), file=sys.stderr)
    print(f"JAX {jax.__version__} on {jax.default_backend()}, {os.cpu_count()} CPUs; "
          f"{_PARTICIPANTS.value} participants per round, {_SAMPLES.value} samples per client, "
          f"budget {_BUDGET.value:g} GiB")
    print("| model | clients | state GiB | where | set-up s | round 1 s | s/round | "
          "vs smallest N | peak RSS GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        base = next(b for b in results if b["model"] == r["model"])
        print(f"| {r['model']} | {r['clients']:,} | {r['state_gib']:.2f} | "
              f"{'disk (memmap)' if r['on_disk'] else 'host memory'} | {r['setup_s']:.1f} | "
              f"{r['round1_s']:.2f} | {r['round_s']:.3f} | {r['round_s'] / base['round_s']:.2f} | "
              f"{r['peak_rss_gib']:.2f} |")


if __name__ == "__main__":
    app.run(main)
