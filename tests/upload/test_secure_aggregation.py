"""Secure aggregation (`upload/secure_aggregation.py` and its stage): the protocol, its sum
simulation, range checks, quorum, and DP with distributed noise.
"""


import math

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_accounting import rdp
from fl_helpers import client_dp_config, pipeline_config, upload_cohort
from scipy import stats

from configs import tabular_hetero
from fedjax_pfedes.config.defaults import SecAggSection
from fedjax_pfedes.engine.loop import run_experiment
from fedjax_pfedes.upload import privacy
from fedjax_pfedes.upload import secure_aggregation as sa
from fedjax_pfedes.upload.pipeline import UploadPipeline


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


def _secagg_pipeline(num_clients=10, expected=4, dp=None, encoding=None, **kw):
    """A secure-aggregation pipeline: `secagg_<field>` keywords set `config.secagg.<field>`,
    `encoding` its ring, the others `config.upload`'s fields."""
    secagg = {k[len("secagg_"):]: kw.pop(k) for k in list(kw) if k.startswith("secagg_")}
    if encoding is not None:
        secagg.update(ring_bits=encoding.ring_bits, fraction_bits=encoding.fraction_bits)
    cfg = pipeline_config(dp=dp, secagg=SecAggSection(enabled=True, **secagg), **kw)
    return UploadPipeline(cfg, "shared", "test", num_clients=num_clients,
                          expected_participants=expected, clients_per_round=expected, rounds=5)


def test_secure_aggregation_rejects_an_out_of_range_client_and_sums_the_rest():
    enc = sa.RingEncoding(32, 16)  # |value| < 2^15 / senders
    pipe = _secagg_pipeline(encoding=enc)
    template = {"w": jnp.zeros(3)}
    ups = {"w": jnp.array([[1.0, 2.0, 3.0], [0.5, 0.5, 0.5], [9e3, 0.0, 0.0], [1.0, 0.0, 1.0]])}
    groups, _, report = pipe.process(0, {"a": upload_cohort(ups, template, [1, 1, 1, 1])},
                                     {"a": {}}, {"a": 4}, jax.random.key(0))
    assert [r["client"] for r in report.rejections] == [2]
    assert "fixed-point range" in report.rejections[0]["reason"]
    np.testing.assert_allclose(groups["a"][0]["w"][0], [2.5 / 3, 2.5 / 3, 4.5 / 3], atol=1e-4)
    assert report.record["secagg_senders"] == 3


def test_secure_aggregation_refuses_fewer_than_min_senders():
    pipe = _secagg_pipeline()  # min_senders = 3 by default
    template = {"w": jnp.zeros(2)}
    ups = {"w": jnp.array([[1.0, 2.0], [3.0, 4.0], [0.0, 0.0]])}
    groups, _, report = pipe.process(0, {"a": upload_cohort(ups, template, [1, 1, 1], [1, 1, 0])},
                                     {"a": {}}, {"a": 3}, jax.random.key(0))
    np.testing.assert_array_equal(groups["a"][1], [0, 0, 0])  # no update from a pair
    assert report.record["secagg_skipped"] == ["a: 2 sender(s), config.secagg.min_senders=3"]
    assert "secagg_senders" not in report.record
    with pytest.raises(ValueError, match="config.secagg.min_senders must be >= 2"):
        _secagg_pipeline(secagg_min_senders=1)


def test_secure_aggregation_reports_a_quantization_bound_that_holds():
    enc = sa.RingEncoding(64, 8)  # coarse: resolution 2^-8
    pipe = _secagg_pipeline(encoding=enc)
    rng = np.random.default_rng(0)
    x = rng.normal(scale=0.01, size=(5, 200)).astype(np.float32)  # mostly below resolution
    sizes = np.array([3.0, 1.0, 2.0, 5.0, 4.0])
    cohort = upload_cohort({"w": jnp.asarray(x)}, {"w": jnp.zeros(200)}, sizes)
    groups, _, report = pipe.process(0, {"a": cohort},
                                     {"a": {}}, {"a": 5}, jax.random.key(0))
    exact = sizes @ x.astype(np.float64) / sizes.sum()
    error = np.abs(np.asarray(groups["a"][0]["w"][0], np.float64) - exact).max()
    bound = report.record["secagg_quantization_error_bound"]
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
        _, _, report = pipe.process(r, {"a": upload_cohort(ups, template, [1] * 4, valid)},
                                    {"a": {}}, {"a": 20}, jax.random.key(r))
        released.append(report.dp_noise_multiplier)
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

    config = client_dp_config(4, 4)
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


# --- simulation='aggregate': the senders' summed noise drawn once ---------------------------


