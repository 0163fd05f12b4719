"""Buffered asynchronous aggregation (FedBuff; Nguyen et al., "Federated Learning with Buffered
Asynchronous Aggregation", AISTATS 2022), driven by the simulated clock of
`fedjax_pfedes.engine.client_system`.

`concurrency` clients train at any time, each from the server version current when it started.
Their updates arrive after their simulated download + compute + upload time. The server waits for
the next `buffer_size` (K) arrivals, then steps once (one "round" of the simulator) with

    upload_i' = x_now + s(tau_i) * (y_i - x_start_i),     tau_i = version_now - version_start_i

so the algorithm's weighted mean of the K rebased uploads moves x by sum_i w_i s(tau_i) Delta_i /
sum_i w_i (FedBuff's buffered, staleness-weighted update; the algorithm's own server step, e.g.
pFedES's momentum or FedAdam, is applied on top). The freed slots start new clients at once.
Staleness functions s(tau) (Xie et al., "Asynchronous Federated Optimization", 2019):
constant 1; polynomial (1 + tau)^-a (FedBuff uses a = 0.5); hinge 1 if tau <= b else
1 / (a (tau - b) + 1).

Clients that drop out never arrive and free their slot; the sampler weighs them down as in the
synchronous mode. The in-flight updates are part of the checkpoint.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pfedes.config.defaults import STALENESS
from fedjax_pfedes.engine import client_system, context, records, rounds, sampling
from fedjax_pfedes.engine.state import SimState
from fedjax_pfedes.errors import ConfigError
from fedjax_pfedes.upload import validation


def staleness_weight(tau: np.ndarray, kind: str, exponent: float = 0.5, hinge_a: float = 10.0,
                     hinge_b: float = 4.0) -> np.ndarray:
    """s(tau) for staleness tau >= 0 (server versions between a client's start and arrival)."""
    tau = np.asarray(tau, np.float64)
    if kind == "constant":
        return np.ones_like(tau)
    if kind == "polynomial":
        return (1.0 + tau) ** -exponent
    if kind == "hinge":
        return np.where(tau <= hinge_b, 1.0, 1.0 / (hinge_a * (tau - hinge_b) + 1.0))
    raise ConfigError(f"config.asynchronous.staleness: unknown '{kind}'; known: {list(STALENESS)}")


def rebase(deltas, template, factors: jax.Array):
    """template + factor_i * delta_i per slot, in the template's dtypes."""
    return jax.tree.map(
        lambda d, t: (t.astype(jnp.float32)[None]
                      + factors.reshape((-1,) + (1,) * t.ndim) * d).astype(t.dtype),
        deltas, template)


@dataclasses.dataclass
class InFlight:
    """Clients training now, one per slot (saved in checkpoints).

    `client [C]` (-1 = free slot), `start_version [C]`, `arrival_s [C]` (simulated time the
    update reaches the server), and per architecture the stacked updates
    `deltas[arch] [C, ...]` (y_i - x_start_i; rows of other architectures' clients are unused).
    """

    client: np.ndarray
    start_version: np.ndarray
    arrival_s: np.ndarray
    timing: np.ndarray            # [C, 4] download, compute, upload, total seconds
    steps: np.ndarray             # [C] local steps run
    train_loss: np.ndarray        # [C] the client's mean local training CE
    deltas: dict[str, Any]

    @classmethod
    def create(cls, concurrency: int, templates: dict[str, Any]) -> InFlight:
        return cls(np.full(concurrency, -1, np.int64), np.zeros(concurrency, np.int64),
                   np.zeros(concurrency, np.float64), np.zeros((concurrency, 4), np.float64),
                   np.zeros(concurrency, np.int64), np.zeros(concurrency, np.float64),
                   {a: jax.tree.map(lambda t: jnp.zeros((concurrency, *jnp.shape(t)),
                                                        jnp.float32), tmpl)
                    for a, tmpl in templates.items()})

    def arrays(self) -> dict[str, Any]:
        """The fields as a dict (shallow: the device buffers are not copied)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def next_arrivals(in_flight: InFlight, buffer_size: int) -> np.ndarray:
    """Slots of the (up to) K earliest arrivals, in arrival order (ties by slot)."""
    busy = np.flatnonzero(in_flight.client >= 0)
    order = busy[np.lexsort((busy, in_flight.arrival_s[busy]))]
    return order[:buffer_size]


def launch(ctx: context.RunContext, server_state, clients: dict[str, Any], in_flight: InFlight,
           sampler: sampling.SamplerState, round_index: int, clock_s: float
           ) -> tuple[dict[str, Any], client_system.RoundTiming, records.Trained, dict[str, Any]]:
    """Fills the free slots: selects clients not in flight, trains them from the current server
    state (their private states change now: the new `clients` is returned) and parks their
    updates in `in_flight` until they arrive."""
    free = np.flatnonzero(in_flight.client < 0)
    busy = np.zeros(ctx.num_clients, bool)
    busy[in_flight.client[in_flight.client >= 0]] = True
    selected, counts = rounds.select_clients(ctx, sampler, round_index, excluded=busy,
                                             count=len(free))
    timing = rounds.simulate_selected(ctx, round_index, selected)
    runs = timing.clients[timing.trains]
    limits = dict(zip(runs.tolist(), timing.step_limit[timing.trains].tolist(), strict=True))
    trained, clients = rounds.train_participants(ctx, server_state, clients, runs,
                                                 context.fold_in(ctx.train_key, round_index),
                                                 limits)
    sampler.record_selected(selected)  # drop-outs never deliver: their streak grows now
    sampler.record_outcome(np.zeros(0, np.int64), np.setdiff1d(selected, runs))
    position = {int(c): k for k, c in enumerate(timing.clients)}
    for slot, cid in zip(free, runs.tolist(), strict=False):
        k = position[cid]
        arch = ctx.client_arch[cid]
        c = trained.uploads[arch]
        j = int(np.flatnonzero(c.client_ids == cid)[0])
        row = jax.tree.map(lambda u, t, j=j: u[j].astype(jnp.float32) - t.astype(jnp.float32),
                           c.uploads, c.template)
        in_flight.deltas[arch] = jax.tree.map(lambda buf, r, slot=slot: buf.at[slot].set(r),
                                              in_flight.deltas[arch], row)
        in_flight.client[slot] = cid
        in_flight.start_version[slot] = round_index
        in_flight.arrival_s[slot] = clock_s + timing.total_s[k]
        in_flight.timing[slot] = (timing.download_s[k], timing.compute_s[k], timing.upload_s[k],
                                  timing.total_s[k])
        metrics = trained.client_metrics[cid]
        in_flight.steps[slot] = metrics.get("local_steps", timing.step_limit[k])
        in_flight.train_loss[slot] = metrics.get("train_ce_loss", np.nan)
    return counts, timing, trained, clients


def async_round(ctx: context.RunContext, state: SimState, round_index: int
                ) -> tuple[SimState, dict[str, Any], list[dict], list[dict]]:
    """One server step of FedBuff: (new state, record, client rows, rejections). `state` itself
    is not changed (its device buffers may be donated: use the returned state)."""
    a = ctx.settings.asynchronous
    state = state.with_host_copies()
    server_state, in_flight = state.server, state.in_flight
    sampler, clock_s = state.sampler, state.clock_s
    counts, launch_timing, launched, clients = launch(ctx, server_state, state.clients, in_flight,
                                                      sampler, round_index, clock_s)
    slots = next_arrivals(in_flight, a.buffer_size)
    arrivals = in_flight.client[slots]
    new_clock = float(max(clock_s, in_flight.arrival_s[slots].max())) if len(slots) else clock_s
    tau = round_index - in_flight.start_version[slots]
    factors = staleness_weight(tau, a.staleness, a.staleness_exponent, a.hinge_a, a.hinge_b)
    uploads = {cohort.arch: _rebased_uploads(ctx, cohort, server_state, in_flight, slots,
                                             arrivals, factors)
               for cohort in ctx.cohorts}
    norms = _stored_norms(in_flight, ctx, slots, arrivals)
    arrived = records.Trained(uploads, records.ClientMetrics(
        np.asarray(arrivals, np.int64),
        {"train_ce_loss": np.asarray(in_flight.train_loss[slots], np.float64),
         "local_steps": np.asarray(in_flight.steps[slots], np.float64),
         records.UPLOAD_NORM: np.asarray(factors * norms, np.float64)}), launched.traffic)
    sampler.record_outcome(arrivals, np.zeros(0, np.int64))
    timing = client_system.RoundTiming(
        arrivals, np.full(len(slots), client_system.DELIVERED), in_flight.steps[slots],
        in_flight.timing[slots, 0], in_flight.timing[slots, 1], in_flight.timing[slots, 2],
        in_flight.timing[slots, 3], new_clock - clock_s)
    staleness = dict(zip(arrivals.tolist(), tau.tolist(), strict=True))
    in_flight.client[slots] = -1
    dropped = int((launch_timing.status == client_system.DROPPED_OUT).sum())

    def head(accepted: int) -> dict[str, Any]:
        return {**counts, "dropped_out": dropped, "participants": len(slots),
                "uploads_accepted": accepted,
                "upload_success_rate": accepted / len(slots) if len(slots) else None}

    def client_rows(rejected: set[int]) -> list[dict]:
        return records.client_report(ctx, timing, arrived, rejected, staleness) + [
            row for row in records.client_report(
                ctx, launch_timing, records.Trained({}, records.ClientMetrics.empty(), []), set())
            if row["status"] == client_system.DROPPED_OUT]

    return rounds.conclude(
        ctx, state, round_index, arrived, clients, head=head, rows=client_rows,
        padded=launched.padded_step_fraction(),  # of this step's launches
        tail={"simulated_round_s": new_clock - clock_s,
              "staleness_mean": float(tau.mean()) if len(tau) else 0.0,
              "staleness_max": int(tau.max()) if len(tau) else 0,
              "in_flight": int((in_flight.client >= 0).sum())},
        clock_s=new_clock)


def _rebased_uploads(ctx: context.RunContext, cohort, server_state, in_flight: InFlight,
                     slots: np.ndarray, arrivals: np.ndarray, factors: np.ndarray):
    """What the upload pipeline gets of one cohort's arrivals: their buffered updates rebased
    on the current server state with their staleness factors (`rebase`), in the cohort's
    bucket of at most `buffer_size` slots."""
    template = ctx.algorithm.upload_template(server_state, cohort.arch)
    mine = np.flatnonzero(np.isin(arrivals, cohort.client_ids))
    bucket = min(len(cohort.client_ids), ctx.settings.asynchronous.buffer_size)
    rows = np.zeros(bucket, np.int64)
    rows[: len(mine)] = slots[mine]
    f = np.zeros(bucket, np.float32)
    f[: len(mine)] = factors[mine]
    valid = np.arange(bucket) < len(mine)
    ids = np.where(valid, np.pad(arrivals[mine], (0, bucket - len(mine))), -1)
    local = np.array([np.flatnonzero(cohort.client_ids == c)[0] if c >= 0
                      else len(cohort.client_ids) for c in ids], np.int32)
    take = jnp.asarray(rows)
    deltas = jax.tree.map(lambda buf: buf[take], in_flight.deltas[cohort.arch])
    stacked = rebase(deltas, template, jnp.asarray(f))
    return rounds.cohort_uploads(ctx, cohort, stacked, template, local, valid, ids)


def _stored_norms(in_flight: InFlight, ctx: context.RunContext, slots: np.ndarray,
                  clients: np.ndarray) -> np.ndarray:
    """L2 norm of each parked update (y_i - x_start_i) in `slots`."""
    norms = np.zeros(len(slots))
    for arch, deltas in in_flight.deltas.items():
        mine = np.flatnonzero([ctx.client_arch[int(c)] == arch for c in clients])
        if len(mine):
            take = jnp.asarray(slots[mine])
            norms[mine] = np.asarray(validation.update_norms(
                jax.tree.map(lambda b, take=take: b[take], deltas)))
    return norms
