"""The upload pipeline of one round: validation -> compression -> clipping -> aggregation.

For each cohort the simulator hands over the stacked uploads, the upload template (the reference
the updates are measured from), the sample counts and which slots are real. The pipeline

1. checks each cohort's model fingerprint against the template's (a mismatch rejects the
   cohort's clients);
2. forms each client's update u_i = upload_i - template and, on the client side (vmapped),
   compresses it (top-k with error feedback kept per client, then bf16 or QSGD values) and, with
   DP, clips it to L2 <= C;
3. rejects non-finite updates and norm outliers (norm per local sample > `norm_outlier_factor`
   x the median of the uploads aggregated together; see `stages.outlier_rule` for where it is off),
   logged with the client id and reason; the weights of the rest are used as they are, i.e.
   renormalized; under secure aggregation the checks run on the client, and values beyond the
   fixed-point range are rejected before masking (a malicious client skips all client halves:
   `UploadStage.server_enforced`);
4. aggregates: either leaves the (decoded) uploads to the algorithm's own weighted mean, or
   computes the aggregate itself — coordinate-wise median / trimmed mean, the DP-FedAvg noisy
   fixed-denominator mean, or the secure-aggregation sum — and hands every real slot
   template + aggregate, so the algorithm's weighted mean of those is exactly that aggregate.

The aggregate is taken per cohort for per-cohort methods (FedAvg family) and over all cohorts for
methods that share one tree (pFedES, LG-FedAvg, FML, FedKD, FedMRL); see `Algorithm.aggregation`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from fedjax_pfedes import aggregation
from fedjax_pfedes.tree_util import put_rows, take_rows
from fedjax_pfedes.upload import compression, privacy, stages, streaming, validation
from fedjax_pfedes.upload.settings import PipelineConfig, check_compatible, check_secagg_range


@dataclasses.dataclass
class CohortUploads:
    """One cohort's round: stacked uploads [slots, ...], the template, sample counts [slots],
    which slots are real [slots], their global client ids [slots] (-1 = padding), the rows
    of the cohort's clients they occupy [slots], which slots run their own code instead of
    the client halves of the chain [slots] (malicious clients; None = none), and every sample
    each client holds, training and local test [slots] (None = the training counts); `facts`
    the client halves' per-client facts [slots] already computed with the uploads
    (`UploadPipeline.client_facts` inside the cohort's program; None = computed here), used
    only by a pipeline that transforms nothing; `reduced` the carry of a streamed cohort
    (`upload.streaming`: its uploads were summed as they were made, `uploads` is None), and
    `restack` () -> its uploads stacked, the participants trained again from their rows before
    the round, for a round whose stages reject an upload already summed (None where no stage
    can: `plan.UploadPlan.rejects_summed`)."""

    uploads: Any
    template: Any
    sizes: jax.Array
    valid: np.ndarray
    client_ids: np.ndarray
    slots: np.ndarray
    skips_client_code: np.ndarray | None = None
    all_sizes: jax.Array | None = None
    facts: dict[str, np.ndarray] | None = None
    reduced: dict | None = None
    restack: Callable[[], Any] | None = None


@dataclasses.dataclass(frozen=True)
class UploadReport:
    """What the upload pipeline did with one round's uploads.

    Attributes:
      rejections: [{'client': id, 'reason': why}, ...], in the order found.
      record: the entries the stages declare for the round's monitoring record
        (`UploadStage.report_keys`: secure aggregation's senders, skipped scopes, ...).
      upload_bytes_per_client: the bytes an accepted client sent, averaged over them and
        counted from what went over the wire (encoded, clipped, masked); None where the
        uploads reached the algorithm as they arrived (the template's size is what was sent).
      dp_noise_multiplier: under client-level DP, the smallest noise multiplier any aggregate
        released this round carried (None: nothing was released).
      dp: whether client-level DP is in force (the round is accounted).
    """

    rejections: list[dict] = dataclasses.field(default_factory=list)
    record: dict[str, Any] = dataclasses.field(default_factory=dict)
    upload_bytes_per_client: float | None = None
    dp_noise_multiplier: float | None = None
    dp: bool = False

    @property
    def rejected(self) -> int:
        """How many uploads were rejected."""
        return len(self.rejections)


def _mismatch(c: CohortUploads) -> str:
    """The rejection reason of a fingerprint mismatch, naming the first offending leaf."""
    try:
        aggregation.check_upload(c.template, c.uploads, "the cohort", stacked=len(c.valid))
    except aggregation.UploadMismatchError as e:
        return f"model fingerprint mismatch ({e})"
    return "model fingerprint mismatch"


@functools.partial(jax.jit, static_argnums=1)
def _replicate(tree, slots: int):
    """`tree` repeated on a new leading axis of `slots`."""
    return jax.tree.map(lambda t: jnp.broadcast_to(t, (slots, *jnp.shape(t))), tree)


@jax.jit
def _select_rows(pick, a, b):
    """Per slot (leading axis): the row of `a` where `pick`, else the row of `b`."""
    return jax.tree.map(lambda x, y: jnp.where(pick.reshape((-1,) + (1,) * (x.ndim - 1)), x, y),
                        a, b)


@jax.jit
def _rows_or_template(keep, uploads, template):
    """Per slot (leading axis): the upload where `keep` (bit for bit), else `template`. It reads
    and writes every stacked upload (with 1,000 participants a pass over hundreds of MB), so
    it runs in rounds that reject someone, plus once per cohort shape so that it compiles then
    and a first rejection later compiles nothing (`UploadPipeline.process`)."""
    return jax.tree.map(lambda u, t: jnp.where(keep.reshape((-1,) + (1,) * t.ndim), u, t[None]),
                        uploads, template)


@functools.partial(jax.jit, static_argnums=2)
def _client_keys(key: jax.Array, cohort_index: int, slots: int) -> jax.Array:
    """[slots] keys of a cohort's upload stages: split(fold_in(key, cohort_index), slots)."""
    return jax.random.split(jax.random.fold_in(key, cohort_index), slots)


def _sub(a, b):
    return jax.tree.map(lambda x, y: x.astype(jnp.float32) - y.astype(jnp.float32), a, b)


def build_stages(cfg: PipelineConfig, noise_multiplier: float) -> list[stages.UploadStage]:
    """The ordered stage list of `cfg`: every registered stage (`stages.STAGES`, in `position`
    order) that `cfg` asks for — checks and client-side transforms in the order a client applies
    them (finite check on the raw update, compression, norm measured on what is sent, DP
    clipping), then the server's weighting and aggregation."""
    chain = [cls.from_config(cfg, noise_multiplier) for cls in stages.STAGES]
    return [stage for stage in chain if stage is not None]


class UploadPipeline:
    """Runs the stage chain (`build_stages`) every round; holds the jitted client side and the
    noise multiplier. What each round really released is in its report
    (`dp_round_noise_multiplier`); the run keeps that history in its `SimState`."""

    def __init__(self, cfg: PipelineConfig, aggregation: str, algorithm: str, num_clients: int,
                 expected_participants: float, clients_per_round: int, rounds: int,
                 stages_override: list[stages.UploadStage] | None = None):
        check_compatible(cfg, aggregation, algorithm)
        self.cfg = cfg
        self.aggregation = aggregation
        self.num_clients = num_clients
        self.expected_participants = expected_participants
        self.clients_per_round = clients_per_round
        self.noise_multiplier = 0.0
        if cfg.dp is not None:
            self.noise_multiplier = privacy.resolve_noise_multiplier(
                cfg.dp, num_clients, clients_per_round, rounds)
        if cfg.secagg is not None:
            check_secagg_range(cfg, self.noise_multiplier, clients_per_round, expected_participants,
                               num_clients)
        self.outlier_note = stages.outlier_rule(cfg)[1]
        self.stages = (build_stages(cfg, self.noise_multiplier) if stages_override is None
                       else list(stages_override))
        self._client_side = jax.jit(jax.vmap(self._one_client, in_axes=(0, None, 0, 0)))
        # One client at a time (`lax.map`): its upload is reduced while in cache (the vmapped
        # form reduces the whole stack at once, slower on XLA:CPU: docs/performance.md).
        self._client_facts = jax.jit(lambda uploads, template, memory, keys: jax.lax.map(
            lambda xs: self._one_client(xs[0], template, xs[1], xs[2])[1:],
            (uploads, memory, keys)))
        self._rogue_side = jax.jit(jax.vmap(self._one_rogue_client, in_axes=(0, None, 0)))
        self._compiled_shapes: set[tuple[str, int]] = set()  # (arch, slots) seen by process

    @property
    def active(self) -> bool:
        """Whether accepted uploads are transformed (otherwise they reach the algorithm exactly
        as they arrived, and only the checks and the weights act)."""
        return any(stage.transforms for stage in self.stages)

    def _one_client(self, upload, template, memory, key):
        """The client halves of the chain, for one client (vmapped and jitted once) on its
        update upload - template (float32); `memory` is {stage name: this client's row of the
        stage's state}."""
        delta = _sub(upload, template)
        info: dict[str, jax.Array] = {}
        memory = dict(memory)
        for stage in self.stages:
            delta, own, info = stage.client(delta, memory.get(stage.name), key, info)
            if stage.name in memory:
                memory[stage.name] = own
        return delta, memory, info

    @property
    def keyless_client_side(self) -> bool:
        """Whether no stage's client half keeps a per-client state or draws a key (only
        compression does), so a client's facts can be computed from its upload alone."""
        return not any(s.client_keyed for s in self.stages)

    @property
    def streamed_clip_norm(self) -> float | None:
        """C, when a streamed round may sum the clipped updates instead of stacking them
        (`streaming.StreamingClippedSum`): client-level DP whose client half is the finite
        check, the norm and the clip only (no compression), the norm over the whole update,
        and an aggregator that adds its noise to that sum (central DP-FedAvg, or secure
        aggregation simulated as 'aggregate'); else None."""
        cfg = self.cfg
        if (cfg.dp is None or not self.keyless_client_side or cfg.norm_keys
                or (cfg.secagg is not None and cfg.secagg.simulation != "aggregate")):
            return None
        return cfg.dp.clip_norm

    def client_facts(self, upload, template) -> dict[str, jax.Array]:
        """One client's facts for the server-side checks ('finite', 'norm', ...), when no
        client half keeps a state or draws a key (`keyless_client_side`): the same values
        `process` computes from the stacked uploads, for a cohort's program to compute while
        the client's upload is in cache (`CohortUploads.facts`)."""
        if not self.keyless_client_side:
            raise ValueError("UploadPipeline.client_facts: the pipeline's client halves keep "
                             "states or draw keys (compression); process computes them")
        return self._one_client(upload, template, {}, None)[2]

    def _one_rogue_client(self, upload, template, key):
        """What the server receives from a client that runs its own code: its raw update, with
        only the stages the server enforces on what it sees applied (`server_enforced`)."""
        delta = _sub(upload, template)
        info: dict[str, jax.Array] = {}
        for stage in self.stages:
            if stage.server_enforced(self.cfg.secagg is not None):
                delta, _, info = stage.client(delta, None, key, info)
            else:
                delta, info = stage.skipped(delta, info)
        return delta, info

    def init_memory(self, template, num_members: int) -> dict[str, Any]:
        """A cohort's per-client stage states: {stage name: state stacked over the members}
        for the stages that keep one (an empty dict when none does)."""
        states = {s.name: s.init_state(template, num_members) for s in self.stages}
        return {name: state for name, state in states.items() if state is not None}

    def expected_in_scope(self, members: int) -> float:
        """Fixed denominator: the expected number of participants among `members` clients."""
        return self.expected_participants * members / self.num_clients

    def process(self, round_index: int, cohorts: dict[str, CohortUploads],
                memories: dict[str, Any], members: dict[str, int], key: jax.Array
                ) -> tuple[dict[str, tuple[Any, jax.Array]], dict[str, Any], UploadReport]:
        """One round of the chain: the client halves per cohort, then the server halves.

        Args:
          round_index: 0-based round.
          cohorts: architecture -> the cohort's uploads.
          memories: architecture -> the cohort's per-client stage states.
          members: architecture -> clients in the cohort.
          key: the round's upload RNG key.

        Returns:
          ({arch: (uploads, weights)} for the server step, new memories, the round's
          `UploadReport`). Under secure aggregation the clients add client-level DP's noise,
          so fewer senders than expected release less of it
          (`UploadReport.dp_noise_multiplier`); the accountant composes what really happened.
        """
        report: dict[str, Any] = {"rejections": []}
        if self.aggregation == "none":  # nothing is uploaded (Standalone)
            return ({a: (c.uploads, jnp.zeros(len(c.valid), jnp.float32))
                     for a, c in cohorts.items()}, memories, UploadReport())
        r = stages.RoundUploads(
            round_index=round_index, cohorts=cohorts, scopes=self._scopes(cohorts),
            members=members, key=key, valid={}, sent={}, info={}, report=report,
            reject=lambda ids, reason: self._reject(round_index, ids, reason, report),
            expected_in_scope=self.expected_in_scope)
        arrived, new_rows = {}, {}
        for k, arch in enumerate(cohorts):
            self._client_halves(r, k, arch, memories, arrived, new_rows)
        for stage in self.stages:  # checks, weights, aggregation: in chain order
            stage.server(r)
        if not self.active:
            return self._as_arrived(r, arrived), memories, self._report(r)
        groups, sent_bytes = self._transformed(r)
        return (groups, self._new_memories(r, memories, new_rows),
                self._report(r, sent_bytes, self._released_noise(r)))

    def _client_halves(self, r: stages.RoundUploads, k: int, arch: str,
                       memories: dict[str, Any], arrived: dict, new_rows: dict) -> None:
        """The client halves of cohort `arch` (the k-th): its decoded updates into `r.sent`,
        its facts into `r.info`, its real slots into `r.valid`; the uploads as they arrived
        into `arrived` and the stage states' new rows into `new_rows`. A fingerprint mismatch
        rejects the whole cohort; a client that runs its own code skips the client halves the
        server does not enforce."""
        c = r.cohorts[arch]
        ok = np.asarray(c.valid).copy()
        if c.reduced is not None:  # streamed: only the facts, the stages decide on them
            r.sent[arch], r.valid[arch] = None, ok
            r.info[arch] = {**c.facts, "skips_client_code": np.zeros(len(ok), bool)}
            return
        uploads = c.uploads
        mismatch = validation.fingerprint(uploads, leading_axes=1) != validation.fingerprint(
            c.template)
        if mismatch:
            r.reject(c.client_ids[ok], _mismatch(c))
            ok[:] = False
            uploads = _replicate(c.template, len(ok))
        arrived[arch] = uploads
        memory_rows = take_rows(memories[arch], jnp.asarray(c.slots))
        keys = _client_keys(r.key, k, len(ok))
        if self.active:
            r.sent[arch], new_rows[arch], info = self._client_side(uploads, c.template,
                                                                   memory_rows, keys)
        elif c.facts is not None and not mismatch:
            # nothing is transformed and the cohort's program computed the facts
            r.sent[arch], info = None, c.facts
        else:  # nothing is transformed: only the checks' facts, no stacked deltas
            r.sent[arch] = None
            new_rows[arch], info = self._client_facts(uploads, c.template, memory_rows, keys)
        r.info[arch] = dict(jax.device_get(info))  # one transfer for the cohort
        rogue = ok & (c.skips_client_code if c.skips_client_code is not None else False)
        if rogue.any():
            raw, rogue_info = self._rogue_side(uploads, c.template, keys)
            if self.active:
                r.sent[arch] = _select_rows(jnp.asarray(rogue), raw, r.sent[arch])
            for name, v in rogue_info.items():
                r.info[arch][name] = np.where(rogue, np.asarray(v), r.info[arch][name])
        r.info[arch]["skips_client_code"] = rogue
        r.valid[arch] = ok

    def _as_arrived(self, r: stages.RoundUploads, arrived: dict) -> dict:
        """{arch: (uploads, weights)} when no stage transforms: the uploads as they arrived,
        the rejected slots holding the template (NaN x 0 weight is still NaN); a streamed
        cohort's sum as its mean, or, where a stage rejected an upload it summed, its uploads
        stacked again (`CohortUploads.restack`)."""
        groups = {}
        for arch, c in r.cohorts.items():
            rejected = np.asarray(c.valid) & ~r.valid[arch]
            if c.reduced is not None:
                entered = np.asarray(c.valid) & (np.asarray(r.info[arch]["finite"])
                                                 | (not self.cfg.upload.reject_nonfinite))
                if not (rejected & entered).any():
                    groups[arch] = streaming.finalize(c.reduced)
                    continue
                if c.restack is None:
                    raise RuntimeError(  # the plan's `rejects_summed` keeps what restacks
                        f"round {r.round_index + 1}: a stage rejected an upload cohort "
                        f"'{arch}' had summed, and the round kept no rows to train it again")
                arrived[arch] = c.restack()
            shape = (arch, len(rejected))
            if rejected.any() or shape not in self._compiled_shapes:
                self._compiled_shapes.add(shape)
                uploads = _rows_or_template(jnp.asarray(~rejected), arrived[arch], c.template)
            else:
                uploads = arrived[arch]
            groups[arch] = (uploads, r.weights[arch])
        return groups

    def _new_memories(self, r: stages.RoundUploads, memories: dict[str, Any],
                      new_rows: dict) -> dict[str, Any]:
        """The stage states after the round (error feedback: only real participants with
        finite updates write their rows)."""
        new_memories = dict(memories)
        for arch, c in r.cohorts.items():
            if arch not in new_rows:  # streamed: its client halves keep no state
                continue
            rows = jnp.asarray(c.slots)
            write = jnp.where(jnp.asarray(np.asarray(c.valid) & r.info[arch]["finite"]), rows,
                              r.members[arch])
            new_memories[arch] = put_rows(memories[arch], write, new_rows[arch])
        return new_memories

    def _transformed(self, r: stages.RoundUploads) -> tuple[dict, float | None]:
        """({arch: (uploads, weights)}, bytes an accepted client sent) when a stage transforms:
        each slot the template plus its decoded update, or plus the aggregate the stages
        computed (a streamed cohort: one row, the aggregate, with the group's total weight)."""
        cfg = self.cfg
        upload_bytes = [(int(r.valid[a].sum()), compression.encoded_bytes(
            c.template, cfg.upload) + (4 if cfg.dp is not None else 0))
            for a, c in r.cohorts.items() if r.valid[a].any()]
        if r.wire_bytes:  # the wire carried dense masked vectors
            upload_bytes = r.wire_bytes
        groups = {}
        for arch, c in r.cohorts.items():
            if c.reduced is not None:
                groups[arch] = (jax.tree.map(lambda t, d: (t + d).astype(t.dtype)[None],
                                             c.template, r.aggregates[arch]),
                                jnp.sum(r.weights[arch])[None])
            elif r.aggregates is None:  # the algorithm averages the decoded uploads itself
                groups[arch] = (jax.tree.map(lambda t, d: (t[None] + d).astype(t.dtype),
                                             c.template, r.sent[arch]), r.weights[arch])
            else:
                groups[arch] = (_replicate(jax.tree.map(lambda t, d: (t + d).astype(t.dtype),
                                                        c.template, r.aggregates[arch]),
                                           len(c.valid)), r.weights[arch])
        if not upload_bytes:
            return groups, None
        counts = np.array(upload_bytes, np.float64)
        return groups, float(counts[:, 1] @ counts[:, 0] / counts[:, 0].sum())

    def _released_noise(self, r: stages.RoundUploads) -> float | None:
        """Client-level DP: the noise multiplier this round's aggregates carried (the server
        adds sigma C itself; under secure aggregation the senders did, so fewer senders than
        expected release less), None when nothing was released or without DP."""
        if self.cfg.dp is None:
            return None
        realized = (r.report.get("dp_realized_noise_multiplier")
                    if self.cfg.secagg is not None else self.noise_multiplier)
        if realized is not None:
            r.report["dp_realized_noise_multiplier"] = realized
            if realized < self.noise_multiplier:
                logging.warning("round %d: the secure sum carries noise multiplier %.3f, "
                                "below the configured %.3f (fewer senders than expected); "
                                "accounted as it is", r.round_index + 1, realized,
                                self.noise_multiplier)
        return realized

    def _report(self, r: stages.RoundUploads, sent_bytes: float | None = None,
                realized: float | None = None) -> UploadReport:
        """The round's `UploadReport`: its rejections, the entries the stages declare for the
        monitoring record (`UploadStage.report_keys`), bytes sent and noise released."""
        keys = dict.fromkeys(k for s in self.stages for k in s.report_keys)
        return UploadReport(
            rejections=list(r.report["rejections"]),
            record={k: r.report[k] for k in keys if k in r.report},
            upload_bytes_per_client=sent_bytes, dp_noise_multiplier=realized,
            dp=self.cfg.dp is not None)

    def _reject(self, round_index: int, ids: np.ndarray, reason: str, report: dict) -> None:
        for cid in np.asarray(ids).tolist():
            report["rejections"].append({"client": int(cid), "reason": reason})

    def _scopes(self, cohorts: dict[str, CohortUploads]) -> list[list[str]]:
        if self.aggregation == "per_cohort":
            return [[a] for a in cohorts]
        return [list(cohorts)]
