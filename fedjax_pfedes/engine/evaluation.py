"""Evaluation and the per-round figures computed from a run's state: every client's model on its
local test split and on the global test set, the label-only reference, the privacy spent so far
(client-level DP and sample-level DP-SGD, from dp_accounting), and divergence detection.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pfedes.data.federated import FederatedData
from fedjax_pfedes.engine.cohorts import Cohort
from fedjax_pfedes.execution import slot_rows
from fedjax_pfedes.upload import privacy


def global_test_set(data: FederatedData, samples: int, seed: int):
    """The global test set every client is evaluated on: `samples` test examples drawn with
    `seed` (all of them when 0), as device arrays (x, y)."""
    c = data.central
    n = samples or len(c.y_test)
    idx = np.random.default_rng(seed).permutation(len(c.y_test))[:n]
    return jnp.asarray(c.x_test[np.sort(idx)]), jnp.asarray(c.y_test[np.sort(idx)])


def majority_class_accuracy(data: FederatedData) -> float:
    """Mean over clients of predicting each client's most frequent local-train label on its local
    test split: the label-only reference a personalized model has to beat."""
    y = data.central.y_train
    scores = [np.mean(y[te] == np.bincount(y[tr]).argmax()) if len(te) else 0.0
              for tr, te in zip(data.train_indices, data.test_indices, strict=True)]
    return float(np.mean(scores))


def evaluation_sample(count: int, seed: int, num_clients: int) -> np.ndarray | None:
    """The clients every evaluation measures: all (None) when `count` (`config.eval.clients`) is
    0, else a random set of that many drawn with `seed`, the same at every evaluation of the run
    (cross-device populations: evaluating 10,000 clients costs more than training a round)."""
    if count <= 0 or count >= num_clients:
        return None
    return np.sort(np.random.default_rng([seed, 0xE7A1]).choice(num_clients, count,
                                                                 replace=False))


def evaluate(algorithm, server_state, cohorts: list[Cohort], clients: dict[str, Any], global_x,
             global_y, sample: np.ndarray | None = None) -> dict[str, Any]:
    """Every client's model (private states `clients`) on its own local test split and on the
    global test set; only the clients in `sample` (global ids) when one is given."""
    per_client: dict[str, list[np.ndarray]] = {}
    per_cohort = {}
    for cohort in cohorts:
        broadcast = algorithm.broadcast(server_state, cohort.arch)
        if sample is None:
            m = jax.device_get(cohort.runner.evaluate(broadcast, clients[cohort.arch],
                                                      cohort.test, global_x, global_y))
        else:
            members = np.flatnonzero(np.isin(cohort.client_ids, sample)).astype(np.int32)
            if not len(members):
                continue
            m = slot_rows.evaluate_in_buckets(cohort.runner.evaluate_slots, broadcast,
                                              clients[cohort.arch], cohort.test, members,
                                              cohort.bucket, global_x, global_y)
        for k, v in m.items():
            per_client.setdefault(k, []).append(np.asarray(v))
        per_cohort[cohort.arch] = float(np.mean(m["personalized_accuracy"]))
    acc = np.concatenate(per_client["personalized_accuracy"])
    means = {f"{k}_mean": float(np.concatenate(v).mean()) for k, v in per_client.items()}
    return {
        **means,
        "personalized_accuracy_std": float(acc.std()),
        "personalized_accuracy_min": float(acc.min()),
        "personalized_accuracy_max": float(acc.max()),
        "personalized_accuracy_by_arch": per_cohort,
        "evaluated_clients": int(len(acc)),
    }


def dp_sgd_statement(dp_sgd: bool) -> dict[str, Any]:
    """What sample-level DP-SGD's figures protect, for summary.json: the unit, the neighbouring
    relation its epsilon is stated under and how its steps are accounted ({} without it;
    client-level DP's statement is `UploadPlan.statement`).

    Args:
      dp_sgd: whether sample-level DP-SGD is on (`config.dp_sgd.enabled`).

    Returns:
      The `dp_sgd_*` fields.
    """
    if not dp_sgd:
        return {}
    return {
        "dp_sgd_unit": "example (one training sample of one client)",
        "dp_sgd_neighbouring_relation": "add_or_remove_one",
        "dp_sgd_accounting": "each local step a Poisson-sampled batch of rate B / n_k (the "
                             "usual approximation of shuffled batches, as Opacus and TF "
                             "Privacy report it; client sizes n_k treated as public)",
    }


def dp_sgd_metrics(noise_multiplier: float | None, delta: float, steps_taken: dict[int, int],
                   batch_rate: dict[int, float], releases_per_step: int = 1
                   ) -> dict[str, float]:
    """Per-client epsilon of sample-level DP-SGD so far (max and mean over clients that have
    trained), RDP accounting. Each local step is accounted as a Poisson-sampled batch with
    q = B / n_k (the usual approximation for shuffled batches, as in Opacus / TF Privacy) on which
    `releases_per_step` Gaussian mechanisms act (pFedES releases the private model's and
    E_proxy's noisy gradients of the same batch: composed inside the sampled event, which equals
    one Gaussian of noise multiplier sigma / sqrt(2) and is larger than composing two
    independently sampled steps).

    Args:
      noise_multiplier: DP-SGD's noise multiplier, None when DP-SGD is off.
      delta: the delta epsilon is stated at.
      steps_taken: client id -> local steps it has taken with DP-SGD so far.
      batch_rate: client id -> B / n_k.
      releases_per_step: Gaussian releases of one sampled batch.

    Returns:
      {} without DP-SGD or before any step; else `dp_sgd_*` figures.
    """
    if noise_multiplier is None or not steps_taken:
        return {}
    import dp_accounting  # on first use: see upload/privacy.py
    eps = []
    for cid, steps in steps_taken.items():
        if noise_multiplier == 0:
            eps.append(float("inf"))
            continue
        accountant = privacy.make_accountant("rdp", "poisson")
        release = dp_accounting.ComposedDpEvent(
            [dp_accounting.GaussianDpEvent(noise_multiplier)] * releases_per_step)
        accountant.compose(dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(batch_rate[cid], release), steps))
        eps.append(float(accountant.get_epsilon(delta)))
    return {"dp_sgd_epsilon_max": max(eps), "dp_sgd_epsilon_mean": float(np.mean(eps)),
            "dp_sgd_delta": delta, "dp_sgd_noise_multiplier": noise_multiplier,
            "dp_sgd_releases_per_step": releases_per_step}


def non_finite_metrics(record: dict[str, Any]) -> list[str]:
    """Names of the round's loss metrics that are NaN or infinite (training diverged)."""
    return sorted(k for k, v in record.items()
                  if "loss" in k and isinstance(v, float) and not math.isfinite(v))


def evaluation_note(summary: dict) -> str:
    """A line naming the `eval.*` fields when evaluating took over half of this process's wall
    time.

    Args:
      summary: a run's summary.json (`evaluation_time_s`, `wall_time_s`,
        `resumed_wall_time_s`: the earlier processes' share of it).

    Returns:
      The line, or '' when evaluation took at most half.
    """
    process_s = summary["wall_time_s"] - summary["resumed_wall_time_s"]
    if summary["evaluation_time_s"] <= 0.5 * process_s:
        return ""
    return (f"evaluation took {summary['evaluation_time_s'] / process_s:.0%} of this process's "
            "wall time: config.eval.every, eval.global_every (the global test set at every "
            "k-th evaluation) and eval.global_test_samples set how often and on what")
