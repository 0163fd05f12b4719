"""Every reported client-level epsilon against dp_accounting built here, in the test, for the events
that happened and the neighbouring relation summary.json states (P11-P16 of docs/threat_model.md).

The references share nothing with `fedjax_pfedes.upload.privacy` but the library: the events
are written out by hand from what the run did (rounds, population, the sampler's rate, the
noise std over the relation's sensitivity).
"""

import json

import dp_accounting
import pytest
from dp_accounting import rdp
from fl_helpers import tiny_config

from configs import private_quickstart
from fedjax_pfedes.engine import sections
from fedjax_pfedes.engine.loop import run_experiment
from fedjax_pfedes.engine.validate import validate_config
from fedjax_pfedes.errors import ConfigError
from fedjax_pfedes.upload import privacy

REPLACE_ONE = dp_accounting.NeighboringRelation.REPLACE_ONE


def _dp_config(rounds: int, num_clients: int, fraction: float, sampling: str = "uniform"):
    config = tiny_config(rounds=rounds, num_clients=num_clients)
    config.train.sampling = sampling
    config.train.client_fraction = fraction
    config.upload.weighting = "uniform"
    config.dp.enabled = True
    config.dp.noise_multiplier = 1.3
    config.eval.every = rounds
    return config


@pytest.mark.slow
def test_P11_poisson_epsilon_is_accounted_at_the_rate_the_sampler_draws_at(tmp_path):
    """8 clients at C = 0.3: the sampler includes each with probability 0.3, although
    round(0.3 x 8) / 8 = 0.25 is what a fixed-size round would hold."""
    config = _dp_config(5, 8, 0.3, "poisson")
    summary = run_experiment(config, str(tmp_path), show_progress=False)
    accountant = rdp.RdpAccountant()  # add-or-remove-one: the sum moves by <= C
    accountant.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.3, dp_accounting.GaussianDpEvent(1.3)), 5))
    expected = accountant.get_epsilon(1e-5)
    assert summary["final"]["dp_epsilon"] == pytest.approx(expected, rel=1e-9)
    assert summary["dp_neighbouring_relation"] == "add_or_remove_one"
    assert summary["dp_sampling_rate"] == 0.3
    assert summary["dp_l2_sensitivity"] == pytest.approx(config.dp.clip_norm)
    at_quarter = rdp.RdpAccountant()
    at_quarter.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.25, dp_accounting.GaussianDpEvent(1.3)), 5))
    assert summary["final"]["dp_epsilon"] > at_quarter.get_epsilon(1e-5)


@pytest.mark.slow
def test_P12_fixed_size_epsilon_uses_the_replace_one_sensitivity_every_round(tmp_path):
    """Every round's metrics.jsonl epsilon: m of N without replacement, replace-one, noise std
    sigma C over sensitivity 2C."""
    config = _dp_config(3, 8, 0.5)
    config.eval.every = 1
    run_experiment(config, str(tmp_path), show_progress=False)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["round"] for r in rows] == [1, 2, 3]
    for r in rows:
        accountant = rdp.RdpAccountant(neighboring_relation=REPLACE_ONE)
        accountant.compose(dp_accounting.SelfComposedDpEvent(
            dp_accounting.SampledWithoutReplacementDpEvent(
                8, 4, dp_accounting.GaussianDpEvent(1.3 / 2)), r["round"]))
        assert r["dp_epsilon"] == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-9)


def test_P13_calibrated_sigma_spends_the_target_under_the_stated_relation():
    """The private quick start's calibration (20 rounds of 10 of 20 clients, target 8): an
    independent replace-one accountant gives <= 8 (to the search tolerance) at the calibrated
    sigma, and more than 8 just below it."""
    config = private_quickstart.get_config()
    cfg = sections.pipeline_config(config).dp
    sigma = privacy.resolve_noise_multiplier(cfg, 20, 10, 20)

    def independent(s):
        accountant = rdp.RdpAccountant(neighboring_relation=REPLACE_ONE)
        accountant.compose(dp_accounting.SelfComposedDpEvent(
            dp_accounting.SampledWithoutReplacementDpEvent(
                20, 10, dp_accounting.GaussianDpEvent(s / 2)), 20))
        return accountant.get_epsilon(1e-5)

    assert independent(sigma) == pytest.approx(8.0, rel=1e-4)
    assert independent(sigma) <= 8.0 * (1 + 1e-4)
    assert independent(0.98 * sigma) > 8.0
    # what the old accounting (sigma as the replace-one multiplier) would have claimed
    assert independent(2 * sigma) < 4.0


