"""The findings' metrics, verdict rules and report (`fedjax_pfedes/studies/pfedes_findings.py`,
`launch.findings`)."""

import itertools
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from configs import quickstart
from fedjax_pfedes.studies import experiments, paired_verdicts, pfedes_findings
from fedjax_pfedes.studies.paired_verdicts import INCONCLUSIVE, REFUTED, REPRODUCED


def test_oscillation_and_convergence_round_by_hand():
    assert paired_verdicts.oscillation([3.0, 2.0, 1.0, 0.0]) == 0.0  # a straight line
    # zig-zag 1, 2, 1, 2: second differences 2, -2 -> mean |.| 2 / mean 1.5
    assert paired_verdicts.oscillation([1.0, 2.0, 1.0, 2.0]) == pytest.approx(2 / 1.5)
    assert paired_verdicts.oscillation([1.0, np.nan, 1.0]) == np.inf
    # drop 10 -> 0: 90% done once the loss is <= 1, first at round 3
    assert pfedes_findings.convergence_round([10.0, 5.0, 0.9, 0.5, 0.0]) == 3.0


def test_client_jumps_pair_consecutive_participations(tmp_path):
    rows = [{"client": 0, "align_loss_at_start": 5.0, "align_loss_at_end": 1.0},
            {"client": 1, "align_loss_at_start": 4.0, "align_loss_at_end": 2.0},
            {"client": 0, "align_loss_at_start": 1.5, "align_loss_at_end": 0.5},
            {"client": 2},  # another method's row: ignored
            {"client": 0, "align_loss_at_start": 0.75, "align_loss_at_end": 0.25}]
    path = tmp_path / "clients.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    assert pfedes_findings.client_jumps(str(path)) == [0.5, 0.25]


def _record(acc, glob=None, seed=0, diverged=False, **curves):
    return {"final": {"personalized_accuracy_mean": acc,
                      "global_accuracy_mean": acc if glob is None else glob},
            "curves": curves, "diverged": diverged, "seed": seed}


NOISE = np.array([0.003, -0.002, 0.001, -0.004, 0.002])  # per-seed noise, 5 seeds
_ARMS_MADE = itertools.count()


def _noise():
    """Per-seed noise of its own for every arm made: two arms with the same noise would differ
    by the same amount on every seed, a difference without spread, which gets no interval."""
    rng = np.random.default_rng(next(_ARMS_MADE))
    return NOISE[rng.permutation(len(NOISE))] * rng.uniform(0.5, 1.5)


def _arm(acc, glob=None, noise=None):
    noise = _noise() if noise is None else noise
    return [_record(acc + e, None if glob is None else glob + e, seed=k)
            for k, e in enumerate(noise)]


def test_confidence_interval_by_hand_and_the_three_verdicts():
    mean, low, high = paired_verdicts.confidence_interval([1.0, 2.0, 3.0])
    half = 4.302653 * 1.0 / np.sqrt(3)  # t(0.975, 2) * sd / sqrt(n)
    assert (mean, low, high) == pytest.approx((2.0, 2.0 - half, 2.0 + half), rel=1e-5)
    assert paired_verdicts.paired_verdict("x", [1, 2, 3], [0, 0, 0], +1).verdict == INCONCLUSIVE
    assert paired_verdicts.paired_verdict("x", [5, 6, 7], [0, 0, 0], +1).verdict == REPRODUCED
    assert paired_verdicts.paired_verdict("x", [5, 6, 7], [0, 0, 0], -1).verdict == REFUTED
    # a seed without a value leaves the interval unbounded: never a verdict on fewer seeds
    assert paired_verdicts.paired_verdict("x", [5, 6, np.nan], [0, 0, 0], +1).verdict == \
        INCONCLUSIVE
    assert paired_verdicts.within_verdict("x", [0.1, -0.1, 0.0], [0, 0, 0], 1.0).verdict == \
        REPRODUCED
    assert paired_verdicts.within_verdict("x", [5.0, 5.1, 4.9], [0, 0, 0], 1.0).verdict == \
        REFUTED


