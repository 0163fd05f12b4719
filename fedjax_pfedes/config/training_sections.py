"""`config.train`, `config.eval`, `config.checkpoint`, `config.monitor`: how a run trains,
evaluates, saves and reports."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from fedjax_pfedes.config.fields import Section, above, at_least, between, param
from fedjax_pfedes.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class TrainSection(Section):
    """`config.train`: rounds, client sampling, local epochs and the local optimizer."""

    SECTION: ClassVar[str] = "train"

    rounds: int = param(20, "communication rounds (with stop_at_plateau: the most it runs)",
                        at_least(1))
    client_fraction: float = param(0.5, "C: share of clients sampled each round",
                                   between(0, 1, "(]"))
    sampling: str = param(
        "uniform", "'uniform' (m = C*N each round) | 'poisson' (each w.p. C) | 'stratified' "
        "(quotas per bucket of sample count x availability class, least-selected clients "
        "first) | 'coverage' (from a random candidate set, each next client is the one whose "
        "labels the selection lacks most; the server learns every client's label histogram; "
        "refused with DP)")
    strata: int = param(3, "stratified: sample-count buckets (quantiles)", at_least(1))
    coverage_candidates: int = param(
        0, "coverage: random candidates per round (0 = 2m; N = all)",
        at_least(0, " (0 = twice the participants)"))
    min_samples: int = param(0, "clients with fewer local samples are skipped or run one epoch "
                             "(below_min)", at_least(0, " (0 = off)"))
    below_min: str = param("skip", "clients under min_samples: never sampled ('skip') or run "
                           "one epoch ('one_epoch')")
    local_epochs: int = param(2, "E: local epochs per round", at_least(1))
    adaptive_epochs: bool = param(
        False, "E_i = clip(round(E * sqrt(median n / n_i)), min_epochs, max_epochs)")
    min_epochs: int = param(1, "adaptive epochs: the fewest", at_least(1))
    max_epochs: int = param(4, "adaptive epochs: the most (>= min_epochs)", at_least(1))
    batch_size: int = param(32, "local batch size", at_least(1))
    drop_partial_batch: bool = param(
        False, "skip an epoch's last partial batch when a client has a full one (PyTorch's "
        "drop_last); False uses every sample every epoch, at the price of a few-sample step "
        "with full weight (docs/guide/methods.md: what it costs FedAvg on small clients)")
    augment: str = param(
        "none", "image augmentation inside the jitted local step: 'none' | 'crop_flip' (random "
        "crop, 4-pixel zero padding, horizontal flip) | 'flip_erase_crop' (the published pFedES "
        "code's: flip, random erasing, crop padded with the mean)")
    lr_local: float = param(
        0.01, "local SGD learning rate; 0.01 was the best of {0.01, 0.02, 0.05, 0.1} for pFedES "
        "(docs/baselines_history.md); 0.05 diverged on a GPU (docs/performance.md)", above(0))
    local_momentum: float = param(0.9, "local SGD momentum (0 = plain SGD); never aggregated",
                                  between(0, 1, "[)"))
    reset_local_optimizer: bool = param(
        False, "methods whose clients keep a private model (`launch.methods` column 'private "
        "opt.'): False keeps its optimizer state (momentum) across rounds; True starts each "
        "round from a fresh one. The FedAvg family always starts fresh")
    allow_divergence: bool = param(
        False, "a NaN/Inf loss stops the run with diverged: true in summary.json and exit "
        "status 3; True keeps exit status 0 (e.g. inside a sweep that expects some to diverge)")
    allow_untrained: bool = param(
        False, "a run in which no participant's update ever reached the server stops with an "
        "error (exit 2); True accepts it")
    stop_at_plateau: bool = param(
        False, "stop once the evaluated mean personalized accuracy has stopped moving "
        "(fedjax_pfedes/engine/plateau.py): with k = plateau_window x the evaluations so far, "
        "the means of the last k and of the k before differ by < plateau_tolerance")
    plateau_window: float = param(0.2, "stop_at_plateau: window, a share of the evaluations",
                                  between(0, 0.5, "(]"))
    plateau_tolerance: float = param(0.005, "stop_at_plateau: accuracy difference that counts "
                                     "as no movement", above(0))
    plateau_min_evaluations: int = param(10, "stop_at_plateau: never before this many "
                                         "evaluations", at_least(2, integer=True))

    def check(self) -> None:
        if not 1 <= self.min_epochs <= self.max_epochs:
            raise ConfigError("config.train.min_epochs / max_epochs need 1 <= min_epochs <= "
                             f"max_epochs, got {self.min_epochs} / {self.max_epochs}")


@dataclasses.dataclass(frozen=True)
class EvalSection(Section):
    """`config.eval`: when and on what the clients' models are evaluated."""

    SECTION: ClassVar[str] = "eval"

    every: int = param(5, "evaluate every k rounds (and after the last)", at_least(1))
    global_test_samples: int = param(0, "0 = the whole global test set",
                                     at_least(0, " (0 = the whole global test set)"))
    global_every: int = param(
        1, "score the global test set at every k-th evaluation (every `eval.every` x k rounds; "
        "0 = only at the run's end) and always at the evaluation that ends the run: scoring "
        "every client's model on it can cost more than the rounds between evaluations, and "
        "no personalized figure, stop or verdict depends on it",
        at_least(0, " (0 = only at the run's end)"))
    after_training: bool = param(
        False, "True: every synchronous round also records "
        "`participants_accuracy_after_training`, the mean local-test accuracy of that round's "
        "participants right after their local training (the published pFedES code's protocol)")
    clients: int = param(
        0, "clients evaluated (0 = all; else a seeded random set of that many, the same each "
        "time): with 10,000+ clients evaluating everyone costs more than training",
        at_least(0, " (0 = every client)"))


@dataclasses.dataclass(frozen=True)
class CheckpointSection(Section):
    """`config.checkpoint`: orbax checkpoints of the whole simulation; launch.main resumes from
    the latest one."""

    SECTION: ClassVar[str] = "checkpoint"

    every: int = param(5, "save every k rounds and after the last (0 = off)",
                       at_least(0, " (0 = off)"))
    max_to_keep: int = param(2, "checkpoints kept", at_least(1))
    resume: bool = param(True, "resume from <workdir>/checkpoints if there is one")


@dataclasses.dataclass(frozen=True)
class MonitorSection(Section):
    """`config.monitor`: per-round monitoring (docs/guide/monitoring.md)."""

    SECTION: ClassVar[str] = "monitor"

    aggregation_loss: bool = param(
        True, "participants' local-test loss before/after the server step; under pFedES also "
        "each client's alignment loss at the start and end of its update")
    client_report: bool = param(True, "<workdir>/clients.jsonl: one line per participant")
    tensorboard: bool = param(True, "<workdir>/tensorboard event files")
