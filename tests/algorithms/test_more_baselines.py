"""SCAFFOLD, FedNova, FedBN, FML, FedKD, FedGH and FedMRL: defining math against hand-derived or
numpy references, and runs through the simulator with hand-counted upload sizes."""

import dataclasses

import fl_helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tabular_hetero
from fedjax_pfedes.algorithms.fedavg import fedavg
from fedjax_pfedes.algorithms.fedgh import FedGHConfig
from fedjax_pfedes.algorithms.fedkd import FedKDConfig
from fedjax_pfedes.algorithms.fedmrl import FedMRLConfig
from fedjax_pfedes.data.federated import ClientArrays
from fedjax_pfedes.data.spec import InputSpec
from fedjax_pfedes.engine.loop import run_experiment
from fedjax_pfedes.models import architectures

SPEC = fl_helpers.SPEC
IMAGE = InputSpec("image", (8, 8, 1), "float32", (0.0,), (1.0,))


_cfg = fl_helpers.fedavg_config


def _hetero(config_class, **kw):
    """`config_class` (a method's config) with small settings, where it has those fields."""
    base = dict(num_classes=3, input_spec=SPEC, dim=4, lr_local=0.1, batch_size=4,
                shared_arch="mlp_small")
    base.update(kw)
    fields = {f.name for f in dataclasses.fields(config_class)}
    return config_class(**{k: v for k, v in base.items() if k in fields})


_data = fl_helpers.client_data


def _ce(model, params, data):
    n = int(data.sizes)
    logp = jax.nn.log_softmax(model.apply(params, data.x[:n]))
    return -jnp.mean(logp[jnp.arange(n), data.y[:n]])


def _close(a, b, **kw):
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, **{"rtol": 1e-5, "atol": 1e-6,
                                                                   **kw}), a, b)


# --- SCAFFOLD ---------------------------------------------------------------------------------

def test_scaffold_with_zero_controls_and_one_step_is_fedavg_and_control_is_the_gradient():
    from fedjax_pfedes.algorithms.scaffold import scaffold

    cfg, data = _cfg(), _data()
    sc, fa = scaffold(cfg, {"mlp_small": 4}), fedavg(cfg)
    server = sc.init_server(jax.random.key(0), ("mlp_small",))
    prog = sc.cohort_program("mlp_small")
    state = prog.init_client(jax.random.key(1))
    upload, new_state, m = prog.client_update(sc.broadcast(server, "mlp_small"), state, data,
                                              jax.random.key(2))
    assert float(m["local_steps"]) == 1.0
    x = server.params["mlp_small"]
    fa_upload, _, _ = fa.cohort_program("mlp_small").client_update(
        x, fa.cohort_program("mlp_small").init_client(jax.random.key(1)), data,
        jax.random.key(2))
    _close(upload["params"], fa_upload)
    model = architectures.classifier_model("mlp_small", 3, SPEC)
    grad = jax.grad(lambda p: _ce(model, p, data))(x)
    _close(upload["control_delta"], grad, rtol=1e-4)  # option II: (x - y) / (K lr) = g
    _close(new_state.control, grad, rtol=1e-4)


