"""FML: federated mutual learning between a private model and a shared small model.

Shen et al., "Federated Mutual Learning", 2020 (arXiv:2006.16765). Every client holds its private
model (any architecture, never uploaded) and a copy of the shared "meme" model (one small
architecture for all clients, `FMLConfig.shared_arch`). Each round a participant receives the
global meme, trains both models together by deep mutual learning on every batch:

  L_private = alpha * CE(private) + (1 - alpha) * KL(p_meme || p_private)
  L_meme    = beta  * CE(meme)    + (1 - beta)  * KL(p_private || p_meme)

(the other model's prediction is a fixed target in each KL), and uploads its meme; the server
averages the memes of all cohorts by sample counts. Inference uses the private model. The
private model's optimizer state persists across rounds; the meme's is fresh every round.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

import jax
import jax.numpy as jnp
import optax
from flax import struct

from fedjax_pfedes import aggregation
from fedjax_pfedes.algorithms import local_training
from fedjax_pfedes.algorithms.base import (
    Algorithm,
    CohortProgram,
    LocalTrainingConfig,
    classifier_program,
)
from fedjax_pfedes.algorithms.registry import AlgorithmEntry, BuildInputs, register
from fedjax_pfedes.config.fields import Section, between, param
from fedjax_pfedes.models import architectures


@dataclasses.dataclass(frozen=True)
class FMLSection(Section):
    """`config.fml`: each model's loss is alpha (or beta) x its CE plus the rest x the KL term
    to the other model."""

    SECTION: ClassVar[str] = "fml"

    alpha: float = param(0.5, "CE weight of the private model (the rest: KL to the meme)",
                         between(0, 1, "[]"))
    beta: float = param(0.5, "CE weight of the shared meme model (the rest: KL to the private "
                        "one)", between(0, 1, "[]"))


@dataclasses.dataclass(frozen=True)
class FMLConfig(FMLSection, LocalTrainingConfig):
    """FML's settings: its section, local training and

    Attributes:
      shared_arch: the small "meme" model every client shares ('' = the modality's default,
        `architectures.DEFAULT_SHARED_ARCH`; config.clients.shared_arch).
    """

    shared_arch: str = ""


def _config(inputs: BuildInputs) -> FMLConfig:
    return FMLConfig(**inputs.local_training(), **inputs.own(),
                     shared_arch=inputs.settings.clients.shared_arch)


@struct.dataclass
class ServerState:
    meme: dict
    round: jnp.ndarray


@struct.dataclass
class ClientState:
    params: dict  # the private model
    opt_state: optax.OptState


def mutual_losses(private_logits, meme_logits, labels, mask, alpha: float, beta: float):
    """(L_private, L_meme, CE private, CE meme) of deep mutual learning as used by FML."""
    ce_p = local_training.cross_entropy(private_logits, labels, mask)
    ce_m = local_training.cross_entropy(meme_logits, labels, mask)
    loss_p = alpha * ce_p + (1 - alpha) * local_training.distillation_kl(meme_logits,
                                                                         private_logits, mask)
    loss_m = beta * ce_m + (1 - beta) * local_training.distillation_kl(private_logits,
                                                                       meme_logits, mask)
    return loss_p, loss_m, ce_p, ce_m


def fml(cfg: FMLConfig) -> Algorithm:
    """Builds FML for heterogeneous cohorts."""
    local_opt = local_training.sgd(cfg.lr_local, cfg.local_momentum)
    dummy_x = cfg.input_spec.dummy_batch()
    meme_model = architectures.classifier_model(
        architectures.shared_arch(cfg.shared_arch, cfg.input_spec), cfg.num_classes,
        cfg.input_spec)

    def init_server(rng: jax.Array, archs: tuple[str, ...] = ()) -> ServerState:
        del archs
        return ServerState(meme_model.init(rng, dummy_x), jnp.zeros((), jnp.int32))

    def broadcast(state: ServerState, arch: str = "") -> dict:
        del arch
        return state.meme

    def server_update(state: ServerState, groups: Mapping[str, tuple[dict, jax.Array]]
                      ) -> ServerState:
        return ServerState(aggregation.mean_over_cohorts(state.meme, groups), state.round + 1)

    def cohort_program(arch: str) -> CohortProgram:
        model = architectures.classifier_model(arch, cfg.num_classes, cfg.input_spec)

        def init_client(rng: jax.Array) -> ClientState:
            params = model.init(rng, dummy_x)
            return ClientState(params, local_opt.init(params))

        def train_step(carry, batch):
            (private, meme), (opt_p, opt_m) = carry
            x, y, mask = batch

            def loss_fn(both):
                p_logits, m_logits = model.apply(both[0], x), meme_model.apply(both[1], x)
                loss_p, loss_m, ce_p, ce_m = mutual_losses(p_logits, m_logits, y, mask,
                                                           cfg.alpha, cfg.beta)
                # Each loss reaches only its own model: the KL targets are stop-gradients.
                return loss_p + loss_m, jnp.stack([ce_p, ce_m])

            grads, stats = jax.grad(loss_fn, has_aux=True)((private, meme))
            up_p, opt_p = local_opt.update(grads[0], opt_p, private)
            up_m, opt_m = local_opt.update(grads[1], opt_m, meme)
            return ((optax.apply_updates(private, up_p), optax.apply_updates(meme, up_m)),
                    (opt_p, opt_m)), stats

        def client_update(meme, state: ClientState, data, rng):
            carry = ((state.params, meme), (state.opt_state, local_opt.init(meme)))
            ((private, new_meme), (opt_p, _)), sums, n_active = local_training.run_local_epochs(
                train_step, carry, data, rng, cfg.local_schedule())
            n = jnp.maximum(n_active, 1.0)
            metrics = {"train_ce_loss": sums[0] / n, "train_meme_ce_loss": sums[1] / n,
                       "local_steps": n_active}
            return new_meme, ClientState(private, opt_p), metrics

        def predict(meme, state: ClientState, x):
            del meme
            return model.apply(state.params, x)

        return classifier_program(init_client, client_update, predict)

    return Algorithm(init_server, broadcast, broadcast, server_update, cohort_program,
                     mean_server_step=True)

register(AlgorithmEntry(
    "fml", lambda inputs: fml(_config(inputs)), asynchronous=True, shared_model=True,
    section=FMLSection, private_optimizer=True, reads=("clients.shared_arch",),
    summary="FML (Shen et al., 2020): mutual learning with a shared meme model"))
