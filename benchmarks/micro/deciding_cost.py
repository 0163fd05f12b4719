"""What the `'auto'` defaults add to a first run (an empty compilation cache), part by part.

  python -m benchmarks.micro.deciding_cost                     # the quick start, 2 passes
  python -m benchmarks.micro.deciding_cost --passes=3 --run_config=configs/quickstart.py

Each pass runs `launch.main` with a fresh compilation cache three times, one run after the
other, round 1 only: with the defaults on a *new machine* (an empty `$XDG_CACHE_HOME`, so the
machine's rates are measured), with the defaults on a *known machine* (its rates measured
before), and with the former defaults (`strategy=loop`, `cpu_kernels=xla`). Whole-run wall times
differ by seconds between identical first runs (compilation), so the table adds up, in each
run's process, what deciding touches: the set-up (`build_context`, which measures the
machine's rates and reads the cohort programs' jaxprs, while the rates' references compile in
the background) less the 'loop' update calls inside it, and every call of a 'loop' runner's
update (the decision's first call compiles the program that round 1 then runs; without a
decision round 1's call compiles it). "added" is that sum less the former defaults' of the same
pass: what deciding costs, where the choice is the former default's ("chosen": summary.json's
`execution_strategy`; another choice runs other
programs, and its row compares other work).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from absl import app, flags

_CONFIG = flags.DEFINE_string("run_config", "configs/quickstart.py", "The run's config file.")
_PASSES = flags.DEFINE_integer("passes", 2, "Passes over the three kinds of run.")

_KINDS = ("new machine", "known machine", "former defaults")


def _instrumented_run(config: str, workdir: str, former: bool) -> dict:
    """Runs round 1 of `config` in this process with timers on the parts deciding touches."""
    import dataclasses

    import jax

    argv = ["launch.main", f"--config={config}", f"--workdir={workdir}",
            f"--config.execution.compilation_cache_dir={os.path.join(workdir, 'cache')}",
            "--config.train.rounds=1"]
    if former:
        argv += ["--config.execution.strategy=loop", "--config.execution.cpu_kernels=xla"]
    sys.argv = argv  # ml_collections' config flag reads its overrides from sys.argv
    from fedjax_pfedes.engine import loop
    from fedjax_pfedes.execution import choice, machine_rates
    from fedjax_pfedes.execution.strategies import looped
    from fedjax_pfedes.launch import cli
    from fedjax_pfedes.launch import main as launch_main

    seconds = {"rates": 0.0, "jaxprs": 0.0, "loop_calls": 0.0}

    def timed(key, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return jax.block_until_ready(fn(*args, **kwargs))
            finally:
                seconds[key] += time.perf_counter() - t0
        return wrapper

    machine_rates.cached = timed("rates", machine_rates.cached)
    choice.Trial.work = timed("jaxprs", choice.Trial.work)
    seconds["set_up"] = 0.0
    build = loop.build_context

    def build_context(*args, **kwargs):  # the set-up, less the loop calls made inside it
        before = seconds["loop_calls"]
        t0 = time.perf_counter()
        try:
            return build(*args, **kwargs)
        finally:
            seconds["set_up"] += (time.perf_counter() - t0) - (seconds["loop_calls"] - before)

    loop.build_context = build_context
    make = looped._loop_runner

    def loop_runner(*args, **kwargs):
        runner = make(*args, **kwargs)
        return dataclasses.replace(runner, update=timed("loop_calls", runner.update))

    looped._loop_runner = loop_runner
    t0 = time.perf_counter()
    try:
        app.run(launch_main.main, argv=argv, flags_parser=cli.parse_flags)
    except SystemExit:
        pass
    seconds["wall"] = time.perf_counter() - t0
    try:
        with open(os.path.join(workdir, "summary.json")) as f:
            seconds["chosen"] = json.load(f)["execution_strategy"]
    except (OSError, ValueError, KeyError):
        seconds["chosen"] = "?"
    return seconds


def _run(kind: str, xdg: str) -> dict:
    with tempfile.TemporaryDirectory() as workdir:
        env = {**os.environ, "XDG_CACHE_HOME": xdg}
        out = subprocess.run([sys.executable, "-m", "benchmarks.micro.deciding_cost",
                              "--child", kind, workdir, _CONFIG.value],
                             env=env, capture_output=True, text=True, check=False)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("DECIDING_COST ")]
    if not lines:
        raise SystemExit(f"the {kind} run failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1].split(" ", 1)[1])


def main(argv) -> None:
    del argv
    print(f"{_CONFIG.value}, round 1 of a first run (fresh compilation cache), seconds")
    print("| pass | run | chosen | rates | jaxprs | set-up | loop update calls | sum | added | "
          "process wall |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for p in range(1, _PASSES.value + 1):
        with tempfile.TemporaryDirectory() as new, tempfile.TemporaryDirectory() as known:
            _run("known machine", known)  # measures the rates once into `known`
            rows = {k: _run(k, new if k == "new machine" else known) for k in _KINDS}
        total = {k: r["set_up"] + r["loop_calls"] for k, r in rows.items()}
        for k, r in rows.items():
            print(f"| {p} | {k} | {r['chosen']} | {r['rates']:.2f} | {r['jaxprs']:.2f} "
                  f"| {r['set_up']:.2f} | {r['loop_calls']:.2f} "
                  f"| {total[k]:.2f} | {total[k] - total['former defaults']:+.2f} "
                  f"| {r['wall']:.1f} |")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:  # one instrumented run: --child KIND WORKDIR CONFIG
        kind, workdir, config = sys.argv[2:5]
        result = _instrumented_run(config, workdir, former=kind == "former defaults")
        print("DECIDING_COST " + json.dumps(result), flush=True)
    else:
        app.run(main)