def test_scaffold_step_uses_the_corrected_gradient_and_server_divides_by_cohort_size():
    from fedjax_pfedes.algorithms.scaffold import scaffold

    cfg, data = _cfg(), _data()
    alg = scaffold(cfg, {"mlp_small": 4})
    server = alg.init_server(jax.random.key(0), ("mlp_small",))
    x = server.params["mlp_small"]
    keys = iter(jax.random.split(jax.random.key(5), 100))
    c = jax.tree.map(lambda a: 0.1 * jax.random.normal(next(keys), a.shape), x)
    ci = jax.tree.map(lambda a: 0.1 * jax.random.normal(next(keys), a.shape), x)
    server = server.replace(control={"mlp_small": c})
    prog = alg.cohort_program("mlp_small")
    state = prog.init_client(jax.random.key(1)).replace(control=ci)
    upload, _, _ = prog.client_update(alg.broadcast(server, "mlp_small"), state, data,
                                      jax.random.key(2))
    model = architectures.classifier_model("mlp_small", 3, SPEC)
    grad = jax.grad(lambda p: _ce(model, p, data))(x)
    expected = jax.tree.map(lambda w, g, cs, cl: w - 0.1 * (g - cl + cs), x, grad, c, ci)
    _close(upload["params"], expected, rtol=1e-4)

    # Server: x <- mean of y (lr_g = 1); c <- c + (sum of deltas of real participants) / N.
    ups = jax.tree.map(lambda a: jnp.stack([a, a + 1.0, a + 100.0]), upload)
    new = alg.server_update(server, {"mlp_small": (ups, jnp.array([1.0, 3.0, 0.0]))})
    _close(new.params["mlp_small"], jax.tree.map(lambda a: a + 0.75, upload["params"]))
    _close(new.control["mlp_small"],
           jax.tree.map(lambda cs, d: cs + (2 * d + 1.0) / 4, c, upload["control_delta"]))


# --- FedNova ----------------------------------------------------------------------------------

def test_fednova_solver_norm_is_the_sum_of_momentum_weights():
    from fedjax_pfedes.algorithms.fednova import local_solver_norm

    rho, tau = 0.9, 7
    # Gradient of step t keeps contributing sum_{j < tau - t} rho^j to the final model.
    direct = sum(sum(rho ** j for j in range(tau - t)) for t in range(tau))
    np.testing.assert_allclose(local_solver_norm(tau, rho), direct, rtol=1e-5)
    assert float(local_solver_norm(tau, 0.0)) == tau


def test_fednova_normalized_aggregate_against_a_hand_example():
    from fedjax_pfedes.algorithms.fednova import normalized_aggregate

    old = {"w": jnp.array([1.0, 2.0])}
    d = {"w": jnp.array([[0.2, -0.4], [0.1, 0.3], [9.0, 9.0]])}  # third slot is padding
    a = jnp.array([2.0, 6.0, 50.0])
    weights = jnp.array([10.0, 30.0, 0.0])
    new, total = normalized_aggregate(old, d, a, weights)
    # p = (1/4, 3/4); tau_eff = 2/4 + 18/4 = 5; mean d = (0.125, 0.125).
    np.testing.assert_allclose(new["w"], [1.0 - 5 * 0.125, 2.0 - 5 * 0.125], rtol=1e-6)
    assert float(total) == 40.0


def test_fednova_with_equal_steps_is_fedavg_and_with_unequal_steps_is_not():
    from fedjax_pfedes.algorithms.fednova import fednova

    cfg = _cfg(batch_size=2, local_momentum=0.9)
    nova, fa = fednova(cfg), fedavg(cfg)
    server = nova.init_server(jax.random.key(0), ("mlp_small",))
    x = server.params["mlp_small"]
    prog_n, prog_a = nova.cohort_program("mlp_small"), fa.cohort_program("mlp_small")

    def round_with(sizes):
        datas = [_data(n=s, capacity=8, seed=i) for i, s in enumerate(sizes)]
        up_n = [prog_n.client_update(x, prog_n.init_client(None), d, jax.random.key(i))[0]
                for i, d in enumerate(datas)]
        up_a = [prog_a.client_update(x, prog_a.init_client(None), d, jax.random.key(i))[0]
                for i, d in enumerate(datas)]
        w = jnp.array(sizes, jnp.float32)
        stack = lambda ups: jax.tree.map(lambda *v: jnp.stack(v), *ups)  # noqa: E731
        new_n = nova.server_update(server, {"mlp_small": (stack(up_n), w)})
        new_a = fa.server_update(fa.init_server(jax.random.key(0), ("mlp_small",)),
                                 {"mlp_small": (stack(up_a), w)})
        return new_n.params["mlp_small"], new_a.params["mlp_small"]

    n_eq, a_eq = round_with([8, 8])
    _close(n_eq, a_eq, rtol=1e-4, atol=1e-5)
    n_ne, a_ne = round_with([2, 8])  # 1 vs 4 local steps
    gap = max(float(jnp.max(jnp.abs(u - v))) for u, v in
              zip(jax.tree.leaves(n_ne), jax.tree.leaves(a_ne), strict=True))
    assert gap > 1e-3


