"""FedBN: FedAvg that keeps BatchNorm layers local, run per architecture cohort.

Li et al., "FedBN: Federated Learning on Non-IID Features via Local Batch Normalization", ICLR
2021. Every parameter of a BatchNorm layer (scale, bias) and its running statistics stay on the
client; all other parameters are averaged as in FedAvg (sample-count weights). A participant
receives the cohort's shared parameters, combines them with its own BatchNorm leaves, trains E
local epochs (BatchNorm in training mode over the real samples of each batch; padded rows are
masked out of the batch statistics) and uploads the shared parameters only. Evaluation uses the
client's own running statistics.

BatchNorm layers are found from the model itself: the modules that own a 'batch_stats' entry.
For a cohort whose backbone has no BatchNorm (e.g. the quick start's convnet3/convnet5/vit),
FedBN is FedAvg; use a BatchNorm backbone such as `convnet3_bn` to see the difference.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import optax
from flax import struct, traverse_util

from fedjax_pfedes import aggregation
from fedjax_pfedes.algorithms import local_training
from fedjax_pfedes.algorithms.base import Algorithm, CohortProgram, classifier_program
from fedjax_pfedes.algorithms.fedavg import FedAvgConfig, fedavg_config
from fedjax_pfedes.algorithms.registry import AlgorithmEntry, register
from fedjax_pfedes.models import architectures


@struct.dataclass
class ServerState:
    shared: dict  # arch -> the cohort's averaged non-BatchNorm parameters
    round: jnp.ndarray


@struct.dataclass
class ClientState:
    local: dict        # this client's BatchNorm parameters (flat path -> array)
    batch_stats: dict  # this client's running statistics ({} without BatchNorm)
    rounds: jnp.ndarray


def batch_norm_modules(variables: dict) -> set[tuple[str, ...]]:
    """Module paths that own running statistics, i.e. the BatchNorm layers."""
    stats = traverse_util.flatten_dict(variables.get("batch_stats", {}))
    return {path[:-1] for path in stats}


def split_params(params: dict, bn_modules: set[tuple[str, ...]]) -> tuple[dict, dict]:
    """(shared, local) flat dicts of `params`: local = the leaves of BatchNorm modules."""
    flat = traverse_util.flatten_dict(params)
    local = {p: v for p, v in flat.items() if p[:-1] in bn_modules}
    shared = {p: v for p, v in flat.items() if p[:-1] not in bn_modules}
    return shared, local


def join_params(shared: dict, local: dict) -> dict:
    return traverse_util.unflatten_dict({**shared, **local})


def _path_keys(flat: dict) -> dict:
    """Flat dict with '/'-joined string keys (a pytree with readable leaf names)."""
    return {"/".join(p): v for p, v in flat.items()}


def _tuple_keys(flat: dict) -> dict:
    return {tuple(k.split("/")): v for k, v in flat.items()}


def fedbn(cfg: FedAvgConfig) -> Algorithm:
    """Builds FedBN per cohort."""
    local_opt = local_training.sgd(cfg.lr_local, cfg.local_momentum)
    dummy_x = cfg.input_spec.dummy_batch()
    models, bn_of = {}, {}

    def model_of(arch: str):
        if arch not in models:
            models[arch] = architectures.classifier_model(arch, cfg.num_classes, cfg.input_spec,
                                                     allow_batch_norm=True)
            variables = jax.eval_shape(models[arch].init, jax.random.key(0), dummy_x)
            bn_of[arch] = batch_norm_modules(variables)
        return models[arch]

    def init_server(rng: jax.Array, archs: tuple[str, ...]) -> ServerState:
        shared = {}
        for i, a in enumerate(archs):
            variables = model_of(a).init(jax.random.fold_in(rng, i), dummy_x)
            shared[a] = _path_keys(split_params(variables["params"], bn_of[a])[0])
        return ServerState(shared, jnp.zeros((), jnp.int32))

    def broadcast(state: ServerState, arch: str) -> dict:
        return state.shared[arch]

    def server_update(state: ServerState, groups: Mapping[str, tuple[dict, jax.Array]]
                      ) -> ServerState:
        shared = dict(state.shared)
        for arch, group in groups.items():
            average, total = aggregation.weighted_mean([group])
            average = jax.tree.map(lambda a, o: a.astype(o.dtype), average, shared[arch])
            shared[arch] = local_training.select_tree(total > 0, average, shared[arch])
        return ServerState(shared, state.round + 1)

    def cohort_program(arch: str) -> CohortProgram:
        model = model_of(arch)
        bn_modules = bn_of[arch]

        def init_client(rng: jax.Array) -> ClientState:
            variables = model.init(rng, dummy_x)
            params = variables["params"]
            return ClientState(_path_keys(split_params(params, bn_modules)[1]),
                               variables.get("batch_stats", {}), jnp.zeros((), jnp.int32))

        def variables_of(params, batch_stats):
            return {"params": params, **({"batch_stats": batch_stats} if bn_modules else {})}

        def train_step(carry, batch):
            params, batch_stats, opt_state = carry
            x, y, mask = batch

            def loss_fn(p):
                if not bn_modules:
                    return local_training.cross_entropy(model.apply({"params": p}, x), y,
                                                        mask), batch_stats
                logits, updated = model.apply(variables_of(p, batch_stats), x, train=True,
                                              mask=mask, mutable=["batch_stats"])
                return local_training.cross_entropy(logits, y, mask), updated["batch_stats"]

            (ce, new_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
            updates, opt_state = local_opt.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), new_stats, opt_state), jnp.stack([ce])

        def client_update(shared, state: ClientState, data, rng):
            start = join_params(_tuple_keys(shared), _tuple_keys(state.local))
            # As in FedAvg, the local optimizer state is fresh every round.
            (params, batch_stats, _), sums, n_active = local_training.run_local_epochs(
                train_step, (start, state.batch_stats, local_opt.init(start)), data, rng,
                cfg.local_schedule())
            new_shared, new_local = split_params(params, bn_modules)
            upload = _path_keys(new_shared)
            metrics = {"train_ce_loss": sums[0] / jnp.maximum(n_active, 1.0),
                       "local_steps": n_active}
            return upload, ClientState(_path_keys(new_local), batch_stats,
                                       state.rounds + 1), metrics

        def predict(shared, state: ClientState, x):
            params = join_params(_tuple_keys(shared), _tuple_keys(state.local))
            return model.apply(variables_of(params, state.batch_stats), x)

        return classifier_program(init_client, client_update, predict)

    return Algorithm(init_server, broadcast, broadcast, server_update, cohort_program,
                     mean_server_step=True)

register(AlgorithmEntry(
    "fedbn", lambda inputs: fedbn(fedavg_config(inputs)), aggregation="per_cohort",
    asynchronous=True, batch_norm=True,
    summary="FedBN (Li et al., ICLR 2021): BatchNorm kept local, per cohort"))
