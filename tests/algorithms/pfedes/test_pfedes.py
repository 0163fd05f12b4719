"""pFedES local step and server step against independent references."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_pfedes.algorithms.pfedes import PFedESConfig, ServerState, pfedes
from fedjax_pfedes.data.federated import ClientArrays
from fedjax_pfedes.data.spec import InputSpec
from fedjax_pfedes.models import architectures

SHAPE = (8, 8, 1)
SPEC = InputSpec("image", SHAPE, "float32", (0.3,), (0.2,))


def _cfg(**kw):
    base = dict(num_classes=4, input_spec=SPEC, lam=0.7,
                proxy_dim=6, proxy_arch="proxy_mlp", lr_local=0.1, batch_size=8,
                local_epochs=1, local_momentum=0.0, server_momentum=0.5)
    base.update(kw)
    return PFedESConfig(**base)


def _client_data(n, capacity, seed=0):
    rng = np.random.default_rng(seed)
    x = np.zeros((capacity,) + SHAPE, np.float32)
    y = np.zeros((capacity,), np.int32)
    x[:n] = rng.uniform(size=(n,) + SHAPE)
    y[:n] = rng.integers(0, 4, n)
    return ClientArrays(jnp.asarray(x), jnp.asarray(y), jnp.int32(n))


def _setup(cfg, arch="mlp"):
    alg = pfedes(cfg)
    program = alg.cohort_program(arch)
    server = alg.init_server(jax.random.key(0))
    client = program.init_client(jax.random.key(1))
    return alg, program, server, client


def _one_step(cfg, key: int):
    """One client's update on 8 rows in one batch: (upload, new client, metrics, the client
    and server before it, the client model, E_proxy, the data)."""
    _, program, server, client = _setup(cfg)
    data = _client_data(n=8, capacity=8)
    upload, new_client, metrics = program.client_update(server.proxy_params, client, data,
                                                        jax.random.key(key))
    model = architectures.client_model("mlp", 4, 6, SPEC)
    proxy = architectures.proxy_model("proxy_mlp", 6, SPEC)
    return upload, new_client, metrics, client, server, model, proxy, data


@pytest.mark.parametrize("align", ["mse", "cosine"])
def test_one_local_step_matches_a_reference_with_constant_targets(align):
    """With one batch, the local model moves by the gradient of CE + lam*align to a CONSTANT
    e_proxy, and E_proxy by the gradient of align to a CONSTANT e_local (both stop-gradients)."""
    cfg = _cfg(align=align)
    upload, new_client, metrics, client, server, model, proxy, data = _one_step(cfg, 2)
    x, y = np.asarray(data.x), np.asarray(data.y)

    def align_ref(a, b):
        if align == "mse":
            return jnp.mean(jnp.mean((a - b) ** 2, axis=-1))
        cos = jnp.sum(a * b, -1) / (jnp.linalg.norm(a, axis=-1) * jnp.linalg.norm(b, axis=-1))
        return jnp.mean(1.0 - cos)

    e_proxy_const = np.asarray(proxy.apply(server.proxy_params, x))
    _, e_local_const = model.apply(client.params, x)
    e_local_const = np.asarray(e_local_const)

    def local_loss(p):
        logits, e = model.apply(p, x)
        ce = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))
        return ce + cfg.lam * align_ref(e, e_proxy_const)

    def proxy_loss(q):
        return align_ref(proxy.apply(q, x), e_local_const)

    want_local = jax.tree.map(lambda p, g: p - cfg.lr_local * g, client.params,
                              jax.grad(local_loss)(client.params))
    want_proxy = jax.tree.map(lambda q, g: q - 0.1 * cfg.lr_local * g, server.proxy_params,
                              jax.grad(proxy_loss)(server.proxy_params))
    chex.assert_trees_all_close(new_client.params, want_local, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(upload, want_proxy, rtol=1e-5, atol=1e-6)
    assert int(new_client.steps) == 1 and float(metrics["local_steps"]) == 1.0
    np.testing.assert_allclose(metrics["train_proxy_align_loss"],
                               proxy_loss(server.proxy_params), rtol=1e-5)


def test_steps_are_decoupled_by_the_stop_gradients():
    """After one step, lam (the local objective) does not change the uploaded E_proxy, and the
    proxy learning rate does not change the local model: no gradient crosses between the two."""
    data = _client_data(n=8, capacity=8)

    def run(**kw):
        _, program, server, client = _setup(_cfg(**kw))
        return program.client_update(server.proxy_params, client, data, jax.random.key(0))

    up_lam, client_lam, _ = run(lam=0.7)
    up_nolam, client_nolam, _ = run(lam=0.0)
    chex.assert_trees_all_close(up_lam, up_nolam, rtol=1e-6)
    assert not np.allclose(jax.tree.leaves(client_lam.params)[0],
                           jax.tree.leaves(client_nolam.params)[0])
    up_slow, client_slow, _ = run(proxy_lr_ratio=0.1)
    up_fast, client_fast, _ = run(proxy_lr_ratio=0.9)
    chex.assert_trees_all_close(client_slow.params, client_fast.params, rtol=1e-6)
    assert not np.allclose(jax.tree.leaves(up_slow)[0], jax.tree.leaves(up_fast)[0])


def test_padded_rows_and_inactive_steps_have_no_effect():
    cfg = _cfg(batch_size=8)
    _, program, server, client = _setup(cfg)
    tight = _client_data(n=6, capacity=6)
    padded = _client_data(n=6, capacity=24)
    garbage = padded.x.at[6:].set(99.0)
    padded = ClientArrays(garbage, padded.y.at[6:].set(3), padded.sizes)
    up_t, c_t, m_t = program.client_update(server.proxy_params, client, tight, jax.random.key(4))
    up_p, c_p, m_p = program.client_update(server.proxy_params, client, padded, jax.random.key(4))
    chex.assert_trees_all_close(up_t, up_p, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(c_t.params, c_p.params, rtol=1e-5, atol=1e-6)
    assert float(m_p["local_steps"]) == 1.0  # 3 scheduled steps, 2 inactive


def test_steps_per_epoch_follow_the_clients_own_size():
    cfg = _cfg(batch_size=4, local_epochs=3)
    _, program, server, client = _setup(cfg)
    data = _client_data(n=9, capacity=20)
    _, new_client, metrics = program.client_update(server.proxy_params, client, data,
                                                   jax.random.key(0))
    assert float(metrics["local_steps"]) == 3 * 3  # ceil(9 / 4) per epoch
    assert int(new_client.steps) == 9


def test_warmup_freezes_the_backbone_only():
    cfg = _cfg(warmup_steps=5)
    _, program, server, client = _setup(cfg)
    data = _client_data(n=8, capacity=8)
    _, new_client, _ = program.client_update(server.proxy_params, client, data, jax.random.key(0))
    chex.assert_trees_all_equal(new_client.params["params"]["backbone"],
                                client.params["params"]["backbone"])
    for head in ("projection", "classifier"):
        assert not np.allclose(jax.tree.leaves(new_client.params["params"][head])[0],
                               jax.tree.leaves(client.params["params"][head])[0])


def test_server_step_is_weighted_mean_then_momentum_against_numpy():
    cfg = _cfg(server_momentum=0.3)
    alg = pfedes(cfg)
    server = alg.init_server(jax.random.key(0))
    rng = np.random.default_rng(0)
    # Two cohorts of stacked uploads; the last slot of the second is padding (weight 0).
    ups = [jax.tree.map(lambda p, k=k: jnp.asarray(rng.normal(size=(k,) + p.shape), p.dtype),
                        server.proxy_params) for k in (3, 2)]
    weights = [jnp.array([10.0, 30.0, 5.0]), jnp.array([55.0, 0.0])]
    new = alg.server_update(server, {f"cohort{i}": g for i, g in
                                     enumerate(zip(ups, weights, strict=True))})
    w = np.array([10.0, 30.0, 5.0, 55.0, 0.0])
    flat_new = jax.tree.leaves(new.proxy_params)
    flat_old = jax.tree.leaves(server.proxy_params)
    flat_up = [np.concatenate([np.asarray(a), np.asarray(b)])
               for a, b in zip(jax.tree.leaves(ups[0]), jax.tree.leaves(ups[1]), strict=True)]
    for n, o, u in zip(flat_new, flat_old, flat_up, strict=True):
        avg = np.tensordot(w, u.astype(np.float64), axes=1) / w.sum()
        np.testing.assert_allclose(n, 0.3 * np.asarray(o) + 0.7 * avg, rtol=1e-5, atol=1e-6)
    assert int(new.round) == 1


def test_server_step_without_any_weight_keeps_the_proxy():
    alg = pfedes(_cfg())
    server = alg.init_server(jax.random.key(0))
    ups = jax.tree.map(lambda p: jnp.ones((2,) + p.shape, p.dtype), server.proxy_params)
    new = alg.server_update(server, {"mlp": (ups, jnp.zeros(2))})
    chex.assert_trees_all_equal(new.proxy_params, server.proxy_params)
    assert isinstance(new, ServerState)


def test_contrastive_alignment_runs_and_is_masked():
    cfg = _cfg(align="contrastive", batch_size=8)
    _, program, server, client = _setup(cfg)
    tight = _client_data(n=5, capacity=5)
    padded = _client_data(n=5, capacity=8)
    up_t, _, _ = program.client_update(server.proxy_params, client, tight, jax.random.key(1))
    up_p, _, _ = program.client_update(server.proxy_params, client, padded, jax.random.key(1))
    chex.assert_trees_all_close(up_t, up_p, rtol=1e-5, atol=1e-6)


def _reference_steps(cfg, model, proxy, params, trace, proxy_params, steps_done, x, y, count,
                     proxy_trace=None):
    """`count` pFedES local steps by hand on the full batch (x, y): the local model takes
    heavy-ball SGD (t = g + m t; p -= lr t) on CE + lam * MSE to E_proxy's output held constant,
    with the backbone's gradient zeroed while fewer than `warmup_steps` steps have been taken in
    the client's life; E_proxy takes plain SGD at proxy_lr_ratio * lr * (1 - proxy momentum) /
    (1 - local momentum) on MSE to the local
    embedding held constant. Both read the parameters from before the step."""
    for _ in range(count):
        target = proxy.apply(proxy_params, x)
        _, embedding = model.apply(params, x)

        def local(p, target=target):
            logits, e = model.apply(p, x)
            ce = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))
            return ce + cfg.lam * jnp.mean(jnp.mean((e - target) ** 2, -1))

        def proxy_loss(q, embedding=embedding):
            return jnp.mean(jnp.mean((proxy.apply(q, x) - embedding) ** 2, -1))

        g = jax.grad(local)(params)
        if steps_done < cfg.warmup_steps:
            g = {"params": {**g["params"], "backbone": jax.tree.map(
                jnp.zeros_like, g["params"]["backbone"])}}
        trace = jax.tree.map(lambda t, gi: gi + cfg.local_momentum * t, trace, g)
        params = jax.tree.map(lambda p, t: p - cfg.lr_local * t, params, trace)
        proxy_grad = jax.grad(proxy_loss)(proxy_params)
        if proxy_trace is not None:  # E_proxy's heavy-ball momentum
            proxy_trace = jax.tree.map(lambda t, gq: gq + cfg.proxy_momentum * t, proxy_trace,
                                       proxy_grad)
            proxy_grad = proxy_trace
        # proxy_lr_rule 'effective': the ratio is of effective (momentum-adjusted) steps
        lr_proxy = (cfg.proxy_lr_ratio * cfg.lr_local * (1 - cfg.proxy_momentum)
                    / (1 - cfg.local_momentum))
        proxy_params = jax.tree.map(lambda q, gq, lr=lr_proxy: q - lr * gq, proxy_params,
                                    proxy_grad)
        steps_done += 1
    return params, trace, proxy_params, steps_done


def test_three_steps_and_a_second_round_match_a_hand_reference_with_warmup():
    """Momentum, the E_proxy learning rate, both stop-gradients and warm-up W=1 over 3 local
    steps and across two rounds: breaking any of them moves the result off the reference."""
    cfg = _cfg(align="mse", local_epochs=3, local_momentum=0.5, warmup_steps=1,
               proxy_lr_ratio=0.3)
    _, program, server, client = _setup(cfg)
    data = _client_data(n=8, capacity=8)  # batch 8: each step sees all 8 rows (any order)
    model = architectures.client_model("mlp", 4, 6, SPEC)
    proxy = architectures.proxy_model("proxy_mlp", 6, SPEC)
    x, y = jnp.asarray(data.x), jnp.asarray(data.y)
    params, trace = client.params, jax.tree.map(jnp.zeros_like, client.params)
    proxy_params, steps = server.proxy_params, 0
    state = client
    for round_key in (2, 3):  # the uploaded E_proxy is the next round's broadcast
        upload, state, metrics = program.client_update(proxy_params, state, data,
                                                       jax.random.key(round_key))
        params, trace, proxy_params, steps = _reference_steps(
            cfg, model, proxy, params, trace, proxy_params, steps, x, y, 3)
        chex.assert_trees_all_close(state.params, params, rtol=2e-4, atol=2e-6)
        chex.assert_trees_all_close(upload, proxy_params, rtol=2e-4, atol=2e-6)
        assert int(state.steps) == steps and float(metrics["local_steps"]) == 3.0
        proxy_params = upload
    # The warm-up froze the backbone for exactly one step of the client's life.
    frozen_once, _, _, _ = _reference_steps(cfg, model, proxy, client.params, jax.tree.map(
        jnp.zeros_like, client.params), server.proxy_params, 0, x, y, 1)
    chex.assert_trees_all_equal(frozen_once["params"]["backbone"],
                                client.params["params"]["backbone"])


@pytest.mark.parametrize("temperature", [0.1, 0.5])
def test_infonce_equals_a_numpy_formula_over_the_real_rows(temperature):
    """InfoNCE (Oord et al., 2018): -mean_i log( exp(cos(a_i, b_i)/T) / sum_j exp(cos(a_i, b_j)/T) )
    over the real rows i, j only; padded rows neither count nor act as negatives."""
    from fedjax_pfedes.algorithms.pfedes import alignment

    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(6, 5)), rng.normal(size=(6, 5))
    mask = np.array([1, 1, 0, 1, 1, 0], bool)
    an = a / np.linalg.norm(a, axis=1, keepdims=True)
    bn = b / np.linalg.norm(b, axis=1, keepdims=True)
    real = np.flatnonzero(mask)
    sim = an[real] @ bn[real].T / temperature
    want = -np.mean(np.diag(sim) - np.log(np.exp(sim).sum(axis=1)))
    loss = alignment.get_alignment("contrastive", temperature)
    got = loss(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32), jnp.asarray(mask))
    np.testing.assert_allclose(float(got), want, rtol=1e-5)
    cos = alignment.get_alignment("cosine")(jnp.asarray(a, jnp.float32),
                                            jnp.asarray(b, jnp.float32), jnp.asarray(mask))
    np.testing.assert_allclose(float(cos), np.mean(1 - np.sum(an * bn, 1)[real]), rtol=1e-5)


@pytest.mark.parametrize("stop_proxy,stop_local", [(False, True), (True, False), (False, False)])
def test_removing_a_stop_gradient_lets_that_loss_reach_the_other_side(stop_proxy, stop_local):
    """Finding F5's switches: one local step against hand-written gradients of
    L_local(p, q) = CE + lam * A(e_local(p), e_proxy(q)) and L_proxy(p, q) =
    A(e_proxy(q), e_local(p)) with A = InfoNCE, each stop-gradient in place or not; and the
    coupled step is no rescaling of the design's: the private update is off the line of design
    updates over every lam', E_proxy's is not parallel to the design's."""
    from fedjax_pfedes.algorithms.pfedes import alignment

    cfg = _cfg(align="contrastive", stop_gradient_proxy=stop_proxy, stop_gradient_local=stop_local)
    upload, new_client, _, client, server, model, proxy, data = _one_step(cfg, 0)
    x, y = jnp.asarray(data.x), jnp.asarray(data.y)
    mask = jnp.ones(x.shape[0], bool)
    infonce = alignment.get_alignment("contrastive", cfg.contrastive_temperature)

    def local_loss(p, q, lam=cfg.lam):
        logits, e = model.apply(p, x)
        ce = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))
        return ce + lam * infonce(e, proxy.apply(q, x), mask)

    def proxy_loss(p, q):
        return infonce(proxy.apply(q, x), model.apply(p, x)[1], mask)

    p0, q0 = client.params, server.proxy_params
    g_p = jax.grad(local_loss)(p0, q0)
    if not stop_local:
        g_p = jax.tree.map(jnp.add, g_p, jax.grad(proxy_loss)(p0, q0))
    g_q = jax.grad(proxy_loss, argnums=1)(p0, q0)
    if not stop_proxy:
        g_q = jax.tree.map(jnp.add, g_q, jax.grad(local_loss, argnums=1)(p0, q0))
    want_p = jax.tree.map(lambda a, g: a - cfg.lr_local * g, p0, g_p)
    want_q = jax.tree.map(lambda a, g: a - cfg.proxy_lr_ratio * cfg.lr_local * g, q0, g_q)
    chex.assert_trees_all_close(new_client.params, want_p, rtol=2e-5, atol=1e-6)
    chex.assert_trees_all_close(upload, want_q, rtol=2e-5, atol=1e-6)

    def flat(tree):
        return np.concatenate([np.ravel(v) for v in jax.tree.leaves(tree)]).astype(np.float64)

    # the design's gradients: the private one is affine in lam', E_proxy's fixed up to a scale
    design_p0 = flat(jax.grad(local_loss)(p0, q0, 0.0))
    design_p1 = flat(jax.grad(local_loss)(p0, q0, 1.0)) - design_p0
    design_q = flat(jax.grad(proxy_loss, argnums=1)(p0, q0))
    got_p, got_q = flat(g_p), flat(g_q)
    best_lam = np.dot(got_p - design_p0, design_p1) / np.dot(design_p1, design_p1)
    off_line = (np.linalg.norm(got_p - design_p0 - best_lam * design_p1)
                / np.linalg.norm(got_p))
    cosine = np.dot(got_q, design_q) / (np.linalg.norm(got_q) * np.linalg.norm(design_q))
    assert (off_line > 1e-3) == (not stop_local), off_line  # float noise is ~1e-7
    assert (cosine < 1 - 1e-4) == (not stop_proxy), cosine


