"""Processors that attack the step view and the engine loop (issue "Hardening II"), registered by
`step_processors:ClassName` offline and on the server (tests/ is on the server's PYTHONPATH)."""

from __future__ import annotations

import time

from pydantic import BaseModel

from fastdeploy_lp.processors import LogitsProcessor, RequestFailures


class StepAttackArgs(BaseModel):
    force_token: int | None = None      # appended to the request's own forced tokens every step ...
    force_count: int = 1                # ... this many times
    force_others: int | None = None     # appended to every *other* running slot's forced tokens
    pop_key: str | None = None          # popped from share_inputs every step
    overwrite: bool | None = None       # writes into every array and list of share_inputs it can reach
    hang_s: float | None = None         # sleeps this long in its first update_state
    interrupt_after: int | None = None  # raises KeyboardInterrupt once the request has this many tokens
    fail: bool | None = None            # named in a RequestFailures raised after every attack of the step
    fail_others: bool | None = None     # names every *other* running slot in that RequestFailures


class StepAttackLogitsProcessor(LogitsProcessor):
    """Does to `share_inputs` what a buggy or hostile processor would, for the requests that ask."""

    args_model = StepAttackArgs

    def __init__(self, fd_config):
        super().__init__(fd_config)
        self.hung: set[str] = set()

    def update_state(self, share_inputs):
        active = [slot for slot, stopped in enumerate(share_inputs["stop_flags"]) if not stopped]
        for slot in active:
            self._attack(share_inputs, slot, share_inputs["logits_processors_args"][slot], active)
        failing = {slot: "asked to fail" for slot in active if share_inputs["logits_processors_args"][slot].fail}
        for slot in active:
            if share_inputs["logits_processors_args"][slot].fail_others:
                failing.update({other: "failed by a neighbour" for other in active if other != slot})
        if failing:
            raise RequestFailures(failing)

    def _attack(self, share_inputs, slot, args, active):
        if args.force_token is not None:
            share_inputs["forced_tokens"][slot].extend([args.force_token] * (args.force_count or 1))
        if args.force_others is not None:
            for other in active:
                if other != slot:
                    share_inputs["forced_tokens"][other].append(args.force_others)
        if args.pop_key:
            share_inputs.pop(args.pop_key, None)
        if args.overwrite:
            self._overwrite(share_inputs)
        if args.hang_s and share_inputs["req_ids"][slot] not in self.hung:
            self.hung.add(share_inputs["req_ids"][slot])
            time.sleep(args.hang_s)
        if args.interrupt_after is not None and share_inputs["step_idx"][slot] >= args.interrupt_after:
            raise KeyboardInterrupt

    @staticmethod
    def _overwrite(share_inputs):
        """Every write a processor could try; each must fail or reach nothing the engine uses."""
        attempts = [
            lambda: share_inputs["stop_flags"].__setitem__(slice(None), True),
            lambda: share_inputs["step_idx"].__setitem__(slice(None), 0),
            lambda: share_inputs["temperature"].__setitem__(slice(None), 50.0),
            lambda: share_inputs["prompt_ids"][0].__setitem__(0, 1),
            lambda: share_inputs["output_ids"][0].append(7),
            lambda: share_inputs["req_ids"].__setitem__(0, "stolen"),
            lambda: share_inputs["logits_processors_args"][0].__setitem__("force_token", 1),
            lambda: setattr(share_inputs["sampling_params"][0] or object(), "max_tokens", 1),
            lambda: share_inputs.__setitem__("stop_flags", [True] * len(share_inputs["stop_flags"])),
        ]
        for attempt in attempts:
            try:
                attempt()
            except (TypeError, ValueError, AttributeError):
                pass
