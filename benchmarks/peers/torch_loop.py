"""A PyTorch per-client loop of the same local updates: the reference `compare_frameworks` times.

Written as a PyTorch user would write it for speed: every model, optimizer and data tensor is
built once before round 1 (data pre-normalized, channels-first, on the host device), each client's
epoch is a plain Python loop of `optimizer.step()` calls with no per-step host synchronization
(losses are accumulated as tensors), and aggregation is in-place on flat parameter buffers.
`device` places models and data on one PyTorch device ('cuda' on a GPU machine); the round's
closing `float(loss_sum)` synchronizes it, so round times include the device's work.

- FedAvg (McMahan et al., AISTATS 2017) with the `convnet3` classifier.
- pFedES (Yi et al., AAAI 2025) as implemented in fedjax_pfedes: private CNN-k + projection head +
  classifier per client, a shared proxy extractor `proxy_cnn`; each local step takes one SGD step
  of CE + lam * MSE(e_local, stopgrad(e_proxy)) on the private model and one SGD step of
  MSE(e_proxy, stopgrad(e_local)) on the proxy, from one proxy forward pass; only the proxy is
  averaged (sample-weighted) and smoothed with server momentum.

Needs the optional dependency group `bench` (`pip install -e ".[bench]"`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

try:
    import torch
    from torch import nn
    from torch.nn import functional as F
except ImportError as e:  # pragma: no cover - exercised only without the bench extra
    raise ImportError("benchmarks.peers.torch_loop needs PyTorch: pip install -e '.[bench]'") from e


class ConvStack(nn.Module):
    """3x3 'same' convs + ReLU, 2x2 max pool after the listed layers, Dense + ReLU (as
    fedjax_pfedes.models.backbones.ConvStack)."""

    def __init__(self, in_ch: int, features: Sequence[int], pool_after: Sequence[int],
                 spatial: int, out_features: int = 128):
        super().__init__()
        layers, ch, size = [], in_ch, spatial
        for i, f in enumerate(features):
            layers += [nn.Conv2d(ch, f, 3, padding=1), nn.ReLU()]
            if i in pool_after and size >= 2:
                layers.append(nn.MaxPool2d(2))
                size //= 2
            ch = f
        self.body = nn.Sequential(*layers)
        self.fc = nn.Linear(ch * size * size, out_features)

    def forward(self, x):
        return F.relu(self.fc(self.body(x).flatten(1)))


class PublishedCNN(nn.Module):
    """CNN-1..CNN-5 of the published pFedES (as fedjax_pfedes.models.backbones.PublishedCNN)."""

    def __init__(self, in_ch: int, spatial: int, conv2: int, fc1: int, fc2: int = 500):
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, 16, 5)
        self.conv2 = nn.Conv2d(16, conv2, 5)
        size = ((spatial - 4) // 2 - 4) // 2
        self.fc1 = nn.Linear(conv2 * size * size, fc1)
        self.fc2 = nn.Linear(fc1, fc2)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return F.relu(self.fc2(F.relu(self.fc1(x.flatten(1)))))


PUBLISHED = {"cnn1": (32, 2000), "cnn2": (16, 2000), "cnn3": (32, 1000), "cnn4": (32, 800),
             "cnn5": (32, 500)}


class ClientModel(nn.Module):
    """Backbone F_k, classifier H_k(z) and projection head P_k(z) = ReLU(Linear(z))."""

    def __init__(self, backbone: nn.Module, features: int, num_classes: int, dim: int):
        super().__init__()
        self.backbone = backbone
        self.classifier = nn.Linear(features, num_classes)
        self.projection = nn.Linear(features, dim)

    def forward(self, x):
        z = self.backbone(x)
        return self.classifier(z), F.relu(self.projection(z))


class Proxy(nn.Module):
    """`proxy_cnn`: ConvStack(16, 32, 64; pool after each) + Dense(d)."""

    def __init__(self, in_ch: int, spatial: int, dim: int):
        super().__init__()
        self.body = ConvStack(in_ch, (16, 32, 64), (0, 1, 2), spatial)
        self.out = nn.Linear(128, dim)

    def forward(self, x):
        return self.out(self.body(x))


def _to_tensors(x: np.ndarray, y: np.ndarray, mean, std) -> tuple[torch.Tensor, torch.Tensor]:
    """Images [N, H, W, C] (uint8 or [0, 1] floats) -> normalized float NCHW, labels int64."""
    x = x.astype(np.float32)
    if x.max() > 1.5:
        x = x / 255.0
    x = (x - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    return (torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2))),
            torch.from_numpy(y.astype(np.int64)))


def _batches(n: int, batch_size: int, epochs: int, device: str = "cpu"):
    """Row indices of each local step: `epochs` reshuffled passes over n rows."""
    for _ in range(epochs):
        order = torch.randperm(n, device=device)
        for s in range(0, n, batch_size):
            yield order[s:s + batch_size]


def _flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


def _load_flat(params, flat: torch.Tensor) -> None:
    start = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[start:start + p.numel()].view_as(p))
            start += p.numel()


def fedavg_step(model: nn.Module, opt, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
    """One local SGD step of FedAvg on a batch; returns the (detached) loss."""
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(xb), yb)
    loss.backward()
    opt.step()
    return loss.detach()


def pfedes_step(model: nn.Module, opt, proxy: nn.Module, proxy_opt, xb: torch.Tensor,
                yb: torch.Tensor, lam: float) -> torch.Tensor:
    """One pFedES local step: SGD on CE + lam * MSE(e_local, stopgrad(e_proxy)) for the private
    model, then SGD on MSE(e_proxy, stopgrad(e_local)) for the proxy; one proxy forward pass
    serves both. Returns the private loss (detached)."""
    e_proxy = proxy(xb)
    logits, e_local = model(xb)
    loss = F.cross_entropy(logits, yb) + lam * F.mse_loss(e_local, e_proxy.detach())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    proxy_loss = F.mse_loss(e_proxy, e_local.detach())
    proxy_opt.zero_grad(set_to_none=True)
    proxy_loss.backward()
    proxy_opt.step()
    return loss.detach()


def fedavg_model(in_ch: int, spatial: int, num_classes: int) -> nn.Module:
    """`convnet3` with its classifier: ConvStack(16, 32, 64; pool after the first two) + Linear."""
    return nn.Sequential(ConvStack(in_ch, (16, 32, 64), (0, 1), spatial),
                         nn.Linear(128, num_classes))


def pfedes_model(arch: str, in_ch: int, spatial: int, num_classes: int, dim: int) -> nn.Module:
    """CNN-k (`arch` in PUBLISHED) with its classifier and projection head."""
    conv2, fc1 = PUBLISHED[arch]
    return ClientModel(PublishedCNN(in_ch, spatial, conv2, fc1), 500, num_classes, dim)


def mlp_model(in_ch: int, spatial: int, num_classes: int, hidden: int = 64) -> nn.Module:
    """`mlp_small` with its classifier: flatten, Linear(hidden) + ReLU, Linear(num_classes)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(in_ch * spatial * spatial, hidden), nn.ReLU(),
                         nn.Linear(hidden, num_classes))


