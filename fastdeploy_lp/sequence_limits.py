"""`SequenceLimits`: what one request may ask of every step of the engine, checked before it is queued.

A few lines of parameters can ask for far more than they weigh: 5,000 bad words each turned into a
row of a per-step match table, 5,000 stop strings searched after every token, `n=128` sequences
holding every slot. `LLMEngine.make_requests` checks `SamplingParams` against these limits, so
`LLM.generate`/`LLM.chat` refuse such a request with a `ValueError` naming the field, as the server
answers it with a 400 (the server counts the same things earlier, on the request's JSON:
`entrypoints/openai/limits.py`). The values are `EngineArgs` options (`LLM(max_n=...)`, `--max-n`).

What the server alone limits, and why offline does not: the prompts of one call times `n`
(`--max-sequences-per-request`), messages and tools. Offline they are the caller's own lists,
already in its memory; queued sequences wait as small records, at most `max_n` per prompt, and a
batch job of 10,000 prompts is what the offline API is for.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastdeploy_lp.sampling_params import SamplingParams


@dataclass(frozen=True)
class SequenceLimits:
    """`EngineArgs` documents each field and holds the defaults."""

    max_n: int                # choices per prompt
    max_stop: int             # entries of stop, and of stop_token_ids
    max_bad_words: int        # entries of bad_words, logits_processors_args.bad_words / bad_words_token_ids
    max_bad_word_length: int  # characters of a bad word, token ids of a banned sequence

    def check(self, params: SamplingParams) -> None:
        """`ValueError` naming the first field over a limit and the option that sets it."""
        if params.n > self.max_n:
            raise ValueError(f"n: {params.n} choices are more than this engine allows per request "
                             f"({self.max_n}, max_n / --max-n)")
        for field in ("stop", "stop_token_ids"):
            values = getattr(params, field) or ()
            if len(values) > self.max_stop:
                raise ValueError(f"{field}: {len(values)} entries are more than this engine allows "
                                 f"({self.max_stop}, max_stop / --max-stop)")
        args = params.logits_processors_args if isinstance(params.logits_processors_args, dict) else {}
        self._check_words(params.bad_words, "bad_words", "characters")
        self._check_words(args.get("bad_words"), "logits_processors_args.bad_words", "characters")
        self._check_words(args.get("bad_words_token_ids"), "logits_processors_args.bad_words_token_ids", "token ids")

    def _check_words(self, words, field: str, unit: str) -> None:
        if not isinstance(words, (list, tuple)):
            return
        if len(words) > self.max_bad_words:
            raise ValueError(f"{field}: {len(words)} entries are more than this engine allows "
                             f"({self.max_bad_words}, max_bad_words / --max-bad-words)")
        for i, word in enumerate(words):
            if isinstance(word, (str, list, tuple)) and len(word) > self.max_bad_word_length:
                raise ValueError(f"{field}[{i}]: {len(word)} {unit}, more than this engine allows per entry "
                                 f"({self.max_bad_word_length}, max_bad_word_length / --max-bad-word-length)")
