"""An encoder in a child process of its own (`isolation: process`): its Python never waits on the service's GIL.

    batcher worker thread ──encode(items, modality)──► pipe ──► child: create_encoder(settings, role)
                          ◄──── float32 rows, or the exception ◄────┘

In one process, every torch op an encoder runs gives up the GIL and takes it back, and between ops the
model's modules and the tokenizer run Python: each encoder's batch waits behind the event loop, the
other encoder and the search threads.  On 2 vCPUs a MiniLM batch took 1.5-1.9x its bare time in the
service for that reason (docs/benchmarks.md).  A child has an interpreter of its own; the worker
thread only sends the texts and blocks on the pipe with the GIL released.

The child builds the encoder as the service would (`create_encoder`: the built-in backends and
entry-point plug-ins; a backend added from code with `register_backend` exists only in the parent),
warms it up and reports what /v1/info shows of it.  The child is a fresh interpreter
(`python -m service.encoders.process FD`, never a fork, which would copy torch's thread pools and CUDA
state, nor multiprocessing's spawn, which re-imports the parent's main script); the two ends talk
over a socket pair through multiprocessing's Connection (pickled messages).

    the child cannot build the encoder   InputError with the child's own one-line message (startup refusal)
    the child loads past load_timeout_s  it is killed and reaped; EncoderFailed naming the deadline (a hung
                                         load refuses the start instead of blocking it forever)
    the model raises in the child        the same exception, re-raised here (the batcher's rules apply)
    the child dies (OOM kill, a crash)   EncoderProcessExited for the batch in flight at once; a new child
                                         loads on a thread of its own meanwhile, and the next call (the
                                         batcher's call-by-call retry too) waits for it, not the failed one;
                                         one that died between calls is replaced before the next call
    a call outlives the batcher's timeout  the batcher calls interrupt(): the child is killed, so the
                                         replica is back (a new child) once it has loaded, not whenever
                                         the stuck call would have returned (a thread cannot be killed)
    ... while its child is being replaced  the interrupt is kept: the call ends as soon as the new child is
                                         ready, without running its batch there (a batch that hangs the
                                         model would otherwise hang the new child too, with no interrupt
                                         left to come); the new child is left to load, since killing it
                                         would never let a model that loads slower than timeout_s back
    the service exits                    the child reads EOF on its pipe and exits with it
"""

from __future__ import annotations

import logging
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any, Literal

import numpy as np

from service import metrics
from service.encoders.base import Embeddings, Encoder, describe
from service.errors import EncoderFailed, EncoderProcessExited, InputError, NobackfillError
from service.settings import EncoderSettings
from service.vocabulary import Modality, Role

log = logging.getLogger(__name__)

# How often a parent waiting for a loading child checks that the child is still alive.
POLL_S = 0.5
STOP_GRACE_S = 5.0


# Backends that run a real model's torch code from Python: a process of their own under `isolation: auto`.
# The simulated and external backends cost the GIL little, and a backend added from code with
# register_backend exists only in this process.
PROCESS_BY_DEFAULT = frozenset({"sentence-transformers", "clip"})


def isolation_of(settings: EncoderSettings) -> Literal["thread", "process"]:
    """Where an encoder runs: as set, or under `auto` a child process for the built-in model backends."""
    if settings.isolation != "auto":
        return settings.isolation
    return "process" if settings.backend in PROCESS_BY_DEFAULT else "thread"


def _portable(exc: BaseException) -> BaseException:
    """`exc` if it survives pickling, else a RuntimeError carrying its type and message."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


def _serve(conn: Connection) -> None:
    """The child's main: take the settings, build and warm the encoder, report it, answer calls until EOF or None."""
    # Ctrl-C (or a signal to the whole process group) reaches the children too: the parent drains its
    # requests first and then stops them; if it dies instead, the pipe's EOF ends the child.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from service.encoders.registry import create_encoder
    from service.gc_pause import freeze_startup_objects

    try:
        settings, role = conn.recv()
        encoder = create_encoder(settings, role)
        encoder.warmup()  # every child, a restarted one too, is warm before it takes a call
    except BaseException as exc:
        conn.send(("error", _portable(exc)))
        return
    freeze_startup_objects()  # the model's objects: no full collection walks them mid-batch
    conn.send(("ready", describe(encoder)))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if message is None:
            return
        items, modality = message
        try:
            conn.send(("ok", np.asarray(encoder.encode(items, modality), dtype=np.float32)))
        except Exception as exc:
            conn.send(("error", _portable(exc)))


