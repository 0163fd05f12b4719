"""vmap, loop and scan execution give the same numbers; padding and non-participants have no effect;
nothing compiles again after the first round."""

import dataclasses
import re
import threading

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_pfedes.algorithms.pfedes import PFedESConfig, pfedes
from fedjax_pfedes.data.federated import stack_clients
from fedjax_pfedes.data.spec import InputSpec
from fedjax_pfedes.execution import host_threads, kernels, runners, slot_rows
from fedjax_pfedes.execution.strategies import protocol
from fedjax_pfedes.models import layers


def _setup(arch, num_clients=4):
    spec = InputSpec("image", (8, 8, 1), "float32", (0.3,), (0.3,))
    cfg = PFedESConfig(num_classes=10, input_spec=spec, proxy_dim=8, proxy_arch="proxy_cnn",
                       batch_size=8, local_epochs=2, lr_local=0.05, local_momentum=0.5)
    alg = pfedes(cfg)
    rng = np.random.default_rng(0)
    sizes = ([13, 5, 20, 9, 11] * 2)[:num_clients]
    x = rng.uniform(size=(sum(sizes), 8, 8, 1)).astype(np.float32)
    y = rng.integers(0, 10, sum(sizes)).astype(np.int32)
    idx = np.split(np.arange(sum(sizes)), np.cumsum(sizes)[:-1])
    data = jax.device_put(stack_clients(x, y, idx))
    program = alg.cohort_program(arch)
    states = jax.vmap(program.init_client)(jax.random.split(jax.random.key(0), num_clients))
    server = alg.init_server(jax.random.key(1))
    return alg, program, data, states, server


def _copy(tree):
    return jax.tree.map(jnp.array, tree)


def _counting_runner(program, field: str, strategy: str):
    """(runner of `program` whose function `field` counts its traces, the list of traces);
    `strategy` 'loop:T' is the loop on T host threads."""
    traces = []
    original = getattr(program, field)

    def counted(*args):
        traces.append(1)
        return original(*args)

    name, _, threads = strategy.partition(":")
    runner = runners.make_runner(dataclasses.replace(program, **{field: counted}), name,
                                   loop_threads=int(threads or 1))
    return runner, traces


@pytest.mark.slow  # compiles both strategies: ~25 s
@pytest.mark.parametrize("arch", ["mlp", "convnet3"])
def test_vmap_and_loop_give_the_same_round(arch):
    _, program, data, states, server = _setup(arch)
    slots = np.array([2, 0, 4, 4], np.int32)  # clients 2 and 0; two padded slots (index 4)
    keys = jax.random.split(jax.random.key(7), 4)
    results = {}
    for strategy in ("vmap", "loop"):
        runner = runners.make_runner(program, strategy)
        results[strategy] = runner.update(server.proxy_params, _copy(states), data, slots, keys)
    (up_v, st_v, m_v), (up_l, st_l, m_l) = results["vmap"], results["loop"]
    chex.assert_trees_all_close(up_v, up_l, rtol=2e-4, atol=2e-5)
    chex.assert_trees_all_close(st_v.params, st_l.params, rtol=2e-4, atol=2e-5)
    chex.assert_trees_all_close(m_v, m_l, rtol=2e-4, atol=2e-5)
    for tree in (up_v, up_l):  # padded slots upload zeros
        assert all(float(jnp.abs(leaf[2:]).max()) == 0.0 for leaf in jax.tree.leaves(tree))
    for st in (st_v, st_l):  # clients 1 and 3 did not take part: unchanged
        for i in (1, 3):
            chex.assert_trees_all_equal(jax.tree.map(lambda a, i=i: a[i], st.params),
                                        jax.tree.map(lambda a, i=i: a[i], states.params))
    ev_v = runners.make_runner(program, "vmap").evaluate(server.proxy_params, st_v, data,
                                                           data.x[0], data.y[0])
    ev_l = runners.make_runner(program, "loop").evaluate(server.proxy_params, st_v, data,
                                                           data.x[0], data.y[0])
    chex.assert_trees_all_close(ev_v, ev_l, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 3])
