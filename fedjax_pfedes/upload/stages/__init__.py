"""Upload stages: each transform of an upload is one object, and the pipeline is their list.

In the spirit of `optax.chain`, a stage has up to two halves:

- `init_state(template, members)`: the stage's persistent per-client state, stacked over a
  cohort's members (e.g. top-k's error-feedback memory), or None when it keeps none. The
  pipeline keeps every cohort's states as {stage name: state}; they are part of the run's
  `SimState` and checkpointed with it, whatever the stage.
- `client(delta, memory, key, info) -> (delta, memory, info)`: what ONE client does to its
  update before sending it (traced; the pipeline vmaps and jits the chain of client halves
  once). `memory` is this client's row of the stage's state (None without one); `info` is a
  dict of per-client facts later stages read on the server (e.g. 'finite', 'norm').
- `server(r: RoundUploads)`: what the server does with the round's uploads (host side, in chain
  order): reject clients, set aggregation weights, or compute the aggregate.
- `report_keys`: the entries of the round's report the stage writes that go into the round's
  monitoring record (metrics.jsonl); the engine copies what the stages declare and names none.

`transforms` says whether a stage changes the values of accepted uploads; when no stage does, the
algorithm receives the uploads exactly as they arrived (bit for bit).

A stage class registers itself (`@register_stage`) with its `position` in the chain and a
`from_config(cfg, noise_multiplier)` that returns the stage a run's `settings.PipelineConfig`
asks for, or None; `pipeline.build_stages` builds the chain from the registry. A stage may own
a config section (`section`: a `fedjax_pfedes.Section` subclass, e.g. `SECTION = 'my_stage'`
with `amount: float = param(0.0, "...", at_least(0))`): it joins the default config
(`fedjax_pfedes.default_config()`), a run builds it once (its ranges checked before anything
else is built) and the stage reads it as `cfg.section(MySection)`. A new stage is one class (in
a module of this package, or of your own) with its registration.
"""

# isort: off
from fedjax_pfedes.upload.stages.stage import (  # noqa: F401  (the package's API)
    STAGES,
    RoundUploads,
    UploadStage,
    declared_fields,
    own_sections,
    register_stage,
    scope_key,
)
from fedjax_pfedes.upload.stages.checks import FiniteCheck, NormOutlierCheck, outlier_rule  # noqa: F401
from fedjax_pfedes.upload.stages.transforms import Clip, Compression  # noqa: F401
from fedjax_pfedes.upload.stages.aggregators import (  # noqa: F401
    DPNoisyMean,
    RobustAggregation,
    Weighting,
)
from fedjax_pfedes.upload.stages.secagg import SecureAggregation  # noqa: F401
# isort: on
