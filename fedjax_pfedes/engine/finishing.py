"""What a round passes a cohort's runner as its broadcast: the plain broadcast, or a
`Finishing` that also runs the upload plan's client half (`UploadPlan.finish`) in the training
program and, under 'scan', streams the uploads (`UploadPlan.reducer`)."""

from __future__ import annotations

import jax

from fedjax_pfedes.execution.strategies import protocol
from fedjax_pfedes.upload.plan import UploadPlan


def sent_to_runner(upload: UploadPlan, attack_active: bool, runner, bucket: int, broadcast,
                   template):
    """What a round passes a cohort's `runner.update` as its broadcast.

    Args:
      upload: the run's upload plan.
      attack_active: whether a simulated attack rewrites uploads after training (then the
        facts are computed from what the attackers send, after it).
      runner: the cohort's runner.
      bucket: the cohort's slot bucket (the streaming reducer's size).
      broadcast: what the method broadcasts to the cohort.
      template: the upload template (the `Finishing` operand).

    Returns:
      `broadcast` as it is (an attack, or a method that uploads nothing), or an
      `execution.strategies.protocol.Finishing` computing `upload.finish` per client and, for a
      runner that streams uploads ('scan') where the plan has a reducer, summing them.
      `execution.choice` times the runners with the same.
    """
    if attack_active or not jax.tree.leaves(template):
        return broadcast
    streams = (upload.reducer is not None
               and protocol.strategy(runner.strategy).streams_uploads)
    return protocol.Finishing(broadcast, template, upload.finish,
                              upload.reducer(bucket) if streams else None)
