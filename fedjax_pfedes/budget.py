"""Round-time budget (seed 001, section 4.3): per-stage time of a round before anyone trains.

    download      = broadcast bytes / downlink bandwidth
    local compute = local steps (epochs x ceil(n / B)) x simulated step time of the speed class
    upload        = bytes as sent (after compression; dense ring elements under secure
                    aggregation) / uplink bandwidth
    waiting       = slowest selected client - median selected client (what the server idles)

Per client these are deterministic (no jitter); the round figures replay the configured sampler
and system model (availability, drop-outs, deadline, jitter) for every round without training,
so they are the simulated times a run of this config will report (`simulated_round_s`), except
that adaptive effects of rejected uploads on sampling are not replayed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedjax_pfedes import rounds, sampling, system


def client_stages(ctx: rounds.RunContext) -> dict[str, np.ndarray]:
    """[N] download / compute / upload / total seconds of every client (no jitter)."""
    p = ctx.profiles
    down = np.array([ctx.download_bytes[a] for a in ctx.client_arch]) / p.download_Bps
    up = np.array([ctx.upload_bytes[a] for a in ctx.client_arch]) / p.upload_Bps
    compute = ctx.planned_steps * p.step_time_s
    return {"download_s": down, "compute_s": compute, "upload_s": up,
            "total_s": down + compute + up}


def replay_rounds(ctx: rounds.RunContext) -> dict[str, np.ndarray]:
    """Per round of the configured run: selected, delivered, round time, waiting time."""
    sampler = sampling.SamplerState.create(ctx.num_clients, int(ctx.strata.max()) + 1)
    out: dict[str, list] = {"selected": [], "delivered": [], "round_s": [], "waiting_s": [],
                            "past_deadline": [], "dropped_out": []}
    for r in range(ctx.config.train.rounds):
        selected, _ = rounds.select_clients(ctx, sampler, r)
        timing = rounds.simulate_selected(ctx, r, selected)
        delivered = timing.clients[timing.trains]
        sampler.record(selected, delivered)
        totals = timing.total_s[timing.trains]
        out["selected"].append(len(selected))
        out["delivered"].append(len(delivered))
        out["round_s"].append(timing.round_s)
        out["waiting_s"].append(timing.round_s - float(np.median(totals)) if len(totals) else 0)
        out["past_deadline"].append(int((timing.status == system.PAST_DEADLINE).sum()))
        out["dropped_out"].append(int((timing.status == system.DROPPED_OUT).sum()))
    return {k: np.asarray(v) for k, v in out.items()}


def budget_table(ctx: rounds.RunContext) -> list[dict[str, Any]]:
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
