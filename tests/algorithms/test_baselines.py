"""FedAvg family and Standalone: defining math against hand-derived references."""

import fl_helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tabular_hetero
from fedjax_pfedes.algorithms.fedavg import (
    FedAdamSection,
    FedAvgMSection,
    FedProxSection,
    fedavg,
)
from fedjax_pfedes.algorithms.fedproto import FedProtoConfig
from fedjax_pfedes.algorithms.lg_fedavg import LGFedAvgConfig
from fedjax_pfedes.algorithms.standalone import standalone
from fedjax_pfedes.data.federated import ClientArrays
from fedjax_pfedes.data.spec import InputSpec
from fedjax_pfedes.engine.loop import run_experiment
from fedjax_pfedes.tree_util import tree_size

SPEC = fl_helpers.SPEC


_cfg = fl_helpers.fedavg_config


_data = fl_helpers.client_data


def _reference_ce(model, params, x, y):
    logp = jax.nn.log_softmax(model.apply(params, x))
    return -jnp.mean(logp[jnp.arange(len(y)), y])


def test_fedavg_local_update_is_sgd_on_the_clients_data():
    alg = fedavg(_cfg())
    server = alg.init_server(jax.random.key(0), ("mlp_small",))
    program = alg.cohort_program("mlp_small")
    data = _data()
    upload, _, metrics = program.client_update(server.params["mlp_small"],
                                               program.init_client(jax.random.key(1)), data,
                                               jax.random.key(2))
    from fedjax_pfedes.models import architectures

    model = architectures.classifier_model("mlp_small", 3, SPEC)
    w0 = server.params["mlp_small"]
    grads = jax.grad(lambda p: _reference_ce(model, p, data.x, data.y))(w0)
    expected = jax.tree.map(lambda w, g: w - 0.1 * g, w0, grads)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 upload, expected)
    assert float(metrics["local_steps"]) == 1.0


@pytest.mark.slow  # ~4 s; FedProx by hand stays fast
def test_fedprox_with_mu_zero_equals_fedavg_and_mu_pulls_toward_the_global_model():
    data = _data(n=16, capacity=16)
    cfg = dict(batch_size=4, local_epochs=2)
    runs = {}
    for name, mu in (("fedavg", 0.0), ("fedprox0", 0.0), ("fedprox", 5.0)):
        alg = fedavg(_cfg(section=FedProxSection(mu=mu), **cfg))
        server = alg.init_server(jax.random.key(0), ("mlp",))
        program = alg.cohort_program("mlp")
        runs[name] = (server.params["mlp"], program.client_update(
            server.params["mlp"], program.init_client(jax.random.key(1)), data,
            jax.random.key(3))[0])
    jax.tree.map(np.testing.assert_array_equal, runs["fedavg"][1], runs["fedprox0"][1])

    def drift(name):
        w0, w = runs[name]
        return float(sum(jnp.sum((a - b) ** 2) for a, b in
                         zip(jax.tree.leaves(w), jax.tree.leaves(w0), strict=True)))

    assert drift("fedprox") < drift("fedavg")


def test_fedprox_two_steps_match_the_proximal_gradient_by_hand():
    """Step 1 starts at w_g (prox gradient 0); step 2 adds mu * (w1 - w_g)."""
    mu, lr = 3.0, 0.1
    data = _data(n=16, capacity=16)
    alg = fedavg(_cfg(section=FedProxSection(mu=mu), batch_size=16, local_epochs=2,
                      lr_local=lr))
    server = alg.init_server(jax.random.key(0), ("mlp_small",))
    program = alg.cohort_program("mlp_small")
    upload, _, _ = program.client_update(server.params["mlp_small"],
                                         program.init_client(jax.random.key(1)), data,
                                         jax.random.key(2))
    from fedjax_pfedes.models import architectures

    model = architectures.classifier_model("mlp_small", 3, SPEC)
    wg = server.params["mlp_small"]
    ce_grad = jax.grad(lambda p: _reference_ce(model, p, data.x, data.y))
    w1 = jax.tree.map(lambda w, g: w - lr * g, wg, ce_grad(wg))
    w2 = jax.tree.map(lambda w, g, w_g: w - lr * (g + mu * (w - w_g)), w1, ce_grad(w1), wg)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), upload, w2)


