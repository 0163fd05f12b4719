"""Simulated malicious clients: chosen clients replace their honest upload before sending it.

The attacker trains like everyone else (its private state evolves honestly) and then sends, in
place of its upload u with reference (broadcast) t:

- 'constant': every value = `value` (a crude wild client; 1e4 wrecks a plain mean);
- 'scale': t + value * (u - t), the boosted update of model-replacement attacks (Bhagoji et al.,
  "Analyzing Federated Learning through an Adversarial Lens", ICML 2019; Bagdasaryan et al.,
  "How To Backdoor Federated Learning", AISTATS 2020);
- 'sign_flip': t - value * (u - t), the reversed update (Damaskinos et al., "Asynchronous
  Byzantine Machine Learning", ICML 2018);
- 'gaussian': t + N(0, value^2) per value, the Gaussian Byzantine client of Blanchard et al.,
  "Machine Learning with Adversaries: Byzantine Tolerant Gradient Descent", NeurIPS 2017;
- 'nan': NaN everywhere (a crashing or buggy client rather than an adversary).

It lets a user measure what the upload pipeline's defences (`config.upload.*`) contain; see
docs/threat_model.md. An attacker runs its own code, so none of the pipeline's client-side
stages act on what it sends (`rogue_slots`): without secure aggregation the server still checks
and (under DP) clips every upload it receives, under secure aggregation nothing does.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pfedes.config.defaults import AttackSection
from fedjax_pfedes.errors import ConfigError

KINDS = ("none", "constant", "scale", "sign_flip", "gaussian", "nan")


@dataclasses.dataclass(frozen=True)
class AttackConfig:
    """`config.attack`: which clients attack, how, and the attack's magnitude."""

    clients: tuple[int, ...] = ()  # `config.attack.clients` parsed ('' = none)
    kind: str = AttackSection.kind
    value: float = AttackSection.value

    @property
    def active(self) -> bool:
        return self.kind != "none" and bool(self.clients)


def attack_config(a, num_clients: int) -> AttackConfig:
    """`AttackConfig` from the config's `attack` section (ValueError naming the field for a
    bad value)."""
    if a.kind not in KINDS:
        raise ConfigError(f"config.attack.kind must be one of {KINDS}, got '{a.kind}'")
    try:
        clients = tuple(sorted({int(c) for c in str(a.clients).split(",") if c.strip()}))
    except ValueError:
        raise ConfigError("config.attack.clients must be comma-separated client ids, got "
                         f"'{a.clients}'") from None
    bad = [c for c in clients if not 0 <= c < num_clients]
    if bad:
        raise ConfigError(f"config.attack.clients: ids {bad} are not in [0, {num_clients})")
    if a.kind != "none" and not clients:
        raise ConfigError(f"config.attack.kind='{a.kind}' needs config.attack.clients")
    if not np.isfinite(a.value):
        raise ConfigError(f"config.attack.value must be finite, got {a.value}")
    return AttackConfig(clients, a.kind, float(a.value))


def malicious_upload(upload, template, key: jax.Array, cfg: AttackConfig):
    """What an attacking client sends instead of its honest `upload` (one client's tree)."""
    leaves, treedef = jax.tree.flatten(upload)
    refs = jax.tree.leaves(template)
    keys = jax.random.split(key, len(leaves))
    out = []
    for u, t, k in zip(leaves, refs, keys, strict=True):
        u32, t32 = u.astype(jnp.float32), t.astype(jnp.float32)
        if cfg.kind == "constant":
            x = jnp.full(u.shape, cfg.value, jnp.float32)
        elif cfg.kind == "scale":
            x = t32 + cfg.value * (u32 - t32)
        elif cfg.kind == "sign_flip":
            x = t32 - cfg.value * (u32 - t32)
        elif cfg.kind == "gaussian":
            x = t32 + cfg.value * jax.random.normal(k, u.shape, jnp.float32)
        elif cfg.kind == "nan":
            x = jnp.full(u.shape, jnp.nan, jnp.float32)
        else:
            raise ConfigError(f"config.attack.kind must be one of {KINDS}, got '{cfg.kind}'")
        out.append(x.astype(u.dtype))
    return jax.tree.unflatten(treedef, out)


def rogue_slots(client_ids: np.ndarray, cfg: AttackConfig) -> np.ndarray | None:
    """[slots] whether each slot's client attacks (None when nobody does). An attacker runs its
    own code: the upload pipeline skips its client-side stages (clipping, compression, the
    range check before masking, its share of the DP noise), and only what the server enforces
    on what it receives applies to it."""
    if not cfg.active:
        return None
    return np.isin(np.asarray(client_ids), cfg.clients)


def apply(stacked, template, client_ids: np.ndarray, key: jax.Array, cfg: AttackConfig):
    """`stacked` uploads [slots, ...] with the attackers' rows replaced (ids -1 = padding)."""
    if not cfg.active:
        return stacked
    rows = np.flatnonzero(np.isin(client_ids, cfg.clients))
    for j in rows.tolist():
        bad = malicious_upload(jax.tree.map(lambda a, j=j: a[j], stacked), template,
                               jax.random.fold_in(key, int(client_ids[j])), cfg)
        stacked = jax.tree.map(lambda a, b, j=j: a.at[j].set(b), stacked, bad)
    return stacked
