"""Which recoverssm is running: the package version and, for a git checkout of recoverssm, its commit.

The commit is looked up next to the imported package, never in the current directory: a user who
installed recoverssm and runs it from their own repository must not get their repository's commit.
"""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Optional

import recoverssm

#: Set by a runner that copies the tree without its ``.git`` (e.g. onto a benchmark machine) to
#: say which commit the copy holds.
ENV_COMMIT = "RECOVERSSM_COMMIT"

_PROJECT_NAME = re.compile(r'^name\s*=\s*["\']recoverssm["\']\s*$', re.MULTILINE)


def package_version() -> str:
    """The version of the imported package (``recoverssm.__version__``: the code that runs, even
    where another copy is installed as a distribution)."""
    return recoverssm.__version__


def _checkout_root(package_dir: Path) -> Optional[Path]:
    """The directory above ``package_dir`` if it is a git checkout of recoverssm itself (it has a
    ``.git`` and a ``pyproject.toml`` naming the project recoverssm), else None."""
    root = package_dir.resolve().parent
    if not (root / ".git").exists():
        return None
    try:
        pyproject = (root / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        return None
    return root if _PROJECT_NAME.search(pyproject) else None


def checkout_commit(package_dir: Path) -> Optional[str]:
    """The short commit of the recoverssm checkout holding ``package_dir``; None if it is not in
    one (an installed package) or git cannot say."""
    root = _checkout_root(package_dir)
    if root is None:
        return None
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                             text=True, check=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def source_commit() -> Optional[str]:
    """``$RECOVERSSM_COMMIT`` if set, else the commit of the checkout the package is imported from
    (None for an installed package)."""
    if os.environ.get(ENV_COMMIT):
        return os.environ[ENV_COMMIT]
    return checkout_commit(Path(recoverssm.__file__).parent)


def version_stamp() -> str:
    """``"0.1.0"`` for an installed package, ``"0.1.0 (commit abc1234)"`` for a checkout."""
    commit = source_commit()
    return package_version() + (f" (commit {commit})" if commit else "")