@pytest.mark.parametrize("align", ["mse", "cosine"])
@pytest.mark.parametrize("field", ["stop_gradient_proxy", "stop_gradient_local"])
def test_a_removed_stop_gradient_with_a_symmetric_loss_is_refused_as_a_rescaling(align, field):
    """With align(a, b) = align(b, a) the coupled step is the design's with lam + 1 (private
    side) or a (1 + lam)x E_proxy step: shown here for one step, then refused by the config."""
    from configs import quickstart
    from fedjax_pfedes.engine.validate import validate_config
    from fedjax_pfedes.errors import ConfigError

    coupled = _one_step(_cfg(align=align, **{field: False}), 0)
    if field == "stop_gradient_local":
        same = _one_step(_cfg(align=align, lam=0.7 + 1.0), 0)
        chex.assert_trees_all_close(coupled[1].params, same[1].params, rtol=2e-5, atol=1e-6)
    else:
        same = _one_step(_cfg(align=align, proxy_lr_ratio=0.1 * 1.7), 0)
        chex.assert_trees_all_close(coupled[0], same[0], rtol=2e-5, atol=1e-6)
    config = quickstart.get_config()
    config.align, config[field] = align, False
    with pytest.raises(ConfigError, match=f"config.{field}=False with config.align='{align}'"):
        validate_config(config)


