"""How often the default norm-outlier rule rejects honest uploads, measured on runs without an
attacker (docs/threat_model.md, "The norm rule's false positives").

  python -m benchmarks.norm_rule collect --workdir=runs/norm_rule        # the honest runs
  python -m benchmarks.norm_rule report --workdir=runs/norm_rule         # the table
  python -m benchmarks.norm_rule detect --workdir=runs/norm_rule_attacks # detection rates
  python -m benchmarks.norm_rule collect --set=converged --workdir=runs/norm_rule_converged
  python -m benchmarks.norm_rule report --set=converged --workdir=runs/norm_rule_converged
  python -m benchmarks.norm_rule audit --workdir=runs/compare_converged  # archived runs that stand

`collect` runs every method on the quick start population and on it with quantity skew
(LogNormal sigma 2), and the published pFedES, FedAvg, FML and FedMRL on the collaboration
population with 5 and with 2 classes per client (pfedes_paper 300 rounds, the others 150),
with the norm rule off (the honest trajectory), one seed (0), without evaluation until the last
round (the rule does not read it). Every run also writes `template_norms.jsonl`: the norm of the
model each cohort's uploads update (the upload template) in each round after the first.
`--set=converged` runs FedAvg (seeds 0-4 and 100-104) and FedMRL (seeds 0-4) instead to a
plateau of their evaluated accuracy on the quick start (`train.stop_at_plateau`, at most 200
rounds; the local rates of `CONVERGED_LR`), where late in training most updates shrink to a
floor and one client still learning stands out.
`report` applies, per run and round, the default rule, the default without its model-ratio
test, and the earlier one (norm per local sample
> 10x the round's median, nothing else) to the honest uploads (clients.jsonl), which is what a
run under that rule rejects up to its first rejection, and gives the largest ratio to the median
and robust z-score an honest upload reached. (A rule that rejects nothing leaves the run equal
to the honest one, so 0 in its column is exact.)

`detect` runs the quick start (pFedES, FedAvg and FedMRL, 20 rounds, seed 0) with client 3
attacking (`config.attack`: each kind of docs/threat_model.md) under the default rule and under
the earlier 10x-median rule, and counts the attacker's uploads the rule rejected and the honest
ones it rejected, with the attacker's update norm over the norm of the model it updates (where
the default rule's model-ratio test, 0.1, could decide).
"""

from __future__ import annotations

import argparse
import collections
import json
import os

import numpy as np

import fedjax_pfedes
from fedjax_pfedes.algorithms import registry
from fedjax_pfedes.engine import sections
from fedjax_pfedes.io.workdir import RunLockedError
from fedjax_pfedes.upload import validation

METHODS = ("pfedes", "pfedes_paper", "standalone", "fedavg", "fedprox", "fedavgm", "fedadam",
           "scaffold", "fednova", "fedbn", "lg_fedavg", "fedproto", "fml", "fedkd", "fedgh",
           "feddistill", "fedmrl")
COLLABORATION_METHODS = ("pfedes_paper", "fedavg", "fml", "fedmrl")
# pfedes_paper, whose honest uploads the 10x-median rule rejected most (~4 % over 300 rounds),
# runs the 300 rounds of that experiment; the others the config's 150.
COLLABORATION_ROUNDS = {"pfedes_paper": 300}


CONVERGED_SEEDS = (0, 1, 2, 3, 4, 100, 101, 102, 103, 104)
# The local rates of the runs at convergence: FedAvg's tuned by launch.compare there
# (docs/baselines.md); FedMRL's the rate it reached after its higher ones diverged, where its
# runs showed honest rejections under the rule without the model-ratio test.
CONVERGED_LR = {"fedavg": 0.02, "fedmrl": 0.05}


