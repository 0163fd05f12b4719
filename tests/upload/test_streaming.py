"""The 'scan' strategy's streaming aggregation (`fedjax_pfedes/upload/streaming.py`): uploads summed
as they are made, equal to the weighted mean of the accepted stacked uploads, and trained again
stacked in a round whose norm rule rejects one already summed; the methods that claim a
weighted-mean server step; the engine's streamed round against the loop's."""

import json

import fl_helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_pfedes.algorithms import registry
from fedjax_pfedes.engine.loop import run_experiment
from fedjax_pfedes.execution import runners
from fedjax_pfedes.execution.strategies import protocol
from fedjax_pfedes.upload import streaming


def _uploads(n=9, seed=0):
    """n uploads of a two-leaf model, their sizes and per-client facts (plain numpy)."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(n, 4, 3)).astype(np.float32)
    b = rng.normal(size=(n, 3)).astype(np.float32)
    sizes = rng.integers(5, 40, n).astype(np.int32)
    return w, b, sizes


def _stream(reducer, w, b, sizes, finite, valid):
    """Adds the uploads one at a time in a jitted `lax.scan`, like the 'scan' runner."""
    norms = np.sqrt((w.astype(np.float64) ** 2).sum((1, 2)) + (b.astype(np.float64) ** 2)
                    .sum(1)).astype(np.float32)

    @jax.jit
    def run(w, b, sizes, norms, finite, valid):
        def body(carry, xs):
            wi, bi, size, norm, fin, slot, ok = xs
            return reducer.add(carry, {"w": wi, "b": bi}, {"finite": fin, "norm": norm}, size,
                               slot, ok, template), None
        template = {"w": jnp.zeros((4, 3)), "b": jnp.zeros(3)}
        start = reducer.init(template)
        slots = jnp.arange(len(sizes), dtype=jnp.int32)
        return jax.lax.scan(body, start, (w, b, sizes, norms, finite, slots, valid))[0]

    return run(w, b, sizes, norms, finite, valid), norms


def _by_hand(w, b, sizes, accepted):
    """The sample-weighted mean of the accepted uploads, in float64 numpy."""
    weight = sizes.astype(np.float64) * accepted
    return ((weight[:, None, None] * w).sum(0) / weight.sum(),
            (weight[:, None] * b).sum(0) / weight.sum(), weight.sum())


def test_the_streamed_mean_is_the_mean_of_the_finite_uploads():
    """A non-finite upload never enters the sum; a padded slot neither; the mean and total
    weight are the by-hand ones of the rest."""
    w, b, sizes = _uploads()
    w[4] *= 1e3  # large, but finite: in the sum
    w[6, 0, 0] = np.nan
    finite = np.isfinite(w).all((1, 2))
    valid = np.ones(len(sizes), bool)
    valid[8] = False  # a padded slot
    carry, norms = _stream(streaming.mean_reducer(True), w, b, sizes, finite, valid)
    mean, total = streaming.finalize(carry)
    want_w, want_b, want_total = _by_hand(np.nan_to_num(w), b, sizes, valid & finite)
    np.testing.assert_allclose(mean["w"][0], want_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(mean["b"][0], want_b, rtol=1e-5, atol=1e-6)
    assert float(total[0]) == want_total


def test_the_clipped_sum_is_the_sum_of_the_clipped_updates_by_hand():
    """Under client-level DP each update (upload - template) is clipped to C and summed, in
    numpy: a non-finite update and a padded slot are left out, and the count says how many
    entered."""
    w, b, sizes = _uploads()
    w[2] *= 50.0  # clipped hard
    w[6, 0, 0] = np.inf
    finite = np.isfinite(w).all((1, 2))
    valid = np.ones(len(sizes), bool)
    valid[8] = False
    carry, norms = _stream(streaming.clipped_sum_reducer(1.5, True), w, b, sizes, finite, valid)
    keep = valid & finite
    scale = np.minimum(1.0, 1.5 / norms.astype(np.float64))[keep]
    want_w = (w[keep].astype(np.float64) * scale[:, None, None]).sum(0)
    want_b = (b[keep].astype(np.float64) * scale[:, None]).sum(0)
    np.testing.assert_allclose(carry[streaming.SUM]["w"], want_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(carry[streaming.SUM]["b"], want_b, rtol=1e-5, atol=1e-6)
    assert float(carry[streaming.COUNT]) == keep.sum()


def _stream_lanes(reducer, w, b, sizes, finite, valid, lanes=2):
    """The uploads streamed in `lanes` interleaved lanes (positions t, t + lanes, ...), as the
    'scan' strategy on several host threads does, each lane naming its uploads by their
    position in the whole bucket; the lanes' carries merged."""
    norms = np.sqrt((w.astype(np.float64) ** 2).sum((1, 2)) + (b.astype(np.float64) ** 2)
                    .sum(1)).astype(np.float32)
    template = {"w": jnp.zeros((4, 3)), "b": jnp.zeros(3)}

    @jax.jit
    def run(w, b, sizes, norms, finite, positions, valid):
        def body(carry, xs):
            wi, bi, size, norm, fin, position, ok = xs
            return reducer.add(carry, {"w": wi, "b": bi}, {"finite": fin, "norm": norm}, size,
                               position, ok, template), None
        return jax.lax.scan(body, reducer.init(template),
                            (w, b, sizes, norms, finite, positions, valid))[0]

    carries = []
    for t in range(lanes):
        p = np.arange(t, len(sizes), lanes)
        carries.append(run(w[p], b[p], sizes[p], norms[p], finite[p], p.astype(np.int32),
                           valid[p]))
    return reducer.merge(carries), norms


