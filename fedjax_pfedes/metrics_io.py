"""Where metrics go: `<workdir>/metrics.jsonl` (one object per evaluated round) and summary.json."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np


def to_builtin(value: Any) -> Any:
    """Converts numpy/jax scalars and arrays to JSON-serializable Python values."""
    if isinstance(value, dict):
        return {k: to_builtin(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_builtin(v) for v in value]
    if hasattr(value, "tolist"):
        return np.asarray(value).tolist()
    return value


class MetricsWriter:
    """Appends one JSON object per line to `<workdir>/metrics.jsonl`."""

    def __init__(self, workdir: str):
        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(workdir, "metrics.jsonl")
        open(self.path, "w").close()

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(to_builtin(record)) + "\n")


def write_json(path: str, obj: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(to_builtin(obj), f, indent=2)
