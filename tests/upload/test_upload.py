"""The upload pipeline: each stage against numpy / hand references / dp_accounting."""

import dataclasses
import math

import dp_accounting
import fl_helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_accounting import rdp
from scipy import stats

from configs import tabular_hetero
from fedjax_pfedes.engine.loop import run_experiment
from fedjax_pfedes.upload import compression, privacy, robust, validation
from fedjax_pfedes.upload import secure_aggregation as sa
from fedjax_pfedes.upload.pipeline import CohortUploads, PipelineConfig, UploadPipeline


def _cohort(uploads, template, sizes, valid=None, ids=None):
    n = len(sizes)
    valid = np.ones(n, bool) if valid is None else np.asarray(valid)
    ids = np.arange(n) if ids is None else np.asarray(ids)
    return CohortUploads(uploads, template, jnp.asarray(sizes, jnp.float32), valid, ids,
                         np.arange(n, dtype=np.int32))


def _pipeline(aggregation="shared", **kw):
    return UploadPipeline(PipelineConfig(**kw), aggregation, "test", num_clients=10,
                          expected_participants=4, clients_per_round=4, rounds=5)


# --- validation ---------------------------------------------------------------------------------

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
    pipe = _pipeline()
    cohorts = {"a": _cohort(good, template, [10.0, 10.0, 30.0], ids=[4, 7, 9]),
               "b": _cohort(wrong, template, [5.0, 5.0], ids=[1, 2])}
    groups, _, report = pipe.process(0, cohorts, {"a": {}, "b": {}},
                                     {"a": 3, "b": 2}, jax.random.key(0))
    reasons = {(r["client"], r["reason"].split(" (")[0]) for r in report["rejections"]}
    assert reasons == {(7, "non-finite values"), (1, "model fingerprint mismatch"),
                       (2, "model fingerprint mismatch")}
    detail = next(r["reason"] for r in report["rejections"] if r["client"] == 1)
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
    pipe = _pipeline(norm_outlier_factor=0.0)
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **kw: compiles.append(event)
        if event == "/jax/core/compile/backend_compile_duration" else None)
    for r, uploads in enumerate([finite, finite, with_nan]):
        before = len(compiles)
        groups, _, report = pipe.process(r, {"a": _cohort(uploads, template, [1.0, 2.0, 3.0])},
                                         {"a": {}}, {"a": 3}, jax.random.key(r))
        if r:
            assert len(compiles) == before, f"round {r} compiled"
    assert [x["client"] for x in report["rejections"]] == [1]
    np.testing.assert_array_equal(groups["a"][0]["w"][1], template["w"])  # the template
    np.testing.assert_array_equal(groups["a"][0]["w"][2], finite["w"][2])


@pytest.mark.parametrize("settings", [dict(topk_fraction=0.5), dict(
    dp=privacy.ClientDPConfig(clip_norm=100.0, noise_multiplier=0.0), weighting="uniform")])
def test_rejected_nan_uploads_leave_no_trace_when_the_pipeline_transforms(settings):
    from fedjax_pfedes.aggregation import weighted_mean

    cfg = dict(settings)
    topk = cfg.pop("topk_fraction", 1.0)
    pipe = UploadPipeline(PipelineConfig(compression=compression.CompressionConfig(topk), **cfg),
                          "shared", "test", num_clients=3, expected_participants=2,
                          clients_per_round=3, rounds=5)
    template = {"w": jnp.zeros(2)}
    ups = {"w": jnp.array([[1.0, 2.0], [jnp.nan, 1.0], [3.0, 0.0]])}
    groups, memories, report = pipe.process(
        0, {"a": _cohort(ups, template, [1, 1, 1])},
        {"a": pipe.init_memory(template, 3)}, {"a": 3},
        jax.random.key(0))
    assert [r["client"] for r in report["rejections"]] == [1]
    mean, _ = weighted_mean([groups["a"]])
    assert np.all(np.isfinite(np.asarray(mean["w"])))
    assert all(np.all(np.isfinite(np.asarray(m))) for m in jax.tree.leaves(memories))
    assert (len(jax.tree.leaves(memories)) == 1) == (topk < 1)  # only top-k keeps a memory


def test_norm_outliers_are_rejected_beyond_factor_times_median():
    template = {"w": jnp.zeros(2)}
    ups = {"w": jnp.array([[1.0, 0.0], [0.0, 1.2], [0.9, 0.0], [30.0, 0.0]])}
    pipe = _pipeline(norm_outlier_factor=5.0)
    groups, _, report = pipe.process(0, {"a": _cohort(ups, template, [1, 1, 1, 1])},
                                     {"a": {}}, {"a": 4}, jax.random.key(0))
    assert [r["client"] for r in report["rejections"]] == [3]
    np.testing.assert_array_equal(groups["a"][1], [1, 1, 1, 0])


def test_the_chain_follows_the_config_and_a_new_stage_is_one_class():
    from fedjax_pfedes.upload import stages
    from fedjax_pfedes.upload.pipeline import build_stages

    def names(cfg):
        return [s.name for s in build_stages(cfg, 1.0)]

    checks = ["finite_check", "compression", "norm_outlier_check"]
    assert names(PipelineConfig()) == checks + ["weighting"]
    assert names(PipelineConfig(aggregator="median")) == checks + ["weighting",
                                                                   "robust_aggregation"]
    dp = privacy.ClientDPConfig(clip_norm=1.0, noise_multiplier=1.0)
    assert names(PipelineConfig(dp=dp, weighting="uniform")) == checks + [
        "clip", "weighting", "dp_noisy_mean"]
    assert names(PipelineConfig(secagg=True, dp=dp, weighting="uniform")) == checks + [
        "clip", "weighting", "secure_aggregation"]

    class AddOne(stages.UploadStage):  # a new client-side transform
        name, transforms = "add_one", True

        def client(self, delta, memory, key, info):
            return jax.tree.map(lambda d: d + 1.0, delta), memory, info

    cfg = PipelineConfig(norm_outlier_factor=0.0)
    chain = build_stages(cfg, 0.0)
    chain.insert(1, AddOne())
    pipe = UploadPipeline(cfg, "shared", "test", 10, 4, 4, 5, stages_override=chain)
    template = {"w": jnp.array([1.0, 2.0])}
    ups = {"w": jnp.array([[1.0, 2.0], [3.0, 2.0]])}
    groups, _, _ = pipe.process(0, {"a": _cohort(ups, template, [1, 3])}, {"a": {}},
                                {"a": 2}, jax.random.key(0))
    np.testing.assert_allclose(groups["a"][0]["w"], [[2.0, 3.0], [4.0, 3.0]])


