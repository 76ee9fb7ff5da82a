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

    Each callable sees its own row and its request's generated ids. The step's calls run at the
    same time, each request's on a thread of `_CallThreads` (a request's `n` choices share one, in
    order: they share its `contextvars` context), and are waited for until the step's time limit
    (`logits_processor_timeout_s`, the one built-in guided decoding runs under). A call that raises,
    returns anything but its row of scores, or is still running at the limit fails only its own
    request, never leaving it unconstrained; the others of the step keep their results. A call that
    never returns keeps its thread (Python cannot stop one) and its request is over, so it is called
    no more; at most `2 x max_num_seqs` threads exist, and once every one of them is held that way,
    the backends' requests fail at once instead of starting more.
    """

    runs_in_place = True  # each call runs on a thread of _CallThreads, waited for until the limit

    def __init__(self, fd_config):
        super().__init__(fd_config)
        self._rows: list[tuple[int, int, Callable, contextvars.Context, list[int], str]] = []
        self._timeout_s = fd_config.logits_processor_timeout_s
        # Its calls are bounded one by one, in parallel, by the limit (so it runs in place); its own
        # limit leaves room to collect them.
        self.step_time_limit_s = None if self._timeout_s is None else self._timeout_s + COLLECT_GRACE_S
        self._threads = _CallThreads(2 * fd_config.max_num_seqs)

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
        by_context: dict[int, list[tuple]] = {}
        for item in self._rows:  # one request's choices share its context: their calls go in order
            by_context.setdefault(id(item[3]), []).append(item)
        deadline = None if self._timeout_s is None else time.monotonic() + self._timeout_s
        started = []
        for group in by_context.values():
            results: list = [None] * len(group)
            calls = [(context, proc, list(output_ids), logits[row]) for row, _, proc, context, output_ids, _ in group]
            started.append((group, results, self._threads.submit(_run_calls, calls, results)))
        futures = [future for _, _, future in started if future is not None]
        concurrent.futures.wait(futures, timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
        failures = {}
        for group, results, future in started:
            for (row, slot, _, _, _, backend), result in zip(group, results):
                error = self._failure(backend, future, result, [logits.shape[-1]])
                if error is None:
                    logits[row] = result[1]
                else:
                    failures[slot] = error
        if failures:
            raise RequestFailures(failures)
        return logits

    def _failure(self, backend: str, future, result, shape: list[int]) -> str | None:
        """Why a call's result cannot be used (None: it can). `result` is None while it runs."""
        if future is None:
            return (f"custom guided decoding backend {backend!r}: all {self._threads.size} threads for backend "
                    "calls are held by calls that never returned")
        if result is None:
            return (f"custom guided decoding backend {backend!r}: its logits processor took longer than the "
                    f"per-step limit of {self._timeout_s:g} s (--logits-processor-timeout)")
        ok, out = result
        if not ok:  # a backend's bug fails its own request, not the batch
            return f"custom guided decoding backend {backend!r} failed: {type(out).__name__}: {out}"
        if not isinstance(out, paddle.Tensor) or list(out.shape) != shape:
            return (f"custom guided decoding backend {backend!r}: its logits processor returned {_describe(out)}; "
                    f"it must return the scores it was given (a tensor of shape {shape})")
        return None


COLLECT_GRACE_S = 1.0  # the adapter's time past the calls' limit, to start them and collect their results


def _run_calls(calls: list[tuple], results: list) -> None:
    """Each call `proc(output_ids, scores)` in its context, in order; `results[i]` = (True, value)
    or (False, exception), set as each returns (the caller reads them at its deadline)."""
    for i, (context, proc, output_ids, scores) in enumerate(calls):
        try:
            results[i] = (True, context.run(proc, output_ids, scores))
        except BaseException as e:  # noqa: BLE001 - SystemExit from a backend is its failure, reported
            results[i] = (False, e if isinstance(e, Exception) else RuntimeError(f"{type(e).__name__}: {e}"))


class _CallThreads:
    """At most `size` daemon threads for backend calls. A thread takes one job at a time and is free
    again when it returns; one whose job never returns is never free again. Unlike a
    `ThreadPoolExecutor`'s, a thread stuck in a backend's call never holds up the interpreter's exit."""

    def __init__(self, size: int):
        self.size = size
        self._free: list[queue.SimpleQueue] = []  # the job queues of the threads waiting for one
        self._count = 0
        self._lock = threading.Lock()

    def submit(self, fn, *args) -> concurrent.futures.Future | None:
        """Run `fn(*args)` on a free thread (started if fewer than `size` exist); None if none is free."""
        with self._lock:
            if self._free:
                jobs = self._free.pop()
            elif self._count < self.size:
                self._count += 1
                jobs = queue.SimpleQueue()
                threading.Thread(target=self._run, args=(jobs,), name="custom-backend-call", daemon=True).start()
            else:
                return None
        future: concurrent.futures.Future = concurrent.futures.Future()
        jobs.put((future, fn, args))
        return future

    def _run(self, jobs: queue.SimpleQueue) -> None:
        while True:
            future, fn, args = jobs.get()
            _run_to_future(future, fn, *args)
            with self._lock:
                self._free.append(jobs)


def _describe(value) -> str:
    if value is None:
        return "None"
    shape = getattr(value, "shape", None)
    return f"{type(value).__name__}" + (f" of shape {list(shape)}" if shape is not None else "")