def populations(which: str = "short") -> dict[str, tuple[str, dict]]:
    """Run name -> (config file, overrides) of the set `which` ('short' or 'converged')."""
    if which == "converged":
        return {f"converged/{m}/seed{s}": ("configs/quickstart.py", {
            "algorithm": m, "seed": s, "train.rounds": 200, "train.stop_at_plateau": True,
            "train.lr_local": lr}) for m, lr in CONVERGED_LR.items() for s in CONVERGED_SEEDS
            if m == "fedavg" or s < 100}
    out = {}
    for m in METHODS:
        out[f"quickstart/{m}"] = ("configs/quickstart.py", {"algorithm": m})
        out[f"quantity_skew/{m}"] = ("configs/quickstart.py", {
            "algorithm": m, "data.partition": "quantity_skew", "data.quantity_sigma": 2.0})
    for classes in (5, 2):
        for m in COLLABORATION_METHODS:
            out[f"collaboration_{classes}class/{m}"] = ("configs/collaboration_mnist.py", {
                "algorithm": m, "data.classes_per_client": classes,
                "train.rounds": COLLABORATION_ROUNDS.get(m, 150)})
    return out


class TemplateNorms(fedjax_pfedes.Callback):
    """Writes, after each round, the norm of each cohort's upload template for the next round
    (the model its uploads update; `validation.model_norm` of its model part)."""

    def __init__(self, path: str):
        self.path = path

    def on_round_end(self, run, end):
        algorithm = run.ctx.algorithm
        norms = {c.arch: validation.model_norm(algorithm.upload_template(end.state.server,
                                                                          c.arch),
                                               algorithm.norm_keys)
                 for c in run.ctx.cohorts}
        with open(self.path, "a") as f:
            f.write(json.dumps({"round": end.round + 1, "template_norm": norms}) + "\n")


