"""The whole default config: the core fields and every registered method's own fields.

`config/defaults.py` declares the fields every run has; each method declares its own in its
module (`AlgorithmEntry.fields`: pFedES's top-level `lam`, `proxy_arch`, ...; `fedprox.mu`,
...), and so may an upload stage (`UploadStage.fields`). `default_config` joins them, so a new
method or stage brings its fields with it.
"""

from __future__ import annotations

import json

import ml_collections

from fedjax_pfedes.algorithms import registry as algorithm_registry
from fedjax_pfedes.config.defaults import core_config
from fedjax_pfedes.errors import ConfigError
from fedjax_pfedes.upload import stages


def default_config() -> ml_collections.ConfigDict:
    """The default config (a new, mutable ConfigDict each call): the quick start.

    Returns:
      Every field the simulator reads, at its default: the core fields
      (`config.defaults.core_config`), every registered method's and upload stage's `fields`.
    """
    config = core_config()
    declared = {**algorithm_registry.declared_fields(), **stages.declared_fields()}
    for path, default in declared.items():
        node = config
        *parents, leaf = path.split(".")
        for part in parents:
            if part not in node:
                node[part] = ml_collections.ConfigDict()
            node = node[part]
        if leaf in node:
            raise ConfigError(f"config.{path}: a method or an upload stage declares a field "
                             "the core config (or another of them) has")
        node[leaf] = default
    return config


def default_values() -> dict:
    """The defaults as plain JSON values. A field an older run's config lacks was added to the
    code later, and at its default it keeps the old behaviour (reuse and resume read this).

    Returns:
      A nested dict of the default config.
    """
    return json.loads(json.dumps(default_config().to_dict()))
