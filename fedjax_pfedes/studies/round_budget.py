"""Round-time budget : per-stage time of a round before anyone trains.

    download      = broadcast bytes / downlink bandwidth
    local compute = local steps (epochs x ceil(n / B)) x simulated step time of the speed class
    upload        = bytes as sent (after compression; dense ring elements under secure
                    aggregation) / uplink bandwidth
    waiting       = slowest selected client - median selected client (what the server idles)

Per client these are deterministic (no jitter); the round figures replay the configured sampler
and system model (availability, drop-outs, deadline, jitter) for every round without training,
so they are the simulated times a run of this config will report (`simulated_round_s`), except
that adaptive effects of rejected uploads on sampling are not replayed.

`measure_step_times` replaces the configured `engine.client_system.step_time_s` by the time one
local step of each architecture takes on this machine (compiled, best of a few runs), so the
compute stage is a budget for the hardware at hand (x the speed-class multipliers).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pfedes.engine import client_system, context, rounds, sampling
from fedjax_pfedes.engine.state import SimState


def client_stages(ctx: context.RunContext) -> dict[str, np.ndarray]:
    """[N] download / compute / upload / total seconds of every client (no jitter)."""
    p = ctx.profiles
    down = np.array([ctx.download_bytes[a] for a in ctx.client_arch]) / p.download_Bps
    up = np.array([ctx.upload_bytes[a] for a in ctx.client_arch]) / p.upload_Bps
    compute = ctx.planned_steps * p.step_time_s
    return {"download_s": down, "compute_s": compute, "upload_s": up,
            "total_s": down + compute + up}


def replay_rounds(ctx: context.RunContext) -> dict[str, np.ndarray]:
    """Per round of the configured run: selected, delivered, round time, waiting time."""
    sampler = sampling.SamplerState.create(ctx.num_clients, int(ctx.strata.max()) + 1)
    out: dict[str, list] = {"selected": [], "delivered": [], "round_s": [], "waiting_s": [],
                            "past_deadline": [], "dropped_out": []}
    for r in range(ctx.settings.train.rounds):
        selected, _ = rounds.select_clients(ctx, sampler, r)
        timing = rounds.simulate_selected(ctx, r, selected)
        delivered = timing.clients[timing.trains]
        sampler.record(selected, delivered)
        totals = timing.total_s[timing.trains]
        out["selected"].append(len(selected))
        out["delivered"].append(len(delivered))
        out["round_s"].append(timing.round_s)
        out["waiting_s"].append(timing.round_s - float(np.median(totals)) if len(totals) else 0)
        out["past_deadline"].append(int((timing.status == client_system.PAST_DEADLINE).sum()))
        out["dropped_out"].append(int((timing.status == client_system.DROPPED_OUT).sum()))
    return {k: np.asarray(v) for k, v in out.items()}


def budget_table(ctx: context.RunContext) -> list[dict[str, Any]]:
    """One row per (architecture, speed class): clients, steps and stage times (median, max)."""
    stages = client_stages(ctx)
    rows = []
    for arch in dict.fromkeys(ctx.client_arch):
        for k, mult in enumerate(ctx.system.speed_classes):
            idx = np.flatnonzero((np.array(ctx.client_arch) == arch)
                                 & (ctx.profiles.speed_class == k))
            if len(idx) == 0:
                continue
            rows.append({
                "arch": arch, "speed": f"x{mult:g}", "clients": len(idx),
                "steps": float(np.median(ctx.planned_steps[idx])),
                "upload_bytes": ctx.upload_bytes[arch],
                **{f"{s}": float(np.median(v[idx])) for s, v in stages.items()},
                "total_max_s": float(stages["total_s"][idx].max())})
    return rows


def measure_step_times(ctx: context.RunContext, state: SimState, repeats: int = 3
                       ) -> dict[str, float]:
    """Seconds per local step of each architecture on this machine: one client's compiled local
    update (the cohort's largest client), best of `repeats` timed runs after a compiling one.
    Client states are copied first, so the context is left as it was."""
    out = {}
    for cohort in ctx.cohorts:
        j = int(np.argmax(np.asarray(cohort.train.sizes)))
        slots = np.full(cohort.bucket, len(cohort.client_ids), np.int32)
        slots[0] = j
        keys = jax.random.split(jax.random.key(0), cohort.bucket)
        broadcast = ctx.algorithm.broadcast(state.server, cohort.arch)
        best = np.inf
        for k in range(repeats + 1):
            states = jax.tree.map(jnp.copy, state.clients[cohort.arch])  # the update donates it
            t0 = time.perf_counter()
            _, _, metrics = cohort.runner.update(broadcast, states, cohort.train, slots, keys)
            steps = float(jax.block_until_ready(metrics["local_steps"])[0])
            if k > 0:
                best = min(best, time.perf_counter() - t0)
        out[cohort.arch] = best / max(steps, 1.0)
    return out


def with_step_times(ctx: context.RunContext, seconds_per_step: dict[str, float]
                    ) -> context.RunContext:
    """`ctx` with every client's step time = its architecture's time x its speed multiplier."""
    mult = np.asarray(ctx.system.speed_classes)[ctx.profiles.speed_class]
    base = np.array([seconds_per_step[a] for a in ctx.client_arch])
    profiles = dataclasses.replace(ctx.profiles, step_time_s=base * mult)
    return dataclasses.replace(ctx, profiles=profiles)
