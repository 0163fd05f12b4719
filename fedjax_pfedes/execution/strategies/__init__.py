"""The built-in execution strategies, one module each, registering itself on import; imported
here in the order 'auto' tries them: 'vmap' (`mapped`), 'loop' (`looped`), 'scan' (`scanned`),
then 'shard' (`sharded`, on a mesh). `protocol` holds what a strategy is (`Strategy`,
`CohortRunner`, `Finishing`) and the registry."""

# isort: off
from fedjax_pfedes.execution.strategies import mapped  # noqa: F401  ('vmap')
from fedjax_pfedes.execution.strategies import looped  # noqa: F401  ('loop')
from fedjax_pfedes.execution.strategies import scanned  # noqa: F401  ('scan')
from fedjax_pfedes.execution.strategies import sharded  # noqa: F401  ('shard')
# isort: on
