"""Small federated fixtures shared by the tests: a 5-feature tabular spec, FedAvg-family configs,
one client's padded arrays, and small end-to-end run configs."""

import os
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np

from configs import quickstart, tabular_hetero
from fedjax_pfedes.algorithms.fedavg import FedAvgConfig
from fedjax_pfedes.config.defaults import SecAggSection, UploadSection
from fedjax_pfedes.data.federated import ClientArrays
from fedjax_pfedes.data.spec import InputSpec
from fedjax_pfedes.upload.pipeline import CohortUploads, UploadPipeline
from fedjax_pfedes.upload.settings import PipelineConfig

ROOT = pathlib.Path(__file__).parents[1]
# PYTHONPATH of a child process that imports the repository and the tests' helpers (the same
# folders as `pythonpath` in pyproject.toml, which reaches only pytest's own process).
CHILD_PATH = os.pathsep.join(str(p) for p in (ROOT, ROOT / "tests", ROOT / "tests" / "execution"))

SPEC = InputSpec("tabular", (5,), "float32", (0.0,) * 5, (1.0,) * 5)


def fedavg_config(**kw) -> FedAvgConfig:
    base = dict(num_classes=3, input_spec=SPEC, lr_local=0.1, local_momentum=0.0, batch_size=8,
                local_epochs=1)
    base.update(kw)
    return FedAvgConfig(**base)


def client_data(n=8, capacity=8, seed=0) -> ClientArrays:
    """n real rows of Gaussian features and labels in {0, 1, 2}, padded to `capacity`."""
    rng = np.random.default_rng(seed)
    x = np.zeros((capacity, 5), np.float32)
    y = np.zeros((capacity,), np.int32)
    x[:n] = rng.normal(size=(n, 5))
    y[:n] = rng.integers(0, 3, n)
    return ClientArrays(jnp.asarray(x), jnp.asarray(y), jnp.int32(n))


def small_config(strategy="loop"):
    config = quickstart.get_config()
    config.data.name = "digits"
    config.data.num_clients = 6
    config.data.min_samples_per_client = 30
    config.data.dirichlet_alpha = 0.5
    config.clients.architectures = "mlp,convnet3"
    config.proxy_arch = "proxy_mlp"
    config.proxy_dim = 16
    config.train.rounds = 4
    config.train.local_epochs = 2
    config.train.lr_local = 0.1
    config.eval.every = 2
    config.execution.strategy = strategy
    # pinned, like the strategy: these tests compare runs bit for bit (the 'auto' default's own
    # tests are in tests/execution/test_cost_model.py and tests/io/test_checkpoint.py)
    config.execution.cpu_kernels = "xla"
    return config


def tiny_config(rounds=4, num_clients=8):
    """`small_config` with one MLP cohort, no checkpoints: runs are dominated by compilation."""
    config = small_config()
    config.clients.architectures = "mlp"
    config.data.num_clients = num_clients
    config.train.rounds = rounds
    config.checkpoint.every = 0
    return config


def upload_cohort(uploads, template, sizes, valid=None, ids=None) -> CohortUploads:
    """One cohort's round of stacked uploads for the upload pipeline's tests (all valid, client
    ids 0..n-1 unless given)."""
    n = len(sizes)
    valid = np.ones(n, bool) if valid is None else np.asarray(valid)
    ids = np.arange(n) if ids is None else np.asarray(ids)
    return CohortUploads(uploads, template, jnp.asarray(sizes, jnp.float32), valid, ids,
                         np.arange(n, dtype=np.int32))


def pipeline_config(dp=None, secagg=None, norm_keys=(), **upload_fields) -> PipelineConfig:
    """`PipelineConfig` with `config.upload`'s fields `upload_fields`, client-level DP `dp` (a
    `privacy.ClientDPConfig`) and secure aggregation `secagg` (True: at its defaults, or a
    `SecAggSection`); the model ratio in force is the config's (0 when it is left to the
    method)."""
    if secagg is True:
        secagg = SecAggSection(enabled=True)
    ratio = max(upload_fields.get("norm_outlier_model_ratio", 0.0), 0.0)
    return PipelineConfig(upload=UploadSection(**upload_fields), dp=dp, secagg=secagg or None,
                          norm_keys=norm_keys, norm_model_ratio=ratio)


def upload_pipeline(aggregation="shared", **kw) -> UploadPipeline:
    """An upload pipeline over 10 clients, 4 a round for 5 rounds, with `pipeline_config(**kw)`."""
    return UploadPipeline(pipeline_config(**kw), aggregation, "test", num_clients=10,
                          expected_participants=4, clients_per_round=4, rounds=5)


def client_dp_config(rounds: int, every: int, noise_multiplier: float = 1.1):
    """tabular_hetero (10 clients, 5 per round) with client-level DP at sigma, uniform weights."""
    config = tabular_hetero.get_config()
    config.train.rounds = rounds
    config.eval.every = every
    config.upload.weighting = "uniform"
    config.dp.enabled = True
    config.dp.noise_multiplier = noise_multiplier
    return config


def launch_error_line(program: str, args: list[str], cwd=ROOT, absent: tuple[str, ...] = ()
                      ) -> str:
    """Runs `python -m launch.<program> <args>`, which must refuse its input: exit status 2, one
    line starting 'error: ' on stderr, no traceback and none of the texts `absent` anywhere on
    stderr. Returns that line."""
    proc = subprocess.run([sys.executable, "-m", f"launch.{program}", *args], cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not [text for text in absent if text in proc.stderr], proc.stderr[-2000:]
    return errors[0]