def _load(config_file: str):
    import importlib.util
    spec = importlib.util.spec_from_file_location("config_module", config_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def collect(workdir: str, only: str = "", which: str = "short") -> None:
    for name, (config_file, overrides) in populations(which).items():
        if only and only not in name:
            continue
        out = os.path.join(workdir, name)
        if os.path.exists(os.path.join(out, "summary.json")):
            continue
        config = _load(config_file)
        for path, value in overrides.items():
            node = config
            *parents, leaf = path.split(".")
            for p in parents:
                node = node[p]
            node[leaf] = value
        if which != "converged":  # the plateau stop reads the evaluations
            config.eval.every = 100000  # only the last round: the rule does not read it
        config.upload.norm_outlier_factor = 0.0  # the honest trajectory; report applies rules
        config.checkpoint.every = 0
        config.monitor.tensorboard = False
        os.makedirs(out, exist_ok=True)
        if os.path.exists(os.path.join(out, "template_norms.jsonl")):
            os.remove(os.path.join(out, "template_norms.jsonl"))
        try:
            fedjax_pfedes.run(config, out, progress=False, callbacks=[
                TemplateNorms(os.path.join(out, "template_norms.jsonl"))])
        except RunLockedError:  # another collect process runs it
            continue
        print(name, "done", flush=True)


def _rounds(run: str) -> dict[int, list[list[tuple]]]:
    """round -> its aggregation scopes, each a list of (arch, norm, samples) of its uploads."""
    summary = json.load(open(os.path.join(run, "summary.json")))
    kind = registry.get(summary["config"]["algorithm"]).aggregation
    by = collections.defaultdict(lambda: collections.defaultdict(list))
    for line in open(os.path.join(run, "clients.jsonl")):
        row = json.loads(line)
        if row.get("update_norm") is None or row["status"] != "delivered":
            continue
        scope = row["arch"] if kind == "per_cohort" else ""
        by[row["round"]][scope].append((row["arch"], row["update_norm"], row["samples"]))
    return {r: list(scopes.values()) for r, scopes in by.items()}


def _measures(rows, templates: dict, round_index: int):
    """(norms, norm per sample, norm / the model's norm) of `rows`; the last is inf where no
    template norm was logged (round 1)."""
    norms = np.array([r[1] for r in rows], np.float32)
    per_sample = norms / np.maximum(np.array([r[2] for r in rows], np.float32), 1)
    t = templates.get(round_index, {})
    relative = np.array([norms[i] / t[r[0]] if t.get(r[0]) else np.inf
                         for i, r in enumerate(rows)], np.float32)
    return norms, per_sample, relative


def report_row(run: str) -> dict:
    """One honest run's uploads judged, scope by scope as `NormOutlierCheck` does, by the
    default rule (a scope of fewer than 3 uploads against the round's uploads of every scope)
    and by the earlier 10x-median rule (such a scope not judged)."""
    summary = json.load(open(os.path.join(run, "summary.json")))
    defaults = fedjax_pfedes.default_config()
    method = summary["config"]["algorithm"]
    pipeline = sections.pipeline_config(_with_algorithm(defaults, method))
    templates = {}
    path = os.path.join(run, "template_norms.jsonl")
    if os.path.exists(path):
        templates = {r["round"]: r["template_norm"] for r in map(json.loads, open(path))}
    uploads = old = default = no_ratio = pooled = 0
    worst_ratio = worst_z = worst_relative = 0.0
    for round_index, scopes in _rounds(run).items():
        everything = [row for scope in scopes for row in scope]
        starts = np.cumsum([0] + [len(scope) for scope in scopes])
        for scope, start in zip(scopes, starts, strict=False):
            norms, per_sample, relative = _measures(scope, templates, round_index)
            uploads += int((norms > 0).sum())  # Standalone uploads nothing
            alone = len(scope) >= 3 or len(scopes) == 1
            if alone:
                old += int(validation.norm_outliers(per_sample, np.ones(len(scope), bool),
                                                    10.0).sum())
                reference, mine = scope, slice(None)
            else:  # judged against every scope of the round, as the stage does
                pooled += len(scope)
                reference, mine = everything, slice(start, start + len(scope))
            _, per_sample, relative = _measures(reference, templates, round_index)
            valid = np.ones(len(reference), bool)
            u = pipeline.upload
            rule = (per_sample, valid, u.norm_outlier_factor, u.norm_outlier_z,
                    u.norm_outlier_hard_factor)
            flagged = validation.norm_outliers(*rule)[mine]
            no_ratio += int(flagged.sum())
            if flagged.any():
                worst_relative = max(worst_relative, float(relative[mine][flagged].max()))
            default += int(validation.norm_outliers(
                *rule, relative if pipeline.norm_model_ratio > 0 else None,
                pipeline.norm_model_ratio)[mine].sum())
            median = float(np.median(per_sample))
            if len(reference) < 3 or median <= 0:  # nothing uploaded (Standalone)
                continue
            ratio = (per_sample / median)[mine]
            z = validation.robust_log_z(per_sample, valid)[mine]
            worst_ratio = max(worst_ratio, float(ratio.max()))
            worst_z = max(worst_z, float(z[ratio > 10].max()) if (ratio > 10).any() else 0.0)
    return {"uploads": uploads, "default": default, "no_ratio": no_ratio, "old_rule": old,
            "pooled": pooled, "worst_relative": worst_relative,
            "max_ratio": worst_ratio, "max_z_beyond_10x": worst_z}


def _with_algorithm(config, method: str):
    config.algorithm = method
    return config


def report(workdir: str, which: str = "short") -> str:
    lines = ["| run | honest uploads | judged against every cohort (own cohort < 3) | "
             "rejected by the default rule | without its model-ratio test | by the 10x-median "
             "rule alone | max norm per sample / median | max robust z beyond 10x | max "
             "norm / model norm of those without the ratio test |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in populations(which):
        run = os.path.join(workdir, name)
        if not os.path.exists(os.path.join(run, "summary.json")):
            continue
        r = report_row(run)
        lines.append(f"| {name} | {r['uploads']} | {r['pooled']} | {r['default']} | "
                     f"{r['no_ratio']} | {r['old_rule']} | "
                     f"{r['max_ratio']:.1f} | {r['max_z_beyond_10x']:.1f} | "
                     + (f"{r['worst_relative']:.3f} |" if r["no_ratio"] else "- |"))
    return "\n".join(lines)


ATTACKS = {"constant 1e4": ("constant", 1e4), "scale x100": ("scale", 100.0),
           "sign_flip x100": ("sign_flip", 100.0), "gaussian std 10": ("gaussian", 10.0),
           "scale x10": ("scale", 10.0)}
RULES = {"default": {}, "10x median alone": {"upload.norm_outlier_z": 0.0,
                                             "upload.norm_outlier_hard_factor": 0.0,
                                             "upload.norm_outlier_model_ratio": 0.0,
                                             "upload.norm_outlier_small_cohorts": False}}
ATTACKER = 3
DETECT_METHODS = ("pfedes", "fedavg", "fedmrl")


def detect(workdir: str, only: str = "") -> str:
    lines = ["| method | attack | rule | attacker uploads | rejected | honest uploads rejected | "
             "final accuracy of the attacker's cohort | attacker's norm / model norm |",
             "|---|---|---|---|---|---|---|---|"]
    for method in DETECT_METHODS:
        if only and only != method:
            continue
        for attack, (kind, value) in ATTACKS.items():
            for rule, fields in RULES.items():
                out = os.path.join(workdir, method, attack.replace(" ", "_"),
                                   rule.replace(" ", "_"))
                if not os.path.exists(os.path.join(out, "summary.json")):
                    config = _load("configs/quickstart.py")
                    config.algorithm = method
                    config.attack.clients, config.attack.kind = str(ATTACKER), kind
                    config.attack.value = value
                    for path, v in fields.items():
                        section, name = path.split(".")
                        config[section][name] = v
                    config.eval.every = 100000
                    config.checkpoint.every = 0
                    config.monitor.tensorboard = False
                    config.train.allow_divergence = True
                    fedjax_pfedes.run(config, out, progress=False, callbacks=[
                        TemplateNorms(os.path.join(out, "template_norms.jsonl"))])
                rows = [json.loads(line) for line in open(os.path.join(out, "clients.jsonl"))]
                mine = [r for r in rows if r["client"] == ATTACKER and r["status"] == "delivered"]
                others = [r for r in rows if r["client"] != ATTACKER]
                final = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))][-1]
                cohort = final["personalized_accuracy_by_arch"][mine[0]["arch"]]
                path = os.path.join(out, "template_norms.jsonl")
                templates = {r["round"]: r["template_norm"] for r in map(
                    json.loads, open(path))} if os.path.exists(path) else {}
                relative = [r["update_norm"] / templates[r["round"]][r["arch"]] for r in mine
                            if r["round"] in templates  # round 1: no template logged
                            and r["update_norm"] is not None]  # null: not finite
                lines.append(f"| {method} | {attack} | {rule} | {len(mine)} | "
                             f"{sum(not r['accepted'] for r in mine)} | "
                             f"{sum(not r['accepted'] for r in others)} | {cohort:.3f} | "
                             + (f"{min(relative):.3g}-{max(relative):.3g} |" if relative
                                else "not logged |"))
                print(lines[-1], flush=True)
    return "\n".join(lines)


