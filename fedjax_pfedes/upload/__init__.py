"""What happens to an upload between a client and the server step, as a chain of stages.

Like `optax.chain`, each stage (`stages.py`) is one object with a client half (what one client
does to its update before sending it, vmapped) and a server half (rejections, weights, the
aggregate); `pipeline.build_stages` orders them from `config.upload`, `config.dp` and
`config.secagg` (their built sections: `settings.PipelineConfig`), and
`pipeline.UploadPipeline` runs them every round, reporting what it did in a typed
`pipeline.UploadReport`. The engine reads all of it through one object, `plan.UploadPlan`
(`plan.make_plan`): the client half run inside the training program, the streaming reducer, the
server half and the facts a run states (bytes sent, privacy spent). The math of each stage
lives in its own module and is tested alone: validation (`validation`), compression
(`compression`), client-level differential privacy (`privacy`), secure aggregation
(`secure_aggregation`) and robust aggregation (`robust`).
"""