def test_a_registered_stage_joins_the_chain_at_its_position():
    from fedjax_pfedes.upload import stages
    from fedjax_pfedes.upload.pipeline import build_stages

    @dataclasses.dataclass
    class Shift(stages.UploadStage):  # a client-side transform, on when topk_fraction < 1
        amount: float = 1.0
        name, transforms, position = "shift_test", True, 25

        @classmethod
        def from_config(cls, cfg, noise_multiplier):
            return cls(0.5) if cfg.compression.topk_fraction < 1 else None

        def client(self, delta, memory, key, info):
            return jax.tree.map(lambda d: d + self.amount, delta), memory, info

    stages.register_stage(Shift)
    try:
        names = [s.name for s in build_stages(PipelineConfig(), 0.0)]
        assert "shift_test" not in names
        cfg = PipelineConfig(compression=compression.CompressionConfig(topk_fraction=0.5))
        names = [s.name for s in build_stages(cfg, 0.0)]
        assert names == ["finite_check", "compression", "shift_test", "norm_outlier_check",
                         "weighting"]

        class Twin(stages.UploadStage):
            name = "shift_test"

        with pytest.raises(ValueError, match="'shift_test' is registered twice"):
            stages.register_stage(Twin)
    finally:
        stages.STAGES.remove(Shift)


def test_a_stage_owns_its_config_fields():
    """A stage's `fields` join the default config, reach its `from_config` through the
    pipeline's settings at the run's values, and its `check` refuses a bad one by name: a new
    stage is its class, its registration and its test, no edit elsewhere."""
    import fedjax_pfedes
    from fedjax_pfedes.engine.sections import pipeline_config
    from fedjax_pfedes.engine.validate import validate_config
    from fedjax_pfedes.errors import ConfigError
    from fedjax_pfedes.upload import stages
    from fedjax_pfedes.upload.pipeline import build_stages

    @dataclasses.dataclass
    class Shift(stages.UploadStage):  # adds a constant to every update, on when amount != 0
        amount: float = 0.0
        name, transforms, position = "shift_owned", True, 25
        fields = {"shift_owned.amount": 0.0}

        @classmethod
        def from_config(cls, cfg, noise_multiplier):
            amount = cfg.field("shift_owned.amount")
            return cls(amount) if amount != 0 else None

        @classmethod
        def check(cls, cfg):
            if not cfg.field("shift_owned.amount") >= 0:
                raise ValueError("config.shift_owned.amount must be >= 0, got "
                                 f"{cfg.field('shift_owned.amount')}")

        def client(self, delta, memory, key, info):
            return jax.tree.map(lambda d: d + self.amount, delta), memory, info

    stages.register_stage(Shift)
    try:
        config = fedjax_pfedes.default_config()
        assert config.shift_owned.amount == 0.0
        assert "shift_owned" not in [s.name for s in build_stages(pipeline_config(config), 0.0)]
        config.shift_owned.amount = 0.25
        chain = build_stages(pipeline_config(config), 0.0)
        names = [s.name for s in chain]
        assert names[names.index("compression") + 1] == "shift_owned"  # position 25
        assert chain[names.index("shift_owned")].amount == 0.25
        validate_config(config)
        config.shift_owned.amount = -1.0
        with pytest.raises(ConfigError, match=r"config\.shift_owned\.amount must be >= 0"):
            validate_config(config)
    finally:
        stages.STAGES.remove(Shift)
    assert "shift_owned" not in fedjax_pfedes.default_config()


def test_the_registry_builds_the_chain_the_config_describes():
    """Against the chain written out by hand: checks, compression, norm, clip under DP,
    weighting, then at most one aggregator (secure sum, else DP noisy mean, else robust)."""
    from fedjax_pfedes.upload.pipeline import build_stages

    dp = privacy.ClientDPConfig(clip_norm=1.0, noise_multiplier=1.0)
    for use_dp in (False, True):
        for secagg in (False, True):
            for aggregator in ("mean", "median", "trimmed_mean"):
                cfg = PipelineConfig(dp=dp if use_dp else None, secagg=secagg,
                                     aggregator=aggregator)
                expected = ["finite_check", "compression", "norm_outlier_check"]
                expected += ["clip"] if use_dp else []
                expected += ["weighting"]
                if secagg:
                    expected += ["secure_aggregation"]
                elif use_dp:
                    expected += ["dp_noisy_mean"]
                elif aggregator != "mean":
                    expected += ["robust_aggregation"]
                assert [s.name for s in build_stages(cfg, 1.0)] == expected, cfg


# --- robust aggregation and weights -------------------------------------------------------------

def test_median_and_trimmed_mean_match_numpy_over_valid_clients():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(9, 4, 3)).astype(np.float32)
    valid = np.array([1, 1, 0, 1, 1, 1, 0, 1, 1], bool)
    got = robust.coordinate_median({"w": jnp.asarray(x)}, jnp.asarray(valid))["w"]
    np.testing.assert_allclose(got, np.median(x[valid], axis=0), rtol=1e-6)
    got = robust.trimmed_mean({"w": jnp.asarray(x)}, jnp.asarray(valid), 0.2)["w"]
    kept = np.sort(x[valid], axis=0)[1:-1]  # 7 valid: floor(0.2 * 7) = 1 cut at each end
    np.testing.assert_allclose(got, kept.mean(axis=0), rtol=1e-5)
    even = valid.copy()
    even[0] = False  # 6 valid: median = mean of the middle two
    got = robust.coordinate_median({"w": jnp.asarray(x)}, jnp.asarray(even))["w"]
    np.testing.assert_allclose(got, np.median(x[even], axis=0), rtol=1e-6)