def audit(workdir: str) -> str:
    """Every finished run under `workdir` (any depth): the norm-rule rejections it recorded and
    the uploads today's default rule would flag on its trajectory without the model-ratio test
    (the test needs template norms, which only this module's runs log, so this count is an upper
    bound of what the default rejects). A run with 0 in both is the run today's default makes
    from its config: its archived numbers stand."""
    lines = ["| run | norm-rule rejections recorded | flagged by today's default without the "
             "model-ratio test | stands |", "|---|---|---|---|"]
    for root, _, files in sorted(os.walk(workdir)):
        if "summary.json" not in files or "clients.jsonl" not in files:
            continue
        recorded = 0
        path = os.path.join(root, "rejections.jsonl")
        if os.path.exists(path):
            recorded = sum("update norm" in json.loads(line)["reason"] for line in open(path))
        flagged = report_row(root)["no_ratio"]
        lines.append(f"| {os.path.relpath(root, workdir)} | {recorded} | {flagged} | "
                     + ("yes |" if recorded == flagged == 0 else
                        "not shown (the flags are an upper bound without template norms) |"))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=("collect", "report", "detect", "audit"))
    parser.add_argument("--workdir", default="runs/norm_rule")
    parser.add_argument("--only", default="", help="collect: only runs whose name contains it; "
                                                   "detect: only this method")
    parser.add_argument("--set", default="short", choices=("short", "converged"),
                        help="the honest runs: every method for a fixed number of rounds, or "
                             "FedAvg to a plateau")
    args = parser.parse_args()
    if args.command == "collect":
        collect(args.workdir, args.only, args.set)
    elif args.command == "detect":
        print(detect(args.workdir, args.only))
    elif args.command == "audit":
        print(audit(args.workdir))
    else:
        print(report(args.workdir, args.set))


if __name__ == "__main__":
    main()
