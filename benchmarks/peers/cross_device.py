"""Cross-device rounds: many small clients per round, FedAvg on an MLP, engine against a plain
jitted `lax.scan` of the same math.

  python -m benchmarks.peers.cross_device                               # 100 per round, ~2 min
  python -m benchmarks.peers.cross_device --participants=10,100,1000 --strategies=scan,loop,vmap
  pip install -e ".[bench]"   # adds the PyTorch per-client loop's column (--notorch: without)
  python -m benchmarks.peers.cross_device --participants=1000 --strategies=scan --breakdown
  python -m benchmarks.peers.cross_device --strategies=scan --private  # + DP (+ secure agg.)
  python -m benchmarks.peers.cross_device --strategies=scan --private --protocol  # + the crypto run
  python -m benchmarks.peers.cross_device --strategies=scan --pfl   # + pfl-research (see pfl_loop)
  python -m benchmarks.peers.cross_device --strategies=scan \
      --flower_python=/tmp/flwr_venv/bin/python
      # + Flower, in its own environment (see flower_loop)
  python -m benchmarks.peers.cross_device --strategies=scan --private --profile --notorch --rounds=5
  python -m benchmarks.peers.cross_device --strategies=scan --notorch --nonorm_rule  # same math
  python -m benchmarks.peers.cross_device --participants=10,100,1000,10000 --model=convnet3 \
      --local_steps=5 --algorithm=pfedes --strategies=scan --private   # the other axes

Work (the speed issue's "work B"): FedAvg, `mlp_small` (784-64 ReLU, then the 10-way classifier),
synthetic MNIST-shaped uint8 data IID over N = max(1,000, 10 x participants) clients with 20
train samples each (a fifth more for the local test split), `--participants` per round, one
local epoch of batch 32 (= 1 local step), lr 0.05, no momentum, no evaluation or monitoring.
`--model`, `--local_steps` and `--algorithm` change those axes (the plain-scan reference and the
peers only where they do the same math: the reference for FedAvg of the MLP, the PyTorch
loop and pfl-research for FedAvg of the MLP or `convnet3`).

The reference shares no code with the engine: parameters as a dict of arrays, the same
normalization, one SGD step per client on its masked batch, and the sample-weighted sum of the
clients' updates in the scan's carry, one jitted call per round. Both sides' s/round are medians
of rounds 3.. (the first compiles); the ratio is engine / reference, measured in one process
one after the other. No timed assertion anywhere: this prints numbers for docs/performance.md.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks import works

_PARTICIPANTS = flags.DEFINE_list("participants", ["100"], "Clients per round.")
_STRATEGIES = flags.DEFINE_list("strategies", ["scan", "loop", "vmap"],
                                "config.execution.strategy values to time.")
_ROUNDS = flags.DEFINE_integer("rounds", 12, "Rounds per measurement (>= 4).")
_BREAKDOWN = flags.DEFINE_bool("breakdown", False, "Also print where the engine's round goes: "
                               "the cohorts' training program, the rest of the participants' "
                               "training step, the upload pipeline and the server step.")
_NORM_RULE = flags.DEFINE_bool("norm_rule", True, "The upload pipeline's norm-outlier rule, on by "
                                "default; --nonorm_rule times the engine doing the reference's "
                                "math only (FedAvg without it; pfl-research has no such rule).")
_PRIVATE = flags.DEFINE_bool("private", False, "Also time each strategy with client-level DP "
                              "(clip 1, noise multiplier 1, uniform weights) with secure "
                              "aggregation ('aggregate' and 'sum' simulations) and without "
                              "(central DP), and print their round times against the plain "
                              "one.")
_SIMULATIONS = flags.DEFINE_list("secagg_simulations", ["aggregate", "sum"], "With --private: "
                                  "the config.secagg.simulation values to time.")
_PROTOCOL = flags.DEFINE_bool("protocol", False, "With --private: also time secure "
                               "aggregation running every party's cryptography "
                               "(config.secagg.simulation='protocol'; the default 'sum' computes "
                               "the same output directly).")
_PROFILE = flags.DEFINE_bool("profile", False, "Also print a cProfile of the engine's rounds "
                              "3.. (the functions with the most cumulative time) for each "
                              "strategy, with --private for the private configuration.")
_TORCH = flags.DEFINE_bool("torch", True, "Also time a PyTorch per-client loop of the same "
                           "work (benchmarks.peers.torch_loop; needs the `bench` extra, skipped "
                           "without it).")
_TORCH_DEVICE = flags.DEFINE_enum("torch_device", "auto", ["auto", "cpu", "cuda"], "Device of "
                                  "the PyTorch loop: auto = cuda when JAX runs on a GPU and "
                                  "PyTorch sees one, else cpu.")
_PFL = flags.DEFINE_bool("pfl", False, "Also time pfl-research (Apple's `pfl`, PyTorch "
                         "backend, one process; benchmarks.peers.pfl_loop says how to install it).")
_FLOWER = flags.DEFINE_string("flower_python", "", "Also time Flower (its simulation engine, Ray "
                             "backend, one worker per core): the Python of an environment with "
                             "Flower and PyTorch (benchmarks/peers/flower_loop.py says how to make "
                             "one); empty = not timed.")
_MODEL = flags.DEFINE_string("model", "mlp_small", "The clients' architecture: mlp_small (work "
                             "B) or convnet3 (or any image backbone of the engine).")
_LOCAL_STEPS = flags.DEFINE_integer("local_steps", 1, "Local steps per participant (local "
                                    "epochs: a client's 20 samples are one batch).")
_ALGORITHM = flags.DEFINE_enum("algorithm", "fedavg", ["fedavg", "pfedes"], "The method: "
                               "fedavg (work B) or pfedes (E_proxy the default small CNN, the "
                               "clients' models of --model).")
_SAMPLES = works.CROSS_DEVICE_SAMPLES
_LR = works.CROSS_DEVICE_LR


def work_config(strategy: str, clients: int, participants: int, rounds: int,
                private: bool = False, simulation: str = "sum"):
    """The engine's config of the work (`works.cross_device_config` with this command's model,
    local steps and method; `private`: with client-level DP, and secure aggregation computed as
    `simulation` says ('' = none: central DP), the pipeline's other stages as configured by
    default)."""
    c = works.cross_device_config(rounds, clients, participants, model=_MODEL.value,
                                  local_steps=_LOCAL_STEPS.value, algorithm=_ALGORITHM.value)
    c.execution.strategy = strategy
    if not _NORM_RULE.value:
        c.upload.norm_outlier_factor = 0.0
    if private:
        c.dp.enabled, c.upload.weighting = True, "uniform"
        c.secagg.enabled = bool(simulation)
        c.secagg.simulation = simulation or "sum"
    return c


def engine_round_s(data, strategy: str, participants: int, rounds: int,
                   private: bool = False, simulation: str = "sum") -> tuple[float, float, str]:
    """(median s/round of rounds 3.., mean local steps per participant, the runner the cohort
    ran: `strategy` or, for 'auto', what it chose)."""
    from fedjax_pfedes.engine import rounds as engine_rounds
    from fedjax_pfedes.engine.build import build_context
    ctx, state = build_context(work_config(strategy, data.num_clients, participants, rounds,
                                           private, simulation), data)
    times = []
    for r in range(rounds):
        t = time.perf_counter()
        state, record, _, _ = engine_rounds.sync_round(ctx, state, r)
        jax.block_until_ready(state.server)
        times.append(time.perf_counter() - t)
    return (float(np.median(times[2:])), float(record["local_steps_mean"]),
            "+".join(c.runner.name for c in ctx.cohorts))


def engine_profile(data, strategy: str, participants: int, rounds: int, private: bool,
                   top: int = 12) -> None:
    """Prints the `top` functions by cumulative time over rounds 3.. of the engine."""
    import cProfile
    import pstats

    from fedjax_pfedes.engine import rounds as engine_rounds
    from fedjax_pfedes.engine.build import build_context
    ctx, state = build_context(work_config(strategy, data.num_clients, participants, rounds,
                                           private), data)
    profile = cProfile.Profile()
    for r in range(rounds):
        if r == 2:
            profile.enable()
        state, _, _, _ = engine_rounds.sync_round(ctx, state, r)
        jax.block_until_ready(state.server)
    profile.disable()
    pstats.Stats(profile).sort_stats("cumulative").print_stats(top)


def engine_breakdown(data, strategy: str, participants: int, rounds: int) -> dict[str, float]:
    """Seconds per round (rounds 3..) of the parts of `rounds.sync_round`, each waited for
    (so the parts add up to a synchronous round, a little slower than the pipelined one)."""
    from fedjax_pfedes.engine import rounds as engine_rounds
    from fedjax_pfedes.engine.build import build_context
    ctx, state = build_context(work_config(strategy, data.num_clients, participants, rounds),
                               data)
    spent: dict[str, float] = {}
    measuring = [False]

    def timed(fn, label):
        def call(*args, **kwargs):
            t = time.perf_counter()
            out = jax.block_until_ready(fn(*args, **kwargs))
            if measuring[0]:
                spent[label] = spent.get(label, 0.0) + time.perf_counter() - t
            return out
        return call

    for c in ctx.cohorts:  # frozen dataclasses: the benchmark swaps their calls in place
        object.__setattr__(c.runner, "update", timed(c.runner.update, "training program"))
    ctx.upload = dataclasses.replace(ctx.upload,
                                     process=timed(ctx.upload.process, "upload pipeline"))
    ctx.server_step = timed(ctx.server_step, "server step")
    train = engine_rounds.train_participants
    engine_rounds.train_participants = timed(train, "train_participants")
    try:
        for r in range(rounds):
            measuring[0] = r >= 2
            t = time.perf_counter()
            state, _, _, _ = engine_rounds.sync_round(ctx, state, r)
            jax.block_until_ready(state.server)
            if measuring[0]:
                spent["round"] = spent.get("round", 0.0) + time.perf_counter() - t
    finally:
        engine_rounds.train_participants = train
    out = {k: v / (rounds - 2) for k, v in spent.items()}
    out["train_participants"] -= out["training program"]  # the rest of the training step
    return out


def reference_round_s(data, participants: int, rounds: int) -> float:
    """Median s/round of the plain jitted scan (see the module docstring)."""
    c = data.central
    mean = jnp.asarray(c.input_spec.mean, jnp.float32)
    std = jnp.asarray(c.input_spec.std, jnp.float32)
    train = [np.asarray(i) for i in data.train_indices]
    width = max(len(i) for i in train)
    x = np.zeros((len(train), width, 28 * 28), np.uint8)
    y = np.zeros((len(train), width), np.int32)
    mask = np.zeros((len(train), width), np.float32)
    for k, idx in enumerate(train):
        x[k, :len(idx)] = c.x_train[idx].reshape(len(idx), -1)
        y[k, :len(idx)] = c.y_train[idx]
        mask[k, :len(idx)] = 1.0
    x, y, mask = jax.device_put((x, y, mask))
    rng = np.random.default_rng(1)
    params = {"w1": jnp.asarray(rng.normal(0, 784 ** -0.5, (784, 64)), jnp.float32),
              "b1": jnp.zeros(64), "w2": jnp.asarray(rng.normal(0, 0.125, (64, 10)),
                                                     jnp.float32), "b2": jnp.zeros(10)}

    def loss(p, xb, yb, mb):
        h = jax.nn.relu(((xb.astype(jnp.float32) / 255.0 - mean) / std) @ p["w1"] + p["b1"])
        logp = jax.nn.log_softmax(h @ p["w2"] + p["b2"])
        ce = -jnp.take_along_axis(logp, yb[:, None], axis=1)[:, 0]
        return jnp.sum(ce * mb) / jnp.maximum(jnp.sum(mb), 1.0)

    steps = _LOCAL_STEPS.value

    @jax.jit
    def one_round(p, clients):
        def client(carry, k):
            total, weight = carry
            local = p
            for _ in range(steps):  # the client's whole data is one batch
                g = jax.grad(loss)(local, x[k], y[k], mask[k])
                local = jax.tree.map(lambda a, gi: a - _LR * gi, local, g)
            n = jnp.sum(mask[k])
            return (jax.tree.map(lambda s, a, b: s + n * (a - b), total, local, p),
                    weight + n), None
        zero = jax.tree.map(jnp.zeros_like, p)
        (total, weight), _ = jax.lax.scan(client, (zero, 0.0), clients)
        return jax.tree.map(lambda a, d: a + d / weight, p, total)

    times = []
    for r in range(rounds):
        clients = jnp.asarray(np.random.default_rng(r).choice(len(train), participants,
                                                              replace=False), jnp.int32)
        t = time.perf_counter()
        params = jax.block_until_ready(one_round(params, clients))
        times.append(time.perf_counter() - t)
    return float(np.median(times[2:]))


def _peer_round_s(run, data, participants: int, rounds: int, **kw) -> float:
    """Median s/round of rounds 3.. of a PyTorch-based peer `run` (torch_loop / pfl_loop
    `run_fedavg`) on the work's clients, with one intra-op thread: a 20-sample step of a
    784-64-10 MLP has nothing to split between threads, and on a busy machine extra threads
    only contend."""
    import torch
    c = data.central
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = run(works.client_arrays(data), c.input_spec.mean, c.input_spec.std, c.num_classes,
                     rounds, participants, 32, _LOCAL_STEPS.value, _LR, **kw)
    finally:
        torch.set_num_threads(threads)
    return float(np.median(result["round_s"][2:]))


def torch_round_s(data, participants: int, rounds: int) -> float | None:
    """The PyTorch per-client loop (`torch_loop.run_fedavg` with `mlp_model`: every client's
    one SGD step in Python, the sample-weighted mean of the flat parameters), or None without
    PyTorch."""
    try:
        from benchmarks.peers import torch_loop
    except ImportError:
        return None
    models = {"mlp_small": torch_loop.mlp_model, "convnet3": torch_loop.fedavg_model}
    if _ALGORITHM.value != "fedavg" or _MODEL.value not in models:
        return None
    import torch
    device = _TORCH_DEVICE.value
    if device == "auto":
        device = "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"
    return _peer_round_s(torch_loop.run_fedavg, data, participants, rounds,
                         make_model=models[_MODEL.value], device=device)


def pfl_round_s(data, participants: int, rounds: int) -> float | None:
    """pfl-research's FedAvg on the same clients and model (`pfl_loop.run_fedavg`), or None
    without pfl or PyTorch."""
    try:
        import torch  # noqa: F401 - pfl's backend
    except ImportError:
        return None
    from benchmarks.peers import pfl_loop, torch_loop
    if _ALGORITHM.value != "fedavg" or _MODEL.value not in ("mlp_small", "convnet3"):
        return None
    kw = {} if _MODEL.value == "mlp_small" else {"make_model": torch_loop.fedavg_model}
    try:
        return _peer_round_s(pfl_loop.run_fedavg, data, participants, rounds, **kw)
    except ImportError:
        return None


def flower_round_s(data, participants: int, rounds: int) -> float | None:
    """Flower's FedAvg on the same clients and model (`flower_loop`, run by --flower_python's
    interpreter), or None where the work is not FedAvg of the MLP or `convnet3`."""
    from benchmarks.peers import flower_loop, torch_loop
    if _ALGORITHM.value != "fedavg" or _MODEL.value not in torch_loop.MODELS:
        return None
    c = data.central
    result = flower_loop.run_in(_FLOWER.value, works.client_arrays(data), c.input_spec.mean,
                                c.input_spec.std, c.num_classes, _MODEL.value, participants,
                                32, _LOCAL_STEPS.value, _LR, rounds)
    return float(np.median(result["round_s"][2:]))


def device_memory() -> str:
    """The accelerator's peak bytes in use so far (`memory_stats`), or '—' where the backend
    keeps none (the CPU: the process's peak RSS is printed at the end instead)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return "—" if peak is None else f"{peak / 2**30:.2f} GiB"


def main(argv):
    del argv
    rounds = max(_ROUNDS.value, 4)
    # The plain scan is written for work B's math only: FedAvg of the MLP.
    plain_math = _ALGORITHM.value == "fedavg" and _MODEL.value == "mlp_small"
    print(f"JAX {jax.__version__} on {jax.default_backend()}, {os.cpu_count()} CPU cores, "
          f"{rounds} rounds per measurement, {_ALGORITHM.value} of {_MODEL.value}, "
          f"{_LOCAL_STEPS.value} local step(s)"
          + ("" if _NORM_RULE.value else ", the engine without the norm-outlier rule"))
    print("| participants | clients | engine | s/round | client-steps/s | reference s/round | "
          "engine / reference | PyTorch loop s/round | PyTorch / engine | peak device memory |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for m in map(int, _PARTICIPANTS.value):
        n = max(1000, 10 * m)
        data = works.cross_device_data(n)
        reference = reference_round_s(data, m, rounds) if plain_math else None
        peer = torch_round_s(data, m, rounds) if _TORCH.value else None
        pfl = pfl_round_s(data, m, rounds) if _PFL.value else None
        if _PFL.value:
            print("  pfl-research (PyTorch, 1 process): "
                  + ("not installed (benchmarks/peers/pfl_loop.py says how)" if pfl is None
                     else f"{pfl:.4f} s/round"), flush=True)
        flower = flower_round_s(data, m, rounds) if _FLOWER.value else None
        if flower is not None:
            print(f"  Flower (simulation engine, Ray, {os.cpu_count()} workers): "
                  f"{flower:.4f} s/round", flush=True)
        for strategy in _STRATEGIES.value:
            round_s, steps, ran = engine_round_s(data, strategy, m, rounds)
            label = strategy if ran == strategy else f"{strategy} ({ran})"
            versus = ("— | —" if peer is None else f"{peer:.4f} | {peer / round_s:.2f}")
            plain = ("— | —" if reference is None
                     else f"{reference:.4f} | {round_s / reference:.2f}")
            print(f"| {m:,} | {n:,} | {label} | {round_s:.4f} | {m * steps / round_s:,.0f} | "
                  f"{plain} | {versus} | {device_memory()} |", flush=True)
            if pfl is not None:
                print(f"  pfl-research / engine: {pfl / round_s:.2f}", flush=True)
            if flower is not None:
                print(f"  Flower / engine: {flower / round_s:.2f}", flush=True)
            if _PRIVATE.value:
                for simulation in _SIMULATIONS.value:
                    private_s, _, ran = engine_round_s(data, strategy, m, rounds,
                                                       private=True, simulation=simulation)
                    print(f"  with client-level DP + secure aggregation ('{simulation}', "
                          f"{ran}): {private_s:.4f} s/round, {private_s / round_s:.2f}x the plain "
                          "round", flush=True)
                central_s, _, ran = engine_round_s(data, strategy, m, rounds, private=True,
                                                   simulation="")
                print(f"  with client-level DP, no secure aggregation ({ran}): {central_s:.4f} "
                      f"s/round, {central_s / round_s:.2f}x the plain round", flush=True)
                if _PROTOCOL.value:
                    full_s, _, ran = engine_round_s(data, strategy, m, rounds, private=True,
                                                    simulation="protocol")
                    print(f"  the same, every party's cryptography run ({ran}): {full_s:.4f} "
                          f"s/round, {full_s / round_s:.2f}x the plain round", flush=True)
            if _PROFILE.value:
                engine_profile(data, strategy, m, rounds, _PRIVATE.value)
            if _BREAKDOWN.value:
                parts = engine_breakdown(data, strategy, m, rounds)
                print("  " + ", ".join(f"{k} {v:.4f} s" for k, v in parts.items()),
                      flush=True)
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


if __name__ == "__main__":
    app.run(main)
