"""The catalogue of docs/threat_model.md: every bad input and every attack there gets a test.

Case ids (C.., L.., D.., U.., P.., R..) are the catalogue's row ids. Rows whose behaviour is
tested elsewhere name that test; `test_every_catalogue_row_names_an_existing_test` keeps the
document and the tests in step.
"""

import json
import math
import os
import re
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fl_helpers import launch_error_line, tiny_config

from configs import quickstart
from fedjax_pfedes.data import partitions
from fedjax_pfedes.data.arrays import load_npz
from fedjax_pfedes.data.federated import partition_dataset
from fedjax_pfedes.data.sources import LoadOptions, make_dataset
from fedjax_pfedes.engine import attacks
from fedjax_pfedes.engine.loop import run_experiment
from fedjax_pfedes.engine.validate import validate_config
from fedjax_pfedes.errors import ConfigError, DataError, DatasetUnavailableError, DivergedError
from fedjax_pfedes.io.workdir import RunLockedError
from fedjax_pfedes.upload import privacy
from fedjax_pfedes.upload.pipeline import CohortUploads, UploadPipeline
from fedjax_pfedes.upload.settings import PipelineConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "threat_model.md")


# --- C: configuration errors (ConfigError naming the field; exit 2 from the CLI) ----------------

CONFIG_CASES = {
    "C01": ({"algorithm": "fedxyz"}, "config.algorithm: unknown algorithm 'fedxyz'"),
    "C02": ({"lam": -1.0}, r"config.lam must be >= 0, got -1.0"),
    "C03": ({"lam": math.inf}, r"config.lam must be finite, got inf"),
    "C04": ({"train.lr_local": math.nan}, r"config.train.lr_local must be finite, got nan"),
    "C05": ({"train.lr_local": 0.0}, r"config.train.lr_local must be > 0"),
    "C06": ({"train.client_fraction": 1.5}, r"config.train.client_fraction must be in \(0, 1\]"),
    "C07": ({"data.num_clients": 0}, r"config.data.num_clients must be >= 1|num_clients"),
    "C08": ({"data.partition": "weird"}, r"config.data.partition: unknown partition 'weird'"),
    "C09": ({"clients.architectures": "resnet9000"}, r"resnet9000"),
    "C10": ({"upload.aggregator": "krum"}, r"config.upload.aggregator must be one of"),
    "C11": ({"upload.trim_fraction": 0.5}, r"config.upload.trim_fraction must be in \[0, 0.5\)"),
    "C12": ({"upload.norm_outlier_factor": -1.0}, r"config.upload.norm_outlier_factor must be "
                                                  r">= 0"),
    "C13": ({"secagg.enabled": True, "upload.aggregator": "median"},
            r"config.upload.aggregator must be 'mean'"),
    "C14": ({"secagg.enabled": True, "secagg.min_senders": 1},
            r"config.secagg.min_senders must be >= 2"),
    "C15": ({"secagg.threshold_fraction": 0.0}, r"config.secagg.threshold_fraction must be in"),
    "C16": ({"secagg.ring_bits": 16}, r"config.secagg.ring_bits must be one of \[32, 64\]"),
    "C17": ({"dp.enabled": True}, r"config.dp.enabled needs config.upload.weighting='uniform'"),
    "C18": ({"dp.enabled": True, "upload.weighting": "uniform", "dp.delta": 1.0},
            r"config.dp.delta must be in \(0, 1\)"),
    "C19": ({"dp.enabled": True, "upload.weighting": "uniform", "dp.accountant": "pld"},
            r"config.dp.accountant='pld' needs"),
    "C20": ({"dp_sgd.enabled": True, "algorithm": "fedproto"}, r"DP-SGD is built into"),
    "C21": ({"attack.kind": "backdoor", "attack.clients": "0"},
            r"config.attack.kind must be one of"),
    "C22": ({"attack.kind": "constant", "attack.clients": "99"},
            r"config.attack.clients: ids \[99\] are not in \[0, 20\)"),
    "C23": ({"execution.strategy": "gpu"}, r"config.execution.strategy: unknown strategy 'gpu'"),
    "C24": ({"train.rounds": 0}, r"config.train.rounds must be >= 1"),
    "C25": ({"clients.architectures": "convnet3_bn"}, r"BatchNorm"),
    "C26": ({"data.name": "imagenet"}, r"config.data.name: unknown dataset 'imagenet'"),
    "C27": ({"upload.weighting": "by_norm"}, r"config.upload.weighting must be one of"),
    "C28": ({"dp.enabled": True, "upload.weighting": "uniform", "dp.clip_norm": 0.0},
            r"config.dp.clip_norm must be > 0"),
    "C29": ({"algorithm": "fml", "fml.alpha": 2.0}, r"config.fml.alpha must be in \[0, 1\]"),
    "C30": ({"algorithm": "fedprox", "fedprox.mu": -0.1}, r"config.fedprox.mu must be >= 0"),
    "C31": ({"algorithm": "fedkd", "fedkd.energy_start": 0.0},
            r"config.fedkd.energy_start must be in \(0, 1\]"),
    "C32": ({"algorithm": "pfedes_paper", "pfedes_paper.mu": 1.5},
            r"config.pfedes_paper.mu must be in \[0, 1\]"),
}