def test_proxy_momentum_matches_heavy_ball_on_e_proxy_over_three_steps():
    cfg = _cfg(align="mse", local_epochs=3, local_momentum=0.9, proxy_momentum=0.9)
    _, program, server, client = _setup(cfg)
    data = _client_data(n=8, capacity=8)
    upload, state, _ = program.client_update(server.proxy_params, client, data,
                                             jax.random.key(2))
    model = architectures.client_model("mlp", 4, 6, SPEC)
    proxy = architectures.proxy_model("proxy_mlp", 6, SPEC)
    params, _, proxy_params, _ = _reference_steps(
        cfg, model, proxy, client.params, jax.tree.map(jnp.zeros_like, client.params),
        server.proxy_params, 0, jnp.asarray(data.x), jnp.asarray(data.y), 3,
        proxy_trace=jax.tree.map(jnp.zeros_like, server.proxy_params))
    chex.assert_trees_all_close(state.params, params, rtol=2e-4, atol=2e-6)
    chex.assert_trees_all_close(upload, proxy_params, rtol=2e-4, atol=2e-6)
    without = _setup(_cfg(align="mse", local_epochs=3, local_momentum=0.9))[1]
    plain, _, _ = without.client_update(server.proxy_params, client, data, jax.random.key(2))
    assert not np.allclose(jax.tree.leaves(plain)[0], jax.tree.leaves(upload)[0])


