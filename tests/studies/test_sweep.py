"""Vectorized sweeps: flag parsing, refused fields, and members equal to separate runs."""

import json

import numpy as np
import pytest
from fl_helpers import small_config, tiny_config

from fedjax_pfedes.engine.build import build_federated_data
from fedjax_pfedes.engine.loop import run_experiment
from fedjax_pfedes.errors import ConfigError
from fedjax_pfedes.io.metrics import WALL_CLOCK_FIELDS
from fedjax_pfedes.launch.cli import split_sweep_flags
from fedjax_pfedes.studies import vectorized_sweep
from fedjax_pfedes.studies.experiments import with_overrides


def test_sweep_flags_are_split_from_the_rest():
    rest, swept = split_sweep_flags(["prog", "--config=c.py", "--sweep.lam=0.1,0.5,2",
                                     "--config.lam=1.0"])
    assert rest == ["prog", "--config=c.py", "--config.lam=1.0"]
    assert swept == {"lam": [0.1, 0.5, 2.0]}
    with pytest.raises(SystemExit) as e:
        split_sweep_flags(["prog", "--sweep.lam=a,b"])
    assert e.value.code == 2


@pytest.mark.parametrize("field, message", [
    ("proxy_dim", r"only float fields can be swept .* int 16"),
    ("train.client_fraction", r"members share the data, sampling"),
    ("data.dirichlet_alpha", r"members share the data, sampling"),
    ("fedprox.mu", r"config.algorithm is 'pfedes', which does not read config.fedprox"),
    ("no_such_field", r"config has no field 'no_such_field'"),
])
def test_fields_members_cannot_differ_in_are_refused_naming_them(field, message):
    with pytest.raises(ConfigError, match=rf"--sweep\.{field}: " + message):
        vectorized_sweep.check_float(tiny_config(), field)


def test_auto_execution_settings_mean_loop_and_xla_in_a_sweep():
    """The defaults ('auto') run a sweep: its one batched program goes participant by
    participant ('loop') with XLA's kernels; explicit settings are kept; the caller's config is
    not changed."""
    config = tiny_config()
    config.execution.strategy, config.execution.cpu_kernels = "auto", "auto"
    resolved = vectorized_sweep._resolved_execution(config)
    assert (resolved.execution.strategy, resolved.execution.cpu_kernels) == ("loop", "xla")
    assert config.execution.strategy == "auto"
    config.execution.cpu_kernels = "eigen"
    assert vectorized_sweep._resolved_execution(config).execution.cpu_kernels == "eigen"


def test_traced_fields_pass_the_trace_check_and_a_shape_field_fails_it(monkeypatch):
    import dataclasses

    from fedjax_pfedes.algorithms import registry

    config = tiny_config()
    data = build_federated_data(config)
    for field in ("lam", "train.lr_local", "proxy_lr_ratio"):
        vectorized_sweep.check_field(config, data, field, ["mlp"])  # no error
    # A method that reads proxy_lr_ratio as an array size: tracing it must fail, and the
    # sweep must say so instead of crashing (a stand-in for any shape-setting float).
    entry = registry.get("pfedes")

    def build(inputs):
        algorithm = entry.build(inputs)
        width = inputs.settings.proxy_lr_ratio

        def cohort_program(arch):
            p = algorithm.cohort_program(arch)
            update = lambda b, s, t, k: (*p.client_update(b, s, t, k)[:2],  # noqa: E731
                                         {"w": np.zeros(int(width))})
            return dataclasses.replace(p, client_update=update)
        return dataclasses.replace(algorithm, cohort_program=cohort_program)

    monkeypatch.setitem(registry._ENTRIES, "pfedes",  # noqa: SLF001
                        dataclasses.replace(entry, build=build))
    with pytest.raises(ConfigError, match=r"--sweep\.proxy_lr_ratio: this field decides "
                                          "shapes or control flow"):
        vectorized_sweep.check_field(config, data, "proxy_lr_ratio", ["mlp"])