def _uploads_with_average(old, average, weights):
    """Two stacked uploads whose weighted mean is `average`."""
    w = np.asarray(weights, np.float64) / np.sum(weights)
    first = jax.tree.map(lambda a: a + 1.0, average)
    second = jax.tree.map(lambda a, f: (a - w[0] * f) / w[1], average, first)
    del old
    return jax.tree.map(lambda a, b: jnp.stack([a, b]), first, second)


def test_server_averages_per_cohort_by_sample_counts_and_skips_empty_cohorts():
    alg = fedavg(_cfg())
    server = alg.init_server(jax.random.key(0), ("mlp", "mlp_small"))
    ups = jax.tree.map(lambda a: jnp.stack([a + 1.0, a - 2.0]), server.params["mlp"])
    new = alg.server_update(server, {"mlp": (ups, jnp.array([30.0, 10.0])),
                                     "mlp_small": (jax.tree.map(lambda a: jnp.stack([a, a]) + 9,
                                                                server.params["mlp_small"]),
                                                   jnp.zeros(2))})
    expected = jax.tree.map(lambda a: a + 0.75 * 1.0 + 0.25 * -2.0, server.params["mlp"])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6),
                 new.params["mlp"], expected)
    jax.tree.map(np.testing.assert_array_equal, new.params["mlp_small"],
                 server.params["mlp_small"])


def test_fedavgm_applies_heavy_ball_momentum_to_the_pseudo_gradient():
    lr, beta = 0.5, 0.9
    alg = fedavg(_cfg(section=FedAvgMSection(server_lr=lr, server_momentum=beta)))
    s0 = alg.init_server(jax.random.key(0), ("mlp_small",))
    g = 0.2  # every round the clients' average sits 0.2 below the current model
    weights = jnp.array([1.0, 3.0])
    w0 = s0.params["mlp_small"]
    s1 = alg.server_update(s0, {"mlp_small": (_uploads_with_average(
        w0, jax.tree.map(lambda a: a - g, w0), weights), weights)})
    w1 = s1.params["mlp_small"]
    s2 = alg.server_update(s1, {"mlp_small": (_uploads_with_average(
        w1, jax.tree.map(lambda a: a - g, w1), weights), weights)})
    # v1 = g, w1 = w0 - lr g; v2 = beta g + g, w2 = w1 - lr (1 + beta) g.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b - lr * g, atol=1e-5), w1, w0)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b - lr * (1 + beta) * g, atol=1e-5),
                 s2.params["mlp_small"], w1)


def test_fedadam_first_step_is_lr_times_sign_scaled_by_eps():
    lr, eps = 0.01, 1e-3
    alg = fedavg(_cfg(section=FedAdamSection(server_lr=lr, eps=eps)))
    s0 = alg.init_server(jax.random.key(0), ("mlp_small",))
    w0 = s0.params["mlp_small"]
    g = 0.05
    weights = jnp.array([2.0, 2.0])
    s1 = alg.server_update(s0, {"mlp_small": (_uploads_with_average(
        w0, jax.tree.map(lambda a: a - g, w0), weights), weights)})
    # Bias-corrected first Adam step: m = g, v = g^2, update = -lr * g / (|g| + eps).
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b - lr * g / (g + eps), atol=1e-6),
                 s1.params["mlp_small"], w0)


def test_standalone_uploads_nothing_and_continues_from_its_own_state():
    alg = standalone(_cfg(batch_size=4))
    program = alg.cohort_program("mlp_small")
    server = alg.init_server(jax.random.key(0), ("mlp_small",))
    state = program.init_client(jax.random.key(1))
    data = _data(n=8, capacity=8)
    upload, state1, _ = program.client_update(alg.broadcast(server, "mlp_small"), state, data,
                                              jax.random.key(2))
    _, state2, _ = program.client_update({}, state1, data, jax.random.key(3))
    assert upload == {} and alg.upload_template(server, "mlp_small") == {}
    assert tree_size(upload) == (0, 0)
    assert int(alg.server_update(server, {}).round) == 1
    changed = jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.any(a != b)), state1.params,
                                           state2.params))
    assert any(changed)  # the second round trained further from the first round's model


def test_tree_size_counts_parameters_and_bytes():
    tree = {"a": jnp.zeros((3, 4)), "b": {"c": jnp.zeros(5, jnp.bfloat16)}}
    assert tree_size(tree) == (17, 12 * 4 + 5 * 2)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["pfedes", "fedavg", "standalone"])
