"""System heterogeneity: who is online, who drops out, and how long each client takes.

Real federations lose clients every round (Bonawitz et al., "Towards Federated Learning at Scale:
System Design", MLSys 2019): devices go offline, drop out
after being selected, or are too slow for the round's deadline. This module simulates that on the
host, deterministically from (seed, round), so a resumed run sees the same events:

* availability: client i is online in a round with probability p_i (one value, or classes such as
  '0.9,0.5' given to clients in equal shares at random); with `availability_period` > 0 a client
  is only reachable in a window of `availability_duty * period` rounds per period (a day/night
  cycle with a random phase per client).
* drop-out: a selected client fails before uploading with probability `dropout`.
* speed classes: step time = `step_time_s` x class multiplier (e.g. '1,2,4'), times a per-round
  log-normal jitter; upload / download time = bytes / bandwidth of the client's class.
* deadline: clients whose simulated time exceeds `deadline_s` are dropped (policy 'drop', as in
  FedAvg with a time-out) or contribute the local steps they finished in time (policy 'partial',
  FedNova-style normalization then handles the unequal step counts; Wang et al. 2020).
"""

from __future__ import annotations

import dataclasses

import ml_collections
import numpy as np

from fedjax_pfedes.config import fields
from fedjax_pfedes.config.runtime_sections import SystemSection, float_list

# Per-client outcome of a round (values of `RoundTiming.status`).
DELIVERED, PARTIAL, DROPPED_OUT, PAST_DEADLINE = "delivered", "partial", "dropped_out", "deadline"


def _parsed(field: str) -> tuple[float, ...]:
    return float_list(getattr(SystemSection, field), f"config.system.{field}")


@dataclasses.dataclass(frozen=True)
class SystemConfig:
    """`config.system` (docs/guide/clients.md) with its comma-separated lists parsed; every
    default and range is the section's (`SystemSection`)."""

    availability: tuple[float, ...] = _parsed("availability")
    availability_period: int = SystemSection.availability_period
    availability_duty: float = SystemSection.availability_duty
    dropout: float = SystemSection.dropout
    speed_classes: tuple[float, ...] = _parsed("speed_classes")
    step_time_s: float = SystemSection.step_time_s
    time_jitter: float = SystemSection.time_jitter
    upload_mbps: tuple[float, ...] = _parsed("upload_mbps")
    download_mbps: tuple[float, ...] = _parsed("download_mbps")
    deadline_s: float = SystemSection.deadline_s
    deadline_policy: str = SystemSection.deadline_policy
    failure_decay: float = SystemSection.failure_decay

    @property
    def all_reliable(self) -> bool:
        """No client is ever offline, dropped or late: sampling is unchanged."""
        return (min(self.availability) >= 1.0 and self.availability_period == 0
                and self.dropout == 0 and self.deadline_s == 0)


def system_config(section: SystemSection | ml_collections.ConfigDict) -> SystemConfig:
    """`SystemConfig` from the config's `system` section.

    Args:
      section: the built section (`ValidConfig.sections['system']`), or the config's
        `config.system` (built here: its ranges checked, a ConfigError naming the field).

    Returns:
      The section with its lists parsed.
    """
    if not isinstance(section, SystemSection):
        section = fields.build(SystemSection, section.to_dict())
    values = dataclasses.asdict(section)
    values.update({f: float_list(values[f], f"config.system.{f}") for f in SystemSection.LISTS})
    return SystemConfig(**values)


@dataclasses.dataclass(frozen=True)
class ClientProfiles:
    """Fixed per-client system properties (drawn once from the seed)."""

    speed_class: np.ndarray   # [N] index into SystemConfig.speed_classes
    step_time_s: np.ndarray   # [N] seconds per local step before jitter
    upload_Bps: np.ndarray    # [N] bytes per second
    download_Bps: np.ndarray  # [N]
    availability: np.ndarray  # [N] probability of being online in an active window
    availability_class: np.ndarray  # [N] index into SystemConfig.availability
    phase: np.ndarray         # [N] offset of the client's availability window (rounds)


def _equal_shares(rng: np.random.Generator, num_clients: int, num_classes: int) -> np.ndarray:
    """Class per client: equal shares (round-robin), shuffled."""
    return rng.permutation(np.arange(num_clients) % num_classes)