def test_one_proxy_scale_is_the_single_scale_algorithm():
    """proxy_scales='1.0' builds the same parameters and takes the same steps as the default."""
    from fedjax_pfedes.algorithms.pfedes import PFedESConfig, pfedes
    from fedjax_pfedes.data.spec import InputSpec

    spec = InputSpec("image", (8, 8, 1), "float32", (0.0,), (1.0,))
    rng = np.random.default_rng(0)
    data = ClientArrays(jnp.asarray(rng.uniform(size=(8, 8, 8, 1)), jnp.float32),
                        jnp.asarray(rng.integers(0, 3, 8), jnp.int32), jnp.int32(8))
    results = []
    for scales in ("1.0", None):
        kw = {} if scales is None else {"proxy_scales": scales}
        alg = pfedes(PFedESConfig(num_classes=3, input_spec=spec, proxy_dim=4, batch_size=4,
                                  lr_local=0.1, **kw))
        program = alg.cohort_program("convnet3")
        proxy = alg.broadcast(alg.init_server(jax.random.key(0)), "")
        results.append(program.client_update(proxy, program.init_client(jax.random.key(1)),
                                             data, jax.random.key(2))[:2])
    for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1]), strict=True):
        np.testing.assert_array_equal(a, b)


def test_multi_scale_alignment_matches_a_hand_computed_weighted_sum():
    """Two scales: E_proxy emits [B, 2, d] (its output and its last conv layer, pooled), the
    client one projection head per scale, and the local loss is
    CE + lam (w0 mse(P0(z), E0(x)) + w1 mse(P1(z), E1(x)))."""
    from fedjax_pfedes.algorithms.pfedes import PFedESConfig, pfedes
    from fedjax_pfedes.data.spec import InputSpec
    from fedjax_pfedes.models import architectures

    spec = InputSpec("image", (8, 8, 1), "float32", (0.0,), (1.0,))
    lam, w, lr = 0.7, (1.0, 0.25), 0.1
    alg = pfedes(PFedESConfig(num_classes=3, input_spec=spec, proxy_dim=4, batch_size=8,
                              lr_local=lr, local_momentum=0.0, local_epochs=1, lam=lam,
                              proxy_scales="1.0,0.25"))
    program = alg.cohort_program("convnet3")
    proxy_params = alg.broadcast(alg.init_server(jax.random.key(0)), "")
    state = program.init_client(jax.random.key(1))
    assert set(state.params["params"]) == {"backbone", "projection", "scale_projections_0",
                                           "classifier"}
    assert "out_scale1" in proxy_params["params"]
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.uniform(size=(8, 8, 8, 1)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 3, 8), jnp.int32)
    _, new_state, _ = program.client_update(proxy_params, state, ClientArrays(x, y, jnp.int32(8)),
                                            jax.random.key(2))
    model = architectures.client_model("convnet3", 3, 4, spec, projection_scales=2)
    proxy = architectures.proxy_model("proxy_cnn", 4, spec, scales=2)
    e_proxy = proxy.apply(proxy_params, x)
    assert e_proxy.shape == (8, 2, 4)

    def loss(p):
        logits, e = model.apply(p, x)
        ce = -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(8), y])
        al = sum(w[s] * jnp.mean((e[:, s] - e_proxy[:, s]) ** 2) for s in range(2))
        return ce + lam * al

    expected = jax.tree.map(lambda p, g: p - lr * g, state.params, jax.grad(loss)(state.params))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 new_state.params, expected)


