"""Upload checks (`upload/validation.py` and the check stages): fingerprints, non-finite and wrong-
model uploads, the norm-outlier rule.
"""


import fl_helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fl_helpers import pipeline_config, upload_cohort, upload_pipeline

from fedjax_pfedes.upload import privacy, validation
from fedjax_pfedes.upload.pipeline import UploadPipeline


def test_fingerprint_ignores_values_and_the_client_axis_but_not_names_shapes_dtypes():
    a = {"w": jnp.zeros((3, 2)), "b": jnp.zeros(2)}
    assert validation.fingerprint(a) == validation.fingerprint(jax.tree.map(jnp.ones_like, a))
    stacked = jax.tree.map(lambda x: jnp.stack([x] * 4), a)
    assert validation.fingerprint(stacked, leading_axes=1) == validation.fingerprint(a)
    assert validation.fingerprint({"w": jnp.zeros((2, 3)), "b": jnp.zeros(2)}) != \
        validation.fingerprint(a)
    assert validation.fingerprint({"w": jnp.zeros((3, 2), jnp.bfloat16), "b": jnp.zeros(2)}) != \
        validation.fingerprint(a)
    assert validation.fingerprint({"v": jnp.zeros((3, 2)), "b": jnp.zeros(2)}) != \
        validation.fingerprint(a)


def test_nan_and_wrong_model_uploads_are_rejected_and_the_rest_averaged():
    template = {"w": jnp.zeros(3)}
    good = {"w": jnp.array([[1.0, 2.0, 3.0], [jnp.nan, 0.0, 0.0], [3.0, 2.0, 1.0]])}
    wrong = {"w": jnp.ones((2, 4))}  # another model's shape
    pipe = upload_pipeline()
    cohorts = {"a": upload_cohort(good, template, [10.0, 10.0, 30.0], ids=[4, 7, 9]),
               "b": upload_cohort(wrong, template, [5.0, 5.0], ids=[1, 2])}
    groups, _, report = pipe.process(0, cohorts, {"a": {}, "b": {}},
                                     {"a": 3, "b": 2}, jax.random.key(0))
    reasons = {(r["client"], r["reason"].split(" (")[0]) for r in report.rejections}
    assert reasons == {(7, "non-finite values"), (1, "model fingerprint mismatch"),
                       (2, "model fingerprint mismatch")}
    detail = next(r["reason"] for r in report.rejections if r["client"] == 1)
    assert "leaf 'w' has shape (2, 4), expected (2, 3)" in detail
    np.testing.assert_array_equal(groups["a"][1], [10.0, 0.0, 30.0])
    np.testing.assert_array_equal(groups["b"][1], [0.0, 0.0])
    from fedjax_pfedes.aggregation import weighted_mean
    mean, total = weighted_mean(list(groups.values()))
    np.testing.assert_allclose(mean["w"], [2.5, 2.0, 1.5])  # (10 x + 30 y) / 40, renormalized
    assert float(total) == 40.0


def test_a_first_rejection_after_round_1_compiles_nothing():
    """Rounds that reject someone run the same compiled programs as rounds that do not (the
    issue's '0 recompiles after round 1'): a NaN upload first seen in round 2 compiles nothing."""
    template = {"w": jnp.zeros(3), "b": jnp.zeros((2, 2))}
    finite = jax.tree.map(lambda t: jnp.stack([t + 1.0, t + 2.0, t + 3.0]), template)
    with_nan = jax.tree.map(lambda u: u.at[1].set(jnp.nan), finite)
    pipe = upload_pipeline(norm_outlier_factor=0.0)
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **kw: compiles.append(event)
        if event == "/jax/core/compile/backend_compile_duration" else None)
    for r, uploads in enumerate([finite, finite, with_nan]):
        before = len(compiles)
        cohort = upload_cohort(uploads, template, [1.0, 2.0, 3.0])
        groups, _, report = pipe.process(r, {"a": cohort},
                                         {"a": {}}, {"a": 3}, jax.random.key(r))
        if r:
            assert len(compiles) == before, f"round {r} compiled"
    assert [x["client"] for x in report.rejections] == [1]
    np.testing.assert_array_equal(groups["a"][0]["w"][1], template["w"])  # the template
    np.testing.assert_array_equal(groups["a"][0]["w"][2], finite["w"][2])


