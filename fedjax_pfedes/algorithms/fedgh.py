"""FedGH: a generalized global header trained by the server on clients' class prototypes.

Yi et al., "FedGH: Heterogeneous Federated Learning with Generalized Global Header", ACM MM 2023.
Every client model is F_k -> P_k (to the common dimension d) -> header H (d -> classes); the header
has the same shape everywhere and the server keeps the global one. Each round a participant
replaces its header with the global header, trains its whole model with CE for E local epochs,
then computes its class prototypes (mean d-dimensional representation per class over its training
data, with the trained model) and uploads them with the per-class counts. The server trains the
global header on the uploaded (prototype, class) pairs with cross-entropy: `gh_server_epochs`
passes of SGD at `gh_server_lr`, one step per pair in a fixed order (cohort, client slot, class),
pairs of absent classes and padded slots skipped. Inference: the client's own F_k, P_k with the
global header. Only prototypes go up (classes x d numbers + counts per client).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import optax
from flax import struct

from fedjax_pfedes import local_training
from fedjax_pfedes.algorithms.base import Algorithm, CohortProgram
from fedjax_pfedes.algorithms.fedavg import evaluate_classifier
from fedjax_pfedes.algorithms.fedproto import class_prototypes
from fedjax_pfedes.algorithms.lg_fedavg import ClientState, HeteroConfig, with_head
from fedjax_pfedes.models import registry


@struct.dataclass
class ServerState:
    head: dict
    round: jnp.ndarray


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


def fedgh(cfg: HeteroConfig) -> Algorithm:
    """Builds FedGH for heterogeneous cohorts."""
    local_opt = local_training.sgd(cfg.lr_local, cfg.local_momentum)
    dummy_x = cfg.input_spec.dummy_batch()

    def init_server(rng: jax.Array, archs: tuple[str, ...]) -> ServerState:
        model = registry.projected_classifier(archs[0], cfg.num_classes, cfg.dim, cfg.input_spec)
        return ServerState(model.init(rng, dummy_x)["params"]["classifier"],
                           jnp.zeros((), jnp.int32))

    def head_apply(head: dict, e: jnp.ndarray) -> jnp.ndarray:
        return e @ head["kernel"] + head["bias"]  # the Dense header of ProjectedClassifier

    def broadcast(state: ServerState, arch: str = "") -> dict:
        del arch
        return state.head

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
            jnp.concatenate(valid), cfg.gh_server_lr, cfg.gh_server_epochs)
        return ServerState(head, state.round + 1)

    def cohort_program(arch: str) -> CohortProgram:
        model = registry.projected_classifier(arch, cfg.num_classes, cfg.dim, cfg.input_spec)

        def init_client(rng: jax.Array) -> ClientState:
            params = model.init(rng, dummy_x)
            return ClientState(params, local_opt.init(params))

        def logits_fn(params, x):
            return model.apply(params, x)[0]

        train_step = local_training.cross_entropy_step(logits_fn, local_opt)

        def client_update(global_head, state: ClientState, data, rng):
            start = with_head(state.params, global_head)
            (params, opt_state), sums, n_active = local_training.run_local_epochs(
                train_step, (start, state.opt_state), data, rng, cfg.batch_size,
                cfg.local_epochs, cfg.unroll_local_steps)
            _, e = model.apply(params, data.x)
            mask = jnp.arange(data.y.shape[0]) < data.sizes
            prototypes, counts = class_prototypes(e, data.y, mask, cfg.num_classes)
            metrics = {"train_ce_loss": sums[0] / jnp.maximum(n_active, 1.0),
                       "local_steps": n_active}
            return ({"prototypes": prototypes, "counts": counts},
                    ClientState(params, opt_state), metrics)

        def evaluate(global_head, state: ClientState, test, global_x, global_y):
            return evaluate_classifier(logits_fn, with_head(state.params, global_head), test,
                                       global_x, global_y)

        return CohortProgram(init_client, client_update, evaluate)

    return Algorithm("fedgh", init_server, broadcast, upload_template, server_update,
                     cohort_program, aggregation="custom")
