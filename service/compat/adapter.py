"""MKP adapter (003_..., sections 3.2, 4, A, B.1): a small MLP h mapping NEW embeddings into the OLD space.

h = LayerNorm -> Linear -> GELU -> Dropout -> Linear (d_new -> d_old), output L2-normalised.  An inverse
map g (old -> new, same shape family) exists only during training, for the point (cycle) loss.
Training sees pre-extracted, L2-normalised support pairs only and minimises the MKP loss (mkp_loss.py:
L_base plus the point, distance and angle preservation terms, each focal-weighted).

Errors: shape and argument problems are AssertionError / ValueError at the call site; this module
defines no exception types (the service translates at its boundary).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from service.compat.mkp_loss import DIST_EPS, batch_index, gram, mkp_loss
from service.progress import progress_bar
from service.rows import F32

FORMAT = "mkp-adapter/1"
TENSOR_PREFIX = "adapter."
LAYER_NORM_EPS = 1e-5
_APPLY_CHUNK = 8192
# Below this many rows apply() takes the numpy path: at batch 1 torch's per-op dispatch dominates.
_NUMPY_MAX_ROWS = 16


@dataclass(frozen=True)
class AdapterConfig:
    """Hyper-parameters; defaults follow 003_... section 5.1 except batch_size (see below)."""

    hidden: int | None = None  # width of both MLPs; None = each net's input dim (the paper's default)
    dropout: float = 0.1
    epochs: int = 10  # the paper trains 50 but reports 10 as comparable (section 5.4)
    # The paper uses 32; its table S3 shows 32 / 128 / 1024 perform alike, and 256 keeps CPU
    # training inside budget (fewer optimiser steps, better matmul efficiency).
    batch_size: int = 256
    lr: float = 1e-3
    weight_decay: float = 1e-4
    warmup: float = 0.0  # fraction of all steps with a linear warmup; the paper uses none
    seed: int = 0
    w_point: float = 1.0
    w_distance: float = 1.0
    w_angle: float = 1.0
    m: int = 100  # local neighbourhood size, capped at batch - 1 since neighbours are in-batch
    pairs_per_anchor: int = 32  # global partners (distance) and (i, k) pairs (angle) per anchor
    gamma: float = 1.0  # focal exponent
    lam: float = 1.0  # weight of the whole preservation term (the paper's lambda)
    device: str = "auto"  # "auto" = cuda when available, else cpu
    # "auto": bf16 autocast for the MLP matmuls where the hardware does bf16 natively (CUDA, or a CPU
    # with AVX512-BF16 / AMX), fp32 elsewhere; losses, master weights and `apply` stay fp32.
    precision: str = "auto"

    def __post_init__(self) -> None:
        """Reject settings that cannot train."""
        if self.hidden is not None and self.hidden < 1:
            raise ValueError(f"hidden must be positive, got {self.hidden}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.epochs < 1 or self.batch_size < 3:
            raise ValueError("epochs must be >= 1 and batch_size >= 3 (angles need three points)")
        if not 0.0 <= self.warmup < 1.0:
            raise ValueError(f"warmup is a fraction of the steps in [0, 1), got {self.warmup}")
        if self.m < 2 or self.pairs_per_anchor < 1:
            raise ValueError("m must be >= 2 and pairs_per_anchor >= 1")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"precision must be auto, bf16 or fp32, got {self.precision!r}")
        if min(self.w_point, self.w_distance, self.w_angle, self.lam, self.gamma, self.lr) < 0:
            raise ValueError("loss weights, lambda, gamma and lr must be non-negative")


def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda when available else cpu; anything else is passed to torch.device."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for training matmuls: bf16 when asked (or 'auto' and native), else None (fp32)."""
    if precision == "fp32":
        return None
    if precision == "bf16":
        return torch.bfloat16
    return torch.bfloat16 if device.type == "cuda" or _cpu_has_native_bf16() else None


