"""The findings' metrics, verdict rules and report (`fedjax_pfedes/findings.py`,
`launch.findings`)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from configs import quickstart
from fedjax_pfedes import findings


def test_oscillation_and_convergence_round_by_hand():
    assert findings.oscillation([3.0, 2.0, 1.0, 0.0]) == 0.0  # a straight line
    # zig-zag 1, 2, 1, 2: second differences 2, -2 -> mean |.| 2 / mean 1.5
    assert findings.oscillation([1.0, 2.0, 1.0, 2.0]) == pytest.approx(2 / 1.5)
    assert findings.oscillation([1.0, np.nan, 1.0]) == np.inf
    # drop 10 -> 0: 90% done once the loss is <= 1, first at round 3
    assert findings.convergence_round([10.0, 5.0, 0.9, 0.5, 0.0]) == 3.0


def test_client_jumps_pair_consecutive_participations(tmp_path):
    rows = [{"client": 0, "align_loss_at_start": 5.0, "align_loss_at_end": 1.0},
            {"client": 1, "align_loss_at_start": 4.0, "align_loss_at_end": 2.0},
            {"client": 0, "align_loss_at_start": 1.5, "align_loss_at_end": 0.5},
            {"client": 2},  # another method's row: ignored
            {"client": 0, "align_loss_at_start": 0.75, "align_loss_at_end": 0.25}]
    path = tmp_path / "clients.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    assert findings.client_jumps(str(path)) == [0.5, 0.25]


def _record(acc, glob=None, **curves):
    return {"final": {"personalized_accuracy_mean": acc,
                      "global_accuracy_mean": acc if glob is None else glob},
            "curves": curves, "diverged": False}


@pytest.mark.parametrize("pfedes,fedavg,verdict", [
    (0.900, 0.905, findings.REPRODUCED), (0.90, 0.92, findings.PARTLY),
    (0.85, 0.95, findings.NOT_REPRODUCED)])
def test_f1_rule(pfedes, fedavg, verdict):
    records = {"hetero_r0_pfedes": [_record(pfedes)], "hetero_r0_fedavg": [_record(fedavg)]}
    base = quickstart.get_config()
    assert findings.FINDINGS["F1"].analyse(records, base, {}, "").verdict == verdict


@pytest.mark.parametrize("g2,p2,verdict", [
    (0.7, 0.8, findings.REPRODUCED), (0.7, 0.95, findings.PARTLY),
    (0.5, 0.95, findings.NOT_REPRODUCED)])
def test_f3_rule(g2, p2, verdict, tmp_path):
    base = quickstart.get_config()  # lam 0.5: the default run is lam 0.5
    records = {"lam0.1": [_record(0.9, 0.5)], findings.DEFAULT: [_record(0.9, 0.6)],
               "lam1": [_record(0.9, 0.6)], "lam2": [_record(p2, g2)]}
    result = findings.FINDINGS["F3"].analyse(records, base, {}, str(tmp_path / "f3.png"))
    assert result.verdict == verdict and os.path.exists(result.figure)


def test_f7_rule_reads_the_alignment_curves(tmp_path):
    base = quickstart.get_config()  # E = 2 is the default run
    zigzag = [1.0, 2.0, 1.0, 2.0, 1.0]
    smooth = [2.0, 1.8, 1.6, 1.4, 1.2]
    records = {"epochs1": [_record(0.9, train_align_loss_mean=zigzag)],
               findings.DEFAULT: [_record(0.9, train_align_loss_mean=zigzag)],
               "epochs3": [_record(0.9, train_align_loss_mean=smooth)]}
    result = findings.FINDINGS["F7"].analyse(records, base, {}, str(tmp_path / "f7.png"))
    assert result.verdict == findings.REPRODUCED
    records["epochs3"] = records["epochs1"]
    assert findings.FINDINGS["F7"].analyse(records, base, {}, str(tmp_path / "f7.png")
                                           ).verdict == findings.NOT_REPRODUCED


def test_variants_are_shared_and_resolve_names_the_flag():
    base = quickstart.get_config()
    variants = findings.variants_of(list(findings.FINDINGS.values()), base)
    assert len(variants) == 17 and variants[findings.DEFAULT] == {}
    assert variants["hetero_r0.8_fedavg"]["clients.architectures"] == "convnet3:4,convnet5:8,vit:8"
    with pytest.raises(ValueError, match="--finding=F9"):
        findings.resolve("F9")


def test_launch_findings_writes_and_replaces_its_section(tmp_path):
    output = tmp_path / "findings.md"
    output.write_text("# Findings\n\n<!-- findings:other -->\nkept\n<!-- /findings:other -->\n")
    cmd = [sys.executable, "-m", "launch.findings", "--config=configs/tabular_hetero.py",
           "--config.train.rounds=3", "--config.eval.every=3", "--config.checkpoint.every=0",
           "--finding=F4", "--seeds=1", f"--workdir={tmp_path / 'runs'}",
           f"--output={output}", f"--figures={tmp_path / 'figures'}", "--progress=False"]
    for _ in range(2):  # the second run reuses the runs and replaces the section
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
    text = output.read_text()
    assert text.count("<!-- findings:breast_cancer -->") == 1 and "kept" in text
    assert "### breast_cancer F4" in text and "**Verdict: " in text
    assert (tmp_path / "figures" / "findings_breast_cancer_F4.png").exists()
    verdicts = json.loads((tmp_path / "runs" / "breast_cancer" / "findings.json").read_text())
    assert verdicts["F4"]["verdict"] in (findings.REPRODUCED, findings.PARTLY,
                                         findings.NOT_REPRODUCED)
    rows = [json.loads(line) for line in
            open(tmp_path / "runs" / "breast_cancer" / "beta0" / "seed0" / "clients.jsonl")]
    assert all("align_loss_at_start" in r for r in rows if r["accepted"])


def test_launch_findings_refuses_an_unknown_finding(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "launch.findings",
                           "--config=configs/tabular_hetero.py", "--finding=F8",
                           f"--output={tmp_path / 'f.md'}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --finding=F8: unknown")


def test_a_run_that_stopped_early_counts_as_oscillating():
    """A diverged run stops early: its curve is padded with NaN and its oscillation is inf."""
    records = [_record(0.9, train_align_loss_mean=[1.0, 0.9, 0.8, 0.7]),
               _record(0.9, train_align_loss_mean=[1.0, 0.9, float("nan")])]
    c = findings.curve(records, "train_align_loss_mean")
    assert c.shape == (2, 4) and np.isnan(c[1, 2:]).all()
    assert findings.oscillation(c[0]) == pytest.approx(0.0, abs=1e-9)
    assert findings.oscillation(c[1]) == np.inf
