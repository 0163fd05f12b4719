"""The local-training loop and the convolution it relies on, against independent references."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_pfedes.algorithms import local_training
from fedjax_pfedes.data.federated import ClientArrays
from fedjax_pfedes.io.metrics import WALL_CLOCK_FIELDS
from fedjax_pfedes.models import layers


@pytest.mark.parametrize("shape,window,strides,padding", [
    ((2, 28, 28, 1), (3, 3), (1, 1), "SAME"),     # taps: convnet3's first layer
    ((2, 28, 28, 1), (5, 5), (1, 1), "VALID"),    # taps: CNN-1..5's first layer on MNIST
    ((2, 12, 10, 3), (3, 3), (1, 1), "SAME"),     # taps: 27, the most
    ((2, 32, 32, 3), (5, 5), (1, 1), "VALID"),
    ((2, 28, 28, 1), (7, 7), (7, 7), "VALID"),   # the ViT patch embedding
    ((3, 9, 10, 4), (3, 3), (2, 2), "SAME"),
    ((2, 11, 11, 3), (4, 4), (3, 3), "VALID"),
    ((3, 16, 8), (5,), (1,), "SAME"),             # 1-D (TextCNN)
])
def test_conv_values_and_gradients_equal_lax(shape, window, strides, padding):
    x = jax.random.normal(jax.random.key(0), shape)
    k = jax.random.normal(jax.random.key(1), window + (shape[-1], 5))
    numbers = ("NHWC", "HWIO", "NHWC") if len(shape) == 4 else ("NWC", "WIO", "NWC")

    def reference(x, k):
        return jnp.sum(jnp.sin(jax.lax.conv_general_dilated(x, k, strides, padding,
                                                            dimension_numbers=numbers)))

    def ours(x, k):
        return jnp.sum(jnp.sin(layers.conv(x, k, strides, padding)))

    np.testing.assert_allclose(ours(x, k), reference(x, k), rtol=1e-5)
    # The differentiated forward pass (a tap sum where `_few_taps`) gives the same values.
    trained, _ = jax.vjp(lambda x, k: layers.conv(x, k, strides, padding), x, k)
    lax_out = jax.lax.conv_general_dilated(x, k, strides, padding, dimension_numbers=numbers)
    np.testing.assert_allclose(trained, lax_out, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.grad(ours, (0, 1))(x, k), jax.grad(reference, (0, 1))(x, k), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_conv_forward_is_a_tap_sum_only_for_few_taps_at_stride_1():
    def taps(window, cin, strides):
        return layers._few_taps(jnp.zeros(window + (cin, 4)), strides)

    assert taps((3, 3), 1, (1, 1)) and taps((5, 5), 1, (1, 1)) and taps((3, 3), 3, (1, 1))
    assert taps((5,), 4, (1,))
    assert not taps((5, 5), 3, (1, 1))          # 75 taps: XLA's kernel
    assert not taps((3, 3), 4, (1, 1))          # 36 taps
    assert not taps((2, 2), 1, (2, 2))          # strided


def test_tap_sum_vmapped_over_clients_equals_each_client():
    x = jax.random.normal(jax.random.key(0), (3, 2, 10, 9, 1))      # 3 clients
    k = jax.random.normal(jax.random.key(1), (3, 5, 5, 1, 4))

    def trained(x, k):  # the forward pass of a gradient: the tap sum
        return jax.vjp(lambda x, k: layers.conv(x, k, (1, 1), "SAME"), x, k)[0]

    stacked = jax.vmap(trained)(x, k)
    for c in range(3):
        np.testing.assert_allclose(stacked[c], trained(x[c], k[c]), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(stacked[c], layers.conv(x[c], k[c], (1, 1), "SAME"),
                                   rtol=1e-5, atol=1e-5)


def test_evaluation_forward_pass_is_xlas_convolution():
    # Not differentiated, the forward pass stays XLA's kernel (fused into the pooling after it,
    # a tap sum runs slower), so evaluation's numbers are lax's to the bit.
    x = jax.random.normal(jax.random.key(0), (2, 28, 28, 1))
    k = jax.random.normal(jax.random.key(1), (5, 5, 1, 4))
    np.testing.assert_array_equal(
        jax.jit(lambda x, k: layers.conv(x, k, (1, 1), "VALID"))(x, k),
        jax.jit(lambda x, k: jax.lax.conv_general_dilated(
            x, k, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")))(x, k))


def test_conv_module_has_flax_conv_parameters():
    from flax import linen as nn
    x = jnp.ones((1, 8, 8, 3))
    ours = layers.Conv(4, (3, 3), name="c").init(jax.random.key(3), x)
    flax = nn.Conv(4, (3, 3), name="c").init(jax.random.key(3), x)
    jax.tree.map(np.testing.assert_array_equal, ours, flax)


def test_local_step_count_by_hand():
    count = local_training.local_step_count
    assert int(count(jnp.int32(50), 64, 16, 3)) == 3 * 4          # ceil(50/16) = 4 per epoch
    assert int(count(jnp.int32(64), 64, 16, 2)) == 8
    assert int(count(jnp.int32(50), 64, 16, 3, jnp.int32(5))) == 5  # capped by a step limit
    assert int(count(jnp.int32(0), 64, 16, 3)) == 0
    assert int(count(jnp.int32(7), 8, 32, 2)) == 2                 # batch clipped to capacity
    # drop_partial_batch: floor(50/16) = 3 per epoch; a client below B keeps its one batch
    assert int(count(jnp.int32(50), 64, 16, 3, drop_partial=True)) == 3 * 3
    assert int(count(jnp.int32(10), 64, 16, 3, drop_partial=True)) == 3
    assert int(count(jnp.int32(0), 64, 16, 3, drop_partial=True)) == 0


def _linear_step(optimizer):
    def logits(p, x):
        return x @ p["w"] + p["b"]
    return local_training.cross_entropy_step(logits, optimizer)


def _clients(sizes, capacity=37, features=6, classes=3, step_limits=None):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(len(sizes), capacity, features)).astype(np.float32)
    y = rng.integers(0, classes, size=(len(sizes), capacity)).astype(np.int32)
    data = ClientArrays(jnp.asarray(x), jnp.asarray(y), jnp.asarray(sizes, jnp.int32))
    if step_limits is not None:
        data = data.replace(step_limit=jnp.asarray(step_limits, jnp.int32))
    return data


@pytest.mark.slow  # ~9 s of compilation
@pytest.mark.parametrize("step_limits,drop", [(None, False), ([3, 100, 0, 7], False),
                                              (None, True)])
def test_rolled_loop_equals_padded_unrolled_schedule(step_limits, drop):
    """Each client runs only its own steps, with the same batches as the padded schedule."""
    data = _clients([37, 12, 5, 30], step_limits=step_limits)
    params = {"w": jnp.full((6, 3), 0.1), "b": jnp.zeros(3)}
    opt = optax.sgd(0.1, momentum=0.9)
    step = _linear_step(opt)

    def run(unroll, client, key):
        return local_training.run_local_epochs(step, (params, opt.init(params)), client, key,
                                               local_training.LocalSchedule(8, 3, unroll, drop))

    keys = jax.random.split(jax.random.key(1), 4)
    rolled = jax.jit(jax.vmap(lambda c, k: run(False, c, k)))(data, keys)
    unrolled = jax.jit(jax.vmap(lambda c, k: run(True, c, k)))(data, keys)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 rolled, unrolled)
    per_epoch = [n // 8 if drop and n >= 8 else -(-n // 8) for n in [37, 12, 5, 30]]
    expected = [min(3 * k, lim) for k, lim in
                zip(per_epoch, step_limits or [10**6] * 4, strict=True)]
    np.testing.assert_array_equal(rolled[2], expected)
    # One client alone (the loop strategy) gives the same as inside the vmap.
    one = jax.tree.map(lambda a: a[1], data)
    alone = jax.jit(lambda c, k: run(False, c, k))(one, keys[1])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b[1], rtol=1e-5, atol=1e-6),
                 alone, rolled)


@pytest.mark.parametrize("drop,steps_per_epoch", [(False, 3), (True, 2)])
def test_rolled_loop_matches_a_numpy_sgd_loop(drop, steps_per_epoch):
    """Hand-written SGD over the batches the schedule names: the loop runs these and no others
    (10 rows, B = 4: batches of 4, 4, 2; with drop_partial_batch the 2-row batch is skipped)."""
    data = _clients([10], capacity=16)
    client = jax.tree.map(lambda a: a[0], data)
    params = {"w": jnp.zeros((6, 3)), "b": jnp.zeros(3)}
    opt = optax.sgd(0.5)
    key = jax.random.key(4)
    (final, _), sums, steps = jax.jit(lambda c: local_training.run_local_epochs(
        _linear_step(opt), (params, opt.init(params)), c, key,
        local_training.LocalSchedule(4, 2, drop_partial_batch=drop)))(client)
    schedule = local_training.batch_schedule(key, jnp.int32(10), 16, 4, 2, drop_partial=drop)
    x, y = np.asarray(client.x), np.asarray(client.y)
    w, b = np.zeros((6, 3)), np.zeros(3)
    losses = []
    for rows, mask in zip(np.asarray(schedule.indices), np.asarray(schedule.sample_mask),
                          strict=True):
        if not mask.any():
            continue
        xb, yb = x[rows][mask], y[rows][mask]
        z = xb @ w + b
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        losses.append(-np.mean(np.log(p[np.arange(len(yb)), yb])))
        g = (p - np.eye(3)[yb]) / len(yb)
        w, b = w - 0.5 * xb.T @ g, b - 0.5 * g.sum(0)
    assert steps == len(losses) == 2 * steps_per_epoch
    assert all(len(np.flatnonzero(m)) == 4 for m in np.asarray(schedule.sample_mask)
               if m.any()) or not drop
    np.testing.assert_allclose(final["w"], w, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(final["b"], b, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(sums[0], sum(losses), rtol=1e-5)


def test_a_one_position_schedule_is_one_masked_step_without_a_loop():
    """Capacity <= B and one epoch (the cross-device case): the client's whole data is one
    batch, so local training is one SGD step on the mean gradient of its real rows (by hand,
    in numpy); a client without rows or with a step limit of 0 takes none; no while loop."""
    data = _clients([5, 0, 3], capacity=6, step_limits=[9, 9, 0])
    params = {"w": jnp.full((6, 3), 0.1), "b": jnp.zeros(3)}
    opt = optax.sgd(0.5)

    def run(c, k):
        return local_training.run_local_epochs(_linear_step(opt), (params, opt.init(params)),
                                               c, k, local_training.LocalSchedule(8, 1))

    keys = jax.random.split(jax.random.key(5), 3)
    def loops(fn, *args):
        return jax.jit(fn).lower(*args).compile().as_text().count(" while(")

    # The only loops are those of the shuffle's random draw (threefry on the CPU).
    shuffle = loops(lambda k: local_training.batch_schedule(k, jnp.int32(5), 6, 8, 1).indices,
                    keys[0])
    assert loops(run, jax.tree.map(lambda a: a[0], data), keys[0]) == shuffle
    (final, _), sums, steps = jax.jit(jax.vmap(run))(data, keys)
    np.testing.assert_array_equal(steps, [1, 0, 0])
    x, y = np.asarray(data.x[0, :5], np.float64), np.asarray(data.y[0, :5])
    z = x @ np.full((6, 3), 0.1)
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    g = (p - np.eye(3)[y]) / 5
    np.testing.assert_allclose(final["w"][0], 0.1 - 0.5 * x.T @ g, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(final["b"][0], -0.5 * g.sum(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sums[0, 0], -np.mean(np.log(p[np.arange(5), y])), rtol=1e-5)
    for i in (1, 2):  # no step: parameters and stats untouched
        np.testing.assert_array_equal(final["w"][i], params["w"])
        assert float(sums[i, 0]) == 0.0


def test_the_local_step_is_traced_once_and_lowers_as_before():
    """The rolled loop needs the step's stats shape before the loop: both come from one trace
    of the step (tracing a model is most of a first call's Python time), and the lowered
    program has no extra function: the step is inlined as if called directly."""
    traces = []

    def logits(p, x):
        traces.append(1)
        return x @ p

    step = local_training.cross_entropy_step(logits, optax.sgd(0.1))
    data = ClientArrays(jnp.ones((40, 5)), jnp.zeros((40,), jnp.int32), jnp.int32(37))
    params = jnp.zeros((5, 3))
    run = jax.jit(lambda p, d, k: local_training.run_local_epochs(
        step, (p, optax.sgd(0.1).init(p)), d, k, local_training.LocalSchedule(8, 2)))
    lowered = run.lower(params, data, jax.random.key(0))
    assert len(traces) == 1
    assert "@train_step" not in lowered.as_text()  # no function of its own: inlined
    assert float(run(params, data, jax.random.key(0))[2]) == 10.0  # 2 epochs x ceil(37/8)


def test_step_keys_follow_the_schedule_positions():
    """DP-SGD keys: the rolled loop hands step t the key of its padded-schedule position."""
    data = _clients([9, 20], capacity=20)
    seen = []

    def step(carry, batch):
        return carry + jax.random.uniform(batch[3]), jnp.zeros(1)

    def run(unroll, c, k):
        return local_training.run_local_epochs(step, jnp.float32(0), c, k,
                                               local_training.LocalSchedule(4, 2, unroll),
                                               step_keys=True)[0]

    keys = jax.random.split(jax.random.key(2), 2)
    for unroll in (False, True):
        seen.append(jax.jit(jax.vmap(lambda c, k, u=unroll: run(u, c, k)))(data, keys))
    np.testing.assert_allclose(seen[0], seen[1], rtol=1e-6)


def _run(tmp_path, name, **execution):
    import json

    import fl_helpers

    from fedjax_pfedes.engine.loop import run_experiment
    config = fl_helpers.tiny_config(rounds=2)
    for k, v in execution.items():
        config.execution[k] = v
    run_experiment(config, str(tmp_path / name), show_progress=False)
    rows = [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]
    clients = [json.loads(line) for line in open(tmp_path / name / "clients.jsonl")]
    return rows, clients, config


@pytest.mark.slow
def test_simulation_numbers_equal_the_padded_unrolled_schedule(tmp_path):
    """The rolled per-client loop changes how the work is executed, not the work."""
    rolled, _, _ = _run(tmp_path, "rolled")
    unrolled, _, _ = _run(tmp_path, "unrolled", unroll_local_steps=True)
    for a, b in zip(rolled, unrolled, strict=True):
        for k, v in a.items():
            if isinstance(v, float) and k not in WALL_CLOCK_FIELDS:
                assert v == pytest.approx(b[k], rel=1e-4, abs=1e-6), k


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["loop", "vmap"])
def test_padded_step_fraction_counts_the_steps_each_strategy_runs(tmp_path, strategy):
    rows, clients, config = _run(tmp_path, strategy, strategy=strategy)
    by_round = {}
    for c in clients:
        by_round.setdefault(c["round"], []).append(c["local_steps"])
    bucket = round(config.train.client_fraction * config.data.num_clients)  # one cohort
    for r in rows:
        steps = np.array(by_round[r["round"]], float)
        expected = 1.0 if strategy == "loop" else bucket * steps.max() / steps.sum()
        assert r["padded_step_fraction"] == pytest.approx(expected)


@pytest.mark.parametrize("modality,arch", [
    pytest.param("image", "vit", marks=pytest.mark.slow),  # ~9 s of compilation
    pytest.param("image", "convnet3", marks=pytest.mark.slow),
    pytest.param("text", "text_transformer", marks=pytest.mark.slow),
    ("text", "proxy")])
def test_jitted_initialization_equals_eager_initialization(modality, arch):
    """Cohort states are initialized in one compiled call; the weights must be exactly those of
    eager initialization (a fused scale changes the last bit, and a run's numbers with it)."""
    from fedjax_pfedes.data.spec import InputSpec
    from fedjax_pfedes.engine import cohorts
    from fedjax_pfedes.models import architectures
    spec = (InputSpec("image", (28, 28, 1), "float32", (0.1,), (0.3,)) if modality == "image"
            else InputSpec("text", (16,), "int32", vocab_size=50))
    model = (architectures.proxy_model("proxy_text", 16, spec) if arch == "proxy"
             else architectures.client_model(arch, 10, 16, spec))
    x = spec.dummy_batch()

    def init(key, model=model, x=x):
        return model.init(key, x)

    rng, ids = jax.random.key(1), jnp.arange(4)
    eager = jax.vmap(init)(jax.vmap(lambda k: jax.random.fold_in(rng, k))(ids))
    jax.tree.map(np.testing.assert_array_equal, cohorts._init_states(init, rng, ids), eager)