@pytest.mark.parametrize("settings", [dict(topk_fraction=0.5), dict(
    dp=privacy.ClientDPConfig(clip_norm=100.0, noise_multiplier=0.0), weighting="uniform")])
def test_rejected_nan_uploads_leave_no_trace_when_the_pipeline_transforms(settings):
    from fedjax_pfedes.aggregation import weighted_mean

    pipe = UploadPipeline(pipeline_config(**settings),
                          "shared", "test", num_clients=3, expected_participants=2,
                          clients_per_round=3, rounds=5)
    template = {"w": jnp.zeros(2)}
    ups = {"w": jnp.array([[1.0, 2.0], [jnp.nan, 1.0], [3.0, 0.0]])}
    groups, memories, report = pipe.process(
        0, {"a": upload_cohort(ups, template, [1, 1, 1])},
        {"a": pipe.init_memory(template, 3)}, {"a": 3},
        jax.random.key(0))
    assert [r["client"] for r in report.rejections] == [1]
    mean, _ = weighted_mean([groups["a"]])
    assert np.all(np.isfinite(np.asarray(mean["w"])))
    assert all(np.all(np.isfinite(np.asarray(m))) for m in jax.tree.leaves(memories))
    # only top-k keeps a memory
    assert (len(jax.tree.leaves(memories)) == 1) == ("topk_fraction" in settings)


def test_norm_outliers_are_rejected_beyond_factor_times_median():
    template = {"w": jnp.zeros(2)}
    ups = {"w": jnp.array([[1.0, 0.0], [0.0, 1.2], [0.9, 0.0], [30.0, 0.0]])}
    pipe = upload_pipeline(norm_outlier_factor=5.0)
    groups, _, report = pipe.process(0, {"a": upload_cohort(ups, template, [1, 1, 1, 1])},
                                     {"a": {}}, {"a": 4}, jax.random.key(0))
    assert [r["client"] for r in report.rejections] == [3]
    np.testing.assert_array_equal(groups["a"][1], [1, 1, 1, 0])


def test_finite_uploads_give_a_finite_weighted_mean():
    from fedjax_pfedes.aggregation import weighted_mean
    ups = {"w": jnp.array([[3e38, -1.0], [3e38, 1.0]], jnp.float32)}
    mean, _ = weighted_mean([(ups, jnp.array([2.0, 1.0]))])
    np.testing.assert_allclose(mean["w"], [3e38, -1.0 / 3], rtol=1e-6)
    small = {"w": jnp.array([[1.0, 2.0], [3.0, 5.0]])}  # the ordinary path is unchanged
    mean, _ = weighted_mean([(small, jnp.array([1.0, 3.0]))])
    np.testing.assert_array_equal(mean["w"], (1.0 * small["w"][0] + 3.0 * small["w"][1]) / 4.0)


@pytest.mark.parametrize("wild", [1e4, 3e38])
def test_default_settings_reject_a_wild_client_and_name_it(wild):
    template = {"w": jnp.zeros(4)}
    rng = np.random.default_rng(0)
    honest = rng.normal(scale=0.1, size=(6, 4)).astype(np.float32)
    ups = {"w": jnp.asarray(honest).at[4].set(wild)}
    pipe = upload_pipeline()  # PipelineConfig() defaults: norm_outlier_factor = 10
    assert pipe.cfg.upload.norm_outlier_factor == 10.0 and not pipe.active
    cohort = upload_cohort(ups, template, [5] * 6, ids=range(10, 16))
    groups, _, report = pipe.process(0, {"a": cohort},
                                     {"a": {}}, {"a": 6}, jax.random.key(0))
    assert [r["client"] for r in report.rejections] == [14]
    assert "beyond 10 x the round's median" in report.rejections[0]["reason"]
    from fedjax_pfedes.aggregation import weighted_mean
    mean, _ = weighted_mean([groups["a"]])
    np.testing.assert_allclose(mean["w"], np.delete(honest, 4, 0).mean(0), rtol=1e-5)


