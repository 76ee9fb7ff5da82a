"""The package imports in one direction: no module reaches itself again through its imports (imports
inside functions and under `TYPE_CHECKING` included: hiding one there still leaves the two modules
depending on each other), and every import of the package is absolute.

The graph is read statically from the installed package's files, so a cycle is caught even on a
path no test happens to import. The top-level `processors/` and `entrypoints/` folders are walked
under the package names they install as (`fastdeploy_lp.processors…`). Importing `a.b.c` also
runs the `__init__` of package `a.b` (its re-exports included), so that is an edge too, except
where the importer is inside `a.b`: its own packages are already being imported when it runs (or
every module would cycle with the `__init__` that re-exports it)."""

from __future__ import annotations

import ast
import importlib.util
import os
from collections import deque

PACKAGE = "fastdeploy_lp"
TOP_LEVEL_FOLDERS = ("processors", "entrypoints")


def package_files() -> dict[str, str]:
    """Module name -> file for every module of the installed package, its mapped top-level folders
    (`processors/`, `entrypoints/`) under the names they import as."""
    files = {}
    for package in (PACKAGE, *(f"{PACKAGE}.{folder}" for folder in TOP_LEVEL_FOLDERS)):
        root = importlib.util.find_spec(package).submodule_search_locations[0]
        for folder, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if os.path.isfile(os.path.join(folder, d, "__init__.py"))
                       and f"{package}.{d}" not in files]
            relative = os.path.relpath(folder, root)
            name = package if relative == "." else ".".join([package, *relative.split(os.sep)])
            for f in names:
                if f.endswith(".py"):
                    files[name if f == "__init__.py" else f"{name}.{f[:-3]}"] = os.path.join(folder, f)
    return files


def parse(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), path)


