"""The docs name what the code has: the `share_inputs` tables list exactly `ShareInputs`' fields,
with the dtypes the scheduler builds them with, and every `fastdeploy_lp.…` name and every source
path the docs and the README mention exists (a moved module breaks this test, not a reader)."""

from __future__ import annotations

import glob
import importlib
import os
import re

import numpy as np
import pytest
from test_import_graph import package_files

from fastdeploy_lp.engine.scheduler import new_share_inputs
from fastdeploy_lp.processors.base import ShareInputs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)) + [os.path.join(ROOT, "README.md")]
# Where a bare file name in the docs may live (`scheduler.py` in a sentence about the engine).
SOURCE_DIRS = ["", "fastdeploy_lp", "fastdeploy_lp/openai", "fastdeploy_lp/engine", "fastdeploy_lp/model",
               "fastdeploy_lp/model/cpu_kernels", "fastdeploy_lp/distributed", "fastdeploy_lp/executor",
               "fastdeploy_lp/tokenizer", "processors", "processors/builtin", "processors/guided", "entrypoints",
               "entrypoints/openai", "entrypoints/openai/routers", "tests", "bench", "train"]
# Files a page tells the reader to write, not files of this repository.
USER_FILES = {"backend.py", "DIR/NAME/backend.py", "my_tools.py", ".../vendor/llama.cpp/convert_hf_to_gguf.py"}


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _share_inputs_table(page: str) -> dict[str, str]:
    """Field -> type column of the page's `share_inputs` table (the one whose first row is stop_flags)."""
    text = _read(os.path.join(ROOT, "docs", page))
    start = text.index("| `stop_flags`")
    rows = {}
    for line in text[start:].splitlines():
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        for name in re.findall(r"`([a-z_]+)`", cells[0]):
            rows[name] = cells[1]
    return rows


@pytest.mark.parametrize("page", ["logits_processors.md", "zh/logits_processors.md"])
def test_the_share_inputs_table_lists_every_field_with_its_dtype(page):
    table = _share_inputs_table(page)
    assert sorted(table) == sorted(ShareInputs.__annotations__), f"docs/{page}: the share_inputs table"
    for name, value in new_share_inputs(2).items():
        if isinstance(value, np.ndarray):
            dtype = value.dtype.name
            assert f"np.ndarray[{dtype}] [slots]" in table[name], f"docs/{page}: {name} is {dtype} [slots]"
        else:
            assert not table[name].startswith("`np.ndarray"), f"docs/{page}: {name} is per-slot values"


def test_every_fastdeploy_lp_name_in_the_docs_exists():
    missing = []
    for page in PAGES:
        for name in sorted(set(re.findall(r"fastdeploy_lp(?:\.[A-Za-z_][A-Za-z0-9_]*)+", _read(page)))):
            if not _resolves(name):
                missing.append(f"{os.path.relpath(page, ROOT)}: {name}")
    assert missing == [], missing


def test_every_fastdeploy_lp_name_the_bench_scripts_import_exists():
    """The benchmarks are not run by the tests; a module they import that moved must still fail here."""
    missing = []
    for path in sorted(glob.glob(os.path.join(ROOT, "bench", "*.py"))):
        for name in sorted(set(re.findall(r"(?:from|import) (fastdeploy_lp(?:\.\w+)*)", _read(path)))):
            if not _resolves(name):
                missing.append(f"{os.path.relpath(path, ROOT)}: {name}")
    assert missing == [], missing


def test_every_source_path_in_the_docs_exists():
    missing = []
    for page in PAGES:
        for path in sorted(set(re.findall(r"[A-Za-z0-9_./-]+\.py\b", _read(page))) - USER_FILES):
            relative = path.lstrip("./") if path.startswith("./") else path
            if not any(os.path.exists(os.path.join(ROOT, d, relative)) for d in SOURCE_DIRS):
                missing.append(f"{os.path.relpath(page, ROOT)}: {path}")
    assert missing == [], missing


