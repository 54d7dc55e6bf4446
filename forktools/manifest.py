# SPDX-License-Identifier: Apache-2.0
"""The series manifest (``series/manifest.toml``): parse, write, count lines.

Paths are read from ``forktools.paths`` when a function runs, so a test can
point the whole fork toolchain at a scratch repository. Stdlib only.
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from forktools import paths

# The release the series is built on, and every hook point of a release change.
RELEASE_FILE = paths.SERIES / "release.toml"
RELEASE = tomllib.loads(RELEASE_FILE.read_text(encoding="utf-8"))
VLLM_VERSION: str = RELEASE["version"]
BASE_TAG = f"v{VLLM_VERSION}"
MANIFEST_REL = "series/manifest.toml"

SLUG_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
# Upstream PR titles (and the commits' subject lines) keep to 72 characters.
MAX_SUBJECT = 72
KEYS = {"name", "subject", "body", "files", "diff", "stack"}

# The series' stacks, in order: each a contiguous run of patches. The first
# two are exported (one directory each); ``project`` patches are built only.
STACKS = {
    "fixes": "stack 1: fixes and small wins, each mergeable on its own",
    "layout": "stack 2: KV layout as a local choice (RFC)",
    "project": "project only: in the fork build, never exported",
}
EXPORTED_STACKS = ("fixes", "layout")
KINDS = ("code", "docs", "tests", "ci")

MANIFEST_HEADER = """\
# vLLM NIXL patch series on top of the vLLM {version} release sdist.
#
# One [[patch]] table per commit, in order. Keys:
#   name     slug, unique; names the diff file series/diffs/NNNN-<name>.diff
#   subject  one-line upstream-style commit title
#   body     commit message body (why the change is needed)
#   files    new files the patch adds, kept at their upstream path in the repo
#   diff     optional unified git diff against upstream files
#   stack    fixes | layout | project: which exported stack the patch is in
#            (project: applied by the fork build, never exported)
# No identity here: `export` signs off as `git config user.name/user.email`.
# `python3 -m forktools.fork save` rewrites this file from build/vllm.