def test_runs_report_upload_and_download_sizes(algorithm, tmp_path):
    config = tabular_hetero.get_config()
    config.algorithm = algorithm
    config.train.rounds = 1
    config.clients.architectures = "mlp_small"
    summary = run_experiment(config, str(tmp_path), show_progress=False)
    final = summary["final"]
    if algorithm == "pfedes":
        # proxy_mlp on 30 features: Dense 30->128, then out 128->32 (proxy_dim).
        expected = 30 * 128 + 128 + 128 * 32 + 32
    elif algorithm == "fedavg":
        # mlp_small: Dense 30->64, classifier 64->2.
        expected = 30 * 64 + 64 + 64 * 2 + 2
    else:
        expected = 0
    assert final["upload_params_per_client"] == expected
    assert final["download_params_per_client"] == expected
    assert final["upload_bytes_per_client"] == 4 * expected


def test_published_pfedes_proxy_g_has_443_parameters_on_rgb():
    from fedjax_pfedes.algorithms.pfedes_paper import PFedESPaperConfig, pfedes_paper

    spec = InputSpec("image", (32, 32, 3), "uint8", (0.5,) * 3, (0.25,) * 3)
    alg = pfedes_paper(PFedESPaperConfig(num_classes=10, input_spec=spec))
    server = alg.init_server(jax.random.key(0))
    assert tree_size(server.g_params)[0] == 443 == (3 * 3 * 3 * 8 + 8) + (3 * 3 * 8 * 3 + 3)


def test_published_pfedes_interleaved_alternation_matches_a_hand_reference():
    """schedule='interleaved': F_k steps on (1-mu) CE(F(x)) + mu CE(F(G(x))) with G fixed; then
    G steps on CE(F_new(G(x))) with F fixed at its new value; the upload is G."""
    from fedjax_pfedes.algorithms.pfedes_paper import PFedESPaperConfig, pfedes_paper
    from fedjax_pfedes.models import architectures

    spec = InputSpec("image", (6, 6, 3), "float32", (0.4,) * 3, (0.3,) * 3)
    mu, lr, ratio = 0.3, 0.1, 0.5
    alg = pfedes_paper(PFedESPaperConfig(num_classes=3, input_spec=spec, mu=mu, lr_local=lr,
                                         g_lr_ratio=ratio, batch_size=8,
                                         schedule="interleaved", local_momentum=0.0,
                                         local_epochs=1,
                                         weight_decay=0.0, grad_clip_norm=0.0))
    server = alg.init_server(jax.random.key(0))
    program = alg.cohort_program("mlp_small")
    state = program.init_client(jax.random.key(1))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.uniform(size=(8, 6, 6, 3)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 3, 8), jnp.int32)
    upload, new_state, _ = program.client_update(server.g_params, state,
                                                 ClientArrays(x, y, jnp.int32(8)),
                                                 jax.random.key(2))
    model = architectures.classifier_model("mlp_small", 3, spec)
    g_model = architectures.ImageProxyG(spec)

    def ce(logits):
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(8), y])

    g0, f0 = server.g_params, state.params
    gx = g_model.apply(g0, x)
    f_grad = jax.grad(lambda p: (1 - mu) * ce(model.apply(p, x))
                      + mu * ce(model.apply(p, gx, True)))(f0)
    f1 = jax.tree.map(lambda w, g: w - lr * g, f0, f_grad)
    g_grad = jax.grad(lambda q: ce(model.apply(f1, g_model.apply(q, x), True)))(g0)
    g1 = jax.tree.map(lambda w, g: w - ratio * lr * g, g0, g_grad)
    close = {"rtol": 1e-4, "atol": 1e-6}
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **close), new_state.params, f1)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **close), upload, g1)


def _torch_sgd(params, grads_fn, steps, lr, momentum, wd, clip):
    """Hand reference of `clip_grad_norm_(clip)` + `torch.optim.SGD(lr, momentum, wd)`."""
    buf = None
    for _ in range(steps):
        g = grads_fn(params)
        scale = min(1.0, clip / np.sqrt(sum(float(jnp.sum(v ** 2)) for v in jax.tree.leaves(g))))
        g = jax.tree.map(lambda v, s=scale: v * s, g)
        g = jax.tree.map(lambda v, w: v + wd * w, g, params)
        buf = g if buf is None else jax.tree.map(lambda b, v: momentum * b + v, buf, g)
        params = jax.tree.map(lambda w, b: w - lr * b, params, buf)
    return params


