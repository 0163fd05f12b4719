"""Faults at the public API: what a user hands `run`, `register_*` and `from_arrays` is checked
where it is handed over (or, for a module, on a probe batch when the run starts), and the error
names the argument, what was expected and what came (docs/threat_model.md, B01-B16)."""

import dataclasses
import json
import math
import re
import subprocess
import sys
from typing import ClassVar

import flax.linen as nn
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from fl_helpers import CHILD_PATH, ROOT, tiny_config

import fedjax_pfedes
from fedjax_pfedes.algorithms import registry
from fedjax_pfedes.config import fields
from fedjax_pfedes.data import catalog
from fedjax_pfedes.data.spec import InputSpec
from fedjax_pfedes.errors import ConfigError, DataError
from fedjax_pfedes.models import backbones
from fedjax_pfedes.models.probe import check_backbone
from fedjax_pfedes.upload import stages

IMAGE = InputSpec("image", (8, 8, 1), "float32", (0.5,), (0.25,))


class Features(nn.Module):
    """A backbone whose output is `shape_of(x)`-shaped: the right [B, F] or a wrong one."""

    kind: str = "ok"

    @nn.compact
    def __call__(self, x):
        z = nn.Dense(6)(x.reshape((x.shape[0], -1)))
        if self.kind == "vector":  # [B]
            return z.sum(-1)
        if self.kind == "image":  # [B, H, W, C]
            return x
        if self.kind == "collapsed":  # [1, F]: the batch axis averaged away
            return z.mean(0, keepdims=True)
        if self.kind == "nan":
            return z * jnp.nan
        if self.kind == "tuple":
            return z, z
        return z


@pytest.fixture
def registered():
    names = []

    def register(name, module, **kw):
        fedjax_pfedes.register_architecture(name, module, **kw)
        names.append(name)

    yield register
    for name in names:
        backbones.BACKBONES.pop(name, None)


PROBE_CASES = {  # B01-B05: a registered module's output, judged on a probe batch of 3
    "B01": (Features("vector"), r"must return features \[B, F\].*returned shape \(3,\)"),
    "B02": (Features("image"), r"returned shape \(3, 8, 8, 1\)"),
    "B03": (Features("collapsed"), r"batch axis intact.*returned shape \(1, 6\)"),
    "B04": (lambda spec: 42, r"must return a flax.linen.Module, returned int"),
    "B05": (Features("nan"), r"non-finite features"),
    "B06": (Features("tuple"), r"\(one array\), returned tuple"),
}


@pytest.mark.parametrize("case", sorted(PROBE_CASES))
def test_a_registered_module_with_the_wrong_output_is_named_before_training(case, registered):
    module, message = PROBE_CASES[case]
    registered("user_net", module)
    with pytest.raises(ValueError, match=r"register_architecture\('user_net'\): .*" + message):
        check_backbone("user_net", IMAGE)


def test_a_registered_module_with_the_right_output_passes_the_probe(registered):
    registered("user_net", Features())
    check_backbone("user_net", IMAGE)
    check_backbone("convnet3", IMAGE)  # built-ins are not probed


@pytest.mark.slow
def test_B03_a_collapsed_batch_axis_stops_the_run_before_training(registered, tmp_path):
    """It used to train (to 0.227) by broadcasting [1, F] against the labels."""
    registered("user_net", Features("collapsed"), modalities=("image", "tabular"))
    config = tiny_config(rounds=1)
    config.clients.architectures = "user_net"
    with pytest.raises(ConfigError, match=r"'user_net'.*returned shape \(1, 6\)"):
        fedjax_pfedes.run(config, str(tmp_path), progress=False)
    assert not (tmp_path / "metrics.jsonl").exists()


def _entry(**kw):
    fedavg = registry.get("fedavg")
    return dataclasses.replace(fedavg, **{"name": "user_method", **kw})


def _section(path: str, default=1):
    """A user's section declaring the one field `path` ('x.y': SECTION 'x'; 'y': top level)."""
    where, _, name = path.rpartition(".")
    return dataclasses.make_dataclass(
        "UserSection", [(name, type(default), fields.param(default, "a user's field"))],
        bases=(fields.Section,), frozen=True, namespace={"SECTION": where})


@dataclasses.dataclass(frozen=True)
class Bare(fields.Section):
    SECTION = "user_method"
    weight: float = 1.0  # not made with fields.param: no help, no range


ENTRY_CASES = {  # B07-B09: AlgorithmEntry fields, checked when it is made
    "B07": (dict(build=None), r"build must be a function of BuildInputs.*got NoneType"),
    "B08": (dict(modalities="image"), r"modalities must be a non-empty tuple"),
    "B09": (dict(section=Bare), r"field 'weight' of Bare is not declared with "
                                  r"config.fields.param"),
    "B09b": (dict(section=dict), r"section must be a dataclass deriving from "
                                 r"config.fields.Section"),
    "B09c": (dict(section=_section("fedprox.mu")), r"its section's SECTION must be "
                                                   r"'user_method'"),
}