def client_profiles(cfg: SystemConfig, num_clients: int, seed: int) -> ClientProfiles:
    rng = np.random.default_rng([seed, 101])
    speed = _equal_shares(rng, num_clients, len(cfg.speed_classes))
    avail_class = _equal_shares(rng, num_clients, len(cfg.availability))
    phase = rng.integers(0, max(cfg.availability_period, 1), num_clients)
    per_class = lambda v: np.asarray(v if len(v) > 1 else v * len(cfg.speed_classes))  # noqa: E731
    mbps_to_Bps = 1e6 / 8
    return ClientProfiles(
        speed_class=speed,
        step_time_s=cfg.step_time_s * np.asarray(cfg.speed_classes)[speed],
        upload_Bps=per_class(cfg.upload_mbps)[speed] * mbps_to_Bps,
        download_Bps=per_class(cfg.download_mbps)[speed] * mbps_to_Bps,
        availability=np.asarray(cfg.availability)[avail_class],
        availability_class=avail_class, phase=phase)


def online_mask(cfg: SystemConfig, profiles: ClientProfiles, seed: int, round_index: int
                ) -> np.ndarray:
    """[N] bool: which clients can be reached in this round."""
    n = len(profiles.availability)
    if min(cfg.availability) >= 1 and cfg.availability_period == 0:
        return np.ones(n, bool)
    online = np.random.default_rng([seed, round_index, 102]).random(n) < profiles.availability
    if cfg.availability_period > 0:
        window = max(1, int(round(cfg.availability_duty * cfg.availability_period)))
        online &= (round_index + profiles.phase) % cfg.availability_period < window
    return online


@dataclasses.dataclass(frozen=True)
class RoundTiming:
    """Simulated times and outcomes of one round's selected clients (aligned with `clients`)."""

    clients: np.ndarray       # [k] global ids, as selected
    status: np.ndarray        # [k] DELIVERED | PARTIAL | DROPPED_OUT | PAST_DEADLINE
    step_limit: np.ndarray    # [k] local steps the client runs (0 = does not run)
    download_s: np.ndarray
    compute_s: np.ndarray
    upload_s: np.ndarray
    total_s: np.ndarray       # [k] download + compute + upload (time of the upload's arrival)
    round_s: float            # server's wall-clock for the round

    @property
    def trains(self) -> np.ndarray:
        """[k] bool: clients whose update reaches the server."""
        return np.isin(self.status, (DELIVERED, PARTIAL))


def step_times(profiles: ClientProfiles, cfg: SystemConfig, seed: int, round_index: int,
               clients: np.ndarray) -> np.ndarray:
    """Seconds per local step of `clients` in this round (class speed x log-normal jitter)."""
    base = profiles.step_time_s[clients]
    if cfg.time_jitter == 0:
        return base
    z = np.random.default_rng([seed, round_index, 103]).standard_normal(len(profiles.phase))
    return base * np.exp(cfg.time_jitter * z[clients])


def simulate_round(cfg: SystemConfig, profiles: ClientProfiles, seed: int, round_index: int,
                   clients: np.ndarray, planned_steps: np.ndarray, upload_bytes: np.ndarray,
                   download_bytes: np.ndarray) -> RoundTiming:
    """Drop-outs, simulated times and the deadline for the selected `clients`.

    Args:
      clients: [k] selected global ids.
      planned_steps: [k] local steps each would run without a deadline.
      upload_bytes: [k] bytes each sends.
      download_bytes: [k] bytes each receives.
    """
    clients = np.asarray(clients, np.int64)
    n = len(profiles.phase)
    dropped = np.random.default_rng([seed, round_index, 104]).random(n)[clients] < cfg.dropout
    step_s = step_times(profiles, cfg, seed, round_index, clients)
    down = np.asarray(download_bytes, np.float64) / profiles.download_Bps[clients]
    up = np.asarray(upload_bytes, np.float64) / profiles.upload_Bps[clients]
    steps = np.asarray(planned_steps, np.int64).copy()
    total = down + steps * step_s + up
    status = np.where(dropped, DROPPED_OUT, DELIVERED).astype(object)
    if cfg.deadline_s > 0:
        late = ~dropped & (total > cfg.deadline_s)
        if cfg.deadline_policy == "partial":
            fits = np.floor((cfg.deadline_s - down - up) / step_s).astype(np.int64)
            partial = late & (fits >= 1)
            steps = np.where(partial, np.minimum(fits, steps), steps)
            status[partial] = PARTIAL
            late &= ~partial
        status[late] = PAST_DEADLINE
    runs = np.isin(status, (DELIVERED, PARTIAL))
    steps = np.where(runs, steps, 0)
    compute = steps * step_s
    total = np.where(runs, down + compute + up, total)
    round_s = float(total[runs].max()) if runs.any() else 0.0
    if cfg.deadline_s > 0 and (status == PAST_DEADLINE).any():
        round_s = cfg.deadline_s  # the server waited until the deadline
    return RoundTiming(clients, status.astype(str), steps, down, compute, up, total, round_s)
