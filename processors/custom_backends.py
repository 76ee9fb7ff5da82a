"""Custom guided-decoding backends loaded from a directory, as NVIDIA NIM defines them.

Each `DIR/NAME/` holds a `backend.py` and optionally wheel files. The wheels are installed at
start-up, offline, into a private directory (never into the server's environment). `backend.py`
provides:

* `async def get_custom_guided_decoding_logits_processor(request, tokenizer)` → a per-request
  `proc(input_ids, scores) -> scores` (input_ids: the tokens generated so far; scores: the
  request's 1-D Paddle logits row, modified in place and returned), or None when the backend does
  not constrain the request (then the request must not ask for a constraint);
* optionally `async def set_custom_guided_decoding_parameters(request)`, awaited once before
  generation; the `contextvars` it sets are visible to the processor;
* optionally `async def get_guided_decoding_constrained_generator(response, raw_request)`, which
  rewrites the final response (or wraps the stream).

Loading runs the directory's code, so it needs the operator's explicit `--trust-custom-code`.
A backend that raises or exits while it is imported is a start-up error naming it. Its hooks and
processors run under the time limits of built-in guided decoding, on threads of their own, and
whatever they return is checked (docs/generation_extensions.md, "When a backend misbehaves").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import importlib.util
import inspect
import logging
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import paddle

from fastdeploy_lp.processors.base import LogitsProcessor, RequestFailures, active_slots

logger = logging.getLogger(__name__)

TRUST_ENV = "FDLP_TRUST_CUSTOM_CODE"  # declared in fastdeploy_lp.envs


@dataclass
class CustomBackend:
    name: str
    get_logits_processor: Callable
    set_parameters: Callable | None = None
    constrained_generator: Callable | None = None


def load_custom_backends(directory: str, trust_custom_code: bool, private_dir: str | None = None
                         ) -> dict[str, CustomBackend]:
    """Import every `directory/NAME/backend.py`; raise ValueError with what to change if not possible."""
    if not trust_custom_code:
        raise ValueError(f"--custom-guided-decoding-backends {directory} would run the code in that directory; "
                         f"start with --trust-custom-code (or {TRUST_ENV}=1) to allow it")
    if not os.path.isdir(directory):
        raise ValueError(f"--custom-guided-decoding-backends: {directory!r} is not a directory")
    private_dir = private_dir or tempfile.mkdtemp(prefix="fastdeploy-lp-backends-")
    backends = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if not os.path.isfile(os.path.join(path, "backend.py")):
            continue
        site = os.path.join(private_dir, name)
        _install_wheels(path, site)
        backends[name] = _import_backend(name, os.path.join(path, "backend.py"), site)
        logger.info("loaded custom guided decoding backend %r", name)
    if not backends:
        raise ValueError(f"--custom-guided-decoding-backends: no NAME/backend.py under {directory!r}")
    return backends


def _install_wheels(backend_dir: str, site: str) -> None:
    wheels = sorted(os.path.join(backend_dir, f) for f in os.listdir(backend_dir) if f.endswith(".whl"))
    if not wheels:
        return
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
           "--disable-pip-version-check", "--target", site, *wheels]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise ValueError(f"custom backend {os.path.basename(backend_dir)!r}: installing its wheels failed: "
                         f"{done.stderr.strip()[-500:]}")


def _import_backend(name: str, path: str, site: str) -> CustomBackend:
    if os.path.isdir(site) and site not in sys.path:
        sys.path.append(site)  # after the server's own packages: a backend's wheels never shadow them
    spec = importlib.util.spec_from_file_location(f"fastdeploy_lp_custom_backend_{name}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # SystemExit too: a backend's exit is a start-up error, not the server's exit
        raise ValueError(f"custom backend {name!r}: importing backend.py failed: {type(e).__name__}: {e}") from e
    hooks = {}
    for attr, required in (("get_custom_guided_decoding_logits_processor", True),
                           ("set_custom_guided_decoding_parameters", False),
                           ("get_guided_decoding_constrained_generator", False)):
        fn = getattr(module, attr, None)
        if fn is None and required:
            raise ValueError(f"custom backend {name!r}: backend.py defines no {attr}()")
        if fn is not None and not inspect.iscoroutinefunction(fn):
            raise ValueError(f"custom backend {name!r}: {attr} must be an async function")
        hooks[attr] = fn
    return CustomBackend(name, hooks["get_custom_guided_decoding_logits_processor"],
                         hooks["set_custom_guided_decoding_parameters"],
                         hooks["get_guided_decoding_constrained_generator"])


class BackendTokenizer:
    """What a backend sees as `tokenizer`: the `transformers`-style subset NIM backends use."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.vocab_size = tokenizer.vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


class BackendRequestError(ValueError):
    """The backend refused or could not prepare this request (it raised, or ran out of time)."""


class MalformedBackendResult(RuntimeError):
    """The backend answered with something it may not: no processor for a constrained request, or
    an object that is not what its hook must return."""


