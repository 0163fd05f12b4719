"""Runs one federated experiment from a config file.

  python -m launch.main --config=configs/quickstart.py --workdir=runs/quickstart
  python -m launch.main --config=configs/quickstart.py --config.lam=1.0 --config.train.rounds=50

Any config field can be overridden with --config.FIELD=VALUE. Writes <workdir>/metrics.jsonl
(one JSON object per round), metrics.csv, clients.jsonl (per-client report), TensorBoard events,
checkpoints/ and summary.json. Run the same command again to resume a killed run from its latest
checkpoint (--config.checkpoint.resume=False starts the workdir over).
"""

from __future__ import annotations

import sys

import jax
from absl import flags
from ml_collections import config_flags

from fedjax_pfedes.engine.evaluation import evaluation_note
from fedjax_pfedes.engine.loop import run_experiment
from fedjax_pfedes.errors import (
    ConfigError,
    DataError,
    DatasetUnavailableError,
    DivergedError,
    StorageError,
)
from fedjax_pfedes.io.workdir import RunLockedError
from fedjax_pfedes.launch import cli
from fedjax_pfedes.launch.cli import fail, loaded_config

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "runs/latest", "Where metrics and the summary go.")
_PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress bar.")


def main(argv: list[str]) -> None:
    del argv
    config = loaded_config(_CONFIG)
    try:
        summary = run_experiment(config, _WORKDIR.value, show_progress=_PROGRESS.value)
    except (ConfigError, DatasetUnavailableError, DataError, RunLockedError,
            StorageError) as e:
        fail(str(e))
    except DivergedError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(3)
    if jax.process_index() > 0:  # process 0 wrote the run's files and prints its figures
        print(f"process {jax.process_index()} of {jax.process_count()}: done; process 0 wrote "
              f"the results in {_WORKDIR.value}")
        return
    final = summary["final"]
    by_arch = {k: round(v, 4) for k, v in final["personalized_accuracy_by_arch"].items()}
    print(f"round {final['round']}: mean personalized accuracy "
          f"{final['personalized_accuracy_mean']:.4f} "
          f"(std across clients {final['personalized_accuracy_std']:.4f}), "
          f"mean global accuracy {final['global_accuracy_mean']:.4f}; "
          f"by architecture {by_arch}; "
          f"wall time {summary['wall_time_s']:.0f} s; results in {_WORKDIR.value}")
    note = evaluation_note(summary)
    if note:
        print(note)
    if summary["resumed_from_round"]:
        print(f"resumed from the checkpoint of round {summary['resumed_from_round']} in "
              f"{_WORKDIR.value}/checkpoints")
    selected = summary["participation"]["selected"]
    print(f"simulated wall-clock {summary['simulated_time_s']:.1f} s; participation per client "
          f"{min(selected)}-{max(selected)} rounds; report: python -m launch.report "
          f"{_WORKDIR.value}")
    uploads = f"uploads: {final['uploads_rejected_total']} rejected"
    if "upload_bytes_per_client" in final:
        uploads += (f", {final['upload_bytes_per_client']:,.0f} bytes per client per round "
                    "(encoded)")
    if "dp_epsilon" in final:
        relation = summary.get("dp_neighbouring_relation", "").replace("_", "-")
        uploads += (f"; client-level DP ({relation} neighbours): epsilon "
                    f"{final['dp_epsilon']:.2f} at delta {final['dp_delta']:g} (noise multiplier "
                    f"{final['dp_noise_multiplier']:.3f}, clip {final['dp_clip_norm']:g})")
    if "secagg_senders" in final or "secagg_failures" in final:
        uploads += (f"; secure aggregation: {final.get('secagg_senders', 0)} senders, "
                    f"{final.get('secagg_dropped_after_upload', 0)} dropped after upload, "
                    f"{len(final.get('secagg_failures', []))} failed unmaskings in the last round")
    print(uploads)


def console() -> None:
    """`python -m launch.main` from a checkout; `fedjax-pfedes` installed."""
    cli.run(main)


if __name__ == "__main__":
    console()
