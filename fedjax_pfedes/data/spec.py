"""What a model needs to know about its inputs: modality, shape, dtype and normalization stats.

One `InputSpec` is derived from the training pool of a dataset and handed to every client model
and to E_proxy, so all of them normalize inputs identically (docs/design.md).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

MODALITIES = ("image", "text", "tabular")


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """Inputs of one dataset.

    Attributes:
      modality: 'image' ([H, W, C] pixels), 'text' ([L] token ids, 0 = padding) or 'tabular'
        ([F] real features).
      shape: shape of one example.
      dtype: numpy dtype name of the stored inputs ('uint8', 'float32', 'int32').
      mean, std: image: per-channel statistics in [0, 1] units; tabular: per-feature statistics
        in the features' own units; text: empty.
      vocab_size: text only: number of token ids (0 = padding, 1 = out of vocabulary).
    """

    modality: str
    shape: tuple[int, ...]
    dtype: str
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()
    vocab_size: int = 0

    def __post_init__(self):
        if self.modality not in MODALITIES:
            raise ValueError(f"modality must be one of {MODALITIES}, got '{self.modality}'")
        if self.modality == "text" and self.vocab_size < 2:
            raise ValueError(f"text inputs need vocab_size >= 2, got {self.vocab_size}")
        if self.modality != "text" and len(self.mean) != self.shape[-1]:
            raise ValueError(f"{self.modality} inputs of shape {self.shape} need one mean/std per "
                             f"channel or feature ({self.shape[-1]}), got {len(self.mean)}")

    def dummy_batch(self) -> jnp.ndarray:
        """A batch of one all-zero example, for initializing parameters."""
        return jnp.zeros((1,) + tuple(self.shape), jnp.dtype(self.dtype))