# --- FedBN ------------------------------------------------------------------------------------

def test_batch_norm_statistics_ignore_padded_rows():
    model = architectures.classifier_model("convnet3_bn", 3, IMAGE, allow_batch_norm=True)
    rng = np.random.default_rng(0)
    real = rng.normal(size=(3, 8, 8, 1)).astype(np.float32)
    padded = np.concatenate([real, 1e3 * np.ones((2, 8, 8, 1), np.float32)])
    variables = model.init(jax.random.key(0), jnp.asarray(real))
    out_real, st_real = model.apply(variables, real, train=True, mutable=["batch_stats"])
    out_pad, st_pad = model.apply(variables, padded, train=True,
                                  mask=jnp.array([1, 1, 1, 0, 0], bool), mutable=["batch_stats"])
    _close(st_pad, st_real, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out_pad[:3], out_real, rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # ~7 s
def test_fedbn_never_uploads_or_averages_batch_norm_leaves():
    from fedjax_pfedes.algorithms.fedbn import fedbn

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 6, 8, 8, 1)).astype(np.float32))
    y = jnp.asarray(rng.integers(0, 3, (2, 6)))
    alg = fedbn(_cfg(input_spec=IMAGE, batch_size=3))
    server = alg.init_server(jax.random.key(0), ("convnet3_bn",))
    shared = alg.broadcast(server, "convnet3_bn")
    assert shared and not any("/bn" in k for k in shared)
    prog = alg.cohort_program("convnet3_bn")
    states, uploads = [], []
    for k in range(2):
        state = prog.init_client(jax.random.key(10 + k))
        assert state.local and all("/bn" in name for name in state.local)
        up, new, _ = prog.client_update(shared, state, ClientArrays(x[k], y[k], jnp.int32(6)),
                                        jax.random.key(k))
        assert set(up) == set(shared)
        states.append(new)
        uploads.append(up)
    # Each client's BatchNorm scale moved with its own data: different between clients.
    name = next(n for n in states[0].local if n.endswith("scale"))
    assert not np.allclose(states[0].local[name], states[1].local[name])
    stacked = jax.tree.map(lambda *v: jnp.stack(v), *uploads)
    new_server = alg.server_update(server, {"convnet3_bn": (stacked, jnp.array([1.0, 1.0]))})
    assert set(new_server.shared["convnet3_bn"]) == set(shared)
    _close(new_server.shared["convnet3_bn"],
           jax.tree.map(lambda a, b: (a + b) / 2, uploads[0], uploads[1]))


# --- FML --------------------------------------------------------------------------------------

