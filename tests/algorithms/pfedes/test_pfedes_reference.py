"""pFedES against a reference written from the method's description with plain `jax.numpy`
parameters: no model, loss, optimizer or aggregation code of the project is used below
`_reference`. It sees model bugs the project's own references cannot (they share its model code):
a classifier reading P_k(z) instead of z, a removed stop-gradient, an ignored lambda, E_proxy's
momentum dropped, a wrong proxy learning-rate rule or server smoothing all fail it.

Setting: 2 clients on 5 tabular features (standardized with mean 0 / std 1, so the input
normalization is the identity), 3 classes, mlp_small private backbones, proxy_mlp E_proxy, 3 local
steps a round (3 epochs of one batch holding all of a client's rows: the shuffle cannot change a
masked mean), 2 rounds, every client participates.
"""

import fl_helpers
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pfedes.algorithms.pfedes import PFedESConfig, pfedes

LAM, LR, M, M_PROXY, RATIO, BETA = 0.7, 0.05, 0.9, 0.5, 0.1, 0.5
SIZES = (8, 6)  # real rows of each client (capacity 8: client 1 has 2 padded rows)
ROUNDS, STEPS = 2, 3


def _config() -> PFedESConfig:
    return PFedESConfig(num_classes=3, input_spec=fl_helpers.SPEC, lr_local=LR, batch_size=8,
                        local_epochs=STEPS, proxy_dim=4, proxy_arch="proxy_mlp", lam=LAM,
                        local_momentum=M, proxy_momentum=M_PROXY, proxy_lr_ratio=RATIO,
                        server_momentum=BETA, align_diagnostics=False)


# ------------------------------------------------------------------ the plain reference


def _relu(v):
    return jnp.maximum(v, 0.0)


def _client_forward(p, x):
    """(logits, e_local) of the private model: z = relu(x W1 + b1), logits = z Wc + bc (the
    classifier reads z), e = relu(z Wp + bp)."""
    z = _relu(x @ p["W1"] + p["b1"])
    return z @ p["Wc"] + p["bc"], _relu(z @ p["Wp"] + p["bp"])


def _proxy_forward(q, x):
    return _relu(x @ q["V1"] + q["c1"]) @ q["Vo"] + q["co"]


def _masked_mean(v, mask):
    return jnp.sum(v * mask) / jnp.sum(mask)


def _ce(logits, y, mask):
    logp = logits - jax.scipy.special.logsumexp(logits, axis=-1, keepdims=True)
    return _masked_mean(-jnp.take_along_axis(logp, y[:, None], axis=-1)[:, 0], mask)


def _mse(a, b, mask):
    return _masked_mean(jnp.mean((a - b) ** 2, axis=-1), mask)


def _reference(p0s, q0, data):
    """Final private parameters per client and the server's E_proxy after ROUNDS rounds."""
    lr_proxy = RATIO * LR * (1 - M_PROXY) / (1 - M)  # a ratio of effective steps
    ps = [dict(p) for p in p0s]
    traces = [{k: jnp.zeros_like(v) for k, v in p.items()} for p in ps]  # kept across rounds
    q = dict(q0)
    for _ in range(ROUNDS):
        locals_ = []
        for k, (x, y, mask) in enumerate(data):
            p, t, qk = ps[k], traces[k], dict(q)
            tq = {n: jnp.zeros_like(v) for n, v in qk.items()}  # E_proxy's trace: fresh
            for _ in range(STEPS):
                target = _proxy_forward(qk, x)  # a constant in the private step

                def private_loss(p, x=x, y=y, mask=mask, target=target):
                    logits, e = _client_forward(p, x)
                    return _ce(logits, y, mask) + LAM * _mse(e, target, mask)

                g = jax.grad(private_loss)(p)
                e_const = _client_forward(p, x)[1]  # same forward pass, before the update
                gq = jax.grad(lambda q, x=x, mask=mask, e=e_const: _mse(
                    _proxy_forward(q, x), e, mask))(qk)
                t = {n: g[n] + M * t[n] for n in p}
                p = {n: p[n] - LR * t[n] for n in p}
                tq = {n: gq[n] + M_PROXY * tq[n] for n in qk}
                qk = {n: qk[n] - lr_proxy * tq[n] for n in qk}
            ps[k], traces[k] = p, t
            locals_.append(qk)
        w = np.asarray(SIZES, np.float64) / sum(SIZES)
        avg = {n: sum(wk * lk[n] for wk, lk in zip(w, locals_, strict=True)) for n in q}
        q = {n: BETA * q[n] + (1 - BETA) * avg[n] for n in q}
    return ps, q


