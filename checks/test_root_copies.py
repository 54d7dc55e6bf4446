# SPDX-License-Identifier: Apache-2.0
"""The repository keeps each new file of the series as the whole series leaves
it (``forktools/save_series.py``): a root copy equals build/vllm HEAD's, and ``build``
derives the version a patch adds from the later patches' diffs.

Stdlib and git only (no vLLM): the test command's suite ``root-final`` runs it
alone, ``.venv/bin/python -m pytest --noconftest checks/test_root_copies.py``.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import tarfile
from pathlib import Path
from types import ModuleType

import pytest

from forktools.git_ops import BUILD_IDENTITY, git, git_out, series_commits
from forktools.manifest import load_manifest
from forktools.paths import ROOT
from forktools.save_series import root_differences


def test_root_copies_are_the_built_tree_final_versions() -> None:
    if not (ROOT / "build" / "vllm" / ".git").is_dir():
        pytest.skip("build/vllm missing: run `python3 -m forktools.fork build`")
    proc = subprocess.run(
        [sys.executable, "-m", "forktools.fork", "check-root"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "check-root: OK" in proc.stdout


ACTIVE = '[[patch]]\nname = "one"\n[[patch]]\nname = "two"\n[[patch]]\nname = "three"\n'
NEW = "vllm/new.py"
V1 = "def f():\n    return 1\n"
V2 = "def f():\n    return 2\n\n\ndef g():\n    return 3\n"
V3 = "def f():\n    return 2\n\n\ndef g():\n    return 4\n"


@pytest.fixture
def fork(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """forktools/fork.py on a scratch repository and a tiny fake release sdist.

    The fork modules read ``forktools.paths`` when they run; ``fetch_sdist``
    and ``make_base`` are replaced where they are called.
    """
    from forktools import build_tree, fork, paths

    repo = tmp_path / "repo"
    (repo / "series" / "diffs").mkdir(parents=True)
    (repo / "vllm").mkdir()
    (repo / "series" / "manifest.toml").write_text("")
    src = tmp_path / "sdist" / "vllm-x"
    (src / "vllm").mkdir(parents=True)
    (src / "vllm" / "core.py").write_text("core = 0\n")
    sdist = tmp_path / "vllm-x.tar.gz"
    with tarfile.open(sdist, "w:gz") as tf:
        tf.add(src, arcname="vllm-x")
    make_base = functools.partial(build_tree.make_base, expect=None)
    for name, value in [
        ("ROOT", repo),
        ("TREE", repo / "build" / "vllm"),
        ("STACK1_TREE", repo / "build" / "stack1"),
    ]:
        monkeypatch.setattr(paths, name, value)
    for module in (build_tree, fork):
        monkeypatch.setattr(module, "fetch_sdist", lambda: sdist)
        monkeypatch.setattr(module, "make_base", make_base)
    return fork


def _commit(tree: Path, msg: str, files: dict[str, str]) -> str:
    for rel, text in files.items():
        (tree / rel).write_text(text)
    git(tree, "add", "-A")
    git(tree, "commit", "-q", "-m", msg, identity=BUILD_IDENTITY)
    return git_out(tree, "rev-parse", "HEAD")


def test_later_patch_edits_an_earlier_patch_new_file(fork: ModuleType) -> None:
    from forktools import paths

    repo, tree = paths.ROOT, paths.TREE
    assert fork.main(["build"]) == 0  # no patch yet: nothing built
    commits = [
        _commit(tree, "Add new\n\nWhy one.", {NEW: V1, "vllm/core.py": "c\n"}),
        _commit(tree, "Edit new\n\nWhy two.", {NEW: V2}),
        _commit(tree, "Edit new again\n\nWhy three.", {NEW: V3}),
    ]
    (repo / "series" / "manifest.toml").write_text(ACTIVE)
    assert fork.main(["save"]) == 0
    # The root holds the final version; the later diffs carry the edits.
    assert (repo / "vllm" / "new.py").read_text() == V3
    assert "+    return 3" in (repo / "series/diffs/0002-two.diff").read_text()
    assert "+    return 4" in (repo / "series/diffs/0003-three.diff").read_text()
    assert fork.main(["save", "--check"]) == 0
    assert fork.main(["check-root"]) == 0

    # build reproduces every commit byte-exact (ids: trees and messages).
    assert fork.main(["build", "--force"]) == 0
    assert series_commits(tree) == commits
    assert git_out(tree, "show", f"{commits[0]}:vllm/new.py") + "\n" == V1
    assert fork.main(["save", "--check"]) == 0
    assert fork.main(["roundtrip"]) == 0

    # A root copy that is not the built tree's final version is caught.
    (repo / "vllm" / "new.py").write_text(V2)
    assert fork.main(["check-root"]) == 1
    assert root_differences(load_manifest()) == ["vllm/new.py (content)"]
    assert fork.main(["save", "--check"]) == 1
    assert fork.main(["build", "--force"]) == 1  # V2 takes no reverse of 0003
