"""Text every tokenizer can take: a Python `str` may hold lone surrogates ("ab\\ud800cd", which JSON's
`\\ud800` escape produces), and no tokenizer, template or grammar engine can encode them.

`check_text(value, field)` finds the first such string in a value (a string, or nested dicts and
lists, keys included) in one linear pass and raises a `ValueError` naming where it is
(`messages[2].content`, `tools[0].function.parameters.properties`), so bad text is refused where
it enters, before it costs anything.
"""

from __future__ import annotations

import re

_SURROGATE = re.compile("[\ud800-\udfff]")
_HOLDS_TEXT = (str, dict, list, tuple)


def first_unencodable(value, path: str = "") -> tuple[str, str, int] | None:
    """(path, the string, the index of its first surrogate) of the first string in `value` that is
    not valid Unicode text, or None. A bad dict key is reported at the dict's path."""
    stack = [(value, path)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, str):
            if not node.isascii() and (hit := _SURROGATE.search(node)) is not None:
                return where, node, hit.start()
        elif isinstance(node, dict):
            for key, child in reversed(node.items()):
                if isinstance(key, str) and not key.isascii() and (hit := _SURROGATE.search(key)) is not None:
                    return where, key, hit.start()
                if isinstance(child, _HOLDS_TEXT):  # numbers need no path: a million token ids stay cheap
                    stack.append((child, f"{where}.{key}" if where else str(key)))
        elif isinstance(node, (list, tuple)):
            texts = [i for i, child in enumerate(node) if isinstance(child, _HOLDS_TEXT)]
            stack.extend((node[i], f"{where}[{i}]") for i in reversed(texts))
    return None


def check_text(value, field: str) -> None:
    """Raise `ValueError("<path>: ...")` if any string in `value` cannot be encoded as UTF-8."""
    found = first_unencodable(value, field)
    if found is not None:
        raise ValueError(unencodable_message(*found))


def unencodable_message(where: str, text: str, index: int) -> str:
    return (f"{where}: contains a lone UTF-16 surrogate (U+{ord(text[index]):04X} at character {index}), which "
            "is not text any tokenizer can encode; send valid Unicode")