def test_outliers_are_judged_across_the_cohorts_of_one_shared_tree():
    # pFedES-style shared aggregation: one participant per cohort, the wild one alone in its own
    template = {"w": jnp.zeros(2)}
    cohorts = {f"arch{k}": upload_cohort({"w": jnp.array([[0.1 * (k + 1), 0.0]])}, template, [1],
                                   ids=[k]) for k in range(4)}
    cohorts["arch3"] = upload_cohort({"w": jnp.array([[50.0, 0.0]])}, template, [1], ids=[3])
    _, _, report = upload_pipeline("shared").process(
        0, cohorts, {a: {} for a in cohorts}, {a: 1 for a in cohorts},
        jax.random.key(0))
    assert [r["client"] for r in report.rejections] == [3]
    # per-cohort aggregation, every cohort of one upload: no cohort has a median of its own,
    # so each is judged against the round's uploads of every cohort (U13)
    _, _, report = upload_pipeline("per_cohort").process(
        0, cohorts, {a: {} for a in cohorts}, {a: 1 for a in cohorts},
        jax.random.key(0))
    assert [r["client"] for r in report.rejections] == [3]
    assert "of the round's uploads of every cohort (its own sent fewer than 3)" in \
        report.rejections[0]["reason"]
    # `norm_outlier_small_cohorts=False`: the rule before, such a cohort is not judged
    _, _, report = upload_pipeline("per_cohort", norm_outlier_small_cohorts=False).process(
        0, cohorts, {a: {} for a in cohorts}, {a: 1 for a in cohorts},
        jax.random.key(0))
    assert report.rejections == []


def test_a_small_cohort_is_judged_against_every_cohort_and_a_large_one_against_itself():
    """Per-cohort aggregation: a cohort of 3+ uploads is judged by its own median, one of 1-2
    by the median of all the round's uploads. Norms per sample by hand: cohort 'big' 1, 1, 1,
    30 (its own median 1: the 30 is 30x); cohort 'pair' 0.5 and 40 (all seven: median 1, the
    40 is 40x); cohort 'lone' 0.02 (all: 1/50x, kept)."""
    template = {"w": jnp.zeros(1)}

    def cohort(values, first_id):
        return upload_cohort({"w": jnp.array([[v] for v in values])}, template,
                             [1] * len(values), ids=list(range(first_id, first_id + len(values))))

    cohorts = {"big": cohort([1.0, 1.0, 1.0, 30.0], 0), "pair": cohort([0.5, 40.0], 10),
               "lone": cohort([0.02], 20)}
    rule = dict(norm_outlier_z=0.0)  # the factor alone, so the medians alone decide
    _, _, report = upload_pipeline("per_cohort", **rule).process(
        0, cohorts, {a: {} for a in cohorts}, {a: 1 for a in cohorts}, jax.random.key(0))
    assert sorted(r["client"] for r in report.rejections) == [3, 11]
    # were 'pair' judged alone it could not be (2 uploads); were 'big' judged against all
    # seven, its 30 would still be beyond 10x and its 1s kept: the same verdicts by hand
    norms = np.array([1, 1, 1, 30, 0.5, 40, 0.02], np.float32)
    assert np.median(norms) == 1.0 and np.median(norms[:4]) == 1.0


def test_late_in_training_a_learning_client_is_kept_and_a_boosted_one_rejected_by_model_size():
    """U26. Per-cohort FedAvg late in training: eight updates at a floor (norm 0.02 each, by
    hand), one client still learning at 0.8 (40x the median, tens of robust deviations out:
    the z/hard-factor rule alone rejects it) and a boosted one at 3.0 (150x). The model they
    update has norm 20: with the default model ratio 0.1 only updates beyond 2.0
    can be rejected, so the learner (0.04 of the model) is kept, the boosted one (0.15) not."""
    template = {"w": jnp.full((4,), 10.0)}  # norm 20
    floor = [0.02 * (1 + 0.01 * k) for k in range(8)]  # a tiny spread: a tiny MAD
    values = floor + [0.8, 3.0]
    ups = {"w": jnp.array([[10.0 + v, 10.0, 10.0, 10.0] for v in values])}  # template + update
    cohort = upload_cohort(ups, template, [1] * 10, ids=range(10))
    from fedjax_pfedes.algorithms.registry import DEFAULT_NORM_MODEL_RATIO

    def rejected(**rule):
        _, _, report = upload_pipeline("per_cohort", **rule).process(
            0, {"a": cohort}, {"a": {}}, {"a": 10}, jax.random.key(0))
        return [r["client"] for r in report.rejections], report.rejections

    clients, rejections = rejected(norm_outlier_model_ratio=DEFAULT_NORM_MODEL_RATIO)
    assert clients == [9]
    assert "0.15 x the norm of the model it updates" in rejections[0]["reason"]
    assert rejected(norm_outlier_model_ratio=0.0)[0] == [8, 9]  # without the model-size test