async def prepare_request(backend: CustomBackend, request: Any, tokenizer, *, constrained_by: str | None,
                          timeout_s: float | None) -> dict[str, Any]:
    """Run the backend's hooks for one request; returns the `SamplingParams.extra` entries to set.

    The hooks run on their own thread and event loop, under `timeout_s` (the compile limit of the
    built-in guided decoding): one that blocks or never returns fails this request, not the server.
    The processor later runs inside a copy of the context the parameter hook ran in, so
    `contextvars` set there are visible to it. `constrained_by` names the request field
    that asked for a constraint: such a request may not go unconstrained because the backend
    returned no processor.
    """
    async def hooks():
        if backend.set_parameters is not None:
            await backend.set_parameters(request)
        return await backend.get_logits_processor(request, BackendTokenizer(tokenizer)), contextvars.copy_context()

    done: concurrent.futures.Future = concurrent.futures.Future()
    threading.Thread(target=_run_to_future, args=(done, asyncio.run, hooks()), daemon=True,
                     name=f"custom-backend-{backend.name}").start()
    try:
        proc, context = await asyncio.wait_for(asyncio.wrap_future(done), timeout_s)
    except asyncio.TimeoutError:
        logger.warning("custom backend %r did not prepare a request within %g s", backend.name, timeout_s)
        raise BackendRequestError(f"backend {backend.name!r} did not prepare this request within {timeout_s:g} s "
                                  "(the guided-decoding compile limit)") from None
    except Exception as e:  # the backend rejected the request or failed on it
        raise BackendRequestError(f"backend {backend.name!r} failed on this request: {type(e).__name__}: {e}") from None
    if proc is None:
        if constrained_by is not None:
            raise MalformedBackendResult(f"custom guided decoding backend {backend.name!r} returned no logits "
                                         f"processor for a request constrained by {constrained_by}; it would "
                                         "run unconstrained")
        return {}
    if not callable(proc):
        raise MalformedBackendResult(f"custom guided decoding backend {backend.name!r}: "
                                     f"get_custom_guided_decoding_logits_processor returned {type(proc).__name__}, "
                                     "not a callable proc(input_ids, scores) -> scores or None")
    return {"request_logits_processor": proc, "request_context": context, "request_backend": backend.name}


def _run_to_future(future: concurrent.futures.Future, fn, *args) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn(*args))
    except BaseException as e:  # noqa: BLE001 - SystemExit from a backend is its failure, handed over
        future.set_exception(e if isinstance(e, Exception) else RuntimeError(f"{type(e).__name__}: {e}"))


class RequestLogitsProcessorAdapter(LogitsProcessor):
    """Runs per-request processors (`SamplingParams.extra["request_logits_processor"]`) in the batch.

    Each callable sees its own row and its request's generated ids, on a worker thread under the
    step's time limit (`logits_processor_timeout_s`, the one built-in guided decoding runs under):
    one that raises, returns anything but its row of scores, or runs out of time fails only its
    own request, never leaving it unconstrained. A call that never returns strands its worker,
    which is replaced.
    """

    def __init__(self, fd_config):
        super().__init__(fd_config)
        self._rows: list[tuple[int, int, Callable, contextvars.Context, list[int], str]] = []
        self._timeout_s = fd_config.logits_processor_timeout_s
        self._worker = _DaemonWorker()

    @classmethod
    def declared_keys(cls):
        return frozenset()  # reads no logits_processors_args keys

    @classmethod
    def is_enabled_by(cls, args, params=None) -> bool:
        return params is not None and "request_logits_processor" in params.extra

    def update_state(self, share_inputs):
        self._rows = []
        for row, slot in enumerate(active_slots(share_inputs)):
            params = share_inputs["sampling_params"][slot]
            if params is not None and "request_logits_processor" in params.extra:
                extra = params.extra
                self._rows.append((row, slot, extra["request_logits_processor"], extra["request_context"],
                                   share_inputs["output_ids"][slot], extra.get("request_backend", "custom")))

    def apply(self, logits):
        failures = {}
        deadline = None if self._timeout_s is None else time.monotonic() + self._timeout_s
        for row, slot, proc, context, output_ids, backend in self._rows:
            scores = logits[row]
            try:
                out = self._call(context, proc, list(output_ids), scores, deadline)
            except concurrent.futures.TimeoutError:
                failures[slot] = (f"custom guided decoding backend {backend!r}: its logits processor took longer "
                                  f"than the per-step limit of {self._timeout_s:g} s (--logits-processor-timeout)")
                continue
            except Exception as e:  # a backend's bug fails its own request, not the batch
                failures[slot] = f"custom guided decoding backend {backend!r} failed: {type(e).__name__}: {e}"
                continue
            if not isinstance(out, paddle.Tensor) or list(out.shape) != list(scores.shape):
                failures[slot] = (f"custom guided decoding backend {backend!r}: its logits processor returned "
                                  f"{_describe(out)}; it must return the scores it was given "
                                  f"(a tensor of shape {list(scores.shape)})")
                continue
            logits[row] = out
        if failures:
            raise RequestFailures(failures)
        return logits

    def _call(self, context, proc, output_ids, scores, deadline):
        future = self._worker.submit(context.run, proc, output_ids, scores)
        try:
            return future.result(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            self._worker.close()  # its thread is stuck in the call; a fresh one takes the next
            self._worker = _DaemonWorker()
            raise


class _DaemonWorker:
    """One daemon thread running calls in order. Unlike a `ThreadPoolExecutor`'s, a thread stuck
    in a backend's call never holds up the interpreter's exit."""

    def __init__(self):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="custom-backend-proc", daemon=True).start()

    def submit(self, fn, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((future, fn, args))
        return future

    def close(self) -> None:
        self._calls.put(None)

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn, args = call
            _run_to_future(future, fn, *args)


def _describe(value) -> str:
    if value is None:
        return "None"
    shape = getattr(value, "shape", None)
    return f"{type(value).__name__}" + (f" of shape {list(shape)}" if shape is not None else "")
