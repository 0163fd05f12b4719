"""Offloaded client states ('offload'): ragged data, chunked initialization, the gathering runner,
and whole runs that equal the on-device placement bit for bit (host memory and memory-mapped)."""

import json
import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fl_helpers import ROOT, small_config, tiny_config
from test_execution import _copy, _setup

from fedjax_pfedes.data.federated import stack_clients
from fedjax_pfedes.engine import cohorts
from fedjax_pfedes.engine.loop import run_experiment
from fedjax_pfedes.engine.validate import validate_config
from fedjax_pfedes.errors import ConfigError
from fedjax_pfedes.execution import offload, runners


def test_ragged_rows_equal_the_padded_stack():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 3, 2)).astype(np.float32)
    y = rng.integers(0, 5, 40)
    idx = [np.array([3, 7, 1]), np.arange(10, 30), np.array([0]), np.array([39, 38])]
    ragged = offload.RaggedClientArrays.from_indices(x, y, idx)
    dense = stack_clients(x, y, idx)
    assert ragged.capacity == dense.capacity == 20
    assert ragged.nbytes < dense.x.nbytes  # 26 rows stored instead of 4 x 20
    picked = ragged.replace(step_limit=np.array([5, 6, 7, 8])).padded(np.array([2, 0, 9]))
    np.testing.assert_array_equal(picked.x, dense.x[[2, 0, 3]])  # 9 is clipped to the last
    np.testing.assert_array_equal(picked.y, dense.y[[2, 0, 3]])
    np.testing.assert_array_equal(picked.sizes, [1, 3, 2])
    np.testing.assert_array_equal(picked.step_limit, [7, 5, 8])


def test_chunked_initialization_equals_one_call(tmp_path):
    _, program, _, _, _ = _setup("convnet3", num_clients=5)
    rng = jax.random.key(3)
    ids = np.array([0, 2, 5, 7, 8, 11, 12])
    init = lambda i: cohorts._init_states(program.init_client, rng, i)  # noqa: E731
    reference = jax.device_get(init(jnp.asarray(ids)))
    rows = jax.eval_shape(program.init_client, rng)
    for directory in (None, str(tmp_path / "mm")):
        store = offload.initialize(init, ids, offload.allocate(rows, len(ids),
                                                                         directory), chunk=3)
        chex.assert_trees_all_equal(jax.tree.map(np.asarray, store), reference)
    assert (tmp_path / "mm" / "leaf0.npy").exists()


@pytest.mark.parametrize("strategy", ["loop", "vmap", "scan"])
def test_offloaded_runner_equals_the_device_runner(strategy):
    _, program, data, states, server = _setup("convnet3", num_clients=5)
    slots = np.array([3, 0, 5], np.int32)  # clients 3 and 0, one padded slot
    keys = jax.random.split(jax.random.key(7), 3)
    runner = runners.make_runner(program, strategy)
    up_d, st_d, m_d = runner.update(server.proxy_params, _copy(states), data, slots, keys)
    host = jax.tree.map(np.array, states)
    host_data = jax.tree.map(np.asarray, data)
    off = offload.offloaded_runner(runner, bucket=3)
    up_o, st_o, m_o = off.update(server.proxy_params, host, host_data, slots, keys)
    assert all(a is b for a, b in zip(jax.tree.leaves(st_o), jax.tree.leaves(host),
                                      strict=True))  # written back in place
    chex.assert_trees_all_close(up_o, up_d, rtol=1e-6, atol=1e-7)
    chex.assert_trees_all_close(m_o, m_d, rtol=1e-6, atol=1e-7)
    chex.assert_trees_all_close(jax.tree.map(jnp.asarray, st_o), st_d, rtol=1e-6, atol=1e-7)
    for i in (1, 2, 4):  # not selected: untouched
        chex.assert_trees_all_equal(jax.tree.map(lambda a, i=i: np.asarray(a[i]), st_o),
                                    jax.tree.map(lambda a, i=i: np.asarray(a[i]), states))
    ev_d = runner.evaluate(server.proxy_params, st_d, data, data.x[0], data.y[0])
    ev_o = off.evaluate(server.proxy_params, st_o, host_data, data.x[0], data.y[0])
    chex.assert_trees_all_close(ev_o, jax.device_get(ev_d), rtol=1e-6, atol=1e-7)


