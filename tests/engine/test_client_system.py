"""Unreliable clients (`engine/client_system.py`) against hand-computed numbers: the deadline,
partial work, drop-outs, availability windows, and the runtime fields' checks.
"""


import json

import fl_helpers
import numpy as np
import pytest

from fedjax_pfedes.engine import client_system
from fedjax_pfedes.engine.loop import run_experiment
from fedjax_pfedes.engine.validate import validate_config
from fedjax_pfedes.errors import ConfigError


def _system(**kw) -> client_system.SystemConfig:
    base = dict(speed_classes=(1.0, 2.0, 4.0), step_time_s=0.1, upload_mbps=(8.0,),
                download_mbps=(16.0,))
    return client_system.SystemConfig(**{**base, **kw})


def test_deadline_drops_exactly_the_clients_past_it():
    cfg = _system(deadline_s=3.0)
    profiles = client_system.client_profiles(cfg, 12, seed=3)
    clients = np.arange(12)
    steps = np.array([3, 5, 8, 10, 12, 4, 6, 9, 2, 7, 11, 1])
    up, down = np.full(12, 1e6), np.full(12, 2e6)  # 1 s up at 8 Mbit/s, 1 s down at 16 Mbit/s
    timing = client_system.simulate_round(cfg, profiles, 3, 0, clients, steps, up, down)
    step_s = 0.1 * np.array([1.0, 2.0, 4.0])[profiles.speed_class]
    total = 1.0 + 1.0 + steps * step_s  # by hand
    late = total > 3.0
    assert late.any() and (~late).any()
    np.testing.assert_array_equal(timing.status == client_system.PAST_DEADLINE, late)
    np.testing.assert_array_equal(timing.trains, ~late)
    np.testing.assert_allclose(timing.total_s[~late], total[~late])
    np.testing.assert_array_equal(timing.step_limit, np.where(late, 0, steps))
    assert timing.round_s == 3.0  # the server waited until the deadline


def test_partial_work_runs_the_steps_that_fit_before_the_deadline():
    cfg = _system(deadline_s=2.6, deadline_policy="partial")
    profiles = client_system.client_profiles(cfg, 9, seed=1)
    steps = np.full(9, 10)
    timing = client_system.simulate_round(cfg, profiles, 1, 0, np.arange(9), steps, np.full(9, 1e6),
                                   np.full(9, 2e6))
    step_s = 0.1 * np.array([1.0, 2.0, 4.0])[profiles.speed_class]
    fits = np.floor((2.6 - 2.0) / step_s).astype(int)  # 6, 3, 1 steps
    expected = np.where(2.0 + 10 * step_s > 2.6, np.minimum(fits, 10), 10)
    np.testing.assert_array_equal(timing.step_limit, expected)
    assert set(timing.status) == {client_system.PARTIAL}
    assert np.all(timing.total_s <= 2.6 + 1e-9)


def test_dropout_rate_and_availability_window():
    cfg = _system(dropout=0.3)
    profiles = client_system.client_profiles(cfg, 200, seed=0)
    dropped = [np.mean(client_system.simulate_round(cfg, profiles, 0, r, np.arange(200),
                                             np.ones(200), np.zeros(200), np.zeros(200)).status
                       == client_system.DROPPED_OUT) for r in range(50)]
    assert abs(np.mean(dropped) - 0.3) < 0.02  # 10,000 draws: 4.5 standard errors
    periodic = _system(availability=(1.0,), availability_period=4, availability_duty=0.5)
    prof = client_system.client_profiles(periodic, 30, seed=0)
    online = np.array([client_system.online_mask(periodic, prof, 0, r) for r in range(8)])
    for i in range(30):  # online exactly in rounds r with (r + phase) mod 4 < 2
        np.testing.assert_array_equal(online[:, i], (np.arange(8) + prof.phase[i]) % 4 < 2)


@pytest.mark.slow
@pytest.mark.parametrize("dropout", [0.3, 0.6])
def test_dropouts_never_crash_and_are_counted(tmp_path, dropout):
    config = fl_helpers.tiny_config(rounds=6)
    config.system.dropout = dropout
    config.system.deadline_s = 0.9
    config.system.speed_classes = "1,8"
    summary = run_experiment(config, str(tmp_path), show_progress=False)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    clients = [json.loads(line) for line in open(tmp_path / "clients.jsonl")]
    for r in rows:
        mine = [c for c in clients if c["round"] == r["round"]]
        status = [c["status"] for c in mine]
        assert r["selected"] == len(mine) == r["planned_participants"] == 4
        assert r["dropped_out"] == status.count("dropped_out")
        assert r["past_deadline"] == status.count("deadline")
        assert r["participants"] == status.count("delivered") == r["uploads_accepted"]
        assert r["selected"] == r["participants"] + r["dropped_out"] + r["past_deadline"]
        assert r["upload_success_rate"] == r["uploads_accepted"] / r["selected"]
        late = [c for c in mine if c["status"] == "deadline"]
        assert all(c["total_s"] > 0.9 for c in late)
        assert all(c["total_s"] <= 0.9 for c in mine if c["status"] == "delivered")
    lost = sum(r["dropped_out"] for r in rows)
    assert lost > 0 and np.isfinite(summary["final"]["personalized_accuracy_mean"])
    assert sum(summary["participation"]["selected"]) == 24
    assert sum(summary["participation"]["completed"]) == sum(r["participants"] for r in rows)


def test_bad_runtime_fields_are_refused_with_the_field_named():
    from configs import quickstart

    for field, value, message in [
        ("system.dropout", 1.0, "config.system.dropout"),
        ("system.speed_classes", "1,x", "config.system.speed_classes"),
        ("system.upload_mbps", "1,2", "config.system.upload_mbps"),
        ("system.deadline_policy", "wait", "config.system.deadline_policy"),
        ("train.sampling", "roundrobin", "config.train.sampling"),
        ("train.below_min", "drop", "config.train.below_min"),
        ("checkpoint.every", -1, "config.checkpoint.every"),
    ]:
        config = quickstart.get_config()
        section, name = field.split(".")
        config[section][name] = value
        with pytest.raises(ConfigError, match=message):
            validate_config(config)
    config = quickstart.get_config()
    config.asynchronous.enabled = True
    config.algorithm = "scaffold"
    with pytest.raises(ConfigError, match="config.asynchronous.enabled"):
        validate_config(config)
