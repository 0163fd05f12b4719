"""What a run's rounds need of the upload pipeline, decided once per run: `UploadPlan`.

The engine reads the upload pipeline only through its plan: the client half that runs inside a
cohort's training program (`finish`), the reducer with which a streamed 'scan' cohort sums its
uploads as they are made (`reducer`), the server half (`process`, with a typed `UploadReport`),
and the facts a run's records and messages state (bytes on the wire, privacy spent, the norm
rule in force). `make_plan` builds the pipeline (`pipeline.UploadPipeline`) and its plan.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from fedjax_pfedes.tree_util import tree_size
from fedjax_pfedes.upload import compression, privacy, streaming, validation
from fedjax_pfedes.upload.pipeline import CohortUploads, UploadPipeline, UploadReport
from fedjax_pfedes.upload.settings import PipelineConfig
from fedjax_pfedes.upload.stages import outlier_rule

__all__ = ["UPLOAD_NORM", "CohortUploads", "UploadPlan", "UploadReport", "make_plan"]

UPLOAD_NORM = "update_norm"  # `UploadPlan.finish`'s entry of the update norm


@dataclasses.dataclass(frozen=True)
class UploadPlan:
    """Everything a run's rounds need of the upload pipeline.

    Attributes:
      finish: (upload, template) -> per-client facts, the function a cohort's training program
        runs on each upload (`execution.strategies.protocol.Finishing`): {UPLOAD_NORM: the
        update norm the monitoring reports}, with the checks' facts when the pipeline
        transforms nothing or streams clipped updates. Build once per run: it is part of the
        compiled programs' identity.
      reducer: bucket -> the reducer with which a 'scan' cohort of that bucket sums its uploads
        as they are made (`upload.streaming`), or None where the stacked uploads are needed.
      rejects_summed: whether a stage may reject an upload a streamed cohort has already
        summed (the norm rule decides on the round's median): the engine then keeps each
        streamed cohort's participants' rows as they were before the round, so that such a
        round can train them again with stacked uploads (`CohortUploads.restack`).
      process: the server half, (round index, {arch: CohortUploads}, memories, {arch: members},
        key) -> ({arch: (uploads, weights)} for the server step, memories, `UploadReport`).
      init_memory: (template, members) -> a cohort's per-client stage states.
      bytes_per_client: template -> bytes one client sends per round as the simulated network
        sees it (compressed, or the secure sum's dense masked vectors).
      privacy_metrics: the noise multipliers the rounds released (None: a round released
        nothing) -> {dp_epsilon, dp_delta, dp_noise_multiplier, dp_clip_norm}; {} without
        client-level DP.
      statement: summary.json's fields on client-level DP (unit, neighbouring relation,
        sensitivity); {} without it.
      outlier_note: the norm rule in force, in words.
      noise_note: client-level DP's noise as a likely cause of a divergence, or None without it.
      hides_uploads: whether the server never sees an individual upload (secure aggregation).
    """

    finish: Callable[[Any, Any], dict]
    reducer: Callable[[int], Any] | None
    rejects_summed: bool
    process: Callable[..., tuple[dict, dict, UploadReport]]
    init_memory: Callable[[Any, int], dict]
    bytes_per_client: Callable[[Any], float]
    privacy_metrics: Callable[[Sequence[float | None]], dict[str, float]]
    statement: dict[str, Any]
    outlier_note: str
    noise_note: str | None
    hides_uploads: bool


def make_plan(cfg: PipelineConfig, algorithm, *, num_clients: int,
              expected_participants: float, clients_per_round: int, rounds: int,
              synchronous: bool = True) -> UploadPlan:
    """The upload pipeline of a run and its plan.

    Args:
      cfg: the run's upload settings.
      algorithm: the `algorithms.base.Algorithm` (its `aggregation`, `name`, `norm_keys`,
        `mean_server_step`).
      num_clients: clients in the population.
      expected_participants: participants per round in expectation (the DP denominator).
      clients_per_round: participants of a fixed-size round.
      rounds: the run's rounds (DP's noise calibration).
      synchronous: False for buffered asynchronous rounds (each upload is kept: no streaming).

    Returns:
      The `UploadPlan`. ValueError naming the field for settings that cannot be honest.
    """
    pipeline = UploadPipeline(cfg, algorithm.aggregation, algorithm.name, num_clients,
                              expected_participants, clients_per_round, rounds)
    dp = cfg.dp
    reducer = _reducer(pipeline) if synchronous and algorithm.mean_server_step else None
    return UploadPlan(
        finish=_finish(pipeline, algorithm.norm_keys),
        reducer=reducer,
        rejects_summed=(reducer is not None and pipeline.streamed_clip_norm is None
                        and outlier_rule(pipeline.cfg)[0] > 0),
        process=pipeline.process,
        init_memory=pipeline.init_memory,
        bytes_per_client=functools.partial(_bytes_per_client, cfg),
        privacy_metrics=functools.partial(_privacy_metrics, pipeline),
        statement=privacy.statement(dp) if dp is not None else {},
        outlier_note=pipeline.outlier_note,
        noise_note=(None if dp is None else
                    f"Client-level DP adds noise of std {pipeline.noise_multiplier:.3g} x "
                    f"{dp.clip_norm:g} on the sum: lower config.dp.noise_multiplier / raise "
                    "config.dp.target_epsilon or config.dp.clip_norm, or lower the learning "
                    "rate"),
        hides_uploads=cfg.secagg is not None)


def _finish(pipeline: UploadPipeline, norm_keys: tuple[str, ...]):
    """The per-client function of `UploadPlan.finish`: the update norm, and, when the pipeline
    transforms nothing, its checks' facts (`UploadPipeline.client_facts`: 'finite', 'norm'),
    computed while the client's upload is in cache instead of in passes over the stacked
    uploads after the round's training."""
    streams_clipped = pipeline.streamed_clip_norm is not None
    facts = (pipeline.client_facts if (not pipeline.active or streams_clipped)
             and pipeline.aggregation != "none" else None)

    def finish(upload, template):
        out = {UPLOAD_NORM: validation.upload_norm(upload, template, norm_keys)}
        return out if facts is None else {**facts(upload, template), **out}

    return finish


