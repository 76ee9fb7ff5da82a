"""`processors/` and `entrypoints/` as `fastdeploy_lp.processors` and `fastdeploy_lp.entrypoints`.

The design card keeps them at the top of the repository, beside `fastdeploy_lp/`; `setup.py` maps
them into the package (`package_dir`), so a wheel holds them as real folders inside it and an
editable install maps them with setuptools' own finder. A source tree that is not installed (a
clone on `PYTHONPATH`, or the repository root ahead of an installed wheel on `sys.path`) finds
them with this finder: it resolves exactly those two names, to the folders beside this package,
and only when the package has no such folder of its own. No symlinks: every tool that reads real
paths sees the folders where they are.
"""

from __future__ import annotations

import os
import sys
from importlib.machinery import ModuleSpec, PathFinder

PACKAGE = __name__.rpartition(".")[0]
TOP_LEVEL_FOLDERS = ("processors", "entrypoints")
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_SOURCE_ROOT = os.path.dirname(_PACKAGE_DIR)


class _TopLevelFolders:
    """A meta-path finder for `fastdeploy_lp.<folder>` → `<repository>/<folder>`."""

    @staticmethod
    def find_spec(fullname: str, path=None, target=None) -> ModuleSpec | None:
        package, _, name = fullname.rpartition(".")
        if package != PACKAGE or name not in TOP_LEVEL_FOLDERS:
            return None
        return PathFinder.find_spec(fullname, [_SOURCE_ROOT])


def find_top_level_folders() -> None:
    """Install the finder when this package sits in a source tree (the folders are beside it and not
    inside it); an installed wheel has them inside and needs nothing."""
    beside = all(os.path.isfile(os.path.join(_SOURCE_ROOT, f, "__init__.py")) for f in TOP_LEVEL_FOLDERS)
    inside = any(os.path.isdir(os.path.join(_PACKAGE_DIR, f)) for f in TOP_LEVEL_FOLDERS)
    if beside and not inside and not any(isinstance(f, _TopLevelFolders) for f in sys.meta_path):
        sys.meta_path.append(_TopLevelFolders())
