"""What a run's rounds read but never change (`RunContext`, built once by `engine.build`), and
the per-client RNG keys a round derives from its key."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from fedjax_pfedes.engine import attacks, client_system
from fedjax_pfedes.engine.cohorts import Cohort
from fedjax_pfedes.engine.sections import RoundSettings
from fedjax_pfedes.upload.plan import UploadPlan

ATTACK_STREAM = 0x5EED_A77  # folded into the round key for the attackers' randomness


@jax.jit
def participant_keys(round_key: jax.Array, ids: jax.Array) -> jax.Array:
    """[slots] RNG keys: `round_key` folded with each slot's client id (one compiled call; an
    eager vmapped fold_in costs milliseconds of dispatch every cohort and round)."""
    return jax.vmap(lambda i: jax.random.fold_in(round_key, i))(ids)


fold_in = jax.jit(jax.random.fold_in)  # the same bits as jax.random.fold_in, one dispatch


@dataclasses.dataclass
class RunContext:
    """What a run's rounds read but never change (built once by `engine.build`)."""

    settings: RoundSettings
    algorithm: Any
    cohorts: list[Cohort]
    server_step: Any
    upload: UploadPlan  # what the rounds need of the upload pipeline
    system: client_system.SystemConfig
    profiles: client_system.ClientProfiles
    client_arch: list[str]       # [N] architecture of every client
    sizes: np.ndarray            # [N] local train samples
    epochs: np.ndarray           # [N] local epochs (adaptive / minimum-samples rule)
    planned_steps: np.ndarray    # [N] local steps without a deadline
    strategy_choices: dict       # arch -> execution.choice.Choice as a dict ('auto' only)
    statically_eligible: np.ndarray  # [N] False below the minimum-samples threshold ('skip')
    strata: np.ndarray           # [N] stratum of every client (stratified sampling)
    label_counts: np.ndarray     # [N, C] local train labels (coverage sampling, monitoring)
    upload_bytes: dict[str, float]    # per architecture, as sent (simulated upload time)
    download_bytes: dict[str, float]  # per architecture
    step_limits: bool            # whether local steps are capped per client (ClientArrays)
    train_key: jax.Array
    upload_key: jax.Array
    attack: attacks.AttackConfig = attacks.AttackConfig()  # simulated malicious clients
    server_metrics: Any = None  # jitted Algorithm.server_metrics, or None

    @property
    def num_clients(self) -> int:
        return len(self.sizes)

    def arch_of(self, clients: np.ndarray) -> list[str]:
        return [self.client_arch[int(c)] for c in clients]