def _metrics(path):
    return [json.loads(line) for line in open(path / "metrics.jsonl")]


@pytest.mark.slow  # two 3-member sweeps and three separate runs
def test_every_member_equals_a_separate_run_with_its_value(tmp_path):
    config = small_config("loop")
    config.train.rounds, config.checkpoint.every = 3, 0
    values = [0.1, 0.5, 2.0]
    for axis in vectorized_sweep.MEMBER_AXES:
        records = vectorized_sweep.run_sweep(config, "lam", values, str(tmp_path / axis),
                                  show_progress=False, member_axis=axis)
        assert list(records) == ["lam=0.1", "lam=0.5", "lam=2"]
    finals = []
    for v in values:
        member = with_overrides(config, {"lam": v})
        run_experiment(member, str(tmp_path / f"alone{v}"), show_progress=False)
        alone = _metrics(tmp_path / f"alone{v}")
        for axis in vectorized_sweep.MEMBER_AXES:
            swept = _metrics(tmp_path / axis / f"lam={v:g}")
            assert len(swept) == len(alone) == 3
            for a, b in zip(swept, alone, strict=True):
                for key in ("train_ce_loss_mean", "train_align_loss_mean", "test_ce_loss_mean",
                            "personalized_accuracy_mean", "global_accuracy_mean"):
                    if key in b:
                        assert a[key] == pytest.approx(b[key], rel=2e-3, abs=2e-4), (axis, v, key)
                assert a["participants"] == b["participants"]
        finals.append(alone[-1]["train_align_loss_mean"])
    assert len(set(np.round(finals, 4))) == 3  # the members did differ


@pytest.mark.slow  # three 2-member sweeps of 5 rounds
def test_ctrl_c_stops_every_member_after_the_same_round_and_the_sweep_resumes(tmp_path,
                                                                               monkeypatch):
    """Ctrl-C (here pressed from member 0's thread at the end of its round 2) stops every member
    after the same round with a checkpoint of it; the same call resumes them to the numbers of a
    sweep that never stopped."""
    import os
    import signal
    import time

    from fedjax_pfedes import RunInterrupted

    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # xdist ignores it
    try:
        config = small_config("loop")
        config.train.rounds, config.checkpoint.every = 5, 4
        values = [0.1, 2.0]
        reference = vectorized_sweep.run_sweep(config, "lam", values, str(tmp_path / "whole"),
                                               show_progress=False)
        pressed = vectorized_sweep._Route.on_round_end

        def press_at_round_2(self, run, end):
            pressed(self, run, end)
            if self.member == 0 and end.round == 2:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.3)  # the main thread takes the signal
        monkeypatch.setattr(vectorized_sweep._Route, "on_round_end", press_at_round_2)
        stopped = tmp_path / "stopped"
        with pytest.raises(RunInterrupted, match=r"stopped after round 3; each member's "
                                                 r"checkpoint holds that round"):
            vectorized_sweep.run_sweep(config, "lam", values, str(stopped),
                                       show_progress=False)
        monkeypatch.setattr(vectorized_sweep._Route, "on_round_end", pressed)
        for name in reference:
            assert sorted(os.listdir(stopped / name / "checkpoints")) == ["3"]
            assert [r["round"] for r in _metrics(stopped / name)] == [1, 2, 3]
            assert not (stopped / name / "summary.json").exists()
        resumed = vectorized_sweep.run_sweep(config, "lam", values, str(stopped),
                                             show_progress=False)
    finally:
        signal.signal(signal.SIGINT, before)
    for name in reference:
        assert [r["round"] for r in _metrics(stopped / name)] == [1, 2, 3, 4, 5]
        a, b = resumed[name]["final"], reference[name]["final"]
        assert {k: v for k, v in a.items() if k not in WALL_CLOCK_FIELDS} == {
            k: v for k, v in b.items() if k not in WALL_CLOCK_FIELDS}