@pytest.mark.parametrize("target, words", [(1e9, "protects nothing"),
                                           (1e-9, "would drown every update")])
def test_P14_an_absurd_target_epsilon_is_refused_in_one_line(target, words):
    config = private_quickstart.get_config()
    config.dp.target_epsilon = target
    cfg = sections.pipeline_config(config).dp
    with pytest.raises(ValueError, match=words) as e:
        privacy.resolve_noise_multiplier(cfg, 20, 10, 20)
    assert "config.dp.target_epsilon" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("change, field", [
    ({"train.sampling": "stratified", "train.strata": 3}, "config.train.strata"),
    ({"train.min_samples": 20, "train.below_min": "skip"}, "config.train.min_samples"),
    ({"system.deadline_s": 1.0, "system.failure_decay": 0.5}, "config.system.deadline_s"),
])
def test_P15_selection_that_reads_private_data_is_refused_under_client_dp(change, field):
    """One client's sample count would change who else takes part: no sensitivity bound holds."""
    config = _dp_config(2, 8, 0.5)
    for dotted, value in change.items():
        section, name = dotted.split(".")
        config[section][name] = value
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        validate_config(config)
    config.dp.enabled = False
    validate_config(config)  # fine without DP


@pytest.mark.slow
def test_P16_deadline_without_failure_decay_is_accounted_without_amplification(tmp_path):
    """A deadline with failure_decay = 1 changes only whether a client itself delivers: no
    amplification is claimed, and the plain Gaussian at sensitivity 2C is what is reported."""
    config = _dp_config(3, 8, 0.5)
    config.system.deadline_s = 5.0
    config.system.failure_decay = 1.0
    summary = run_experiment(config, str(tmp_path), show_progress=False)
    assert summary["dp_accounting_sampling"] == "none"
    assert summary["dp_neighbouring_relation"] == "replace_one"
    accountant = rdp.RdpAccountant()
    accountant.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.GaussianDpEvent(1.3 / 2), 3))
    assert summary["final"]["dp_epsilon"] == pytest.approx(accountant.get_epsilon(1e-5),
                                                           rel=1e-9)


@pytest.mark.slow
def test_P17_secure_aggregation_with_drop_outs_composes_the_noise_of_the_honest_senders(
        tmp_path):
    """Fixed-size selection with drop-outs before upload (no amplification) and senders lost
    after uploading: each round's noise is what its senders added, sigma sqrt(senders / 4);
    epsilon is the plain Gaussian at sensitivity 2C composed over exactly those rounds, with
    the senders read from metrics.jsonl."""
    config = _dp_config(4, 8, 0.5)
    config.eval.every = 4
    config.system.dropout = 0.3
    config.secagg.enabled = True
    config.secagg.dropout_after_upload = 0.3
    config.secagg.min_senders = 2
    summary = run_experiment(config, str(tmp_path), show_progress=False)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    accountant = rdp.RdpAccountant()
    released = []
    for r in rows:
        senders = r.get("secagg_senders", 0)
        if senders >= 2:
            sigma = 1.3 * (senders / 4) ** 0.5
            released.append(sigma)
            accountant.compose(dp_accounting.GaussianDpEvent(sigma / 2))
    assert len(set(released)) > 1 or any(r.get("secagg_senders", 0) < 4 for r in rows), rows
    assert summary["dp_accounting_sampling"] == "none"
    assert summary["final"]["dp_epsilon"] == pytest.approx(accountant.get_epsilon(1e-5),
                                                           rel=1e-9)
