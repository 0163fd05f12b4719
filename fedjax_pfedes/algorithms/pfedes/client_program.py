"""One pFedES client's program: its local step (the private model's step on CE + lam x align, then
E_proxy's step on align; with DP-SGD, or with a stop-gradient removed, the variants of
`PFedESConfig`), its local update over epochs, and its evaluation. Written once for one client
(`CohortProgram`); the execution strategies run it over a cohort."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from fedjax_pfedes.algorithms import local_training
from fedjax_pfedes.algorithms.base import CohortProgram, classifier_metrics
from fedjax_pfedes.algorithms.pfedes.hyperparameters import PFedESConfig


@struct.dataclass
class ClientState:
    """A client's private model, its optimizer state and its local step count (for warm-up)."""

    params: dict
    opt_state: optax.OptState
    steps: jnp.ndarray


@dataclasses.dataclass(frozen=True)
class Parts:
    """What a cohort's client functions share: the hyper-parameters, the cohort's private model,
    E_proxy, the alignment loss, the private model's optimizer, E_proxy's learning rate and a
    dummy input batch (for initialization)."""

    cfg: PFedESConfig
    model: Any
    proxy: Any
    align: Callable
    local_opt: optax.GradientTransformation
    lr_proxy: float
    dummy_x: jax.Array


def freeze_backbone(grads: dict, frozen: jnp.ndarray) -> dict:
    """`grads` with the backbone's gradients zeroed where `frozen` (the warm-up's steps)."""
    inner = dict(grads["params"])
    inner["backbone"] = jax.tree.map(lambda g: jnp.where(frozen, 0.0, g), inner["backbone"])
    return {**grads, "params": inner}


def init_client(parts: Parts, rng: jax.Array) -> ClientState:
    params = parts.model.init(rng, parts.dummy_x)
    return ClientState(params, parts.local_opt.init(params), jnp.zeros((), jnp.int32))

def local_loss(parts: Parts, p, batch):
    x, y, mask, e_proxy = batch
    logits, e_local = parts.model.apply(p, x)
    ce = local_training.cross_entropy(logits, y, mask)
    al = parts.align(e_local, e_proxy, mask)
    return ce + parts.cfg.lam * al, (ce, al, e_local)

def proxy_loss_fn(parts: Parts, q, batch):
    x, mask, e_target = batch
    return parts.align(parts.proxy.apply(q, x), e_target, mask), ()

def private_step(parts: Parts, params, proxy_params, e_proxy, batch):
    """Both steps with DP-SGD: per-example clipping and noise (own keys per step)."""
    x, y, mask, key = batch
    k_local, k_proxy = jax.random.split(key)
    grads, _ = local_training.private_gradient(functools.partial(local_loss, parts), params,
                                               (x, y, mask, e_proxy), mask, k_local,
                                               parts.cfg.dp_sgd)
    _, (ce, al, e_local) = local_loss(parts, params, (x, y, mask, e_proxy))
    e_target = jax.lax.stop_gradient(e_local)
    proxy_grads, proxy_loss = local_training.private_gradient(
        functools.partial(proxy_loss_fn, parts), proxy_params, (x, mask, e_target), mask,
        k_proxy, parts.cfg.dp_sgd)
    return grads, proxy_grads, ce, al, proxy_loss

def coupled_step(parts: Parts, params, proxy_params, batch):
    """Both gradients with one or both stop-gradients removed (F5)."""
    x, y, mask = batch[:3]

    def objectives(p, q):
        logits, e_local = parts.model.apply(p, x)
        e_proxy = parts.proxy.apply(q, x)
        target_for_local = (jax.lax.stop_gradient(e_proxy) if parts.cfg.stop_gradient_proxy
                            else e_proxy)
        target_for_proxy = (jax.lax.stop_gradient(e_local) if parts.cfg.stop_gradient_local
                            else e_local)
        ce = local_training.cross_entropy(logits, y, mask)
        al = parts.align(e_local, target_for_local, mask)
        proxy_loss = parts.align(e_proxy, target_for_proxy, mask)
        return ce + parts.cfg.lam * al, proxy_loss, ce, al

    (g_local_p, g_local_q), (g_proxy_p, g_proxy_q) = jax.jacrev(
        lambda p, q: objectives(p, q)[:2], argnums=(0, 1))(params, proxy_params)
    _, proxy_loss, ce, al = objectives(params, proxy_params)
    # Each side descends its own loss; a removed stop-gradient adds the other loss's
    # gradient (zero while the stop-gradient is in place).
    grads = jax.tree.map(jnp.add, g_local_p, g_proxy_p)
    proxy_grads = jax.tree.map(jnp.add, g_proxy_q, g_local_q)
    return grads, proxy_grads, ce, al, proxy_loss