# ------------------------------------------------------------------ the simulator's pFedES


def _flat_client(params):
    p = params["params"]
    return {"W1": p["backbone"]["fc1"]["kernel"], "b1": p["backbone"]["fc1"]["bias"],
            "Wp": p["projection"]["Dense_0"]["kernel"], "bp": p["projection"]["Dense_0"]["bias"],
            "Wc": p["classifier"]["kernel"], "bc": p["classifier"]["bias"]}


def _flat_proxy(params):
    p = params["params"]
    return {"V1": p["MLP_0"]["fc1"]["kernel"], "c1": p["MLP_0"]["fc1"]["bias"],
            "Vo": p["out"]["kernel"], "co": p["out"]["bias"]}


def _run(cfg: PFedESConfig):
    alg = pfedes(cfg)
    program = alg.cohort_program("mlp_small")
    server = alg.init_server(jax.random.key(0))
    clients = [program.init_client(jax.random.key(10 + k)) for k in range(len(SIZES))]
    arrays = [fl_helpers.client_data(n=n, capacity=8, seed=k) for k, n in enumerate(SIZES)]
    start = ([_flat_client(c.params) for c in clients], _flat_proxy(server.proxy_params), arrays)
    update = jax.jit(program.client_update)
    server_update = jax.jit(alg.server_update)
    for r in range(ROUNDS):
        uploads = []
        for k in range(len(SIZES)):
            up, clients[k], _ = update(alg.broadcast(server, "mlp_small"), clients[k],
                                       arrays[k], jax.random.key(100 * r + k))
            uploads.append(up)
        stacked = jax.tree.map(lambda *u: jnp.stack(u), *uploads)
        server = server_update(server, {"mlp_small": (stacked, jnp.asarray(SIZES, jnp.float32))})
    return start, [_flat_client(c.params) for c in clients], _flat_proxy(server.proxy_params)


def _data(arrays):
    out = []
    for a in arrays:
        mask = (jnp.arange(a.y.shape[0]) < a.sizes).astype(jnp.float32)
        out.append((a.x, a.y, mask))
    return out


def _assert_close(got, want):
    for n in want:
        np.testing.assert_allclose(np.asarray(got[n]), np.asarray(want[n]), rtol=2e-4,
                                   atol=2e-6, err_msg=n)


def test_pfedes_matches_a_plain_jax_numpy_reference_over_two_rounds():
    (p0s, q0, arrays), ps, q = _run(_config())
    want_ps, want_q = _reference(p0s, q0, _data(arrays))
    for got, want in zip(ps, want_ps, strict=True):
        _assert_close(got, want)
    _assert_close(q, want_q)
    # the comparison has teeth: E_proxy and every private leaf moved
    assert all(float(jnp.abs(q[n] - q0[n]).max()) > 1e-4 for n in q)
    assert all(float(jnp.abs(ps[0][n] - p0s[0][n]).max()) > 1e-4 for n in ps[0])


def test_the_reference_tells_apart_what_a_bug_would_change():
    """Each changed setting moves the result beyond the tolerance above, so a bug with the same
    effect (lambda ignored, E_proxy's momentum dropped, the raw lr rule, no server smoothing, a
    stop-gradient removed) is caught. Checked also by breaking the code once each: the classifier
    reading P_k(z), lambda dropped from the local loss, E_proxy's momentum skipped."""
    (p0s, q0, arrays), ps, q = _run(_config())
    for change in ({"lam": 0.0}, {"proxy_momentum": 0.0}, {"proxy_lr_rule": "raw"},
                   {"server_momentum": 0.0}, {"stop_gradient_proxy": False},
                   {"stop_gradient_local": False}):
        _, ps2, q2 = _run(PFedESConfig(**{**_config().__dict__, **change}))
        moved = max(float(jnp.abs(q2[n] - q[n]).max()) for n in q)
        moved = max(moved, max(float(jnp.abs(ps2[0][n] - ps[0][n]).max()) for n in ps[0]))
        assert moved > 1e-3, change
