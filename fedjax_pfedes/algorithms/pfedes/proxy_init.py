"""Saved E_proxy parameters: the file `launch.pretrain_proxy` writes and `config.proxy_init` reads.

One msgpack file (flax.serialization) holding {"meta": ..., "params": E_proxy's state dict}. The
metadata says what the parameters are (proxy architecture, d, input shape) and what they were
trained on (dataset, public fraction, seed), so that a run can refuse a file that does not fit
its E_proxy, or that was pretrained on samples its own clients hold.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
from flax import serialization

from fedjax_pfedes.errors import ConfigError

SEED = "{seed}"  # in a path: replaced by the run's config.seed


def resolve(path: str, seed: int) -> str:
    """`path` with `{seed}` replaced by `seed`: one config value names a per-seed file, as the
    public share (and so a pretrained E_proxy) depends on the run's seed."""
    return path.replace(SEED, str(seed))


def save(path: str, params: Any, meta: dict) -> None:
    """Writes `params` (a pytree of arrays) and `meta` (JSON-like) to `path` atomically."""
    state = serialization.to_state_dict(jax.tree.map(np.asarray, params))
    payload = serialization.msgpack_serialize({"meta": meta, "params": state})
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(payload)
    os.replace(tmp, path)


def read(path: str) -> tuple[dict, dict]:
    """(meta, params state dict) of a saved file; ValueError naming `config.proxy_init` and
    the path when it is missing or not such a file."""
    if not os.path.isfile(path):
        raise ConfigError(f"config.proxy_init: no file at '{path}' (write one with "
                         "python -m launch.pretrain_proxy)")
    try:
        with open(path, "rb") as f:
            restored = serialization.msgpack_restore(f.read())
        return dict(restored["meta"]), restored["params"]
    except Exception as e:  # noqa: BLE001 - any decoding failure: the file is not ours
        raise ConfigError(f"config.proxy_init: '{path}' is not a saved E_proxy "
                         f"({type(e).__name__})") from None


def _paths(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_paths(v, f"{prefix}/{k}" if prefix else str(k)))
        return out
    return {prefix: tree}


def load(path: str, template: Any) -> Any:
    """The saved parameters as a tree like `template` (E_proxy's freshly initialized
    parameters); ValueError naming the first leaf whose path, shape or dtype differs."""
    meta, state = read(path)
    want = _paths(serialization.to_state_dict(template))
    have = _paths(state)
    where = f"config.proxy_init: '{path}' (E_proxy '{meta.get('proxy_arch')}', " \
            f"d={meta.get('proxy_dim')})"
    for leaf in sorted(set(want) | set(have)):
        if leaf not in have:
            raise ConfigError(f"{where} lacks parameter {leaf} of this run's E_proxy")
        if leaf not in want:
            raise ConfigError(f"{where} has parameter {leaf}, which this run's E_proxy lacks")
        a, b = np.asarray(have[leaf]), want[leaf]
        if a.shape != tuple(b.shape):
            raise ConfigError(f"{where}: parameter {leaf} has shape {a.shape}, this run's "
                             f"E_proxy needs {tuple(b.shape)}")
        if not np.all(np.isfinite(a)):
            raise ConfigError(f"{where}: parameter {leaf} has non-finite values")
    return serialization.from_state_dict(template, jax.tree.map(
        lambda a, t: np.asarray(a, dtype=t.dtype), state, serialization.to_state_dict(template)))
