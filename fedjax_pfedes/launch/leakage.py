"""Gradient-inversion check: how well one client's upload can be turned back into its images.

  python -m launch.leakage --config=configs/quickstart.py --workdir=runs/leakage

Attacks (Inverting Gradients, Geiping et al. 2020) a FedSGD-style upload of the `--arch` client
model at initialization, one image per client, for `--victims` clients: with no protection, with
clipping to C (default: the median gradient norm of the victims) plus Gaussian noise sigma*C, and
under secure aggregation of `--secagg_clients` clients. Writes leakage.md (PSNR / SSIM, mean ± std
over victims), leakage.json and leakage.png (originals vs reconstructions).
"""

from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from ml_collections import config_flags

from fedjax_pfedes import markdown
from fedjax_pfedes.data.catalog import load_dataset
from fedjax_pfedes.engine.build import load_options
from fedjax_pfedes.errors import DatasetUnavailableError
from fedjax_pfedes.launch import cli
from fedjax_pfedes.launch.cli import loaded_config
from fedjax_pfedes.models import architectures
from fedjax_pfedes.studies.gradient_inversion import (
    AttackConfig,
    gradient,
    invert,
    observed_uploads,
    psnr,
    ssim,
)

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config (its data).")
_WORKDIR = flags.DEFINE_string("workdir", "runs/leakage", "Where the table and figure go.")
_ARCH = flags.DEFINE_string("arch", "cnn_small", "Client model under attack.")
_VICTIMS = flags.DEFINE_integer("victims", 4, "Clients attacked (one image each).",
                                lower_bound=1)
_STEPS = flags.DEFINE_integer("steps", 400, "Attack optimization steps.", lower_bound=1)
_CLIP = flags.DEFINE_float("clip_norm", 0.0, "DP clip norm C (0 = median gradient norm).",
                           lower_bound=0.0)
_SIGMA = flags.DEFINE_float("noise_multiplier", 1.0, "DP noise multiplier sigma.",
                            lower_bound=0.0)
_SECAGG = flags.DEFINE_integer("secagg_clients", 2, "Clients summed by secure aggregation.",
                               lower_bound=2)


