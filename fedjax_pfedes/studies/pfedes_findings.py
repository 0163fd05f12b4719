"""The design's findings F1-F7 as experiments with stated verdict rules.

docs/design.md lists seven behaviours the pFedES design expects. Each `Finding` here names its
claim, the config variants its experiment runs (dotted overrides of a base config, several seeds,
same data), a metric per variant computed from the runs' metrics.jsonl, and a rule that turns the
metrics into a verdict by one statistical rule (`paired_verdict`): every comparison is a
paired difference over seeds (same seed: same data, clients and sampling) with a Student-t 95%
confidence interval; 'reproduced' only when the interval excludes 0 in the claimed direction,
'refuted' when it excludes 0 in the opposite direction, 'inconclusive' otherwise. A finding
with several comparisons is reproduced when all are, refuted when any is. Diverged seeds are
never dropped: they count with a stated value (accuracy 0, oscillation `DIVERGED_OSCILLATION`)
or, for metrics without one, make the comparison inconclusive. The rules are stated in `rule`
(and printed in docs/findings.md), fixed before looking at results, so a verdict is mechanical.
`launch.findings` runs them and writes the report.

Variants are shared between findings by name (the default pFedES run serves F3-F7), so running
all seven costs 17 variants x seeds runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import ml_collections

from fedjax_pfedes.studies.design_findings import (  # noqa: F401  (named by launch.findings, tests)
    F4_SETUP,
    F5_DESIGN,
    WARMUP_STEPS,
    analyse_f3,
    analyse_f4,
    analyse_f5,
    analyse_f6,
    analyse_f7,
    client_jumps,
    convergence_round,
    f3_variants,
    f4_rounds,
    f4_setup_words,
    f4_variants,
    f5_variants,
    f6_variants,
    f7_variants,
)
from fedjax_pfedes.studies.finding import DEFAULT, Finding, Records, Verdict  # noqa: F401
from fedjax_pfedes.studies.heterogeneity_findings import (  # noqa: F401
    RATIOS,
    analyse_f1,
    analyse_f2,
    f1_variants,
    hetero_variants,
)

# ---------------------------------------------------------------------------- the catalogue

FINDINGS: dict[str, Finding] = {f.id: f for f in (
    Finding("F1", "with one architecture for everyone, pFedES is within about 1 point of FedAvg",
            "paired by seed, final personalized accuracy: reproduced if the 95% CI of "
            "pFedES − FedAvg lies within ±1 pp, refuted if it lies wholly outside, else "
            "inconclusive; inconclusive too unless the positive control (FedAvg − Standalone "
            "with one architecture, CI > 0) holds", f1_variants, analyse_f1),
    Finding("F2", "as the heterogeneity ratio grows from 0 to 0.8, pFedES's lead over FedAvg "
            "run per architecture cohort grows beyond 10 points",
            "ratio = share of clients whose architecture differs from the majority (at 0.8: 4 "
            "clients of each of 5 architectures); lead = pFedES − FedAvg per seed; reproduced "
            "if the CIs of (lead at 0.8 − lead at 0) > 0 and of the lead at 0.8 > 10 pp, "
            "refuted if either lies on the other side, else inconclusive; gated by the "
            "positive control as F1", hetero_variants, analyse_f2),
    Finding("F3", "λ = 2.0 raises global accuracy but lowers personalized accuracy; λ ≈ 0.5 "
            "balances them",
            "paired by seed against λ = 0.5: reproduced if the CI of λ 2.0's global accuracy "
            "difference is > 0 and of its personalized one < 0; refuted if either lies on "
            "the other side of 0; else inconclusive", f3_variants, analyse_f3),
    Finding("F4", "server momentum β ≈ 0.5 removes the jump of the loss right after aggregation",
            "jump = a client's alignment loss right after receiving the aggregated E_proxy "
            "minus its loss at the end of its previous participation (same rows of its data), "
            "averaged over clients and participations, in a setup where E_proxy moves between "
            f"a client's participations ({f4_setup_words()}, rounds × the base's fraction / "
            f"{F4_SETUP['train.client_fraction']:g}: as many participations per client); "
            "inconclusive unless the CI of the jump at β = 0 is > 0 (the condition exists); "
            "then reproduced if the CI of jump(β = 0.5) − jump(β = 0) is < 0, refuted if > 0",
            f4_variants, analyse_f4),
    Finding("F5", "removing either stop-gradient makes the losses oscillate",
            "oscillation = mean |second difference| / mean of the per-round training "
            "alignment loss (a diverged run scores 1.0); all arms align with InfoNCE (with "
            "MSE or cosine a removed stop-gradient is only a rescaled λ or E_proxy step); "
            "reproduced if the CI of (variant − design) is > 0 for both variants, refuted if "
            "either is < 0", f5_variants, analyse_f5),
    Finding("F6", "warm-up (frozen F_k) makes the projection head converge faster",
            f"warm-up = backbone frozen for the first {WARMUP_STEPS} local steps of a client; "
            "reproduced if the CIs of (warm-up − none) are < 0 for both the rounds to 90% of "
            "the alignment-loss drop and the mean alignment loss over rounds 1-5, refuted if "
            "either is > 0", f6_variants, analyse_f6),
    Finding("F7", "3 local epochs give a smoother alignment loss than 1",
            "reproduced if the CI of oscillation(E = 3) − oscillation(E = 1) is < 0, refuted "
            "if > 0 (a diverged run scores 1.0)", f7_variants, analyse_f7),
)}


def resolve(spec: str) -> list[Finding]:
    """'F3', 'F1,F4' or 'all' -> findings; ValueError naming --finding otherwise."""
    if spec == "all":
        return list(FINDINGS.values())
    ids = [s.strip().upper() for s in spec.split(",") if s.strip()]
    unknown = [i for i in ids if i not in FINDINGS]
    if unknown or not ids:
        raise ValueError(f"--finding={spec}: unknown {unknown or spec}; known: "
                         f"{list(FINDINGS)} or 'all'")
    return [FINDINGS[i] for i in ids]


def variants_of(findings: Sequence[Finding], base: ml_collections.ConfigDict
                ) -> dict[str, dict]:
    """The union of the findings' variants (shared names run once)."""
    out: dict[str, dict] = {}
    for f in findings:
        for name, overrides in f.variants(base).items():
            if name in out and out[name] != overrides:
                raise AssertionError(f"variant {name} defined twice differently")
            out[name] = overrides
    return out
