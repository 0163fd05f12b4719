"""FedKD: adaptive mutual distillation with a shared small mentee, SVD-compressed uploads.

Wu et al., "Communication-efficient federated learning via knowledge distillation", Nature
Communications 13, 2032 (2022). Every client holds a private mentor (its own architecture), a copy
of the shared mentee (one small architecture, `FedKDConfig.shared_arch`) and a private linear map
W_h between their hidden representations. Both models end in the common d-dimensional feature
space of `ProjectedClassifier` (h = P(F(x))), so W_h is d x d. One local step minimizes

  CE_t + CE_s + [KL(p_s || p_t) + KL(p_t || p_s) + MSE(h_t, W_h h_s)] / (CE_t + CE_s)

over mentor, mentee and W_h: the paper's adaptive distillation and hidden losses of both models,
each scaled by the inverse of the summed task losses (treated as a weight: no gradient flows
through the denominator; the KL targets are stop-gradients). Participants upload the mentee's
update compressed by truncated SVD: every leaf with >= 2 dimensions, reshaped to a matrix, keeps
the fewest singular values whose energy (sum of squares) reaches the threshold T, raised linearly
from `energy_start` to `energy_end` over the rounds as in the paper; vectors go dense. The
upload carries the reconstructed update (the simulator sums dense trees), and the metrics carry
the number of numbers the factors take (`upload_encoded_params`), which the round summary
reports as the upload size. The server adds the weighted mean update to the mentee. The downlink
is not compressed here (the paper compresses it too). Inference uses the mentor.
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
    classifier_program,
)
from fedjax_pfedes.algorithms.registry import AlgorithmEntry, BuildInputs, register
from fedjax_pfedes.config.fields import Section, between, param
from fedjax_pfedes.models import architectures


@dataclasses.dataclass(frozen=True)
class FedKDSection(Section):
    """`config.fedkd`: the SVD energy threshold of the uploads, raised linearly from
    energy_start (round 1) to energy_end (the last round)."""

    SECTION: ClassVar[str] = "fedkd"

    energy_start: float = param(0.95, "SVD energy kept in the uploads, first round",
                                between(0, 1, "(]"))
    energy_end: float = param(0.98, "SVD energy kept in the uploads, last round",
                              between(0, 1, "(]"))


@dataclasses.dataclass(frozen=True)
class FedKDConfig(FedKDSection, LocalTrainingConfig):
    """FedKD's settings: its section, local training and

    Attributes:
      dim: the hidden dimension both mentor and mentee project to (config.proxy_dim).
      shared_arch: the shared mentee ('' = the modality's default small model;
        config.clients.shared_arch).
      rounds: the round at which the energy reaches energy_end (config.train.rounds).
    """

    dim: int = 128
    shared_arch: str = ""
    rounds: int = 1


def _config(inputs: BuildInputs) -> FedKDConfig:
    c = inputs.settings
    return FedKDConfig(**inputs.local_training(), **inputs.own(), dim=c.proxy_dim,
                       shared_arch=c.clients.shared_arch, rounds=c.train.rounds)


@struct.dataclass
class ServerState:
    mentee: dict
    round: jnp.ndarray


@struct.dataclass
class ClientState:
    mentor: dict
    hidden_map: dict  # W_h
    opt_state: optax.OptState


def svd_truncate(matrix: jnp.ndarray, energy: jax.Array) -> tuple[jnp.ndarray, jax.Array]:
    """Rank-k reconstruction of a 2-D `matrix`, k = the fewest singular values whose squared sum
    reaches `energy` (a fraction) of the total; returns (reconstruction, k)."""
    u, s, vt = jnp.linalg.svd(matrix.astype(jnp.float32), full_matrices=False)
    squared = s ** 2
    before = jnp.cumsum(squared) - squared  # energy of the values ranked above each one
    keep = before < energy * jnp.sum(squared)
    keep = keep & (jnp.sum(squared) > 0)
    return (u * jnp.where(keep, s, 0.0)) @ vt, jnp.sum(keep)


def compress_update(update: dict, energy: jax.Array) -> tuple[dict, jax.Array]:
    """SVD-compresses every leaf of >= 2 dimensions (as [prod(leading dims), last dim]);
    returns (reconstructed tree, numbers transmitted: k (m + n + 1) per matrix, size per vector)."""
    leaves, treedef = jax.tree.flatten(update)
    out, sent = [], jnp.zeros((), jnp.float32)
    for leaf in leaves:
        if leaf.ndim >= 2 and min(leaf.shape[-1], leaf.size // leaf.shape[-1]) > 1:
            m, n = leaf.size // leaf.shape[-1], leaf.shape[-1]
            rebuilt, k = svd_truncate(leaf.reshape(m, n), energy)
            out.append(rebuilt.reshape(leaf.shape).astype(leaf.dtype))
            sent = sent + k.astype(jnp.float32) * (m + n + 1)
        else:
            out.append(leaf)
            sent = sent + leaf.size
    return jax.tree.unflatten(treedef, out), sent


def energy_threshold(round_index: jax.Array, cfg: FedKDConfig) -> jax.Array:
    """T for 0-based `round_index`: energy_start at the first round, energy_end at the
    last."""
    frac = jnp.clip(round_index / max(cfg.rounds - 1, 1), 0.0, 1.0)
    return cfg.energy_start + (cfg.energy_end - cfg.energy_start) * frac


def fedkd(cfg: FedKDConfig) -> Algorithm:
    """Builds FedKD for heterogeneous cohorts."""
    local_opt = local_training.sgd(cfg.lr_local, cfg.local_momentum)
    dummy_x = cfg.input_spec.dummy_batch()
    mentee_model = architectures.projected_classifier(
        architectures.shared_arch(cfg.shared_arch, cfg.input_spec), cfg.num_classes, cfg.dim,
        cfg.input_spec)
    hidden_map = nn.Dense(cfg.dim, use_bias=False)

    def init_server(rng: jax.Array, archs: tuple[str, ...] = ()) -> ServerState:
        del archs
        return ServerState(mentee_model.init(rng, dummy_x), jnp.zeros((), jnp.int32))

    def broadcast(state: ServerState, arch: str = "") -> dict:
        del arch
        return {"mentee": state.mentee, "energy": energy_threshold(state.round, cfg)}

    def upload_template(state: ServerState, arch: str = "") -> dict:
        del arch
        return jax.tree.map(jnp.zeros_like, state.mentee)  # uploads are updates

    def server_update(state: ServerState, groups: Mapping[str, tuple[dict, jax.Array]]
                      ) -> ServerState:
        mean_update = aggregation.mean_over_cohorts(
            jax.tree.map(jnp.zeros_like, state.mentee), groups)
        return ServerState(jax.tree.map(jnp.add, state.mentee, mean_update), state.round + 1)

    def cohort_program(arch: str) -> CohortProgram:
        model = architectures.projected_classifier(arch, cfg.num_classes, cfg.dim, cfg.input_spec)

        def init_client(rng: jax.Array) -> ClientState:
            k1, k2 = jax.random.split(rng)
            mentor = model.init(k1, dummy_x)
            w_h = hidden_map.init(k2, jnp.zeros((1, cfg.dim)))
            return ClientState(mentor, w_h, local_opt.init((mentor, w_h)))

        def train_step(carry, batch):
            (mentor, mentee, w_h), (opt_private, opt_mentee) = carry
            x, y, mask = batch

            def loss_fn(trees):
                t_logits, h_t = model.apply(trees[0], x)
                s_logits, h_s = mentee_model.apply(trees[1], x)
                ce_t = local_training.cross_entropy(t_logits, y, mask)
                ce_s = local_training.cross_entropy(s_logits, y, mask)
                hidden = local_training.masked_mean(
                    jnp.mean((h_t - hidden_map.apply(trees[2], h_s)) ** 2, axis=-1), mask)
                distill = (local_training.distillation_kl(s_logits, t_logits, mask)
                           + local_training.distillation_kl(t_logits, s_logits, mask) + hidden)
                weight = 1.0 / jax.lax.stop_gradient(jnp.maximum(ce_t + ce_s, 1e-6))
                return ce_t + ce_s + weight * distill, jnp.stack([ce_t, ce_s, hidden])

            grads, stats = jax.grad(loss_fn, has_aux=True)((mentor, mentee, w_h))
            up_p, opt_private = local_opt.update((grads[0], grads[2]), opt_private,
                                                 (mentor, w_h))
            up_s, opt_mentee = local_opt.update(grads[1], opt_mentee, mentee)
            mentor, w_h = optax.apply_updates((mentor, w_h), up_p)
            return ((mentor, optax.apply_updates(mentee, up_s), w_h),
                    (opt_private, opt_mentee)), stats

        def client_update(received, state: ClientState, data, rng):
            mentee = received["mentee"]
            carry = ((state.mentor, mentee, state.hidden_map),
                     (state.opt_state, local_opt.init(mentee)))
            ((mentor, new_mentee, w_h), (opt_private, _)), sums, n_active = (
                local_training.run_local_epochs(train_step, carry, data, rng, cfg.local_schedule()))
            update = jax.tree.map(jnp.subtract, new_mentee, mentee)
            compressed, sent = compress_update(update, received["energy"])
            n = jnp.maximum(n_active, 1.0)
            metrics = {"train_ce_loss": sums[0] / n, "train_mentee_ce_loss": sums[1] / n,
                       "train_hidden_loss": sums[2] / n, "local_steps": n_active,
                       "upload_encoded_params": sent}
            return compressed, ClientState(mentor, w_h, opt_private), metrics

        def predict(received, state: ClientState, x):
            del received
            return model.apply(state.mentor, x)[0]

        return classifier_program(init_client, client_update, predict)

    return Algorithm(init_server, broadcast, upload_template, server_update, cohort_program,
                     encoded_upload_params=lambda metrics: metrics["upload_encoded_params"])

register(AlgorithmEntry(
    "fedkd", lambda inputs: fedkd(_config(inputs)), shared_model=True,
    schedule_depends_on_rounds=True,
    section=FedKDSection, private_optimizer=True,
    reads=("proxy_dim", "clients.shared_arch", "train.rounds"),
    summary="FedKD (Wu et al., Nature Communications 2022): distilled mentee, SVD uploads"))
