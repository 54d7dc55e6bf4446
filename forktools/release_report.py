# SPDX-License-Identifier: Apache-2.0
"""What ``release.py take`` tells the release taker: the conflict report (the
old..new release hunks that overlap each conflict) and the hook points of
``series/release.toml`` to re-check by hand. Stdlib only."""

from __future__ import annotations

import difflib
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from forktools import paths
from forktools.git_ops import git, git_env, git_out, rel
from forktools.manifest import RELEASE

# How many changed lines of a release hunk the conflict report shows.
HUNK_LINES = 6
# How many overlapping hunks per conflicted file it shows.
MAX_HUNKS = 4
UNMERGED = ("DD", "AU", "UD", "UA", "DU", "AA", "UU")


def conflicted_files(repo: Path) -> list[tuple[str, str]]:
    """(path, git status code) of the unmerged paths."""
    out = git_out(repo, "status", "--porcelain=v1", "-z", "--untracked-files=no")
    entries = ((e[3:], e[:2]) for e in out.split("\0"))
    return [(path, code) for path, code in entries if code in UNMERGED]


@dataclass
class Region:
    file_lines: tuple[int, int]  # marker lines in the conflicted file, 1-based
    ours: tuple[int, int]  # the HEAD side, in new-release line numbers


def parse_conflicts(text: str) -> tuple[list[str], list[tuple[int, int, int, int]]]:
    """The file with each conflict resolved to HEAD's side, and the regions.

    Each region: (first marker line, last marker line) of the conflicted
    file (1-based) and [start, end) of HEAD's side in the resolved lines.
    """
    resolved: list[str] = []
    regions = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("<<<<<<< "):
            resolved.append(lines[i])
            i += 1
            continue
        first, start = i + 1, len(resolved)
        i += 1
        side = "ours"
        while i < len(lines) and not lines[i].startswith(">>>>>>> "):
            line = lines[i]
            if line.startswith("||||||| ") or line == "|||||||":
                side = "base"
            elif line == "=======" and side != "theirs":
                side = "theirs"
            elif side == "ours":
                resolved.append(line)
            i += 1
        regions.append((first, i + 1, start, len(resolved)))
        i += 1
    return resolved, regions


def to_release_lines(
    release: list[str], resolved: list[str], regions: list[tuple[int, int, int, int]]
) -> list[Region]:
    """Map each region's HEAD side onto the new release's line numbers."""
    sm = difflib.SequenceMatcher(None, release, resolved, autojunk=False)
    where: dict[int, int] = {}
    for a, b, size in sm.get_matching_blocks():
        for k in range(size):
            where[b + k] = a + k
    out = []
    for first, last, start, end in regions:
        hits = [where[j] for j in range(start, end) if j in where]
        if hits:
            span = (min(hits) + 1, max(hits) + 1)
        else:
            before = [where[j] for j in range(start) if j in where]
            pos = (max(before) + 1) if before else 0
            span = (pos, pos + 1)
        out.append(Region((first, last), span))
    return out


@dataclass
class Hunk:
    header: str
    new: tuple[int, int]  # 1-based inclusive range of the new side
    changed: list[str]


def release_hunks(repo: Path, old_tag: str, new_tag: str, path: str) -> list[Hunk]:
    text = git(repo, "diff", "--no-color", "--no-renames", "-U3", old_tag, new_tag,
               "--", path).stdout  # fmt: skip
    hunks: list[Hunk] = []
    for line in text.splitlines():
        m = re.match(r"@@ -\d+(?:,\d+)? \+(\d+)(?:,(\d+))? @@", line)
        if m:
            start, count = int(m.group(1)), int(m.group(2) or 1)
            hunks.append(Hunk(line, (start, start + max(count, 1) - 1), []))
        elif hunks and line[:1] in "+-" and not line.startswith(("+++", "---")):
            hunks[-1].changed.append(line)
    return hunks


def exists_at(repo: Path, rev: str, path: str) -> bool:
    return git(repo, "cat-file", "-e", f"{rev}:{path}", check=False).returncode == 0


def report_conflict(repo: Path, old: str, new: str, pid: str, done: int) -> list[str]:
    """The report on a stopped cherry-pick of patch ``pid`` (``old``/``new``:
    the release tags; ``done``: how many patches applied before it)."""
    files = conflicted_files(repo)
    applied = f"{done} before it applied" if done else "the first patch"
    lines = [
        f"CONFLICT: patch {pid} does not apply on {new} ({applied}); conflicted files:",
        *(f"  {path}  [{code}]" for path, code in files),
    ]
    for path, code in files:
        lines += ["", f"{path}:"]
        if not exists_at(repo, old, path):
            lines.append(f"  not in {old}: added by {new} and the patch")
        elif not exists_at(repo, new, path):
            lines.append(f"  deleted (or moved) by {new}; the patch changes it")
        if code in ("UU", "AA") and (repo / path).is_file():
            lines += file_report(repo, old, new, path)
    return lines