def imported_modules(module: str, path: str, files: dict[str, str]) -> set[str]:
    """The package modules `module` imports, anywhere in its body. A relative import is resolved the
    way Python resolves it, from the module's package name (not from its real path); `from pkg
    import name` imports the submodule `pkg.name` when there is one, else `pkg`."""
    def known(name: str) -> str:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name

    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    targets = set()
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Import):
            targets.update(known(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0]
                base = f"{anchor}.{base}".rstrip(".")
            targets.update(known(f"{base}.{alias.name}") for alias in node.names)
    return targets - {"", module}


def with_packages_on_the_way(module: str, targets: set[str]) -> set[str]:
    """`targets` and the packages Python imports to reach them, but for `module`'s own packages."""
    found = set(targets)
    for target in targets:
        parts = target.split(".")
        for n in range(1, len(parts)):
            package = ".".join(parts[:n])
            if not (module + ".").startswith(package + "."):
                found.add(package)
    return found


def import_graph() -> dict[str, set[str]]:
    files = package_files()
    return {module: with_packages_on_the_way(module, imported_modules(module, path, files))
            for module, path in files.items()}


def shortest_cycle_through(graph: dict[str, set[str]], start: str) -> list[str] | None:
    parents, queue = {start: None}, deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph[node]):
            if nxt == start:
                path = [node]
                while parents[path[-1]] is not None:
                    path.append(parents[path[-1]])
                return [*reversed(path), start]
            if nxt not in parents:
                parents[nxt] = node
                queue.append(nxt)
    return None


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle per group of modules that import each other, so each tangle is named once."""
    cycles, seen = [], set()
    for module in sorted(graph):
        cycle = None if module in seen else shortest_cycle_through(graph, module)
        if cycle:
            cycles.append(cycle)
            seen.update(reachable(graph, module) & reaching(graph, module))
    return cycles


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    found, stack = {start}, [start]
    while stack:
        for nxt in graph[stack.pop()] - found:
            found.add(nxt)
            stack.append(nxt)
    return found


def reaching(graph: dict[str, set[str]], target: str) -> set[str]:
    reverse = {m: {n for n in graph if m in graph[n]} for m in graph}
    return reachable(reverse, target)


def test_the_graph_sees_every_package_and_the_mapped_folders():
    graph = import_graph()
    for module in ("fastdeploy_lp.config", "fastdeploy_lp.processors.guided.compiler",
                   "fastdeploy_lp.entrypoints.openai.api_server", "fastdeploy_lp.model.cpu_kernels"):
        assert module in graph
    server = graph["fastdeploy_lp.entrypoints.openai.api_server"]
    assert {"fastdeploy_lp.engine.async_engine", "fastdeploy_lp.engine"} <= server
    assert "fastdeploy_lp.entrypoints.openai" not in server  # its own package


def test_a_relative_import_resolves_from_the_package_name_not_the_real_path(tmp_path):
    """`processors/guided/x.py` lives outside `fastdeploy_lp/`; Python resolves its `...` from
    `fastdeploy_lp.processors.guided`, and so does the graph."""
    path = tmp_path / "x.py"
    path.write_text("from ...reasoning import get_reasoning_parser\nfrom ..base import ShareInputs\n"
                    "def f():\n    from . import compiler\n")
    files = package_files()
    assert imported_modules("fastdeploy_lp.processors.guided.x", str(path), files) == {
        "fastdeploy_lp.reasoning", "fastdeploy_lp.processors.base", "fastdeploy_lp.processors.guided.compiler"}


def test_a_cycle_is_found_and_named():
    graph = {"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": set()}
    assert import_cycles(graph) == [["a", "b", "c", "a"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_the_package_has_no_import_cycles():
    cycles = import_cycles(import_graph())
    assert cycles == [], "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_package_imports_itself_only_absolutely():
    """`from ..x import y` climbs out of a mapped folder differently for every tool that reads
    real paths; one absolute style (`from fastdeploy_lp.… import …`) reads the same everywhere."""
    relative = []
    for module, path in sorted(package_files().items()):
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.ImportFrom) and node.level:
                relative.append(f"{module}:{node.lineno}: from {'.' * node.level}{node.module or ''} import ...")
    assert relative == [], "relative imports:\n" + "\n".join(relative)


# The server's composition root builds the engine; every other server module holds an EngineClient.
_BUILDS_THE_ENGINE = {"fastdeploy_lp.entrypoints.cli", "fastdeploy_lp.entrypoints.openai.api_server",
                      "fastdeploy_lp.entrypoints.openai.args"}
_ENGINE_INTERFACE = {"fastdeploy_lp.engine", "fastdeploy_lp.engine.protocol", "fastdeploy_lp.engine.request"}


def test_the_server_talks_to_the_engine_only_through_its_interface():
    """Server modules import `engine.protocol` (`EngineClient`) and `engine.request` (outputs), and
    never reach past the client into the engine it wraps (`async_engine.engine.…`)."""
    files = package_files()
    graph = import_graph()
    beyond, reached = [], []
    for module, path in sorted(files.items()):
        if not module.startswith("fastdeploy_lp.entrypoints"):
            continue
        if module not in _BUILDS_THE_ENGINE:
            beyond += [f"{module} imports {t}" for t in sorted(graph[module])
                       if t.startswith("fastdeploy_lp.engine") and t not in _ENGINE_INTERFACE]
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.Attribute) and node.attr == "engine" and isinstance(node.value, ast.Attribute) \
                    and node.value.attr in ("engine", "async_engine"):
                reached.append(f"{module}:{node.lineno}")
    assert beyond == [], "\n".join(beyond)
    assert reached == [], "reaching past the EngineClient at " + ", ".join(reached)


def test_processors_never_import_the_server():
    graph = import_graph()
    upward = [f"{m} imports {t}" for m, targets in sorted(graph.items()) if m.startswith("fastdeploy_lp.processors")
              for t in sorted(targets) if t.startswith("fastdeploy_lp.entrypoints")]
    assert upward == [], "\n".join(upward)


# The package's parts from the bottom up: each imports only parts of the layers below its own.
LAYERS = [
    {"_source_tree", "options", "envs", "block_formats"},
    {"gguf_file"},
    {"model_config", "tokenizer", "distributed", "reasoning"},  # distributed: the primitives the model uses
    {"sampling_params", "speculative_config", "kv_events_config"},
    {"sequence_limits"},
    {"config"},
    {"model", "processors"},
    {"executor", "openai"},  # executor: the rank driver; openai: FastDeploy's import path for processors
    {"engine"},
    {"entrypoints"},
    {""},  # the package's own __init__: the public names
]


def _part(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def test_every_part_of_the_package_has_a_layer():
    layered = set().union(*LAYERS)
    assert {_part(m) for m in import_graph()} <= layered, "add the new part to LAYERS"
    assert sum(len(layer) for layer in LAYERS) == len(layered)  # each part in one layer


def test_parts_import_only_the_layers_below_them():
    """Cycles are caught above; this keeps the direction: the model never imports the engine, the
    processors never the server, the distributed primitives never their driver."""
    level = {part: i for i, layer in enumerate(LAYERS) for part in layer}
    upward = sorted({f"{m} ({_part(m)}) imports {t} ({_part(t)})" for m, targets in import_graph().items()
                     for t in targets if t != PACKAGE and _part(t) != _part(m)
                     and level[_part(t)] >= level[_part(m)]})
    assert upward == [], "imports against the layers:\n" + "\n".join(upward)
