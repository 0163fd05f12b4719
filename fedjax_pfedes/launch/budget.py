"""Round-time budget of a config, before training .

  python -m launch.budget --config=configs/quickstart.py
  python -m launch.budget --config=configs/quickstart.py --config.system.speed_classes=1,2,8 \
      --config.system.upload_mbps=2 --config.upload.topk_fraction=0.1
  python -m launch.budget --config=configs/quickstart.py --measure   # step time of this machine

Prints, per architecture and device speed class, the stages of one client's round (download,
local compute, upload after compression), then replays the run's sampling and system model
(availability, drop-outs, deadline) over all rounds without training: round time, waiting for
the slowest client, clients lost, and the simulated time of the whole run. With --measure the
compute stage uses the measured time of one local step of each architecture on this machine
(compiled; x the speed-class multipliers) instead of config.system.step_time_s.
"""

from __future__ import annotations

import sys
import tempfile

import jax
import numpy as np
from absl import flags
from ml_collections import config_flags

from fedjax_pfedes.engine.build import build_context, build_federated_data
from fedjax_pfedes.engine.validate import validate_config
from fedjax_pfedes.errors import ConfigError, DatasetUnavailableError
from fedjax_pfedes.execution import offload
from fedjax_pfedes.launch import cli
from fedjax_pfedes.studies.round_budget import (
    budget_table,
    measure_step_times,
    replay_rounds,
    with_step_times,
)

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.",
                                          lock_config=True)
_MEASURE = flags.DEFINE_bool("measure", False, "Measure the local step time of every "
                             "architecture on this machine instead of system.step_time_s.")


def main(argv: list[str]) -> None:
    del argv
    # Offloaded client states are written to files when the context is built: into a folder
    # of this report's own, removed at its end (never a run's `client_state_dir`, whose
    # states it would overwrite).
    with tempfile.TemporaryDirectory(prefix="fedjax_pfedes_budget_") as scratch:
        config = _CONFIG.value.copy_and_resolve_references()
        config.execution.client_state_dir = scratch
        try:
            validate_config(config)
            ctx, state = build_context(config, build_federated_data(config))
        except (ConfigError, DatasetUnavailableError) as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        try:
            _report(config, ctx, state)
        finally:
            offload.close_files(state.clients)


def _report(config, ctx, state) -> None:
    """Prints the budget of the run `config` describes (see the module docstring)."""
    s, t = ctx.system, config.train
    print(f"Round-time budget: {config.algorithm} on {config.data.name}, {ctx.num_clients} "
          f"clients, client_fraction {t.client_fraction} ({t.sampling}), {t.rounds} rounds")
    if _MEASURE.value:
        measured = measure_step_times(ctx, state)
        ctx = with_step_times(ctx, measured)
        step = ", ".join(f"{a} {v * 1e3:.1f} ms" for a, v in measured.items())
        print(f"measured step time on this machine ({ctx.cohorts[0].runner.name} "
              f"strategy, {jax.default_backend()}): {step}; x speed class")
    else:
        print(f"simulated step time {s.step_time_s:g} s x speed class")
    print("uplink "
          f"{','.join(f'{v:g}' for v in s.upload_mbps)} Mbit/s, downlink "
          f"{','.join(f'{v:g}' for v in s.download_mbps)} Mbit/s\n")
    header = (f"{'architecture':14s}{'speed':>7s}{'clients':>8s}{'steps':>7s}"
              f"{'upload B':>11s}{'download s':>11s}{'compute s':>10s}{'upload s':>9s}"
              f"{'total s':>9s}{'max s':>8s}")
    print(header)
    print("-" * len(header))
    for r in budget_table(ctx):
        print(f"{r['arch']:14s}{r['speed']:>7s}{r['clients']:>8d}{r['steps']:>7.0f}"
              f"{r['upload_bytes']:>11,.0f}{r['download_s']:>11.3f}{r['compute_s']:>10.3f}"
              f"{r['upload_s']:>9.3f}{r['total_s']:>9.3f}{r['total_max_s']:>8.3f}")
    if config.asynchronous.enabled:
        print("\nasynchronous rounds: a server step waits for the next "
              f"{config.asynchronous.buffer_size} arrivals (no round deadline)")
        return
    replay = replay_rounds(ctx)
    lost = replay["selected"].sum() - replay["delivered"].sum()
    print(f"\nper round (replayed over {t.rounds} rounds, no training): round time mean "
          f"{replay['round_s'].mean():.3f} s (p90 {np.percentile(replay['round_s'], 90):.3f}, "
          f"max {replay['round_s'].max():.3f}); waiting for the slowest: mean "
          f"{replay['waiting_s'].mean():.3f} s")
    print(f"selected {replay['selected'].mean():.1f}, delivered {replay['delivered'].mean():.1f} "
          f"per round; lost {lost} uploads ({replay['dropped_out'].sum()} drop-outs, "
          f"{replay['past_deadline'].sum()} past the deadline)")
    print(f"simulated time of the run: {replay['round_s'].sum():.1f} s")


def console() -> None:
    """`python -m launch.budget` from a checkout; `fedjax-pfedes-budget` installed."""
    cli.run(main, required=("config",))


if __name__ == "__main__":
    console()