def test_fml_mutual_losses_against_numpy_and_targets_are_fixed():
    from fedjax_pfedes.algorithms.fml import mutual_losses

    rng = np.random.default_rng(0)
    lp, lm = rng.normal(size=(4, 3)), rng.normal(size=(4, 3))
    y, mask = np.array([0, 2, 1, 0]), np.array([1, 1, 1, 0], bool)

    def softmax(z):
        e = np.exp(z - z.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    pp, pm = softmax(lp)[:3], softmax(lm)[:3]
    ce_p = -np.mean(np.log(pp[np.arange(3), y[:3]]))
    ce_m = -np.mean(np.log(pm[np.arange(3), y[:3]]))
    kl_m_to_p = np.mean(np.sum(pm * (np.log(pm) - np.log(pp)), -1))
    kl_p_to_m = np.mean(np.sum(pp * (np.log(pp) - np.log(pm)), -1))
    loss_p, loss_m, got_ce_p, got_ce_m = mutual_losses(jnp.asarray(lp), jnp.asarray(lm),
                                                       jnp.asarray(y), jnp.asarray(mask), 0.3,
                                                       0.8)
    np.testing.assert_allclose(loss_p, 0.3 * ce_p + 0.7 * kl_m_to_p, rtol=1e-5)
    np.testing.assert_allclose(loss_m, 0.8 * ce_m + 0.2 * kl_p_to_m, rtol=1e-5)
    np.testing.assert_allclose([got_ce_p, got_ce_m], [ce_p, ce_m], rtol=1e-5)
    # The private loss does not move the meme and vice versa.
    g_meme = jax.grad(lambda m: mutual_losses(jnp.asarray(lp), m, jnp.asarray(y),
                                              jnp.asarray(mask), 0.0, 1.0)[0])(jnp.asarray(lm))
    np.testing.assert_array_equal(g_meme, 0.0)


# --- FedKD ------------------------------------------------------------------------------------

def test_fedkd_svd_keeps_the_fewest_singular_values_reaching_the_energy():
    from fedjax_pfedes.algorithms.fedkd import compress_update, energy_threshold, svd_truncate

    rng = np.random.default_rng(0)
    u, _ = np.linalg.qr(rng.normal(size=(6, 4)))
    v, _ = np.linalg.qr(rng.normal(size=(5, 4)))
    s = np.array([3.0, 2.0, 1.0, 0.5])
    m = (u * s) @ v.T
    # Energies 9, 4, 1, 0.25 (total 14.25): 90% needs 9 + 4 = 13 >= 12.825 -> k = 2.
    rebuilt, k = svd_truncate(jnp.asarray(m, jnp.float32), 0.9)
    assert int(k) == 2
    np.testing.assert_allclose(rebuilt, (u[:, :2] * s[:2]) @ v[:, :2].T, atol=1e-5)
    assert int(svd_truncate(jnp.asarray(m, jnp.float32), 0.99)[1]) == 4
    tree = {"kernel": jnp.asarray(m, jnp.float32), "bias": jnp.ones(5)}
    _, sent = compress_update(tree, 0.9)
    assert float(sent) == 2 * (6 + 5 + 1) + 5
    cfg = _hetero(FedKDConfig, rounds=11, energy_start=0.9, energy_end=0.95)
    np.testing.assert_allclose([energy_threshold(0, cfg), energy_threshold(5, cfg),
                                energy_threshold(10, cfg)], [0.9, 0.925, 0.95], rtol=1e-6)


def test_fedkd_uploads_the_compressed_mentee_update_and_server_adds_the_mean():
    from fedjax_pfedes.algorithms.fedkd import fedkd

    alg = fedkd(_hetero(FedKDConfig, energy_start=0.5, energy_end=0.5))
    server = alg.init_server(jax.random.key(0), ("mlp",))
    prog = alg.cohort_program("mlp")
    up, _, m = prog.client_update(alg.broadcast(server, "mlp"), prog.init_client(
        jax.random.key(1)), _data(), jax.random.key(2))
    dense = sum(a.size for a in jax.tree.leaves(server.mentee))
    assert 0 < float(m["upload_encoded_params"]) < dense
    stacked = jax.tree.map(lambda a: jnp.stack([a, 3 * a]), up)
    new = alg.server_update(server, {"mlp": (stacked, jnp.array([1.0, 1.0]))})
    _close(new.mentee, jax.tree.map(lambda w, d: w + 2 * d, server.mentee, up))


# --- FedGH ------------------------------------------------------------------------------------

def test_fedgh_server_header_training_matches_per_pair_sgd_in_numpy():
    from fedjax_pfedes.algorithms.fedgh import train_header_on_prototypes

    rng = np.random.default_rng(0)
    w0, b0 = rng.normal(size=(4, 3)), rng.normal(size=3)
    protos = rng.normal(size=(5, 4))
    labels = np.array([0, 1, 2, 1, 0])
    valid = np.array([1, 1, 0, 1, 1], bool)
    lr, epochs = 0.3, 2
    w, b = w0.copy(), b0.copy()
    for _ in range(epochs):
        for p, c, ok in zip(protos, labels, valid, strict=True):
            if not ok:
                continue
            z = p @ w + b
            prob = np.exp(z - z.max())
            prob /= prob.sum()
            prob[c] -= 1.0
            w -= lr * np.outer(p, prob)
            b -= lr * prob
    head = {"kernel": jnp.asarray(w0, jnp.float32), "bias": jnp.asarray(b0, jnp.float32)}
    got = train_header_on_prototypes(head, lambda h, e: e @ h["kernel"] + h["bias"],
                                     jnp.asarray(protos, jnp.float32), jnp.asarray(labels),
                                     jnp.asarray(valid), lr, epochs)
    np.testing.assert_allclose(got["kernel"], w, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got["bias"], b, rtol=1e-4, atol=1e-5)


def test_fedgh_uploads_class_prototypes_of_its_trained_model_with_the_global_header():
    from fedjax_pfedes.algorithms.fedgh import fedgh
    from fedjax_pfedes.algorithms.fedproto import class_prototypes

    alg = fedgh(_hetero(FedGHConfig))
    server = alg.init_server(jax.random.key(0), ("mlp",))
    prog = alg.cohort_program("mlp")
    data = _data()
    up, state, _ = prog.client_update(server.head, prog.init_client(jax.random.key(1)), data,
                                      jax.random.key(2))
    model = architectures.projected_classifier("mlp", 3, 4, SPEC)
    _, e = model.apply(state.params, data.x)
    protos, counts = class_prototypes(e, data.y, jnp.arange(8) < 8, 3)
    _close(up["prototypes"], protos)
    np.testing.assert_array_equal(up["counts"], np.bincount(np.asarray(data.y), minlength=3))


# --- FedMRL -----------------------------------------------------------------------------------

def test_fedmrl_shares_the_small_model_and_its_header_reads_only_the_nested_prefix():
    from fedjax_pfedes.algorithms.fedmrl import SHARED_KEYS, MatryoshkaModel, fedmrl

    alg = fedmrl(_hetero(FedMRLConfig, dim=6, sub_dim=2))
    server = alg.init_server(jax.random.key(0), ("mlp",))
    assert set(server.shared) == set(SHARED_KEYS)
    assert server.shared["shared_header"]["kernel"].shape == (2, 3)
    model = MatryoshkaModel("mlp", "mlp_small", 3, 6, 2, SPEC)
    params = model.init(jax.random.key(1), jnp.zeros((1, 5)))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 5)), jnp.float32)
    private, shared = model.apply(params, x)
    bumped = jax.tree.map(lambda a: a, params)
    kernel = bumped["params"]["projector"]["kernel"]
    bumped["params"]["projector"]["kernel"] = kernel.at[:, 2:].add(1.0)  # dims past d1
    private2, shared2 = model.apply(bumped, x)
    np.testing.assert_allclose(shared2, shared, rtol=1e-6)
    assert not np.allclose(private2, private)
    prog = alg.cohort_program("mlp")
    up, state, _ = prog.client_update(server.shared, prog.init_client(jax.random.key(2)),
                                      _data(), jax.random.key(3))
    assert set(up) == set(SHARED_KEYS)
    _close(up, {k: state.params["params"][k] for k in SHARED_KEYS})