def test_scan_gives_the_loops_round(chunk):
    """'scan' (one client, or a vmapped chunk of 3, per iteration of one compiled scan) equals
    'loop' on uploads, states, metrics and evaluation; padded slots upload zeros and write
    nothing; non-participants keep their states; a chunk wider than the bucket works."""
    _, program, data, states, server = _setup("mlp")
    slots = np.array([2, 0, 4, 4], np.int32)  # clients 2 and 0; two padded slots (index 4)
    keys = jax.random.split(jax.random.key(7), 4)
    loop = runners.make_runner(program, "loop")
    scan = runners.make_runner(program, "scan", scan_chunk=chunk)
    up_l, st_l, m_l = loop.update(server.proxy_params, _copy(states), data, slots, keys)
    up_s, st_s, m_s = scan.update(server.proxy_params, _copy(states), data, slots, keys)
    chex.assert_trees_all_close(up_s, up_l, rtol=2e-4, atol=2e-5)
    chex.assert_trees_all_close(st_s, st_l, rtol=2e-4, atol=2e-5)
    chex.assert_trees_all_close(m_s, m_l, rtol=2e-4, atol=2e-5)
    assert all(float(jnp.abs(leaf[2:]).max()) == 0.0 for leaf in jax.tree.leaves(up_s))
    for i in (1, 3):
        chex.assert_trees_all_equal(jax.tree.map(lambda a, i=i: a[i], st_s),
                                    jax.tree.map(lambda a, i=i: a[i], states))
    steps = np.asarray(m_s["local_steps"])[:2]
    assert scan.computed_steps(steps, 4) >= steps.sum()
    chex.assert_trees_all_close(
        scan.evaluate(server.proxy_params, st_l, data, data.x[0], data.y[0]),
        loop.evaluate(server.proxy_params, st_l, data, data.x[0], data.y[0]),
        rtol=1e-4, atol=1e-5)
    wide = runners.make_runner(program, "scan", scan_chunk=8)
    chex.assert_trees_all_close(wide.update(server.proxy_params, _copy(states), data, slots,
                                            keys)[0], up_l, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("slots", [[2, 0, 4, 4], [3, 0, 2]])
def test_scan_lanes_give_one_scans_round_bit_for_bit(slots):
    """'scan' on two host threads (two lanes of participants, each its own scanned call)
    gives one scan's uploads, states and metrics exactly, for an even bucket with padded
    slots and an odd one (a lane padded); a second round runs the lanes at once; a lane
    budget too small for the stacked new state rows runs one scan."""
    _, program, data, states, server = _setup("mlp")
    slots = np.array(slots, np.int32)
    keys = jax.random.split(jax.random.key(7), len(slots))
    lane_threads = lambda: sum(t.name.startswith("scan_lane")  # noqa: E731
                               for t in threading.enumerate())
    want = runners.make_runner(program, "scan", loop_threads=1).update(
        server.proxy_params, _copy(states), data, slots, keys)
    before = lane_threads()
    narrow = runners.make_runner(program, "scan", loop_threads=2, eval_memory_budget_gb=1e-9)
    for _ in range(2):
        chex.assert_trees_all_equal(
            narrow.update(server.proxy_params, _copy(states), data, slots, keys), want)
    assert lane_threads() == before  # the stacked rows do not fit: one scan
    lanes = runners.make_runner(program, "scan", loop_threads=2)
    for _ in range(2):  # the first call compiles on one thread; the second runs both lanes
        chex.assert_trees_all_equal(
            lanes.update(server.proxy_params, _copy(states), data, slots, keys), want)
    assert lane_threads() > before


@pytest.mark.parametrize("strategy", ["loop", "vmap", "scan"])
def test_a_finishing_broadcast_adds_the_per_client_facts_and_changes_nothing_else(strategy):
    """`execution.Finishing`: the same uploads, states and metrics as the plain broadcast, plus
    `fn(upload, operand)` per slot, equal to the same function applied to the stacked uploads
    afterwards (zeros in padded slots; a bool stays a bool), and the plain call afterwards
    still works (the loop's output buffers are kept per kind)."""
    _, program, data, states, server = _setup("mlp")
    slots = np.array([2, 0, 4, 4], np.int32)
    keys = jax.random.split(jax.random.key(7), 4)
    runner = runners.make_runner(program, strategy)
    template = server.proxy_params

    def fn(upload, operand):
        delta = jax.tree.map(jnp.subtract, upload, operand)
        return {"sq": sum(jnp.sum(d ** 2) for d in jax.tree.leaves(delta)),
                "finite": jnp.all(jnp.stack([jnp.all(jnp.isfinite(d))
                                             for d in jax.tree.leaves(delta)]))}

    up_p, st_p, m_p = runner.update(server.proxy_params, _copy(states), data, slots, keys)
    up_f, st_f, m_f = runner.update(protocol.Finishing(server.proxy_params, template, fn),
                                    _copy(states), data, slots, keys)
    facts = m_f.pop(protocol.UPLOAD_FACTS)
    chex.assert_trees_all_equal(up_f, up_p)
    chex.assert_trees_all_equal(st_f, st_p)
    chex.assert_trees_all_equal(m_f, m_p)
    by_hand = [fn(jax.tree.map(lambda a, j=j: a[j], up_p), template) for j in range(2)]
    np.testing.assert_allclose(np.asarray(facts["sq"])[:2], [float(h["sq"]) for h in by_hand],
                               rtol=1e-5)
    assert float(facts["sq"][0]) > 0 and np.asarray(facts["sq"])[2:].tolist() == [0.0, 0.0]
    assert facts["finite"].dtype == jnp.bool_ and np.asarray(facts["finite"]).tolist() == [
        True, True, False, False]
    again = runner.update(server.proxy_params, _copy(states), data, slots, keys)
    assert protocol.UPLOAD_FACTS not in again[2]


def test_scan_chunk_below_one_is_refused():
    _, program, *_ = _setup("mlp")
    with pytest.raises(ValueError, match="scan_chunk must be >= 1"):
        runners.make_runner(program, "scan", scan_chunk=0)


@pytest.mark.slow  # ~6 s of compilation
def test_a_participant_gets_the_same_result_alone_or_in_a_padded_bucket():
    _, program, data, states, server = _setup("mlp")
    key = jax.random.key(3)
    runner = runners.make_runner(program, "vmap")
    alone = runner.update(server.proxy_params, _copy(states), data, np.array([1], np.int32),
                          key[None])
    crowd = runner.update(server.proxy_params, _copy(states), data,
                          np.array([3, 1, 4], np.int32), jnp.stack([key, key, key]))
    chex.assert_trees_all_close(jax.tree.map(lambda a: a[0], alone[0]),
                                jax.tree.map(lambda a: a[1], crowd[0]), rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # ~8 s of compilation
def test_loop_with_no_participant_returns_zero_uploads():
    _, program, data, states, server = _setup("mlp")
    runner = runners.make_runner(program, "loop")
    ups, new_states, metrics = runner.update(server.proxy_params, _copy(states), data,
                                             np.array([4, 4], np.int32),
                                             jax.random.split(jax.random.key(0), 2))
    assert all(leaf.shape[0] == 2 and float(jnp.abs(leaf).max()) == 0.0
               for leaf in jax.tree.leaves(ups))
    chex.assert_trees_all_equal(new_states.params, states.params)
    assert float(metrics["local_steps"].sum()) == 0.0


@pytest.mark.parametrize("strategy", ["vmap", "loop", "loop:2", "scan"])
def test_no_recompilation_after_the_first_round(strategy):
    _, program, data, states, server = _setup("mlp")
    runner, traces = _counting_runner(program, "client_update", strategy)
    for r, slots in enumerate([[0, 2], [3, 4], [1, 0]]):
        keys = jax.random.split(jax.random.key(r), 2)
        _, states, _ = runner.update(server.proxy_params, states, data,
                                     np.array(slots, np.int32), keys)
        if r == 0:
            after_first = len(traces)
    assert after_first >= 1 and len(traces) == after_first


def test_unknown_strategy_names_the_field():
    with pytest.raises(ValueError, match="config.execution.strategy: unknown strategy 'pmap'"):
        protocol.resolve_strategy("pmap")


def _fake_runner(name, seconds_per_step, kernels="xla"):
    """A runner whose update sleeps `seconds_per_step` per local step it would run."""
    import time

    def update(broadcast, states, train, slots, keys):
        sizes = np.asarray(train.sizes)
        real = sizes[np.asarray(slots)[np.asarray(slots) < len(sizes)]]  # padded: out of range
        steps = real.sum() if name == "loop" else real.max(initial=0)
        time.sleep(seconds_per_step * float(steps))
        return None, states, {}

    return protocol.CohortRunner(name, update, None, None, None, kernels=kernels)


def test_auto_strategy_picks_the_cheaper_expected_round_and_caches_it(tmp_path):
    from fedjax_pfedes.data.federated import ClientArrays
    from fedjax_pfedes.execution import choice
    train = ClientArrays(jnp.zeros((4, 8, 2)), jnp.zeros((4, 8), jnp.int32),
                         jnp.array([8, 8, 8, 8], jnp.int32))
    states = {"w": jnp.zeros((4, 3))}
    # One step per client: loop 4 x 10 ms per call, vmap 1 x 30 ms.
    runners = {"loop": _fake_runner("loop", 0.01), "vmap": _fake_runner("vmap", 0.03)}
    planned = np.array([2, 2, 2, 10])  # one long client: vmap pays its 10 steps every round
    def trial(name, participants, steps):
        return choice.Trial(name, runners, {}, states, train, bucket=4,
                                     expected_participants=participants, planned_steps=steps,
                                     epochs=1, batch_size=1)

    picked = choice.choose(trial("alg/arch", 2.0, planned), str(tmp_path), repeats=1)
    loop_call, vmap_call = picked.seconds_per_call["loop"], picked.seconds_per_call["vmap"]
    assert loop_call == pytest.approx(0.04, rel=0.5) and vmap_call == pytest.approx(0.03, rel=0.5)
    # Expected round: loop = per-client step x mean steps x participants; vmap = x max steps.
    assert picked.expected_round_s["loop"] == pytest.approx(loop_call / 4 * 4.0 * 2.0)
    assert picked.expected_round_s["vmap"] == pytest.approx(vmap_call * 10.0)
    assert picked.strategy == "loop" and not picked.cached
    again = choice.choose(trial("alg/arch", 2.0, planned), str(tmp_path), repeats=1)
    assert again.cached and again.strategy == "loop"
    assert again.seconds_per_call == picked.seconds_per_call
    # Equal step counts: vmap's single batched call wins.
    even = choice.choose(trial("alg/arch2", 4.0, np.full(4, 3)), None, repeats=1)
    assert even.strategy == "vmap"


def test_a_cached_decision_is_not_reused_on_another_cpu_or_jaxlib(tmp_path, monkeypatch):
    """The decision cache's key holds the machine (`choice.machine`: CPU model, instruction-set
    features, cores, jax and jaxlib versions): a cache copied from an AVX-512 CPU to an
    AVX2-only one, or read after a jaxlib upgrade, measures anew."""
    from fedjax_pfedes.data.federated import ClientArrays
    from fedjax_pfedes.execution import choice
    train = ClientArrays(jnp.zeros((4, 8, 2)), jnp.zeros((4, 8), jnp.int32),
                         jnp.array([8, 8, 8, 8], jnp.int32))
    trial = choice.Trial("alg/arch", {"loop": _fake_runner("loop", 0.001),
                                      "vmap": _fake_runner("vmap", 0.002)},
                         {}, {"w": jnp.zeros((4, 3))}, train, bucket=4,
                         expected_participants=4.0, planned_steps=np.full(4, 2), epochs=1,
                         batch_size=1)
    here = choice.machine()
    assert {"cpu", "cpu_features", "cores", "jax", "jaxlib"} <= set(here)
    assert not choice.choose(trial, str(tmp_path), repeats=1).cached
    assert choice.choose(trial, str(tmp_path), repeats=1).cached
    features = set(here["cpu_features"])
    other_features = sorted(features ^ {"avx512f"})  # AVX-512 here: without it; else with it
    for other in ({"cpu_features": other_features}, {"jaxlib": "0.0.1"},
                  {"cores": here["cores"] + 14}):
        monkeypatch.setattr(choice, "machine", lambda other=other: {**here, **other})
        assert choice.cached_choice(trial, str(tmp_path)) is None, other


def test_auto_kernels_are_candidates_of_their_own_and_keyed_apart_in_the_cache(tmp_path):
    """With `cpu_kernels='auto'` every strategy comes twice (XLA's and Eigen's kernels): each
    variant is timed and priced by its strategy's rule, the name says the kernels, and the
    decision cache keeps decisions over other candidate sets apart."""
    from fedjax_pfedes.data.federated import ClientArrays
    from fedjax_pfedes.execution import choice
    train = ClientArrays(jnp.zeros((4, 8, 2)), jnp.zeros((4, 8), jnp.int32),
                         jnp.array([8, 8, 8, 8], jnp.int32))
    states = {"w": jnp.zeros((4, 3))}
    eigen = _fake_runner("loop", 0.005, kernels="eigen")
    assert eigen.name == "loop/eigen" and _fake_runner("loop", 0.01).name == "loop"
    both = {"loop": _fake_runner("loop", 0.01), "loop/eigen": eigen,
            "vmap": _fake_runner("vmap", 0.03)}
    planned = np.array([2, 2, 2, 10])

    def trial(runners):
        return choice.Trial("alg/arch", runners, {}, states, train, bucket=4,
                                     expected_participants=2.0, planned_steps=planned,
                                     epochs=1, batch_size=1)

    picked = choice.choose(trial(both), str(tmp_path), repeats=1)
    assert picked.strategy == "loop/eigen" and not picked.cached
    # Both loop variants are priced by the loop's rule: the call's 4 slots ran one step each;
    # a round runs 4 mean planned steps for each of 2 expected participants.
    for name in ("loop", "loop/eigen"):
        assert picked.expected_round_s[name] == pytest.approx(
            picked.seconds_per_call[name] / 4 * 4.0 * 2.0)
    # Another candidate set is measured anew; the same one is read back.
    without = choice.choose(trial({k: both[k] for k in ("loop", "vmap")}),
                                     str(tmp_path), repeats=1)
    assert without.strategy == "loop" and not without.cached
    assert choice.choose(trial(both), str(tmp_path), repeats=1).cached
    assert kernels.kernel_candidates("eigen") == ("eigen",)
    expected = ("xla", "eigen") if jax.default_backend() == "cpu" else ("xla",)
    assert kernels.kernel_candidates("auto") == expected
    with pytest.raises(ValueError, match="config.execution.cpu_kernels"):
        kernels.kernel_candidates("onednn")


def test_loop_threads_give_the_numbers_of_one_thread():
    """The 'loop' strategy with its participants spread over host threads returns exactly the
    one-thread uploads, states, metrics and evaluations (every client computes the same
    function of the same inputs); padded slots stay zero, non-participants unchanged."""
    _, program, data, states, server = _setup("mlp", num_clients=8)
    slots = np.array([5, 2, 8, 0, 7, 8], np.int32)  # 4 participants, 2 padded slots (index 8)
    keys = jax.random.split(jax.random.key(7), len(slots))
    one = runners.make_runner(program, "loop", loop_threads=1)
    many = runners.make_runner(program, "loop", loop_threads=3)
    for _ in range(2):  # the second call runs every participant on the threads
        up_1, st_1, m_1 = one.update(server.proxy_params, _copy(states), data, slots, keys)
        up_3, st_3, m_3 = many.update(server.proxy_params, _copy(states), data, slots, keys)
        chex.assert_trees_all_equal((up_1, st_1, m_1), (up_3, st_3, m_3))
    assert float(np.abs(np.asarray(m_3["local_steps"])[[2, 5]]).max()) == 0.0
    chex.assert_trees_all_equal(jax.tree.map(lambda a: a[np.array([1, 3, 4, 6])], st_3),
                                jax.tree.map(lambda a: a[np.array([1, 3, 4, 6])], states))
    for _ in range(2):
        ev_1 = one.evaluate(server.proxy_params, st_1, data, data.x[0], data.y[0])
        ev_3 = many.evaluate(server.proxy_params, st_1, data, data.x[0], data.y[0])
        chex.assert_trees_all_equal(ev_1, ev_3)
    part_1 = one.evaluate_slots(server.proxy_params, st_1, data, slots, data.x[0], data.y[0])
    part_3 = many.evaluate_slots(server.proxy_params, st_1, data, slots, data.x[0], data.y[0])
    chex.assert_trees_all_equal(part_1, part_3)


@pytest.mark.parametrize("strategy", ["loop", "loop:2", "vmap"])
def test_global_accuracy_is_its_own_program_and_scores_each_client_by_numpy(strategy):
    """Evaluation = the program's local-test metrics + `global_accuracy` from a separate
    program: the monitoring (no global set) and a full evaluation share the local program (the
    loop traces it once), and each client's global accuracy is numpy's argmax of its model's
    logits on the global set against the labels; padded slots stay zero."""
    _, program, data, states, server = _setup("convnet3", num_clients=5)
    runner, traces = _counting_runner(program, "evaluate", strategy)
    name = strategy.partition(":")[0]
    rng = np.random.default_rng(3)
    global_x = jnp.asarray(rng.uniform(size=(23, 8, 8, 1)).astype(np.float32))
    global_y = jnp.asarray(rng.integers(0, 10, 23).astype(np.int32))
    slots = np.array([3, 1, 5], np.int32)  # a round's participants, one padded slot
    monitoring = runner.evaluate_slots(server.proxy_params, states, data, slots)
    assert "global_accuracy" not in monitoring
    traced = len(traces)
    full = runner.evaluate(server.proxy_params, states, data, global_x, global_y)
    if name == "loop":
        assert traced == 1 and len(traces) == 1  # the local program is shared
    for key, value in monitoring.items():  # vmap: other batch shapes, other float sums
        np.testing.assert_allclose(np.asarray(value)[:2], np.asarray(full[key])[slots[:2]],
                                   rtol=0 if name == "loop" else 1e-5)
        assert float(np.asarray(value)[2]) == 0.0
    for i in range(5):  # the whole set in one batch, not one sample at a time
        logits = program.predict(server.proxy_params, jax.tree.map(lambda a, i=i: a[i], states),
                                 global_x)
        expected = np.mean(np.argmax(np.asarray(logits), -1) == np.asarray(global_y))
        np.testing.assert_allclose(float(full["global_accuracy"][i]), expected, atol=1e-6)


def test_tap_sum_under_both_kernel_sets_equals_lax():
    """The first convolution's training forward pass (`layers._tap_sum`) compiled with either
    `cpu_kernels` setting, plainly and inside a scan, gives lax's values."""
    x = jax.random.uniform(jax.random.key(0), (8, 8, 8, 1), minval=-1.0, maxval=2.3)
    k = jax.random.normal(jax.random.key(1), (3, 3, 1, 16)) * 0.3
    expected = jax.lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))

    def forward(k, x):
        return jax.vjp(lambda k: layers.conv(x, k, (1, 1), "SAME"), k)[0]

    def scanned(k, xs):
        return jax.lax.scan(lambda c, x: (c, forward(k, x)), 0, xs)[1]

    for name in ("xla", "eigen"):
        opts = kernels.kernel_options(name) or None
        np.testing.assert_allclose(jax.jit(forward, compiler_options=opts)(k, x), expected,
                                   rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(jax.jit(scanned, compiler_options=opts)(
            k, jnp.stack([x, x]))[1], expected, rtol=1e-5, atol=1e-5)


def test_eigen_cpu_kernels_compile_convolutions_without_ynnpack_and_give_the_same_round(
        monkeypatch):
    """`cpu_kernels='eigen'` compiles the client programs' convolutions without YNNPACK
    fusions (XLA's default hands them to it), its matrix products still with them, and computes
    the same round up to float reassociation; a name it does not know is refused naming the
    field. The convolutions are
    the kernels' here (no tap sum: `layers.MAX_TAPS` 0); the tap sum under both kernel sets is
    `test_tap_sum_under_both_kernel_sets_equals_lax`."""
    if jax.default_backend() != "cpu":
        pytest.skip("YNNPACK fusions are an XLA:CPU feature")
    monkeypatch.setattr(layers, "MAX_TAPS", 0)
    _, program, data, states, server = _setup("convnet3")
    slots = np.array([2, 0, 4, 4], np.int32)
    keys = jax.random.split(jax.random.key(7), 4)
    assert kernels.kernel_options("xla") == {}
    options = kernels.kernel_options("eigen")
    args = (server.proxy_params, jax.tree.map(lambda a: a[0], states),
            jax.tree.map(lambda a: a[0], data), keys[0])
    texts = {name: jax.jit(program.client_update, compiler_options=opts or None).lower(
        *args).compile().as_text() for name, opts in (("xla", {}), ("eigen", options))}
    def library_fused(text, op):  # YNNPACK fusions whose result is `op`'s
        return [line for line in text.splitlines()
                if "__ynn_fusion" in line and re.search(f'op_name="[^"]*/{op}"', line)]

    assert library_fused(texts["xla"], "conv_general_dilated")
    assert not library_fused(texts["eigen"], "conv_general_dilated")
    assert library_fused(texts["eigen"], "dot_general")
    results = {k: runners.make_runner(program, "loop", cpu_kernels=k).update(
        server.proxy_params, _copy(states), data, slots, keys) for k in ("xla", "eigen")}
    chex.assert_trees_all_close(results["xla"], results["eigen"], rtol=2e-4, atol=2e-5)
    # ...and the runner really compiled other kernels: some value differs in its last bits.
    assert any(not np.array_equal(a, b) for a, b in zip(
        jax.tree.leaves(results["xla"]), jax.tree.leaves(results["eigen"]), strict=True))
    with pytest.raises(ValueError, match="config.execution.cpu_kernels"):
        kernels.kernel_options("onednn")


def test_balanced_groups_split_the_weight_evenly_and_keep_every_slot_once():
    weights = np.array([5.0, 1.0, 4.0, 3.0, 3.0, 2.0])
    groups = host_threads.balanced_groups(np.arange(6), weights, 2)
    assert sorted(np.concatenate(groups).tolist()) == list(range(6))
    assert [float(weights[g].sum()) for g in groups] == [9.0, 9.0]  # 5+4 and 3+3+2+1
    assert all(list(g) == sorted(g) for g in groups)
    assert [len(g) for g in host_threads.balanced_groups(np.arange(2), weights[:2], 4)] == [
        1, 1, 0, 0]


def test_client_threads_take_the_next_item_when_free_the_heaviest_first():
    """Every item is called once and its output kept; the first call runs alone (it compiles);
    the rest start heaviest first, each thread taking the next item when its call returns, so
    one slow call does not hold back items a fixed split would have queued behind it."""
    import threading
    import time
    pool = host_threads.ClientThreads(2, "test_threads")
    started, lock = [], threading.Lock()
    ran_on = {}

    def call(j):
        with lock:
            started.append(j)
            ran_on[j] = threading.current_thread().name
        time.sleep(1.0 if j == 1 else 0.01)  # item 1 is slow
        return np.float32(10 * j)

    real = np.arange(6)
    weights = np.array([1.0, 6.0, 5.0, 4.0, 3.0, 2.0])
    out = pool.run("update", call, real, weights)
    assert out == {j: np.float32(10 * j) for j in range(6)}
    assert started[0] == 0  # the first call of a kind, alone on the calling thread
    assert sorted(started[1:3]) == [1, 2] and started[3:] == [3, 4, 5]
    # While item 1 sleeps, the other thread takes 3, 4 and 5 in turn (a split fixed in advance
    # by weight, 1 + 4 + 5 against 2 + 3, would have queued 4 and 5 behind the slow call).
    assert ran_on[0] == threading.current_thread().name
    assert ran_on[1] not in {ran_on[j] for j in (0, 2, 3, 4, 5)}
    assert len({ran_on[j] for j in (2, 3, 4, 5)}) == 1
    again = pool.run("update", call, real[1:3], weights[1:3])
    assert again == {1: np.float32(10), 2: np.float32(20)}


def test_scan_lanes_are_dealt_by_samples_within_their_width():
    """'scan''s lanes hold `capacity` slots each: the heaviest participant first onto the
    lightest lane with room; equal sizes deal the slots round-robin (the layout lanes had
    before they were balanced); the layout puts each lane's outputs back in slot order."""
    from fedjax_pfedes.execution.strategies import scanned
    heavy = np.array([9.0, 1.0, 1.0, 1.0])
    free = host_threads.balanced_groups(np.arange(4), heavy, 2)
    assert [g.tolist() for g in free] == [[0], [1, 2, 3]]
    capped = host_threads.balanced_groups(np.arange(4), heavy, 2, capacity=2)
    assert [g.tolist() for g in capped] == [[0, 3], [1, 2]]
    equal = host_threads.balanced_groups(np.arange(5), np.ones(5), 2, capacity=3)
    assert [g.tolist() for g in equal] == [[0, 2, 4], [1, 3]]
    positions, lane_positions, order = scanned._lane_layout(  # noqa: SLF001
        tuple(map(tuple, capped)), 4)
    assert positions.tolist() == [[0, 3], [1, 2]]
    assert [p.tolist() for p in lane_positions] == [[0, 3], [1, 2]]
    assert np.concatenate(positions)[np.asarray(order)].tolist() == [0, 1, 2, 3]
    odd, _, order = scanned._lane_layout(((0, 2, 4), (1, 3)), 5)  # noqa: SLF001
    assert odd.tolist() == [[0, 2, 4], [1, 3, 5]]  # padded past the bucket
    assert np.concatenate(odd)[np.asarray(order)].tolist() == [0, 1, 2, 3, 4]


def test_zero_buffers_of_a_tree_compile_one_program_and_are_independent():
    """The slot buffers of a round (uploads, metrics) are zeros made by ONE compiled program per
    tree of shapes, not one per leaf shape, and each leaf is its own buffer (later donated)."""
    shapes = {"w": jax.ShapeDtypeStruct((3, 5), jnp.float32),
              "b": jax.ShapeDtypeStruct((5,), jnp.float32),
              "v": jax.ShapeDtypeStruct((5,), jnp.float32),
              "n": jax.ShapeDtypeStruct((), jnp.int32)}
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **kw: compiles.append(event)
        if event == "/jax/core/compile/backend_compile_duration" else None)
    zeros = slot_rows.zeros_in_slots(shapes, 7)
    assert len(compiles) == 1
    assert {k: (v.shape, v.dtype) for k, v in zeros.items()} == {
        "w": ((7, 3, 5), jnp.float32), "b": ((7, 5), jnp.float32), "v": ((7, 5), jnp.float32),
        "n": ((7,), jnp.int32)}
    assert all(not np.asarray(v).any() for v in zeros.values())
    written = jax.jit(lambda a: a.at[0].set(1.0), donate_argnums=0)(zeros["b"])
    assert float(written.sum()) == 5.0 and not np.asarray(zeros["v"]).any()
    before = len(compiles)
    slot_rows.zeros_in_slots(shapes, 7)
    assert len(compiles) == before  # cached: the same tree of shapes compiles nothing more