def test_published_pfedes_paper_schedule_matches_a_hand_reference():
    """schedule='paper' (the authors' code): F trains E epochs with G frozen, then G trains
    E + extra epochs through the new F; both SGD with momentum and weight decay after
    global-norm clipping, fresh optimizers. Full-batch epochs make every step deterministic."""
    from fedjax_pfedes.algorithms.pfedes_paper import PFedESPaperConfig, pfedes_paper
    from fedjax_pfedes.models import architectures

    spec = InputSpec("image", (6, 6, 3), "float32", (0.4,) * 3, (0.3,) * 3)
    mu, lr, ratio, m, wd, clip, epochs, extra = 0.3, 0.1, 0.5, 0.9, 0.01, 0.5, 2, 1
    alg = pfedes_paper(PFedESPaperConfig(
        num_classes=3, input_spec=spec, mu=mu, lr_local=lr, g_lr_ratio=ratio, batch_size=8,
        local_momentum=m, weight_decay=wd, grad_clip_norm=clip, local_epochs=epochs,
        g_extra_epochs=extra))
    server = alg.init_server(jax.random.key(0))
    program = alg.cohort_program("mlp_small")
    state = program.init_client(jax.random.key(1))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.uniform(size=(8, 6, 6, 3)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 3, 8), jnp.int32)
    upload, new_state, metrics = program.client_update(
        server.g_params, state, ClientArrays(x, y, jnp.int32(8)), jax.random.key(2))
    assert float(metrics["local_steps"]) == epochs + epochs + extra
    model = architectures.classifier_model("mlp_small", 3, spec)
    g_model = architectures.ImageProxyG(spec)

    def ce(logits):
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(8), y])

    g0 = server.g_params
    gx = g_model.apply(g0, x)
    f1 = _torch_sgd(state.params, jax.grad(lambda p: (1 - mu) * ce(model.apply(p, x))
                                           + mu * ce(model.apply(p, gx, True))),
                    epochs, lr, m, wd, clip)
    g1 = _torch_sgd(g0, jax.grad(lambda q: ce(model.apply(f1, g_model.apply(q, x), True))),
                    epochs + extra, ratio * lr, m, wd, clip)
    close = {"rtol": 2e-4, "atol": 1e-6}
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **close), new_state.params, f1)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **close), upload, g1)


def test_published_pfedes_paper_step_counts_per_phase():
    """n = 8 rows, batch 4: F runs E x 2 steps, G (E + extra) x 2; an adaptive-epoch cap of
    one epoch on F gives G 1 + extra epochs."""
    from fedjax_pfedes.algorithms.pfedes_paper import PFedESPaperConfig, pfedes_paper

    spec = InputSpec("image", (6, 6, 3), "float32", (0.4,) * 3, (0.3,) * 3)
    alg = pfedes_paper(PFedESPaperConfig(num_classes=3, input_spec=spec, batch_size=4,
                                         local_epochs=2, g_extra_epochs=3))
    program = alg.cohort_program("mlp_small")
    g = alg.init_server(jax.random.key(0)).g_params
    x = jnp.zeros((8, 6, 6, 3), jnp.float32)
    y = jnp.zeros((8,), jnp.int32)
    state = program.init_client(jax.random.key(1))
    _, _, metrics = program.client_update(g, state, ClientArrays(x, y, jnp.int32(8)),
                                          jax.random.key(2))
    assert float(metrics["local_steps"]) == 2 * 2 + (2 + 3) * 2
    capped = ClientArrays(x, y, jnp.int32(8), jnp.int32(2))  # one epoch of F
    _, _, metrics = program.client_update(g, state, capped, jax.random.key(2))
    assert float(metrics["local_steps"]) == 1 * 2 + (1 + 3) * 2


def _hetero(config_class, **kw):
    """`config_class` (a method's config) with small settings."""
    base = dict(num_classes=3, input_spec=SPEC, dim=4, lr_local=0.1, batch_size=4)
    base.update(kw)
    return config_class(**base)


