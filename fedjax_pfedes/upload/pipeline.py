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
    (`upload.streaming`: its uploads were summed as they were made, `uploads` is None)."""

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
        if cfg.secagg:
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
                or (cfg.secagg and cfg.secagg_simulation != "aggregate")):
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
            if stage.server_enforced(self.cfg.secagg):
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
                ) -> tuple[dict[str, tuple[Any, jax.Array]], dict[str, Any], dict[str, Any]]:
        """Returns ({arch: (uploads, weights)} for the server step, new memories, report).

        Under client-level DP the report's `dp_round_noise_multiplier` is the smallest noise
        multiplier any aggregate released this round carried (None: nothing was released).
        Under secure aggregation the clients add the noise, so fewer senders than expected
        release less of it; the accountant composes what really happened."""
        cfg = self.cfg
        report: dict[str, Any] = {"rejected": 0, "rejections": []}
        if self.aggregation == "none":  # nothing is uploaded (Standalone)
            return ({a: (c.uploads, jnp.zeros(len(c.valid), jnp.float32))
                     for a, c in cohorts.items()}, memories, report)
        r = stages.RoundUploads(
            round_index=round_index, cohorts=cohorts, scopes=self._scopes(cohorts),
            members=members, key=key, valid={}, sent={}, info={}, report=report,
            reject=lambda ids, reason: self._reject(round_index, ids, reason, report),
            expected_in_scope=self.expected_in_scope)
        arrived, new_rows = {}, {}
        for k, (arch, c) in enumerate(cohorts.items()):
            ok = np.asarray(c.valid).copy()
            if c.reduced is not None:  # streamed: only the facts, the stages decide on them
                r.sent[arch], r.valid[arch] = None, ok
                r.info[arch] = {**c.facts, "skips_client_code": np.zeros(len(ok), bool)}
                continue
            uploads = c.uploads
            mismatch = validation.fingerprint(uploads, leading_axes=1) != validation.fingerprint(
                c.template)
            if mismatch:
                self._reject(round_index, c.client_ids[ok], _mismatch(c), report)
                ok[:] = False
                uploads = _replicate(c.template, len(ok))
            arrived[arch] = uploads
            memory_rows = take_rows(memories[arch], jnp.asarray(c.slots))
            keys = _client_keys(key, k, len(ok))
            if self.active:
                r.sent[arch], new_rows[arch], info = self._client_side(uploads, c.template,
                                                                       memory_rows, keys)
            elif c.facts is not None and not mismatch:
                # nothing is transformed and the cohort's program computed the facts
                r.sent[arch], info = None, c.facts
            else:  # nothing is transformed: only the checks' facts, no stacked deltas
                r.sent[arch] = None
                new_rows[arch], info = self._client_facts(uploads, c.template, memory_rows,
                                                          keys)
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
        for stage in self.stages:  # checks, weights, aggregation: in chain order
            stage.server(r)
        if not self.active:  # the uploads as they arrived; rejected slots hold the template
            groups = {}
            for arch, c in cohorts.items():
                rejected = np.asarray(c.valid) & ~r.valid[arch]
                if c.reduced is not None:  # the held-aside uploads the stages rejected
                    entered = np.asarray(c.valid) & (np.asarray(r.info[arch]["finite"])
                                                     | (not cfg.reject_nonfinite))
                    groups[arch] = streaming.finalize(c.reduced, r.valid[arch],
                                                      rejected & entered, arch, round_index)
                    continue
                # rejected slots hold the template: NaN x 0 weight is still NaN
                shape = (arch, len(rejected))
                if rejected.any() or shape not in self._compiled_shapes:
                    self._compiled_shapes.add(shape)
                    uploads = _rows_or_template(jnp.asarray(~rejected), arrived[arch],
                                                c.template)
                else:
                    uploads = arrived[arch]
                groups[arch] = (uploads, r.weights[arch])
            return groups, memories, report
        new_memories = dict(memories)
        for arch, c in cohorts.items():
            if arch not in new_rows:  # streamed: its client halves keep no state
                continue
            # Error feedback: only real participants with finite updates write their rows.
            rows = jnp.asarray(c.slots)
            write = jnp.where(jnp.asarray(np.asarray(c.valid) & r.info[arch]["finite"]), rows,
                              members[arch])
            new_memories[arch] = put_rows(memories[arch], write, new_rows[arch])
        upload_bytes = [(int(r.valid[a].sum()), compression.encoded_bytes(
            c.template, cfg.compression) + (4 if cfg.dp is not None else 0))
            for a, c in cohorts.items() if r.valid[a].any()]
        if cfg.secagg and report.get("secagg_bytes"):  # the wire carries dense masked vectors
            upload_bytes = report.pop("secagg_bytes")
        groups = {}
        for arch, c in cohorts.items():
            if c.reduced is not None:
                # Streamed (its server step is a weighted mean): one row, the aggregate, with
                # the group's total weight, instead of a copy of it for every slot.
                groups[arch] = (jax.tree.map(lambda t, d: (t + d).astype(t.dtype)[None],
                                             c.template, r.aggregates[arch]),
                                jnp.sum(r.weights[arch])[None])
                continue
            if r.aggregates is None:  # the algorithm averages the decoded uploads itself
                uploads = jax.tree.map(lambda t, d: (t[None] + d).astype(t.dtype), c.template,
                                       r.sent[arch])
            else:
                uploads = _replicate(jax.tree.map(lambda t, d: (t + d).astype(t.dtype),
                                                  c.template, r.aggregates[arch]),
                                     len(c.valid))
            groups[arch] = (uploads, r.weights[arch])
        if upload_bytes:
            counts = np.array(upload_bytes, np.float64)
            report["upload_bytes_per_client"] = float(counts[:, 1] @ counts[:, 0]
                                                      / counts[:, 0].sum())
        if cfg.dp is not None:
            # The server adds sigma C itself; under secure aggregation the senders did.
            realized = (report.get("dp_realized_noise_multiplier") if cfg.secagg
                        else self.noise_multiplier)
            report["dp_round_noise_multiplier"] = realized
            if realized is not None:
                report["dp_realized_noise_multiplier"] = realized
                if realized < self.noise_multiplier:
                    logging.warning("round %d: the secure sum carries noise multiplier %.3f, "
                                    "below the configured %.3f (fewer senders than expected); "
                                    "accounted as it is", round_index + 1, realized,
                                    self.noise_multiplier)
        return groups, new_memories, report

    @property
    def report_keys(self) -> tuple[str, ...]:
        """The round report's entries the stages declare for the monitoring record."""
        return tuple(dict.fromkeys(k for s in self.stages for k in s.report_keys))

    def _reject(self, round_index: int, ids: np.ndarray, reason: str, report: dict) -> None:
        for cid in np.asarray(ids).tolist():
            report["rejections"].append({"client": int(cid), "reason": reason})
            report["rejected"] += 1

    def _scopes(self, cohorts: dict[str, CohortUploads]) -> list[list[str]]:
        if self.aggregation == "per_cohort":
            return [[a] for a in cohorts]
        return [list(cohorts)]
