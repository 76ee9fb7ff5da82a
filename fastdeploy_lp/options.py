"""Options written once: a dataclass field holds an option's type, default and help, and the command
line, keyword arguments and the docs' flag tables are generated from it (vLLM's `EngineArgs` way).

    @dataclass
    class Args:
        port: int = option(8000, "Port to listen on.", group="HTTP server", parse=port_number)

`add_arguments(parser, Args)` adds `--port` (argparse shows the default), `from_namespace(Args,
namespace)` reads it back, `markdown_table(Args)` writes the docs' rows. A field with `cli=False`
is a keyword only (a dict of callables has no command-line form).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
from typing import Any, Callable

_MISSING = dataclasses.MISSING


def option(default: Any = _MISSING, help: str = "", *, group: str, default_factory: Callable[[], Any] = _MISSING,
           parse: Callable[[str], Any] | None = None, flag: str | None = None, aliases: tuple[str, ...] = (),
           metavar: str | None = None, choices: tuple[str, ...] | None = None, nargs: str | None = None,
           cli: bool = True) -> Any:
    """A dataclass field with its help and command-line form (`flag` defaults to `--field-name`)."""
    if not help or "%" in help:
        raise ValueError("option: a help text is required and must not contain '%' (argparse formats it)")
    metadata = {"help": help, "group": group, "parse": parse, "flag": flag, "aliases": aliases,
                "metavar": metavar, "choices": choices, "nargs": nargs, "cli": cli}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def options(cls) -> list[dataclasses.Field]:
    """The fields of `cls` declared with `option`, in order."""
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def default_of(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is _MISSING else f.default


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser, cls, groups: dict[str, Any] | None = None) -> dict[str, Any]:
    """Add every command-line option of `cls` to `parser`, under argument groups named by the
    options' `group` (created as needed, shared through `groups`)."""
    groups = {} if groups is None else groups
    for f in options(cls):
        meta = f.metadata
        if not meta["cli"]:
            continue
        if meta["group"] not in groups:
            groups[meta["group"]] = parser.add_argument_group(meta["group"])
        default = default_of(f)
        kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": meta["help"]}
        if isinstance(default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction if default else "store_true"
        else:
            kwargs.update({k: meta[k] for k in ("metavar", "choices", "nargs") if meta[k] is not None})
            if meta["parse"] is not None:
                kwargs["type"] = meta["parse"]
        groups[meta["group"]].add_argument(flag_of(f), *meta["aliases"], **kwargs)
    return groups


def from_namespace(cls, namespace: argparse.Namespace):
    """An instance of `cls` from parsed arguments (the namespace may hold other classes' options)."""
    return cls(**{f.name: getattr(namespace, f.name) for f in options(cls) if f.metadata["cli"]})


def signature_of(cls, first: str | None = None) -> inspect.Signature:
    """`cls`'s options as a call signature (the first positional, the rest keyword-only), after a
    parameter named `first` if given (`self`)."""
    params = [inspect.Parameter(first, inspect.Parameter.POSITIONAL_OR_KEYWORD)] if first else []
    for i, f in enumerate(options(cls)):
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if i == 0 else inspect.Parameter.KEYWORD_ONLY
        params.append(inspect.Parameter(f.name, kind, default=default_of(f), annotation=f.type))
    return inspect.Signature(params)


def _default_text(value: Any) -> str:
    if value is None or value == []:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"`{value}`"


def markdown_table(*classes) -> str:
    """The docs' flag table: one row per command-line option of `classes`, in order."""
    rows = ["| flag | default | meaning |", "|------|---------|---------|"]
    for cls in classes:
        for f in options(cls):
            meta = f.metadata
            if not meta["cli"]:
                continue
            default = default_of(f)
            names = [flag_of(f), *meta["aliases"]]
            if isinstance(default, bool) and default:
                names = ["--[no-]" + flag_of(f)[2:]]
            value = "" if isinstance(default, bool) else " " + (meta["metavar"] or f.name.upper())
            if meta["choices"] and not meta["metavar"]:
                value = " {" + ",".join(meta["choices"]) + "}"
            if meta["nargs"] in ("*", "+"):
                value += " ..."
            flags = ", ".join(f"`{n}{value}`" for n in names)
            text = meta["help"].replace("|", "&#124;").replace("<", "&lt;")
            rows.append(f"| {flags} | {_default_text(default)} | {text} |")
    return "\n".join(rows) + "\n"


# -- command-line value parsers ---------------------------------------------------------------------
def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def port_number(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number (0..65535), got {text}")
    return value


# -- JSON values given as an object or as its text ---------------------------------------------------
def json_object(field: str, value: Any, want: type | tuple[type, ...] = dict) -> Any:
    """`value`, parsed first when it is JSON text, if it is a `want` (a JSON object by default): the
    one reading of "a dict or a JSON string holding one" for request fields and config values alike.
    Else a ValueError naming `field`."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{field}: not valid JSON ({e.msg} at position {e.pos})") from None
    if not isinstance(value, want):
        raise ValueError(f"{field}: must be a JSON object, got {type(value).__name__}")
    return value