def test_weight_smoothing():
    counts, valid = jnp.array([4.0, 9.0, 16.0]), jnp.array([True, False, True])
    np.testing.assert_array_equal(robust.smooth_weights(counts, valid, "samples"), [4, 0, 16])
    np.testing.assert_array_equal(robust.smooth_weights(counts, valid, "sqrt_samples"),
                                  [2, 0, 4])
    np.testing.assert_array_equal(robust.smooth_weights(counts, valid, "uniform"), [1, 0, 1])
    with pytest.raises(ValueError, match="config.upload.weighting"):
        robust.smooth_weights(counts, valid, "median")


def test_pipeline_median_hands_the_algorithm_the_median_in_every_slot():
    template = {"w": jnp.array([1.0, 1.0])}
    ups = {"w": jnp.array([[2.0, 1.0], [1.0, 5.0], [100.0, 1.5]])}
    pipe = _pipeline(aggregator="median", norm_outlier_factor=0.0)  # the median alone
    groups, _, _ = pipe.process(0, {"a": _cohort(ups, template, [1, 1, 1])},
                                {"a": {}}, {"a": 3}, jax.random.key(0))
    np.testing.assert_allclose(groups["a"][0]["w"], [[2.0, 1.5]] * 3, rtol=1e-6)


# --- compression --------------------------------------------------------------------------------

def test_topk_error_feedback_sends_every_coordinates_mass_eventually():
    rng = np.random.default_rng(0)
    memory = {"a": jnp.zeros((5, 4)), "b": jnp.zeros(7)}
    total_updates = jax.tree.map(jnp.zeros_like, memory)
    total_sent = jax.tree.map(jnp.zeros_like, memory)
    for _ in range(30):
        update = {"a": jnp.asarray(rng.normal(size=(5, 4)), jnp.float32),
                  "b": jnp.asarray(rng.normal(size=7), jnp.float32)}
        sent, memory = compression.topk_with_feedback(update, memory, 0.1)
        assert sum(int(jnp.sum(s != 0)) for s in jax.tree.leaves(sent)) == 3  # ceil(0.1 * 27)
        total_updates = jax.tree.map(jnp.add, total_updates, update)
        total_sent = jax.tree.map(jnp.add, total_sent, sent)
    jax.tree.map(lambda s, m, u: np.testing.assert_allclose(s + m, u, atol=1e-4),
                 total_sent, memory, total_updates)


def test_qsgd_is_unbiased_and_on_its_levels():
    v = {"w": jnp.array([0.3, -1.2, 0.05, 2.0, 0.0])}
    keys = jax.random.split(jax.random.key(0), 20000)
    draws = jax.vmap(lambda k: compression.qsgd(v, k, 4)["w"])(keys)
    norm = float(jnp.linalg.norm(v["w"]))
    np.testing.assert_allclose(draws.mean(0), v["w"], atol=4 * norm / 4 / math.sqrt(20000) * 2)
    levels = np.asarray(draws) / norm * 4
    np.testing.assert_allclose(levels, np.round(levels), atol=1e-4)


def test_encoded_bytes_count_the_encoded_form():
    tree = {"w": jnp.zeros((10, 10)), "b": jnp.zeros(10)}  # 110 float32 values
    assert compression.encoded_bytes(tree, compression.CompressionConfig()) == 440
    assert compression.encoded_bytes(tree, compression.CompressionConfig(values="bf16")) == 220
    # top 10%: ceil(11) = 11 values x (4 value + 4 index) bytes.
    assert compression.encoded_bytes(tree, compression.CompressionConfig(0.1)) == 88
    # QSGD s=16: 1 sign + 5 level bits per value, plus a float32 norm per leaf.
    assert compression.encoded_bytes(tree, compression.CompressionConfig(
        values="qsgd", qsgd_levels=16)) == 110 * 6 / 8 + 8


# --- differential privacy -----------------------------------------------------------------------

def test_clipping_bounds_every_update_norm():
    rng = np.random.default_rng(0)
    for scale in (0.01, 1.0, 100.0):
        u = {"a": jnp.asarray(scale * rng.normal(size=(6, 3))), "b": jnp.asarray(rng.normal(3))}
        clipped, norm = privacy.clip_update(u, 1.5)
        new_norm = math.sqrt(sum(float(jnp.sum(x ** 2)) for x in jax.tree.leaves(clipped)))
        assert new_norm <= 1.5 * (1 + 1e-6)
        if float(norm) <= 1.5:
            jax.tree.map(np.testing.assert_allclose, clipped, u)


def test_dp_mean_noise_has_std_sigma_c_over_the_fixed_denominator():
    template = {"w": jnp.zeros(20000)}
    pipe = UploadPipeline(PipelineConfig(weighting="uniform", dp=privacy.ClientDPConfig(
        clip_norm=2.0, noise_multiplier=1.5)), "shared", "test", num_clients=10,
        expected_participants=4, clients_per_round=4, rounds=5)
    ups = {"w": jnp.zeros((3, 20000))}  # zero updates: the aggregate is pure noise
    groups, _, _ = pipe.process(0, {"a": _cohort(ups, template, [5, 5, 5])},
                                {"a": {}}, {"a": 10}, jax.random.key(3))
    noise = np.asarray(groups["a"][0]["w"][0])
    expected = 1.5 * 2.0 / 4  # sigma C / expected participants (4 of 10)
    assert abs(noise.std() - expected) < 0.02 * expected
    assert abs(noise.mean()) < 4 * expected / math.sqrt(20000)


def _client_dp_config(rounds: int, every: int, noise_multiplier: float = 1.1):
    """tabular_hetero (10 clients, 5 per round) with client-level DP at sigma, uniform weights."""
    config = tabular_hetero.get_config()
    config.train.rounds = rounds
    config.eval.every = every
    config.upload.weighting = "uniform"
    config.dp.enabled = True
    config.dp.noise_multiplier = noise_multiplier
    return config