def main(argv: list[str]) -> None:
    del argv
    config = loaded_config(_CONFIG)
    try:
        central = load_dataset(config.data.name, load_options(config))
        if central.modality != "image":
            raise ValueError(f"launch.leakage attacks images; config.data.name="
                             f"'{config.data.name}' is {central.modality}")
        if _VICTIMS.value + _SECAGG.value - 1 > len(central.y_train):
            raise ValueError(f"--victims={_VICTIMS.value} and --secagg_clients="
                             f"{_SECAGG.value} need {_VICTIMS.value + _SECAGG.value - 1} "
                             f"training images; {config.data.name} has "
                             f"{len(central.y_train)}")
        model = architectures.classifier_model(_ARCH.value, central.num_classes, central.input_spec)
    except (ValueError, DatasetUnavailableError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    cli.output_folder("workdir", _WORKDIR.value)
    rng = np.random.default_rng(config.seed)
    n = _VICTIMS.value + _SECAGG.value - 1
    idx = rng.choice(len(central.y_train), size=n, replace=False)
    x = central.x_train[idx]
    images = (x.astype(np.float32) / 255.0 if np.issubdtype(x.dtype, np.integer)
              else x.astype(np.float32))
    labels = central.y_train[idx].astype(np.int32)
    params = model.init(jax.random.key(config.seed), jnp.asarray(images[:1]))
    norms = [float(jnp.sqrt(sum(jnp.sum(a ** 2) for a in jax.tree.leaves(gradient(
        model, params, jnp.asarray(images[i:i + 1]), jnp.asarray(labels[i:i + 1]))))))
        for i in range(_VICTIMS.value)]
    clip = _CLIP.value or float(np.median(norms))
    cfg = AttackConfig(steps=_STEPS.value, clip_norm=clip,
                               noise_multiplier=_SIGMA.value, secagg_clients=_SECAGG.value)
    rows, recon = {"none": [], "dp": [], "secagg": []}, {k: [] for k in ("none", "dp", "secagg")}
    for v in range(_VICTIMS.value):
        views = observed_uploads(model, params, images, labels, v,
                                         jax.random.key(1000 + v), cfg)
        for name, (observed, assumed_labels) in views.items():
            shape = (len(assumed_labels), *images.shape[1:])
            out = np.asarray(invert(model, params, observed, jnp.asarray(assumed_labels),
                                            shape, jax.random.key(v), cfg))
            scores = [(psnr(o, images[v]), ssim(o, images[v])) for o in out]
            best = max(range(len(out)), key=lambda i: scores[i][0])
            rows[name].append(scores[best])
            recon[name].append(out[best])
            print(f"victim {v}: {name:7s} PSNR {scores[best][0]:6.2f} dB  "
                  f"SSIM {scores[best][1]:.3f}")
    labels_text = {"none": "no protection",
                   "dp": f"clip C={clip:.3g} + noise sigma={_SIGMA.value:g}",
                   "secagg": f"secure aggregation of {_SECAGG.value} clients"}
    table = _report_table(config.data.name, config.seed, images, rows, labels_text)
    with open(os.path.join(_WORKDIR.value, "leakage.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(_WORKDIR.value, "leakage.json"), "w") as f:
        json.dump({"clip_norm": clip, "noise_multiplier": _SIGMA.value,
                   "scores": {k: [list(s) for s in v] for k, v in rows.items()}}, f, indent=1)
    _figure(images[:_VICTIMS.value], recon, labels_text,
            os.path.join(_WORKDIR.value, "leakage.png"))
    print(table)
    print(f"\nwrote {_WORKDIR.value}/leakage.md, leakage.json, leakage.png")


def _report_table(dataset: str, seed: int, images, rows, labels_text) -> str:
    """The scores per view of the upload, beside what no attack scores on the same images."""
    lines = [f"Gradient inversion (Geiping et al. 2020) of a `{_ARCH.value}` client's upload at "
             f"initialization, {dataset}, one image per client, {_VICTIMS.value} "
             f"victims, {_STEPS.value} Adam steps; mean ± std over victims.", ""]
    noise_rng = np.random.default_rng(seed + 1)
    references = {  # what no attack at all scores against the same images
        "reference: all-zero image (no attack)": [
            (psnr(np.zeros_like(images[v]), images[v]),
             ssim(np.zeros_like(images[v]), images[v])) for v in range(_VICTIMS.value)],
        "reference: uniform noise image (no attack)": [
            (psnr(r, images[v]), ssim(r, images[v]))
            for v in range(_VICTIMS.value)
            for r in [noise_rng.random(images[v].shape)]],
    }
    cells = []
    for name, vals in [*((labels_text[k], v) for k, v in rows.items()), *references.items()]:
        v = np.array(vals)
        cells.append([name, f"{v[:, 0].mean():.2f} ± {v[:, 0].std():.2f}",
                      f"{v[:, 1].mean():.3f} ± {v[:, 1].std():.3f}"])
    lines.append(markdown.table(["upload seen by the server", "PSNR dB", "SSIM"], cells))
    table = "\n".join(lines)
    return table


def _figure(originals, recon, labels_text, path):
    from fedjax_pfedes.io.plotting import plt, save

    rows = [("original", list(originals))] + [(labels_text[k], v) for k, v in recon.items()]
    fig, axes = plt.subplots(len(rows), len(originals), squeeze=False,
                             figsize=(1.6 * len(originals) + 2.2, 1.6 * len(rows)))
    for r, (title, imgs) in enumerate(rows):
        for c, img in enumerate(imgs):
            ax = axes[r, c]
            ax.imshow(np.squeeze(img), cmap="gray" if img.shape[-1] == 1 else None,
                      vmin=0, vmax=1)
            ax.set_xticks([])
            ax.set_yticks([])
        axes[r, 0].set_ylabel(title, fontsize=7, rotation=0, ha="right", va="center")
    save(fig, path)


def console() -> None:
    """`python -m launch.leakage` from a checkout; `fedjax-pfedes-leakage` installed."""
    cli.run(main, required=("config",))


if __name__ == "__main__":
    console()
