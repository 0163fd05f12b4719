"""Pieces of one client's local training that every algorithm shares.

All functions act on ONE client's padded arrays and are safe under `jax.vmap`: a client runs its
own number of local steps in a rolled loop (compiled once), and padded samples never enter a loss.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from fedjax_pfedes.config.defaults import TrainSection
from fedjax_pfedes.data import augmentation
from fedjax_pfedes.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class BatchSchedule:
    """Which rows each local step reads.

    Attributes:
      indices: [steps, batch] row indices into the client's padded arrays.
      sample_mask: [steps, batch] True where the row is a real sample.
      step_active: [steps] True where the step has at least one real sample; inactive steps leave
        every parameter and optimizer state untouched.
    """

    indices: jnp.ndarray
    sample_mask: jnp.ndarray
    step_active: jnp.ndarray


@dataclasses.dataclass(frozen=True)
class LocalSchedule:
    """How a client walks its own data in a round.

    Attributes:
      batch_size: B (capped at the client's padded length).
      epochs: the most local epochs any client runs (fewer via a per-client step limit).
      unroll: run the padded schedule as one unrolled scan (the tested reference) instead of the
        rolled loop of the client's own steps.
      drop_partial_batch: skip an epoch's last, partial batch when the client has at least one
        full batch (PyTorch's `drop_last`): a client of 161 rows with B = 32 then takes 5 steps
        per epoch, not 6 with a one-sample sixth. Off by default (every sample is used each
        epoch, as PyTorch's default data loader does); docs/baselines.md measures both.
      augment: image augmentation applied to each batch inside the step
        (`data.augmentation.KINDS`; 'none' = off), keyed by the step's padded-schedule position.
      augment_fill: the erased pixels' per-channel value in [0, 1] units (the dataset's mean).
    """

    batch_size: int
    epochs: int
    unroll: bool = False
    drop_partial_batch: bool = TrainSection.drop_partial_batch
    augment: str = TrainSection.augment
    augment_fill: tuple[float, ...] = ()

    def with_epochs(self, epochs: int) -> LocalSchedule:
        return dataclasses.replace(self, epochs=epochs)


def batches_per_epoch(size, batch: int, drop_partial: bool):
    """Local steps of one epoch for a client with `size` real rows: ceil(size / B), or
    floor(size / B) with `drop_partial` when size >= B (a client smaller than B keeps its one
    partial batch)."""
    ceil = -(-size // batch)
    return jnp.where(size >= batch, size // batch, ceil) if drop_partial else ceil


def steps_per_epoch(capacity: int, batch_size: int) -> int:
    """Local steps of one epoch for a client padded to `capacity` rows (static)."""
    return -(-capacity // min(batch_size, capacity))


def batch_schedule(rng: jax.Array, size: jnp.ndarray, capacity: int, batch_size: int,
                   epochs: int, step_limit: jnp.ndarray | None = None,
                   drop_partial: bool = False) -> BatchSchedule:
    """Shuffled mini-batches over `epochs` passes of a client's `size` real rows.

    A client with n real rows takes ceil(n / B) steps per epoch, like a data loader over its own
    data; the remaining steps up to ceil(capacity / B) are inactive. Each epoch reshuffles.
    With `step_limit`, only the first `step_limit` real steps are active (fewer epochs, or the
    partial work a straggler finishes before the round deadline). With `drop_partial`, an
    epoch's last partial batch is inactive when the client has a full one.
    """
    batch = min(batch_size, capacity)
    per_epoch = steps_per_epoch(capacity, batch)
    positions = jnp.arange(per_epoch * batch)
    row = jnp.arange(capacity)

    def one_epoch(key):
        noise = jax.random.uniform(key, (capacity,))
        order = jnp.argsort(jnp.where(row < size, noise, 2.0 + row))
        order = jnp.pad(order, (0, per_epoch * batch - capacity))
        return order.reshape(per_epoch, batch)

    indices = jax.vmap(one_epoch)(jax.random.split(rng, epochs)).reshape(-1, batch)
    used = batches_per_epoch(size, batch, True) * batch if drop_partial else size
    sample_mask = jnp.tile((positions < jnp.minimum(size, used)).reshape(per_epoch, batch),
                           (epochs, 1))
    if step_limit is not None:
        real_step = jnp.cumsum(sample_mask.any(axis=1)) - 1  # index among real steps
        sample_mask = sample_mask & (real_step < step_limit)[:, None]
    return BatchSchedule(indices, sample_mask, sample_mask.any(axis=1))


def masked_mean(values: jnp.ndarray, mask: jnp.ndarray) -> jnp.ndarray:
    """Mean of `values` over entries where `mask` is True (0 when none is)."""
    mask = mask.astype(values.dtype)
    return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def cross_entropy(logits: jnp.ndarray, labels: jnp.ndarray, mask: jnp.ndarray) -> jnp.ndarray:
    """Masked mean softmax cross-entropy."""
    return masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels), mask)


def distillation_kl(teacher_logits: jnp.ndarray, student_logits: jnp.ndarray,
                    mask: jnp.ndarray) -> jnp.ndarray:
    """Masked mean of KL(softmax(teacher) || softmax(student)); the teacher is not
    differentiated (Hinton et al. 2015; deep mutual learning, Zhang et al. CVPR 2018)."""
    teacher = jax.lax.stop_gradient(teacher_logits)
    log_t = jax.nn.log_softmax(teacher)
    kl = jnp.sum(jnp.exp(log_t) * (log_t - jax.nn.log_softmax(student_logits)), axis=-1)
    return masked_mean(kl, mask)


@dataclasses.dataclass(frozen=True)
class DPSGDConfig:
    """Sample-level DP-SGD (Abadi et al., "Deep Learning with Differential Privacy", CCS 2016):
    per-example gradients clipped to L2 <= `clip_norm`, N(0, (noise_multiplier * clip_norm)^2)
    added to their sum, divided by the batch size."""

    clip_norm: float
    noise_multiplier: float

    def __post_init__(self):
        if self.clip_norm <= 0:
            raise ConfigError(f"config.dp_sgd.clip_norm must be > 0, got {self.clip_norm}")
        if self.noise_multiplier < 0:
            raise ConfigError(f"config.dp_sgd.noise_multiplier must be >= 0, got "
                             f"{self.noise_multiplier}")


def private_gradient(loss_fn, params, batch: tuple, mask: jnp.ndarray, rng: jax.Array,
                     dp: DPSGDConfig):
    """The DP-SGD gradient of a batch loss that is a masked mean of per-example terms.

    Args:
      loss_fn: (params, batch) -> (loss, aux); evaluated on one example at a time (every array
        of `batch` sliced to one row), so it must not couple examples (no BatchNorm, no
        contrastive terms).
      batch: arrays with a leading axis of B rows (the batch size).
      mask: [B] real rows; padded rows contribute nothing.

    Returns:
      ((sum_i clip(g_i) + N(0, (sigma C)^2)) / B, mean loss over the real rows).
    """
    def one(*example):
        return jax.value_and_grad(
            lambda p: loss_fn(p, tuple(e[None] for e in example))[0])(params)

    losses, grads = jax.vmap(one)(*batch)
    sq = sum(jnp.sum(g.reshape(g.shape[0], -1).astype(jnp.float32) ** 2, axis=1)
             for g in jax.tree.leaves(grads))
    scale = jnp.minimum(1.0, dp.clip_norm / jnp.maximum(jnp.sqrt(sq), 1e-12))
    scale = scale * mask.astype(jnp.float32)
    leaves, treedef = jax.tree.flatten(grads)
    keys = jax.random.split(rng, len(leaves))
    std = dp.noise_multiplier * dp.clip_norm
    noisy = [((jnp.tensordot(scale, g.astype(jnp.float32), axes=1)
               + std * jax.random.normal(k, g.shape[1:], jnp.float32)) / mask.shape[0]
              ).astype(g.dtype) for g, k in zip(leaves, keys, strict=True)]
    return jax.tree.unflatten(treedef, noisy), masked_mean(losses, mask)


def select_tree(pred: jnp.ndarray, on_true, on_false):
    """`on_true` where the scalar `pred` holds, else `on_false`, leaf by leaf."""
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def sgd(learning_rate: float, momentum: float) -> optax.GradientTransformation:
    """The local optimizer: SGD, with heavy-ball momentum when `momentum` > 0."""
    return optax.sgd(learning_rate, momentum=momentum if momentum > 0 else None)


def local_step_count(size: jnp.ndarray, capacity: int, batch_size: int, epochs: int,
                     step_limit: jnp.ndarray | None = None,
                     drop_partial: bool = False) -> jnp.ndarray:
    """The local steps a client with `size` real rows runs: epochs * `batches_per_epoch`, capped
    at `step_limit` when given (a traced int32 scalar)."""
    batch = min(batch_size, capacity)
    count = epochs * batches_per_epoch(size, batch, drop_partial)
    return count if step_limit is None else jnp.minimum(count, step_limit)


def run_local_epochs(train_step, carry, data, rng: jax.Array, schedule: LocalSchedule,
                     step_keys: bool = False):
    """Runs `schedule.epochs` passes of `train_step` over one client's padded `data`.

    The batches are those of `batch_schedule` (each epoch reshuffles the client's own rows).
    By default the client runs exactly its own `local_step_count` steps: a rolled loop with a
    dynamic trip count, so the step is compiled once whatever the schedule's length, and a client
    with fewer rows than the cohort's largest computes fewer steps (under `jax.vmap` the loop runs
    as long as the slowest client in the batch; the others' extra iterations change nothing).

    Args:
      train_step: (carry, (x, y, sample_mask[, key])) -> (carry, stats [num_stats]).
      carry: the training state threaded through the steps.
      data: one client's `ClientArrays` (x [capacity, ...], y [capacity], sizes scalar, and an
        optional step_limit scalar).
      schedule: batch size, epochs, partial batches; with `schedule.unroll`, run the whole
        padded schedule (epochs * ceil(capacity / B) positions) as a fully unrolled `lax.scan`
        instead, with the positions past the client's data masked out. Same numbers; kept as
        the reference the rolled loop is tested and benchmarked against, and taken whenever
        the padded schedule has one position (no loop then: one masked step).
      step_keys: append a fresh PRNG key to every batch tuple (DP-SGD noise).

    Returns:
      (final carry, per-stat sums over the steps run, number of steps run as float32).
    """
    plan = schedule
    batch_size, epochs, drop = schedule.batch_size, schedule.epochs, schedule.drop_partial_batch
    capacity = data.y.shape[0]
    batch = min(batch_size, capacity)
    per_epoch = steps_per_epoch(capacity, batch)
    if schedule.unroll or epochs * per_epoch == 1:
        # One padded position (the cross-device case: a client's data fits one batch, one
        # epoch): the step itself, without a loop around it (docs/performance.md).
        return _run_unrolled(train_step, carry, data, rng, schedule, step_keys)
    size = data.sizes
    real_per_epoch = jnp.maximum(batches_per_epoch(size, batch, drop), 1)
    total = local_step_count(size, capacity, batch_size, epochs,
                             getattr(data, "step_limit", None), drop)
    schedule = batch_schedule(rng, size, capacity, batch_size, epochs, drop_partial=drop)
    keys = (jax.random.split(jax.random.fold_in(rng, 1), epochs * per_epoch) if step_keys
            else None)

    augment_key = jax.random.fold_in(rng, AUGMENT_STREAM)

    def batch_of(t):
        # Step t is batch (t mod k) of epoch (t div k), k = the client's own batches per epoch;
        # its position in the padded schedule is epoch * per_epoch + batch.
        position = (t // real_per_epoch) * per_epoch + t % real_per_epoch
        rows = schedule.indices[position]
        x = augmented(data.x[rows], augment_key, position, plan)
        out = (x, data.y[rows], schedule.sample_mask[position])
        return out + (keys[position],) if step_keys else out

    # The step is traced once: the stats' shape and the loop body share the trace of a nested
    # jit (tracing a model's forward and backward is a first call's Python time); `inline`
    # copies its equations into the loop, so the lowered program is the one a direct call gives.
    step = jax.jit(train_step, inline=True)
    stats_shape = jax.eval_shape(lambda c: step(c, batch_of(jnp.int32(0)))[1], carry)
    sums = jnp.zeros(stats_shape.shape, stats_shape.dtype)

    def body(t, state):
        carry, sums = state
        carry, stats = step(carry, batch_of(t))
        return carry, sums + stats

    carry, sums = jax.lax.fori_loop(0, total, body, (carry, sums))
    return carry, sums, total.astype(jnp.float32)


AUGMENT_STREAM = 0xA06  # folded into a client's round key for its augmentation keys


def augmented(x: jax.Array, key: jax.Array, position, plan: LocalSchedule) -> jax.Array:
    """The batch `x` at padded-schedule `position`, augmented as `plan.augment` says (the key
    depends on the position only, so the rolled loop, the unrolled scan, loop and vmap agree)."""
    if plan.augment == "none":
        return x
    return augmentation.augment(x, jax.random.fold_in(key, position), plan.augment,
                                plan.augment_fill)


def _run_unrolled(train_step, carry, data, rng, plan: LocalSchedule, step_keys):
    """The padded static schedule as a fully unrolled scan (see `run_local_epochs`)."""
    capacity = data.y.shape[0]
    schedule = batch_schedule(rng, data.sizes, capacity, plan.batch_size, plan.epochs,
                              getattr(data, "step_limit", None), plan.drop_partial_batch)

    def step(carry, step_inputs):
        *batch, active = step_inputs
        new_carry, stats = train_step(carry, tuple(batch))
        return select_tree(active, new_carry, carry), stats * active.astype(stats.dtype)

    n = schedule.step_active.shape[0]
    x = data.x[schedule.indices]
    if plan.augment != "none":
        key = jax.random.fold_in(rng, AUGMENT_STREAM)
        x = jax.vmap(lambda xb, p: augmented(xb, key, p, plan))(x, jnp.arange(n))
    inputs = (x, data.y[schedule.indices], schedule.sample_mask)
    if step_keys:
        inputs += (jax.random.split(jax.random.fold_in(rng, 1), n),)
    inputs += (schedule.step_active,)
    carry, per_step = jax.lax.scan(step, carry, inputs, unroll=n)
    return carry, per_step.sum(axis=0), schedule.step_active.sum().astype(jnp.float32)


def cross_entropy_step(logits_fn, optimizer: optax.GradientTransformation):
    """A `run_local_epochs` train step: one `optimizer` step on the masked cross-entropy of
    `logits_fn(params, x)`; carry = (params, opt_state), stats = [CE]."""

    def train_step(carry, batch):
        params, opt_state = carry
        x, y, mask = batch
        ce, grads = jax.value_and_grad(
            lambda p: cross_entropy(logits_fn(p, x), y, mask))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), jnp.stack([ce])

    return train_step
