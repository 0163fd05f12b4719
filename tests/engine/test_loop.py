"""End to end: a small heterogeneous run writes the documented metrics and is reproducible."""

import json

import numpy as np
import pytest
from fl_helpers import small_config

from fedjax_pfedes.engine.build import build_federated_data
from fedjax_pfedes.engine.loop import run_experiment
from fedjax_pfedes.engine.schema import default_values
from fedjax_pfedes.io.metrics import WALL_CLOCK_FIELDS

# Written every round (docs/guide/monitoring.md), and the evaluation written at evaluated rounds.
ROUND_KEYS = {
    "round", "planned_participants", "online_clients", "selected", "participants",
    "dropped_out", "past_deadline", "partial_work", "uploads_accepted", "upload_success_rate",
    "train_ce_loss_mean", "train_align_loss_mean", "train_proxy_align_loss_mean",
    "local_steps_mean", "proxy_update_norm_mean", "client_loss_var", "update_norm_min",
    "update_norm_median", "update_norm_max", "loss_before_aggregation",
    "loss_after_aggregation", "upload_params_per_client", "upload_bytes_per_client",
    "download_params_per_client", "download_bytes_per_client", "uploads_rejected",
    "uploads_rejected_total", "simulated_round_s", "simulated_clock_s", "participation_min",
    "participation_max", *WALL_CLOCK_FIELDS, "padded_step_fraction",
    "selected_label_coverage", "align_loss_at_start_mean", "align_loss_at_end_mean",
    "align_loss_before_aggregation", "align_loss_after_aggregation", "proxy_relative_change",
}
EVAL_KEYS = {
    "personalized_accuracy_mean", "personalized_accuracy_std", "personalized_accuracy_min",
    "personalized_accuracy_max", "global_accuracy_mean", "test_ce_loss_mean",
    "test_align_loss_mean", "personalized_accuracy_by_arch", "evaluated_clients",
}


@pytest.fixture(scope="module")
def loop_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("run")
    return workdir, run_experiment(small_config("loop"), str(workdir), show_progress=False)


@pytest.mark.slow
def test_run_writes_metrics_and_summary(loop_run):
    workdir, summary = loop_run
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert set(r) == ROUND_KEYS | (EVAL_KEYS if r["round"] % 2 == 0 else set())
        assert r["planned_participants"] == r["selected"] == r["participants"] == 3
        assert r["uploads_accepted"] == 3 and r["upload_success_rate"] == 1.0
        # Reliable clients (0 % drop-out, no deadline): nobody is lost.
        assert r["dropped_out"] == r["past_deadline"] == r["partial_work"] == 0
    rows = [r for r in rows if "personalized_accuracy_mean" in r]
    for r in rows:
        assert 0.0 <= r["personalized_accuracy_min"] <= r["personalized_accuracy_mean"] \
            <= r["personalized_accuracy_max"] <= 1.0
        assert set(r["personalized_accuracy_by_arch"]) == {"mlp", "convnet3"}
    on_disk = json.load(open(workdir / "summary.json"))
    assert on_disk["final"] == rows[-1]
    assert on_disk["clients_per_arch"] == {"mlp": 3, "convnet3": 3}
    assert on_disk["config"]["lam"] == 0.5
    assert summary["best_personalized_accuracy"] == max(r["personalized_accuracy_mean"]
                                                        for r in rows)


@pytest.mark.slow
def test_personalized_accuracy_is_the_mean_of_per_client_accuracies(loop_run):
    _, summary = loop_run
    final = summary["final"]
    by_arch = final["personalized_accuracy_by_arch"]
    # Three clients per cohort: the overall mean is the mean of the two cohort means.
    np.testing.assert_allclose(final["personalized_accuracy_mean"],
                               (by_arch["mlp"] + by_arch["convnet3"]) / 2, rtol=1e-6)


@pytest.mark.slow
def test_training_beats_the_local_majority_class(loop_run):
    """Each client's local-test majority class is the best label-only guess; learning beats it."""
    _, summary = loop_run
    data = build_federated_data(small_config())
    y = data.central.y_train
    majority = np.mean([np.mean(y[te] == np.bincount(y[tr]).argmax())
                        for tr, te in zip(data.train_indices, data.test_indices, strict=True)])
    np.testing.assert_allclose(summary["majority_class_accuracy_mean"], majority)
    assert summary["final"]["personalized_accuracy_mean"] > majority + 0.1


@pytest.mark.slow
def test_same_seed_same_numbers_and_vmap_matches_loop(loop_run, tmp_path):
    _, loop_summary = loop_run
    vmap_summary = run_experiment(small_config("vmap"), str(tmp_path), show_progress=False)
    for key in ("personalized_accuracy_mean", "global_accuracy_mean", "train_ce_loss_mean"):
        np.testing.assert_allclose(vmap_summary["final"][key], loop_summary["final"][key],
                                   rtol=2e-3, atol=2e-3)


@pytest.mark.slow
def test_per_client_accuracy_recomputed_from_the_saved_client_states(loop_run):
    """Restores the last checkpoint's private models and recomputes, by plain numpy argmax over
    each client's local test split, the per-architecture accuracies the run reported."""
    import jax

    from fedjax_pfedes.engine.build import build_context
    from fedjax_pfedes.io import checkpoints
    from fedjax_pfedes.models import architectures

    workdir, summary = loop_run
    config = small_config("loop")
    data = build_federated_data(config)
    ctx, state = build_context(config, data)
    checkpointer = checkpoints.Checkpointer(str(workdir), 2)
    assert checkpointer.check_config(config.to_dict(), default_values()) is not None
    rounds_done, restored = checkpointer.restore(state.to_checkpoint())
    state = state.from_checkpoint(restored)
    checkpointer.close()
    assert rounds_done == summary["final"]["round"]
    c = data.central
    per_arch = {}
    for cohort in ctx.cohorts:
        model = architectures.client_model(cohort.arch, c.num_classes, config.proxy_dim,
                                      c.input_spec)
        states = state.clients[cohort.arch]
        scores = []
        for j, cid in enumerate(cohort.client_ids):
            params = jax.tree.map(lambda a, j=j: a[j], states.params)
            idx = data.test_indices[cid]
            logits, _ = model.apply(params, c.x_train[idx])
            scores.append(np.mean(np.argmax(np.asarray(logits), -1) == c.y_train[idx]))
        per_arch[cohort.arch] = float(np.mean(scores))
    reported = summary["final"]["personalized_accuracy_by_arch"]
    for arch, acc in per_arch.items():
        np.testing.assert_allclose(reported[arch], acc, atol=1e-6)
