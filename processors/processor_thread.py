"""`ProcessorThread`: one processor's calls, each under a deadline, on a thread of the processor's own.

A step cannot wait for a processor that hangs, and Python cannot stop a thread, so the pipeline
does not make the call itself: it hands it to the processor's thread and waits until the call's
deadline. A call that passes it is left running there (`CallTimedOut`), the engine thread goes on
with the step, and the processor is *late* until that call returns: every later call raises
`ProcessorLate` at once, so no second call starts on an object still in use and one processor can
hold at most one thread. When the late call returns, the processor takes calls again (its next
`update_state` shows it the batch as it is then).

Exceptions the call raises reach the caller unchanged (the pipeline isolates them as if the call
had run on its own thread); the thread itself never ends on one. It is a daemon: a call that never
returns does not hold up the interpreter's exit.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from typing import Any, Callable

logger = logging.getLogger(__name__)


class ProcessorLate(Exception):
    """The processor is still running an earlier call that passed its deadline."""

    def __init__(self, name: str, seconds: float):
        super().__init__(f"logits processor {name} is still running a call that passed the per-step limit "
                         f"{seconds:.1f} s ago; the requests that enable it fail until that call returns")


class CallTimedOut(ProcessorLate):
    """The call did not return before its deadline; it goes on running on the processor's thread."""

    def __init__(self, name: str, limit_s: float):
        Exception.__init__(self, f"logits processor {name} took longer than the per-step limit of {limit_s:g} s "
                                 "(--logits-processor-timeout)")


class ProcessorThread:
    """Runs one processor's calls in order on one daemon thread, started at the first call."""

    def __init__(self, name: str):
        self.name = name
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._started = False
        self._late: concurrent.futures.Future | None = None  # a call that passed its deadline, still running
        self._late_since = 0.0

    @property
    def late(self) -> bool:
        """Whether a call that passed its deadline still runs (checked, and cleared once it returned)."""
        if self._late is None:
            return False
        if not self._late.done():
            return True
        logger.warning("logits processor %s: its late call returned after %.1f s; it serves requests again",
                       self.name, time.monotonic() - self._late_since)
        self._late = None
        return False

    def call(self, limit_s: float, budget_s: float, fn: Callable, *args) -> Any:
        """`fn(*args)` on the thread, waited for at most `budget_s` seconds (what is left of the
        processor's `limit_s` this step). Raises what it raised, `CallTimedOut` when the budget runs
        out, or `ProcessorLate` while an earlier call is still running."""
        if self.late:
            raise ProcessorLate(self.name, time.monotonic() - self._late_since)
        if not self._started:
            threading.Thread(target=self._run, name=f"logits-processor-{self.name}", daemon=True).start()
            self._started = True
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((future, fn, args))
        try:
            return future.result(timeout=max(0.0, budget_s))
        except TimeoutError:
            if future.done():  # a TimeoutError the call raised itself
                raise
            self._late, self._late_since = future, time.monotonic()
        except BaseException:
            if not future.done():  # the caller was interrupted (Ctrl-C) while the call runs on
                self._late, self._late_since = future, time.monotonic()
            raise
        logger.warning("logits processor %s passed its per-step limit of %g s; its call is left running "
                       "and the requests that enable it fail until it returns", self.name, limit_s)
        raise CallTimedOut(self.name, limit_s)

    def _run(self) -> None:
        while True:
            run_to_future(*self._calls.get())


def run_to_future(future: concurrent.futures.Future, fn: Callable, args: tuple) -> None:
    """`fn(*args)` into `future`, unless it was cancelled: its result, or what it raised (handed to
    the waiter, which isolates it). The loop of every daemon worker that serves futures."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn(*args))
    except BaseException as e:  # noqa: BLE001
        future.set_exception(e)
