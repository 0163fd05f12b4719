"""Client-side transforms of an update before it is sent: compression (top-k with error feedback,
bf16 or QSGD values) and clipping to a norm."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fedjax_pfedes.config.defaults import UploadSection
from fedjax_pfedes.upload import compression, privacy
from fedjax_pfedes.upload.stages.stage import UploadStage, register_stage


@register_stage
@dataclasses.dataclass
class Compression(UploadStage):
    """Top-k with error feedback (the client's `memory`), then bf16 or QSGD values."""

    cfg: UploadSection
    name = "compression"
    position = 20

    @classmethod
    def from_config(cls, cfg, noise_multiplier):
        del noise_multiplier
        return cls(cfg.upload)

    @property
    def transforms(self) -> bool:
        return self.cfg.compresses

    @property
    def client_keyed(self) -> bool:
        return self.cfg.compresses  # error feedback's memory, QSGD's stochastic rounding

    def init_state(self, template, members: int):
        """Error-feedback memory, zeros [members, ...] (float32), when top-k is on."""
        if self.cfg.topk_fraction >= 1:
            return None
        return jax.tree.map(lambda a: jnp.zeros((members, *jnp.shape(a)), jnp.float32),
                            template)

    def client(self, delta, memory, key, info):
        delta, memory = compression.compress(delta, memory, key, self.cfg)
        return delta, memory, info


@register_stage
@dataclasses.dataclass
class Clip(UploadStage):
    """Client-level DP: the update scaled to L2 norm <= `clip_norm`."""

    clip_norm: float
    name = "clip"
    transforms = True
    position = 40

    @classmethod
    def from_config(cls, cfg, noise_multiplier):
        del noise_multiplier
        return cls(cfg.dp.clip_norm) if cfg.dp is not None else None

    def client(self, delta, memory, key, info):
        delta, _ = privacy.clip_update(delta, self.clip_norm)
        return delta, memory, info

    def server_enforced(self, secagg: bool) -> bool:
        # Central DP: the trusted server clips what it receives. Distributed DP (secure
        # aggregation): clipping is the client's own code, which a rogue client skips.
        return not secagg