@pytest.mark.parametrize("case", sorted(ENTRY_CASES))
def test_a_malformed_algorithm_entry_is_refused_when_made(case):
    changes, message = ENTRY_CASES[case]
    with pytest.raises(ValueError, match=message):
        _entry(**changes)


def test_B10_register_algorithm_takes_only_an_entry():
    with pytest.raises(ConfigError, match=r"expected an AlgorithmEntry, got dict"):
        fedjax_pfedes.register_algorithm({"name": "x", "build": None})


def test_B11_a_build_that_returns_no_algorithm_is_named():
    registry.register(_entry(build=lambda inputs: 42))
    try:
        with pytest.raises(ConfigError, match=r"'user_method'.*must return an Algorithm, "
                                              r"returned int"):
            registry.build("user_method", None, False)
    finally:
        registry._ENTRIES.pop("user_method", None)


@pytest.mark.parametrize("name,path,clash", [("train", "train.rounds", "train.rounds"),
                                             ("user_method", "train", "train"),
                                             ("proxy_dim", "proxy_dim.x", "proxy_dim")])
def test_B12_fields_that_collide_with_the_core_config_are_refused_at_registration(name, path,
                                                                                  clash):
    with pytest.raises(ValueError, match=rf"'config\.{path}' collides with the core "
                                         rf"config's 'config\.{clash}'"):
        registry.register(_entry(name=name, section=_section(path)))
    assert name not in registry.entries() or name == "user_method"
    assert "user_method" not in registry.entries()
    fedjax_pfedes.default_config()  # and the process is not left broken


def test_B12_a_section_named_as_another_methods_field_names_both():
    # method 'lam' keeps its fields in config.lam: pFedES's top-level field config.lam
    with pytest.raises(ValueError, match=r"'config\.lam\.x' collides with the field "
                                         r"'config\.lam' of 'pfedes'"):
        registry.register(_entry(name="lam", section=_section("lam.x")))
    fedjax_pfedes.default_config()


def test_B12_a_field_another_method_declares_differently_names_both():
    with pytest.raises(ValueError, match=r"'config\.lam' is declared by 'pfedes' "
                                         r"too, with default 0\.5 \(here 0\.9\)"):
        registry.register(_entry(section=_section("lam", 0.9)))


def test_B12_a_stage_field_that_collides_is_refused():
    @dataclasses.dataclass(frozen=True)
    class MuSection(fedjax_pfedes.Section):
        SECTION: ClassVar[str] = "fedprox"
        mu: float = fedjax_pfedes.param(0.5, "a second mu")

    class Mine(stages.UploadStage):
        name = "mine"
        section = MuSection

    with pytest.raises(ValueError, match=r"section 'config\.fedprox' is declared by the method "
                                         r"'fedprox'"):
        fedjax_pfedes.register_stage(Mine)

    class Old(stages.UploadStage):  # the former way: refused, naming the new one
        name = "old"
        fields = {"old.x": 0.5}

    with pytest.raises(ValueError, match=r"declares its config fields as a `section`"):
        fedjax_pfedes.register_stage(Old)
    with pytest.raises(ValueError, match=r"expected a subclass of UploadStage"):
        fedjax_pfedes.register_stage(42)
    assert Mine not in stages.STAGES