def train_step(parts: Parts, carry, batch):
    params, opt_state, (proxy_params, proxy_trace), steps = carry
    x, y, mask = batch[:3]
    # One forward pass of E_proxy serves both steps: its output is a constant target in
    # the local step, and its VJP gives the parts.proxy step's gradient.
    e_proxy, proxy_vjp = jax.vjp(lambda q: parts.proxy.apply(q, x), proxy_params)
    e_proxy = jax.lax.stop_gradient(e_proxy)

    if parts.cfg.dp_sgd is not None:
        grads, proxy_grads, ce, al, proxy_loss = private_step(parts, params, proxy_params,
                                                              e_proxy, batch)
    elif not (parts.cfg.stop_gradient_proxy and parts.cfg.stop_gradient_local):
        grads, proxy_grads, ce, al, proxy_loss = coupled_step(parts, params, proxy_params,
                                                              batch)
    else:
        grads, (ce, al, e_local) = jax.grad(functools.partial(local_loss, parts), has_aux=True)(
            params, (x, y, mask, e_proxy))
        e_target = jax.lax.stop_gradient(e_local)
        proxy_loss, d_e_proxy = jax.value_and_grad(
            lambda e: parts.align(e, e_target, mask))(e_proxy)
        (proxy_grads,) = proxy_vjp(d_e_proxy)
    grads = freeze_backbone(grads, steps < parts.cfg.warmup_steps)
    updates, new_opt_state = parts.local_opt.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    if parts.cfg.proxy_momentum > 0:  # heavy-ball, as optax.sgd: t = g + m t; q -= lr t
        proxy_trace = jax.tree.map(lambda t, g: g + parts.cfg.proxy_momentum * t, proxy_trace,
                                   proxy_grads)
        proxy_grads = proxy_trace
    new_proxy = jax.tree.map(lambda q, g: q - parts.lr_proxy * g, proxy_params, proxy_grads)

    return ((new_params, new_opt_state, (new_proxy, proxy_trace), steps + 1),
            jnp.stack([ce, al, proxy_loss]))

def client_update(parts: Parts, global_proxy, state: ClientState, data, rng):
    trace = (jax.tree.map(jnp.zeros_like, global_proxy) if parts.cfg.proxy_momentum > 0
             else ())
    carry = (state.params, state.opt_state, (global_proxy, trace), state.steps)
    (params, opt_state, (local_proxy, _), steps), sums, n_active = \
        local_training.run_local_epochs(functools.partial(train_step, parts), carry, data, rng,
                                        parts.cfg.local_schedule(),
                                        step_keys=parts.cfg.dp_sgd is not None)
    n_steps = jnp.maximum(n_active, 1.0)
    delta = jax.tree.map(jnp.subtract, local_proxy, global_proxy)
    metrics = {
        "train_ce_loss": sums[0] / n_steps,
        "train_align_loss": sums[1] / n_steps,
        "train_proxy_align_loss": sums[2] / n_steps,
        "local_steps": n_active,
        "proxy_update_norm": optax.tree.norm(delta),
    }
    if parts.cfg.align_diagnostics:
        # The alignment loss on the client's first batch of rows, right after receiving
        # the aggregated E_proxy and at the end of its local training: across two
        # participations of a client, start minus the previous end is the jump
        # aggregation causes (F4).
        rows = min(parts.cfg.batch_size, data.y.shape[0])
        x0, mask0 = data.x[:rows], jnp.arange(rows) < data.sizes
        metrics["align_loss_at_start"] = parts.align(
            parts.model.apply(state.params, x0)[1], parts.proxy.apply(global_proxy, x0), mask0)
        metrics["align_loss_at_end"] = parts.align(
            parts.model.apply(params, x0)[1], parts.proxy.apply(local_proxy, x0), mask0)
    return local_proxy, ClientState(params, opt_state, steps), metrics

def evaluate(parts: Parts, global_proxy, state: ClientState, test):
    logits, e_local = parts.model.apply(state.params, test.x)
    mask = jnp.arange(test.y.shape[0]) < test.sizes
    e_proxy = parts.proxy.apply(global_proxy, test.x)
    return {**classifier_metrics(logits, test),
            "test_align_loss": parts.align(e_local, e_proxy, mask)}

def predict(parts: Parts, global_proxy, state: ClientState, x):
    del global_proxy  # inference uses the private parts.model alone
    return parts.model.apply(state.params, x)[0]


def cohort_program(parts: Parts) -> CohortProgram:
    """The cohort's per-client functions, bound to `parts`.

    Args:
      parts: the cohort's model and what every client shares.

    Returns:
      Its `CohortProgram`.
    """
    return CohortProgram(functools.partial(init_client, parts),
                         functools.partial(client_update, parts),
                         functools.partial(evaluate, parts), functools.partial(predict, parts))
