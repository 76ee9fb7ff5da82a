"""Per-request limits, checked on the parsed JSON before anything else looks at it.

A body of a few kilobytes can ask for far more work than it weighs: 20,000 chat messages to
template and tokenize, 5,000 bad words each turned into a row of a per-step match table, 5,000
stop strings searched after every token, `n=128` sequences holding every slot; a few megabytes of
token ids take seconds to validate one by one. These checks count list lengths and string sizes
only (no validation model, no tokenizer), so an over-limit request gets its 400 in microseconds.
The flags and their defaults are `ServerArgs` (`args.py`); `docs/server.md` lists them.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastdeploy_lp.entrypoints.openai.errors import bad_request


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for; the flags of the same names (`ServerArgs`) document each and
    hold the defaults."""

    max_messages: int               # chat turns (and /v1/responses input items)
    max_bad_words: int              # entries per bad-words list
    max_bad_word_length: int        # characters of a word, ids of a banned sequence
    max_n: int                      # choices per prompt
    max_sequences_per_request: int  # prompts x n of one request
    max_stop: int                   # entries of stop and of stop_token_ids, checked every token
    max_tools: int                  # tool definitions, each templated and compiled into the constraint
    max_model_len: int | None = None  # the engine's context (set when the app is built): longer token-id prompts cannot run

    def check(self, body: dict) -> None:
        """400 naming the first field over a limit. Values of the wrong type are left to the
        request model, which reports them."""
        self._check_count(body, "messages", self.max_messages, "--max-messages")
        self._check_count(body, "input", self.max_messages, "--max-messages")  # /v1/responses' items
        self._check_count(body, "tools", self.max_tools, "--max-tools")
        self._check_count(body, "stop", self.max_stop, "--max-stop")
        self._check_count(body, "stop_sequences", self.max_stop, "--max-stop")  # /v1/messages' name
        self._check_count(body, "stop_token_ids", self.max_stop, "--max-stop")
        n = body.get("n")
        n = n if _integer(n) else 1
        if n > self.max_n:
            raise bad_request(f"n: {n} choices are more than this server allows per request ({self.max_n}, "
                              "--max-n)", param="n")
        prompt = body.get("prompt")
        batch = isinstance(prompt, list) and bool(prompt) and not _integer(prompt[0])
        prompts = len(prompt) if batch else 1
        if prompts * n > self.max_sequences_per_request:
            raise bad_request(f"prompt: {prompts} prompts x n={n} are {prompts * n} sequences, more than one "
                              f"request may submit ({self.max_sequences_per_request}, --max-sequences-per-request)",
                              param="prompt")
        self._check_token_ids(prompt, batch)
        self._check_words(body.get("bad_words"), "bad_words", "characters")
        args = body.get("logits_processors_args")
        if isinstance(args, dict):
            self._check_words(args.get("bad_words"), "logits_processors_args.bad_words", "characters")
            self._check_words(args.get("bad_words_token_ids"), "logits_processors_args.bad_words_token_ids",
                              "token ids")

    def _check_token_ids(self, prompt, batch: bool) -> None:
        """Token-id prompts the context cannot hold, refused before a million ids are validated
        one by one (text prompts must be tokenized to be measured)."""
        if self.max_model_len is None or not isinstance(prompt, list):
            return
        for field, ids in ([(f"prompt[{k}]", p) for k, p in enumerate(prompt)] if batch else [("prompt", prompt)]):
            if isinstance(ids, list) and len(ids) >= self.max_model_len:
                raise bad_request(f"{field}: {len(ids)} tokens leave no room to generate within "
                                  f"max_model_len={self.max_model_len}", param=field)

    @staticmethod
    def _check_count(body: dict, field: str, limit: int, flag: str) -> None:
        value = body.get(field)
        if isinstance(value, list) and len(value) > limit:
            raise bad_request(f"{field}: {len(value)} entries are more than this server allows ({limit}, {flag})",
                              param=field)

    def _check_words(self, words, field: str, unit: str) -> None:
        if not isinstance(words, list):
            return
        if len(words) > self.max_bad_words:
            raise bad_request(f"{field}: {len(words)} entries are more than this server allows "
                              f"({self.max_bad_words}, --max-bad-words)", param=field)
        for i, word in enumerate(words):
            if isinstance(word, (str, list)) and len(word) > self.max_bad_word_length:
                raise bad_request(f"{field}[{i}]: {len(word)} {unit}, more than this server allows per entry "
                                  f"({self.max_bad_word_length}, --max-bad-word-length)", param=f"{field}[{i}]")


def _integer(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