def test_padded_slots_are_zeroed_and_a_chunk_costs_its_longest_schedule_by_hand():
    """`slot_rows.zero_padded` keeps valid rows and zeroes padded ones, any leaf rank, a bool
    staying a bool; 'scan' at chunk 3 executes, per chunk of participants, 3 x its longest
    schedule (steps 5, 1, 2 | 4: 3 x 5 + 3 x 4 = 27), at chunk 1 the participants' own 12."""
    valid = jnp.array([True, False, True])
    tree = {"m": jnp.arange(6.0).reshape(3, 2), "s": jnp.array([1, 2, 3], jnp.int32),
            "b": jnp.array([True, True, True])}
    out = slot_rows.zero_padded(tree, valid)
    assert np.asarray(out["m"]).tolist() == [[0.0, 1.0], [0.0, 0.0], [4.0, 5.0]]
    assert np.asarray(out["s"]).tolist() == [1, 0, 3]
    assert out["b"].dtype == jnp.bool_ and np.asarray(out["b"]).tolist() == [True, False, True]
    _, program, *_ = _setup("mlp")
    steps = np.array([5.0, 1.0, 2.0, 4.0])
    assert runners.make_runner(program, "scan", scan_chunk=3).computed_steps(steps, 6) == 27.0
    assert runners.make_runner(program, "scan").computed_steps(steps, 6) == 12.0
    assert runners.make_runner(program, "loop").computed_steps(steps, 6) == 12.0
    assert runners.make_runner(program, "vmap").computed_steps(steps, 6) == 30.0