@pytest.mark.slow
def test_B13_a_built_in_name_is_refused_before_the_built_ins_are_loaded():
    code = ("import dataclasses\n"
            "from fedjax_pfedes.algorithms import registry\n"
            "assert not registry._DISCOVERED\n"
            "def build(inputs): raise AssertionError\n"
            "registry.register(registry.AlgorithmEntry('fedavg', build))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, env={"PYTHONPATH": CHILD_PATH, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 1
    assert "algorithm 'fedavg' is registered twice (a built-in method has that name" in (
        out.stderr)


@pytest.mark.parametrize("config,workdir,callbacks,message", [
    ({"algorithm": "pfedes"}, "w", (), r"config must be an ml_collections.ConfigDict.*got dict"),
    (None, "w", (), r"config must be .*got NoneType"),
    ("cfg", None, (), r"workdir must be a non-empty path, got None"),
    ("cfg", "", (), r"workdir must be a non-empty path"),
    ("cfg", "w", [42], r"callbacks\[0\] must be a fedjax_pfedes.Callback.*got int"),
    ("cfg", "w", 42, r"callbacks must be a list of Callback objects, got int"),
])
@pytest.mark.slow
def test_B14_run_checks_its_arguments(config, workdir, callbacks, message, tmp_path):
    if config == "cfg":
        config = fedjax_pfedes.default_config()
    if workdir == "w":
        workdir = str(tmp_path / "w")
    with pytest.raises(ConfigError, match=message):
        fedjax_pfedes.run(config, workdir, callbacks=callbacks)
    assert not (tmp_path / "w").exists()


def test_B15_a_loader_that_returns_no_dataset_is_named():
    x = np.zeros((20, 4), np.float32)
    y = np.arange(20) % 2
    fedjax_pfedes.register_dataset("user_tuple", lambda options: (x, y, x, y))
    try:
        with pytest.raises(DataError, match=r"config.data.name='user_tuple': its loader must "
                                            r"return a CentralDataset.*returned tuple"):
            catalog.load_dataset("user_tuple")
    finally:
        catalog.LOADERS.pop("user_tuple", None)


@pytest.mark.parametrize("ids,message", [
    (np.where(np.arange(20) == 5, np.nan, np.arange(20) % 3), r"client_ids\[5\] = nan is not"),
    (np.arange(20) % 3 + 0.5, r"client_ids\[0\] = 0.5 is not an integer"),
    (np.zeros((20, 2)), r"one id per training sample \(1-D\)"),
])
def test_B16_client_ids_that_are_not_ids_are_named(ids, message):
    x = np.zeros((20, 4), np.float32)
    y = np.arange(20) % 2
    with pytest.raises(DataError, match=message):
        fedjax_pfedes.from_arrays("mine", x, y, x, y, client_ids=ids)


def _strict(line: str):
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(line, parse_constant=refuse)


class NaNMetric(fedjax_pfedes.Callback):
    def on_round_end(self, run, end):
        end.record["my_metric"] = math.nan if end.round == 1 else 1.0
        end.record["my_inf"] = {"x": math.inf}


@pytest.mark.slow
def test_B17_a_callbacks_nan_is_written_as_null_and_counted(tmp_path):
    config = tiny_config(rounds=2)
    config.monitor.tensorboard = False
    fedjax_pfedes.run(config, str(tmp_path), progress=False, callbacks=[NaNMetric()])
    rows = [_strict(line) for line in open(tmp_path / "metrics.jsonl")]
    assert rows[0]["my_metric"] is None and rows[1]["my_metric"] == 1.0
    assert rows[0]["non_finite_as_null"] == ["my_metric", "my_inf.x"]
    assert rows[1]["non_finite_as_null"] == ["my_inf.x"]
    _strict(open(tmp_path / "summary.json").read())


def test_config_dicts_stay_the_public_type():
    assert isinstance(fedjax_pfedes.default_config(), ml_collections.ConfigDict)


CLI_CASES = {  # L19-L22: config files and reports on the command line, one line and exit 2
    "L19": ("def get_config():\n    return {'algorithm': 'pfedes'}\n",
            r"get_config\(\) must return an ml_collections.ConfigDict .*returned dict"),
    "L20": ("raise SystemExit(0)\n", r"the file exited \(SystemExit\(0\)\) instead of "
                                     r"returning a config"),
    "L21": ("import sys\ndef get_config():\n    sys.exit()\n",
            r"the file exited \(SystemExit\(None\)\)"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_config_files_that_return_no_config_are_one_line(case, tmp_path):
    text, message = CLI_CASES[case]
    (tmp_path / "cfg.py").write_text(text)
    out = subprocess.run([sys.executable, "-m", "launch.main", f"--config={tmp_path}/cfg.py",
                          f"--workdir={tmp_path}/w"], cwd=ROOT, capture_output=True,
                         text=True, env={"PYTHONPATH": CHILD_PATH, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    assert re.search(message, lines[0]), lines[0]


@pytest.mark.slow
def test_L22_a_report_on_a_truncated_summary_is_one_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"round": 1, "train_ce_loss_mean": 1.0}\n')
    (tmp_path / "summary.json").write_text('{"final": {"rou')
    out = subprocess.run([sys.executable, "-m", "launch.report", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True,
                         env={"PYTHONPATH": CHILD_PATH, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"error: {tmp_path}/summary.json is not complete JSON (Unterminated string starting "
        "at, line 1 column 12): the file was cut off or edited; rerun the command to rewrite "
        "it"], out.stderr


@pytest.mark.slow
def test_H01_a_divergence_under_a_simulated_attack_names_the_attack_first(tmp_path):
    from fedjax_pfedes.engine.loop import run_experiment
    from fedjax_pfedes.errors import DivergedError

    config = tiny_config(rounds=3)
    config.upload.norm_outlier_factor = 0.0  # no defence: the attack reaches the aggregate
    config.attack.clients = "0,1,2,3,4,5,6,7"
    config.attack.kind = "constant"
    config.attack.value = 1e30
    with pytest.raises(DivergedError, match=r"non-finite\); summary in .*\. The simulated "
                                            r"attack is the likeliest cause: config\.attack\."
                                            r"kind='constant' \(value 1e\+30\)"):
        run_experiment(config, str(tmp_path), show_progress=False)