def _cpu_has_native_bf16() -> bool:
    """Whether oneDNN runs bf16 matmuls natively on this CPU (AVX512-BF16 / AMX); False if unknown."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a private probe: absent in some builds
        return False


class AdapterMLP(nn.Module):
    """LayerNorm -> Linear -> GELU -> Dropout -> Linear, then L2 normalisation of the output rows."""

    def __init__(self, d_in: int, hidden: int, d_out: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_in, eps=LAYER_NORM_EPS)
        self.fc1 = nn.Linear(d_in, hidden)
        self.act = nn.GELU()
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x: Tensor) -> Tensor:
        """Map rows [n, d_in] to unit rows [n, d_out]."""
        y = self.fc2(self.drop(self.act(self.fc1(self.norm(x)))))
        return F.normalize(y, dim=-1)


# ---------------------------------------------------------------------------------------------------
# The trained artefact.
# ---------------------------------------------------------------------------------------------------


def _erf(x: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """erf in numpy (Abramowitz-Stegun 7.1.26, |error| < 1.5e-7): numpy has no erf of its own."""
    s = np.sign(x)
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    out: npt.NDArray[np.float32] = (s * (1.0 - poly * np.exp(-a * a))).astype(np.float32, copy=False)
    return out


@dataclass(eq=False)
class TrainedAdapter:
    """A fitted adapter h (new -> old) in eval mode on the CPU, with its config and training report."""

    net: AdapterMLP
    config: AdapterConfig
    new_dim: int
    old_dim: int
    report: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.net = self.net.to("cpu").eval()
        self._np = {k: v.detach().numpy().copy() for k, v in self.net.state_dict().items()}
        # Row-major matvec wants [d_in, d_out]; transposing once here saves it per call.
        self._w1t = np.ascontiguousarray(self._np["fc1.weight"].T)
        self._w2t = np.ascontiguousarray(self._np["fc2.weight"].T)

    @property
    def hidden(self) -> int:
        """Width of the hidden layer."""
        return int(self.net.fc1.out_features)

    def apply(self, new: npt.NDArray[np.floating]) -> F32:
        """Map new embeddings [n, d_new] to unit rows [n, d_old] in the old space (eval mode, no grad)."""
        x = _check_rows(new, self.new_dim)
        if len(x) <= _NUMPY_MAX_ROWS:
            return self.apply_numpy(x)
        return self.apply_torch(x)

    def apply_torch(self, new: npt.NDArray[np.floating]) -> F32:
        """`apply` through torch, in chunks of 8192 rows."""
        x = _check_rows(new, self.new_dim)
        out = np.empty((len(x), self.old_dim), dtype=np.float32)
        with torch.inference_mode():
            for s in range(0, len(x), _APPLY_CHUNK):
                chunk = F.normalize(torch.from_numpy(x[s : s + _APPLY_CHUNK]), dim=-1)
                out[s : s + _APPLY_CHUNK] = self.net(chunk).numpy()
        return out

    def apply_numpy(self, new: npt.NDArray[np.floating]) -> F32:
        """`apply` in plain numpy with the same weights (the low-latency path for a few rows)."""
        x = _check_rows(new, self.new_dim)
        p = self._np
        x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), DIST_EPS)
        mu = x.mean(axis=1, keepdims=True)
        xc = x - mu
        var = np.mean(xc * xc, axis=1, keepdims=True)
        z = xc / np.sqrt(var + LAYER_NORM_EPS) * p["norm.weight"] + p["norm.bias"]
        a = z @ self._w1t + p["fc1.bias"]
        a = 0.5 * a * (1.0 + _erf(a * np.float32(1.0 / math.sqrt(2.0))))
        y = a @ self._w2t + p["fc2.bias"]
        out: F32 = (y / np.maximum(np.linalg.norm(y, axis=1, keepdims=True), DIST_EPS)).astype(np.float32)
        return out

    def state_dict_tensors(self) -> dict[str, Tensor]:
        """h's weights as contiguous CPU float32 tensors named `adapter.<layer>.<param>` (safetensors-ready)."""
        return {
            TENSOR_PREFIX + k: v.detach().to("cpu", torch.float32).contiguous().clone()
            for k, v in self.net.state_dict().items()
        }

    def meta(self) -> dict[str, Any]:
        """JSON-able description needed (with the tensors) to rebuild the adapter."""
        return {
            "format": FORMAT,
            "new_dim": self.new_dim,
            "old_dim": self.old_dim,
            "hidden": self.hidden,
            "layer_norm_eps": LAYER_NORM_EPS,
            "config": asdict(self.config),
            "report": self.report,
        }