def test_row_bytes_count_one_clients_row_by_hand():
    """One client's row of a stacked state, counted by hand: what the cost model prices, the
    lanes budget and the evaluation chunks size (the same for arrays and shapes, and for a
    cohort with no member yet)."""
    stacked = {"w": np.zeros((7, 3, 4), np.float32), "n": np.zeros((7,), np.int8),
               "m": np.zeros((7, 2), np.float64)}
    hand = 3 * 4 * 4 + 1 + 2 * 8
    assert slot_rows.row_bytes(stacked) == hand
    assert slot_rows.row_bytes(jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), stacked)) == hand
    assert slot_rows.row_bytes({"w": np.zeros((0, 3, 4), np.float32)}) == 48


def test_a_registered_strategy_runs_by_name_and_joins_auto():
    """A new strategy is one `register_strategy`: `make_runner` builds it by name (same numbers
    as the runner it wraps here), 'auto' times it, and a mesh strategy is left out of 'auto'
    without a multi-device mesh."""
    name = "loop_again_test"
    protocol.register_strategy(protocol.Strategy(
        name, lambda program, o: protocol.strategy("loop").build(program, o)))
    protocol.register_strategy(protocol.Strategy(
        "mesh_only_test", lambda program, o: protocol.strategy("loop").build(program, o),
        needs_mesh=True))
    try:
        assert name in protocol.auto_candidates(None)
        assert "mesh_only_test" not in protocol.auto_candidates(None)
        assert protocol.needs_mesh("mesh_only_test") and not protocol.needs_mesh(name)
        _, program, data, states, server = _setup("convnet3", num_clients=4)
        slots = jnp.array([2, 0, 4], jnp.int32)  # one padded slot
        keys = jax.random.split(jax.random.key(3), 3)
        mine = runners.make_runner(program, name)
        assert mine.strategy == name
        out_mine = mine.update(server.proxy_params, _copy(states), data, slots, keys)
        out_loop = runners.make_runner(program, "loop").update(
            server.proxy_params, _copy(states), data, slots, keys)
        chex.assert_trees_all_equal(out_mine, out_loop)
        with pytest.raises(ValueError, match="'loop_again_test' is registered twice"):
            protocol.register_strategy(protocol.Strategy(name, mine.update))
        with pytest.raises(ValueError, match="needs a mesh"):
            runners.make_runner(program, "mesh_only_test")
    finally:
        protocol._STRATEGIES.pop(name, None)
        protocol._STRATEGIES.pop("mesh_only_test", None)


