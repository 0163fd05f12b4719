"""One synchronous round, in the pieces the synchronous and the buffered-asynchronous loops share.

A round: the sampler picks clients among those online (`sampling`, `system`), the system model
decides who drops out or misses the deadline and how many local steps each runs, the cohorts train
their participants (`train_participants`), the upload pipeline checks and combines the uploads,
the server steps (`aggregate`), and the monitoring record and the per-client report are built.
Everything random is keyed by (seed, round), so resuming from a checkpoint repeats it exactly.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from fedjax_pfedes.engine import attacks, client_system, sampling
from fedjax_pfedes.engine.cohorts import Cohort
from fedjax_pfedes.engine.context import ATTACK_STREAM, RunContext, fold_in, participant_keys
from fedjax_pfedes.engine.finishing import sent_to_runner
from fedjax_pfedes.engine.records import (
    UPLOAD_NORM,
    ClientMetrics,
    Trained,
    client_means,
    client_report,
    count_dp_sgd_steps,
    outcome_counts,
)
from fedjax_pfedes.engine.state import SimState
from fedjax_pfedes.execution import offload
from fedjax_pfedes.execution.strategies import protocol
from fedjax_pfedes.tree_util import take_rows, tree_size
from fedjax_pfedes.upload import validation
from fedjax_pfedes.upload.plan import CohortUploads, UploadReport


def train_arrays(ctx: RunContext, cohort: Cohort, step_limits: dict[int, int]):
    """The cohort's train arrays with this round's local-step caps: `step_limits` for the given
    clients (deadline partial work), their planned steps for the others."""
    if not ctx.step_limits:
        return cohort.train
    cap = ctx.planned_steps[cohort.client_ids].copy()
    for j, cid in enumerate(cohort.client_ids):
        if int(cid) in step_limits:
            cap[j] = step_limits[int(cid)]
    return cohort.train.replace(step_limit=jnp.asarray(cap, jnp.int32))


def train_participants(ctx: RunContext, server_state, clients: dict[str, Any],
                       participants: np.ndarray, round_key: jax.Array,
                       step_limits: dict[int, int]) -> tuple[Trained, dict[str, Any]]:
    """Broadcast and local updates of every cohort's participants, each capped at its step
    limit (`train_arrays`). Returns their uploads and metrics, and the cohorts' new private
    states (`clients` is donated: do not reuse it)."""
    algorithm = ctx.algorithm
    clients = dict(clients)
    uploads, client_metrics, traffic = {}, [], []
    useful = computed = 0.0
    for cohort in ctx.cohorts:
        broadcast = algorithm.broadcast(server_state, cohort.arch)
        template = algorithm.upload_template(server_state, cohort.arch)
        slots = cohort.slots(participants)
        valid = slots < len(cohort.client_ids)
        ids = np.where(valid, cohort.client_ids[np.minimum(slots, len(cohort.client_ids) - 1)],
                       -1)
        keys = participant_keys(round_key, jnp.asarray(ids))
        sent = sent_to_runner(ctx.upload, ctx.attack.active, cohort.runner, cohort.bucket,
                              broadcast, template)
        finishing = isinstance(sent, protocol.Finishing)
        streams = finishing and sent.reducer is not None
        train = train_arrays(ctx, cohort, step_limits)
        restack = (_restacker(cohort.runner, sent, clients[cohort.arch], train, slots, keys,
                              valid) if streams and ctx.upload.rejects_summed else None)
        stacked, clients[cohort.arch], metrics = cohort.runner.update(
            sent, clients[cohort.arch], train, slots, keys)
        if restack is not None:
            restack = functools.partial(restack, clients[cohort.arch])
        reduced, stacked = (stacked, None) if streams else (None, stacked)
        if ctx.attack.active:
            stacked = attacks.apply(stacked, template, ids, fold_in(round_key, ATTACK_STREAM),
                                    ctx.attack)
        norms = (validation.upload_norms(stacked, template, ctx.algorithm.norm_keys)
                 if not finishing and valid.any() and jax.tree.leaves(template) else None)
        # One device-to-host transfer for the cohort's per-client metrics, norms and facts.
        host, norms = jax.device_get((metrics, norms))
        facts = host.pop(protocol.UPLOAD_FACTS, {})
        if UPLOAD_NORM in facts:
            norms = facts[UPLOAD_NORM]
        # The pipeline reads the facts only when it transforms nothing, where the plan's
        # `finish` includes its checks' facts.
        uploads[cohort.arch] = cohort_uploads(ctx, cohort, stacked, template, slots, valid, ids,
                                              facts or None, reduced, restack)
        if not valid.any():
            continue
        metrics, sent_sizes, steps = _cohort_record(ctx, cohort, host, norms, ids, valid,
                                                    template, broadcast)
        client_metrics.append(metrics)
        traffic.append(sent_sizes)
        useful, computed = useful + steps[0], computed + steps[1]
    return (Trained(uploads, ClientMetrics.concatenate(client_metrics), traffic, useful,
                    computed), clients)


def _cohort_record(ctx: RunContext, cohort: Cohort, host: dict[str, np.ndarray], norms,
                   ids: np.ndarray, valid: np.ndarray, template, broadcast
                   ) -> tuple[ClientMetrics, tuple, tuple[float, float]]:
    """What the round records of one cohort's participants (`valid` slots of `ids`): their
    metrics and upload norms (`host`, fetched), the traffic entry (participants, the upload's
    and the broadcast's sizes; an encoded upload's own size when the method compresses it) and
    the local steps (useful: the participants' own; computed: what the strategy executed)."""
    if norms is None:
        norms = np.zeros(len(valid))
    useful = computed = 0.0
    if "local_steps" in host:
        steps = host["local_steps"][valid]
        useful = float(steps.sum())
        computed = cohort.runner.computed_steps(steps, len(valid))
    rows = np.flatnonzero(valid)
    metrics = ClientMetrics(
        ids[rows].astype(np.int64),
        {**{k: np.asarray(v, np.float64)[rows] for k, v in host.items()},
         UPLOAD_NORM: np.asarray(norms, np.float64)[rows]})
    upload = tree_size(template)
    if ctx.algorithm.encoded_upload_params is not None:  # sent compressed
        encoded = float(np.asarray(ctx.algorithm.encoded_upload_params(host))[valid].mean())
        upload = (encoded, encoded * upload[1] / max(upload[0], 1))
    return metrics, (int(valid.sum()), *upload, *tree_size(broadcast)), (useful, computed)


def cohort_uploads(ctx: RunContext, cohort: Cohort, stacked, template, slots: np.ndarray,
                   valid: np.ndarray, ids: np.ndarray, facts: dict | None = None,
                   reduced: dict | None = None,
                   restack: Callable[[], Any] | None = None) -> CohortUploads:
    """What the upload pipeline gets of one cohort's round: the stacked uploads with their
    clients' local training sample counts and all-sample counts (training + local test), and
    the checks' facts when the training program computed them (`UploadPlan.finish`); a
    streamed cohort (`UploadPlan.reducer`) gives its `reduced` carry instead of stacked
    uploads, and `restack` (`_restacker`) where a stage may reject an upload it summed."""
    take = jnp.asarray(slots)
    sizes = jnp.take(cohort.train.sizes, take, mode="clip")
    all_sizes = sizes + jnp.take(jnp.asarray(cohort.test.sizes), take, mode="clip")
    return CohortUploads(stacked, template, sizes, valid, ids, slots,
                         attacks.rogue_slots(ids, ctx.attack), all_sizes, facts, reduced,
                         restack)


def _restacker(runner, sent: protocol.Finishing, states, train, slots: np.ndarray,
               keys: jax.Array, valid: np.ndarray) -> Callable[[Any], Any]:
    """(states after the round) -> the round's uploads of a streamed cohort, stacked: its
    participants trained again from their state rows as they were before the round (read here,
    before the update takes `states`), with the same data, step limits and keys, by the same
    runner without the reducer. `UploadPipeline` calls it only in a round whose stages reject
    an upload the cohort had already summed (`upload.streaming`); the states it writes are
    those the first pass wrote."""
    rows = np.asarray(slots)[valid]
    leaves = jax.tree.leaves(states)
    on_device = all(isinstance(a, jax.Array) for a in leaves)
    before = (take_rows(states, jnp.asarray(rows)) if on_device
              else offload.read_rows(states, rows)) if leaves else None
    plain = sent.replace(reducer=None)

    def restack(after):
        if before is not None:
            after = offload.replace_rows(after, rows, before)
        return runner.update(plain, after, train, slots, keys)[0]

    return restack


def participants_metrics(ctx: RunContext, server_state, clients: dict[str, Any],
                         ids: np.ndarray, keys: tuple[str, ...] | None = None
                         ) -> dict[str, float]:
    """Mean local-test metrics `keys` (None: every metric named `test_<name>_loss`, the
    cross-entropy and e.g. pFedES's alignment to the broadcast E_proxy) of the clients `ids`
    with `server_state`'s broadcast and their private states in `clients` (the model each
    would predict with). Empty when nobody is given."""
    losses: dict[str, list] = {}
    for cohort in ctx.cohorts:
        slots = cohort.slots(ids)
        valid = slots < len(cohort.client_ids)
        if not valid.any():
            continue
        m = cohort.runner.evaluate_slots(ctx.algorithm.broadcast(server_state, cohort.arch),
                                         clients[cohort.arch], cohort.test, slots)
        wanted = keys if keys is not None else [k for k in m if k.startswith("test_")
                                                and k.endswith("_loss")]
        for key in wanted:
            if key in m:
                losses.setdefault(key, []).append(np.asarray(m[key])[valid])
    return {k: float(np.concatenate(v).mean()) for k, v in losses.items()}


def aggregate(ctx: RunContext, server_state, clients: dict[str, Any], trained: Trained,
              memories: dict, round_index: int
              ) -> tuple[Any, dict, dict[str, Any], UploadReport]:
    """Upload pipeline + server step, with the monitoring losses before / after it.

    Returns (server state, memories, the round's summary: rejections, traffic, the pipeline's
    record entries, losses; the pipeline's `UploadReport`)."""
    members = {c.arch: len(c.client_ids) for c in ctx.cohorts}
    groups, memories, report = ctx.upload.process(
        round_index, trained.uploads, memories, members,
        fold_in(ctx.upload_key, round_index))
    for r in report.rejections:
        logging.warning("round %d: upload of client %d rejected: %s", round_index + 1,
                        r["client"], r["reason"])
    trained_ids = np.array(sorted(trained.client_metrics), np.int64)
    monitor = ctx.settings.monitor.aggregation_loss and len(trained_ids) > 0
    before = participants_metrics(ctx, server_state, clients, trained_ids) if monitor else {}
    previous = server_state
    server_state = ctx.server_step(server_state, groups)
    changes = (ctx.server_metrics(previous, server_state)
               if ctx.server_metrics is not None else {})
    after = participants_metrics(ctx, server_state, clients, trained_ids) if monitor else {}
    summary: dict[str, Any] = {"uploads_rejected": report.rejected,
                               "rejections": report.rejections,
                               **{k: float(v) for k, v in jax.device_get(changes).items()}}
    if trained.traffic:
        counts = np.array(trained.traffic, np.float64)
        per_client = counts[:, 1:].T @ counts[:, 0] / counts[:, 0].sum()
        summary.update(zip(("upload_params_per_client", "upload_bytes_per_client",
                            "download_params_per_client", "download_bytes_per_client"),
                           per_client.tolist(), strict=True))
    if report.upload_bytes_per_client is not None:  # counted from what went over the wire
        summary["upload_bytes_per_client"] = report.upload_bytes_per_client
    summary.update(report.record)
    if monitor:
        summary["loss_before_aggregation"] = before.get("test_ce_loss")
        summary["loss_after_aggregation"] = after.get("test_ce_loss")
        for key in sorted(set(before) - {"test_ce_loss"}):  # e.g. pFedES's alignment (F4)
            name = key[len("test_"):]
            summary[f"{name}_before_aggregation"] = before[key]
            summary[f"{name}_after_aggregation"] = after[key]
    return server_state, memories, summary, report


def participant_states(ctx: RunContext, clients: dict[str, Any], ids: np.ndarray
                       ) -> dict[str, tuple[np.ndarray, np.ndarray, Any]]:
    """{arch: (global ids, local rows, host copy of those rows' states)} of the clients `ids`,
    taken before they train (`Algorithm.state_needs_acceptance`)."""
    out = {}
    for cohort in ctx.cohorts:
        local = np.flatnonzero(np.isin(cohort.client_ids, ids))
        if len(local):
            out[cohort.arch] = (cohort.client_ids[local], local,
                                offload.read_rows(clients[cohort.arch], local))
    return out


def restore_states(ctx: RunContext, clients: dict[str, Any], before: dict, rejected: np.ndarray
                   ) -> dict[str, Any]:
    """`clients` with the states of the `rejected` clients set back to `before`."""
    clients = dict(clients)
    for arch, (ids, local, rows) in before.items():
        keep = np.isin(ids, rejected)
        if keep.any():
            clients[arch] = offload.replace_rows(
                clients[arch], local[keep], jax.tree.map(lambda r, k=keep: r[k], rows))
    return clients


def select_clients(ctx: RunContext, sampler: sampling.SamplerState, round_index: int,
                   excluded: np.ndarray | None = None, count: int | None = None
                   ) -> tuple[np.ndarray, dict[str, Any]]:
    """This round's selection and the counts behind it (online, eligible, planned)."""
    s, n = ctx.settings, ctx.num_clients
    online = client_system.online_mask(ctx.system, ctx.profiles, s.seed, round_index)
    eligible = online & ctx.statically_eligible
    if excluded is not None:
        eligible &= ~excluded
    weights = (np.ones(n) if ctx.system.all_reliable
               else sampling.reliability_weights(sampler, ctx.system.failure_decay))
    m = sampling.participants_per_round(n, s.train.client_fraction) if count is None else count
    if s.train.sampling == "poisson" and count is None:
        planned: float = s.train.client_fraction * n
        selected = sampling.weighted_poisson(s.seed, round_index, s.train.client_fraction,
                                             eligible, weights)
    elif s.train.sampling == "stratified" and count is None:
        planned = m
        selected = sampling.stratified_sample(s.seed, round_index, m, eligible, weights,
                                              ctx.strata, sampler)
    elif s.train.sampling == "coverage" and count is None:
        planned = m
        selected = sampling.coverage_sample(s.seed, round_index, m, eligible, weights,
                                            ctx.label_counts, s.train.coverage_candidates)
    else:
        planned = m
        selected = sampling.weighted_uniform(s.seed, round_index, m, eligible, weights)
    return selected, {"planned_participants": planned, "online_clients": int(online.sum()),
                      "selected": len(selected),
                      "selected_label_coverage": sampling.label_coverage(ctx.label_counts,
                                                                         selected)}


def prefetch_upcoming(ctx: RunContext, clients: dict[str, Any], sampler: sampling.SamplerState,
                      round_index: int) -> None:
    """Tells the cohorts whose client states live on disk which clients round `round_index` will
    probably select, so that their rows are read while the current round computes. The guess is
    that round's selection made now (on a copy of the sampler: the current round's outcome is not
    recorded yet, so with reliability weights or stratified quotas it can differ). A hint only:
    nothing computed depends on it."""
    cohorts = [c for c in ctx.cohorts if c.runner.prefetch is not None]
    if not cohorts or round_index >= ctx.settings.train.rounds:
        return
    upcoming, _ = select_clients(ctx, copy.deepcopy(sampler), round_index)
    for cohort in cohorts:
        cohort.runner.prefetch(clients[cohort.arch],
                               np.flatnonzero(np.isin(cohort.client_ids, upcoming)))


def simulate_selected(ctx: RunContext, round_index: int, selected: np.ndarray
                      ) -> client_system.RoundTiming:
    archs = ctx.arch_of(selected)
    return client_system.simulate_round(
        ctx.system, ctx.profiles, ctx.settings.seed, round_index, selected,
        ctx.planned_steps[selected], [ctx.upload_bytes[a] for a in archs],
        [ctx.download_bytes[a] for a in archs])


def conclude(ctx: RunContext, state: SimState, round_index: int, trained: Trained,
             clients: dict[str, Any], *, head: Callable[[int], dict[str, Any]],
             rows: Callable[[set[int]], list[dict]], padded: dict[str, float],
             tail: dict[str, Any], clock_s: float, before: dict | None = None
             ) -> tuple[SimState, dict[str, Any], list[dict], list[dict]]:
    """The second half of a round, the same for synchronous rounds and FedBuff's server steps:
    the upload pipeline and server step on `trained`, the rejected clients' states set back
    (`before`, when the algorithm's states need acceptance), the round's record and client rows,
    and the new state with its DP step counts, clock and released noise multiplier.

    Args:
      ctx: the run.
      state: the state the round started from (its server, memories and counters).
      round_index: 0-based round.
      trained: the uploads and per-client metrics that reach the server this round.
      clients: the clients' states after training.
      head: the record's first fields, given the number of accepted uploads.
      rows: the client rows, given the set of rejected clients.
      padded: the padded-step fraction of the round's training.
      tail: the record's last fields.
      clock_s: the simulated clock after the round.
      before: `participant_states` taken before training, or None.

    Returns:
      (new state, record, client rows, rejections).
    """
    server_state, memories, summary, report = aggregate(ctx, state.server, clients, trained,
                                                        state.memories, round_index)
    rejections = summary.pop("rejections")
    rejected = {r["client"] for r in rejections}
    if before is not None and rejected:
        clients = restore_states(ctx, clients, before, np.array(sorted(rejected), np.int64))
    accepted = len(set(trained.client_metrics) - rejected)
    record = {**head(accepted), **client_means(trained.client_metrics), **padded, **summary,
              **tail}
    client_rows = rows(rejected)
    state = state.replace(server=server_state, clients=clients, memories=memories,
                          dp_sgd_steps=count_dp_sgd_steps(state.dp_sgd_steps, client_rows),
                          clock_s=clock_s)
    if report.dp:
        state = state.with_round_noise(round_index, report.dp_noise_multiplier)
    return state, record, client_rows, rejections


def sync_round(ctx: RunContext, state: SimState, round_index: int
               ) -> tuple[SimState, dict[str, Any], list[dict], list[dict]]:
    """One synchronous round: (new state, record, client rows, rejections). `state` itself is
    not changed (its device buffers may be donated: use the returned state)."""
    state = state.with_host_copies()
    sampler = state.sampler
    selected, counts = select_clients(ctx, sampler, round_index)
    timing = simulate_selected(ctx, round_index, selected)
    runs = timing.clients[timing.trains]
    limits = dict(zip(runs.tolist(), timing.step_limit[timing.trains].tolist(), strict=True))
    prefetch_upcoming(ctx, state.clients, sampler, round_index + 1)
    before = (participant_states(ctx, state.clients, runs)
              if ctx.algorithm.state_needs_acceptance else None)
    trained, clients = train_participants(ctx, state.server, state.clients, runs,
                                          fold_in(ctx.train_key, round_index), limits)
    after_training = {}
    if ctx.settings.eval.after_training and trained.client_metrics:
        # Each participant right after its local training, before the server step (the
        # published pFedES code's evaluation protocol).
        after_training = {"participants_accuracy_after_training": participants_metrics(
            ctx, state.server, clients, np.array(sorted(trained.client_metrics), np.int64),
            ("personalized_accuracy",))["personalized_accuracy"]}
    sampler.record(selected, runs)
    return conclude(
        ctx, state, round_index, trained, clients,
        head=lambda accepted: {**counts, **outcome_counts(timing, accepted)},
        rows=lambda rejected: client_report(ctx, timing, trained, rejected),
        padded=trained.padded_step_fraction(),
        tail={**after_training, "simulated_round_s": timing.round_s},
        clock_s=state.clock_s + timing.round_s, before=before)
