"""What a user gets by default, beside every explicit execution choice, on the machine it runs on.

  python -m benchmarks.defaults                       # works A, B, pFedES CIFAR-shaped, quick start
  python -m benchmarks.defaults --works=b --rounds_b=40
  python -m benchmarks.defaults --works=cross_device_10k --rounds=6   # writes ~33 GiB of states
  python -m benchmarks.defaults --works=a --choices=loop/xla,loop/eigen   # fewer columns

For each work it runs the engine with the config's own `config.execution.strategy` and
`cpu_kernels` (what a user gets without setting them: 'auto', `execution.cost_model`), then
with every explicit strategy the backend offers ('loop', 'vmap', 'scan'; 'shard' with more than
one device) x every kernel set
('xla', 'eigen' on a CPU), one run after another in this process. Each run is a fresh
`run_experiment` (monitoring, checkpoints and the compilation cache off, evaluation only after
the last round); s/round is the median round time over rounds 2 .. R-1 (round 1 compiles, the
last one also evaluates). Prints the machine (`execution.choice.machine`: CPU model,
instruction-set features, cores, jax and jaxlib), then a Markdown table: s/round per choice, the
fastest explicit one and the default's ratio to it. Take its figures on a quiet machine: run
nothing else meanwhile (docs/performance.md).

Works:
  a: FedAvg `convnet3`, MNIST-5k IID, 10 of 20 clients per round, 5 steps of 32
     (`works.fedavg_config`).
  b: cross-device FedAvg `mlp_small` (784-64-10), 1,000 clients with 20 samples, 100 per round,
     one step (`works.cross_device_config`).
  pfedes: pFedES on CIFAR-shaped inputs, 20 clients cycling CNN-1..5, all every round
     (`works.pfedes_config`).
  quickstart: configs/quickstart.py.
  cross_device_10k: configs/cross_device_10k.py (10,000 offloaded clients; minutes per run).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile

import jax
from absl import app, flags

from benchmarks import works
from configs import cross_device_10k, quickstart
from fedjax_pfedes.engine.loop import run_experiment
from fedjax_pfedes.execution import choice, kernels
from fedjax_pfedes.execution.strategies import protocol

WORKS = ("a", "b", "pfedes", "quickstart", "cross_device_10k")
_WORKS = flags.DEFINE_list("works", ["a", "b", "pfedes", "quickstart"],
                           "Works to run: " + ", ".join(WORKS) + ".")
_ROUNDS = flags.DEFINE_integer("rounds", 8, "Rounds per run (>= 3).")
_ROUNDS_B = flags.DEFINE_integer(
    "rounds_b", 40, "Rounds per run of work b (>= 3): its rounds take ~20 ms, so its median "
    "needs more of them to be stable.")
_CHOICES = flags.DEFINE_list(
    "choices", [], "The explicit strategy/kernels columns to run (e.g. loop/xla,loop/eigen); "
    "default: every one the backend offers. The best of fewer columns is the best of those.")
_PARTICIPANTS = flags.DEFINE_integer("participants", 100, "Work b: participants per round.")


def work_config(name: str, rounds: int, scratch: str):
    """The engine config of work `name` for `rounds` rounds (data files written under
    `scratch`)."""
    if name == "a":
        return works.fedavg_config(rounds)
    if name == "b":
        path = os.path.join(scratch, "mnist_shaped.npz")
        if not os.path.exists(path):
            works.write_mnist_shaped(path, 1000)
        return works.cross_device_config(_ROUNDS_B.value, 1000, _PARTICIPANTS.value, path)
    if name == "pfedes":
        path = os.path.join(scratch, "cifar_shaped.npz")
        if not os.path.exists(path):
            works.write_cifar_shaped(path, 20)
        return works.pfedes_config(rounds, path)
    if name in ("quickstart", "cross_device_10k"):
        module = quickstart if name == "quickstart" else cross_device_10k
        return works.quiet(module.get_config(), rounds)
    raise app.UsageError(f"--works: unknown work '{name}'; known: {', '.join(WORKS)}")


def explicit_choices(choices: list[str] | None = None) -> list[tuple[str, str]]:
    """Every (strategy, kernels) pair a run on this backend may be given explicitly, or those
    of them named in `choices` ('strategy/kernels', --choices)."""
    multi_device = len(jax.devices()) > 1
    strategies = [s for s in protocol.strategy_names()
                  if multi_device or not protocol.strategy(s).needs_mesh]
    pairs = [(s, k) for s in strategies for k in kernels.kernel_candidates("auto")]
    if not choices:
        return pairs
    unknown = sorted(set(choices) - {f"{s}/{k}" for s, k in pairs})
    if unknown:
        raise app.UsageError(f"--choices: {', '.join(unknown)} not among "
                             f"{', '.join(f'{s}/{k}' for s, k in pairs)}")
    return [(s, k) for s, k in pairs if f"{s}/{k}" in choices]


def seconds_per_round(config, workdir: str) -> tuple[float, str, float]:
    """(median round time over rounds 2 .. R-1, the strategy the run used, seconds its
    'auto' decisions took) of one run; its folder is removed afterwards (an offloaded work's
    client states take tens of GiB per run)."""
    try:
        summary = run_experiment(config, workdir, show_progress=False)
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            times = [json.loads(line)["round_time_s"] for line in f]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    deciding = sum(c.get("decided_in_s", 0.0)
                   for c in summary.get("strategy_choice", {}).values())
    return statistics.median(times[1:-1]), summary["execution_strategy"], deciding


def main(argv):
    del argv
    if min(_ROUNDS.value, _ROUNDS_B.value) < 3:
        raise app.UsageError("--rounds and --rounds_b must be >= 3 (round 1 compiles, the last "
                             "evaluates)")
    print("machine:", json.dumps(choice.machine()))
    pairs = explicit_choices(_CHOICES.value)
    header = ["work", "default (chosen)", "deciding s"] + [f"{s}/{k}" for s, k in pairs] + [
        "best explicit", "default / best"]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    with tempfile.TemporaryDirectory() as scratch:
        for name in _WORKS.value:
            config = work_config(name, _ROUNDS.value, scratch)
            default_s, used, deciding = seconds_per_round(
                config, os.path.join(scratch, name, "default"))
            explicit = {}
            for s, k in pairs:
                config.execution.strategy, config.execution.cpu_kernels = s, k
                explicit[f"{s}/{k}"] = seconds_per_round(
                    config, os.path.join(scratch, name, f"{s}_{k}"))[0]
            best = min(explicit, key=explicit.get)
            cells = [name, f"{default_s:.3f} ({used})", f"{deciding:.1f}"] + [
                f"{explicit[f'{s}/{k}']:.3f}" for s, k in pairs] + [
                best, f"{default_s / explicit[best]:.2f}x"]
            print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    app.run(main)
