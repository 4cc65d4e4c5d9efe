"""The version stamp of ``recoverssm info`` and the benchmark: the package's version, and the
commit only for a git checkout of recoverssm itself (never the current directory's repository)."""
from __future__ import annotations

import subprocess

import pytest

import recoverssm
from recoverssm import build_info


def _git(root, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, check=True,
                   capture_output=True)


def _repo(root, project: str):
    pkg = root / "recoverssm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (root / "pyproject.toml").write_text(f'[project]\nname = "{project}"\nversion = "1"\n')
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "x")
    return pkg


def test_commit_of_a_recoverssm_checkout(tmp_path):
    pkg = _repo(tmp_path, "recoverssm")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True,
                          text=True, check=True).stdout.strip()
    assert build_info.checkout_commit(pkg) == head


def test_no_commit_for_another_project_or_an_install(tmp_path):
    assert build_info.checkout_commit(_repo(tmp_path / "other", "someone-elses-project")) is None
    installed = tmp_path / "site-packages" / "recoverssm"
    installed.mkdir(parents=True)
    assert build_info.checkout_commit(installed) is None


def test_version_stamp(monkeypatch):
    monkeypatch.setenv(build_info.ENV_COMMIT, "abc1234")
    assert build_info.version_stamp() == f"{recoverssm.__version__} (commit abc1234)"
    monkeypatch.delenv(build_info.ENV_COMMIT)
    monkeypatch.setattr(build_info, "checkout_commit", lambda package_dir: None)
    assert build_info.version_stamp() == recoverssm.__version__


@pytest.mark.parametrize("results, want", [
    (dict(version="0.1.0", commit="abc1234"), "recoverssm 0.1.0  commit abc1234"),
    (dict(version="0.1.0", commit=None), "recoverssm 0.1.0"),
    (dict(commit="abc"), "commit abc"),
], ids=["checkout", "installed", "results-without-version"])
def test_bench_stamp(results, want):
    from recoverssm.bench import suites

    assert suites.stamp(results) == want
