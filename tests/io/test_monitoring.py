"""Per-round monitoring: every metric key docs/guide/run_files.md documents appears in
metrics.jsonl, the CSV and TensorBoard files hold the same numbers, the report writes its PNGs,
and the round-time budget's stages match a hand computation."""

import json
import os
import re
import struct

import fl_helpers
import numpy as np
import pytest

from fedjax_pfedes.engine import client_system
from fedjax_pfedes.engine.build import build_context, build_federated_data
from fedjax_pfedes.engine.loop import run_experiment
from fedjax_pfedes.io.run_report import write_report
from fedjax_pfedes.studies import round_budget

GUIDE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                     "docs", "guide", "run_files.md")


def documented_keys() -> dict[str, str]:
    """{key: when} from docs/guide/run_files.md's tables (incl. 'also `k`' keys)."""
    keys = {}
    for line in open(GUIDE).read().splitlines():
        m = re.match(r"\| `([a-z_0-9]+)` \| ([^|]+) \| (.*) \|$", line)
        if not m:
            continue
        key, when, meaning = m.groups()
        keys[key] = when.strip()
        for extra in re.findall(r"also ((?:`[a-z_0-9]+`(?:, | and )?)+)", meaning):
            for k in re.findall(r"`([a-z_0-9]+)`", extra):
                keys[k] = when.strip()
    return keys


@pytest.fixture(scope="module")
def private_run(tmp_path_factory):
    """Sync run with every optional metric on: client-level DP, DP-SGD, secure aggregation,
    drop-outs, a deadline with partial work, stratified sampling."""
    workdir = tmp_path_factory.mktemp("private")
    config = fl_helpers.tiny_config()
    config.upload.weighting = "uniform"
    config.dp.enabled = True
    config.dp.clip_norm = 1.0
    config.dp_sgd.enabled = True
    config.secagg.enabled = True
    config.secagg.dropout_after_upload = 0.2
    config.system.dropout = 0.2
    config.system.speed_classes = "1,6"
    config.system.deadline_s = 0.6
    config.system.deadline_policy = "partial"
    config.system.failure_decay = 1.0  # DP: a deadline miss must not steer who else is drawn
    config.train.sampling = "stratified"
    config.train.strata = 1  # DP: strata from the public availability classes only
    config.eval.after_training = True
    return workdir, run_experiment(config, str(workdir), show_progress=False)


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("async")
    config = fl_helpers.tiny_config()
    config.asynchronous.enabled = True
    config.asynchronous.concurrency = 4
    config.asynchronous.buffer_size = 2
    config.monitor.tensorboard = False
    return workdir, run_experiment(config, str(workdir), show_progress=False)


def _rows(workdir):
    return [json.loads(line) for line in open(workdir / "metrics.jsonl")]


@pytest.mark.slow
def test_every_documented_metric_key_is_written(private_run, async_run):
    keys = documented_keys()
    assert len(keys) > 40 and "loss_before_aggregation" in keys
    sync_rows, async_rows = _rows(private_run[0]), _rows(async_run[0])
    written_sync = set().union(*sync_rows)
    written_async = set().union(*async_rows)
    pfedes_only = {"train_align_loss_mean", "train_proxy_align_loss_mean",
                   "test_align_loss_mean"}
    for key, when in keys.items():
        if when == "async":
            assert key in written_async, key
        else:
            assert key in written_sync, (key, when)
        if when == "every round" and key not in ("participants",):
            for r in sync_rows:
                assert key in r or key in pfedes_only, (key, r["round"])
    # Nothing undocumented: every written key is in docs/guide/run_files.md.
    assert written_sync - set(keys) == set()
    assert written_async - set(keys) == set()


@pytest.mark.slow
def test_round_records_are_consistent(private_run):
    workdir, summary = private_run
    rows = _rows(workdir)
    clients = [json.loads(line) for line in open(workdir / "clients.jsonl")]
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    eps = [r["dp_epsilon"] for r in rows]
    assert eps == sorted(eps) and eps[0] > 0  # spent every round
    for r in rows:
        mine = [c for c in clients if c["round"] == r["round"]]
        delivered = [c for c in mine if c["status"] in ("delivered", "partial")]
        assert r["participants"] == len(delivered)
        assert r["partial_work"] == sum(c["status"] == "partial" for c in mine)
        norms = [c["update_norm"] for c in delivered]
        if norms:
            np.testing.assert_allclose([r["update_norm_min"], r["update_norm_median"],
                                        r["update_norm_max"]],
                                       [min(norms), np.median(norms), max(norms)], rtol=1e-6)
            losses = [c["train_loss"] for c in delivered]
            np.testing.assert_allclose(r["client_loss_var"], np.var(losses), rtol=1e-5)
        for c in mine:
            if c["status"] == "partial":
                assert c["total_s"] <= 0.6 + 1e-9 and c["local_steps"] >= 1
    assert summary["participation"]["selected"] == list(np.bincount(
        [c["client"] for c in clients], minlength=8))


