"""A malicious client runs its own code: the upload pipeline's client-side stages (clipping,
compression, the range check before masking, its share of the DP noise) do not act on what it
sends; only what the server enforces on what it receives does (A01-A05 of docs/threat_model.md).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fl_helpers import pipeline_config

from fedjax_pfedes.upload import privacy
from fedjax_pfedes.upload.pipeline import CohortUploads, UploadPipeline

N = 4  # participants; client 0 attacks


def _cohort(values, rogue):
    uploads = {"w": jnp.asarray(values, jnp.float32)}
    n = len(values)
    return CohortUploads(uploads, {"w": jnp.zeros(len(values[0]))}, jnp.ones(n, jnp.float32),
                         np.ones(n, bool), np.arange(n), np.arange(n, dtype=np.int32),
                         np.asarray(rogue, bool))


def _aggregate(rogue, dp_sigma=None, secagg=False, clip=1.0, values=None):
    dp = (privacy.ClientDPConfig(clip_norm=clip, noise_multiplier=dp_sigma)
          if dp_sigma is not None else None)
    cfg = pipeline_config(weighting="uniform", dp=dp, secagg=secagg, norm_outlier_factor=0.0)
    pipe = UploadPipeline(cfg, "shared", "test", num_clients=N, expected_participants=N,
                          clients_per_round=N, rounds=3)
    values = values if values is not None else [[1e4] * 3] + [[0.1] * 3] * (N - 1)
    groups, _, report = pipe.process(0, {"a": _cohort(values, rogue)}, {"a": {}}, {"a": N},
                                     jax.random.key(0))
    return np.asarray(groups["a"][0]["w"][0]), report, pipe


def test_A01_central_dp_the_server_clips_what_a_rogue_client_sends():
    """Without secure aggregation the server sees each upload and clips it itself."""
    honest, _, _ = _aggregate([False] * N, dp_sigma=0.0)
    rogue, _, _ = _aggregate([True] + [False] * (N - 1), dp_sigma=0.0)
    np.testing.assert_allclose(rogue, honest, rtol=1e-6)
    assert np.abs(rogue).max() <= 1.0  # (C + 3 x 0.1 sqrt(3)) / 4 per coordinate at most


def test_A02_secure_aggregation_with_dp_sums_a_rogue_client_unclipped():
    """Distributed DP: clipping is the client's own code. The rogue 1e4 enters the sum as is."""
    honest, _, _ = _aggregate([False] * N, dp_sigma=0.0, secagg=True)
    rogue, report, _ = _aggregate([True] + [False] * (N - 1), dp_sigma=0.0, secagg=True)
    assert np.abs(honest).max() < 1.0
    np.testing.assert_allclose(rogue, (1e4 + 3 * 0.1) / N, rtol=1e-6)
    assert report.rejected == 0  # the server cannot tell


def test_A03_a_rogue_client_skips_the_range_check_and_wraps_around_the_ring():
    """Under secure aggregation a value beyond the fixed-point range is not rejected when the
    client skips its own check: it wraps modulo 2^ring_bits and corrupts the sum."""
    huge = [[1e12] * 3] + [[0.1] * 3] * (N - 1)
    checked, report_checked, _ = _aggregate([False] * N, secagg=True, values=huge)
    assert report_checked.rejected == 1  # an honest client's check rejects itself
    np.testing.assert_allclose(checked, 0.1 * 3 / 3, rtol=1e-5)  # the rest, weight-normalized
    rogue, report, _ = _aggregate([True] + [False] * (N - 1), secagg=True, values=huge)
    assert report.rejected == 0
    assert not np.allclose(rogue, checked, rtol=1e-3)  # wrapped garbage, not 1e12 / 4 either
    assert not np.allclose(rogue, (1e12 + 0.3) / N, rtol=1e-3)


def test_A04_a_rogue_client_adds_no_noise_and_the_accountant_counts_only_honest_shares():
    _, report, _ = _aggregate([True] + [False] * (N - 1), dp_sigma=1.2, secagg=True)
    assert report.dp_noise_multiplier == pytest.approx(1.2 * math.sqrt((N - 1) / N))
    _, honest, _ = _aggregate([False] * N, dp_sigma=1.2, secagg=True)
    assert honest.dp_noise_multiplier == pytest.approx(1.2)


def test_A05_without_secure_aggregation_the_server_checks_a_rogue_nan_itself():
    nan = [[float("nan")] * 3] + [[0.1] * 3] * (N - 1)
    agg, report, _ = _aggregate([True] + [False] * (N - 1), values=nan)
    assert report.rejected == 1 and np.isfinite(agg).all()
    agg, report, _ = _aggregate([True] + [False] * (N - 1), values=nan, secagg=True)
    # No fixed-point form for NaN: the rogue vector lands as 0 and nothing rejects it.
    assert report.rejected == 0 and np.isfinite(agg).all()