def _check_rows(x: npt.NDArray[np.floating], dim: int) -> F32:
    """Validate rows [n, dim] and return them as contiguous float32."""
    arr = np.ascontiguousarray(x, dtype=np.float32)
    assert arr.ndim == 2 and arr.shape[1] == dim, f"expected [n, {dim}] rows, got shape {arr.shape}"
    return arr


def load_adapter(tensors: Mapping[str, Tensor | npt.NDArray[np.float32]], meta: Mapping[str, Any]) -> TrainedAdapter:
    """Rebuild a TrainedAdapter from `state_dict_tensors()` output (torch or numpy) and `meta()`."""
    if meta.get("format") != FORMAT:
        raise ValueError(f"adapter format {meta.get('format')!r} is not {FORMAT!r}")
    new_dim, old_dim, hidden = int(meta["new_dim"]), int(meta["old_dim"]), int(meta["hidden"])
    known = {f.name for f in fields(AdapterConfig)}
    config = AdapterConfig(**{k: v for k, v in dict(meta.get("config", {})).items() if k in known})
    net = AdapterMLP(new_dim, hidden, old_dim, config.dropout)
    expected = {TENSOR_PREFIX + k: tuple(v.shape) for k, v in net.state_dict().items()}
    state: dict[str, Tensor] = {}
    for name, shape in expected.items():
        if name not in tensors:
            raise ValueError(f"adapter tensor {name!r} is missing")
        t = torch.as_tensor(tensors[name])
        if tuple(t.shape) != shape or t.dtype != torch.float32:
            raise ValueError(f"adapter tensor {name!r}: {t.dtype} {tuple(t.shape)}, expected float32 {shape}")
        state[name[len(TENSOR_PREFIX) :]] = t
    net.load_state_dict(state, strict=True)
    return TrainedAdapter(net, config, new_dim, old_dim, dict(meta.get("report", {})))


# ---------------------------------------------------------------------------------------------------
# Training.
# ---------------------------------------------------------------------------------------------------