def test_proxy_scales_are_validated():
    from fl_helpers import tiny_config

    from fedjax_pfedes.engine.validate import validate_config
    from fedjax_pfedes.errors import ConfigError

    for value, message in (("1,x", "not a comma-separated list"), ("0,0", "not all 0"),
                           ("1,0.5", r"need a conv E_proxy \(\['proxy_cnn'\]\)")):
        config = tiny_config()
        config.proxy_scales = value  # tiny_config's E_proxy is proxy_mlp
        with pytest.raises(ConfigError, match=message):
            validate_config(config)
    spec = InputSpec("image", (8, 8, 1), "float32", (0.0,), (1.0,))
    with pytest.raises(ValueError, match="5 weights, but E_proxy 'proxy_cnn' emits at most 4"):
        architectures.proxy_model("proxy_cnn", 4, spec, scales=5)


def test_alignment_loss_at_start_and_end_of_a_participation():
    """align_loss_at_start: the starting private model against the received E_proxy;
    align_loss_at_end: the trained model against the client's trained E_proxy; both on the
    client's first batch of rows (F4's jump pairs them across participations)."""
    from fedjax_pfedes.algorithms.pfedes.alignment import mse_alignment
    from fedjax_pfedes.data.spec import InputSpec

    spec = InputSpec("tabular", (5,), "float32", (0.0,) * 5, (1.0,) * 5)
    alg = pfedes(PFedESConfig(num_classes=3, input_spec=spec, proxy_dim=4, batch_size=4,
                              lr_local=0.1, proxy_arch="proxy_mlp", local_epochs=2))
    program = alg.cohort_program("mlp_small")
    proxy_params = alg.broadcast(alg.init_server(jax.random.key(0)), "")
    state = program.init_client(jax.random.key(1))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(8, 5)), jnp.float32)
    data = ClientArrays(x, jnp.asarray(rng.integers(0, 3, 8), jnp.int32), jnp.int32(3))
    upload, new_state, m = program.client_update(proxy_params, state, data, jax.random.key(2))
    model = architectures.client_model("mlp_small", 3, 4, spec)
    proxy = architectures.proxy_model("proxy_mlp", 4, spec)
    mask = jnp.arange(4) < 3  # 3 real rows among the first batch of 4
    start = mse_alignment(model.apply(state.params, x[:4])[1], proxy.apply(proxy_params, x[:4]),
                          mask)
    end = mse_alignment(model.apply(new_state.params, x[:4])[1], proxy.apply(upload, x[:4]),
                        mask)
    np.testing.assert_allclose(m["align_loss_at_start"], start, rtol=1e-6)
    np.testing.assert_allclose(m["align_loss_at_end"], end, rtol=1e-6)
    assert float(m["align_loss_at_end"]) < float(m["align_loss_at_start"])

    # Without the diagnostics (config.monitor.aggregation_loss = False) the update computes
    # the same upload, state and training metrics, and reports neither diagnostic.
    quiet = pfedes(PFedESConfig(num_classes=3, input_spec=spec, proxy_dim=4, batch_size=4,
                                lr_local=0.1, proxy_arch="proxy_mlp", local_epochs=2,
                                align_diagnostics=False)).cohort_program("mlp_small")
    upload_q, state_q, m_q = quiet.client_update(proxy_params, state, data, jax.random.key(2))
    assert set(m) - set(m_q) == {"align_loss_at_start", "align_loss_at_end"}
    chex.assert_trees_all_equal((upload_q, state_q, m_q),
                                (upload, new_state, {k: m[k] for k in m_q}))


def test_the_alignment_diagnostics_follow_the_aggregation_loss_monitor(monkeypatch):
    import collections

    from fl_helpers import tiny_config

    import fedjax_pfedes.algorithms.pfedes as module
    from fedjax_pfedes.algorithms.registry import get
    from fedjax_pfedes.engine import sections

    built = []
    monkeypatch.setattr(module, "pfedes", built.append)
    for monitor in (True, False):
        config = tiny_config()
        config.monitor.aggregation_loss = monitor
        get("pfedes").build(sections.build_inputs(config, 3, SPEC, 1, collections.Counter()))
    assert [cfg.align_diagnostics for cfg in built] == [True, False]