def test_lanes_merged_give_the_mean_of_the_finite_uploads():
    """Two lanes, each streaming half of the uploads, merged: the non-finite upload and the
    padded slot never entered; the mean is the by-hand mean of the rest."""
    w, b, sizes = _uploads(n=11)
    w[6, 0, 0] = np.nan
    finite = np.isfinite(w).all((1, 2))
    valid = np.ones(len(sizes), bool)
    valid[10] = False
    carry, _ = _stream_lanes(streaming.mean_reducer(True), w, b, sizes, finite, valid)
    mean, total = streaming.finalize(carry)
    want_w, want_b, want_total = _by_hand(np.nan_to_num(w), b, sizes, valid & finite)
    np.testing.assert_allclose(mean["w"][0], want_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(mean["b"][0], want_b, rtol=1e-5, atol=1e-6)
    assert float(total[0]) == pytest.approx(want_total)


def test_lanes_merged_give_the_clipped_sum_of_one_stream():
    """Under client-level DP the lanes' clipped sums and counts add up to one stream's."""
    w, b, sizes = _uploads()
    w[2] *= 50.0
    finite, valid = np.ones(len(sizes), bool), np.ones(len(sizes), bool)
    reducer = streaming.clipped_sum_reducer(1.5, True)
    one, _ = _stream(reducer, w, b, sizes, finite, valid)
    merged, _ = _stream_lanes(reducer, w, b, sizes, finite, valid, lanes=3)
    for leaf in ("w", "b"):
        np.testing.assert_allclose(merged[streaming.SUM][leaf], one[streaming.SUM][leaf],
                                   rtol=1e-5, atol=1e-6)
    assert float(merged[streaming.COUNT]) == float(one[streaming.COUNT]) == len(sizes)


@pytest.mark.parametrize("secagg", [False, True])
def test_a_scope_with_one_streamed_and_one_stacked_cohort_releases_the_same_mean(secagg):
    """Under `execution.strategy='auto'` one cohort of a shared scope may stream its clipped
    sum while another stacks its uploads: the released mean is the one the all-stacked round
    releases (same noise draw), the streamed cohort's group one row of it."""
    import fl_helpers

    from fedjax_pfedes.config.defaults import SecAggSection
    from fedjax_pfedes.upload import privacy
    from fedjax_pfedes.upload.pipeline import CohortUploads
    dp = privacy.ClientDPConfig(clip_norm=1.0, noise_multiplier=0.7)
    kw = dict(secagg=SecAggSection(enabled=True, simulation="aggregate")) if secagg else {}
    rng = np.random.default_rng(5)
    template = {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)}
    ups = {a: {"w": jnp.asarray(rng.normal(size=(5, 4, 3)), jnp.float32) + template["w"]}
           for a in ("a", "b")}

    def stacked(a):
        return fl_helpers.upload_cohort(ups[a], template, [1.0] * 5, valid=[1, 1, 1, 0, 1],
                                        ids=np.arange(5) + (5 if a == "b" else 0))

    def streamed(a):
        c = stacked(a)
        delta = np.asarray(ups[a]["w"], np.float64) - np.asarray(template["w"], np.float64)
        norms = np.linalg.norm(delta.reshape(5, -1), axis=1)
        clipped = delta * np.minimum(1.0, 1.0 / norms)[:, None, None]
        total = clipped[np.asarray(c.valid, bool)].sum(0)
        return CohortUploads(None, template, c.sizes, c.valid, c.client_ids, c.slots,
                             facts={"finite": np.ones(5, bool), "norm": norms.astype(np.float32)},
                             reduced={streaming.SUM: {"w": jnp.asarray(total, jnp.float32)},
                                      streaming.COUNT: jnp.float32(4)})

    out = []
    for cohorts in ({"a": stacked("a"), "b": stacked("b")},
                    {"a": streamed("a"), "b": stacked("b")}):
        pipe = fl_helpers.upload_pipeline(dp=dp, weighting="uniform", **kw)
        groups, _, report = pipe.process(0, cohorts, {"a": {}, "b": {}}, {"a": 5, "b": 5},
                                         jax.random.key(3))
        out.append((groups, report))
    (all_stacked, r0), (mixed, r1) = out
    assert mixed["a"][0]["w"].shape == (1, 4, 3) and float(mixed["a"][1][0]) == 4.0
    np.testing.assert_allclose(mixed["a"][0]["w"][0], all_stacked["a"][0]["w"][0], rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(mixed["b"][0]["w"], all_stacked["b"][0]["w"], rtol=1e-5,
                               atol=1e-6)
    assert r0.dp_noise_multiplier == r1.dp_noise_multiplier


@pytest.mark.slow  # two 3-round runs per setting
@pytest.mark.parametrize("secagg", [False, True])
def test_a_streamed_private_run_gives_the_loops_numbers(secagg, tmp_path, monkeypatch):
    """Client-level DP (central, or with secure aggregation simulated as 'aggregate'): the
    'scan' strategy sums the clipped updates in its carry and the aggregator adds the same
    noise draw to that sum as to the stacked clipped updates of 'loop': the same accuracies,
    losses, update norms, released noise multipliers and epsilon, up to float summation."""
    from fedjax_pfedes.upload import stages
    summed = []
    scope_sum = stages.RoundUploads.scope_sum
    monkeypatch.setattr(stages.RoundUploads, "scope_sum",
                        lambda self, scope: summed.append(1) or scope_sum(self, scope))
    runs = {}
    for strategy in ("loop", "scan"):
        config = fl_helpers.tiny_config(rounds=3)
        config.execution.strategy = strategy
        config.eval.every = 1
        config.upload.weighting = "uniform"
        config.dp.enabled, config.dp.noise_multiplier = True, 0.8
        config.secagg.enabled, config.secagg.simulation = secagg, "aggregate"
        run_experiment(config, str(tmp_path / strategy), show_progress=False)
        runs[strategy] = _metrics(tmp_path / strategy)
    for loop, scan in zip(runs["loop"], runs["scan"], strict=True):
        for key, value in loop.items():
            if key.endswith("_s") or not isinstance(value, float):
                assert key.endswith("_s") or scan[key] == value, key
                continue
            assert scan[key] == pytest.approx(value, rel=2e-4, abs=2e-5), key
    assert runs["scan"][-1]["dp_epsilon"] > 0
    assert len(summed) == 3  # every round of 'scan' streamed, none of 'loop'


@pytest.mark.parametrize("outlier", [False, True])
def test_a_summed_upload_the_norm_rule_rejects_makes_the_cohort_restack(outlier):
    """The pipeline takes a streamed cohort's sum as its mean while no stage rejects an upload
    it summed; when the norm rule rejects one (a 1e3 x outlier), it asks the cohort for its
    uploads stacked (`CohortUploads.restack`) and averages the accepted ones: both equal the
    by-hand mean of what was accepted (numpy), and the non-finite upload is left out either
    way."""
    from fedjax_pfedes.upload.pipeline import CohortUploads
    w, b, sizes = _uploads(n=9)
    if outlier:
        w[4] *= 1e3
    w[6, 0, 0] = np.nan
    finite = np.isfinite(w).all((1, 2))
    valid = np.ones(len(sizes), bool)
    valid[8] = False  # a padded slot
    carry, norms = _stream(streaming.mean_reducer(True), w, b, sizes, finite, valid)
    restacked = []

    def restack():
        restacked.append(1)
        return {"w": jnp.asarray(w), "b": jnp.asarray(b)}

    template = {"w": jnp.zeros((4, 3)), "b": jnp.zeros(3)}
    cohort = CohortUploads(None, template, jnp.asarray(sizes, jnp.float32), valid,
                           np.arange(9), np.arange(9, dtype=np.int32),
                           facts={"finite": finite, "norm": norms}, reduced=carry,
                           restack=restack)
    pipe = fl_helpers.upload_pipeline(aggregation="per_cohort", norm_outlier_factor=10.0,
                                      norm_outlier_z=0.0)
    groups, _, report = pipe.process(0, {"mlp": cohort}, {"mlp": {}}, {"mlp": 9},
                                     jax.random.key(0))
    accepted = valid & finite
    accepted[4] = not outlier
    assert len(restacked) == int(outlier)
    assert {r["client"] for r in report.rejections} == ({4, 6} if outlier else {6})
    uploads, weights = groups["mlp"]
    share = np.asarray(weights, np.float64) / np.asarray(weights, np.float64).sum()
    got_w = np.tensordot(share, np.asarray(uploads["w"], np.float64), 1)
    got_b = np.tensordot(share, np.asarray(uploads["b"], np.float64), 1)
    want_w, want_b, _ = _by_hand(np.nan_to_num(w), b, sizes, accepted)
    np.testing.assert_allclose(got_w, want_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_b, want_b, rtol=1e-5, atol=1e-6)


def test_a_reducer_needs_the_scan_strategy():
    from test_execution import _setup
    _, program, data, states, server = _setup("mlp")
    runner = runners.make_runner(program, "vmap")
    bcast = protocol.Finishing(server.proxy_params, server.proxy_params,
                                lambda u, t: {}, streaming.mean_reducer(True))
    with pytest.raises(ValueError, match="'scan' strategy"):
        runner.update(bcast, states, data, np.array([0, 1], np.int32),
                      jax.random.split(jax.random.key(0), 2))


@pytest.mark.parametrize("name", [n for n in registry.names()
                                  if n not in ("standalone",)])
def test_a_mean_server_step_takes_its_groups_reduced_to_one_row(name):
    """Conformance of `Algorithm.mean_server_step`: where a method claims it, its server step
    on each cohort's stacked uploads equals its step on the groups reduced to (weighted mean,
    total weight). Methods that do not claim it are skipped (the 'scan' strategy stacks)."""
    from fedjax_pfedes.engine.build import build_context, build_federated_data
    config = fl_helpers.tiny_config(rounds=1, num_clients=6)
    config.algorithm = name
    ctx, state = build_context(config, build_federated_data(config))
    alg = ctx.algorithm
    if not alg.mean_server_step:
        pytest.skip(f"{name} does not claim a weighted-mean server step")
    rng = np.random.default_rng(1)
    groups, reduced = {}, {}
    for cohort in ctx.cohorts:
        template = alg.upload_template(state.server, cohort.arch)
        stacked = jax.tree.map(lambda t: jnp.asarray(
            np.asarray(t)[None] + rng.normal(size=(3,) + np.shape(t)).astype(np.float32)),
            template)
        weights = jnp.asarray([3.0, 0.0, 7.0])
        groups[cohort.arch] = (stacked, weights)
        share = weights / weights.sum()
        mean = jax.tree.map(lambda s, share=share: jnp.tensordot(share, s, axes=1)[None], stacked)
        reduced[cohort.arch] = (mean, weights.sum()[None])
    full = alg.server_update(state.server, groups)
    short = alg.server_update(state.server, reduced)
    jax.tree.map(lambda a, c: np.testing.assert_allclose(a, c, rtol=2e-5, atol=2e-6),
                 full, short)


def _metrics(workdir):
    return [json.loads(line) for line in open(f"{workdir}/metrics.jsonl")]


@pytest.mark.slow  # two 3-round runs per method
@pytest.mark.parametrize("name,factor", [("fedavg", 10.0), ("pfedes", 1.1)])
def test_a_streamed_scan_run_gives_the_loops_numbers(name, factor, tmp_path, monkeypatch):
    """A whole run with the 'scan' strategy, which streams these methods' uploads (client
    states on the device or offloaded to the host), against the 'loop' strategy, which stacks
    them: the same accuracies, losses, update norms and rejections (factor 1.1 makes the norm
    rule reject some uploads the scan had summed: those rounds train the cohort again
    stacked, from its rows before the round)."""
    from fedjax_pfedes.engine import rounds
    streamed, restacked = [], []
    finalize = streaming.finalize
    monkeypatch.setattr(streaming, "finalize", lambda *a: streamed.append(1) or finalize(*a))
    restacker = rounds._restacker

    def counted(*a):
        restack = restacker(*a)
        return lambda after: restacked.append(1) or restack(after)

    monkeypatch.setattr(rounds, "_restacker", counted)
    runs = {}
    for variant in ("loop", "scan", "scan/offload", "scan:1"):
        strategy, _, states = variant.partition("/")
        strategy, _, threads = strategy.partition(":")
        config = fl_helpers.tiny_config(rounds=3)
        config.algorithm = name
        config.execution.strategy = strategy
        config.execution.loop_threads = int(threads or 2)  # 'scan': two lanes, or one
        config.execution.client_states = states or "device"
        config.upload.norm_outlier_factor = factor
        config.upload.norm_outlier_z = 0.0  # the factor alone: rejections
        config.upload.norm_outlier_model_ratio = 0.0
        config.eval.every = 1
        workdir = tmp_path / variant.replace("/", "_").replace(":", "_")
        run_experiment(config, str(workdir), show_progress=False)
        runs[variant] = _metrics(workdir)
    for scanned in ("scan", "scan/offload", "scan:1"):  # offloaded: slots are compacted
        for loop, scan in zip(runs["loop"], runs[scanned], strict=True):
            for key, value in loop.items():
                if key.endswith("_s") or not isinstance(value, float):
                    assert key.endswith("_s") or scan[key] == value, key
                    continue
                assert scan[key] == pytest.approx(value, rel=2e-4, abs=2e-5), key
    # one streamed cohort, every round of each 'scan', none of 'loop': its sum as the mean, or
    # restacked where the rule rejected an upload
    assert len(streamed) + len(restacked) == 9
    if factor < 2:
        assert sum(r["uploads_rejected"] for r in runs["scan"]) > 0 and restacked
    else:
        assert not restacked


def _last_round_counts(name: str, events: list) -> dict[int, int]:
    """{clients: entries appended to `events` during the third 'scan' round of `name`} for 8
    and 32 clients (4 and 16 participants); `name` '<method>+private' adds client-level DP
    with secure aggregation simulated as 'aggregate'."""
    from fedjax_pfedes.engine import rounds
    from fedjax_pfedes.engine.build import build_context, build_federated_data
    name, _, private = name.partition("+")
    counts = {}
    for clients in (8, 32):
        config = fl_helpers.tiny_config(rounds=3, num_clients=clients)
        config.algorithm = name
        if private:
            config.upload.weighting = "uniform"
            config.dp.enabled = config.secagg.enabled = True
            config.secagg.simulation = "aggregate"
        config.execution.strategy = "scan"
        ctx, state = build_context(config, build_federated_data(config))
        for r in range(3):
            events.clear()
            state, record, _, _ = rounds.sync_round(ctx, state, r)
        counts[clients] = len(events)
        assert record["participants"] == clients // 2
    return counts


@pytest.mark.parametrize("name", ["fedavg", "pfedes", "pfedes+private"])
def test_a_rounds_host_reads_do_not_grow_with_its_participants(name, monkeypatch):
    """The structure of a round, not its time: with the 'scan' strategy the values the host
    reads from the device in one round (every `device_get`, `np.asarray` or `float` of a
    device array goes through `ArrayImpl._value`) are as many with 16 participants as with 4.
    (On CPU `jax.transfer_guard_device_to_host` does not see these reads, so they are counted
    here instead.)"""
    from jax._src import array as jax_array
    original = jax_array.ArrayImpl._value
    reads = []
    monkeypatch.setattr(jax_array.ArrayImpl, "_value", property(
        lambda self: reads.append(1) or original.fget(self)))
    counts = _last_round_counts(name, reads)
    assert counts[8] == counts[32], counts


@pytest.mark.parametrize("name", ["fedavg", "pfedes", "pfedes+private"])
def test_a_rounds_dispatched_programs_do_not_grow_with_its_participants(name, monkeypatch):
    """The structure of a round: with the 'scan' strategy the compiled programs a round
    dispatches (jitted calls and eager operations alike; each runs through
    `ExecuteReplicated.__call__` once JAX's C++ fast path is off) are as many with 16
    participants as with 4, so the host's dispatch work does not grow with them."""
    from jax._src import pjit
    from jax._src.interpreters import pxla
    jax.clear_caches()  # no program keeps a fast path from an earlier test
    monkeypatch.setattr(pjit, "_get_fastpath_data", lambda *a, **k: None)
    original = pxla.ExecuteReplicated.__call__
    runs = []
    monkeypatch.setattr(pxla.ExecuteReplicated, "__call__",
                        lambda self, *a, **k: runs.append(1) or original(self, *a, **k))
    counts = _last_round_counts(name, runs)
    assert counts[8] == counts[32] > 0, counts
