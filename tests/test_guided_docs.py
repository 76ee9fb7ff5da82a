"""The offline examples in docs/guided_decoding.md run as written (the OpenAI SDK ones need a server
and are left to the server tests)."""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_offline_snippets_in_the_guide_run(monkeypatch):
    with open(os.path.join(ROOT, "docs", "guided_decoding.md"), encoding="utf-8") as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    offline = [b for b in blocks if "client." not in b and "OpenAI(" not in b]
    assert len(offline) >= 5
    monkeypatch.chdir(ROOT)
    namespace: dict = {}
    for block in offline:
        exec(compile(block, "docs/guided_decoding.md", "exec"), namespace)  # noqa: S102
    # random weights: the call may be cut by max_tokens, but it is a get_weather call from the start
    assert namespace["text"].startswith("<function=get_weather>")
    assert [c["name"] for c in namespace["calls"]] in ([], ["get_weather"])