def test_a_budget_below_one_round_is_refused_naming_the_field():
    row = {"w": jax.ShapeDtypeStruct((1000,), jnp.float32)}  # 4,000 bytes a client
    with pytest.raises(offload.BudgetError,
                       match=r"config\.execution\.client_state_budget_gb=1e-06: one round"):
        offload.check_budget({"a": row}, {"a": 100}, {"a": 10}, 1e-6)
    assert offload.check_budget({"a": row}, {"a": 100}, {"a": 10}, 400_000 / 2**30)
    assert not offload.check_budget({"a": row}, {"a": 100}, {"a": 10}, 100_000 / 2**30)


def test_offload_config_is_validated():
    config = tiny_config()
    config.execution.client_states = "gpu"
    with pytest.raises(ConfigError, match="config.execution.client_states: unknown 'gpu'"):
        validate_config(config)
    config.execution.client_states = "offload"
    config.execution.strategy, config.execution.cpu_kernels = "auto", "auto"
    validate_config(config)  # decided by the cost model alone (nothing to time on the host)
    config.execution.client_state_budget_gb = 0.0
    with pytest.raises(ConfigError, match="client_state_budget_gb must be > 0"):
        validate_config(config)


def _metrics(workdir):
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    return [{k: v for k, v in r.items() if "time" not in k and "elapsed" not in k}
            for r in rows]


@pytest.mark.slow  # four small runs
def test_offloaded_runs_equal_the_device_run_and_resume(tmp_path, monkeypatch):
    def config(**execution):
        c = small_config("loop")
        c.train.rounds, c.train.client_fraction, c.checkpoint.every = 3, 0.34, 1
        for k, v in execution.items():
            setattr(c.execution, k, v)
        return c

    run_experiment(config(), str(tmp_path / "device"), show_progress=False)
    run_experiment(config(client_states="offload"), str(tmp_path / "host"), show_progress=False)
    # a budget that holds one round's participants but not all clients: memory-mapped files
    disk = config(client_states="offload", client_state_budget_gb=0.002)
    short = config(client_states="offload", client_state_budget_gb=0.002)
    short.train.rounds = 2
    run_experiment(short, str(tmp_path / "disk"), show_progress=False)
    run_experiment(disk, str(tmp_path / "disk"), show_progress=False)  # resumes at round 2
    assert list((tmp_path / "disk" / "client_states").glob("*/leaf0.npy"))
    reference = _metrics(tmp_path / "device")
    assert len(reference) == 3
    assert _metrics(tmp_path / "host") == reference
    assert _metrics(tmp_path / "disk") == reference
    restored = []  # a resumed run puts its states back into the memory-mapped files
    real_refill = offload.refill
    monkeypatch.setattr(offload, "refill",
                        lambda store, r: restored.append(real_refill(store, r)) or restored[-1])
    disk.train.rounds = 4
    run_experiment(disk, str(tmp_path / "disk"), show_progress=False)
    assert restored and all(isinstance(a, np.memmap) for s in restored
                            for a in jax.tree.leaves(s))


@pytest.mark.slow  # two small runs
def test_auto_execution_with_offloaded_states_takes_the_models_choice_untimed(tmp_path):
    """The defaults with offloaded states: the cost model decides each cohort without a timing
    (the states live on the host), and the run equals one given that choice explicitly."""
    config = small_config("auto")
    config.execution.cpu_kernels = "auto"
    config.train.rounds, config.train.client_fraction = 2, 0.34
    config.execution.client_states = "offload"
    config.execution.compilation_cache_dir = str(tmp_path / "cache")
    summary = run_experiment(config, str(tmp_path / "auto"), show_progress=False)
    for arch, picked in summary["strategy_choice"].items():
        assert picked["seconds_per_call"] == {} and "offloaded" in picked["reason"], arch
        assert picked["strategy"] == next(iter(picked["predicted_round_s"]))
    chosen = set(summary["execution_strategy_by_arch"].values())
    if len(chosen) == 1:  # one choice for every cohort: the explicit run is one config
        strategy, _, kernels = chosen.pop().partition("/")
        config.execution.strategy, config.execution.cpu_kernels = strategy, kernels or "xla"
        run_experiment(config, str(tmp_path / "explicit"), show_progress=False)
        assert _metrics(tmp_path / "explicit") == _metrics(tmp_path / "auto")


