"""How close the local step runs to what this machine can compute: FLOPs against time.

  python -m benchmarks.micro.roofline                       # ~2 min on 2 CPU cores
  python -m benchmarks.micro.roofline --cpu_kernels=xla,eigen --notorch
  python -m benchmarks.micro.roofline --run=runs/quickstart    # a finished run's training FLOPs

For the two works of `benchmarks.peers.compare_frameworks` (FedAvg `convnet3` on MNIST-5k, batch 32;
pFedES CNN-1..5 with `proxy_cnn` on CIFAR-shaped inputs, batch 64), per architecture:

- FLOPs of one client's local step, counted twice, independently: by XLA's cost analysis of
  our compiled local update (the rolled loop's body counts once; the client update runs 5 steps,
  outside the loop only a few norms) and by PyTorch's `FlopCounterMode` on the PyTorch step of
  `benchmarks.peers.torch_loop` (matrix products and convolutions only, forward and backward);
- the time of one step: our client update compiled for one client and timed alone (best of
  `--repeats`, divided by its 5 steps), and the PyTorch step on the same shapes;
- the GFLOP/s that gives, and its share of this machine's rate on a large float32 matrix
  product (2048 x 2048, all threads): the best the CPU does on the friendliest operation, an
  upper bound for small convolutions.

Then what the targets of the speed issue ask of the machine: FedAvg <= 0.2 s/round (its 50
client steps, minus the round's own work) and pFedES >= 2x the PyTorch loop's client-steps/s,
as the GFLOP/s they need and the share of the matrix-product rate that is. No timed assertion
anywhere: this prints numbers for docs/performance.md.

`--run=DIR` instead reads a finished run's workdir (summary.json's config, clients.jsonl's local
steps per trained client) and prints the FLOPs of all its local steps (XLA's count of each
architecture's step, without the pFedES monitoring passes and without evaluation), the time
they would take at this machine's matrix-product rate, and the run's own summed round times.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import app, flags

from benchmarks.micro import cohort_inputs
from benchmarks.works import fedavg_config, pfedes_config, write_cifar_shaped
from fedjax_pfedes.engine.build import build_federated_data
from fedjax_pfedes.execution import kernels

_KERNELS = flags.DEFINE_list("cpu_kernels", ["xla", "eigen"], "config.execution.cpu_kernels "
                             "choices our update is timed with.")
_TORCH = flags.DEFINE_bool("torch", True, "Also count and time the PyTorch step (bench extra).")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed calls per program (best is kept).")
_RUN = flags.DEFINE_string("run", "", "A finished run's workdir: count its local steps' FLOPs.")

FEDAVG_TARGET_S = 0.2          # the FedAvg target, s/round
PFEDES_TARGET_RATIO = 2.0      # the pFedES target, x the PyTorch loop's client-steps/s


def _best_s(f, repeats: int) -> float:
    f()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_gflops(repeats: int) -> dict[str, float]:
    """GFLOP/s of a 2048 x 2048 float32 matrix product: XLA (jit) and, if present, PyTorch."""
    n = 2048
    calls = max(4 * repeats, 20)  # the best of many: the machine's rate, not its neighbours'
    a = jax.random.normal(jax.random.key(0), (n, n))
    product = jax.jit(jnp.matmul)
    out = {"XLA": 2 * n ** 3 / _best_s(lambda: product(a, a).block_until_ready(), calls) / 1e9}
    if _TORCH.value:
        import torch
        t = torch.randn(n, n)
        out["PyTorch"] = 2 * n ** 3 / _best_s(lambda: t @ t, calls) / 1e9
    return out


def compiled_updates(config, cpu_kernels: str = "xla"):
    """(arch, compiled client update, its arguments) for the first client of each architecture
    of `config`'s run, compiled with `cpu_kernels` (`config.execution.cpu_kernels` choices)."""
    options = kernels.kernel_options(cpu_kernels) or None
    for arch, program, args in cohort_inputs.first_clients(config)[1]:
        yield arch, jax.jit(program.client_update, compiler_options=options).lower(
            *args).compile(), args