"""


class ForkError(Exception):
    """A failure reported to the user as one line, exit status 1."""


@dataclass
class Patch:
    """One [[patch]] table of the manifest."""

    name: str
    subject: str = ""
    body: str = ""
    files: list[str] = field(default_factory=list)
    diff: str | None = None
    stack: str = "fixes"


@dataclass
class Manifest:
    """The parsed manifest: ``patches`` are built in order."""

    patches: list[Patch]

    @property
    def exported(self) -> list[Patch]:
        """The patches ``fork.py export`` writes, in order."""
        return [p for p in self.patches if p.stack in EXPORTED_STACKS]


def check_relpath(where: str, path: str) -> None:
    parts = Path(path).parts
    if not path or Path(path).is_absolute() or ".." in parts or "\\" in path:
        raise ForkError(f"{where}: bad repo-relative path {path!r}")


def load_manifest(require_subject: bool = True, path: Path | None = None) -> Manifest:
    """Parse and validate the manifest (``path``: another one than the root's)."""
    path = path or paths.ROOT / MANIFEST_REL
    rel = f"{path.parent.name}/{path.name}"
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ForkError(f"{rel} not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ForkError(f"{rel}: invalid TOML: {exc}") from None
    unknown = set(data) - {"patch"}
    if unknown:
        raise ForkError(f"{rel}: unknown top-level keys {sorted(unknown)}")
    raw = data.get("patch", [])
    if not isinstance(raw, list):
        raise ForkError(f"{rel}: 'patch' must be an array of tables")
    patches: list[Patch] = []
    seen: set[str] = set()
    order = list(STACKS)
    for i, table in enumerate(raw, start=1):
        where = f"{rel}: patch {i}"
        patch = parse_patch(where, table, require_subject)
        if patch.name in seen:
            raise ForkError(f"{where}: duplicate name {patch.name!r}")
        seen.add(patch.name)
        if patches and order.index(patch.stack) < order.index(patches[-1].stack):
            raise ForkError(
                f"{where} ({patch.name}): stack {patch.stack!r} after "
                f"{patches[-1].stack!r}; stacks run in the order {order}"
            )
        patches.append(patch)
    return Manifest(patches)


def parse_patch(where: str, table: object, require_subject: bool) -> Patch:
    """One validated [[patch]] table."""
    if not isinstance(table, dict):
        raise ForkError(f"{where}: not a table")
    if set(table) - KEYS:
        raise ForkError(f"{where}: unknown keys {sorted(set(table) - KEYS)}")
    name = table.get("name")
    if not isinstance(name, str) or not SLUG_RE.match(name):
        raise ForkError(f"{where}: 'name' must be a slug like 'ordered-transfers'")
    where = f"{where} ({name})"
    subject, body = table.get("subject", ""), table.get("body", "")
    files, diff = table.get("files", []), table.get("diff")
    if not isinstance(subject, str) or "\n" in subject.strip():
        raise ForkError(f"{where}: 'subject' must be one line")
    if require_subject and not subject.strip():
        raise ForkError(f"{where}: 'subject' is missing")
    if len(subject.strip()) > MAX_SUBJECT:
        raise ForkError(
            f"{where}: 'subject' has {len(subject.strip())} "
            f"characters; upstream titles keep to {MAX_SUBJECT}"
        )
    if not isinstance(body, str):
        raise ForkError(f"{where}: 'body' must be a string")
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        raise ForkError(f"{where}: 'files' must be a list of paths")
    for f in files:
        check_relpath(where, f)
    if diff is not None:
        if not isinstance(diff, str):
            raise ForkError(f"{where}: 'diff' must be a path")
        check_relpath(where, diff)
    stack = table.get("stack", "fixes")
    if stack not in STACKS:
        raise ForkError(f"{where}: 'stack' must be one of {list(STACKS)}")
    return Patch(name, subject.strip(), body.strip("\n"), list(files), diff, stack)


def toml_str(value: str) -> str:
    # A JSON string literal is a valid TOML basic string.
    return json.dumps(value, ensure_ascii=False)


def toml_body(value: str) -> str:
    if not value:
        return '""'
    literal_ok = "'''" not in value and not any(
        ord(c) < 32 and c not in "\t\n" for c in value
    )
    return f"'''\n{value}\n'''" if literal_ok and "\n" in value else toml_str(value)


def dump_manifest(manifest: Manifest, version: str = VLLM_VERSION) -> str:
    """Serialize the manifest as TOML (round-trips through load_manifest)."""
    out = [MANIFEST_HEADER.format(version=version)]
    for p in manifest.patches:
        out.append(f"\n[[patch]]\nname = {toml_str(p.name)}\n")
        out.append(f"subject = {toml_str(p.subject)}\nbody = {toml_body(p.body)}\n")
        items = "".join(f"    {toml_str(f)},\n" for f in p.files)
        out.append(f"files = [\n{items}]\n" if p.files else "files = []\n")
        if p.diff:
            out.append(f"diff = {toml_str(p.diff)}\n")
        out.append(f"stack = {toml_str(p.stack)}\n")
    return "".join(out)


def file_kind(path: str) -> str:
    """What a file of the series is, for the summary's line counts."""
    if path.startswith("tests/"):
        return "tests"
    if path.startswith("docs/") or path.endswith(".md"):
        return "docs"
    if path.startswith((".buildkite/", "docker/")):
        return "ci"
    return "code"


def diff_lines(patch: Patch, nonblank: bool = False) -> dict[str, tuple[int, int]]:
    """(added, removed) lines per file of the patch's diff (``nonblank``:
    lines with more than whitespace only)."""
    counts: dict[str, tuple[int, int]] = {}
    diff = paths.ROOT / patch.diff if patch.diff else None
    if diff is None or not diff.is_file():
        return counts
    path = ""
    for line in diff.read_text(encoding="utf-8").splitlines():
        if line.startswith("diff --git "):
            path = line.split(" b/", 1)[1]
            counts.setdefault(path, (0, 0))
        elif nonblank and not line[1:].strip():
            continue
        elif line.startswith("+") and not line.startswith("+++ "):
            counts[path] = (counts[path][0] + 1, counts[path][1])
        elif line.startswith("-") and not line.startswith("--- "):
            counts[path] = (counts[path][0], counts[path][1] + 1)
    return counts


def patch_lines(patch: Patch, nonblank: bool = False) -> dict[str, tuple[int, int]]:
    """(added, removed) lines per kind: its new files and its diff.

    A new file's root copy is its final version: the lines later patches'
    diffs add to it (net) are theirs, not the adding patch's.
    """
    counts = dict.fromkeys(KINDS, (0, 0))

    def add(path: str, plus: int, minus: int) -> None:
        old = counts[file_kind(path)]
        counts[file_kind(path)] = (old[0] + plus, old[1] + minus)

    patches = load_manifest(require_subject=False).patches
    later = patches[[p.name for p in patches].index(patch.name) + 1 :]
    later_diffs = [diff_lines(p, nonblank) for p in later]
    for path in patch.files:
        text = (paths.ROOT / path).read_text(encoding="utf-8", errors="replace")
        lines = [ln for ln in text.splitlines() if ln.strip() or not nonblank]
        grown = sum(d[path][0] - d[path][1] for d in later_diffs if path in d)
        add(path, len(lines) - grown, 0)
    for path, (plus, minus) in diff_lines(patch, nonblank).items():
        add(path, plus, minus)
    return counts