@pytest.mark.slow
def test_epsilon_in_the_metrics_equals_dp_accounting_for_the_same_events(tmp_path):
    config = _client_dp_config(3, 1)
    summary = run_experiment(config, str(tmp_path), show_progress=False)
    n, m = 10, 5  # tabular_hetero: 10 clients, C = 0.5
    # Fixed-size sampling is amplified under replace-one neighbours, where one clipped update
    # swapped for another moves the sum by 2C: the Gaussian's multiplier is sigma / 2.
    accountant = rdp.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    accountant.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.SampledWithoutReplacementDpEvent(
            n, m, dp_accounting.GaussianDpEvent(1.1 / 2)), 3))
    assert summary["final"]["dp_epsilon"] == pytest.approx(accountant.get_epsilon(1e-5),
                                                           rel=1e-9)
    assert summary["dp_neighbouring_relation"] == "replace_one"
    assert summary["dp_l2_sensitivity"] == pytest.approx(2 * config.dp.clip_norm)


@pytest.mark.slow  # PLD calibration: ~20 s
def test_noise_calibrated_from_a_target_epsilon_spends_it():
    cfg = privacy.ClientDPConfig(clip_norm=1.0, target_epsilon=5.0, delta=1e-5,
                                 accountant="pld", sampling="poisson",
                                 sampling_rate=0.1)
    sigma = privacy.calibrate_noise_multiplier(cfg, 100, 10, 50)
    assert privacy.epsilon(cfg, sigma, 100, 10, 50) == pytest.approx(5.0, rel=1e-2)
    assert privacy.epsilon(cfg, sigma * 1.2, 100, 10, 50) < 5.0


def test_incompatible_settings_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="config.upload.weighting='uniform'"):
        _pipeline(dp=privacy.ClientDPConfig(clip_norm=1.0))
    with pytest.raises(ValueError, match="config.upload.aggregator must be 'mean'"):
        _pipeline(secagg=True, aggregator="median")
    with pytest.raises(ValueError, match="own server math"):
        UploadPipeline(PipelineConfig(aggregator="median"), "custom", "fedgh", 10, 4, 4, 5)
    with pytest.raises(ValueError, match="config.dp.accountant='pld' needs"):
        privacy.ClientDPConfig(clip_norm=1.0, accountant="pld", sampling="fixed")


# --- secure aggregation -------------------------------------------------------------------------

def test_secure_sum_equals_the_plain_fixed_point_sum_exactly():
    enc = sa.RingEncoding(64, 24)
    rng = np.random.default_rng(1)
    vectors = {u: rng.normal(scale=5.0, size=1000) for u in (3, 8, 11, 20, 41)}
    result = sa.secure_sum(vectors, threshold=3, encoding=enc, seed=7)
    plain = np.zeros(1000, np.uint64)
    for v in vectors.values():
        plain = (plain + enc.encode(v)) & enc.mask
    np.testing.assert_array_equal(result.total, enc.decode(plain))  # bit-exact
    np.testing.assert_allclose(result.total, sum(vectors.values()), atol=5 * 2.0 ** -24)


def test_a_single_masked_vector_looks_uniform():
    enc = sa.RingEncoding(64, 24)
    rng = np.random.default_rng(0)
    client = sa.SecureAggregationClient(0, rng, enc)
    others = [sa.SecureAggregationClient(i, np.random.default_rng(i), enc) for i in (1, 2)]
    publics = {0: client.advertise(), **{c.id: c.advertise() for c in others}}
    client.share_keys(publics, 2)
    y = client.masked_input(np.zeros(50000))  # the most structured input there is
    counts = np.bincount((y >> np.uint64(60)).astype(np.int64), minlength=16)  # top 4 bits
    assert stats.chisquare(counts).pvalue > 1e-3
    low = np.bincount((y & np.uint64(15)).astype(np.int64), minlength=16)  # low 4 bits
    assert stats.chisquare(low).pvalue > 1e-3


def test_unmasking_survives_up_to_n_minus_t_dropouts_and_fails_clearly_below():
    enc = sa.RingEncoding(32, 12)
    rng = np.random.default_rng(2)
    vectors = {u: rng.normal(size=64) for u in range(7)}
    t = 4
    # One client drops before sending, two after: 6 senders, 4 online at unmasking = t.
    result = sa.secure_sum(vectors, t, enc, seed=3, drop_before_upload=frozenset({5}),
                           drop_after_upload=frozenset({0, 2}))
    np.testing.assert_allclose(result.total, sum(v for u, v in vectors.items() if u != 5),
                               atol=7 * 2.0 ** -12)
    assert result.senders == (0, 1, 2, 3, 4, 6)
    with pytest.raises(sa.SecureAggregationError, match="at least t=4 needed"):
        sa.secure_sum(vectors, t, enc, seed=3, drop_before_upload=frozenset({5}),
                      drop_after_upload=frozenset({0, 2, 6}))
    with pytest.raises(sa.SecureAggregationError, match="threshold is 4"):
        sa.secure_sum(vectors, t, enc, seed=3, drop_before_upload=frozenset({0, 1, 2, 3}))