class ProcessEncoder:
    """The Encoder protocol over a child process that runs the configured backend."""

    def __init__(self, settings: EncoderSettings, role: Role) -> None:
        self.settings = settings
        self.role = role
        self._lock = threading.Lock()  # one call on the pipe at a time
        self._conn: Connection | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._described: dict[str, Any] = {}  # the child encoder's describe(), as it reported it
        self._closed = False
        # Set by interrupt(), cleared when a call ends: an interrupt that finds no live child (it is
        # being replaced) is honoured by the waiting call once the replacement is ready.
        self._interrupted = threading.Event()
        self._respawner: threading.Thread | None = None  # loads the child that replaces one died mid-call
        self._spawn()
        # What the service reads of an encoder, from that report (a restarted child is the same model).
        self.dim: int = self._described["dim"]
        self.model_id: str = self._described["id"]
        self.device: str = self._described["device"]
        self.fingerprint: str | None = self._described["fingerprint"]
        self.modalities: tuple[Modality, ...] = tuple(self._described["modalities"])

    @property
    def pid(self) -> int | None:
        """The child's process id (None once stopped), for whoever signals it: the tests; the service never does."""
        return None if self._process is None else self._process.pid

    @property
    def replacing(self) -> bool:
        """From a child's death until its replacement reports ready: no call can be answered meanwhile.

        The batcher reads it for /readyz: with every replica replacing its child, the service is not
        ready, though nothing is stuck (a request would spend its deadline on the model's load).
        """
        return not self._closed and self._conn is None

    def details(self) -> dict[str, Any]:
        """The child encoder's own /v1/info details (its describe() minus what the protocol covers)."""
        own = {"id", "dim", "device", "fingerprint", "modalities"}
        return {key: value for key, value in self._described.items() if key not in own}

    # -- calls -----------------------------------------------------------------------------------

    def encode(self, batch: list[str], modality: Modality = Modality.text) -> Embeddings:
        """The child's rows for `batch` (its exception re-raised here; EncoderProcessExited if it died)."""
        rows: Embeddings = self._call((batch, modality))
        return rows

    def warmup(self) -> None:
        """Nothing to do: every child warms its encoder (each modality) before it reports ready."""

    def interrupt(self) -> None:
        """Kill the child in the middle of a call that has run too long; the call then fails and a new child starts.

        While the child is being replaced (no live one), the call fails once the new one is ready instead.
        """
        self._interrupted.set()
        process = self._process  # read without the lock: the stuck call holds it
        if process is not None and process.poll() is None:
            log.error("%s encoder process %d: a call outlived its timeout; killing it", self.role, process.pid)
            process.kill()
        else:
            log.error("%s encoder process: a call outlived its timeout while a new child loads", self.role)

    def close(self) -> None:
        """Ask the child to exit; terminate it when it does not within STOP_GRACE_S."""
        with self._lock:
            self._closed = True
            self._stop()
        if self._respawner is not None:
            self._respawner.join()

    def _call(self, message: tuple[Any, ...]) -> Any:
        with self._lock:
            try:
                status, value = self._call_locked(message)
            finally:
                self._interrupted.clear()  # this call's interrupt is spent (it killed its child, or ended it)
        if status == "error":
            raise value
        return value

    def _call_locked(self, message: tuple[Any, ...]) -> tuple[str, Any]:
        if self._closed:
            raise EncoderProcessExited(f"{self.role} encoder process was stopped")
        if self._process is not None and self._process.poll() is not None:
            # It died between calls (or was interrupted just as its call returned): no call of
            # its was lost, so this one waits for a new child instead of failing.
            self._replace_dead("between calls")
        if self._conn is None:  # that, the respawner has not started one yet, or the last restart failed
            self._restart()
        if self._interrupted.is_set():  # the batcher gave up on this call while the new child loaded
            raise EncoderProcessExited(f"{self.role} encoder call was interrupted while its process was replaced")
        assert self._conn is not None
        try:
            self._conn.send(message)
            report: tuple[str, Any] = self._conn.recv()
        except (EOFError, OSError) as exc:
            # This call fails now, not after a new child loaded (seconds that would read as a hung input).
            code = self._replace_dead("during a call")
            self._respawner = threading.Thread(target=self._respawn, name=f"spawn-{self.role}-again", daemon=True)
            self._respawner.start()
            raise EncoderProcessExited(f"{self.role} encoder process exited with code {code}") from exc
        return report

    def _respawn(self) -> None:
        """Load the child that replaces one that died mid-call (the next call waits on the lock for it)."""
        with self._lock:
            if self._closed or self._conn is not None:
                return
            try:
                self._restart()
            except EncoderProcessExited as exc:  # the next call tries again, and fails with this if it must
                log.error("%s", exc.message)

    # -- the child's lifecycle -------------------------------------------------------------------

    def _spawn(self) -> None:
        """Start a child and wait until it reports ready; InputError with its message when it cannot,
        EncoderFailed when it has not within load_timeout_s (the child is then killed)."""
        parent_sock, child_sock = socket.socketpair()
        process = subprocess.Popen(
            [sys.executable, "-m", "service.encoders.process", str(child_sock.fileno())], pass_fds=[child_sock.fileno()]
        )
        child_sock.close()  # only the child holds this end now: its death reads as EOF here
        conn = Connection(parent_sock.detach())
        try:
            status, value = self._await_ready(conn, process)
        except BaseException:  # too slow, dead, or this thread interrupted: no child is left loading
            conn.close()
            if process.poll() is None:
                process.kill()
            process.wait()
            raise
        if status == "error":
            conn.close()
            process.wait()
            if isinstance(value, InputError):
                raise value
            raise InputError(f"the encoder process could not build the encoder: {type(value).__name__}: {value}")
        self._conn, self._process, self._described = conn, process, value

    def _await_ready(self, conn: Connection, process: subprocess.Popen[bytes]) -> tuple[str, Any]:
        """Send the child its settings and wait for its report, at most load_timeout_s."""
        limit = self.settings.load_timeout_s
        deadline = time.monotonic() + limit
        try:
            conn.send((self.settings, self.role))
            while not conn.poll(max(0.0, min(POLL_S, deadline - time.monotonic()))):
                if process.poll() is not None:
                    break
                if time.monotonic() >= deadline:
                    raise EncoderFailed(
                        f"the encoder process did not load the model within {limit:g} s "
                        f"(NOBACKFILL_{self.role.upper()}__LOAD_TIMEOUT_S); it was killed"
                    )
            report: tuple[str, Any] = conn.recv()
        except (EOFError, OSError):
            raise InputError(f"the encoder process exited with code {process.wait()} while loading the model") from None
        return report

    def _replace_dead(self, when: str) -> int | None:
        """Reap a child that exited and count it (the caller starts the new one); the dead child's exit code."""
        code = self._reap()
        log.error("%s encoder process exited (code %s) %s; starting a new one", self.role, code, when)
        metrics.ENCODER_PROCESS_RESTARTS.labels(encoder=self.role).inc()
        return code

    def _restart(self) -> None:
        """Start a new child after one died; a failure here is this call's failure (a 500), never a 400."""
        try:
            self._spawn()
        except NobackfillError as exc:
            raise EncoderProcessExited(f"{self.role} encoder process could not be restarted: {exc.message}") from exc

    def _reap(self) -> int | None:
        """Forget a dead (or stopping) child; its exit code, None if it outlived STOP_GRACE_S."""
        process, self._process = self._process, None
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if process is None:
            return None
        try:
            return process.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            return None

    def _stop(self) -> None:
        if self._conn is not None:
            try:
                self._conn.send(None)
            except OSError:
                pass
        process = self._process
        if self._reap() is None and process is not None:
            process.kill()
            process.wait()


def start_processes(settings: EncoderSettings, role: Role, count: int) -> list[Encoder]:
    """`count` children loading side by side; when one cannot start, the others are stopped too."""
    with ThreadPoolExecutor(count, thread_name_prefix=f"spawn-{role}") as pool:
        futures = [pool.submit(ProcessEncoder, settings, role) for _ in range(count)]
    started: list[Encoder] = [future.result() for future in futures if future.exception() is None]
    failures = [exc for future in futures if (exc := future.exception()) is not None]
    if failures:
        close_all(started)
        raise failures[0]
    return started


def close_all(encoders: list[Encoder]) -> None:
    """Stop the child of every encoder that has one (in-process encoders have nothing to stop)."""
    for encoder in encoders:
        if isinstance(encoder, ProcessEncoder):
            encoder.close()


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])))
