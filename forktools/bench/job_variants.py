# SPDX-License-Identifier: Apache-2.0
"""What the main job compares: stock and every prefix of the series.

The variants are the series as ``build/vllm`` holds it (``fork.py build``):
stock is the release tag (``manifest.BASE_TAG``, e.g. ``v0.34.0``), then one
variant per prefix of the series, each the real code of its own tree: a detached
git worktree of ``build/vllm`` at the prefix's last commit, under
``build/prefixes/`` (created on the first run, moved to the new commit when the
series changes, reused otherwise). Nothing is emulated: a lever is on in a row
exactly when that prefix's code ships it on. A prefix is numbered by its last
patch's place in ``series/manifest.toml``.

A commit that changes no file under ``vllm/`` (a benchmark, tests or CI)
changes nothing a row could show: it gets no row of its own, and the report
names it. Row labels come from the manifest names (``series/manifest.toml``,
matched to the commits by order) and the commit subjects, so the rows follow
the series as it is reshaped.

Stdlib only (git on the command line).
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from forktools.paths import PREFIX_DIR, ROOT, TREE


def _git(cwd: Path, *args: str, check: bool = True) -> str:
    proc = subprocess.run(
        ["git", *args], cwd=cwd, capture_output=True, text=True, check=False
    )
    if check and proc.returncode != 0:
        raise RuntimeError(
            f"git {' '.join(args)} in {cwd}: {proc.stderr.strip() or proc.returncode}"
        )
    return proc.stdout.strip() if proc.returncode == 0 else ""


@dataclass(frozen=True)
class Variant:
    """One tree (and configuration) the job reads every scenario with.

    Attributes:
        key: ``stock`` or ``0001``... (the prefix's last patch).
        label: Row label.
        commit: Commit of ``build/vllm`` the tree is checked out at.
        tree: The worktree (``build/prefixes/...``).
        patches: ``NNNN name`` of every patch in the prefix.
        subject: Subject of the prefix's last patch (stock: the tag).
        series: The tree's ``vllm/`` is the whole series'.

    """

    key: str
    label: str
    commit: str
    tree: Path
    patches: tuple[str, ...] = ()
    subject: str = ""
    series: bool = False

    def record(self) -> dict[str, object]:
        """The variant as the JSON has it."""
        tree = str(self.tree.relative_to(ROOT))
        return asdict(self) | {"tree": tree, "patches": list(self.patches)}


@dataclass
class Series:
    """The variants of ``build/vllm`` and the commits that get no row."""

    head: str
    base_tag: str
    variants: list[Variant]
    no_row: list[str] = field(default_factory=list)
    # build/vllm has uncommitted changes: the rows read its commits only.
    dirty: bool = False

    def by_key(self) -> dict[str, Variant]:
        out = {v.key: v for v in self.variants}
        out["series"] = self.variants[-1]
        return out


def _names(count: int) -> list[str]:
    """Manifest names by position, when the manifest has one per commit."""
    try:
        from forktools.manifest import load_manifest  # forktools/manifest.py

        names = [p.name for p in load_manifest().patches]
    except Exception:  # noqa: BLE001 - labels fall back to numbers
        names = []
    return names if len(names) == count else [f"patch-{n}" for n in range(count)]


def discover(tree: Path = TREE, base_tag: str | None = None) -> Series:
    """Stock and the code prefixes of the series (no worktrees yet).

    ``base_tag`` defaults to the release the series sits on
    (``series/release.toml``, ``manifest.BASE_TAG``).
    """
    if base_tag is None:
        from forktools.manifest import BASE_TAG as base_tag
    if not (tree / ".git").exists():
        raise RuntimeError(
            f"{tree} is no git tree: run `python3 -m forktools.fork build`"
        )
    head = _git(tree, "rev-parse", "HEAD")
    stock = _git(tree, "rev-parse", f"{base_tag}^{{commit}}")
    commits = _git(tree, "rev-list", "--reverse", f"{base_tag}..HEAD").split()
    names = _names(len(commits))
    variants = [
        Variant("stock", "stock", stock, PREFIX_DIR / base_tag, subject=base_tag)
    ]
    no_row: list[str] = []
    included: list[str] = []
    first = None
    for number, (commit, name) in enumerate(zip(commits, names, strict=True), 1):
        tag = f"{number:04d}"
        included.append(f"{tag} {name}")
        subject = _git(tree, "log", "-1", "--format=%s", commit)
        changed = _git(tree, "diff", "--name-only", f"{commit}^", commit).split()
        if not any(path.startswith("vllm/") for path in changed):
            no_row.append(f"{tag} {name}")
            continue
        first = first or tag
        span = tag if first == tag else f"{first}-{tag}"
        label = f"{span} {name}" if first == tag else f"{span} +{name}"
        variants.append(
            Variant(
                tag,
                label,
                commit,
                PREFIX_DIR / f"{tag}-{name}",
                tuple(included),
                subject,
            )
        )
    last = variants[-1]
    if last.key != "stock":
        variants[-1] = replace(last, label=f"{last.label} (series)", series=True)
    dirty = bool(_git(tree, "status", "--porcelain", "--untracked-files=no"))
    return Series(head, base_tag, variants, no_row=no_row, dirty=dirty)


def ensure_worktree(path: Path, commit: str, tree: Path = TREE) -> None:
    """A clean detached worktree of ``tree`` at ``commit`` (reused when it is)."""
    if (path / ".git").exists():
        head = _git(path, "rev-parse", "HEAD", check=False)
        dirty = _git(path, "status", "--porcelain", "--untracked-files=no", check=False)
        if head and not dirty:
            if head != commit:
                _git(path, "checkout", "-q", "--detach", commit)
            return
    _git(tree, "worktree", "remove", "--force", str(path), check=False)
    shutil.rmtree(path, ignore_errors=True)
    _git(tree, "worktree", "prune", check=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    _git(tree, "worktree", "add", "-q", "--detach", str(path), commit)


def same_code(a: Variant, b: Variant, paths: tuple[str, ...]) -> bool:
    """Whether the two trees hold the same files under ``paths``."""
    if a.commit == b.commit:
        return True
    proc = subprocess.run(
        ["git", "diff", "--quiet", a.commit, b.commit, "--", *paths],
        cwd=TREE,
        capture_output=True,
        check=False,
    )
    return proc.returncode == 0
