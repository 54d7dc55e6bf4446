# SPDX-License-Identifier: Apache-2.0
"""Git for the series tools: fixed identities and config, so builds reproduce.

Paths are read from ``forktools.paths`` when a function runs (see
``forktools.manifest``). Stdlib only.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from forktools import paths
from forktools.manifest import BASE_TAG, ForkError, Manifest

BASE_IDENTITY = ("vLLM release sdist", "noreply@vllm.invalid")
FIXED_DATE = "2026-01-01T00:00:00+00:00"
# Author of the series commits in the local build/vllm tree: fixed, so builds
# are reproducible, and never exported as anyone's sign-off. `export` authors
# and signs off every patch as `git config user.name/user.email`.
BUILD_IDENTITY = ("vLLM NIXL series (local build)", "build@localhost.invalid")
GIT_OPTS = [
    "-c", "core.hooksPath=" + os.devnull,
    "-c", "commit.gpgSign=false",
    "-c", "tag.gpgSign=false",
    "-c", "core.autocrlf=false",
    "-c", "core.safecrlf=false",
    "-c", "core.fileMode=true",
    "-c", "gc.auto=0",
    "-c", "init.defaultBranch=main",
    "-c", "advice.detachedHead=false",
]  # fmt: skip


def rel(path: Path) -> str:
    """``path`` relative to the repository root where it is inside it."""
    try:
        return str(path.relative_to(paths.ROOT))
    except ValueError:
        return str(path)


def git_env(identity: tuple[str, str] | None = None) -> dict[str, str]:
    """Environment for reproducible git commands independent of user config."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("GIT_") or k in ("GIT_SSH", "GIT_SSL_CAINFO")
    }
    env.update(
        GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull, GIT_TERMINAL_PROMPT="0"
    )
    name, email = identity or BASE_IDENTITY
    for role in ("AUTHOR", "COMMITTER"):
        env[f"GIT_{role}_NAME"] = name
        env[f"GIT_{role}_EMAIL"] = email
        env[f"GIT_{role}_DATE"] = FIXED_DATE
    return env


def git(
    cwd: Path,
    *args: str,
    identity: tuple[str, str] | None = None,
    check: bool = True,
    stdin: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run git in cwd; raise ForkError with git's last stderr line on failure."""
    proc = subprocess.run(
        ["git", *GIT_OPTS, *args], cwd=cwd, env=git_env(identity), input=stdin,
        capture_output=True, text=True,
    )  # fmt: skip
    if check and proc.returncode != 0:
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        last = lines[-1] if lines else f"exit status {proc.returncode}"
        raise ForkError(f"git {args[0]} failed in {cwd}: {last}")
    return proc


def git_out(cwd: Path, *args: str) -> str:
    return git(cwd, *args).stdout.strip()


def user_identity() -> tuple[str, str] | None:
    """``git config user.name/user.email`` of whoever runs this, if both set."""
    name, email = (
        subprocess.run(
            ["git", "config", key], cwd=paths.ROOT, capture_output=True, text=True
        ).stdout.strip()
        for key in ("user.name", "user.email")
    )
    return (name, email) if name and email else None


def require_user_identity() -> tuple[str, str]:
    identity = user_identity()
    if identity is None:
        raise ForkError(
            "set git config user.name and user.email; exported patches "
            "are authored and signed off (DCO) by whoever exports them"
        )
    return identity


def require_tree() -> None:
    if not (paths.TREE / ".git").is_dir():
        raise ForkError(
            f"{rel(paths.TREE)} missing: run `python3 -m forktools.fork build`"
        )


def series_commits(tree: Path) -> list[str]:
    merges = git_out(tree, "rev-list", "--merges", f"{BASE_TAG}..HEAD")
    if merges:
        raise ForkError(f"{rel(tree)}: merge commits above {BASE_TAG}; keep it linear")
    out = git_out(tree, "rev-list", "--reverse", f"{BASE_TAG}..HEAD")
    return out.split() if out else []


def stack_commits(manifest: Manifest) -> dict[str, list[str]]:
    """The build tree's commits of each stack (manifest order = commit order)."""
    commits = series_commits(paths.TREE)
    if len(commits) != len(manifest.patches):
        raise ForkError(
            f"{rel(paths.TREE)} has {len(commits)} commit(s) but the manifest "
            f"{len(manifest.patches)} patch(es); run `fork.py save` or `build`"
        )
    out: dict[str, list[str]] = {}
    for commit, patch in zip(commits, manifest.patches, strict=True):
        out.setdefault(patch.stack, []).append(commit)
    return out


def commit_text(tree: Path, commit: str) -> tuple[str, str]:
    """Subject and body of a commit, without Signed-off-by trailers."""
    lines = git(tree, "log", "-1", "--format=%B", commit).stdout.strip("\n")
    subject, *rest = lines.splitlines() or [""]
    body = "\n".join(
        ln.rstrip() for ln in rest if not ln.rstrip().startswith("Signed-off-by:")
    )
    return subject.strip(), re.sub(r"\n{3,}", "\n\n", body.strip("\n"))


def changed_paths(tree: Path, commit: str) -> tuple[list[str], list[str]]:
    """(added, other) paths of a commit relative to its parent."""
    out = git(
        tree, "diff-tree", "-r", "--no-commit-id", "--no-renames", "-z",
        "--name-status", f"{commit}^", commit,
    ).stdout  # fmt: skip
    fields = out.split("\0")
    added: list[str] = []
    other: list[str] = []
    for status, path in zip(fields[0::2], fields[1::2], strict=False):
        if status:
            (added if status == "A" else other).append(path)
    return added, other


def upstream_diff(tree: Path, commit: str, files: list[str]) -> str:
    """The commit's diff of ``files`` (binary where a file needs it)."""
    numstat = git_out(tree, "diff", "--numstat", f"{commit}^", commit, "--", *files)
    binary = any(ln.startswith("-\t-\t") for ln in numstat.splitlines())
    return git(
        tree, "diff", "--no-renames", "--no-color", *(["--binary"] if binary else []),
        f"{commit}^", commit, "--", *files,
    ).stdout  # fmt: skip


def final_blob(tree: Path, path: str) -> tuple[bytes, int] | None:
    """Content and file mode of ``path`` at HEAD; None where it is deleted."""
    listed = git_out(tree, "ls-tree", "HEAD", "--", path)
    if not listed:
        return None
    data = subprocess.run(
        ["git", "show", f"HEAD:{path}"], cwd=tree, capture_output=True,
        check=True, env=git_env(),
    ).stdout  # fmt: skip
    return data, 0o755 if listed.split()[0] == "100755" else 0o644