def _hetero(pfedes_by_ratio, fedavg=0.80, standalone=0.75):
    records = {}
    for ratio, p in zip(pfedes_findings.RATIOS, pfedes_by_ratio, strict=True):
        records[f"hetero_r{ratio:g}_pfedes"] = _arm(p)
        records[f"hetero_r{ratio:g}_fedavg"] = _arm(fedavg, noise=-NOISE)
        records[f"hetero_r{ratio:g}_standalone"] = _arm(standalone)
    return records


def test_f1_rule_is_an_equivalence_test_gated_by_the_positive_control():
    base = quickstart.get_config()
    f1 = pfedes_findings.FINDINGS["F1"]
    assert f1.analyse(_hetero([0.801, 0.8, 0.8]), base, {}, "").verdict == REPRODUCED
    assert f1.analyse(_hetero([0.75, 0.8, 0.8]), base, {}, "").verdict == REFUTED
    # FedAvg no better than Standalone: the setup cannot show collaboration
    gated = f1.analyse(_hetero([0.801, 0.8, 0.8], standalone=0.85), base, {}, "")
    assert gated.verdict == INCONCLUSIVE and "positive control" in gated.reason


def test_f2_rule_reads_the_lead_per_seed(tmp_path):
    base = quickstart.get_config()
    variants = pfedes_findings.variants_of([pfedes_findings.FINDINGS["F2"]], base)
    f2, figure = pfedes_findings.FINDINGS["F2"], str(tmp_path / "f2.png")
    assert f2.analyse(_hetero([0.80, 0.85, 0.95]), base, variants, figure).verdict == \
        REPRODUCED
    assert f2.analyse(_hetero([0.85, 0.82, 0.80]), base, variants, figure).verdict == \
        REFUTED
    # grows, but by less than 10 pp at 0.8: refuted on the second comparison
    assert f2.analyse(_hetero([0.80, 0.82, 0.84]), base, variants, figure).verdict == \
        REFUTED


@pytest.mark.parametrize("g2,p2,verdict", [
    (0.7, 0.8, REPRODUCED), (0.6, 0.9, INCONCLUSIVE),
    (0.5, 0.95, REFUTED)])
def test_f3_rule(g2, p2, verdict, tmp_path):
    base = quickstart.get_config()  # lam 0.5: the default run is lam 0.5
    records = {"lam0.1": _arm(0.9, 0.5), pfedes_findings.DEFAULT: _arm(0.9, 0.6),
               "lam1": _arm(0.9, 0.6), "lam2": _arm(p2, g2, noise=NOISE[::-1])}
    if verdict == INCONCLUSIVE:  # same means, seed noise only
        records["lam2"] = _arm(p2, g2, noise=3 * NOISE[::-1])
    result = pfedes_findings.FINDINGS["F3"].analyse(records, base, {}, str(tmp_path / "f3.png"))
    assert result.verdict == verdict and os.path.exists(result.figure)


def test_a_diverged_seed_counts_and_can_flip_a_verdict(tmp_path):
    base = quickstart.get_config()
    records = {"lam0.1": _arm(0.9, 0.5), pfedes_findings.DEFAULT: _arm(0.9, 0.6),
               "lam1": _arm(0.9, 0.6), "lam2": _arm(0.8, 0.7)}
    f3 = pfedes_findings.FINDINGS["F3"]
    assert f3.analyse(records, base, {}, str(tmp_path / "f.png")).verdict == REPRODUCED
    records["lam2"][2]["diverged"] = True  # scores 0: global accuracy no longer clearly higher
    assert f3.analyse(records, base, {}, str(tmp_path / "f.png")).verdict != REPRODUCED