def test_vmap_evaluates_in_chunks_of_clients_when_the_budget_says_so():
    """A cohort whose estimated evaluation memory exceeds `eval_memory_budget_gb` is evaluated
    in chunks of clients: every client's metrics as in one call, padded tail dropped; the
    chunk width comes from the program's activation bytes (a budget of one client's need gives
    one client per call, a large one all of them)."""
    from fedjax_pfedes.config.defaults import ExecutionSection
    from fedjax_pfedes.execution import eval_memory
    assert ExecutionSection().eval_memory_budget_gb == eval_memory.DEFAULT_BUDGET_GB
    _, program, data, states, server = _setup("convnet3", num_clients=5)
    rng = np.random.default_rng(3)
    global_x = jnp.asarray(rng.uniform(size=(23, 8, 8, 1)).astype(np.float32))
    global_y = jnp.asarray(rng.integers(0, 10, 23).astype(np.int32))
    per_row = eval_memory.activation_bytes_per_row(
        program, server.proxy_params, jax.tree.map(lambda a: a[0], states), data.x[0, :1])
    assert per_row > 8 * 8 * 16 * 4  # at least the first conv's output
    need = (data.x.shape[1] + 23) * per_row + sum(
        a.nbytes // a.shape[0] for a in jax.tree.leaves(states))
    widths = {budget: eval_memory.clients_per_call(program, server.proxy_params, states, data,
                                                   23, budget)
              for budget in (need, 2.5 * need, 1e12)}
    assert widths[need] == 1 and widths[2.5 * need] == 2 and widths[1e12] > 5
    whole = runners.make_runner(program, "vmap").evaluate(server.proxy_params, states, data,
                                                          global_x, global_y)
    for gb in (need / 2**30, 2.5 * need / 2**30):  # chunks of 1 and of 2 (a padded tail)
        chunked = runners.make_runner(program, "vmap", eval_memory_budget_gb=gb).evaluate(
            server.proxy_params, states, data, global_x, global_y)
        assert all(np.shape(v) == (5,) for v in chunked.values())
        chex.assert_trees_all_close(chunked, whole, rtol=1e-5, atol=1e-6)