@pytest.mark.parametrize("ring_bits,fraction_bits", [(64, 24), (32, 12)])
def test_the_sum_simulation_outputs_what_the_protocol_outputs_bit_for_bit(ring_bits,
                                                                         fraction_bits):
    """`simulation='sum'` against every party running (`'protocol'`) over drop-outs before and
    after sending, clients that skip their range check (wrapping around, NaN, Inf), and the
    quorum failures: same sums, senders, byte counts and error messages."""
    enc = sa.RingEncoding(ring_bits, fraction_bits)
    rng = np.random.default_rng(ring_bits)
    ids = [2, 5, 7, 11, 13, 17, 19]
    bound = enc.max_abs(len(ids))
    vectors = {u: rng.uniform(-bound, bound, 257) for u in ids}
    vectors[5] = np.concatenate([[np.nan, np.inf, -np.inf], 1e3 * bound * np.ones(254)])
    scenarios = [
        dict(),
        dict(drop_before_upload=frozenset({7}), drop_after_upload=frozenset({2})),
        dict(unchecked=frozenset({5, 11})),
        dict(drop_after_upload=frozenset({2, 7, 11}), unchecked=frozenset({5})),
        dict(drop_after_upload=frozenset({2, 7, 11, 13})),            # 3 online, t = 4
        dict(drop_before_upload=frozenset({2, 7, 11, 13})),           # 3 senders, t = 4
    ]
    outcomes = 0
    for scenario in scenarios:
        unchecked = scenario.get("unchecked", frozenset())
        vs = {u: v for u, v in vectors.items() if u != 5 or 5 in unchecked}
        results = []
        for simulation in ("protocol", "sum"):
            try:
                results.append(sa.secure_sum(vs, 4, enc, seed=11, simulation=simulation,
                                             **scenario))
            except sa.SecureAggregationError as e:
                results.append(str(e))
        protocol, direct = results
        if isinstance(protocol, str):
            assert direct == protocol
            continue
        outcomes += 1
        np.testing.assert_array_equal(direct.total, protocol.total)
        assert direct.senders == protocol.senders
        assert direct.bytes_per_sender == protocol.bytes_per_sender
    assert outcomes == 4
    with pytest.raises(ValueError, match="config.secagg.simulation must be one of"):
        sa.secure_sum(vectors, 4, enc, seed=0, simulation="fast")


def test_shamir_reconstructs_from_any_t_shares_only():
    rng = np.random.default_rng(0)
    secret = int.from_bytes(rng.bytes(32), "big")
    shares = sa.shamir_share(secret, 3, 6, rng)
    assert sa.shamir_reconstruct([shares[5], shares[1], shares[3]], 3) == secret
    assert sa.shamir_reconstruct(shares[:2] + [shares[0]] * 0 + [shares[4]], 3) == secret
    with pytest.raises(sa.SecureAggregationError, match="3 shares needed, got 2"):
        sa.shamir_reconstruct(shares[:2], 3)


def test_secure_sum_still_checks_the_fixed_point_range_per_client():
    enc = sa.RingEncoding(32, 24)
    with pytest.raises(ValueError, match="client 1 has .* beyond the fixed-point range"):
        sa.secure_sum({0: np.zeros(3), 1: np.array([0.0, 500.0, 0.0])}, 1, enc, seed=0)


def _secagg_pipeline(num_clients=10, expected=4, **kw):
    return UploadPipeline(PipelineConfig(secagg=True, **kw), "shared", "test",
                          num_clients=num_clients, expected_participants=expected,
                          clients_per_round=expected, rounds=5)


def test_secure_aggregation_rejects_an_out_of_range_client_and_sums_the_rest():
    enc = sa.RingEncoding(32, 16)  # |value| < 2^15 / senders
    pipe = _secagg_pipeline(encoding=enc)
    template = {"w": jnp.zeros(3)}
    ups = {"w": jnp.array([[1.0, 2.0, 3.0], [0.5, 0.5, 0.5], [9e3, 0.0, 0.0], [1.0, 0.0, 1.0]])}
    groups, _, report = pipe.process(0, {"a": _cohort(ups, template, [1, 1, 1, 1])},
                                     {"a": {}}, {"a": 4}, jax.random.key(0))
    assert [r["client"] for r in report["rejections"]] == [2]
    assert "fixed-point range" in report["rejections"][0]["reason"]
    np.testing.assert_allclose(groups["a"][0]["w"][0], [2.5 / 3, 2.5 / 3, 4.5 / 3], atol=1e-4)
    assert report["secagg_senders"] == 3


def test_secure_aggregation_refuses_fewer_than_min_senders():
    pipe = _secagg_pipeline()  # min_senders = 3 by default
    template = {"w": jnp.zeros(2)}
    ups = {"w": jnp.array([[1.0, 2.0], [3.0, 4.0], [0.0, 0.0]])}
    groups, _, report = pipe.process(0, {"a": _cohort(ups, template, [1, 1, 1], [1, 1, 0])},
                                     {"a": {}}, {"a": 3}, jax.random.key(0))
    np.testing.assert_array_equal(groups["a"][1], [0, 0, 0])  # no update from a pair
    assert report["secagg_skipped"] == ["a: 2 sender(s), config.secagg.min_senders=3"]
    assert "secagg_senders" not in report
    with pytest.raises(ValueError, match="config.secagg.min_senders must be >= 2"):
        _secagg_pipeline(secagg_min_senders=1)


def test_secure_aggregation_reports_a_quantization_bound_that_holds():
    enc = sa.RingEncoding(64, 8)  # coarse: resolution 2^-8
    pipe = _secagg_pipeline(encoding=enc)
    rng = np.random.default_rng(0)
    x = rng.normal(scale=0.01, size=(5, 200)).astype(np.float32)  # mostly below resolution
    sizes = np.array([3.0, 1.0, 2.0, 5.0, 4.0])
    groups, _, report = pipe.process(0, {"a": _cohort({"w": jnp.asarray(x)}, {"w": jnp.zeros(200)},
                                                      sizes)},
                                     {"a": {}}, {"a": 5}, jax.random.key(0))
    exact = sizes @ x.astype(np.float64) / sizes.sum()
    error = np.abs(np.asarray(groups["a"][0]["w"][0], np.float64) - exact).max()
    bound = report["secagg_quantization_error_bound"]
    # weights travel divided by 2 (the power of two at or below their mean 3)
    assert bound == pytest.approx(5 * 2.0 ** -9 / (sizes.sum() / 2))
    assert 0 < error <= bound * (1 + 1e-6)