def test_evaluating_a_sample_of_clients_equals_those_clients_of_a_full_evaluation():
    from fedjax_pfedes.engine.build import build_context, build_federated_data
    from fedjax_pfedes.engine.evaluation import evaluate, evaluation_sample, global_test_set

    config = small_config("loop")
    data = build_federated_data(config)
    ctx, state = build_context(config, data)
    gx, gy = global_test_set(data, config.eval.global_test_samples, config.seed)
    full = evaluate(ctx.algorithm, state.server, ctx.cohorts, state.clients, gx, gy)
    everyone = evaluate(ctx.algorithm, state.server, ctx.cohorts, state.clients, gx, gy,
                        np.arange(ctx.num_clients))
    assert everyone == full and full["evaluated_clients"] == ctx.num_clients
    sample = evaluation_sample(3, config.seed, ctx.num_clients)
    assert len(sample) == 3 and np.array_equal(sample, evaluation_sample(3, config.seed, 6))
    part = evaluate(ctx.algorithm, state.server, ctx.cohorts, state.clients, gx, gy, sample)
    per_client = {}
    for c in ctx.cohorts:
        m = c.runner.evaluate(ctx.algorithm.broadcast(state.server, c.arch),
                              state.clients[c.arch], c.test, gx, gy)
        per_client.update(zip(c.client_ids.tolist(), np.asarray(m["personalized_accuracy"]),
                              strict=True))
    assert part["evaluated_clients"] == 3
    assert part["personalized_accuracy_mean"] == pytest.approx(
        np.mean([per_client[int(k)] for k in sample]), abs=1e-6)