def _curves(key, shape, noise=None):
    """Per seed, `shape` scaled by 1 + e and bent by e (a bend moves the oscillation score,
    which is scale-free, so every seed scores a little differently)."""
    noise = _noise() if noise is None else noise
    tilt = (np.arange(len(shape)) / len(shape)) ** 2
    return [_record(0.9, seed=k, **{"train_ce_loss_mean": SMOOTH,
                                    key: list(np.asarray(shape) * (1 + e) + e * tilt)})
            for k, e in enumerate(noise)]


ZIGZAG = [1.0, 2.0, 1.0, 2.0, 1.0]
SMOOTH = [2.0, 1.8, 1.6, 1.4, 1.2]


def test_f5_rule_compares_each_variant_with_the_design(tmp_path):
    base = quickstart.get_config()
    key = "train_align_loss_mean"
    records = {pfedes_findings.F5_DESIGN: _curves(key, SMOOTH), "no_sg_proxy": _curves(key, ZIGZAG),
               "no_sg_local": _curves(key, ZIGZAG)}
    f5 = pfedes_findings.FINDINGS["F5"]
    assert f5.analyse(records, base, {}, str(tmp_path / "f5.png")).verdict == REPRODUCED
    records["no_sg_local"] = _curves(key, SMOOTH, noise=NOISE[::-1])
    assert f5.analyse(records, base, {}, str(tmp_path / "f5.png")).verdict == \
        INCONCLUSIVE
    records[pfedes_findings.F5_DESIGN] = _curves(key, ZIGZAG)
    records["no_sg_proxy"] = _curves(key, SMOOTH)
    assert f5.analyse(records, base, {}, str(tmp_path / "f5.png")).verdict == REFUTED
    # a diverged variant counts as oscillating
    records = {pfedes_findings.F5_DESIGN: _curves(key, SMOOTH), "no_sg_proxy": _curves(key, SMOOTH),
               "no_sg_local": _curves(key, SMOOTH)}
    for name in ("no_sg_proxy", "no_sg_local"):
        for r in records[name]:
            r["diverged"] = True
    assert f5.analyse(records, base, {}, str(tmp_path / "f5.png")).verdict == REPRODUCED


def test_f6_rule_needs_both_faster_convergence_and_lower_early_loss(tmp_path):
    base = quickstart.get_config()
    key = "train_align_loss_mean"
    slow = [2.0, 1.9, 1.8, 1.7, 1.6, 1.0, 0.9, 0.5]
    fast = [1.5, 0.7, 0.6, 0.55, 0.5, 0.5, 0.5, 0.5]
    w = f"warmup{pfedes_findings.WARMUP_STEPS}"
    f6 = pfedes_findings.FINDINGS["F6"]
    records = {pfedes_findings.DEFAULT: _curves(key, slow), w: _curves(key, fast)}
    assert f6.analyse(records, base, {}, str(tmp_path / "f6.png")).verdict == REPRODUCED
    records = {pfedes_findings.DEFAULT: _curves(key, fast), w: _curves(key, slow)}
    assert f6.analyse(records, base, {}, str(tmp_path / "f6.png")).verdict == REFUTED


