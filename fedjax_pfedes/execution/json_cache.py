"""The small JSON files the execution layer keeps beside the compilation cache (decisions,
machine rates): read tolerantly, written atomically. They are optimizations: a damaged file
reads as empty and a folder that cannot be written keeps nothing, so either costs a measurement
next time, never a failed run."""

from __future__ import annotations

import json
import os


def read(path: str | None) -> dict:
    """The JSON object at `path`; {} when there is none, it is damaged or not an object."""
    if not path or not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def write(path: str, data: dict) -> None:
    """Writes `data` to `path` (creating its folder) through a temporary file and a rename; an
    OSError (a read-only or full disk) is ignored."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        try:
            os.remove(tmp)
        except OSError:
            pass
