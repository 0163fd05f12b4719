"""Client-level DP (`upload/privacy.py`) and sample-level DP-SGD: clipping, noise, and epsilon
against dp_accounting for the events that happened.
"""


import math

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_accounting import rdp
from fl_helpers import client_dp_config, pipeline_config, upload_cohort

from configs import tabular_hetero
from fedjax_pfedes.engine.loop import run_experiment
from fedjax_pfedes.upload import privacy
from fedjax_pfedes.upload.pipeline import UploadPipeline


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
    pipe = UploadPipeline(pipeline_config(weighting="uniform", dp=privacy.ClientDPConfig(
        clip_norm=2.0, noise_multiplier=1.5)), "shared", "test", num_clients=10,
        expected_participants=4, clients_per_round=4, rounds=5)
    ups = {"w": jnp.zeros((3, 20000))}  # zero updates: the aggregate is pure noise
    groups, _, _ = pipe.process(0, {"a": upload_cohort(ups, template, [5, 5, 5])},
                                {"a": {}}, {"a": 10}, jax.random.key(3))
    noise = np.asarray(groups["a"][0]["w"][0])
    expected = 1.5 * 2.0 / 4  # sigma C / expected participants (4 of 10)
    assert abs(noise.std() - expected) < 0.02 * expected
    assert abs(noise.mean()) < 4 * expected / math.sqrt(20000)



@pytest.mark.slow
def test_epsilon_in_the_metrics_equals_dp_accounting_for_the_same_events(tmp_path):
    config = client_dp_config(3, 1)
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


@pytest.mark.slow
@pytest.mark.parametrize("change", [{"train.sampling": "stratified", "train.strata": 1},
                                    {"system.availability": "0.9,0.5"},
                                    {"system.dropout": 0.2},
                                    {"train.min_samples": 40, "train.below_min": "one_epoch"}])
def test_client_dp_claims_no_amplification_when_selection_is_not_uniform(tmp_path, change):
    """Stratified quotas over public strata, availability < 1 and failure-decayed weights are
    not a uniformly random draw (but do not read the clients' data): epsilon is the plain
    Gaussian mechanism composed per round, at the replace-one sensitivity 2C."""
    config = client_dp_config(3, 3)
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