def our_steps(config, cpu_kernels: str,
              repeats: int) -> dict[str, tuple[float, float, float]]:
    """{arch: (XLA-counted FLOPs of one local step, seconds per step, steps of the update)} of
    our client update for the work's first client of each architecture, compiled with
    `cpu_kernels`."""
    out = {}
    for arch, compiled, args in compiled_updates(config, cpu_kernels):
        steps = float(compiled(*args)[2]["local_steps"])  # the update's own count
        seconds = _best_s(lambda c=compiled, a=args: jax.block_until_ready(c(*a)), repeats)
        flops = compiled.cost_analysis()["flops"]  # the loop body counts once: one step
        out[arch] = (flops, seconds / steps, steps)
    return out


def torch_steps(config, archs: list[str], repeats: int) -> dict[str, tuple[float, float]]:
    """{arch: (FlopCounterMode FLOPs of one step, seconds per step)} of
    benchmarks.peers.torch_loop's step of `config`'s algorithm (fedavg or pfedes) on a batch of
    its input shape."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from benchmarks.peers import torch_loop
    torch.manual_seed(0)
    data = build_federated_data(config)
    height, width, channels = data.central.input_spec.shape
    batch, lr = config.train.batch_size, config.train.lr_local
    x = torch.randn(batch, channels, height, width)
    y = torch.randint(0, data.central.num_classes, (batch,))
    out = {}
    for arch in archs:
        if config.algorithm == "fedavg":
            model = torch_loop.fedavg_model(channels, height, data.central.num_classes)
            opt = torch.optim.SGD(model.parameters(), lr=lr)

            def step(model=model, opt=opt):
                torch_loop.fedavg_step(model, opt, x, y)
        else:
            model = torch_loop.pfedes_model(arch, channels, height, data.central.num_classes,
                                            config.proxy_dim)
            proxy = torch_loop.Proxy(channels, height, config.proxy_dim)
            opt = torch.optim.SGD(model.parameters(), lr=lr)
            proxy_opt = torch.optim.SGD(proxy.parameters(), lr=config.proxy_lr_ratio * lr)

            def step(model=model, opt=opt, proxy=proxy, proxy_opt=proxy_opt):
                torch_loop.pfedes_step(model, opt, proxy, proxy_opt, x, y, config.lam)
        with FlopCounterMode(display=False) as counter:
            step()
        seconds = min(_best_s(step, repeats) for _ in range(3))
        out[arch] = (counter.get_total_flops(), seconds)
    return out


def step_flops(config) -> dict[str, float]:
    """{arch: XLA-counted FLOPs of one local step} for the run `config` describes."""
    config = ml_collections.ConfigDict(config.to_dict())
    config.monitor.aggregation_loss = False  # no pFedES diagnostics outside the loop
    return {arch: compiled.cost_analysis()["flops"]
            for arch, compiled, _ in compiled_updates(config)}


def run_report(run_dir: str, peak: float) -> None:
    """Prints the local steps' FLOPs of the finished run in `run_dir` against `peak` GFLOP/s."""
    try:
        with open(os.path.join(run_dir, "summary.json")) as f:
            config = ml_collections.ConfigDict(json.load(f)["config"])
        with open(os.path.join(run_dir, "clients.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            rounds = [json.loads(line) for line in f]
    except (OSError, KeyError, ValueError) as e:
        raise app.UsageError(f"--run={run_dir}: not a finished run's workdir ({e})") from None
    flops = step_flops(config)
    trained = [r for r in rows if r.get("train_loss") is not None]  # the clients that trained
    total = sum(flops[r["arch"]] * r["local_steps"] for r in trained)
    steps = sum(r["local_steps"] for r in trained)
    wall = sum(r["round_time_s"] for r in rounds)
    print(f"{run_dir}: {len(rounds)} rounds, {steps} local steps "
          + ", ".join(f"{a} {f / 1e9:.3f} GFLOP/step" for a, f in flops.items()))
    print(f"- local steps: {total / 1e9:.0f} GFLOP; at this machine's matrix-product rate "
          f"({peak:.0f} GFLOP/s) {total / peak / 1e9:.1f} s, at 40 % of it "
          f"{total / peak / 1e9 / 0.4:.1f} s")
    print(f"- the run's rounds took {wall:.1f} s together ({total / wall / 1e9:.1f} GFLOP/s "
          "counting the local steps alone; the rounds also evaluate, monitor and compile)")


def main(argv):
    del argv
    repeats = _REPEATS.value
    peak = matmul_gflops(repeats)
    best_peak = max(peak.values())
    print(f"JAX {jax.__version__} on {jax.default_backend()}, {os.cpu_count()} CPU cores; "
          "2048 x 2048 float32 matrix product: "
          + ", ".join(f"{k} {v:.1f} GFLOP/s" for k, v in peak.items()))
    if _RUN.value:
        run_report(_RUN.value, best_peak)
        return
    print("| work | architecture | engine | GFLOP/step (XLA count) | GFLOP/step (PyTorch count) "
          "| ms/step | GFLOP/s | share of the matrix-product rate |")
    print("|---|---|---|---|---|---|---|---|")
    needs = []
    with tempfile.TemporaryDirectory() as tmp:
        npz = os.path.join(tmp, "cifar_shaped.npz")
        write_cifar_shaped(npz)
        works = {"fedavg": fedavg_config(3), "pfedes": pfedes_config(3, npz)}
        for work, config in works.items():
            archs = list(dict.fromkeys(a.strip() for a in
                                       config.clients.architectures.split(",")))
            theirs = torch_steps(config, archs, repeats) if _TORCH.value else {}
            ours = {k: our_steps(config, k, repeats) for k in _KERNELS.value}
            for arch in archs:
                torch_count = f"{theirs[arch][0] / 1e9:.3f}" if theirs else ""
                for cpu_kernels, result in ours.items():
                    flops, seconds, _ = result[arch]
                    rate = flops / seconds / 1e9
                    print(f"| {work} | {arch} | ours, {cpu_kernels} kernels | {flops / 1e9:.3f} | "
                          f"{torch_count} | {seconds * 1e3:.1f} | {rate:.1f} | "
                          f"{rate / best_peak:.0%} |")
                if theirs:
                    t_flops, t_seconds = theirs[arch]
                    print(f"| {work} | {arch} | PyTorch | | {t_flops / 1e9:.3f} | "
                          f"{t_seconds * 1e3:.1f} | {t_flops / t_seconds / 1e9:.1f} | "
                          f"{t_flops / t_seconds / 1e9 / best_peak:.0%} |")
            mean_flops = np.mean([ours[_KERNELS.value[0]][a][0] for a in archs])
            if work == "fedavg":
                participants = round(config.train.client_fraction * config.data.num_clients)
                steps_per_round = participants * np.mean(
                    [ours[_KERNELS.value[0]][a][2] for a in archs])  # IID: equal clients
                need = mean_flops * steps_per_round / FEDAVG_TARGET_S / 1e9
                needs.append(f"FedAvg <= {FEDAVG_TARGET_S} s/round: {steps_per_round:.0f} "
                             f"steps of {mean_flops / 1e9:.3f} GFLOP in {FEDAVG_TARGET_S} s = "
                             f"{need:.0f} GFLOP/s ({need / best_peak:.0%} of the matrix-product "
                             "rate), with no time left for the round's own work")
            elif theirs:
                torch_s = np.mean([theirs[a][1] for a in archs])
                need = mean_flops * PFEDES_TARGET_RATIO / torch_s / 1e9
                needs.append(f"pFedES >= {PFEDES_TARGET_RATIO:g}x PyTorch: a step in "
                             f"{torch_s / PFEDES_TARGET_RATIO * 1e3:.1f} ms (PyTorch "
                             f"{torch_s * 1e3:.1f} ms) = {need:.0f} GFLOP/s "
                             f"({need / best_peak:.0%} of the matrix-product rate)")
    print("\nWhat the targets need, on this machine:")
    for line in needs:
        print(f"- {line}")


if __name__ == "__main__":
    app.run(main)
