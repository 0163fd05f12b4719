"""The simulation state: everything a run carries from one round to the next, in one value.

Round functions (`rounds.sync_round`, `asynchronous.async_round`) take a `SimState` and return a
new one; nothing else changes between rounds (the `RunContext` is read-only, and every random
draw is keyed by (seed, round)). A checkpoint is `to_checkpoint()` of it, saved as one pytree
by orbax, and a resume is `from_checkpoint` of what was restored.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from fedjax_pfedes.engine.sampling import SamplerState

PyTree = Any


@dataclasses.dataclass(frozen=True)
class SimState:
    """Attributes:
      server: the algorithm's server state.
      clients: architecture -> the cohort's private client states, stacked over its members.
      memories: architecture -> {upload stage name: its per-client state stacked over the
        cohort's members} (`UploadStage.init_state`; e.g. top-k's error-feedback memory; empty
        when no stage keeps state).
      sampler: participation history (selections, deliveries, failure streaks, quotas).
      dp_sgd_steps: [N] local DP-SGD steps each client has released (its accountant's input).
      clock_s: the simulated wall clock.
      in_flight: buffered asynchronous rounds only: the clients still training and their parked
        updates (`asynchronous.InFlight`); None for synchronous rounds.
      history: the evaluated rounds' records so far (host side; a checkpoint keeps it in its
        JSON meta, next to the arrays of `to_checkpoint`).
      dp_noise_multipliers: under client-level DP, per round so far the noise multiplier the
        released aggregate really carried (None: nothing released); the accountant composes
        these (`UploadPlan.privacy_metrics`). Empty without DP. Host side, kept in the
        checkpoint's JSON meta like `history`.
    """

    server: PyTree
    clients: dict[str, PyTree]
    memories: dict[str, PyTree]
    sampler: SamplerState
    dp_sgd_steps: np.ndarray
    clock_s: float
    in_flight: Any = None
    history: tuple[dict[str, Any], ...] = ()
    dp_noise_multipliers: tuple[float | None, ...] = ()

    def replace(self, **changes) -> SimState:
        return dataclasses.replace(self, **changes)

    def with_host_copies(self) -> SimState:
        """A state whose host-side (numpy) parts are copies, so a round may update them in place
        without touching `self`."""
        sampler = SamplerState(**{k: np.array(v) for k, v in self.sampler.arrays().items()})
        in_flight = None
        if self.in_flight is not None:
            fields = self.in_flight.arrays()
            in_flight = type(self.in_flight)(**{
                k: (dict(v) if k == "deltas" else np.array(v)) for k, v in fields.items()})
        return self.replace(sampler=sampler, dp_sgd_steps=np.array(self.dp_sgd_steps),
                            in_flight=in_flight)

    def to_checkpoint(self) -> dict[str, Any]:
        """The state as the pytree of arrays a checkpoint holds."""
        out = {"server": self.server, "clients": self.clients, "memories": self.memories,
               "sampler": self.sampler.arrays(), "dp_sgd_steps": self.dp_sgd_steps,
               "clock_s": np.asarray(self.clock_s, np.float64)}
        if self.in_flight is not None:
            out["in_flight"] = self.in_flight.arrays()
        return out

    def with_round_noise(self, round_index: int, realized: float | None) -> SimState:
        """The state with round `round_index`'s released noise multiplier recorded."""
        kept = self.dp_noise_multipliers[:round_index]
        return self.replace(dp_noise_multipliers=(
            *kept, *([None] * (round_index - len(kept))), realized))

    def from_checkpoint(self, restored: dict[str, Any], history=(),
                        dp_noise_multipliers=()) -> SimState:
        """The state restored from `restored` (a checkpoint of a state shaped like `self`), the
        checkpoint's evaluated `history` and its rounds' DP noise multipliers."""
        in_flight = None
        if self.in_flight is not None:
            in_flight = type(self.in_flight)(**{
                k: (v if k == "deltas" else np.array(v))
                for k, v in restored["in_flight"].items()})
        return SimState(
            server=restored["server"], clients=restored["clients"],
            memories=restored["memories"],
            sampler=SamplerState(**{k: np.array(v) for k, v in restored["sampler"].items()}),
            dp_sgd_steps=np.array(restored["dp_sgd_steps"]),
            clock_s=float(restored["clock_s"]), in_flight=in_flight, history=tuple(history),
            dp_noise_multipliers=tuple(dp_noise_multipliers))
