"""FedGH: a generalized global header trained by the server on clients' class prototypes.

Yi et al., "FedGH: Heterogeneous Federated Learning with Generalized Global Header", ACM MM 2023.
Every client model is F_k -> P_k (to the common dimension d) -> header H (d -> classes); the header
has the same shape everywhere and the server keeps the global one. Each round a participant
replaces its header with the global header, trains its whole model with CE for E local epochs,
then computes its class prototypes (mean d-dimensional representation per class over its training
data, with the trained model) and uploads them with the per-class counts. The server trains the
global header on the uploaded (prototype, class) pairs with cross-entropy: `server_epochs`
passes of SGD at `server_lr`, one step per pair in a fixed order (cohort, client slot, class),
pairs of absent classes and padded slots skipped. Inference: the client's own F_k, P_k with the
global header. Only prototypes go up (classes x d numbers + counts per client).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

import jax
import jax.numpy as jnp
import optax

from fedjax_pfedes.algorithms import local_training
from fedjax_pfedes.algorithms.base import Algorithm, CohortProgram
from fedjax_pfedes.algorithms.fedproto import class_prototypes
from fedjax_pfedes.algorithms.lg_fedavg import (
    LGFedAvgConfig,
    ServerState,
    global_head_program,
    global_head_server,
)
from fedjax_pfedes.algorithms.registry import AlgorithmEntry, BuildInputs, register
from fedjax_pfedes.config.fields import Section, above, at_least, param


@dataclasses.dataclass(frozen=True)
class FedGHSection(Section):
    """`config.fedgh`: the server's training of the global header."""

    SECTION: ClassVar[str] = "fedgh"

    server_lr: float = param(0.05, "server SGD learning rate on the uploaded prototypes",
                             above(0))
    server_epochs: int = param(1, "server epochs over the uploaded prototypes per round",
                               at_least(1))


@dataclasses.dataclass(frozen=True)
class FedGHConfig(FedGHSection, LGFedAvgConfig):
    """FedGH's settings: its section and LG-FedAvg's."""


def _config(inputs: BuildInputs) -> FedGHConfig:
    return FedGHConfig(**inputs.local_training(), **inputs.own(),
                       dim=inputs.settings.proxy_dim)


def train_header_on_prototypes(head: dict, head_apply, prototypes: jnp.ndarray,
                               labels: jnp.ndarray, valid: jnp.ndarray, lr: float,
                               epochs: int) -> dict:
    """SGD over (prototype, label) pairs, one CE step per valid pair, `epochs` passes in order.

    Args:
      prototypes: [pairs, d]; labels: [pairs]; valid: [pairs] bool (invalid pairs are skipped).
    """
    def step(h, pair):
        proto, label, ok = pair
        grads = jax.grad(lambda p: optax.softmax_cross_entropy_with_integer_labels(
            head_apply(p, proto[None]), label[None])[0])(h)
        new = jax.tree.map(lambda w, g: w - lr * g, h, grads)
        return local_training.select_tree(ok, new, h), None

    def one_epoch(h, _):
        return jax.lax.scan(step, h, (prototypes, labels, valid))[0], None

    return jax.lax.scan(one_epoch, head, None, length=epochs)[0]


def fedgh(cfg: FedGHConfig) -> Algorithm:
    """Builds FedGH for heterogeneous cohorts."""
    init_server, broadcast = global_head_server(cfg)

    def head_apply(head: dict, e: jnp.ndarray) -> jnp.ndarray:
        return e @ head["kernel"] + head["bias"]  # the Dense header of ProjectedClassifier

    def upload_template(state: ServerState, arch: str = "") -> dict:
        del arch
        return {"prototypes": jnp.zeros((cfg.num_classes, cfg.dim), jnp.float32),
                "counts": jnp.zeros((cfg.num_classes,), jnp.float32)}

    def server_update(state: ServerState, groups: Mapping[str, tuple[dict, jax.Array]]
                      ) -> ServerState:
        protos, labels, valid = [], [], []
        for uploads, weights in groups.values():
            slots = weights.shape[0]
            protos.append(uploads["prototypes"].reshape(-1, cfg.dim))
            labels.append(jnp.tile(jnp.arange(cfg.num_classes), slots))
            valid.append(((uploads["counts"] > 0) & (weights[:, None] > 0)).reshape(-1))
        head = train_header_on_prototypes(
            state.head, head_apply, jnp.concatenate(protos), jnp.concatenate(labels),
            jnp.concatenate(valid), cfg.server_lr, cfg.server_epochs)
        return ServerState(head, state.round + 1)

    def prototype_upload(model, params, data, global_head):
        del global_head
        _, e = model.apply(params, data.x)
        mask = jnp.arange(data.y.shape[0]) < data.sizes
        prototypes, counts = class_prototypes(e, data.y, mask, cfg.num_classes)
        return {"prototypes": prototypes, "counts": counts}, {}

    def cohort_program(arch: str) -> CohortProgram:
        return global_head_program(arch, cfg, prototype_upload)

    return Algorithm(init_server, broadcast, upload_template, server_update, cohort_program)

register(AlgorithmEntry(
    "fedgh", lambda inputs: fedgh(_config(inputs)), aggregation="custom",
    section=FedGHSection, private_optimizer=True, reads=("proxy_dim",),
    summary="FedGH (Yi et al., ACM MM 2023): a global header trained on prototypes"))