def test_secure_aggregation_with_dp_accounts_the_noise_the_senders_really_added():
    dp = privacy.ClientDPConfig(clip_norm=1.0, noise_multiplier=1.2)
    pipe = _secagg_pipeline(num_clients=20, expected=4, dp=dp, weighting="uniform")
    template = {"w": jnp.zeros(3)}
    ups = {"w": jnp.ones((4, 3)) * 0.1}
    released = []
    for r, valid in enumerate([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]]):
        _, _, report = pipe.process(r, {"a": _cohort(ups, template, [1] * 4, valid)},
                                    {"a": {}}, {"a": 20}, jax.random.key(r))
        released.append(report["dp_round_noise_multiplier"])
    # expected 4 per round of 20; senders 4, 3, then 2 (< min_senders: nothing released)
    assert released == [pytest.approx(1.2), pytest.approx(1.2 * math.sqrt(3 / 4)), None]
    accountant = rdp.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    for sigma in (1.2, 1.2 * math.sqrt(3 / 4)):  # replace-one: sensitivity 2C
        accountant.compose(dp_accounting.SampledWithoutReplacementDpEvent(
            20, 4, dp_accounting.GaussianDpEvent(sigma / 2)))
    got = privacy.epsilon_of_rounds(dp, released, 20, 4)
    assert got == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-9)
    assert got > privacy.epsilon(dp, 1.2, 20, 4, 2)  # nominal accounting under-reports


# --- a wild client under default settings -------------------------------------------------------

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
    pipe = _pipeline()  # PipelineConfig() defaults: norm_outlier_factor = 10
    assert pipe.cfg.norm_outlier_factor == 10.0 and not pipe.active
    groups, _, report = pipe.process(0, {"a": _cohort(ups, template, [5] * 6, ids=range(10, 16))},
                                     {"a": {}}, {"a": 6}, jax.random.key(0))
    assert [r["client"] for r in report["rejections"]] == [14]
    assert "beyond 10 x the round's median" in report["rejections"][0]["reason"]
    from fedjax_pfedes.aggregation import weighted_mean
    mean, _ = weighted_mean([groups["a"]])
    np.testing.assert_allclose(mean["w"], np.delete(honest, 4, 0).mean(0), rtol=1e-5)


def test_outliers_are_judged_across_the_cohorts_of_one_shared_tree():
    # pFedES-style shared aggregation: one participant per cohort, the wild one alone in its own
    template = {"w": jnp.zeros(2)}
    cohorts = {f"arch{k}": _cohort({"w": jnp.array([[0.1 * (k + 1), 0.0]])}, template, [1],
                                   ids=[k]) for k in range(4)}
    cohorts["arch3"] = _cohort({"w": jnp.array([[50.0, 0.0]])}, template, [1], ids=[3])
    _, _, report = _pipeline("shared").process(
        0, cohorts, {a: {} for a in cohorts}, {a: 1 for a in cohorts},
        jax.random.key(0))
    assert [r["client"] for r in report["rejections"]] == [3]
    _, _, report = _pipeline("per_cohort").process(  # alone in a cohort: no median to judge by
        0, cohorts, {a: {} for a in cohorts}, {a: 1 for a in cohorts},
        jax.random.key(0))
    assert report["rejections"] == []


def test_when_most_uploads_are_non_finite_the_broadcast_is_blamed():
    template = {"w": jnp.zeros(2)}
    ups = {"w": jnp.array([[jnp.nan, 0.0], [jnp.inf, 1.0], [0.2, 0.1]])}
    _, _, report = _pipeline().process(0, {"a": _cohort(ups, template, [1, 1, 1])},
                                       {"a": {}}, {"a": 3}, jax.random.key(0))
    assert [r["client"] for r in report["rejections"]] == [0, 1]
    assert "2 of 3 uploads this round: a poisoned or diverged broadcast" in \
        report["rejections"][0]["reason"]


def test_the_median_norm_rule_is_off_where_it_would_break_dp_or_secure_aggregation():
    from fedjax_pfedes.upload.stages import outlier_rule
    dp = privacy.ClientDPConfig(clip_norm=1.0)
    assert outlier_rule(PipelineConfig())[0] == 10.0
    factor, why = outlier_rule(PipelineConfig(dp=dp, weighting="uniform"))
    assert factor == 0.0 and "clip_norm" in why
    factor, why = outlier_rule(PipelineConfig(secagg=True))
    assert factor == 0.0 and "range-checked before masking" in why


# --- everything together ------------------------------------------------------------------------

@pytest.mark.slow
def test_pfedes_with_topk_dp_and_secure_aggregation_runs_end_to_end(tmp_path):
    config = tabular_hetero.get_config()
    config.train.rounds = 2
    config.eval.every = 1
    config.upload.topk_fraction = 0.1
    config.upload.weighting = "uniform"
    config.dp.enabled = True
    config.dp.target_epsilon = 8.0
    config.secagg.enabled = True
    config.secagg.dropout_after_upload = 0.2
    import json

    final = run_experiment(config, str(tmp_path), show_progress=False)["final"]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    released = [r for r in rows if r.get("dp_realized_noise_multiplier") is not None]
    # A round whose unmasking failed released nothing and costs nothing (round 2 here: 2 of 5
    # senders dropped after uploading); the calibration spends 8 over both rounds.
    assert [r["round"] for r in released] == [1] and "secagg_failures" in rows[1]
    assert 0 < final["dp_epsilon"] < 8.0 * 0.9
    assert 0.0 <= final["personalized_accuracy_mean"] <= 1.0
    # Secure aggregation sends dense masked vectors whatever top-k kept: proxy_mlp on 30
    # features with d = 32 has 30*128 + 128 + 128*32 + 32 = 8,096 values, plus the weight, as
    # 64-bit ring elements; plus a 32-byte key and two 66-byte shares per other participant
    # (5 participants per round).
    assert final["upload_bytes_per_client"] == 8097 * 8 + 32 + 2 * 66 * 4


@pytest.mark.slow
def test_secure_aggregation_dp_epsilon_composes_the_realized_noise_of_every_round(tmp_path):
    """Poisson sampling + secure aggregation + DP: the senders of a round vary, so does the noise
    their shares add up to; the reported epsilon is dp_accounting's composition of exactly the
    per-round noise multipliers written to metrics.jsonl."""
    import json

    config = _client_dp_config(4, 4)
    config.train.sampling = "poisson"
    config.train.client_fraction = 0.5
    config.secagg.enabled = True
    final = run_experiment(config, str(tmp_path), show_progress=False)["final"]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    realized = [r.get("dp_realized_noise_multiplier") for r in rows]
    for r, sigma in zip(rows, realized, strict=True):
        if sigma is not None:  # sigma * sqrt(senders / expected 5)
            assert sigma == pytest.approx(1.1 * math.sqrt(r["secagg_senders"] / 5), rel=1e-9)
    assert len({s for s in realized if s is not None}) > 1, realized  # the point of the test
    accountant = rdp.RdpAccountant()
    for sigma in realized:
        if sigma is not None:
            accountant.compose(dp_accounting.PoissonSampledDpEvent(
                0.5, dp_accounting.GaussianDpEvent(sigma)))
    assert final["dp_epsilon"] == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-9)


