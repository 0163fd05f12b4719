"""A FedAvg work handed to a peer framework that runs in its own Python environment.

Flower (`flower_loop`) and FedJAX (`fedjax_loop`) pin libraries this project's environment has
in other versions, so each runs in a virtual environment of its own: the benchmark writes the
work's clients to an .npz (`write_work`), runs the peer's module with that environment's
interpreter (`run_in`), and reads back the one JSON line it prints (per-round wall times, the
client-steps run, the set-up time).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write_work(path: str, clients: list[tuple[np.ndarray, np.ndarray]], mean, std,
               num_classes: int, model: str, per_round: int, batch_size: int, epochs: int,
               lr: float) -> None:
    """Writes a FedAvg work: the clients' local train arrays ([(x uint8 [n, H, W, C], y [n])],
    concatenated with their offsets), the inputs' normalization, `model` (one of
    `works.PEER_MODELS`), the participants per round and the local optimization (batch, epochs,
    SGD rate).

    Raises:
      ValueError: naming `model` when it is not a peer model.
    """
    from benchmarks.works import PEER_MODELS
    if model not in PEER_MODELS:
        raise ValueError(f"model: expected one of {', '.join(PEER_MODELS)}, got {model!r}")
    sizes = np.asarray([len(y) for _, y in clients], np.int64)
    np.savez(path, x=np.concatenate([x for x, _ in clients]),
             y=np.concatenate([y for _, y in clients]).astype(np.int64),
             offsets=np.concatenate([[0], np.cumsum(sizes)]),
             mean=np.asarray(mean, np.float32), std=np.asarray(std, np.float32),
             num_classes=num_classes, model=model, per_round=per_round,
             batch_size=batch_size, epochs=epochs, lr=lr)


def load_work(path: str) -> dict:
    """The work at `path` (`write_work`), its scalars and arrays."""
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def run_in(python: str, module: str, flag: str, clients: list[tuple[np.ndarray, np.ndarray]],
           mean, std, num_classes: int, model: str, per_round: int, batch_size: int,
           epochs: int, lr: float, rounds: int) -> dict:
    """Runs `module` (`python -m module --work=... --rounds=...`) with the interpreter `python`
    on the FedAvg work (`write_work`'s arguments) for `rounds` rounds.

    Args:
      python: the peer environment's interpreter.
      module: the peer's module, e.g. 'benchmarks.peers.flower_loop'.
      flag: the command-line flag that named `python`, for the errors.
      clients ... lr: `write_work`'s arguments.
      rounds: rounds to run.

    Returns:
      The JSON line the module printed, as a dict.

    Raises:
      FileNotFoundError: naming `flag` when `python` does not exist.
      RuntimeError: with the end of the peer's output when its run fails.
    """
    if not os.path.isfile(python):
        raise FileNotFoundError(f"--{flag}: no such interpreter {python!r} "
                                f"({module.replace('.', '/')}.py says how to make one)")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "work.npz")
        write_work(path, clients, mean, std, num_classes, model, per_round, batch_size, epochs,
                   lr)
        done = subprocess.run([python, "-m", module, f"--work={path}", f"--rounds={rounds}"],
                              cwd=ROOT, capture_output=True, text=True, check=False)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{module}'s run failed (exit {done.returncode}): "
                           + (done.stderr or done.stdout)[-2000:])
    return json.loads(lines[-1])


def client_steps(work: dict, rounds: int) -> int:
    """The client-steps `rounds` rounds of `work` run: participants x epochs x the median
    client's batches (the last one partial)."""
    batches = math.ceil(float(np.median(np.diff(work["offsets"]))) / int(work["batch_size"]))
    return rounds * int(work["per_round"]) * int(work["epochs"]) * batches


def main(run: Callable[..., dict], description: str,
         add_arguments: Callable[[argparse.ArgumentParser], None] | None = None) -> None:
    """A peer module's command line: `--work` (an .npz of `write_work`) and `--rounds`, and
    what `add_arguments` adds; calls `run(work, rounds, *added)` and prints its result as the
    one JSON line `run_in` reads."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--work", required=True, help="An .npz written by work_file.write_work.")
    parser.add_argument("--rounds", type=int, default=12)
    if add_arguments is not None:
        add_arguments(parser)
    args = vars(parser.parse_args())
    work, rounds = args.pop("work"), args.pop("rounds")
    if not os.path.isfile(work):
        sys.exit(f"--work: no such file {work!r} (write it with work_file.write_work)")
    result = run(work, rounds, *args.values())
    print(json.dumps({k: (list(map(float, v)) if isinstance(v, list) else float(v))
                      for k, v in result.items()}), flush=True)