def _open_files_under(folder) -> list[str]:
    """The files under `folder` this process holds a descriptor of (Linux's /proc)."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own descriptor)
            continue
        if target.startswith(str(folder)):
            held.append(target)
    return held


@pytest.mark.slow  # one small run
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads Linux's /proc")
def test_a_finished_run_leaves_none_of_its_state_files_open(tmp_path):
    """Memory-mapped states are read and written through descriptors the run opens; once the run
    returns none is left open, so removing its folder frees the disk (an open descriptor keeps a
    removed file's space taken until the process exits: a sweep or a notebook of offloaded
    runs would fill the disk)."""
    config = tiny_config(rounds=2)
    config.train.client_fraction = 0.5
    config.execution.client_states, config.execution.client_state_budget_gb = "offload", 0.002
    run_experiment(config, str(tmp_path / "run"), show_progress=False)
    assert list((tmp_path / "run" / "client_states").glob("*/leaf0.npy"))
    assert _open_files_under(tmp_path) == []


@pytest.mark.slow  # the start of one small run
def test_states_the_disk_cannot_hold_stop_the_run_before_a_file_is_written(tmp_path,
                                                                           monkeypatch):
    """A run whose offloaded states would not fit on the disk ends with the figures, before it
    writes a state file (the check itself: tests/io/test_storage.py)."""
    from fedjax_pfedes.errors import StorageError
    from fedjax_pfedes.io import storage

    monkeypatch.setattr(storage.shutil, "disk_usage",
                        lambda path: type("U", (), {"free": 2**20})())
    config = tiny_config(rounds=2)
    config.checkpoint.every = 0
    config.execution.client_states, config.execution.client_state_budget_gb = "offload", 0.002
    with pytest.raises(StorageError, match=r"the clients' states go to files under .* they "
                                           r"need .* GiB, 0.00 GiB is free there"):
        run_experiment(config, str(tmp_path / "run"), show_progress=False)
    assert not list((tmp_path / "run").glob("client_states/*/leaf*.npy"))


def test_rounds_prefetch_the_next_rounds_participants_from_disk(tmp_path, monkeypatch):
    """With states on disk each round hints the next round's selection (exactly the clients that
    then train, under uniform sampling) and the hint changes no row that is read."""
    from fedjax_pfedes.engine import rounds
    from fedjax_pfedes.engine.build import build_context, build_federated_data

    hinted = []
    real_prefetch = offload.prefetch

    def spy(store, idx):
        hinted.append(np.asarray(idx).copy())
        before = offload.read_rows(store, idx)
        real_prefetch(store, idx)
        chex.assert_trees_all_equal(offload.read_rows(store, idx), before)

    monkeypatch.setattr(offload, "prefetch", spy)
    config = tiny_config(rounds=3)
    config.train.client_fraction = 0.5
    config.execution.client_states, config.execution.client_state_budget_gb = "offload", 0.002
    config.execution.client_state_dir = str(tmp_path / "states")
    ctx, state = build_context(config, build_federated_data(config))
    (cohort,) = ctx.cohorts
    assert cohort.runner.prefetch is not None
    assert all(isinstance(a, np.memmap) for a in jax.tree.leaves(state.clients["mlp"]))
    trained = []
    for r in range(3):
        state, record, rows, _ = rounds.sync_round(ctx, state, r)
        trained.append(sorted(row["client"] for row in rows if row["local_steps"] > 0))
    # rounds 0 and 1 hint rounds 1 and 2; round 2 is the last and hints nothing
    assert len(hinted) == 2
    for r in (1, 2):
        assert cohort.client_ids[hinted[r - 1]].tolist() == trained[r]
    # in host memory there is nothing to prefetch
    config.execution.client_state_budget_gb = 4.0
    ctx, _ = build_context(config, build_federated_data(config))
    assert ctx.cohorts[0].runner.prefetch is None


@pytest.mark.parametrize("offloaded", [False, True])
def test_same_init_starts_every_client_of_an_architecture_from_one_model(tmp_path, offloaded):
    from fedjax_pfedes.engine.build import build_context, build_federated_data

    config = tiny_config(rounds=1)
    config.clients.architectures = "mlp,mlp_small"
    if offloaded:
        config.execution.client_states = "offload"
        config.execution.client_state_dir = str(tmp_path / "states")
    states = {}
    for same in (False, True):
        config.clients.same_init = same
        ctx, state = build_context(config, build_federated_data(config))
        states[same] = {c.arch: offload.read_rows(state.clients[c.arch],
                                                      np.arange(len(c.client_ids)))
                        for c in ctx.cohorts}
    for arch, rows in states[True].items():
        kernel = np.asarray(rows.params["params"]["backbone"]["fc1"]["kernel"])
        assert len(kernel) >= 2 and all(np.array_equal(k, kernel[0]) for k in kernel)
        other = np.asarray(states[False][arch].params["params"]["backbone"]["fc1"]["kernel"])
        assert not np.array_equal(other[0], other[1])  # the default: one init per client
    first = {a: np.asarray(r.params["params"]["backbone"]["fc1"]["kernel"][0])
             for a, r in states[True].items()}
    assert first["mlp"].shape != first["mlp_small"].shape  # per architecture, not one model


@pytest.mark.slow  # one process
def test_the_budget_report_writes_offloaded_states_to_a_folder_of_its_own(tmp_path):
    """`launch.budget` builds the run's context, which writes offloaded states to files: into a
    temporary folder it removes at its end, never the config's `client_state_dir` (a run's
    states there would be overwritten)."""
    states = tmp_path / "a_runs_states"
    states.mkdir()
    (states / "kept.npy").write_bytes(b"a run's state")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "launch.budget", "--config=configs/quickstart.py",
         "--config.execution.client_states=offload",
         "--config.execution.client_state_budget_gb=0.05", "--config.train.client_fraction=0.1",
         f"--config.execution.client_state_dir={states}"],
        capture_output=True, text=True, env={**os.environ, "TMPDIR": str(scratch)},
        cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "simulated time of the run" in done.stdout
    assert sorted(p.name for p in states.iterdir()) == ["kept.npy"]
    assert (states / "kept.npy").read_bytes() == b"a run's state"
    assert not [p for p in scratch.iterdir() if p.name.startswith("fedjax_pfedes_budget_")]


@pytest.mark.slow  # one process
def test_a_context_built_without_a_workdir_removes_its_state_folder_at_exit(tmp_path):
    """`build_context` without a workdir (a notebook's, the public API's) and no
    `client_state_dir` writes offloaded states to a temporary folder; the process removes it
    when it exits instead of leaving every client's states behind."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    script = (
        "import os, sys\n"
        "from fl_helpers import tiny_config\n"
        "from fedjax_pfedes.engine.build import build_context, build_federated_data\n"
        "config = tiny_config(rounds=1, num_clients=4)\n"
        "config.execution.client_states = 'offload'\n"
        "config.execution.client_state_budget_gb = 0.002\n"
        "build_context(config, build_federated_data(config))\n"
        "print(os.listdir(sys.argv[1]))\n")
    done = subprocess.run([sys.executable, "-c", script, str(scratch)], capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, "TMPDIR": str(scratch),
                                                    "PYTHONPATH": os.path.join(ROOT, "tests")})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "fedjax_pfedes_states_" in done.stdout  # the states were written there
    assert not [p for p in scratch.iterdir() if p.name.startswith("fedjax_pfedes_states_")]