def test_when_most_uploads_are_non_finite_the_broadcast_is_blamed():
    template = {"w": jnp.zeros(2)}
    ups = {"w": jnp.array([[jnp.nan, 0.0], [jnp.inf, 1.0], [0.2, 0.1]])}
    _, _, report = upload_pipeline().process(0, {"a": upload_cohort(ups, template, [1, 1, 1])},
                                       {"a": {}}, {"a": 3}, jax.random.key(0))
    assert [r["client"] for r in report.rejections] == [0, 1]
    assert "2 of 3 uploads this round: a poisoned or diverged broadcast" in \
        report.rejections[0]["reason"]


def test_the_median_norm_rule_is_off_where_it_would_break_dp_or_secure_aggregation():
    from fedjax_pfedes.upload.stages import outlier_rule
    dp = privacy.ClientDPConfig(clip_norm=1.0)
    assert outlier_rule(pipeline_config())[0] == 10.0
    factor, why = outlier_rule(pipeline_config(dp=dp, weighting="uniform"))
    assert factor == 0.0 and "clip_norm" in why
    factor, why = outlier_rule(pipeline_config(secagg=True))
    assert factor == 0.0 and "range-checked before masking" in why


def test_the_norm_rule_measures_only_the_uploads_model_part():
    """FedNova uploads a solver scalar and FedProto class counts beside the model: with
    `norm_keys` the rule measures the model part, so a large scalar is no outlier."""
    template = {"model": jnp.zeros(3), "scalar": jnp.zeros(())}
    ups = {"model": jnp.full((4, 3), 0.1), "scalar": jnp.array([1.0, 1.0, 1.0, 500.0])}

    def rejected(keys):
        pipe = upload_pipeline(norm_outlier_factor=10.0, norm_keys=keys)
        _, _, report = pipe.process(0, {"a": upload_cohort(ups, template, [1, 1, 1, 1])}, {"a": {}},
                                    {"a": 4}, jax.random.key(0))
        return [r["client"] for r in report.rejections]

    assert rejected(()) == [3]           # the scalar dominates the whole upload's norm
    assert rejected(("model",)) == []    # the model parts are identical
    from fedjax_pfedes.algorithms.fednova import fednova
    from fedjax_pfedes.algorithms.fedproto import FedProtoConfig, fedproto
    assert fednova(fl_helpers.fedavg_config()).norm_keys == ("normalized_update",)
    assert fedproto(FedProtoConfig(num_classes=3, input_spec=fl_helpers.SPEC, dim=4,
                                   lr_local=0.1, batch_size=4)).norm_keys == \
        ("prototypes",)


@pytest.mark.parametrize("mapped", ["one", "vmap", "lax.map"])
def test_all_finite_is_the_exact_check_also_where_squares_overflow(mapped):
    """`validation.all_finite` decides by the sum of squares and falls back to the exact check
    when that is not finite: values of 1e20 (their squares overflow float32) are finite; a
    NaN or an Inf anywhere is not; under vmap (where the branch becomes a select) and lax.map
    too."""
    from fedjax_pfedes.upload import validation
    rows = [{"w": jnp.ones((3, 2)), "b": jnp.zeros(2)},
            {"w": jnp.full((3, 2), 1e20), "b": jnp.zeros(2)},
            {"w": jnp.ones((3, 2)).at[1, 1].set(jnp.nan), "b": jnp.zeros(2)},
            {"w": jnp.ones((3, 2)), "b": jnp.array([0.0, -jnp.inf])}]
    expected = [True, True, False, False]
    if mapped == "one":
        got = [bool(jax.jit(validation.all_finite)(r)) for r in rows]
    else:
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *rows)
        fn = (jax.vmap(validation.all_finite) if mapped == "vmap"
              else lambda s: jax.lax.map(validation.all_finite, s))
        got = np.asarray(jax.jit(fn)(stacked)).tolist()
    assert got == expected
    assert np.asarray(validation.finite_mask(jax.tree.map(lambda *xs: jnp.stack(xs), *rows))
                      ).tolist() == expected