# --- through the simulator, with hand-counted upload sizes ------------------------------------

# tabular_hetero: 30 features, 2 classes, d = 32; every client runs mlp_small (Dense 30->64).
MLP_SMALL = 30 * 64 + 64 + 64 * 2 + 2
UPLOADS = {
    "scaffold": 2 * MLP_SMALL,                      # model + control delta
    "fednova": MLP_SMALL + 1,                       # normalized update + ||a_i||_1
    "fedbn": MLP_SMALL,                             # mlp_small has no BatchNorm
    "fml": MLP_SMALL,                               # the meme (shared_arch = mlp_small)
    "fedgh": 2 * 32 + 2,                            # prototypes [2, d] + counts [2]
    "fedmrl": (30 * 64 + 64) + (16 * 2 + 2),      # G (mlp_small), shared header d1=16 -> 2
}


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", [*UPLOADS, "fedkd"])
def test_new_methods_run_through_the_simulator_with_hand_counted_uploads(algorithm, tmp_path):
    config = tabular_hetero.get_config()
    config.algorithm = algorithm
    config.train.rounds = 2
    config.eval.every = 1
    config.clients.architectures = "mlp_small"
    summary = run_experiment(config, str(tmp_path), show_progress=False)
    final = summary["final"]
    assert 0.0 <= final["personalized_accuracy_mean"] <= 1.0
    assert np.isfinite(final["train_ce_loss_mean"])
    if algorithm == "fedkd":
        # Mentee = ProjectedClassifier(mlp_small, d=32): dense size; SVD sends fewer numbers.
        dense = (30 * 64 + 64) + (64 * 32 + 32) + (32 * 2 + 2)
        assert 0 < final["upload_params_per_client"] < dense
    else:
        assert final["upload_params_per_client"] == UPLOADS[algorithm]
        assert final["upload_bytes_per_client"] == 4 * UPLOADS[algorithm]


