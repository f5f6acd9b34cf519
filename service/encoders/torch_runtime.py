"""What every torch-backed real encoder shares: the local model, offline loading, the extra check, threads, streams.

Threads: torch's intra-op thread count is per OS thread under OpenMP (each thread keeps its own
setting), so each encoder sets its own count on the worker thread that runs it, before every batch.
`torch.get_num_threads()` first, because the first parallel region of a thread resets the count to
the process-wide value unless the thread has initialised it already.
Streams: on CUDA each encoder enqueues its kernels on its own stream, so two encoders sharing one GPU
do not serialise behind each other on the default stream.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from service.encoders.base import Embeddings, cpu_threads
from service.encoders.identity import weights_fingerprint
from service.errors import InputError
from service.settings import EncoderSettings

if TYPE_CHECKING:
    import torch

MODELS_EXTRA = "pip install 'nobackfill[models]'"


def go_offline() -> None:
    """Forbid the Hugging Face libraries any network access (weights come from local folders only)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the worker threads are the parallelism


# Two encoders load at once on two threads; transformers' lazy modules are not safe to import
# concurrently (one thread can see a half-initialised module and fail with ImportError).
LOADING = threading.Lock()


def import_failure(backend: str, exc: ImportError) -> InputError:
    """The error for a backend whose model library is missing (name the extra) or broken (say why)."""
    if exc.name is None or importlib.util.find_spec(exc.name.partition(".")[0]) is None:
        return InputError(f"backend {backend} needs the models extra: {MODELS_EXTRA} ({exc.name} is not installed)")
    return InputError(f"backend {backend}: its model library failed to import: {exc}")


def model_folder(settings: EncoderSettings, backend: str) -> Path:
    """The configured local model folder; InputError when unset or absent."""
    if not settings.path:
        raise InputError(f"backend {backend} needs a local model folder in its path setting")
    folder = Path(settings.path).expanduser()
    if not folder.is_dir():
        raise InputError(f"model folder {folder} does not exist")
    return folder


def model_id(settings: EncoderSettings, folder: Path) -> str:
    """settings.model_id, else the model folder's own name (as given: a symlink's name, not its target's)."""
    return settings.model_id or folder.name or folder.resolve().name


def load_failure(folder: Path, exc: Exception) -> InputError:
    """A one-line error for a model folder the library could not load."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return InputError(f"cannot load the model in {folder}: {type(exc).__name__}: {first}")


@contextlib.contextmanager
def loading(backend: str, folder: Path) -> Iterator[None]:
    """Import the model library and load a folder: offline, one load at a time, failures in one line.

    An ImportError names the extra to install (or says why the installed library broke); anything
    else the library raises names the folder.
    """
    go_offline()
    with LOADING:
        try:
            yield
        except ImportError as exc:
            raise import_failure(backend, exc) from exc
        except InputError:
            raise
        except Exception as exc:  # the libraries raise whatever their loaders raise
            raise load_failure(folder, exc) from exc


class TorchRuntime:
    """Device, dtype, thread count and CUDA stream of one encoder; `run()` wraps each batch."""

    def __init__(self, settings: EncoderSettings, device: str) -> None:
        import torch

        self.device = device
        self.cuda = device.startswith("cuda")
        if self.cuda and not torch.cuda.is_available():
            raise InputError(f"device {device} requested but torch sees no CUDA device")
        if self.cuda:
            self.dtype = torch.float16 if settings.fp16 else torch.float32
        else:
            self.dtype = torch.bfloat16 if settings.cpu_bf16 else torch.float32
        self.threads = None if self.cuda else cpu_threads(settings.threads)
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None  # type: ignore[no-untyped-call]

    @contextlib.contextmanager
    def run(self) -> Iterator[None]:
        """Inference mode, this encoder's thread count (CPU) or stream (CUDA), on the calling thread."""
        import torch

        if self.threads is not None and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        with (
            torch.inference_mode(),
            torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext(),
        ):
            yield

    def details(self) -> dict[str, Any]:
        """dtype and threads, for /v1/info."""
        return {"dtype": str(self.dtype).removeprefix("torch."), "threads": self.threads}


@dataclass(frozen=True)
class LocalModel:
    """A torch backend's model before it loads: its folder, id, the fingerprint of its weights, the runtime."""

    folder: Path
    model_id: str
    fingerprint: str
    runtime: TorchRuntime


def local_model(settings: EncoderSettings, device: str, backend: str) -> LocalModel:
    """The configured model folder (InputError when unset or absent), its id and fingerprint, a runtime on `device`."""
    folder = model_folder(settings, backend)
    return LocalModel(folder, model_id(settings, folder), weights_fingerprint(folder), TorchRuntime(settings, device))


class TorchEncoder:
    """What a torch backend's encoder holds of its local model: folder, runtime (and its device), id, fingerprint."""

    def __init__(self, local: LocalModel) -> None:
        self.folder = local.folder
        self.runtime = local.runtime
        self.device = local.runtime.device
        self.model_id = local.model_id
        self.fingerprint = local.fingerprint


def unit_rows(x: torch.Tensor) -> Embeddings:
    """float32 numpy rows scaled to unit norm; a zero or non-finite row comes back as zero, never NaN."""
    import torch

    x = x.float()
    x = torch.where(torch.isfinite(x).all(dim=1, keepdim=True), x, torch.zeros_like(x))
    norms = torch.linalg.vector_norm(x, dim=1, keepdim=True)
    rows = (x / torch.where(norms > 0, norms, torch.ones_like(norms))).cpu().numpy()
    return np.ascontiguousarray(rows, dtype=np.float32)