def _resolves(name: str) -> bool:
    """Whether `name` is a module, or attributes reached from its longest importable prefix."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ImportError:
            continue
        for attr in parts[k:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_the_module_map_names_every_module_of_the_package():
    text = _read(os.path.join(ROOT, "docs", "architecture.md"))
    folders = dict(re.findall(r"^\*\*`([a-z_/]+)/`\*\* — (.*?)(?=\n\n|\Z)", text, flags=re.S | re.M))
    missing = []
    for module, path in package_files().items():
        parts = module.split(".")
        if parts[1:2] in (["processors"], ["entrypoints"]):  # top-level folders, installed inside the package
            parts = parts[1:]
        folder, name = "/".join(parts[:-1]), parts[-1]
        if path.endswith("__init__.py"):
            if f"{folder}/{name}" in folders or len(parts) == 1:  # a folder of the map
                continue
        else:
            name += ".py"
        if f"`{name}`" not in folders.get(folder, ""):
            missing.append(f"{folder}/{name}")
    assert missing == [], f"docs/architecture.md's module map lacks {missing}"


FASTAPI_PAGES = ("/docs", "/redoc", "/openapi")  # FastAPI's own pages, not routes of the routers


def _server_routes() -> set[tuple[str, str]]:
    from fastdeploy_lp.entrypoints.openai.routers import ROUTERS
    return {(method, route.path) for router in ROUTERS for route in router.routes for method in route.methods}


def test_every_endpoint_server_md_lists_is_a_route_and_every_route_is_listed():
    text = _read(os.path.join(ROOT, "docs", "server.md"))
    table = text[text.index("## Endpoints"):text.index("### Where the code is")]
    documented = set()
    for cell in re.findall(r"^\| (.*?) \|", table, flags=re.M):
        for method, path in re.findall(r"`(GET|POST|DELETE) (/[^`]*)`", cell):
            if not path.startswith(FASTAPI_PAGES):
                documented.add((method, path.replace("{id}", "{response_id}")))
    routes = {r for r in _server_routes() if not r[1].startswith(FASTAPI_PAGES)}
    routes = {(m, p.replace("{model:path}", "{model}")) for m, p in routes}
    assert documented - routes == set(), "docs/server.md lists endpoints the app does not have"
    assert routes - documented == set(), "docs/server.md's endpoint table lacks routes of the app"


def test_every_environment_variable_the_docs_name_is_declared_in_envs():
    from fastdeploy_lp.envs import ENV_VARS
    unknown = []
    for page in PAGES:
        for name in sorted(set(re.findall(r"\b(?:FDLP|FASTDEPLOY_LP)_[A-Z0-9_]*[A-Z0-9]", _read(page)))):
            if name not in ENV_VARS and not any(v.old_name == name for v in ENV_VARS.values()):
                unknown.append(f"{os.path.relpath(page, ROOT)}: {name}")
    assert unknown == [], unknown


# Pages whose `--flag`s are the server's (other pages also show bench/ and train/ scripts' flags).
# flags of the request routers docs/distributed.md starts in front of replicas (sglang-router, vllm-router)
ROUTER_FLAGS = {"--policy", "--worker-urls", "--health-check-interval-secs", "--cb-timeout-duration-secs",
                "--kv-event-source", "--kv-event-replay-source", "--kv-event-block-size", "--prometheus-port"}
# ... and of Paddle's launcher, which starts the ranks of a multi-node server (`--nproc_per_node`, `--log_dir`)
LAUNCHER_FLAGS = {"--nnodes", "--rank", "--master", "--nproc", "--log"}
SERVER_FLAG_PAGES = ["server.md", "kv_cache.md", "generation_extensions.md", "guided_decoding.md",
                     "logits_processors.md", "zh/logits_processors.md", "distributed.md", "architecture.md"]


@pytest.mark.parametrize("page", SERVER_FLAG_PAGES)
def test_every_flag_a_page_names_is_a_flag_of_fastdeploy_lp_serve(page):
    from fastdeploy_lp.entrypoints.openai.args import make_parser
    from fastdeploy_lp.entrypoints.cli import make_parser as cli_parser
    flags = {s for action in make_parser()._actions for s in action.option_strings}
    worker = cli_parser()._subparsers._group_actions[0].choices["tp-worker"]
    flags |= {s for action in worker._actions for s in action.option_strings}  # the ranks' command
    named = set(re.findall(r"(?<![\w-])(--(?:\[no-\])?[a-z][a-z0-9-]*)", _read(os.path.join(ROOT, "docs", page))))
    named -= {"--write-docs"}  # args.py's own command that regenerates the table
    named -= ROUTER_FLAGS | LAUNCHER_FLAGS
    unknown = sorted(f for f in named if f.replace("[no-]", "") not in flags)
    assert unknown == [], f"docs/{page} names flags `fastdeploy-lp serve` does not have: {unknown}"