def test_fedproto_uploads_numpy_class_means_of_its_embeddings():
    from fedjax_pfedes.algorithms.fedproto import fedproto
    from fedjax_pfedes.models import architectures

    alg = fedproto(_hetero(FedProtoConfig))
    server = alg.init_server(jax.random.key(0))
    program = alg.cohort_program("mlp_small")
    data = _data(n=6, capacity=8, seed=3)
    upload, state, _ = program.client_update(alg.broadcast(server), program.init_client(
        jax.random.key(1)), data, jax.random.key(2))
    model = architectures.projected_classifier("mlp_small", 3, 4, SPEC)
    e = np.asarray(model.apply(state.params, data.x)[1])[:6]
    y = np.asarray(data.y)[:6]
    for c in range(3):
        count = int(np.sum(y == c))
        assert float(upload["counts"][c]) == count
        expected = e[y == c].mean(0) if count else np.zeros(4)
        np.testing.assert_allclose(upload["prototypes"][c], expected, rtol=1e-5, atol=1e-6)


def test_fedproto_server_takes_count_weighted_class_means_and_keeps_unseen_classes():
    from fedjax_pfedes.algorithms.fedproto import fedproto, nearest_prototype

    alg = fedproto(_hetero(FedProtoConfig, num_classes=3, dim=2))
    server = alg.init_server(jax.random.key(0))
    server = server.replace(prototypes=jnp.full((3, 2), 7.0))
    protos_a = jnp.array([[[1.0, 0.0], [2.0, 2.0], [0.0, 0.0]],
                          [[3.0, 4.0], [9.0, 9.0], [0.0, 0.0]]])
    counts_a = jnp.array([[1.0, 2.0, 0.0], [3.0, 5.0, 0.0]])
    protos_b = jnp.array([[[5.0, 5.0], [4.0, 0.0], [0.0, 0.0]]])
    counts_b = jnp.array([[4.0, 2.0, 0.0]])
    new = alg.server_update(server, {
        "a": ({"prototypes": protos_a, "counts": counts_a}, jnp.array([1.0, 0.0])),  # slot 2 pad
        "b": ({"prototypes": protos_b, "counts": counts_b}, jnp.array([9.0]))})
    # class 0: (1*[1,0] + 4*[5,5]) / 5; class 1: (2*[2,2] + 2*[4,0]) / 4; class 2: unseen.
    np.testing.assert_allclose(new.prototypes, [[21 / 5, 20 / 5], [3.0, 1.0], [7.0, 7.0]],
                               rtol=1e-6)
    np.testing.assert_array_equal(new.available, [True, True, False])
    e = jnp.array([[3.0, 1.2], [7.0, 7.0]])
    np.testing.assert_array_equal(nearest_prototype(e, new.prototypes, new.available), [1, 0])


def test_lg_fedavg_shares_only_the_head():
    from fedjax_pfedes.algorithms.lg_fedavg import lg_fedavg

    alg = lg_fedavg(_hetero(LGFedAvgConfig))
    server = alg.init_server(jax.random.key(0), ("mlp_small", "mlp"))
    program = alg.cohort_program("mlp")
    state = program.init_client(jax.random.key(1))
    upload, new_state, _ = program.client_update(server.head, state, _data(), jax.random.key(2))
    assert set(upload) == {"kernel", "bias"} and upload["kernel"].shape == (4, 3)
    jax.tree.map(np.testing.assert_array_equal, upload,
                 new_state.params["params"]["classifier"])
    ups = jax.tree.map(lambda a: jnp.stack([a, a + 2.0]), upload)
    new = alg.server_update(server, {"mlp": (ups, jnp.array([1.0, 3.0]))})
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b + 1.5, rtol=1e-6), new.head,
                 upload)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["lg_fedavg", "fedproto", "fedprox", "fedavgm"])
def test_heterogeneous_and_drift_methods_run_through_the_simulator(algorithm, tmp_path):
    config = tabular_hetero.get_config()
    config.algorithm = algorithm
    config.train.rounds = 10
    config.eval.every = 5
    summary = run_experiment(config, str(tmp_path), show_progress=False)
    assert set(summary["final"]["personalized_accuracy_by_arch"]) == {"mlp", "mlp_small",
                                                                        "mlp_deep"}
    accuracy = summary["final"]["personalized_accuracy_mean"]
    majority = summary["majority_class_accuracy_mean"]  # 0.78 here
    if algorithm == "fedproto":
        # FedProto predicts by the nearest GLOBAL prototype (as the paper evaluates); with
        # three architectures' embeddings tied only through the prototype loss it measured
        # 0.70-0.73 after 10-20 rounds, below the majority label: a finding, not asserted away.
        assert 0.5 <= accuracy <= 1.0
    else:  # measured 0.94-0.96 after 10 rounds
        assert accuracy > majority + 0.05