def test_aggregate_without_noise_is_the_protocols_output_up_to_its_rounding():
    """With sigma = 0 'aggregate' is the mean of the clipped updates, which the protocol
    ('sum': the ring sum of fixed-point encodings) outputs up to the reported rounding bound;
    both count the same senders and bytes."""
    dp = privacy.ClientDPConfig(clip_norm=1.0, noise_multiplier=0.0)
    rng = np.random.default_rng(3)
    x = rng.normal(scale=0.5, size=(6, 40)).astype(np.float32)
    cohort = lambda: upload_cohort({"w": jnp.asarray(x)}, {"w": jnp.zeros(40)}, [1] * 6,  # noqa: E731
                                   valid=[1, 1, 1, 1, 0, 1])
    out = {}
    for simulation in ("sum", "aggregate"):
        pipe = _secagg_pipeline(num_clients=12, expected=5, dp=dp, weighting="uniform",
                                secagg_simulation=simulation)
        groups, _, report = pipe.process(0, {"a": cohort()}, {"a": {}}, {"a": 12},
                                         jax.random.key(1))
        out[simulation] = (np.asarray(groups["a"][0]["w"][0], np.float64), report)
    norms = np.linalg.norm(x.astype(np.float64), axis=1, keepdims=True)
    clipped = x * np.minimum(1.0, 1.0 / norms)
    want = clipped[[0, 1, 2, 3, 5]].sum(0) / 5  # fixed denominator: 5 expected
    bound = out["sum"][1].record["secagg_quantization_error_bound"]
    np.testing.assert_allclose(out["aggregate"][0], want, rtol=1e-5, atol=1e-7)
    assert np.abs(out["sum"][0] - want).max() <= bound * (1 + 1e-6) + 1e-7
    for key in ("secagg_senders", "secagg_quantization_error_bound",
                "dp_realized_noise_multiplier"):
        assert out["aggregate"][1].record[key] == out["sum"][1].record[key], key
    assert (out["aggregate"][1].upload_bytes_per_client
            == out["sum"][1].upload_bytes_per_client)


def test_aggregate_draws_the_senders_summed_noise_variance():
    """senders x (sigma C)^2 / expected is the variance of the summed shares: the released
    mean of zero updates has std sigma C sqrt(senders / expected) / expected per value (one
    draw of 200,000 values, a chi-square interval), and the realized noise multiplier the
    accountant composes is sigma sqrt(senders / expected)."""
    dp = privacy.ClientDPConfig(clip_norm=2.0, noise_multiplier=1.5)
    pipe = _secagg_pipeline(num_clients=40, expected=8, dp=dp, weighting="uniform",
                            secagg_simulation="aggregate")
    n = 200_000
    cohort = upload_cohort({"w": jnp.zeros((6, n))}, {"w": jnp.zeros(n)}, [1] * 6)
    groups, _, report = pipe.process(0, {"a": cohort}, {"a": {}}, {"a": 40}, jax.random.key(7))
    values = np.asarray(groups["a"][0]["w"][0], np.float64)
    want = 1.5 * 2.0 * math.sqrt(6 / 8) / 8
    low, high = (math.sqrt(stats.chi2.ppf(q, n) / n) for q in (0.0005, 0.9995))
    assert low * want <= values.std() <= high * want
    assert abs(values.mean()) < 5 * want / math.sqrt(n)
    assert report.record["dp_realized_noise_multiplier"] == pytest.approx(1.5 * math.sqrt(6 / 8))


def test_aggregate_fails_on_the_same_quorum_and_refuses_attacks():
    """Drop-outs after upload below the threshold: no sum, every sender rejected, nothing
    released; and a run that pairs 'aggregate' with config.attack is refused before it
    starts, naming both fields."""
    from fedjax_pfedes.engine import validate
    dp = privacy.ClientDPConfig(clip_norm=1.0, noise_multiplier=1.0)
    pipe = _secagg_pipeline(dp=dp, weighting="uniform", secagg_simulation="aggregate",
                            secagg_dropout_after_upload=0.95)
    cohort = upload_cohort({"w": jnp.ones((4, 3))}, {"w": jnp.zeros(3)}, [1] * 4)
    groups, _, report = pipe.process(0, {"a": cohort}, {"a": {}}, {"a": 10}, jax.random.key(0))
    assert report.record["secagg_failures"] and report.rejected == 4
    assert report.dp_noise_multiplier is None
    np.testing.assert_array_equal(groups["a"][1], np.zeros(4))
    config = client_dp_config(2, 2)
    config.secagg.enabled, config.secagg.simulation = True, "aggregate"
    config.attack.clients, config.attack.kind = "0", "scale"
    with pytest.raises(validate.ConfigError, match=r"simulation='aggregate'.*config\.attack"):
        validate.validate_config(config)
