"""The whole default config: the core fields and every registered method's own fields.

`config/defaults.py` declares the fields every run has; each method declares its own in its
module (`AlgorithmEntry.fields`: pFedES's top-level `lam`, `proxy_arch`, ...; `fedprox.mu`,
...). `default_config` joins them, so a new method brings its fields with it.
"""

from __future__ import annotations

import json

import ml_collections

from fedjax_pfedes.algorithms import registry as algorithm_registry
from fedjax_pfedes.config.defaults import core_config


def default_config() -> ml_collections.ConfigDict:
    """The default config (a new, mutable ConfigDict each call): the quick start.

    Returns:
      Every field the simulator reads, at its default: the core fields
      (`config.defaults.core_config`) and every registered method's `fields`.
    """
    config = core_config()
    for path, default in algorithm_registry.declared_fields().items():
        node = config
        *parents, leaf = path.split(".")
        for part in parents:
            if part not in node:
                node[part] = ml_collections.ConfigDict()
            node = node[part]
        if leaf in node:
            raise ValueError(f"config.{path}: a method declares a field the core config has")
        node[leaf] = default
    return config


def default_values() -> dict:
    """The defaults as plain JSON values. A field an older run's config lacks was added to the
    code later, and at its default it keeps the old behaviour (reuse and resume read this).

    Returns:
      A nested dict of the default config.
    """
    return json.loads(json.dumps(default_config().to_dict()))
