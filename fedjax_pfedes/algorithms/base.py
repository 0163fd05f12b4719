"""The algorithm interface every federated method implements.

Modelled on optax's `GradientTransformation` and FedJAX's `FederatedAlgorithm`: a frozen dataclass
of pure functions over explicit pytree state. The per-client functions are written for ONE client;
`fedjax_pfedes.execution.runners` runs them over a cohort by `jax.vmap` or by a loop with
identical results.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from fedjax_pfedes.algorithms import local_training
from fedjax_pfedes.algorithms.local_training import LocalSchedule
from fedjax_pfedes.config.defaults import ExecutionSection, TrainSection
from fedjax_pfedes.data.spec import InputSpec
from fedjax_pfedes.errors import ConfigError

PyTree = Any
Metrics = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LocalTrainingConfig:
    """What every method's local training needs; each method's config dataclass extends it.

    Keyword-only, so a method's config may also derive from its config section
    (`config.fields.Section`), whose fields come first and carry their own defaults.

    Attributes:
      num_classes: labels of the dataset.
      input_spec: modality, shape and normalization statistics of the inputs.
      lr_local: local SGD learning rate (`config.train.lr_local`).
      local_momentum: local SGD heavy-ball momentum (0 = plain SGD).
      local_epochs: the most local epochs any client runs (fewer are masked per client).
      batch_size: local batch size.
      unroll_local_steps: run the padded unrolled schedule instead of the rolled loop (the
        tested reference; `config.execution.unroll_local_steps`).
      drop_partial_batch: skip an epoch's last partial batch (`config.train.drop_partial_batch`).
      augment: on-device image augmentation of every local batch (`config.train.augment`).
    """

    num_classes: int
    input_spec: InputSpec
    # The defaults are the config's (its sections declare them); a run passes every value.
    lr_local: float = TrainSection.lr_local
    local_momentum: float = TrainSection.local_momentum
    local_epochs: int = TrainSection.local_epochs
    batch_size: int = TrainSection.batch_size
    unroll_local_steps: bool = ExecutionSection.unroll_local_steps
    drop_partial_batch: bool = TrainSection.drop_partial_batch
    augment: str = TrainSection.augment

    def local_schedule(self) -> LocalSchedule:
        """The `local_training.LocalSchedule` of these settings."""
        return LocalSchedule(self.batch_size, self.local_epochs, self.unroll_local_steps,
                             self.drop_partial_batch, self.augment, self.input_spec.mean)


@dataclasses.dataclass(frozen=True)
class CohortProgram:
    """What the clients of one architecture run.

    Attributes:
      init_client: rng -> ClientState of one client.
      client_update: (broadcast, client_state, train_arrays, rng) -> (upload, client_state,
        metrics). `train_arrays` is one client's padded `ClientArrays`.
      evaluate: (broadcast, client_state, test_arrays) -> metrics of one client on its local
        test split ('personalized_accuracy', 'test_ce_loss', and what the method adds).
      predict: (broadcast, client_state, x) -> class scores [n, classes] of the model the client
        predicts with (the same one `evaluate` scores; argmax is its prediction). The engine
        scores it on the global test set (`global_accuracy`) in a program of its own, so the
        per-round monitoring, which needs the local metrics only, never compiles the global part.
    """

    init_client: Callable[[jax.Array], PyTree]
    client_update: Callable[[PyTree, PyTree, PyTree, jax.Array], tuple[PyTree, PyTree, Metrics]]
    evaluate: Callable[[PyTree, PyTree, PyTree], Metrics]
    predict: Callable[[PyTree, PyTree, jax.Array], jax.Array]


def classifier_metrics(logits: jax.Array, test: PyTree) -> Metrics:
    """Accuracy and CE of class scores `logits` [n, classes] on one client's padded local test
    split `test` (the samples past `test.sizes` are masked)."""
    mask = jnp.arange(test.y.shape[0]) < test.sizes
    correct = (jnp.argmax(logits, -1) == test.y).astype(jnp.float32)
    return {"personalized_accuracy": local_training.masked_mean(correct, mask),
            "test_ce_loss": local_training.cross_entropy(logits, test.y, mask)}


def classifier_program(init_client: Callable, client_update: Callable,
                       predict: Callable[[PyTree, PyTree, jax.Array], jax.Array]
                       ) -> CohortProgram:
    """The `CohortProgram` of a method whose clients are scored by the classifier `predict`
    alone: its `evaluate` is `classifier_metrics` of `predict` on the local test split."""

    def evaluate(broadcast, client_state, test):
        return classifier_metrics(predict(broadcast, client_state, test.x), test)

    return CohortProgram(init_client, client_update, evaluate, predict)


GLOBAL_BATCH = 512  # global test samples per vectorized chunk of `global_accuracy`


def global_accuracy(program: CohortProgram, broadcast: PyTree, client_state: PyTree,
                    global_x: jax.Array, global_y: jax.Array) -> jax.Array:
    """Accuracy of one client's `program.predict` on the global test set: every sample scored
    on its own (a batch of one, vectorized over chunks of `GLOBAL_BATCH` by `lax.map`), so
    the result does not depend on how the set is chunked."""
    scores = jax.lax.map(lambda xb: program.predict(broadcast, client_state, xb[None])[0],
                         global_x, batch_size=GLOBAL_BATCH)
    return jnp.mean(jnp.argmax(scores, -1) == global_y)


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """A federated algorithm.

    Attributes:
      init_server: (rng, architecture names of the cohorts) -> ServerState.
      broadcast: (ServerState, arch) -> what each participant of that cohort receives this round
        (the same tree for every cohort when the server shares one model, e.g. pFedES's E_proxy;
        the cohort's own global model for FedAvg run per cohort).
      upload_template: (ServerState, arch) -> the tree every upload of that cohort must match
        (structure, shapes, dtypes) and the reference it is compared against: a client's update
        is upload - template (the broadcast model for model uploads, zeros for uploads that are
        already updates or statistics). `{}` when nothing is uploaded.
      server_update: (ServerState, {arch: (stacked uploads, weights)}) -> ServerState; pure and
        jittable.
      cohort_program: architecture name -> CohortProgram.
      name: the method's config name, and
      aggregation: how the server combines uploads ('shared', 'per_cohort', 'custom', 'none':
        `registry.AlgorithmEntry.aggregation` says what each lets the upload pipeline do). Both
        are declared once, in the method's `AlgorithmEntry`; `registry.build` sets them here
        ('' in an Algorithm built outside the registry).
      dp_sgd_releases_per_step: with sample-level DP-SGD, how many noisy gradients of the same
        batch a local step releases (pFedES: the private model's and E_proxy's, 2); the
        accountant composes them inside each sampled step.
      server_metrics: (ServerState before, ServerState after the server step) -> {name: scalar}
        added to the round's record (pFedES: `proxy_relative_change`); None = nothing. Pure and
        jittable.
      norm_keys: the top-level upload entries that are the model update, measured by the norm
        rule and the update-norm monitoring (FedNova: its normalized update, not the solver
        scalar; FedProto: its prototypes, not the class counts); () = the whole upload.
      state_needs_acceptance: a client whose upload the server rejects keeps its state from
        before the round (SCAFFOLD: its control variate c_i must stay the one the server's c
        was built from, else c drifts from the mean of the clients' controls).
      mean_server_step: `server_update` reads each group only through
        `aggregation.weighted_mean` (or `mean_over_cohorts`), so a group may arrive reduced to
        one row, the group's weighted mean, with the group's total weight: the 'scan' strategy
        then sums the uploads as they are made instead of stacking them (`upload.streaming`).
        A conformance test checks the claim for every method that makes it.
      client_report_metrics: per-client training metrics (of `client_update`) that go into
        clients.jsonl next to the engine's own columns (pFedES: its alignment loss at the start
        and end of local training, for finding F4).
      encoded_upload_params: (a cohort's per-client training metrics, on the host) -> the count
        of numbers each client's upload encodes to, for an upload that is sent compressed
        (FedKD's SVD factors); None: the upload template's size. The round's traffic figures
        read it; the engine names no metric of its own for it.

    Every evaluation metric named `test_<name>_loss` is also measured on the round's
    participants right before and after the server step while `config.monitor.aggregation_loss`
    is on (`loss_before_aggregation` for the cross-entropy, `<name>_loss_before_aggregation` for
    the others).
    """

    init_server: Callable[[jax.Array, tuple[str, ...]], PyTree]
    broadcast: Callable[[PyTree, str], PyTree]
    upload_template: Callable[[PyTree, str], PyTree]
    server_update: Callable[[PyTree, dict[str, tuple[PyTree, jax.Array]]], PyTree]
    cohort_program: Callable[[str], CohortProgram]
    name: str = ""
    aggregation: str = ""
    dp_sgd_releases_per_step: int = 1
    state_needs_acceptance: bool = False
    norm_keys: tuple[str, ...] = ()
    server_metrics: Callable[[PyTree, PyTree], dict[str, jax.Array]] | None = None
    mean_server_step: bool = False
    client_report_metrics: tuple[str, ...] = ()
    encoded_upload_params: Callable[[dict], Any] | None = None


def with_fresh_local_optimizer(program: CohortProgram) -> CohortProgram:
    """`program` whose clients start every round with a fresh local-optimizer state.

    The client state's `opt_state` (the private model's SGD momentum trace) is replaced by zeros
    before the round's local training, which is what `optax.sgd(...).init` returns (and every
    optax optimizer's init: zero traces and moments, zero step counts); the private parameters
    are kept. Used for `config.train.reset_local_optimizer` on methods whose registry entry has
    `private_optimizer=True`.
    """

    def client_update(broadcast, state, data, rng):
        fresh = state.replace(opt_state=jax.tree.map(jnp.zeros_like, state.opt_state))
        return program.client_update(broadcast, fresh, data, rng)

    return dataclasses.replace(program, client_update=client_update)


def check_range(value, low, high, field: str, low_open: bool = False,
                high_open: bool = False) -> None:
    """ConfigError naming `field` unless low <(=) value <(=) high (None = unbounded)."""
    ok = ((low is None or (value > low if low_open else value >= low))
          and (high is None or (value < high if high_open else value <= high)))
    if not ok:
        lo = "(" if low_open else "["
        hi = ")" if high_open else "]"
        raise ConfigError(f"{field} must be in {lo}{low}, {high}{hi}, got {value}")
