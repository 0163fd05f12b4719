"""The server side of an upload, as a chain of small pure transforms over stacked client updates.

Like `optax.chain`, each stage is a separate function, configured from `config.upload` and tested
alone: validation (`validation`), compression
(`compression`), client-level differential privacy (`privacy`), secure aggregation
(`secure_aggregation`) and robust aggregation (`robust`); `pipeline` runs them in order.
"""
