# SPDX-License-Identifier: Apache-2.0
"""``fork.py save`` and ``check-root``: build/vllm's commits back into the repo.

Each commit above the release tag maps, in order, to a manifest [[patch]]
(project-docs/fork.md, "Editing the series"). Stdlib only.
"""

from __future__ import annotations

from pathlib import Path

from forktools import paths
from forktools.build_tree import mark_saved, patch_id
from forktools.git_ops import (
    changed_paths,
    commit_text,
    final_blob,
    git_out,
    rel,
    require_tree,
    series_commits,
    stack_commits,
    upstream_diff,
)
from forktools.manifest import (
    BASE_TAG,
    MANIFEST_REL,
    ForkError,
    Manifest,
    Patch,
    check_relpath,
    dump_manifest,
    load_manifest,
)


class RepoWriter:
    """Writes and deletions in the repository, or with ``check`` only the
    paths they would change."""

    def __init__(self, check: bool) -> None:
        self.check = check
        self.differs: list[str] = []

    def write(self, path: str, data: bytes, mode: int = 0o644) -> None:
        dest = paths.ROOT / path
        if self.check:
            same = dest.is_file() and dest.read_bytes() == data
            if not same or (dest.stat().st_mode & 0o777) != mode:
                self.differs.append(path)
            return
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
        dest.chmod(mode)

    def remove(self, path: str) -> bool:
        if not (paths.ROOT / path).is_file():
            return False
        if self.check:
            self.differs.append(path)
        else:
            (paths.ROOT / path).unlink()
        return True


def saved_patch(
    tree: Path, index: int, commit: str, old: Patch, out: RepoWriter
) -> tuple[Patch, int]:
    """Write one commit's new files and diff; its patch and how many upstream
    files it changes. ``old`` is its manifest entry (name, stack, file order)."""
    subject, body = commit_text(tree, commit)
    added, other = changed_paths(tree, commit)
    for path in added:  # the root copy is the final version (HEAD's)
        check_relpath(f"commit {commit[:12]}", path)
        final = final_blob(tree, path)
        if final is None:
            out.remove(path)
        else:
            out.write(path, *final)
    diff = None
    if other:
        diff = f"series/diffs/{index:04d}-{old.name}.diff"
        out.write(diff, upstream_diff(tree, commit, other).encode("utf-8"))
    # Keep the manifest's file order; new files go last, sorted.
    files = [f for f in old.files if f in added]
    files += sorted(set(added) - set(files))
    return Patch(old.name, subject, body, files, diff, old.stack), len(other)


def remove_stale(old: list[Patch], new: list[Patch], out: RepoWriter) -> list[str]:
    """Remove the files and diffs of ``old`` that ``new`` no longer has."""
    gone = {f for p in old for f in p.files} - {f for p in new for f in p.files}
    gone |= {p.diff for p in old if p.diff} - {p.diff for p in new if p.diff}
    return [path for path in sorted(gone) if out.remove(path)]


def save(check: bool) -> int:
    out = RepoWriter(check)
    require_tree()
    tree = paths.TREE
    manifest = load_manifest(require_subject=False)
    if git_out(tree, "status", "--porcelain"):
        raise ForkError(
            f"{rel(tree)} has uncommitted changes; commit or amend them there first"
        )
    commits = series_commits(tree)
    if len(commits) != len(manifest.patches):
        raise ForkError(
            f"{rel(tree)} has {len(commits)} commit(s) above {BASE_TAG} but "
            f"{MANIFEST_REL} has {len(manifest.patches)} [[patch]] table(s); "
            "commits map to tables by order, so add a table with just "
            '`name = "<slug>"` for each new commit (or drop tables) and rerun'
        )
    patches: list[Patch] = []
    for index, (commit, old) in enumerate(
        zip(commits, manifest.patches, strict=True), 1
    ):
        patch, upstream = saved_patch(tree, index, commit, old, out)
        patches.append(patch)
        if not check:
            print(
                f"save: {patch_id(index, old)}: {len(patch.files)} new file(s), "
                f"{upstream} upstream file(s) changed"
            )
    for stale in remove_stale(manifest.patches, patches, out):
        if not check:
            print(f"save: removed {stale}")
    new_manifest = Manifest(patches)
    out.write(MANIFEST_REL, dump_manifest(new_manifest).encode("utf-8"))
    if check:
        if out.differs:
            print(f"save --check: FAIL: save would change {sorted(out.differs)}")
            return 1
        print(f"save --check: OK: the repository holds build/vllm's {BASE_TAG}..HEAD")
        return 0
    if load_manifest() != new_manifest:  # the hand-written TOML must round-trip
        raise ForkError(f"internal error: {MANIFEST_REL} does not round-trip")
    mark_saved(tree)
    print(f"save: wrote {MANIFEST_REL} ({len(patches)} patch(es))")
    return 0


def root_differences(manifest: Manifest) -> list[str]:
    """Active patches' new files whose repository copy is not the tree's HEAD's."""
    bad: list[str] = []
    for path in sorted({f for p in manifest.patches for f in p.files}):
        final, dest = final_blob(paths.TREE, path), paths.ROOT / path
        if final is None:
            if dest.exists():
                bad.append(f"{path} (deleted by the series, still at the root)")
        elif not dest.is_file():
            bad.append(f"{path} (missing at the root)")
        elif dest.read_bytes() != final[0]:
            bad.append(f"{path} (content)")
        elif dest.stat().st_mode & 0o777 != final[1]:
            bad.append(f"{path} (mode)")
    return bad


def check_root() -> int:
    require_tree()
    manifest = load_manifest()
    stack_commits(manifest)  # the tree holds the manifest's patches
    bad = root_differences(manifest)
    tree = rel(paths.TREE)
    if bad:
        print(
            f"check-root: FAIL: root copies differ from {tree} HEAD's: "
            + "; ".join(bad)
        )
        return 1
    n = sum(len(p.files) for p in manifest.patches)
    print(f"check-root: OK: {n} new file(s) at the root are {tree} HEAD's")
    return 0
