"""Calling a loss function: in this process, or in a worker so that a hang or a crash is a finding.

:class:`InProcess` calls it here (no timeout). :class:`Isolated`:

The worker loads the implementation from its spec (built-in name, module:function or
file.py:function) and serves one :func:`m2po_oracle.judge.contract.measure` per request. A call
that takes longer than ``timeout_s`` gets the worker killed and a ``timeout`` finding; a
worker that dies (segfault, ``os._exit``) gives a ``crashed`` finding. A fresh worker is
started for the next call. Worker processes come from a forkserver that has torch
preloaded, so a restart costs a fraction of a second after the first.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import multiprocessing.connection
import os
import signal
import tempfile
import time
from typing import Any

from m2po_oracle.adapters import adapt
from m2po_oracle.call.resolve import load_implementation
from m2po_oracle.errors import LoadError as ImplementationLoadError  # one load error, whichever way it is called
from m2po_oracle.judge.contract import Finding, Implementation, Measurement, measure, rounded_batch, with_output
from m2po_oracle.judge.validation import ProbeResult, probe, run_probe
from m2po_oracle.oracle.batch import Batch

#: Starting a worker imports torch and the implementation: allow for that separately.
STARTUP_TIMEOUT_S = 180.0
#: A port compiled with torch.compile compiles on its first call in each worker (tens of
#: seconds on a CPU): that call may take this long, or the per-call timeout if longer.
FIRST_COMPILED_CALL_S = 300.0
#: Setting it to 1 makes torch.compile a no-op: the port runs eagerly.
EAGER_ENV = "TORCHDYNAMO_DISABLE"


def compiled(fn: Any) -> bool:
    """Whether ``fn`` (or the port an adapter wraps) is compiled with torch.compile and will
    compile on its first call (not under TORCHDYNAMO_DISABLE=1)."""
    if os.environ.get(EAGER_ENV) == "1":
        return False
    seen = 0
    while fn is not None and seen < 8:
        if hasattr(fn, "_torchdynamo_orig_callable") or type(fn).__name__ == "OptimizedModule":
            return True
        call = getattr(fn, "bound_call", None)
        fn = call.fn if call is not None else getattr(fn, "__wrapped__", None)
        seen += 1
    return False


_context: Any = None


def _forkserver() -> Any:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(["torch", "numpy", "m2po_oracle.judge.contract", "m2po_oracle.core.loss"])
    return _context


def _serve(
    spec: str,
    adapter: str | None,
    bindings: tuple[str, ...],
    capture: bool,
    rejecting: tuple[str, ...],
    connection: multiprocessing.connection.Connection,
) -> None:
    # Ctrl-C reaches the whole process group: the parent writes the partial report and
    # stops this worker; a traceback from here would only clutter the terminal.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            fn = adapt(load_implementation(spec), adapter, bindings)
    except Exception as error:  # reported to the parent as a load failure
        connection.send(("load_error", str(error)))
        return
    connection.send(("ready", compiled(fn)))
    # Output written below Python (C extensions, os.write) goes to a file we read per call.
    native = _NativeOutput() if capture else None
    while True:
        try:
            request = connection.recv()
        except EOFError:
            return
        if request is None:
            return
        kind, payload, dtype, device = request
        if kind == "probe":
            connection.send(("result", run_probe(fn, payload, dtype=dtype, device=device, rejecting=rejecting)))
        else:
            measurement = measure(fn, Batch.from_dict(payload), dtype=dtype, device=device, capture=capture)
            connection.send(("result", with_output(measurement, native.read()) if native else measurement))


class _NativeOutput:
    """File descriptors 1 and 2 of this process, redirected to a file read incrementally."""

    def __init__(self) -> None:
        self._file = tempfile.TemporaryFile(mode="w+b")  # noqa: SIM115 - open for the process's life, closed by close()
        for fd in (1, 2):
            os.dup2(self._file.fileno(), fd)

    def read(self) -> str:
        self._file.seek(0)
        data = self._file.read()
        self._file.seek(0)
        self._file.truncate()
        return data.decode("utf-8", "replace")


class InProcess:
    """Calls a loss function in this process (no timeout: a hang hangs the caller)."""

    timeouts = 0
    crashes = 0

    def __init__(self, fn: Implementation, *, capture: bool = True, rejecting: tuple[str, ...] = ()) -> None:
        self.fn, self.capture, self.rejecting = fn, capture, rejecting

    def measure(self, batch: Batch, *, dtype: str = "float64", device: str = "cpu") -> Measurement:
        return measure(self.fn, batch, dtype=dtype, device=device, capture=self.capture)

    def probe(self, name: str, *, dtype: str = "float64", device: str = "cpu") -> Any:
        return run_probe(self.fn, name, dtype=dtype, device=device, rejecting=self.rejecting)


class Isolated:
    """A runner: ``measure(batch, *, dtype, device)`` in a worker process, with a timeout."""

    def __init__(
        self,
        spec: str,
        *,
        timeout_s: float = 60.0,
        adapter: str | None = None,
        bindings: tuple[str, ...] = (),
        capture: bool = True,
        rejecting: tuple[str, ...] = (),
    ) -> None:
        if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not timeout_s > 0:
            raise ValueError(f"timeout_s: expected a number > 0, got {timeout_s!r}")
        self.spec = spec
        self.adapter = adapter
        self.bindings = tuple(bindings)  # the adapter's --bind KEY=VALUE, applied in the worker as in this process
        self.capture, self.rejecting = capture, rejecting
        self.timeout_s = float(timeout_s)
        self.timeouts = 0
        self.crashes = 0
        self._process: Any = None
        self._connection: Any = None
        #: The worker's port compiles on its first call: that call's limit is raised.
        self.compiled = False
        self._first_call = False

    def start(self) -> None:
        """Start the worker and wait until it has loaded the implementation.

        Raises :class:`ImplementationLoadError` if the spec cannot be loaded there."""
        context = _forkserver()
        parent, child = context.Pipe()
        process = context.Process(
            target=_serve,
            args=(self.spec, self.adapter, self.bindings, self.capture, self.rejecting, child),
            daemon=True,
            name=f"m2po-impl:{self.spec}",
        )
        process.start()
        child.close()
        if not parent.poll(STARTUP_TIMEOUT_S):
            self._kill(process)
            raise ImplementationLoadError(f"impl: the worker for {self.spec!r} did not start within {STARTUP_TIMEOUT_S:.0f} s")
        try:
            kind, detail = parent.recv()
        except EOFError:
            self._kill(process)
            raise ImplementationLoadError(
                f"impl: the worker for {self.spec!r} died while loading it (exit code {process.exitcode})"
            ) from None
        if kind == "load_error":
            self._kill(process)
            raise ImplementationLoadError(detail)
        self._process, self._connection = process, parent
        self.compiled = self._first_call = bool(detail)

    def measure(self, batch: Batch, *, dtype: str = "float64", device: str = "cpu") -> Measurement:
        reply, problem = self._call(("measure", batch.to_dict(), dtype, device))
        if problem is None:
            return reply
        return Measurement(rounded_batch(batch, dtype), dtype, None, problem)

    def probe(self, name: str, *, dtype: str = "float64", device: str = "cpu") -> Any:
        """One validation probe (``validation.run_probe``) in the worker."""
        reply, problem = self._call(("probe", name, dtype, device))
        if problem is None:
            return reply
        described = probe(name)
        return ProbeResult(name, described.description, "hung" if problem.kind == "timeout" else "crashed", problem.message)

    def _call(self, request: tuple) -> tuple[Any, Finding | None]:
        """Send one request; the reply, or a timeout/crashed finding (worker replaced)."""
        if self._process is None:
            self.start()
        started = time.monotonic()
        limit = max(self.timeout_s, FIRST_COMPILED_CALL_S) if self._first_call else self.timeout_s
        self._first_call = False
        try:
            self._connection.send(request)
            if self._connection.poll(limit):
                _, payload = self._connection.recv()
                return payload, None
            timed_out = True
        except (EOFError, BrokenPipeError, ConnectionResetError, OSError):
            timed_out = False  # the pipe closed under us: the worker died
        if timed_out:
            self.timeouts += 1
            self._restart()
            eager = f"; it is compiled with torch.compile: {EAGER_ENV}=1 runs it eagerly" if self.compiled else ""
            return None, Finding("timeout", f"no result within the per-call timeout of {limit:g} s (worker killed){eager}")
        self.crashes += 1
        self._process.join(5)
        code = self._process.exitcode
        self._restart()
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return None, Finding("crashed", f"the implementation's process died after {time.monotonic() - started:.2f} s ({how})")

    def _restart(self) -> None:
        self._kill(self._process)
        self._process = self._connection = None

    @staticmethod
    def _kill(process: Any) -> None:
        if process is None:
            return
        process.kill()
        process.join(5)

    def close(self) -> None:
        if self._process is not None:
            try:
                self._connection.send(None)
            except (BrokenPipeError, OSError):
                pass
            self._process.join(2)
            self._kill(self._process)
            self._process = self._connection = None

    def __enter__(self) -> Isolated:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