# --- sample-level DP-SGD --------------------------------------------------------------------------

def test_private_gradient_clips_each_example_and_divides_by_the_batch_size():
    from fedjax_pfedes.algorithms.local_training import DPSGDConfig, private_gradient

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(6, 3)), jnp.float32)
    y = jnp.asarray(rng.normal(size=6), jnp.float32)
    mask = jnp.array([1, 1, 1, 1, 0, 0], bool)
    w = jnp.asarray(rng.normal(size=3), jnp.float32)

    def loss(p, batch):
        bx, by, bm = batch
        return jnp.sum(bm * (bx @ p - by) ** 2) / jnp.maximum(jnp.sum(bm), 1), ()

    g, _ = private_gradient(loss, w, (x, y, mask), mask, jax.random.key(0),
                            DPSGDConfig(clip_norm=0.5, noise_multiplier=0.0))
    per_example = 2 * (np.asarray(x) @ np.asarray(w) - np.asarray(y))[:, None] * np.asarray(x)
    norms = np.linalg.norm(per_example, axis=1)
    clipped = per_example * np.minimum(1, 0.5 / norms)[:, None]
    np.testing.assert_allclose(g, clipped[:4].sum(0) / 6, rtol=1e-5)
    noisy = jax.vmap(lambda k: private_gradient(
        loss, w, (x, y, mask), mask, k, DPSGDConfig(clip_norm=0.5, noise_multiplier=2.0))[0])(
        jax.random.split(jax.random.key(1), 4000))
    assert np.std(np.asarray(noisy) - np.asarray(g), axis=0) == pytest.approx(
        [2.0 * 0.5 / 6] * 3, rel=0.05)


def _dp_sgd_run(tmp_path, algorithm: str, noise_multiplier: float):
    """Two rounds of `algorithm` with DP-SGD on the tabular config; returns (config, final)."""
    config = tabular_hetero.get_config()
    config.algorithm = algorithm
    config.train.rounds = 2
    config.eval.every = 2
    config.clients.architectures = "mlp_small"
    config.dp_sgd.enabled = True
    config.dp_sgd.noise_multiplier = noise_multiplier
    return config, run_experiment(config, str(tmp_path), show_progress=False)["final"]


@pytest.mark.slow
def test_dp_sgd_runs_for_fedavg_and_reports_per_client_epsilon(tmp_path):
    _, final = _dp_sgd_run(tmp_path, "fedavg", 1.3)
    assert np.isfinite(final["dp_sgd_epsilon_max"])
    assert final["dp_sgd_epsilon_max"] >= final["dp_sgd_epsilon_mean"] > 0


def test_dp_sgd_is_refused_where_it_is_not_built_in():
    from configs import quickstart
    from fedjax_pfedes.engine.validate import validate_config
    from fedjax_pfedes.errors import ConfigError

    config = quickstart.get_config()
    config.dp_sgd.enabled = True
    config.algorithm = "lg_fedavg"
    with pytest.raises(ConfigError, match="config.dp_sgd.enabled: DP-SGD is built into"):
        validate_config(config)
    config.algorithm, config.align = "pfedes", "contrastive"
    with pytest.raises(ConfigError, match="per-example alignment"):
        validate_config(config)


def test_every_registered_algorithm_builds_with_the_aggregation_it_declares():
    from fedjax_pfedes.algorithms import registry
    from fedjax_pfedes.engine.build import build_algorithm, build_federated_data
    from fedjax_pfedes.engine.validate import aggregation_kind

    tabular = tabular_hetero.get_config()
    images = fl_helpers.small_config()
    data = {"tabular": build_federated_data(tabular), "images": build_federated_data(images)}
    assert len(registry.names()) >= 16
    for name, entry in registry.entries().items():
        config, kind = (images, "images") if name == "pfedes_paper" else (tabular, "tabular")
        config.algorithm = name
        algorithm = build_algorithm(config, data[kind])
        assert algorithm.name == name
        assert algorithm.aggregation == entry.aggregation == aggregation_kind(name), name


@pytest.mark.slow
@pytest.mark.parametrize("algorithm,releases", [("fedavg", 1), ("pfedes", 2)])
def test_dp_sgd_epsilon_equals_dp_accounting_for_the_releases_that_happened(
        tmp_path, algorithm, releases):
    """Every local step is one Poisson-sampled batch (q = B / n_k) on which the algorithm releases
    `releases` noisy gradients (pFedES: private model and E_proxy): the reported epsilon must be
    dp_accounting's for exactly those events, recomputed here from clients.jsonl."""
    import json

    import dp_accounting
    config, final = _dp_sgd_run(tmp_path, algorithm, 1.0)
    steps, samples = {}, {}
    for line in open(tmp_path / "clients.jsonl"):
        row = json.loads(line)
        if row["status"] in ("delivered", "partial"):
            steps[row["client"]] = steps.get(row["client"], 0) + row["local_steps"]
            samples[row["client"]] = row["samples"]

    def epsilon(cid, per_step):
        accountant = dp_accounting.rdp.RdpAccountant()
        q = min(1.0, config.train.batch_size / samples[cid])
        accountant.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
            q, dp_accounting.ComposedDpEvent(
                [dp_accounting.GaussianDpEvent(1.0)] * per_step)), steps[cid]))
        return accountant.get_epsilon(config.dp_sgd.delta)

    expected = max(epsilon(c, releases) for c in steps)
    assert final["dp_sgd_releases_per_step"] == releases
    assert final["dp_sgd_epsilon_max"] == pytest.approx(expected, rel=1e-6)
    if releases > 1:  # counting one release per step would under-report
        assert final["dp_sgd_epsilon_max"] > 1.2 * max(epsilon(c, 1) for c in steps)


