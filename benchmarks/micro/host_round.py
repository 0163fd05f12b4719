"""The host's share of a cross-device round: the per-client report and means, and the cyclic
garbage collector.

  python -m benchmarks.micro.host_round                 # the report and the means, per call
  python -m benchmarks.micro.host_round --gc --gc_rounds=150 --trials=3
  python -m benchmarks.micro.host_round --noise        # + the DP noise shares' draws alone
  python -m benchmarks.micro.host_round --norm_rule    # + the norm rule's decision and finalize

Work B of `benchmarks.peers.cross_device` (FedAvg, `mlp_small`, 1,000 clients, 100 a round, strategy
'scan'). The first part captures one round's inputs of `records.client_report` and
`records.client_means` and times each call alone (median of `--calls` calls). `--gc` runs
`--trials` pairs of `--gc_rounds` rounds in one process, the collector as it is and with every
object alive at the start frozen (`gc.freeze`), and prints each arm's mean, median, 99th
percentile and longest round. `--noise` times what distributed DP noise costs at this size
(100 senders x the model's 50,890 values): the senders' shares as the secure-aggregation stage
draws them (numpy, float64, one call), the same on the device (`jax.random.normal`, jitted),
and one draw of their sum (the model's size). No timed assertion anywhere: numbers for
docs/performance.md. `--norm_rule` times the norm-outlier rule's host decision
(`validation.norm_outliers` over 100 norms) and a streamed cohort's `streaming.finalize` with 28
of its 64 held rows used (work B's expected count), on synthetic inputs of work B's shapes.
"""

from __future__ import annotations

import gc
import time

import jax
import numpy as np
from absl import app, flags

from benchmarks import works
from benchmarks.peers import cross_device

_CALLS = flags.DEFINE_integer("calls", 2000, "Calls timed per function.")
_GC = flags.DEFINE_bool("gc", False, "Also compare rounds with and without gc.freeze().")
_ROUNDS = flags.DEFINE_integer("gc_rounds", 150, "Rounds per arm and trial (--gc).")
_TRIALS = flags.DEFINE_integer("trials", 3, "Pairs of arms (--gc).")
_NOISE = flags.DEFINE_bool("noise", False, "Also time the DP noise shares' draws alone.")
_NORM_RULE = flags.DEFINE_bool("norm_rule", False, "Also time the norm rule's host decision "
                               "and a streamed cohort's finalize.")


def norm_rule_parts() -> dict[str, float]:
    """ms per call of the norm rule's decision and of `streaming.finalize` (work B shapes)."""
    import jax.numpy as jnp

    from fedjax_pfedes.upload import streaming, validation

    rng = np.random.default_rng(0)
    per_sample = rng.lognormal(0, 0.5, 100).astype(np.float32)
    valid = np.ones(100, bool)
    template = {"d0": {"kernel": jnp.zeros((784, 64)), "bias": jnp.zeros(64)},
                "d1": {"kernel": jnp.zeros((64, 10)), "bias": jnp.zeros(10)}}
    carry = streaming.mean_reducer(True).init(template)
    return {
        "`validation.norm_outliers` (100 norms)": _median_ms(
            lambda: np.asarray(validation.norm_outliers(per_sample, valid, 10.0)), 300),
        "`streaming.finalize` (a streamed cohort's mean)": _median_ms(
            lambda: jax.block_until_ready(streaming.finalize(carry)), 300),
    }


def _median_ms(call, repeats: int = 20) -> float:
    call()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return float(np.median(times) * 1e3)


def noise_draws(senders: int = 100, size: int = 50_890) -> dict[str, float]:
    """ms per draw of `senders` noise shares of `size` values, host and device, and of one."""
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    shares = jax.jit(lambda k: jax.random.normal(k, (senders, size), jnp.float32))
    one = jax.jit(lambda k: jax.random.normal(k, (size,), jnp.float32))
    key = jax.random.key(0)
    return {
        f"{senders} shares, numpy Generator.normal float64 (the stage's draw)":
            _median_ms(lambda: rng.normal(0.0, 1.0, (senders, size))),
        f"{senders} shares, jax.random.normal float32, jitted":
            _median_ms(lambda: shares(key).block_until_ready()),
        "their sum as one draw, numpy float64": _median_ms(lambda: rng.normal(0.0, 1.0, size)),
        "their sum as one draw, jax float32": _median_ms(lambda: one(key).block_until_ready()),
    }


def main(argv: list[str]) -> None:
    del argv
    from fedjax_pfedes.engine import records, rounds
    from fedjax_pfedes.engine.build import build_context

    data = works.cross_device_data(1000)
    total = 5 + (2 * _ROUNDS.value * _TRIALS.value if _GC.value else 0)
    ctx, state = build_context(cross_device.work_config("scan", 1000, 100, total), data)
    captured = {}
    report = rounds.client_report

    def capture(*args):
        captured["args"] = args
        return report(*args)

    rounds.client_report = capture  # the name sync_round calls
    try:
        for r in range(5):
            state, _, _, _ = rounds.sync_round(ctx, state, r)
    finally:
        rounds.client_report = report
    args = captured["args"]
    print(f"JAX {jax.__version__} on {jax.default_backend()}, 100 participants a round")
    print("| function | ms per call |\n|---|---|")
    for name, call in (("client_report", lambda: report(*args)),
                       ("client_means", lambda: records.client_means(args[2].client_metrics))):
        times = []
        for _ in range(_CALLS.value):
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
        print(f"| `records.{name}` | {np.median(times) * 1e3:.3f} |")
    if _NORM_RULE.value:
        print("\n| the norm rule's host parts | ms per call |\n|---|---|")
        for name, ms in norm_rule_parts().items():
            print(f"| {name} | {ms:.3f} |")
    if _NOISE.value:
        print("\n| noise draw | ms |\n|---|---|")
        for name, ms in noise_draws().items():
            print(f"| {name} | {ms:.2f} |")
    if not _GC.value:
        return
    r = 5

    def run(n):
        nonlocal state, r
        out = []
        for _ in range(n):
            t = time.perf_counter()
            state, _, _, _ = rounds.sync_round(ctx, state, r)
            jax.block_until_ready(state.server)
            out.append(time.perf_counter() - t)
            r += 1
        return out

    arms = {"collector as it is": [], "gc.freeze() at the start": []}
    for _ in range(_TRIALS.value):
        arms["collector as it is"] += run(_ROUNDS.value)
        gc.collect()
        gc.freeze()
        try:
            arms["gc.freeze() at the start"] += run(_ROUNDS.value)
        finally:
            gc.unfreeze()
    print("\n| rounds | mean ms | median ms | 99th percentile ms | longest ms |\n"
          "|---|---|---|---|---|")
    for name, times in arms.items():
        t = np.array(times) * 1e3
        print(f"| {name} ({len(t)}) | {t.mean():.2f} | {np.median(t):.2f} | "
              f"{np.percentile(t, 99):.2f} | {t.max():.1f} |")


if __name__ == "__main__":
    app.run(main)