def test_f4_rule_needs_a_jump_at_beta_zero(tmp_path):
    base = quickstart.get_config()

    def arm(name, jump):
        out = []
        for k, e in enumerate(_noise()):
            d = tmp_path / name / f"seed{k}"
            d.mkdir(parents=True)
            rows = [{"client": 0, "align_loss_at_start": 1.0, "align_loss_at_end": 0.5},
                    {"client": 0, "align_loss_at_start": 0.5 + jump + e,
                     "align_loss_at_end": 0.4}]
            (d / "clients.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
            out.append({**_record(0.9, seed=k), "run_dir": str(d),
                        "curves": {"align_loss_after_aggregation": [1.0],
                                   "align_loss_before_aggregation": [0.9],
                                   "train_align_loss_mean": [1.0, 0.9]}})
        return out

    f4 = pfedes_findings.FINDINGS["F4"]
    records = {"f4_beta0": arm("b0", 0.3), "f4_beta0.5": arm("b5", 0.05),
               "f4_beta0.9": arm("b9", 0.01)}
    assert f4.analyse(records, base, {}, str(tmp_path / "f4.png")).verdict == REPRODUCED
    records = {"f4_beta0": arm("c0", 0.05), "f4_beta0.5": arm("c5", 0.3),
               "f4_beta0.9": arm("c9", 0.01)}
    assert f4.analyse(records, base, {}, str(tmp_path / "f4.png")).verdict == REFUTED
    records = {"f4_beta0": arm("d0", 0.0), "f4_beta0.5": arm("d5", 0.0),
               "f4_beta0.9": arm("d9", 0.0)}
    result = f4.analyse(records, base, {}, str(tmp_path / "f4.png"))
    assert result.verdict == INCONCLUSIVE and "does not arise" in result.reason


def test_f7_rule_reads_the_alignment_curves(tmp_path):
    base = quickstart.get_config()  # E = 2 is the default run
    key = "train_align_loss_mean"
    records = {"epochs1": _curves(key, ZIGZAG), pfedes_findings.DEFAULT: _curves(key, ZIGZAG),
               "epochs3": _curves(key, SMOOTH)}
    f7 = pfedes_findings.FINDINGS["F7"]
    assert f7.analyse(records, base, {}, str(tmp_path / "f7.png")).verdict == REPRODUCED
    records["epochs3"], records["epochs1"] = records["epochs1"], records["epochs3"]
    assert f7.analyse(records, base, {}, str(tmp_path / "f7.png")).verdict == REFUTED


def test_plateau_rule_by_hand():
    flat = {"personalized_accuracy": [0.2, 0.5, 0.7, 0.8, 0.80, 0.801, 0.802, 0.80, 0.803, 0.80]}
    rising = {"personalized_accuracy": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9]}
    assert experiments.at_plateau(flat) and not experiments.at_plateau(rising)
    assert not experiments.at_plateau({**flat, "diverged": True})
    assert not experiments.at_plateau({"personalized_accuracy": [0.5]})
    note = experiments.plateau_note({"a": [flat, flat], "b": [rising]})
    assert "2 of 3" in note and "still moving in b" in note


def test_variants_are_shared_and_resolve_names_the_flag():
    base = quickstart.get_config()
    variants = pfedes_findings.variants_of(list(pfedes_findings.FINDINGS.values()), base)
    assert len(variants) == 22 and variants[pfedes_findings.DEFAULT] == {}
    assert variants["hetero_r0.8_fedavg"]["clients.architectures"] == \
        "convnet3:4,convnet5:4,vit:4,mlp:4,cnn_small:4"  # ratio 0.8 off the majority
    assert variants["f4_beta0"] == {**pfedes_findings.F4_SETUP, "server_momentum": 0.0,
                                    "train.rounds": 5 * base.train.rounds}  # 0.5 / 0.1
    assert pfedes_findings.F4_SETUP["train.client_fraction"] < base.train.client_fraction
    base.train.client_fraction = 0.05  # never fewer rounds than the base's
    assert pfedes_findings.f4_rounds(base) == base.train.rounds
    with pytest.raises(ValueError, match="--finding=F9"):
        pfedes_findings.resolve("F9")


@pytest.mark.slow
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
    assert verdicts["F4"]["verdict"] in paired_verdicts.VERDICTS
    rows = [json.loads(line) for line in
            open(tmp_path / "runs" / "breast_cancer" / "f4_beta0" / "seed0" / "clients.jsonl")]
    assert all("align_loss_at_start" in r for r in rows if r["accepted"])


@pytest.mark.slow
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
    c = paired_verdicts.curve(records, "train_align_loss_mean")
    assert c.shape == (2, 4) and np.isnan(c[1, 2:]).all()
    assert paired_verdicts.oscillation(c[0]) == pytest.approx(0.0, abs=1e-9)
    assert paired_verdicts.oscillation(c[1]) == np.inf