def test_trimmed_mean_trims_at_least_one_per_side_below_ten_uploads():
    """floor(0.1 * 9) = 0 made the default trimmed mean a plain mean with 9 uploads."""
    x = np.arange(9, dtype=np.float32)[:, None] ** 3  # one large outlier at the top
    valid = np.ones(9, bool)
    got = robust.trimmed_mean({"w": jnp.asarray(x)}, jnp.asarray(valid), 0.1)["w"]
    np.testing.assert_allclose(got, np.sort(x, axis=0)[1:-1].mean(axis=0), rtol=1e-6)
    assert int(robust.trim_count(jnp.int32(9), 0.1)) == 1
    assert int(robust.trim_count(jnp.int32(25), 0.1)) == 2
    assert int(robust.trim_count(jnp.int32(3), 0.4)) == 1
    assert int(robust.trim_count(jnp.int32(9), 0.0)) == 0  # 0 = no trimming, a plain mean


@pytest.mark.parametrize("aggregator", ["median", "trimmed_mean"])
def test_robust_aggregation_of_fewer_than_three_uploads_is_skipped_and_reported(aggregator):
    template = {"w": jnp.array([1.0, 1.0])}
    ups = {"w": jnp.array([[2.0, 1.0], [100.0, 5.0], [0.0, 0.0]])}
    pipe = _pipeline(aggregator=aggregator, norm_outlier_factor=0.0)
    groups, _, report = pipe.process(0, {"a": _cohort(ups, template, [1, 1, 1], [1, 1, 0])},
                                     {"a": {}}, {"a": 3}, jax.random.key(0))
    np.testing.assert_array_equal(groups["a"][1], [0, 0, 0])  # nobody counts: state kept
    assert report["robust_aggregation_skipped"] == [
        f"a: 2 valid upload(s), config.upload.aggregator='{aggregator}' needs >= 3"]
    groups, _, report = pipe.process(0, {"a": _cohort(ups, template, [1, 1, 1])},
                                     {"a": {}}, {"a": 3}, jax.random.key(0))
    assert "robust_aggregation_skipped" not in report and float(groups["a"][1].sum()) > 0


@pytest.mark.slow
@pytest.mark.parametrize("change", [{"train.sampling": "stratified", "train.strata": 1},
                                    {"system.availability": "0.9,0.5"},
                                    {"system.dropout": 0.2},
                                    {"train.min_samples": 40, "train.below_min": "one_epoch"}])
def test_client_dp_claims_no_amplification_when_selection_is_not_uniform(tmp_path, change):
    """Stratified quotas over public strata, availability < 1 and failure-decayed weights are
    not a uniformly random draw (but do not read the clients' data): epsilon is the plain
    Gaussian mechanism composed per round, at the replace-one sensitivity 2C."""
    config = _client_dp_config(3, 3)
    for field, value in change.items():
        section, name = field.split(".")
        config[section][name] = value
    summary = run_experiment(config, str(tmp_path), show_progress=False)
    accountant = rdp.RdpAccountant()
    accountant.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.GaussianDpEvent(1.1 / 2), 3))
    expected = ("none" if "train.min_samples" not in change else "fixed")
    assert summary["dp_accounting_sampling"] == expected
    assert summary["dp_neighbouring_relation"] == "replace_one"
    if expected == "fixed":  # one-epoch small clients: still a uniform draw
        return
    assert summary["final"]["dp_epsilon"] == pytest.approx(accountant.get_epsilon(1e-5),
                                                           rel=1e-9)
    amplified = rdp.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    amplified.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.SampledWithoutReplacementDpEvent(
            10, 5, dp_accounting.GaussianDpEvent(1.1 / 2)), 3))
    assert summary["final"]["dp_epsilon"] > amplified.get_epsilon(1e-5)


def test_the_norm_rule_measures_only_the_uploads_model_part():
    """FedNova uploads a solver scalar and FedProto class counts beside the model: with
    `norm_keys` the rule measures the model part, so a large scalar is no outlier."""
    template = {"model": jnp.zeros(3), "scalar": jnp.zeros(())}
    ups = {"model": jnp.full((4, 3), 0.1), "scalar": jnp.array([1.0, 1.0, 1.0, 500.0])}

    def rejected(keys):
        pipe = _pipeline(norm_outlier_factor=10.0, norm_keys=keys)
        _, _, report = pipe.process(0, {"a": _cohort(ups, template, [1, 1, 1, 1])}, {"a": {}},
                                    {"a": 4}, jax.random.key(0))
        return [r["client"] for r in report["rejections"]]

    assert rejected(()) == [3]           # the scalar dominates the whole upload's norm
    assert rejected(("model",)) == []    # the model parts are identical
    from fedjax_pfedes.algorithms.fednova import fednova
    from fedjax_pfedes.algorithms.fedproto import FedProtoConfig, fedproto
    assert fednova(fl_helpers.fedavg_config()).norm_keys == ("normalized_update",)
    assert fedproto(FedProtoConfig(num_classes=3, input_spec=fl_helpers.SPEC, dim=4,
                                   lr_local=0.1, batch_size=4)).norm_keys == \
        ("prototypes",)


def test_all_samples_weighting_counts_training_and_local_test_rows():
    """The published pFedES code weighs an upload by all of its client's samples."""
    template = {"w": jnp.zeros(2)}
    ups = {"w": jnp.array([[1.0, 0.0], [0.0, 1.0]])}
    cohort = _cohort(ups, template, [8, 2])
    cohort = dataclasses.replace(cohort, all_sizes=jnp.asarray([10.0, 10.0]))
    for weighting, want in (("samples", [0.8, 0.2]), ("all_samples", [0.5, 0.5])):
        pipe = _pipeline(weighting=weighting, norm_outlier_factor=0.0)
        groups, _, _ = pipe.process(0, {"a": cohort}, {"a": {}}, {"a": 2}, jax.random.key(0))
        w = np.asarray(groups["a"][1])
        np.testing.assert_allclose(w / w.sum(), want, rtol=1e-6)


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
