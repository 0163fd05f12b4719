"""The 'shard' strategy (participants split over a mesh of devices) gives the numbers of 'vmap'.

JAX fixes its device count at start-up, so each check runs in a subprocess with four simulated
CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=4)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from fl_helpers import CHILD_PATH, ROOT, tiny_config

from fedjax_pfedes.engine.validate import validate_config
from fedjax_pfedes.errors import ConfigError
from fedjax_pfedes.execution import placement
from fedjax_pfedes.execution.strategies import protocol


def _run_with_devices(code: str, devices: int = 4, timeout: int = 600) -> dict:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               JAX_PLATFORMS="cpu", PYTHONPATH=CHILD_PATH)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_shard_runner_equals_vmap_on_four_devices():
    """One cohort round: uploads, new states and metrics of 'shard' (4 devices, 8 slots of which
    3 real) equal 'vmap''s; padded slots upload zeros; non-participants keep their states."""
    result = _run_with_devices("""
        import json, jax, jax.numpy as jnp, numpy as np
        from fedjax_pfedes.execution import placement, runners
        from test_execution import _setup, _copy
        _, program, data, states, server = _setup("convnet3", num_clients=5)
        slots = np.array([2, 0, 4, 5, 5, 5, 5, 5], np.int32)  # 3 clients, 5 padded slots
        keys = jax.random.split(jax.random.key(7), 8)
        mesh = placement.client_mesh(0)
        out = {s: runners.make_runner(program, s, mesh).update(
                   server.proxy_params, _copy(states), data, slots, keys)
               for s in ("vmap", "shard")}
        diff = lambda a, b: max(float(jnp.abs(jnp.asarray(x) - jnp.asarray(y)).max())
                                for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
        (up_v, st_v, m_v), (up_s, st_s, m_s) = out["vmap"], out["shard"]
        ev = {s: runners.make_runner(program, s, mesh).evaluate(
                  server.proxy_params, st_v, data, data.x[0], data.y[0]) for s in out}
        print(json.dumps({
            "devices": mesh.size,
            "uploads": diff(up_v, up_s), "states": diff(st_v.params, st_s.params),
            "metrics": diff(m_v, m_s), "evaluate": diff(ev["vmap"], ev["shard"]),
            "evaluate_rows": int(jax.tree.leaves(ev["shard"])[0].shape[0]),
            "padded_upload_max": max(float(jnp.abs(l[3:]).max()) for l in jax.tree.leaves(up_s)),
            "untouched": diff(jax.tree.map(lambda a: a[jnp.array([1, 3])], st_s.params),
                              jax.tree.map(lambda a: a[jnp.array([1, 3])], states.params)),
            "moved": diff(st_s.params, states.params)}))
    """)
    assert result["devices"] == 4
    for key in ("uploads", "states", "metrics", "evaluate"):
        assert result[key] < 1e-4, (key, result)
    assert result["evaluate_rows"] == 5  # the padding of the last device's share is cut off
    assert result["padded_upload_max"] == 0.0
    assert result["untouched"] == 0.0
    assert result["moved"] > 1e-3  # the participants did train


@pytest.mark.slow
def test_a_cohort_that_fills_the_mesh_is_split_over_it_with_the_vmap_numbers():
    """8 clients on 4 devices: states and samples are split by client (2 per device), stay so
    after an update, and give 'vmap''s uploads, states and evaluation."""
    result = _run_with_devices("""
        import json, jax, jax.numpy as jnp, numpy as np
        from fedjax_pfedes.execution import placement, runners
        from test_execution import _setup, _copy
        _, program, data, states, server = _setup("convnet3", num_clients=8)
        mesh = placement.client_mesh(0)
        slots = np.array([6, 1, 3, 8], np.int32)  # 3 clients, one padded slot
        keys = jax.random.split(jax.random.key(7), 4)
        placed = data.replace(x=placement.client_rows(data.x, mesh),
                              y=placement.client_rows(data.y, mesh))
        split_states = placement.client_rows(_copy(states), mesh)
        up_v, st_v, _ = runners.make_runner(program, "vmap").update(
            server.proxy_params, _copy(states), data, slots, keys)
        shard = runners.make_runner(program, "shard", mesh)
        up_s, st_s, _ = shard.update(server.proxy_params, split_states, placed, slots, keys)
        diff = lambda a, b: max(float(jnp.abs(jnp.asarray(x) - jnp.asarray(y)).max())
                                for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
        ev_v = runners.make_runner(program, "vmap").evaluate(
            server.proxy_params, st_v, data, data.x[0], data.y[0])
        ev_s = shard.evaluate(server.proxy_params, st_s, placed, data.x[0], data.y[0])
        leaf = jax.tree.leaves(st_s)[0]
        print(json.dumps({
            "uploads": diff(up_v, up_s), "states": diff(st_v.params, st_s.params),
            "evaluate": diff(ev_v, ev_s),
            "split": leaf.sharding.spec == placement.P(placement.CLIENT_AXIS),
            "rows_per_device": [s.data.shape[0] for s in leaf.addressable_shards],
            "x_rows_per_device": [s.data.shape[0] for s in placed.x.addressable_shards]}))
    """)
    for key in ("uploads", "states", "evaluate"):
        assert result[key] < 1e-4, (key, result)
    assert result["split"]
    assert result["rows_per_device"] == [2, 2, 2, 2]
    assert result["x_rows_per_device"] == [2, 2, 2, 2]


def test_row_spec_splits_only_counts_the_mesh_divides():
    mesh = placement.client_mesh(0)
    assert placement.row_spec((3 * mesh.size, 5), mesh) == placement.P(placement.CLIENT_AXIS)
    if mesh.size > 1:
        assert placement.row_spec((mesh.size + 1, 5), mesh) == placement.P()


@pytest.mark.slow  # two end-to-end runs with 4 simulated devices: ~1 min
def test_shard_run_matches_vmap_run_end_to_end(tmp_path):
    result = _run_with_devices(f"""
        import json
        from fedjax_pfedes.engine.loop import run_experiment
        from fl_helpers import small_config
        out = {{}}
        for strategy in ("vmap", "shard"):
            c = small_config(strategy)
            c.train.rounds, c.checkpoint.every = 3, 0
            c.execution.compilation_cache_dir = ""
            s = run_experiment(c, "{tmp_path}/" + strategy)
            out[strategy] = dict(s["final"], strategy=s["execution_strategy"])
        print(json.dumps(out))
    """)
    v, s = result["vmap"], result["shard"]
    assert s["strategy"] == "shard"
    for key in ("personalized_accuracy_mean", "global_accuracy_mean", "test_ce_loss_mean",
                "test_align_loss_mean"):
        assert abs(v[key] - s[key]) <= 5e-3 * max(1.0, abs(v[key])), (key, v[key], s[key])


def test_a_mesh_larger_than_the_devices_is_refused_naming_the_field():
    config = tiny_config()
    config.execution.strategy = "shard"
    config.execution.devices = len(__import__("jax").local_devices()) + 1
    with pytest.raises(ConfigError, match=r"config\.execution\.devices=\d+: this process sees"):
        validate_config(config)


def test_auto_considers_shard_only_with_several_devices():
    mesh = placement.client_mesh(0)
    expected = ("vmap", "loop", "scan") + (("shard",) if mesh.size > 1 else ())
    assert protocol.auto_candidates(mesh) == expected
    assert protocol.auto_candidates(None) == ("vmap", "loop", "scan")