def _reducer(pipeline: UploadPipeline):
    """bucket -> the reducer of `UploadPlan.reducer`, or None: a method whose server step is a
    weighted mean, and a pipeline that either transforms nothing (no compression, privacy,
    robust aggregation: `StreamingMean`) or is client-level DP that adds its noise to the sum
    of the clipped updates (`UploadPipeline.streamed_clip_norm`: `StreamingClippedSum`)."""
    if pipeline.aggregation not in ("per_cohort", "shared"):
        return None
    reject_nonfinite = bool(pipeline.cfg.upload.reject_nonfinite)
    clip = pipeline.streamed_clip_norm
    if clip is not None:
        clipped = streaming.clipped_sum_reducer(clip, reject_nonfinite)
        return lambda bucket: clipped
    if pipeline.active:
        return None
    mean = streaming.mean_reducer(reject_nonfinite)
    return lambda bucket: mean


def _bytes_per_client(cfg: PipelineConfig, template) -> float:
    """Bytes one client sends per round as the simulated network sees it."""
    if not jax.tree.leaves(template):
        return 0.0
    if cfg.secagg is not None:  # dense masked ring elements
        return tree_size(template)[0] * cfg.encoding.ring_bits / 8
    return compression.encoded_bytes(template, cfg.upload) + (4 if cfg.dp is not None else 0)


def _privacy_metrics(pipeline: UploadPipeline, realized: Sequence[float | None]
                     ) -> dict[str, float]:
    """dp_epsilon (at dp_delta) spent so far, from dp_accounting composed over the noise each
    round really released (None: a round released nothing); {} without client-level DP."""
    dp = pipeline.cfg.dp
    if dp is None:
        return {}
    eps = privacy.epsilon_of_rounds(dp, realized, pipeline.num_clients,
                                    pipeline.clients_per_round)
    return {"dp_epsilon": eps, "dp_delta": dp.delta,
            "dp_noise_multiplier": pipeline.noise_multiplier, "dp_clip_norm": dp.clip_norm}
