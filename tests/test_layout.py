"""The source tree imports exactly as it installs: `processors/` and `entrypoints/` are real
top-level folders, reached only as `fastdeploy_lp.processors` / `fastdeploy_lp.entrypoints` (mapped
by setup.py's `package_dir`, and in an uninstalled tree by `fastdeploy_lp/_source_tree.py`), never as
top-level packages, and need no install to import."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE_DIRS = ("fastdeploy_lp", "processors", "entrypoints", "tests", "bench", "train", "docs")


def test_processors_and_entrypoints_are_real_folders_beside_the_package():
    for name in ("processors", "entrypoints"):
        assert not os.path.lexists(os.path.join(ROOT, "fastdeploy_lp", name)), "no link or copy inside the package"
        assert os.path.isfile(os.path.join(ROOT, name, "__init__.py")) and not os.path.islink(os.path.join(ROOT, name))


# Without the editable install's finder: the source tree alone, as a clone on PYTHONPATH sees it.
_IMPORT_FROM_THE_TREE = (
    "import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]; "
    "import fastdeploy_lp.processors.guided.processor, fastdeploy_lp.entrypoints.openai.api_server as a; "
    "print(a.__file__); print(sorted(m for m in sys.modules if m.split('.')[0] in ('processors', 'entrypoints')))")


def test_the_source_tree_imports_without_an_install(tmp_path):
    """From another directory with only PYTHONPATH=<repository>, the source tree is what imports."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = ROOT
    out = subprocess.run([sys.executable, "-c", _IMPORT_FROM_THE_TREE], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    path, modules = out.stdout.strip().splitlines()[-2:]
    assert path == os.path.join(ROOT, "entrypoints", "openai", "api_server.py")
    assert modules == "[]", "nothing may import plain `processors` or `entrypoints`"


def test_nothing_imports_plain_processors_or_entrypoints():
    plain = re.compile(r"^\s*(from|import)\s+(processors|entrypoints)\b", re.M)
    offenders = []
    for top in SOURCE_DIRS:
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    with open(path, encoding="utf-8") as fh:
                        if plain.search(fh.read()):
                            offenders.append(os.path.relpath(path, ROOT))
    assert offenders == []