def _tensorboard_scalars(logdir) -> dict[str, dict[int, float]]:
    """Reads scalar summaries from TFRecord event files (framing: length, crc, data, crc)."""
    from tensorboardX.proto import event_pb2

    out: dict[str, dict[int, float]] = {}
    for name in os.listdir(logdir):
        data = open(os.path.join(logdir, name), "rb").read()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for v in event.summary.value:
                if v.HasField("simple_value"):
                    out.setdefault(v.tag, {})[event.step] = v.simple_value
    return out


@pytest.mark.slow
def test_csv_and_tensorboard_hold_the_jsonl_numbers(private_run):
    workdir, _ = private_run
    rows = _rows(workdir)
    import csv

    table = list(csv.DictReader(open(workdir / "metrics.csv")))
    assert [int(float(t["round"])) for t in table] == [1, 2, 3, 4]
    for r, t in zip(rows, table, strict=True):
        np.testing.assert_allclose(float(t["simulated_clock_s"]), r["simulated_clock_s"])
    assert "personalized_accuracy_by_arch/mlp" in table[-1]
    scalars = _tensorboard_scalars(workdir / "tensorboard")
    for key in ("personalized_accuracy_mean", "loss_after_aggregation", "dp_epsilon"):
        for r in rows:
            if r.get(key) is not None:
                np.testing.assert_allclose(scalars[key][r["round"]], r[key], rtol=1e-6)


@pytest.mark.slow
def test_report_writes_the_plots_and_a_markdown_summary(private_run, async_run):
    workdir, _ = private_run
    plots = write_report(str(workdir))
    assert set(plots) == {"accuracy", "losses", "aggregation_loss", "proxy_change",
                          "update_norms", "participation", "participants", "privacy"}
    for path in plots.values():
        assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    md = open(workdir / "report.md").read()
    for name in plots:
        assert f"](report/{name}.png)" in md
    assert "privacy" not in write_report(str(async_run[0]))  # no DP: no privacy plot
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    assert all(r["proxy_relative_change"] >= 0 for r in rows)  # pFedES logs it every round
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        write_report(str(workdir / "nothing_here"))


def test_budget_stages_match_a_hand_computation():
    config = fl_helpers.tiny_config(rounds=6)
    config.system.speed_classes = "1,4"
    config.system.upload_mbps = "8,2"
    config.system.download_mbps = "16"
    config.system.step_time_s = 0.1
    config.system.deadline_s = 2.5
    config.upload.topk_fraction = 0.25
    ctx, state = build_context(config, build_federated_data(config))
    stages = round_budget.client_stages(ctx)
    upload = ctx.upload_bytes["mlp"]
    # top-k 25 %: (int32 index, float32 value) per kept coordinate of E_proxy.
    from fedjax_pfedes.tree_util import tree_size

    params = tree_size(ctx.algorithm.upload_template(state.server, "mlp"))[0]
    assert upload == pytest.approx(8 * int(np.ceil(0.25 * params)), rel=0.01)
    slow = ctx.profiles.speed_class == 1
    np.testing.assert_allclose(stages["upload_s"],
                               upload / (np.where(slow, 2.0, 8.0) * 1e6 / 8))
    np.testing.assert_allclose(stages["compute_s"],
                               ctx.planned_steps * np.where(slow, 0.4, 0.1))
    np.testing.assert_allclose(stages["download_s"], ctx.download_bytes["mlp"] / 2e6)
    replay = round_budget.replay_rounds(ctx)
    late = replay["past_deadline"] > 0
    np.testing.assert_array_equal(replay["round_s"][late], 2.5)
    assert np.all(replay["round_s"] <= 2.5)
    rows = round_budget.budget_table(ctx)
    assert sum(r["clients"] for r in rows) == 8
    # --measure: this machine's step time per architecture, x the speed multipliers.
    measured = round_budget.measure_step_times(ctx, state, repeats=1)
    assert set(measured) == {"mlp"} and 0 < measured["mlp"] < 1
    timed = round_budget.with_step_times(ctx, {"mlp": 0.2})
    np.testing.assert_allclose(round_budget.client_stages(timed)["compute_s"],
                               ctx.planned_steps * np.where(slow, 0.8, 0.2))
    np.testing.assert_allclose(round_budget.client_stages(ctx)["compute_s"],  # ctx left as it was
                               ctx.planned_steps * np.where(slow, 0.4, 0.1))
    assert client_system.PAST_DEADLINE == "deadline"


@pytest.mark.slow
def test_tensorboard_writer_does_not_import_torch_and_torch_still_imports_after():
    """tensorboardX imports PyTorch when it is installed (seconds of start-up); our writer hides
    it during that import, and a later `import torch` (if installed) still works."""
    import subprocess
    import sys
    code = ("import importlib.util, sys\n"
            "from fedjax_pfedes.io import metrics\n"
            "metrics.summary_writer_class()\n"
            "assert 'tensorboardX' in sys.modules and 'torch' not in sys.modules, 'torch loaded'\n"
            "if importlib.util.find_spec('torch') is not None:\n"
            "    import torch\n"
            "    assert torch.zeros(2).sum().item() == 0.0\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
