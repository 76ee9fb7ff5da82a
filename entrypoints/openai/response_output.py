"""A response's output items, built from the generated text as it arrives, each change also told as
the typed event the `openai` SDK parses. Streamed and not, a response is built the same way (the
whole text is one delta), so both answers hold the same items.

The text is read as chat reads it: a reasoning parser (when the server has one) splits off the
reasoning, and with tools `ToolCallParser` reads the calls. Items appear in text order:

    reasoning       output_item.added, content_part.added, reasoning_text.delta..., reasoning_text.done,
                    content_part.done, output_item.done
    message         output_item.added, content_part.added, output_text.delta..., output_text.done,
                    content_part.done, output_item.done
    function_call   output_item.added (name, call_id), function_call_arguments.delta...,
                    function_call_arguments.done, output_item.done

An item that is open when the output is cut by `max_output_tokens` closes with status "incomplete"
(a cut function call included: it is not a call to run).
"""

from __future__ import annotations

import uuid
from typing import Any

from fastdeploy_lp.entrypoints.openai.tool_parser import ToolCallParser
from fastdeploy_lp.reasoning import ReasoningStream


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    def __init__(self, reasoning: ReasoningStream | None, parser: ToolCallParser | None):
        self.reasoning, self.parser = reasoning, parser
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item receiving text; None: a new one starts
        self._calls: dict[int, dict[str, Any]] = {}  # the parser's call index → its item

    def feed(self, delta: str) -> list[dict[str, Any]]:
        """The events for one text delta (sequence numbers are the caller's)."""
        return self._read(delta, final=False)

    def finish(self, status: str) -> list[dict[str, Any]]:
        """The end of the output: what was held back, then the open item closed with `status`
        ("completed", or "incomplete" when cut)."""
        events = self._read("", final=True)
        self._close(events, status)
        return events

    def _read(self, delta: str, final: bool) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        answer = delta
        if self.reasoning is not None:
            thought, answer = self.reasoning.feed(delta, final=final)
            if thought:
                self._text("reasoning", thought, events)
        if self.parser is None:
            if answer:
                self._text("message", answer, events)
            return events
        parsed = self.parser.feed(answer) + (self.parser.finish() if final else [])
        for event in parsed:
            if event[0] == "content":
                self._text("message", event[1], events)
            elif event[0] == "call":
                self._start_call(event[1], event[2], events)
            elif event[0] == "arguments":
                item = self._calls[event[1]]
                item["arguments"] += event[2]
                events.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                               "output_index": self._index(item), "delta": event[2]})
            elif event[0] == "end":
                self._close(events, "completed")
        return events

    # -- items ----------------------------------------------------------------------------------
    def _text(self, kind: str, text: str, events: list) -> None:
        """Append text to the open item of `kind`, opening one (and closing another) as needed."""
        if self._open is None or self._open["type"] != kind:
            self._close(events, "completed")
            self._open_text_item(kind, events)
        item = self._open
        item["content"][0]["text"] += text
        event = {"type": f"response.{_TEXT_KIND[kind]}.delta", "item_id": item["id"],
                 "output_index": self._index(item), "content_index": 0, "delta": text}
        if kind == "message":
            event["logprobs"] = []
        events.append(event)

    def _open_text_item(self, kind: str, events: list) -> None:
        if kind == "message":
            item = {"id": new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "status": "in_progress", "content": []}
            part = {"type": "reasoning_text", "text": ""}
        self._add(item, events)
        item["content"].append(part)
        events.append({"type": "response.content_part.added", "item_id": item["id"],
                       "output_index": self._index(item), "content_index": 0, "part": dict(part)})

    def _start_call(self, index: int, name: str, events: list) -> None:
        self._close(events, "completed")
        item = {"id": new_id("fc"), "type": "function_call", "call_id": new_id("call"), "name": name,
                "arguments": "", "status": "in_progress"}
        self._calls[index] = item
        self._add(item, events)

    def _add(self, item: dict, events: list) -> None:
        self.items.append(item)
        self._open = item
        events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                       "item": _copy(item)})

    def _close(self, events: list, status: str) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        index = self._index(item)
        if item["type"] == "function_call":
            events.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                           "output_index": index, "name": item["name"], "arguments": item["arguments"]})
        else:
            part = item["content"][0]
            done = {"type": f"response.{_TEXT_KIND[item['type']]}.done", "item_id": item["id"], "output_index": index,
                    "content_index": 0, "text": part["text"]}
            if item["type"] == "message":
                done["logprobs"] = []
            events.append(done)
            events.append({"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                           "content_index": 0, "part": dict(part)})
        item["status"] = status
        events.append({"type": "response.output_item.done", "output_index": index, "item": _copy(item)})

    def _index(self, item: dict) -> int:
        return next(k for k in range(len(self.items) - 1, -1, -1) if self.items[k] is item)

    def reasoning_text(self) -> str:
        return "".join(i["content"][0]["text"] for i in self.items if i["type"] == "reasoning")


_TEXT_KIND = {"message": "output_text", "reasoning": "reasoning_text"}


def _copy(item: dict) -> dict:
    """A snapshot for an event (the item itself keeps growing)."""
    out = dict(item)
    if "content" in out:
        out["content"] = [dict(p) for p in out["content"]]
    return out
