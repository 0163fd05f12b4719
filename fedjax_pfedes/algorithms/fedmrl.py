"""FedMRL: a shared small model fused with each private model by Matryoshka representations.

Yi et al., "Federated Model Heterogeneous Matryoshka Representation Learning", NeurIPS 2024.
Every client model has two feature extractors on the same input: the shared homogeneous small
extractor G (architecture `FedMRLConfig.shared_arch`, its ReLU features) and the client's
private heterogeneous extractor F_k. A private lightweight projector fuses them,
r = P_k([G(x), F_k(x)]) in R^d, and two headers read nested prefixes of r (Matryoshka
representation learning, Kusupati et al., NeurIPS 2022): the shared header reads r[:d1]
(`sub_dim`, 0 = d/2), the private header reads all of r. The local loss is
CE(shared header) + CE(private header); every part is trained together. Participants upload G and
the shared header; the server averages them over all cohorts by sample counts. Inference uses the
private header's output (as in HtFLlib's FedMRL).
Parameter subtrees: 'shared_backbone', 'shared_header' (uploaded) and
'private_backbone', 'projector', 'private_header' (kept).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax import struct

from fedjax_pfedes import aggregation
from fedjax_pfedes.algorithms import local_training
from fedjax_pfedes.algorithms.base import (
    Algorithm,
    CohortProgram,
    LocalTrainingConfig,
    check_range,
    classifier_program,
)
from fedjax_pfedes.algorithms.lg_fedavg import ClientState
from fedjax_pfedes.algorithms.registry import (
    AlgorithmEntry,
    BuildInputs,
    local_override,
    register,
)
from fedjax_pfedes.config.fields import Section, at_least, param
from fedjax_pfedes.data.spec import InputSpec
from fedjax_pfedes.errors import ConfigError
from fedjax_pfedes.models import architectures
from fedjax_pfedes.models.backbones import BACKBONES
from fedjax_pfedes.models.layers import InputNormalization

SHARED_KEYS = ("shared_backbone", "shared_header")


@dataclasses.dataclass(frozen=True)
class FedMRLSection(Section):
    """`config.fedmrl`."""

    SECTION: ClassVar[str] = "fedmrl"

    sub_dim: int = param(0, "the nested (Matryoshka) dimension read by the shared header "
                         "(<= config.proxy_dim; 0 = half of it)", at_least(0))
    local_momentum: float = local_override(
        "local_momentum", 0.0, "its fused representation feeds unnormalized linear headers; "
        "with momentum 0.9 it diverged on the quick start (docs/baselines_history.md)")


@dataclasses.dataclass(frozen=True)
class FedMRLConfig(FedMRLSection, LocalTrainingConfig):
    """FedMRL's settings: its section, local training and

    Attributes:
      dim: the fused representation's dimension d (config.proxy_dim).
      shared_arch: the shared small extractor ('' = the modality's default small model;
        config.clients.shared_arch).
    """

    dim: int = 128
    shared_arch: str = ""


def _config(inputs: BuildInputs) -> FedMRLConfig:
    c = inputs.settings
    return FedMRLConfig(**inputs.local_training(), **inputs.own(), dim=c.proxy_dim,
                        shared_arch=c.clients.shared_arch)


@struct.dataclass
class ServerState:
    shared: dict
    round: jnp.ndarray


class MatryoshkaModel(nn.Module):
    """Returns (private logits, shared logits) of FedMRL's fused model."""

    arch: str
    shared_arch: str
    num_classes: int
    dim: int
    sub_dim: int
    spec: InputSpec

    def setup(self):
        self.normalize = InputNormalization(self.spec)
        self.shared_backbone = BACKBONES[self.shared_arch].build(self.spec)
        self.shared_header = nn.Dense(self.num_classes)
        self.private_backbone = BACKBONES[self.arch].build(self.spec)
        self.projector = nn.Dense(self.dim)
        self.private_header = nn.Dense(self.num_classes)

    def __call__(self, x: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
        x = self.normalize(x)
        g = self.shared_backbone(x)
        f = self.private_backbone(x)
        r = self.projector(jnp.concatenate([g, f], axis=-1))
        return self.private_header(r), self.shared_header(r[:, : self.sub_dim])


def shared_part(params: dict) -> dict:
    return {k: params["params"][k] for k in SHARED_KEYS}


def with_shared(params: dict, shared: dict) -> dict:
    return {**params, "params": {**params["params"], **shared}}


def fedmrl(cfg: FedMRLConfig) -> Algorithm:
    """Builds FedMRL for heterogeneous cohorts."""
    sub_dim = cfg.sub_dim or cfg.dim // 2
    if not 0 < sub_dim <= cfg.dim:
        raise ConfigError(f"config.fedmrl.sub_dim must be in [0, config.proxy_dim="
                         f"{cfg.dim}] (0 = half of it), got {cfg.sub_dim}")
    local_opt = local_training.sgd(cfg.lr_local, cfg.local_momentum)
    dummy_x = cfg.input_spec.dummy_batch()
    small = architectures.shared_arch(cfg.shared_arch, cfg.input_spec)

    def model_of(arch: str) -> MatryoshkaModel:
        architectures.check_architecture(arch, modality=cfg.input_spec.modality)
        if architectures.uses_batch_norm(arch):
            raise ConfigError(f"config.clients.architectures: '{arch}' has BatchNorm layers, "
                             "which FedMRL does not handle; use it with config.algorithm='fedbn'")
        return MatryoshkaModel(arch, small, cfg.num_classes, cfg.dim, sub_dim, cfg.input_spec)

    def init_server(rng: jax.Array, archs: tuple[str, ...]) -> ServerState:
        return ServerState(shared_part(model_of(archs[0]).init(rng, dummy_x)),
                           jnp.zeros((), jnp.int32))

    def broadcast(state: ServerState, arch: str = "") -> dict:
        del arch
        return state.shared

    def server_update(state: ServerState, groups: Mapping[str, tuple[dict, jax.Array]]
                      ) -> ServerState:
        return ServerState(aggregation.mean_over_cohorts(state.shared, groups),
                           state.round + 1)

    def cohort_program(arch: str) -> CohortProgram:
        model = model_of(arch)

        def init_client(rng: jax.Array) -> ClientState:
            params = model.init(rng, dummy_x)
            return ClientState(params, local_opt.init(params))

        def train_step(carry, batch):
            params, opt_state = carry
            x, y, mask = batch

            def loss_fn(p):
                private_logits, shared_logits = model.apply(p, x)
                ce_private = local_training.cross_entropy(private_logits, y, mask)
                ce_shared = local_training.cross_entropy(shared_logits, y, mask)
                return ce_private + ce_shared, jnp.stack([ce_private, ce_shared])

            grads, stats = jax.grad(loss_fn, has_aux=True)(params)
            updates, opt_state = local_opt.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), stats

        def client_update(shared, state: ClientState, data, rng):
            start = with_shared(state.params, shared)
            (params, opt_state), sums, n_active = local_training.run_local_epochs(
                train_step, (start, state.opt_state), data, rng, cfg.local_schedule())
            upload = shared_part(params)
            n = jnp.maximum(n_active, 1.0)
            metrics = {"train_ce_loss": sums[0] / n, "train_shared_ce_loss": sums[1] / n,
                       "local_steps": n_active}
            return upload, ClientState(params, opt_state), metrics

        def predict(shared, state: ClientState, x):
            return model.apply(with_shared(state.params, shared), x)[0]

        return classifier_program(init_client, client_update, predict)

    return Algorithm(init_server, broadcast, broadcast, server_update, cohort_program,
                     mean_server_step=True)

register(AlgorithmEntry(
    "fedmrl", lambda inputs: fedmrl(_config(inputs)), asynchronous=True,
    shared_model=True,
    check=lambda c: check_range(c.fedmrl.sub_dim, 0, c.proxy_dim,
                                f"config.fedmrl.sub_dim (0 = half of config.proxy_dim="
                                f"{c.proxy_dim})"),
    private_optimizer=True, reads=("proxy_dim", "clients.shared_arch"),
    # Late in training at rates near its divergence edge an honest client's update of the shared
    # model reaches 0.39 of its norm at 250x the round's median (docs/threat_model.md).
    norm_model_ratio=0.5,
    summary="FedMRL (Yi et al., NeurIPS 2024): nested representation learning",
    section=FedMRLSection))