def _set(config, dotted: str, value) -> None:
    *path, leaf = dotted.split(".")
    node = config
    for p in path:
        node = node[p]
    node[leaf] = value


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_bad_config_is_refused_naming_the_field(case):
    overrides, message = CONFIG_CASES[case]
    config = quickstart.get_config()
    for k, v in overrides.items():
        _set(config, k, v)
    with pytest.raises(ConfigError, match=message):
        validate_config(config)


# --- L: the command line (one line on stderr, exit status 2) ------------------------------------

CLI_CASES = {
    "L01": (["--config=/nonexistent/cfg.py"], r"--config=/nonexistent/cfg.py: no such file"),
    "L02": (["--config={broken}"], r"syntax error on line 1"),
    "L03": (["--config=configs/quickstart.py", "--config.trian.rounds=3"],
            r"unknown config field: 'trian'.*Did you mean \"train\""),
    "L04": (["--config=configs/quickstart.py", "--config.train.rounds=abc"],
            r"invalid literal for int\(\)"),
    "L05": (["--config=configs/quickstart.py", "--workdir={file}"], r"is a file, not a directory"),
    "L06": (["--config=configs/quickstart.py", "stray"], r"unexpected arguments \['stray'\]"),
    "L07": (["--config=configs/quickstart.py", "--config.data.name=npz",
             "--config.data.path={nan_npz}"], r"x_train\[3\] holds a non-finite value"),
    "L08": (["--config=configs/quickstart.py", "--config.lam=inf"],
            r"config.lam must be finite, got inf"),
    "L09": (["--config=configs/quickstart.py", "--config.baseline.fml_alpha=0.3"],
            r"--config.baseline.fml_alpha is now --config.fml.alpha"),
    "L17": (["--config=configs/quickstart.py", "--config.clients.num_clients=6"],
            r"unknown config field: --config.clients.num_clients \(config.clients has no field "
            r"'num_clients'"),
    "L23": (["--config=configs/quickstart.py", "--config.train.roundz=3"],
            r"unknown config field: --config.train.roundz \(config.train has no field "
            r"'roundz'"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_command_line_errors_are_one_line_with_exit_status_2(case, tmp_path):
    args, message = CLI_CASES[case]
    broken = tmp_path / "broken.py"
    broken.write_text("def get_config(:\n")
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    nan_npz = tmp_path / "nan.npz"
    x = np.ones((40, 8, 8, 1), np.float32)
    x[3, 0, 0, 0] = np.nan
    np.savez(nan_npz, x_train=x, y_train=np.arange(40) % 4, x_test=x[:8],
             y_test=np.arange(8) % 4)
    args = [a.format(broken=broken, file=a_file, nan_npz=nan_npz) for a in args]
    if not any(a.startswith("--workdir") for a in args):
        args.append(f"--workdir={tmp_path / 'run'}")
    error = launch_error_line("main", [*args, "--progress=false"])
    assert re.search(message, error), error


# --- D: data (DataError naming the file, the array and the first offending index) ---------------

def _arrays(n=60, k=4, seed=0):
    rng = np.random.default_rng(seed)
    return dict(x_train=rng.random((n, 8, 8, 1)).astype(np.float32),
                y_train=np.arange(n) % k,
                x_test=rng.random((20, 8, 8, 1)).astype(np.float32),
                y_test=np.arange(20) % k)


def _with(**changes):
    a = _arrays()
    a.update(changes)
    return {k: v for k, v in a.items() if v is not None}


def _nan_at(x, i, value=np.nan):
    x = x.copy()
    x[i].flat[5] = value
    return x


A = _arrays()
DATA_CASES = {
    "D01": (_with(x_train=_nan_at(A["x_train"], 17)), r"x_train\[17\] holds a non-finite"),
    "D02": (_with(x_test=_nan_at(A["x_test"], 3, np.inf)), r"x_test\[3\] holds a non-finite"),
    "D03": (_with(y_train=A["y_train"] + 0.5), r"y_train\[0\] = 0.5 is not an integer label"),
    "D04": (_with(y_train=np.where(np.arange(60) == 7, 57, A["y_train"])),
            r"labels leave classes 4-56 empty \(largest label 57 at y_train\[7\]\)"),
    "D05": (_with(y_train=np.zeros(60, int), y_test=np.zeros(20, int)),
            r"every label is 0; classification needs at least 2 classes"),
    "D06": (_with(y_train=np.zeros(60, int), num_classes=np.array(4)),
            r"y_train holds 1 distinct class"),
    "D07": (_with(y_train=np.eye(4)[A["y_train"]]), r"y_train must be a vector .*one-hot"),
    "D08": (_with(x_train=A["x_train"][:50]), r"x_train has 50 rows but y_train has 60"),
    "D09": (_with(x_test=np.zeros((20, 9, 9, 1), np.float32)),
            r"x_train examples have shape \(8, 8, 1\) but x_test examples \(9, 9, 1\)"),
    "D10": (_with(x_test=None, y_test=None), r"lacks the arrays \['x_test', 'y_test'\]"),
    "D11": ("garbage", r"is not a readable .npz file"),
    "D12": (_with(y_train=np.array([{"a": 1}] * 60, dtype=object)), r"not a readable .npz"),
    "D13": (_with(y_test=np.where(np.arange(20) == 2, -1, A["y_test"])),
            r"y_test\[2\] = -1 is a negative label"),
    "D14": (_with(y_test=np.where(np.arange(20) == 5, 9, A["y_test"]), num_classes=np.array(4)),
            r"y_test\[5\] = 9 is outside \[0, 4\)"),
    "D15": (dict(x_train=np.full((60, 5), 50), y_train=np.arange(60) % 4,
                 x_test=np.zeros((20, 5), int), y_test=np.arange(20) % 4,
                 modality=np.array("text"), vocab_size=np.array(10)),
            r"text x_train must hold integer token ids in \[0, vocab_size=10\)"),
    "D16": (_with(groups_train=np.zeros(59, int)), r"groups_train has 59 entries for 60"),
    "D17": (_with(y_train=A["y_train"] > 1), r"y_train must hold integer labels, got dtype bool"),
    "D18": (_with(x_train=np.zeros(60, np.float32)), r"x_train must hold one example per row"),
    "D19": (_with(modality=np.array("audio")), r"modality must be one of"),
}


@pytest.mark.parametrize("case", sorted(DATA_CASES))
def test_bad_data_files_are_refused_naming_file_array_and_index(case, tmp_path):
    arrays, message = DATA_CASES[case]
    path = tmp_path / f"{case}.npz"
    if isinstance(arrays, str):
        path.write_bytes(b"this is not a zip archive")
    else:
        np.savez(path, **arrays)
    with pytest.raises(DataError, match=message) as e:
        load_npz(LoadOptions(path=str(path)))
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_D20_missing_or_empty_data_path_is_unavailable_not_a_crash(tmp_path):
    with pytest.raises(DatasetUnavailableError, match="which is empty"):
        load_npz(LoadOptions(path=""))
    with pytest.raises(DatasetUnavailableError, match="does not exist"):
        load_npz(LoadOptions(path=str(tmp_path / "none.npz")))


def test_D21_clients_without_a_local_test_sample_are_refused():
    # 20 samples of 10 classes over 10 clients: singleton classes stay in train, so some
    # clients get no local test sample and would count as accuracy 0 in the headline mean.
    x = np.random.default_rng(0).random((20, 4)).astype(np.float32)
    central = make_dataset("t", "tabular", x, np.arange(20) % 10, x[:10], np.arange(10), 10)
    with pytest.raises(ValueError, match=r"clients \[.*\] have no local test sample"):
        partition_dataset(central, 10, "iid", seed=0)


def test_D22_more_clients_than_samples_is_refused():
    x = np.zeros((6, 4), np.float32)
    central = make_dataset("t", "tabular", x, np.arange(6) % 2, x, np.arange(6) % 2, 2)
    with pytest.raises(ValueError, match="client"):
        partition_dataset(central, 10, "iid", seed=0)
    assert partitions  # the partitioners raise; partition_dataset forwards their message


# --- U: malicious and crashing clients against the default upload pipeline ---------------------

def _cohort(uploads, template, ids):
    n = len(ids)
    return CohortUploads(uploads, template, jnp.full(n, 10.0), np.ones(n, bool),
                         np.asarray(ids), np.arange(n, dtype=np.int32))


ATTACK_CASES = {  # kind, value -> the attacker (client 13) is rejected for this reason
    "U01": ("constant", 1e4, "update norm"),
    "U02": ("constant", 3e38, "update norm"),
    "U03": ("scale", 100.0, "update norm"),
    "U04": ("sign_flip", 100.0, "update norm"),
    "U05": ("gaussian", 10.0, "update norm"),
    "U06": ("nan", 0.0, "non-finite values"),
}


@pytest.mark.parametrize("case", sorted(ATTACK_CASES))
def test_default_pipeline_rejects_the_attacker_and_only_the_attacker(case):
    kind, value, reason = ATTACK_CASES[case]
    rng = np.random.default_rng(0)
    template = {"w": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32),
                "b": jnp.zeros(4, jnp.float32)}
    honest = jax.tree.map(lambda t: t[None] + 0.05 * jnp.asarray(
        rng.normal(size=(6, *t.shape)), jnp.float32), template)
    cfg = attacks.AttackConfig((13,), kind, value)
    bad = attacks.malicious_upload(jax.tree.map(lambda a: a[3], honest), template,
                                   jax.random.key(0), cfg)
    uploads = jax.tree.map(lambda a, b: a.at[3].set(b), honest, bad)
    pipe = UploadPipeline(PipelineConfig(), "shared", "test", 20, 6, 6, 5)
    groups, _, report = pipe.process(0, {"a": _cohort(uploads, template, range(10, 16))},
                                     {"a": {}}, {"a": 6}, jax.random.key(0))
    assert [(r["client"], r["reason"].startswith(reason)) for r in report.rejections] == [
        (13, True)]
    from fedjax_pfedes.aggregation import weighted_mean
    mean, _ = weighted_mean([groups["a"]])
    expected = jax.tree.map(lambda a: np.delete(np.asarray(a), 3, 0).mean(0), honest)
    jax.tree.map(lambda m, e: np.testing.assert_allclose(m, e, rtol=1e-5, atol=1e-6), mean,
                 expected)


MISMATCH_CASES = {
    "U07": (lambda t: {"w": jnp.zeros((6, 8, 5)), "b": t["b"]}, "has shape (6, 8, 5)"),
    "U08": (lambda t: {"w": t["w"].astype(jnp.bfloat16), "b": t["b"]}, "has dtype bfloat16"),
    "U09": (lambda t: {"w": t["w"]}, "missing leaves ['b']"),
}


@pytest.mark.parametrize("case", sorted(MISMATCH_CASES))
def test_uploads_for_another_model_are_rejected_naming_the_leaf(case):
    make, detail = MISMATCH_CASES[case]
    template = {"w": jnp.zeros((8, 4)), "b": jnp.zeros(4)}
    stacked = {"w": jnp.zeros((6, 8, 4)), "b": jnp.zeros((6, 4))}
    pipe = UploadPipeline(PipelineConfig(), "shared", "test", 20, 6, 6, 5)
    groups, _, report = pipe.process(0, {"a": _cohort(make(stacked), template, range(6))},
                                     {"a": {}}, {"a": 6}, jax.random.key(0))
    assert report.rejected == 6
    assert all("model fingerprint mismatch" in r["reason"] and detail in r["reason"]
               for r in report.rejections)
    assert float(groups["a"][1].sum()) == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("defended", [True, False])
def test_U10_a_wild_client_in_a_real_run_is_contained_by_default(tmp_path, defended):
    config = tiny_config(rounds=3, num_clients=6)
    config.algorithm = "fedavg"
    config.train.client_fraction = 1.0
    config.attack.kind, config.attack.clients = "constant", "0"
    if not defended:
        config.upload.norm_outlier_factor = 0.0
    summary = run_experiment(config, str(tmp_path), show_progress=False)
    rejected = [json.loads(line) for line in open(tmp_path / "rejections.jsonl")]
    accuracy = summary["final"]["personalized_accuracy_mean"]
    if defended:  # the attacker is named every round and nobody else
        assert {r["client"] for r in rejected} == {0} and len(rejected) == 3
        assert accuracy > 0.9
    else:  # the same attack without the default defence: the model is destroyed
        assert rejected == [] and accuracy < 0.3


# --- P: privacy accounting ----------------------------------------------------------------------

def test_P05_zero_noise_reports_infinite_epsilon_and_silent_rounds_cost_nothing():
    dp = privacy.ClientDPConfig(clip_norm=1.0, noise_multiplier=1.0)
    assert privacy.epsilon_of_rounds(dp, [1.0, 0.0], 100, 10) == math.inf
    assert privacy.epsilon_of_rounds(dp, [None, None], 100, 10) == 0.0
    assert privacy.epsilon_of_rounds(dp, [1.0, None, 1.0], 100, 10) == pytest.approx(
        privacy.epsilon(dp, 1.0, 100, 10, 2), rel=1e-12)


# --- R: runs and checkpoints --------------------------------------------------------------------

@pytest.mark.slow
def test_R01_R02_a_diverging_run_stops_and_says_so(tmp_path):
    config = tiny_config(rounds=4, num_clients=6)
    config.train.lr_local = 1e4
    with pytest.raises(DivergedError, match="training diverged in round 1"):
        run_experiment(config, str(tmp_path / "a"), show_progress=False)
    summary = json.load(open(tmp_path / "a" / "summary.json"))
    assert summary["diverged"] is True and summary["diverged_at"]["round"] == 1
    assert "train_ce_loss_mean" in summary["diverged_at"]["metrics"]
    config.train.allow_divergence = True
    summary = run_experiment(config, str(tmp_path / "b"), show_progress=False)
    assert summary["diverged"] is True and summary["final"]["round"] == 1


@pytest.mark.slow
def test_R03_R04_a_workdir_written_by_a_live_process_is_locked(tmp_path):
    config = tiny_config(rounds=1, num_clients=6)
    lock = tmp_path / ".lock"
    lock.write_text(f"{socket.gethostname()} {os.getppid()}")  # alive: pytest's parent
    with pytest.raises(RunLockedError, match=f"in use by pid {os.getppid()}"):
        run_experiment(config, str(tmp_path), show_progress=False)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock.write_text(f"{socket.gethostname()} {dead.pid}")  # a crashed run's stale lock
    run_experiment(config, str(tmp_path), show_progress=False)
    assert not lock.exists()  # released at the end


def _checkpointed_run(workdir, rounds, **data):
    config = tiny_config(rounds=rounds, num_clients=6)
    config.checkpoint.every = 1
    config.checkpoint.max_to_keep = 3
    for k, v in data.items():
        config.data[k] = v
    return run_experiment(config, str(workdir), show_progress=False)


def _largest_file(directory):
    files = [os.path.join(r, f) for r, _, fs in os.walk(directory) for f in fs]
    return max(files, key=os.path.getsize)


@pytest.mark.slow
def test_R05_R06_R07_corrupt_checkpoints_fall_back_and_rounds_cannot_shrink(tmp_path, caplog):
    _checkpointed_run(tmp_path, 3)
    victim = _largest_file(tmp_path / "checkpoints" / "3")
    with open(victim, "r+b") as f:  # truncated, as by a full disk or an interrupted copy
        f.truncate(os.path.getsize(victim) // 2)
    meta = next(os.path.join(r, f) for r, _, fs in os.walk(tmp_path / "checkpoints" / "2")
                for f in fs if "meta" in r)
    with open(meta, "w") as f:  # an edited / garbled meta file
        f.write("{not json")
    summary = _checkpointed_run(tmp_path, 4)
    assert summary["resumed_from_round"] == 1 and summary["final"]["round"] == 4
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "checkpoint of round 3" in warned and "truncated" in warned
    assert "checkpoint of round 2" in warned and "corrupt" in warned
    assert sorted(os.listdir(tmp_path / "corrupt_checkpoints")) == ["2", "3"]
    with pytest.raises(ConfigError, match=r"config.train.rounds=2 is below the round of the "
                                          r"checkpoint .* \(4\)"):
        _checkpointed_run(tmp_path, 2)


@pytest.mark.slow
def test_R08_resume_with_changed_data_contents_is_refused(tmp_path):
    path = tmp_path / "data.npz"
    np.savez(path, **_arrays(n=240))
    _checkpointed_run(tmp_path / "run", 1, name="npz", path=str(path))
    changed = _arrays(n=240)
    changed["x_train"][0] += 0.5  # same shapes and config, other contents
    np.savez(path, **changed)
    with pytest.raises(ConfigError, match="the data contents changed since it was written"):
        _checkpointed_run(tmp_path / "run", 2, name="npz", path=str(path))


# --- the catalogue and the tests stay in step ---------------------------------------------------

def _catalogue_rows():
    rows = []
    for line in open(DOC, encoding="utf-8"):
        m = re.match(r"\|\s*([CLDUPRBH]\d\d)\s*\|.*\|\s*`([^`]+)`\s*\|\s*$", line)
        if m:
            rows.append(m.groups())
    return rows


def test_every_catalogue_row_names_an_existing_test():
    rows = _catalogue_rows()
    assert len(rows) >= 60 and len({r[0] for r in rows}) == len(rows)
    for case, ref in rows:
        file, _, name = ref.partition("::")
        source = open(os.path.join(ROOT, file), encoding="utf-8").read()
        func = name.split("[")[0]
        assert re.search(rf"^def {re.escape(func)}\(", source, re.M), (case, ref)
        if "[" in name:  # a parametrized case: its id is a key of the case table
            assert f'"{name.split("[")[1].rstrip("]")}"' in source, (case, ref)