def pfl_simple_cnn_model(in_ch: int, spatial: int, num_classes: int) -> nn.Module:
    """pfl-research's `simple_cnn` without its dropout layers (`benchmarks.works.
    register_pfl_simple_cnn` is the engine's): conv 3x3 32, ReLU, conv 3x3 64, ReLU, 2x2 max
    pool, Linear 128, ReLU, Linear(num_classes); no padding."""
    side = (spatial - 4) // 2
    return nn.Sequential(nn.Conv2d(in_ch, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(side * side * 64, 128),
                         nn.ReLU(), nn.Linear(128, num_classes))


# By the engine's architecture names: `benchmarks.works.PEER_MODELS`.
MODELS = {"mlp_small": mlp_model, "convnet3": fedavg_model,
          "pfl_simple_cnn": pfl_simple_cnn_model}


def run_fedavg(clients: list[tuple[np.ndarray, np.ndarray]], mean, std, num_classes: int,
               rounds: int, per_round: int, batch_size: int, epochs: int, lr: float,
               seed: int = 0, device: str = "cpu", make_model=fedavg_model) -> dict:
    """FedAvg over `clients` ([(x, y)] local train arrays) with `make_model(in_ch, spatial,
    num_classes)` (`convnet3` by default; `mlp_model` for the cross-device work). Returns
    per-round wall times, the client-steps run and the set-up time before round 1."""
    start = time.perf_counter()
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    data = [tuple(t.to(device) for t in _to_tensors(x, y, mean, std)) for x, y in clients]
    in_ch, spatial = data[0][0].shape[1], data[0][0].shape[2]

    def model():
        return make_model(in_ch, spatial, num_classes).to(device)

    global_model, local = model(), model()
    local_params = list(local.parameters())
    opt = torch.optim.SGD(local_params, lr=lr)
    global_flat = _flat(global_model.parameters())
    times, steps = [], 0
    setup_s = time.perf_counter() - start
    for _ in range(rounds):
        t0 = time.perf_counter()
        chosen = rng.choice(len(data), per_round, replace=False)
        total = torch.zeros_like(global_flat)
        weight = 0.0
        for k in chosen:
            x, y = data[k]
            _load_flat(local_params, global_flat)
            loss_sum = torch.zeros((), device=device)
            for idx in _batches(len(y), batch_size, epochs, device):
                loss_sum += fedavg_step(local, opt, x[idx], y[idx])
                steps += 1
            total += len(y) * _flat(local_params)
            weight += len(y)
        global_flat = total / weight
        float(loss_sum)  # one host sync per round, as a progress bar would
        times.append(time.perf_counter() - t0)
    return {"round_s": times, "client_steps": steps, "setup_s": setup_s}


def run_pfedes(clients: list[tuple[np.ndarray, np.ndarray]], archs: list[str], mean, std,
               num_classes: int, rounds: int, batch_size: int, epochs: int, lr: float,
               lam: float = 0.5, dim: int = 128, proxy_lr_ratio: float = 0.1,
               server_momentum: float = 0.5, seed: int = 0, device: str = "cpu") -> dict:
    """pFedES with every client each round: private CNN-k models, a shared `proxy_cnn`."""
    start = time.perf_counter()
    torch.manual_seed(seed)
    data = [tuple(t.to(device) for t in _to_tensors(x, y, mean, std)) for x, y in clients]
    in_ch, spatial = data[0][0].shape[1], data[0][0].shape[2]
    models, opts = [], []
    for arch in archs:
        m = pfedes_model(arch, in_ch, spatial, num_classes, dim).to(device)
        models.append(m)
        opts.append(torch.optim.SGD(m.parameters(), lr=lr))
    proxy = Proxy(in_ch, spatial, dim).to(device)
    proxy_params = list(proxy.parameters())
    proxy_opt = torch.optim.SGD(proxy_params, lr=proxy_lr_ratio * lr)
    global_flat = _flat(proxy_params)
    times, steps = [], 0
    setup_s = time.perf_counter() - start
    for _ in range(rounds):
        t0 = time.perf_counter()
        total = torch.zeros_like(global_flat)
        weight = 0.0
        loss_sum = torch.zeros((), device=device)
        for k, (x, y) in enumerate(data):
            model, opt = models[k], opts[k]
            _load_flat(proxy_params, global_flat)
            for idx in _batches(len(y), batch_size, epochs, device):
                loss_sum += pfedes_step(model, opt, proxy, proxy_opt, x[idx], y[idx], lam)
                steps += 1
            total += len(y) * _flat(proxy_params)
            weight += len(y)
        global_flat = server_momentum * global_flat + (1 - server_momentum) * total / weight
        float(loss_sum)
        times.append(time.perf_counter() - t0)
    return {"round_s": times, "client_steps": steps, "setup_s": setup_s}
