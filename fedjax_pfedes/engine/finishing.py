"""How a round's uploads are finished inside the cohort's training program: the per-client facts
(`upload_finish`: the update norm, the checks' facts), the streaming reducer of 'scan' cohorts
(`stream_reducer`) and the broadcast that carries both to a runner (`sent_to_runner`)."""

from __future__ import annotations

import functools

import jax

from fedjax_pfedes.engine.records import UPLOAD_NORM
from fedjax_pfedes.engine.sections import RoundSettings
from fedjax_pfedes.execution.strategies import protocol
from fedjax_pfedes.upload import streaming, validation
from fedjax_pfedes.upload.pipeline import UploadPipeline
from fedjax_pfedes.upload.stages import outlier_rule


def upload_finish(algorithm, pipeline: UploadPipeline):
    """The per-client function a cohort's program runs on each upload
    (`execution.strategies.protocol.Finishing`, with the upload template as its operand): the update
    norm the monitoring reports, and, when the upload pipeline transforms nothing, its checks' facts
    (`UploadPipeline.client_facts`: 'finite', 'norm'). Computed while the client's upload is in
    cache, instead of passes over the stacked uploads after the round's training. Build it once per
    run: it is part of the compiled program's identity."""
    streams_clipped = pipeline.streamed_clip_norm is not None
    facts = (pipeline.client_facts if (not pipeline.active or streams_clipped)
             and pipeline.aggregation != "none" else None)
    keys = algorithm.norm_keys

    def finish(upload, template):
        out = {UPLOAD_NORM: validation.upload_norm(upload, template, keys)}
        return out if facts is None else {**facts(upload, template), **out}

    return finish


def stream_reducer(settings: RoundSettings, algorithm, pipeline: UploadPipeline):
    """bucket -> the reducer with which a 'scan' cohort of that bucket sums its uploads as
    they are made (`upload.streaming`), or None where the stacked uploads are needed: the
    server step must be a weighted mean (`Algorithm.mean_server_step`), the rounds synchronous
    (buffered asynchronous rounds keep each upload), and the upload pipeline must either
    transform nothing (no compression, privacy, robust aggregation or other weights than
    samples: `StreamingMean`) or be client-level DP that adds its noise to the sum of the
    clipped updates (`UploadPipeline.streamed_clip_norm`: `StreamingClippedSum`)."""
    if (not algorithm.mean_server_step or settings.asynchronous is not None
            or pipeline.aggregation not in ("per_cohort", "shared")):
        return None
    clip = pipeline.streamed_clip_norm
    if clip is not None:
        clipped = streaming.clipped_sum_reducer(clip, bool(pipeline.cfg.reject_nonfinite))
        return lambda bucket: clipped
    if pipeline.active:
        return None
    factor, _ = outlier_rule(pipeline.cfg)
    hold = settings.execution.scan_held_uploads if factor > 0 else 0
    return functools.partial(streaming.reducer, hold,
                             reject_nonfinite=bool(pipeline.cfg.reject_nonfinite))


def sent_to_runner(finish, reducer, attack_active: bool, runner, bucket: int, broadcast,
                   template):
    """What a round passes a cohort's `runner.update` as its broadcast: the plain broadcast, or
    an `execution.strategies.protocol.Finishing` that computes `finish` per client in the training
    program (not when an attack rewrites the uploads after it, nor for methods that upload nothing)
    and, for a 'scan' runner with a `reducer` (bucket -> reducer, `stream_reducer`), streams the
    uploads. `execution.choice` times the runners with the same."""
    if finish is None or attack_active or not jax.tree.leaves(template):
        return broadcast
    streams = reducer is not None and protocol.strategy(runner.strategy).streams_uploads
    return protocol.Finishing(broadcast, template, finish, reducer(bucket) if streams else None)