def _lr_factor(step: int, total: int, warmup_steps: int) -> float:
    """Linear warmup to 1, then cosine decay to 0 at the last step."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup_steps) / span)))


def _batches(n: int, batch_size: int, gen: torch.Generator) -> list[Tensor]:
    """A shuffled epoch of row indices; a tail too small for angles joins the previous batch."""
    perm = torch.randperm(n, generator=gen)
    parts = list(torch.split(perm, batch_size))
    if len(parts) > 1 and len(parts[-1]) < 3:
        tail = parts.pop()
        parts[-1] = torch.cat([parts[-1], tail])
    return parts


class LiveMap:
    """h as it is during training, usable as a row map between epochs (eval mode while applied, no grad)."""

    def __init__(self, net: AdapterMLP, device: torch.device) -> None:
        self.net = net
        self.device = device

    def apply(self, new: npt.NDArray[np.floating]) -> F32:
        """Map rows [n, d_new] to unit rows [n, d_old] with the current weights."""
        x = np.ascontiguousarray(new, dtype=np.float32)
        out = np.empty((len(x), self.net.fc2.out_features), dtype=np.float32)
        was_training = self.net.training
        self.net.eval()
        try:
            with torch.inference_mode():
                for s in range(0, len(x), _APPLY_CHUNK):
                    chunk = F.normalize(torch.from_numpy(x[s : s + _APPLY_CHUNK]).to(self.device), dim=-1)
                    out[s : s + _APPLY_CHUNK] = self.net(chunk).float().cpu().numpy()
        finally:
            self.net.train(was_training)
        return out


EpochHook = Callable[[int, LiveMap], None]


def train_adapter(
    new: npt.NDArray[np.floating],
    old: npt.NDArray[np.floating],
    config: AdapterConfig | None = None,
    progress: bool = True,
    *,
    on_epoch: EpochHook | None = None,
    stop_after: int | None = None,
) -> TrainedAdapter:
    """Fit h (and its inverse g) on support pairs new [n, d_new] / old [n, d_old]; seeded, AdamW, cosine LR.

    on_epoch(e, live) runs after epoch e (1-based) with h as it is then, e.g. to score held-out rows.
    stop_after ends training after that many epochs of the config.epochs schedule (the learning rate
    follows the full schedule), so a run stopped at epoch e equals the first e epochs of a full run:
    what early stopping chose on the folds is what the final adapter gets.
    """
    cfg = config or AdapterConfig()
    new32, old32 = np.ascontiguousarray(new, np.float32), np.ascontiguousarray(old, np.float32)
    assert new32.ndim == 2 and old32.ndim == 2, "expected 2-d arrays"
    assert len(new32) == len(old32), f"{len(new32)} new rows but {len(old32)} old rows"
    assert len(new32) >= 3, "need at least three support pairs"
    assert np.isfinite(new32).all() and np.isfinite(old32).all(), "support pairs contain NaN/inf"
    n, d_new = new32.shape
    d_old = old32.shape[1]
    run_epochs = cfg.epochs if stop_after is None else max(1, min(cfg.epochs, stop_after))
    device = resolve_device(cfg.device)
    new_t, old_t = torch.from_numpy(new32), torch.from_numpy(old32)

    rng_devices = [device.index or 0] if device.type == "cuda" else []
    started = time.perf_counter()
    # fork_rng keeps the caller's global RNG untouched while dropout draws from a seeded stream.
    with torch.random.fork_rng(devices=rng_devices):
        torch.manual_seed(cfg.seed)
        h = AdapterMLP(d_new, cfg.hidden or d_new, d_old, cfg.dropout).to(device)
        g = AdapterMLP(d_old, cfg.hidden or d_old, d_new, cfg.dropout).to(device)
        gen = torch.Generator().manual_seed(cfg.seed)
        params = [*h.parameters(), *g.parameters()]
        # The fused kernel is several times faster than the per-tensor loop on CPU.
        opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
        amp = autocast_dtype(cfg.precision, device)
        steps_per_epoch = len(_batches(n, cfg.batch_size, torch.Generator().manual_seed(0)))
        total = cfg.epochs * steps_per_epoch
        warmup_steps = int(cfg.warmup * total)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, total, warmup_steps))
        history: list[dict[str, float]] = []
        h.train()
        g.train()
        bar = progress_bar(
            total=run_epochs * steps_per_epoch, desc="adapter", unit="step", enabled=progress, leave=False
        )
        for epoch in range(run_epochs):
            sums: dict[str, Tensor] = {}
            for rows in _batches(n, cfg.batch_size, gen):
                x_new = F.normalize(new_t.index_select(0, rows).to(device, non_blocking=True), dim=-1)
                x_old = F.normalize(old_t.index_select(0, rows).to(device, non_blocking=True), dim=-1)
                g_new = gram(x_new)
                index = batch_index(g_new, cfg.m, cfg.pairs_per_anchor, gen)
                with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
                    out = h(x_new).float()
                    recon = g(out).float()
                loss, parts = mkp_loss(out, recon, x_new, x_old, index, cfg, g_new=g_new)
                opt.zero_grad(set_to_none=True)
                torch.autograd.backward(loss)
                opt.step()
                sched.step()
                for k, v in parts.items():
                    sums[k] = sums.get(k, torch.zeros((), device=device)) + v
                bar.update(1)
            # One host sync per epoch: per-step .item() calls would stall a GPU pipeline.
            history.append({k: float(v) / steps_per_epoch for k, v in sums.items()})
            bar.set_postfix(epoch=epoch + 1, loss=f"{history[-1]['total']:.4f}")
            if on_epoch is not None:
                on_epoch(epoch + 1, LiveMap(h, device))
        bar.close()
    report = {
        "pairs": n,
        "epochs": run_epochs,
        "steps": run_epochs * steps_per_epoch,
        "seconds": round(time.perf_counter() - started, 3),
        "device": str(device),
        "autocast": str(amp).removeprefix("torch.") if amp is not None else "fp32",
        "history": history,
    }
    return TrainedAdapter(h, cfg, d_new, d_old, report)
