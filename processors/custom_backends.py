"""Custom guided-decoding backends loaded from a directory, as NVIDIA NIM defines them.

Each `DIR/NAME/` holds a `backend.py` and optionally wheel files. The wheels are installed at
start-up, offline, into a private directory (never into the server's environment). `backend.py`
provides:

* `async def get_custom_guided_decoding_logits_processor(request, tokenizer)` → a per-request
  `proc(input_ids, scores) -> scores` (input_ids: the tokens generated so far; scores: the
  request's 1-D Paddle logits row, modified in place and returned), or None;
* optionally `async def set_custom_guided_decoding_parameters(request)`, awaited once before
  generation; the `contextvars` it sets are visible to the processor;
* optionally `async def get_guided_decoding_constrained_generator(response, raw_request)`, which
  rewrites the final response (or wraps the stream).

Loading runs the directory's code, so it needs the operator's explicit `--trust-custom-code`.
"""

from __future__ import annotations

import contextvars
import importlib.util
import inspect
import logging
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Callable

from .base import LogitsProcessor, RequestFailures, active_slots

logger = logging.getLogger(__name__)

TRUST_ENV = "FASTDEPLOY_LP_TRUST_CUSTOM_CODE"


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
    except Exception as e:
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


async def prepare_request(backend: CustomBackend, request: Any, tokenizer) -> dict[str, Any]:
    """Run the backend's hooks for one request; returns the `SamplingParams.extra` entries to set.

    The processor later runs on the engine thread inside a copy of the context the parameter hook
    ran in, so `contextvars` set there are visible to it.
    """
    async def hooks():
        if backend.set_parameters is not None:
            await backend.set_parameters(request)
        return await backend.get_logits_processor(request, BackendTokenizer(tokenizer)), contextvars.copy_context()

    proc, context = await _in_fresh_context(hooks)
    return {} if proc is None else {"request_logits_processor": proc, "request_context": context}


async def _in_fresh_context(coroutine_fn):
    import asyncio

    return await asyncio.get_running_loop().create_task(coroutine_fn(), context=contextvars.copy_context())


class RequestLogitsProcessorAdapter(LogitsProcessor):
    """Runs per-request processors (`SamplingParams.extra["request_logits_processor"]`) in the batch.

    Each callable sees its own row and its request's generated ids; one that raises fails only its
    own request.
    """

    def __init__(self, fd_config):
        super().__init__(fd_config)
        self._rows: list[tuple[int, int, Callable, contextvars.Context, list[int]]] = []

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
                self._rows.append((row, slot, params.extra["request_logits_processor"],
                                   params.extra["request_context"], share_inputs["output_ids"][slot]))

    def apply(self, logits):
        failures = {}
        for row, slot, proc, context, output_ids in self._rows:
            try:
                logits[row] = context.run(proc, list(output_ids), logits[row])
            except Exception as e:  # a backend's bug fails its own request, not the batch
                failures[slot] = f"custom guided decoding backend failed: {type(e).__name__}: {e}"
        if failures:
            raise RequestFailures(failures)
        return logits
