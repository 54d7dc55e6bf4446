# SPDX-License-Identifier: Apache-2.0
"""``fork.py fetch`` and ``build``: the release sdist, and build/vllm made of it.

project-docs/fork.md ("How the fork is built") says what ``build`` commits.
Stdlib only.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from forktools import paths
from forktools.git_ops import BUILD_IDENTITY, git, git_out, rel
from forktools.manifest import (
    BASE_TAG,
    RELEASE,
    VLLM_VERSION,
    ForkError,
    Manifest,
    Patch,
    load_manifest,
)

SDIST_SHA256: str = RELEASE["sha256"]
BASE_COMMIT: str = RELEASE["base_commit"]  # the pristine base's commit id
# Names the last HEAD of build/vllm saved in the repository (written by
# `build` and `save`); `build` refuses to discard any other unless --force.
SAVED_HEAD_MARKER = "fork-saved-head"


def patch_id(index: int, patch: Patch) -> str:
    """'NNNN name' as used in messages (index is 1-based)."""
    return f"{index:04d} {patch.name}"


def sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def env_python() -> Path:
    """Python of the project venv (needed by `pip download`, see fetch)."""
    env_dir = Path(os.environ.get("ENV_DIR", ".venv"))
    return (env_dir if env_dir.is_absolute() else paths.ROOT / env_dir) / "bin/python"


def fetch_sdist(version: str = VLLM_VERSION, sha256: str | None = SDIST_SHA256) -> Path:
    """Return the verified sdist path, downloading it first if needed.

    ``pip download`` builds the sdist's metadata without isolation, in the
    project venv (an isolated build would install the release's torch, GBs).
    ``sha256=None`` skips the check (``release.py`` checks it itself).
    """
    name, cache = f"vllm-{version}.tar.gz", paths.CACHE_DIR
    target = cache / name
    if not target.exists():
        python = env_python()
        if not python.exists():
            raise ForkError(
                f"cannot download {name}: no venv python at {rel(python)}; run "
                "`bash tools/setup_env.sh` (it fetches the sdist)"
            )
        cache.mkdir(parents=True, exist_ok=True)
        log = cache / "fetch.log"
        env = dict(
            os.environ, VLLM_VERSION_OVERRIDE=version, VLLM_TARGET_DEVICE="empty"
        )
        with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
            cmd = [
                str(python), "-m", "pip", "download", "--no-deps",
                "--no-binary", "vllm", "--no-build-isolation",
                "--retries", "2", "--timeout", "30",
                f"vllm=={version}", "-d", tmp,
            ]  # fmt: skip
            print(f"fetch: downloading {name} from the package index", flush=True)
            with open(log, "w", encoding="utf-8") as logf:
                proc = subprocess.run(
                    cmd, env=env, stdout=logf, stderr=subprocess.STDOUT
                )
            got = Path(tmp) / name
            if proc.returncode != 0 or not got.exists():
                pinned = f" (sha256 {sha256[:12]}...)" if sha256 else ""
                raise ForkError(
                    f"sdist download failed (pip exit {proc.returncode}), likely no "
                    "network / PyPI unreachable: check connectivity or proxy "
                    f"settings and retry, or copy {name}{pinned} "
                    f"into {rel(cache)}/; pip log: {rel(log)}"
                )
            shutil.move(str(got), target)
    if sha256 and (digest := sha256_of(target)) != sha256:
        raise ForkError(
            f"sdist sha256 mismatch: got {digest}, expected {sha256}; "
            f"delete {rel(target)} and retry"
        )
    return target


def make_base(
    dest: Path,
    sdist: Path,
    version: str = VLLM_VERSION,
    expect: str | None = BASE_COMMIT,
) -> str:
    """Create a git repo at dest holding the pristine sdist as one commit.

    The commit has a fixed identity and date, so its id depends on the
    sdist alone; it is tagged ``v<version>``. ``expect`` is the id it should
    have (``series/release.toml``'s ``base_commit``): a warning if not.
    """
    dest.mkdir(parents=True)
    subprocess.run(
        ["tar", "-xzf", str(sdist), "-C", str(dest), "--strip-components=1",
         "--no-same-owner"],
        check=True,
    )  # fmt: skip
    git(dest, "init", "-q")
    # The sdist ships files the tree's own .gitignore would skip: force-add
    # so the base commit is exactly the sdist.
    git(dest, "add", "-f", "-A")
    git(
        dest, "commit", "-q", "--cleanup=verbatim", "-m",
        f"vLLM {version} release sdist\n\n{sdist.name} sha256 {sha256_of(sdist)}\n",
    )  # fmt: skip
    git(dest, "tag", f"v{version}")
    head = git_out(dest, "rev-parse", "HEAD")
    if expect and head != expect:
        print(
            f"warning: pristine base commit is {head}, expected {expect} "
            "(extracted tree differs from the reference: file modes/filesystem?)",
            file=sys.stderr,
        )
    return head


def apply_error(pid: str, diff_rel: str, stderr: str) -> ForkError:
    """The failure of ``git apply`` of a patch's diff, as one line."""
    errors = [ln[7:] for ln in stderr.splitlines() if ln.startswith("error: ")]
    hunk = ""
    for e in errors:
        m = re.match(r"patch failed: (.+):(\d+)$", e)
        if m:
            hunk = f" (hunk at line {m.group(2)})"
    for e in reversed(errors):
        m = re.match(r"(\S+): (.+)$", e)
        if m and m.group(1) not in ("patch failed", "corrupt patch"):
            return ForkError(
                f"patch {pid} does not apply: {m.group(1)}: {m.group(2)}{hunk}"
            )
    reason = errors[-1] if errors else (stderr.strip().splitlines() or ["?"])[-1]
    return ForkError(f"patch {pid} does not apply: {diff_rel}: {reason}")


def copy_file(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    shutil.copymode(src, dst)


def added_versions(root: Path, patches: Sequence[Patch], work: Path) -> list[Path]:
    """Per patch, a directory under ``work`` with its new files as it adds them.

    ``root`` holds each new file as the whole series leaves it (its final
    version). Walking the patches backwards from there, each patch's files
    are taken as they stand, then the patch's diff of earlier patches' new
    files is reverse-applied: what remains is their version before it.
    """
    state = work / "state"
    state.mkdir(parents=True)
    git(state, "init", "-q")
    for path in {f for p in patches for f in p.files}:
        if (root / path).is_file():
            copy_file(root / path, state / path)
    dirs: list[Path] = []
    for index in range(len(patches), 0, -1):
        patch = patches[index - 1]
        dirs.append(work / f"{index:04d}")
        for path in patch.files:
            if not (state / path).is_file():
                raise ForkError(
                    f"patch {patch_id(index, patch)}: new file {path} is missing "
                    "from the repo"
                )
            copy_file(state / path, dirs[-1] / path)
            (state / path).unlink()
        earlier = {f for p in patches[: index - 1] for f in p.files}
        diff = root / patch.diff if patch.diff else None
        if not earlier or diff is None or not diff.is_file():
            continue  # a missing diff: apply_patch says so
        stat = git_out(state, "apply", "--numstat", "-z", str(diff))
        touched = [f.split("\t")[-1] for f in stat.split("\0")] if stat else []
        undo = sorted(earlier.intersection(touched))
        if not undo:
            continue
        escaped = (re.sub(r"([*?\[\\])", r"\\\1", f) for f in undo)
        proc = git(
            state, "apply", "-R", "--whitespace=nowarn",
            *(f"--include={f}" for f in escaped), str(diff), check=False,
        )  # fmt: skip
        if proc.returncode != 0:
            raise ForkError(
                f"patch {patch_id(index, patch)}: its diff of {', '.join(undo)} "
                "does not reverse-apply to the repository's (final) copies: "
                + (proc.stderr.strip().splitlines() or ["?"])[-1]
            )
    return dirs[::-1]


def commit_message(patch: Patch) -> str:
    body = patch.body.strip("\n")
    return f"{patch.subject}\n\n{body}\n" if body else f"{patch.subject}\n"


def apply_patch(
    tree: Path, index: int, patch: Patch, files: Path, diff_root: Path | None = None
) -> None:
    """Add the patch's files (from ``files``), apply its diff (from
    ``diff_root``, default the repository) and commit it."""
    pid = patch_id(index, patch)
    for path in patch.files:
        src, dst = files / path, tree / path
        if not src.is_file():
            raise ForkError(f"patch {pid}: new file {path} is missing from the repo")
        if dst.exists() or dst.is_symlink():
            raise ForkError(
                f"patch {pid}: new file {path} already exists in the tree; "
                "changes to existing files belong in the patch's diff"
            )
        copy_file(src, dst)
    if patch.files:
        git(tree, "add", "-f", "--", *patch.files)
    if patch.diff:
        diff_path = (diff_root or paths.ROOT) / patch.diff
        if not diff_path.is_file():
            raise ForkError(f"patch {pid}: diff {patch.diff} not found")
        proc = git(tree, "apply", "--index", "--whitespace=nowarn", str(diff_path),
                   check=False)  # fmt: skip
        if proc.returncode != 0:
            raise apply_error(pid, patch.diff, proc.stderr)
    if git(tree, "diff", "--cached", "--quiet", check=False).returncode == 0:
        print(f"warning: patch {pid} changes nothing", file=sys.stderr)
    git(
        tree, "commit", "-q", "--allow-empty", "--cleanup=whitespace",
        "-F", "-", identity=BUILD_IDENTITY, stdin=commit_message(patch),
    )  # fmt: skip


def unsaved_reason(tree: Path) -> str | None:
    """Why rebuilding tree would lose work, or None if it is safe."""
    status = git(tree, "status", "--porcelain", check=False)
    if status.returncode != 0:
        return None  # not a usable repo: nothing to protect
    if status.stdout.strip():
        n = len(status.stdout.splitlines())
        return f"{rel(tree)} has {n} uncommitted change(s)"
    head = git(tree, "rev-parse", "-q", "--verify", "HEAD", check=False).stdout.strip()
    marker = tree / ".git" / SAVED_HEAD_MARKER
    saved = marker.read_text().strip() if marker.exists() else ""
    if head and head != saved:
        return f"{rel(tree)} HEAD {head[:12]} is not saved to the series"
    return None


def mark_saved(tree: Path) -> None:
    head = git_out(tree, "rev-parse", "HEAD")
    (tree / ".git" / SAVED_HEAD_MARKER).write_text(head + "\n")


def prepare_base(tree: Path, sdist: Path) -> None:
    """Reset tree to the pristine base, reusing an existing repo if it has one."""
    if (tree / ".git").is_dir():
        tag = git(tree, "rev-parse", "-q", "--verify", f"{BASE_TAG}^{{commit}}",
                  check=False).stdout.strip()  # fmt: skip
        if tag == BASE_COMMIT:
            git(tree, "checkout", "-q", "-f", "-B", "main", BASE_TAG)
            git(tree, "clean", "-q", "-ffdx")
            return
    if tree.exists() or tree.is_symlink():
        shutil.rmtree(tree)
    make_base(tree, sdist)


def build(tree: Path, force: bool) -> Manifest:
    manifest = load_manifest()
    sdist = fetch_sdist()
    reason = unsaved_reason(tree) if tree.exists() and not force else None
    if reason:
        raise ForkError(
            f"{reason}; commit and run `python3 -m forktools.fork save` first, "
            "or rerun build with --force to discard it"
        )
    with tempfile.TemporaryDirectory(prefix="fork-files-") as tmp:
        versions = added_versions(paths.ROOT, manifest.patches, Path(tmp))
        prepare_base(tree, sdist)
        try:
            for index, patch in enumerate(manifest.patches, start=1):
                apply_patch(tree, index, patch, versions[index - 1])
        except ForkError:
            # Leave a clean tree holding the patches that applied; it is the
            # series' own output, so the next build may discard it.
            git(tree, "reset", "-q", "--hard", check=False)
            git(tree, "clean", "-q", "-ffd", check=False)
            mark_saved(tree)
            raise
    mark_saved(tree)
    return manifest
