"""Reading grammar text and llguidance's messages, for the constraint model and for structural tags
(which embed grammars): which dialect a grammar is written in, and an error message a user can read."""

from __future__ import annotations

import re

_GBNF_RULE = re.compile(r"(?m)^\s*[A-Za-z_][A-Za-z0-9_-]*\s*::=")


def is_gbnf(text: str) -> bool:
    """llama.cpp GBNF (`root ::= ...`) rather than Lark (`start: ...`)."""
    return bool(_GBNF_RULE.search(text))


def clean_error(message: str) -> str:
    """llguidance's message without the grammar excerpt it appends, on one line."""
    kept = []
    for line in message.strip().splitlines():
        if re.match(r"^\s*\d+ \| ", line) or line.strip() == "<state>":
            break
        kept.append(line.strip())
    text = re.sub(r"\s+", " ", " ".join(k for k in kept if k)).strip()
    for internal, meaning in _ERROR_MEANINGS.items():
        if internal in text:
            text = f"{meaning} ({text})"
    return text[:500] or "invalid constraint"


# llguidance messages that name its internals rather than the problem in the request.
_ERROR_MEANINGS = {
    "NoExtensionBias": "no output can ever satisfy it: a rule or $ref only leads back to itself, with no way to end",
}