def test_batch_norm_backbones_are_refused_outside_fedbn():
    from configs import quickstart
    from fedjax_pfedes.engine.validate import validate_config
    from fedjax_pfedes.errors import ConfigError

    config = quickstart.get_config()
    config.clients.architectures = "convnet3_bn,vit"
    config.algorithm = "fedavg"
    with pytest.raises(ConfigError, match="config.clients.architectures.*BatchNorm.*fedbn"):
        validate_config(config)
    config.algorithm = "fedbn"
    validate_config(config)


@pytest.mark.parametrize("offloaded", [False, True])
def test_scaffold_client_keeps_its_control_variate_when_its_upload_is_rejected(offloaded,
                                                                               tmp_path):
    """The server drops a rejected client's control delta, so the client must keep c_i: else
    c stops being the mean of the clients' controls (checked here: c = (1/N) sum_i c_i), with
    the states on the device and in host memory."""
    from fedjax_pfedes.engine import rounds
    from fedjax_pfedes.engine.build import build_context, build_federated_data
    from fedjax_pfedes.execution import offload

    config = fl_helpers.tiny_config(rounds=2, num_clients=4)
    config.algorithm = "scaffold"
    if offloaded:
        config.execution.client_states = "offload"
        config.execution.client_state_dir = str(tmp_path / "states")
    config.train.client_fraction = 1.0
    config.attack.clients, config.attack.kind = "0", "nan"  # rejected by the finiteness check
    ctx, state = build_context(config, build_federated_data(config))
    (cohort,) = ctx.cohorts
    everyone = np.arange(len(cohort.client_ids))
    initial = offload.read_rows(state.clients[cohort.arch], everyone)
    for r in range(2):
        state, _, rows, rejections = rounds.sync_round(ctx, state, r)
        assert [x["client"] for x in rejections] == [0]
        assert {x["client"] for x in rows if x["accepted"]} == {1, 2, 3}
    controls = offload.read_rows(state.clients[cohort.arch], everyone).control
    jax.tree.map(lambda c, c0: np.testing.assert_array_equal(c[0], c0[0]), controls,
                 initial.control)
    moved = jax.tree.map(lambda c: float(np.abs(c[1:]).max()), controls)
    assert max(jax.tree.leaves(moved)) > 0  # the accepted clients' controls did change
    server_c = state.server.control[cohort.arch]
    jax.tree.map(lambda c, s: np.testing.assert_allclose(np.asarray(c).mean(0), s, rtol=1e-5,
                                                         atol=1e-7), controls, server_c)