def file_report(repo: Path, old: str, new: str, path: str) -> list[str]:
    """A conflicted file's regions and the release hunks that overlap them."""
    release = git(repo, "show", f"HEAD:{path}").stdout.splitlines()
    text = (repo / path).read_text(encoding="utf-8", errors="replace")
    regions = to_release_lines(release, *parse_conflicts(text))
    hunks = release_hunks(repo, old, new, path)
    lines = [
        f"  conflict at lines {r.file_lines[0]}-{r.file_lines[1]} of the "
        f"file; {new} side = lines {r.ours[0]}-{r.ours[1]}"
        for r in regions
    ]
    overlap = [
        h for h in hunks
        if any(h.new[0] <= r.ours[1] and r.ours[0] <= h.new[1] for r in regions)
    ]  # fmt: skip
    lines.append(
        f"  {old}..{new} changes this file in {len(hunks)} "
        f"hunk(s); {len(overlap)} overlap the conflict(s):"
    )
    for h in overlap[:MAX_HUNKS]:
        lines.append(f"    {h.header}")
        lines += [f"      {c[:100]}" for c in h.changed[:HUNK_LINES]]
        if len(h.changed) > HUNK_LINES:
            lines.append(
                f"      ... {len(h.changed) - HUNK_LINES} more changed line(s)"
            )
    if len(overlap) > MAX_HUNKS:
        lines.append(f"    ... {len(overlap) - MAX_HUNKS} more overlapping hunk(s)")
    if regions and not overlap:
        lines.append(
            "    (none: the conflict is with a release change next to it; "
            f"`git diff {old} {new} -- {path}`)"
        )
    return lines


def pins(repo: Path, tag: str, name: str) -> dict[str, set[str]]:
    """The requirement lines for ``name`` in ``tag``'s requirements/, by file."""
    proc = git(repo, "grep", "-i", "-E", rf"^{re.escape(name)}\s*[=<>~!]",
               tag, "--", "requirements/", check=False)  # fmt: skip
    found: dict[str, set[str]] = {}
    for line in proc.stdout.splitlines():
        _, path, spec = line.split(":", 2)
        spec = re.sub(r"\s+", "", spec.split("#")[0].split(";")[0].rstrip("\\ "))
        found.setdefault(path, set()).add(spec)
    return found


def pin_changes(repo: Path, old: str, new: str, name: str) -> list[str]:
    """How the release's pins of ``name`` moved, one line per changed file."""
    before, after = pins(repo, old, name), pins(repo, new, name)
    out = []
    for path in sorted(set(before) | set(after)):
        a, b = before.get(path, set()), after.get(path, set())
        if a != b:
            out.append(
                f"      {path}: {', '.join(sorted(a)) or '-'} -> "
                f"{', '.join(sorted(b)) or '-'}"
            )
    same = len(set(before) | set(after)) - len(out)
    if same:
        out.append(f"      ({same} other requirements file(s) pin it as before)")
    return out


def cpu_patch_checks(repo: Path, tag: str, folder: Path) -> list[str]:
    """``git apply --check`` of the CPU build patches, in order, on ``tag``."""
    patches = sorted(folder.glob("*.diff"))
    if not patches:
        return [f"    {rel(folder)}: no *.diff"]
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(git_env(), GIT_INDEX_FILE=str(Path(tmp) / "index"))
        subprocess.run(["git", "read-tree", tag], cwd=repo, env=env, check=True)
        for patch in patches:
            proc = subprocess.run(
                ["git", "apply", "--cached", "--whitespace=nowarn", str(patch)],
                cwd=repo, env=env, capture_output=True, text=True,
            )  # fmt: skip
            why = (proc.stderr.strip().splitlines() or ["?"])[-1]
            what = "applies" if proc.returncode == 0 else f"DOES NOT APPLY: {why}"
            out.append(f"    {rel(patch)}: {what} on {tag}")
    return out


def recheck(repo: Path, old: str, new: str) -> list[str]:
    """The release's hook points, with how the release moved them."""
    lines = ["", "re-check by hand (series/release.toml hook points):"]
    exceptions = RELEASE.get("exceptions", {})
    names = [k for k in exceptions if not k.endswith("_reason")]
    if not names:
        lines.append("  [exceptions]: none")
    for name in names:
        lines.append(f"  [exceptions] {name} = {exceptions[name]!r}")
        if reason := exceptions.get(f"{name}_reason"):
            lines.append(f"    reason: {reason}")
        lines.append(f"    {old}..{new} pins of {name}:")
        lines += pin_changes(repo, old, new, name)
    folder = paths.ROOT / RELEASE.get("cpu_patches", "tools/cpu_ext")
    lines.append(f"  cpu_patches = {rel(folder)}:")
    lines += cpu_patch_checks(repo, new, folder)
    lines.append(
        "  also: CPU_GATE in tools/test_site/sitecustomize.py, stock counts in "
        "forktools/testrun/suites.py, tools/mypy_baseline.txt "
        "(project-docs/releases.md)"
    )
    return lines
