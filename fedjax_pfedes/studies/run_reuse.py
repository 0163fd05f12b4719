"""Which finished run a config may reuse: a comparison that is resumed, extended to more seeds
or re-reported (`--report_only`) takes a run folder's summary.json when it was made with the
same config, up to the fields that never change a run's numbers.
"""

from __future__ import annotations

import json
import os
from typing import Any

import ml_collections

from fedjax_pfedes.engine.schema import default_values


def same_config(old: Any, new: Any, default: Any) -> bool:
    """Whether a finished run's config `old` is `new`: every field equal, except a field `old`
    lacks (added to the code after the run was made) whose value in `new` is its shipped
    default (`default`, fedjax_pfedes/config/defaults.py): new fields default to the old
    behaviour."""
    if isinstance(old, dict) and isinstance(new, dict):
        default = default if isinstance(default, dict) else {}
        for key, value in new.items():
            if key not in old:
                if key not in default or default[key] != value:
                    return False
            elif not same_config(old[key], value, default.get(key)):
                return False
        return set(old) <= set(new)
    return old == new


# Fields that change what a run reports or keeps, or how fast it runs, never its numbers:
# ignored when a finished run is matched for reuse (`loop_threads`: bit-identical numbers;
# `scan_held_uploads`, retired, decided only whether a round could stop: archives carry it;
# `global_every`: which evaluations score the global test set, the final one always).
RESULT_NEUTRAL = (("train", "allow_divergence"), ("train", "allow_untrained"),
                  ("monitor", "tensorboard"), ("eval", "global_every"),
                  ("checkpoint", "every"), ("checkpoint", "max_to_keep"),
                  ("execution", "compilation_cache_dir"), ("execution", "loop_threads"),
                  ("execution", "scan_held_uploads"))


# The plateau stop's settings: neutral in a run made without `train.stop_at_plateau`.
PLATEAU_FIELDS = ("plateau_window", "plateau_tolerance", "plateau_min_evaluations")


# Fields whose value 'auto' matches a finished run of any value: every execution strategy and
# kernel set computes the same numbers up to float reassociation, and 'auto' may pick any of
# them (`execution.choice`), so a run made with an explicit one is an 'auto' run's result too.
AUTO_MATCHES_ANY = (("execution", "strategy"), ("execution", "cpu_kernels"))


def _without_neutral(config: dict | None, auto_in: dict | None = None) -> dict | None:
    """`config` without the `RESULT_NEUTRAL` fields, nor the `AUTO_MATCHES_ANY` fields that
    are 'auto' in `auto_in` (the config a finished run is matched against)."""
    if not isinstance(config, dict):
        return config
    out = json.loads(json.dumps(config))
    auto_in = auto_in if isinstance(auto_in, dict) else {}
    dropped = RESULT_NEUTRAL + tuple(
        (section, field) for section, field in AUTO_MATCHES_ANY
        if isinstance(auto_in.get(section), dict) and auto_in[section].get(field) == "auto")
    for section, field in dropped:
        if isinstance(out.get(section), dict):
            out[section].pop(field, None)
    train = out.get("train")
    if isinstance(train, dict) and not train.get("stop_at_plateau"):
        for field in PLATEAU_FIELDS:  # the stop's settings, which a run without it never reads
            train.pop(field, None)
    return out


def finished_run(config: ml_collections.ConfigDict, run_dir: str) -> dict | None:
    """The summary of a finished run in `run_dir` made with `config` (`same_config`), else
    None."""
    path = os.path.join(run_dir, "summary.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        summary = json.load(f)
    normalized = json.loads(json.dumps(config.to_dict()))
    same = same_config(_without_neutral(summary.get("config"), normalized),
                       _without_neutral(normalized, normalized),
                       _without_neutral(default_values(), normalized))
    return summary if same else None
