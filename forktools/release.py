# SPDX-License-Identifier: Apache-2.0
"""Take a new vLLM release: rebase the patch series onto it.

    python3 -m forktools.release take NEW_VERSION --sha256 HASH [--from REV]
                             [--each] [--work DIR] [--dry-run] [--resume]

``take`` reads the series from project commit REV (default HEAD): its
manifest, diffs and new files, and the release it sits on (REV's
``series/release.toml``, or the constants ``VLLM_VERSION`` in
forktools/manifest.py and ``SDIST_SHA256``/``BASE_COMMIT`` in forktools/fork.py of
commits older than that file). It fetches both sdists (the three-way merge
needs the old base's blobs), checks the new one against the pinned
``--sha256`` and prints the package index's hash beside it.

In one scratch git repository (default ``build/release/<NEW>/vllm``) it
commits the old release (tag ``v<old>``) with the series' active patches on
branch ``series-<old>``, exactly as ``fork.py build`` does, and the new
release as ``fork.py build`` would (tag ``v<NEW>``); then it cherry-picks
each series commit onto the new release, a three-way merge.

* A conflict stops it: the report names the patch, its conflicted files and
  the old..new release hunks that overlap each conflict region; exit 1. The
  cherry-pick is left in progress: resolve it there, ``git cherry-pick
  --continue``, and rerun with ``--resume``.
* ``--each``: every patch alone on the new release, one line per patch.
* Everything applied: the rebased series is written back into the
  repository (new files, ``series/diffs/``, ``series/manifest.toml``, the
  way ``fork.py save`` writes them) and ``series/release.toml`` moves to the
  new release, with ``[previous]`` = the old one and REV. ``--dry-run``
  writes nothing into the repository.

Every run ends with what to re-check by hand: the ``[exceptions]`` to the
release's requirements (with the old and new pins) and the CPU build
patches (``cpu_patches``, each checked with ``git apply --check``).
project-docs/releases.md says how a release is taken. Stdlib only.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from forktools import manifest as manifest_mod  # forktools/manifest.py
from forktools.fork import (
    BUILD_IDENTITY,
    RELEASE,
    ROOT,
    ForkError,
    Manifest,
    Patch,
    _apply_error,
    _rel,
    added_versions,
    changed_paths,
    commit_message,
    commit_text,
    dump_manifest,
    fetch_sdist,
    final_blob,
    git,
    git_env,
    git_out,
    load_manifest,
    make_base,
    patch_id,
    sha256_of,
)

RELEASE_FILE = ROOT / "series" / "release.toml"
WORK_DIR = ROOT / "build" / "release"
PYPI_JSON = "https://pypi.org/pypi/vllm/{version}/json"
PYPI_PROJECT_JSON = "https://pypi.org/pypi/vllm/json"
PYPI_TIMEOUT = 5.0
VERSION_RE = re.compile(r"^\d+\.\d+\.\d+(?:[.\-+]?[a-z0-9]+)*$")
STATE_FILE = "release-state.json"
# How many changed lines of a release hunk the conflict report shows.
HUNK_LINES = 6
# How many overlapping hunks per conflicted file it shows.
MAX_HUNKS = 4


def say(msg: str = "") -> None:
    print(msg, flush=True)


# --------------------------------------------------------------------------
# the series at REV


@dataclass
class Base:
    """The release a series sits on, as recorded at some project commit."""

    version: str
    sha256: str | None
    base_commit: str | None


@dataclass
class Series:
    rev: str  # full sha of the project commit
    base: Base
    manifest: Manifest
    root: Path  # extracted files of REV: series/, new files


def resolve_rev(rev: str) -> str:
    proc = git(ROOT, "rev-parse", "-q", "--verify", f"{rev}^{{commit}}", check=False)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise ForkError(f"--from {rev}: not a commit of this repository")
    return proc.stdout.strip()


def show(rev: str, path: str) -> str | None:
    """The text of ``path`` at project commit ``rev``, None if absent."""
    proc = git(ROOT, "show", f"{rev}:{path}", check=False)
    return proc.stdout if proc.returncode == 0 else None


def _constant(text: str | None, name: str) -> str | None:
    if not text:
        return None
    m = re.search(rf'^{name}(?:: *str)? *= *"([^"]+)"', text, re.M)
    return m.group(1) if m else None


def base_at(rev: str) -> Base:
    """The release of the series at ``rev`` (release.toml, else constants)."""
    text = show(rev, "series/release.toml")
    if text is not None:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ForkError(f"series/release.toml at {rev[:12]}: {exc}") from None
        if "version" not in data:
            raise ForkError(f"series/release.toml at {rev[:12]}: no version")
        return Base(data["version"], data.get("sha256"), data.get("base_commit"))
    version = _constant(show(rev, "tools/manifest.py"), "VLLM_VERSION")
    fork_py = show(rev, "tools/fork.py")
    if version is None:
        raise ForkError(
            f"{rev[:12]} has neither series/release.toml nor a VLLM_VERSION "
            "constant in tools/manifest.py: which release is its series on?"
        )
    return Base(
        version, _constant(fork_py, "SDIST_SHA256"), _constant(fork_py, "BASE_COMMIT")
    )


@contextlib.contextmanager
def manifest_at(path: Path, root: Path, version: str) -> Iterator[None]:
    """Point forktools/manifest.py's globals at another manifest for a while.

    ``load_manifest``/``dump_manifest`` read these module globals; the
    series taken may be another commit's, and the one written back carries
    the new release in its header.
    """
    saved = (manifest_mod.MANIFEST, manifest_mod.ROOT, manifest_mod.VLLM_VERSION)
    manifest_mod.MANIFEST, manifest_mod.ROOT = path, root
    manifest_mod.VLLM_VERSION = version
    try:
        yield
    finally:
        (manifest_mod.MANIFEST, manifest_mod.ROOT,
         manifest_mod.VLLM_VERSION) = saved  # fmt: skip


def read_series(rev: str, dest: Path) -> Series:
    """Extract the series of project commit ``rev`` into ``dest``."""
    base = base_at(rev)
    text = show(rev, "series/manifest.toml")
    if text is None:
        raise ForkError(f"{rev[:12]} has no series/manifest.toml")
    dest.mkdir(parents=True)
    (dest / "series").mkdir()
    (dest / "series" / "manifest.toml").write_text(text, encoding="utf-8")
    with manifest_at(dest / "series" / "manifest.toml", dest, base.version):
        manifest = load_manifest()
    paths = {"series/manifest.toml"}
    for p in [*manifest.patches, *manifest.parked]:
        paths.update(p.files)
        if p.diff:
            paths.add(p.diff)
    listed = git_out(ROOT, "ls-tree", "-r", "--name-only", "-z", rev).split("\0")
    missing = sorted(paths - set(listed))
    if missing:
        raise ForkError(f"{rev[:12]}: the manifest names files it lacks: {missing}")
    tar = dest / ".series.tar"
    with open(tar, "wb") as out:
        proc = subprocess.run(
            ["git", "archive", "--format=tar", rev, "--", *sorted(paths)],
            cwd=ROOT, stdout=out, stderr=subprocess.PIPE, env=git_env(),
        )  # fmt: skip
    if proc.returncode != 0:
        raise ForkError(f"git archive {rev[:12]} failed: {proc.stderr.decode()[-200:]}")
    with tarfile.open(tar) as tf:
        tf.extractall(dest, filter="data")
    tar.unlink()
    return Series(rev, base, manifest, dest)


# --------------------------------------------------------------------------
# sdists


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=PYPI_TIMEOUT) as resp:
        return json.load(resp)


def pypi_sha256(version: str) -> tuple[str | None, str]:
    """(sha256 of the sdist the package index lists, where it came from).

    The release's JSON page first; where that fails, the project's page
    (its ``releases`` table) decides whether the version exists at all: a
    404 of the release page alone is not proof (some mirrors serve only
    the project page). Unreachable: (None, why).
    """
    url = PYPI_JSON.format(version=version)
    try:
        files = _get_json(url).get("urls", [])
        source = url
    except (OSError, ValueError) as exc:
        try:
            releases = _get_json(PYPI_PROJECT_JSON).get("releases", {})
        except (OSError, ValueError) as exc2:
            why = getattr(exc2, "reason", None) or getattr(exc, "reason", exc)
            return None, f"PyPI unreachable ({why})"
        if version not in releases:
            raise ForkError(
                f"vLLM {version} is not a release on PyPI (not in "
                f"{PYPI_PROJECT_JSON}); see https://pypi.org/project/vllm/#history"
            ) from None
        files, source = releases[version], PYPI_PROJECT_JSON
    for entry in files:
        if entry.get("packagetype") == "sdist":
            return entry.get("digests", {}).get("sha256"), f"PyPI, {source}"
    raise ForkError(f"vLLM {version} on PyPI has no sdist ({source})")


def fetch_release(version: str, pinned: str) -> Path:
    """The new release's sdist, checked against the hash the user pinned."""
    index_sha, source = pypi_sha256(version)
    path = fetch_sdist(version, None)
    got = sha256_of(path)
    say(f"sdist: {_rel(path)}")
    say(f"  sha256 {got} (file)")
    say(f"  sha256 {pinned} (--sha256, pinned)")
    if index_sha:
        note = "" if index_sha == got else "  <- DIFFERS from the file"
        say(f"  sha256 {index_sha} ({source}){note}")
    else:
        say(f"  {source}: cannot show the package index's sha256")
    if got != pinned:
        raise ForkError(
            f"sdist sha256 mismatch: {_rel(path)} is {got}, --sha256 pins "
            f"{pinned}; check the hash on https://pypi.org/project/vllm/{version}/"
            f"#files (a bad download: delete {_rel(path)} and rerun)"
        )
    return path


# --------------------------------------------------------------------------
# the scratch repository


def first_versions(root: Path, patches: list[Patch], work: Path) -> list[Path]:
    """``fork.added_versions``; a series saved before the root kept each new
    file's final version (e.g. the 0.33.0 state) keeps the versions it adds."""
    try:
        return added_versions(root, patches, work)
    except ForkError as exc:
        say(f"series: root copies taken as the versions patches add ({exc})")
        return [root] * len(patches)


def apply_from(root: Path, tree: Path, index: int, patch: Patch, files: Path) -> None:
    """``fork.apply_patch`` with the diff taken from ``root``, new files from
    ``files``."""
    pid = patch_id(index, patch)
    for rel in patch.files:
        src, dst = files / rel, tree / rel
        if dst.exists() or dst.is_symlink():
            raise ForkError(f"patch {pid}: new file {rel} already exists in the tree")
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
        shutil.copymode(src, dst)
    if patch.files:
        git(tree, "add", "-f", "--", *patch.files)
    if patch.diff:
        proc = git(
            tree, "apply", "--index", "--whitespace=nowarn", str(root / patch.diff),
            check=False,
        )  # fmt: skip
        if proc.returncode != 0:
            raise _apply_error(pid, patch.diff, proc.stderr)
    git(
        tree, "commit", "-q", "--allow-empty", "--cleanup=whitespace",
        "-F", "-", identity=BUILD_IDENTITY, stdin=commit_message(patch),
    )  # fmt: skip


@dataclass
class Scratch:
    repo: Path  # the new release, the old one's objects borrowed
    old: Base
    new: str
    commits: list[str]  # the series' commits on the old release, in order
    patches: list[Patch]

    @property
    def old_tag(self) -> str:
        return f"v{self.old.version}"

    @property
    def new_tag(self) -> str:
        return f"v{self.new}"


def build_scratch(work: Path, series: Series, old_sdist: Path, new: str,
                  new_sdist: Path) -> Scratch:  # fmt: skip
    """Old release + series (branch series-<old>) and the new release."""
    old = series.base
    old_repo, repo = work / "old", work / "vllm"
    t0 = time.monotonic()
    make_base(old_repo, old_sdist, old.version, old.base_commit)
    patches = series.manifest.patches
    with tempfile.TemporaryDirectory(prefix="release-files-") as tmp:
        files = first_versions(series.root, patches, Path(tmp))
        for index, patch in enumerate(patches, start=1):
            try:
                apply_from(series.root, old_repo, index, patch, files[index - 1])
            except ForkError as exc:
                raise ForkError(
                    f"the series of {series.rev[:12]} does not build on its own "
                    f"release v{old.version}: {exc}"
                ) from None
    git(old_repo, "branch", "-q", f"series-{old.version}")
    # Whoever resolves a conflict there runs plain git: no background repack.
    git(old_repo, "config", "gc.auto", "0")
    expect = RELEASE.get("base_commit") if RELEASE.get("version") == new else None
    new_base = make_base(repo, new_sdist, new, expect)
    git(repo, "config", "gc.auto", "0")
    # Borrow the old release's objects: the fetch below copies nothing.
    alternates = repo / ".git" / "objects" / "info" / "alternates"
    alternates.write_text(str((old_repo / ".git" / "objects").resolve()) + "\n")
    git(repo, "fetch", "-q", "--no-tags", str(old_repo.resolve()),
        f"refs/tags/v{old.version}:refs/tags/v{old.version}",
        f"refs/heads/series-{old.version}:refs/heads/series-{old.version}")  # fmt: skip
    commits = git_out(
        repo, "rev-list", "--reverse", f"v{old.version}..series-{old.version}"
    ).split()
    say(
        f"scratch: {_rel(repo)}: v{old.version} + {len(commits)} patch(es) "
        f"(branch series-{old.version}), v{new} = {new_base[:12]} "
        f"({time.monotonic() - t0:.0f}s)"
    )
    return Scratch(repo, old, new, commits, list(series.manifest.patches))


def conflicted_files(repo: Path) -> list[tuple[str, str]]:
    """(path, git status code) of the unmerged paths."""
    out = git_out(repo, "status", "--porcelain=v1", "-z", "--untracked-files=no")
    rows = []
    for entry in out.split("\0"):
        code, path = entry[:2], entry[3:]
        if code in ("DD", "AU", "UD", "UA", "DU", "AA", "UU"):
            rows.append((path, code))
    return rows


def cherry_pick(repo: Path, commit: str) -> tuple[bool, bool]:
    """(applied, empty): cherry-pick ``commit`` onto HEAD."""
    # A patch upstream has taken becomes an empty commit (kept, reported).
    proc = git(repo, "cherry-pick", "--keep-redundant-commits", commit,
               identity=BUILD_IDENTITY, check=False)  # fmt: skip
    if proc.returncode == 0:
        empty = not git_out(repo, "diff-tree", "--name-only", "-r", "HEAD^", "HEAD")
        return True, empty
    if conflicted_files(repo):
        return False, False
    text = proc.stdout + proc.stderr
    raise ForkError(f"git cherry-pick {commit[:12]} failed: {text.strip()[-300:]}")


# --------------------------------------------------------------------------
# the conflict report


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


def report_conflict(s: Scratch, index: int, done: int) -> list[str]:
    repo, lines = s.repo, []
    patch = s.patches[index - 1]
    files = conflicted_files(repo)
    applied = f"{done} before it applied" if done else "the first patch"
    lines.append(
        f"CONFLICT: patch {patch_id(index, patch)} does not apply on "
        f"{s.new_tag} ({applied}); conflicted files:"
    )
    for path, code in files:
        lines.append(f"  {path}  [{code}]")
    for path, code in files:
        lines.append("")
        lines.append(f"{path}:")
        if not exists_at(repo, s.old_tag, path):
            lines.append(f"  not in {s.old_tag}: added by {s.new_tag} and the patch")
        elif not exists_at(repo, s.new_tag, path):
            lines.append(f"  deleted (or moved) by {s.new_tag}; the patch changes it")
        worktree = repo / path
        if code not in ("UU", "AA") or not worktree.is_file():
            continue
        release = git(repo, "show", f"HEAD:{path}").stdout.splitlines()
        resolved, raw = parse_conflicts(
            worktree.read_text(encoding="utf-8", errors="replace")
        )
        regions = to_release_lines(release, resolved, raw)
        hunks = release_hunks(repo, s.old_tag, s.new_tag, path)
        for r in regions:
            lines.append(
                f"  conflict at lines {r.file_lines[0]}-{r.file_lines[1]} of the "
                f"file; {s.new_tag} side = lines {r.ours[0]}-{r.ours[1]}"
            )
        overlap = [
            h for h in hunks
            if any(h.new[0] <= r.ours[1] and r.ours[0] <= h.new[1] for r in regions)
        ]  # fmt: skip
        lines.append(
            f"  {s.old_tag}..{s.new_tag} changes this file in {len(hunks)} "
            f"hunk(s); {len(overlap)} overlap the conflict(s):"
        )
        for h in overlap[:MAX_HUNKS]:
            lines.append(f"    {h.header}")
            for c in h.changed[:HUNK_LINES]:
                lines.append(f"      {c[:100]}")
            if len(h.changed) > HUNK_LINES:
                lines.append(
                    f"      ... {len(h.changed) - HUNK_LINES} more changed line(s)"
                )
        if len(overlap) > MAX_HUNKS:
            lines.append(f"    ... {len(overlap) - MAX_HUNKS} more overlapping hunk(s)")
        if regions and not overlap:
            lines.append(
                "    (none: the conflict is with a release change next to it; "
                f"`git diff {s.old_tag} {s.new_tag} -- {path}`)"
            )
    return lines


# --------------------------------------------------------------------------
# hook points to re-check


def _pins(repo: Path, tag: str, name: str) -> dict[str, set[str]]:
    """The requirement lines for ``name`` in ``tag``'s requirements/, by file."""
    proc = git(repo, "grep", "-i", "-E", rf"^{re.escape(name)}\s*[=<>~!]",
               tag, "--", "requirements/", check=False)  # fmt: skip
    pins: dict[str, set[str]] = {}
    for line in proc.stdout.splitlines():
        _, path, spec = line.split(":", 2)
        spec = re.sub(r"\s+", "", spec.split("#")[0].split(";")[0].rstrip("\\ "))
        pins.setdefault(path, set()).add(spec)
    return pins


def pin_changes(repo: Path, old: str, new: str, name: str) -> list[str]:
    """How the release's pins of ``name`` moved, one line per changed file."""
    before, after = _pins(repo, old, name), _pins(repo, new, name)
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
        return [f"    {_rel(folder)}: no *.diff"]
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(git_env(), GIT_INDEX_FILE=str(Path(tmp) / "index"))
        subprocess.run(["git", "read-tree", tag], cwd=repo, env=env, check=True)
        for patch in patches:
            proc = subprocess.run(
                ["git", "apply", "--cached", "--whitespace=nowarn", str(patch)],
                cwd=repo, env=env, capture_output=True, text=True,
            )  # fmt: skip
            what = "applies" if proc.returncode == 0 else (
                "DOES NOT APPLY: "
                + ((proc.stderr.strip().splitlines() or ["?"])[-1])
            )  # fmt: skip
            out.append(f"    {_rel(patch)}: {what} on {tag}")
    return out


def recheck(s: Scratch) -> list[str]:
    lines = ["", "re-check by hand (series/release.toml hook points):"]
    exceptions = RELEASE.get("exceptions", {})
    names = [k for k in exceptions if not k.endswith("_reason")]
    if not names:
        lines.append("  [exceptions]: none")
    for name in names:
        lines.append(f"  [exceptions] {name} = {exceptions[name]!r}")
        reason = exceptions.get(f"{name}_reason")
        if reason:
            lines.append(f"    reason: {reason}")
        lines.append(f"    {s.old_tag}..{s.new_tag} pins of {name}:")
        lines += pin_changes(s.repo, s.old_tag, s.new_tag, name)
    folder = ROOT / RELEASE.get("cpu_patches", "tools/cpu_ext")
    lines.append(f"  cpu_patches = {_rel(folder)}:")
    lines += cpu_patch_checks(s.repo, s.new_tag, folder)
    lines.append(
        "  also: CPU_GATE in tools/test_site/sitecustomize.py, stock counts in "
        "forktools/testrun/suites.py, tools/mypy_baseline.txt "
        "(project-docs/releases.md)"
    )
    return lines


# --------------------------------------------------------------------------
# write back


def write_back(s: Scratch, series: Series, new_sha: str, new_base: str) -> list[str]:
    """Write the rebased series and the new release.toml into the repository."""
    repo, msgs = s.repo, []
    commits = git_out(repo, "rev-list", "--reverse", f"{s.new_tag}..HEAD").split()
    old_files = {f for p in s.patches for f in p.files}
    old_diffs = {p.diff for p in s.patches if p.diff}
    new_patches: list[Patch] = []
    for index, (commit, old) in enumerate(zip(commits, s.patches, strict=True), 1):
        subject, body = commit_text(repo, commit)
        added, other = changed_paths(repo, commit)
        for path in added:  # as fork.py save: the final version at the root
            final, dest = final_blob(repo, path), ROOT / path
            if final is None:
                dest.unlink(missing_ok=True)
                continue
            data, mode = final
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(data)
            dest.chmod(mode)
        diff_rel = None
        if other:
            numstat = git_out(repo, "diff", "--numstat", f"{commit}^", commit,
                              "--", *other)  # fmt: skip
            binary = any(ln.startswith("-\t-\t") for ln in numstat.splitlines())
            text = git(
                repo, "diff", "--no-renames", "--no-color",
                *(["--binary"] if binary else []), f"{commit}^", commit, "--", *other,
            ).stdout  # fmt: skip
            diff_rel = f"series/diffs/{index:04d}-{old.name}.diff"
            (ROOT / diff_rel).write_text(text, encoding="utf-8")
        files = [f for f in old.files if f in added]
        files += sorted(set(added) - set(files))
        new_patches.append(Patch(old.name, subject, body, files, diff_rel, old.stack))
    parked = series.manifest.parked
    keep = {f for p in parked for f in p.files} | {p.diff for p in parked if p.diff}
    new_files = {f for p in new_patches for f in p.files}
    new_diffs = {p.diff for p in new_patches if p.diff}
    for stale in sorted((old_files - new_files) | (old_diffs - new_diffs) - keep):
        if stale and (ROOT / stale).is_file():
            (ROOT / stale).unlink()
            msgs.append(f"removed {stale}")
    for p in parked:  # REV's parked patches, carried over untouched
        for rel in [*p.files, *([p.diff] if p.diff else [])]:
            (ROOT / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(series.root / rel, ROOT / rel)
    manifest_path = ROOT / "series" / "manifest.toml"
    new_manifest = Manifest(new_patches, parked)
    with manifest_at(manifest_path, ROOT, s.new):
        manifest_path.write_text(dump_manifest(new_manifest), encoding="utf-8")
        if load_manifest() != new_manifest:
            raise ForkError("internal error: series/manifest.toml does not round-trip")
    msgs.append(
        f"wrote series/manifest.toml ({len(new_patches)} patch(es), "
        f"{len(parked)} parked), series/diffs/ and the new files"
    )
    RELEASE_FILE.write_text(
        release_toml(RELEASE_FILE, s, new_sha, new_base, series.rev), encoding="utf-8"
    )
    msgs.append(f"wrote {_rel(RELEASE_FILE)}: {s.new_tag}, [previous] {s.old_tag}")
    return msgs


def _set_key(text: str, key: str, value: str) -> str:
    line = f"{key} = {json.dumps(value)}"
    pat = re.compile(rf"^{key} *=.*$", re.M)
    head, sep, tail = text.partition("\n[")
    if pat.search(head):
        head = pat.sub(lambda _: line, head, count=1)
    else:
        head = head.rstrip("\n") + "\n" + line + "\n"
    return head + sep + tail


def release_toml(path: Path, s: Scratch, sha: str, base: str, rev: str) -> str:
    """release.toml on the new release, the old one as [previous]."""
    text = path.read_text(encoding="utf-8") if path.is_file() else (
        'cpu_patches = "tools/cpu_ext"\n\n[exceptions]\n'
    )  # fmt: skip
    text = re.sub(r"\n\[previous\]\n(?:(?!\[)[^\n]*\n?)*", "\n", text).rstrip("\n")
    text += "\n"
    for key, value in (("version", s.new), ("sha256", sha), ("base_commit", base)):
        text = _set_key(text, key, value)
    previous = (
        f"\n[previous]\nversion = {json.dumps(s.old.version)}\n"
        f"sha256 = {json.dumps(s.old.sha256 or '')}\n"
        f"series_commit = {json.dumps(rev)}\n"
    )
    return text + previous


def dirty_paths(paths: list[str]) -> list[str]:
    out = git_out(ROOT, "status", "--porcelain", "--", *paths)
    return [ln[3:] for ln in out.splitlines()]


# --------------------------------------------------------------------------
# take


def prepare_work(work: Path, key: dict, resume: bool) -> str:
    """'fresh' (an empty work dir), 'reuse' (the scratch of the same take,
    reset to the new release) or 'resume' (a stopped rebase, as it is)."""
    path = work / STATE_FILE
    state = json.loads(path.read_text()) if path.is_file() else None
    same = state is not None and all(state.get(k) == v for k, v in key.items())
    if resume:
        if state is None:
            raise ForkError(f"--resume: no release in progress in {_rel(work)}")
        if not same:
            raise ForkError(
                f"--resume: {_rel(work)} takes {state['new']} from "
                f"{state['rev'][:12]}; rerun with that version, --sha256 and --from"
            )
        return "resume"
    if state is not None and state.get("stopped"):
        raise ForkError(
            f"{_rel(work)} holds a stopped rebase: resolve it and rerun with "
            "--resume, or delete the directory to start over"
        )
    if same and (work / "vllm" / ".git").is_dir():
        repo = work / "vllm"
        git(repo, "cherry-pick", "--abort", check=False)
        git(repo, "checkout", "-q", "-f", "-B", "main", f"v{key['new']}")
        git(repo, "clean", "-q", "-ffd")
        return "reuse"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    return "fresh"


def cmd_take(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    new = args.version
    if not VERSION_RE.match(new):
        raise ForkError(f"{new!r} is not a vLLM version (like 0.34.0)")
    pinned = args.sha256.lower()
    if not re.fullmatch(r"[0-9a-f]{64}", pinned):
        raise ForkError(f"--sha256 {args.sha256!r}: not a sha256 (64 hex digits)")
    default = WORK_DIR / (f"{new}-each" if args.each else new)
    work = Path(args.work).resolve() if args.work else default
    rev = resolve_rev(args.rev)
    old = base_at(rev)
    if old.version == new:
        raise ForkError(f"the series at {rev[:12]} is already on vLLM {new}")
    key = {"rev": rev, "old": old.version, "new": new, "sha256": pinned}
    mode = prepare_work(work, key, args.resume)
    if mode == "fresh":
        series = read_series(rev, work / "series-src")
    else:
        src = work / "series-src"
        with manifest_at(src / "series" / "manifest.toml", src, old.version):
            series = Series(rev, old, load_manifest(), src)
    say(
        f"take: vLLM {old.version} -> {new}: the series of {rev[:12]} "
        f"({len(series.manifest.patches)} patch(es), "
        f"{len(series.manifest.parked)} parked)"
    )
    new_sdist = fetch_release(new, pinned)
    old_sdist = fetch_sdist(old.version, old.sha256)
    if old.sha256 is None:
        say(f"note: no sha256 recorded for {old.version}; {old_sdist.name} unchecked")
    if mode == "fresh":
        s = build_scratch(work, series, old_sdist, new, new_sdist)
        save_state(work, key, stopped=False)
    else:
        repo = work / "vllm"
        commits = git_out(
            repo, "rev-list", "--reverse", f"v{old.version}..series-{old.version}"
        ).split()
        s = Scratch(repo, old, new, commits, list(series.manifest.patches))
        say(f"scratch: {_rel(repo)}: {mode}d ({len(commits)} patch(es))")
    for p in series.manifest.parked:
        say(f"parked at {rev[:12]}, not rebased: {p.name} ({p.parked})")
    rc = take_each(s) if args.each else take_all(s, series, key, args.dry_run)
    for line in recheck(s):
        say(line)
    say(f"take: {time.monotonic() - t0:.0f}s")
    return rc


def save_state(work: Path, key: dict, stopped: bool) -> None:
    state = dict(key, stopped=stopped)
    (work / STATE_FILE).write_text(json.dumps(state) + "\n")


def take_each(s: Scratch) -> int:
    say(f"each patch alone on {s.new_tag}:")
    applies = 0
    for index, (commit, patch) in enumerate(zip(s.commits, s.patches, strict=True), 1):
        git(s.repo, "checkout", "-q", "-f", "-B", "each", s.new_tag)
        ok, empty = cherry_pick(s.repo, commit)
        if ok:
            applies += 1
            what = "applies (empty: upstream has it)" if empty else "applies"
        else:
            files = ", ".join(p for p, _ in conflicted_files(s.repo))
            what = f"conflicts ({files})"
            git(s.repo, "cherry-pick", "--abort", check=False)
        say(f"  {patch_id(index, patch)}: {what}")
    git(s.repo, "checkout", "-q", "-f", "main")
    say(f"each: {applies} of {len(s.patches)} patch(es) apply alone on {s.new_tag}")
    return 0


def take_all(s: Scratch, series: Series, key: dict, dry_run: bool) -> int:
    repo, work = s.repo, s.repo.parent
    if (repo / ".git" / "CHERRY_PICK_HEAD").exists():
        raise ForkError(
            f"{_rel(repo)}: a cherry-pick is in progress; finish it "
            "(git add, git cherry-pick --continue) and rerun with --resume"
        )
    done = len(git_out(repo, "rev-list", f"{s.new_tag}..HEAD").split())
    if done:
        say(f"resume: {done} patch(es) already on {s.new_tag}")
    for index in range(done + 1, len(s.commits) + 1):
        patch = s.patches[index - 1]
        ok, empty = cherry_pick(repo, s.commits[index - 1])
        if not ok:
            save_state(work, key, stopped=True)
            for line in report_conflict(s, index, index - 1):
                say(line)
            say("")
            say(
                f"stopped at {patch_id(index, patch)}: resolve in {_rel(repo)} "
                "(edit, git add, git cherry-pick --continue), then rerun this "
                "command with --resume"
            )
            return 1
        note = " (empty: upstream has it; drop it from the manifest?)" if empty else ""
        say(f"  {patch_id(index, patch)}: applies{note}")
    save_state(work, key, stopped=False)
    new_base = git_out(repo, "rev-parse", f"{s.new_tag}^{{commit}}")
    say(f"all {len(s.commits)} patch(es) apply on {s.new_tag} (base {new_base[:12]})")
    if dry_run:
        say("--dry-run: the repository is not written")
        return 0
    touched = ["series", *{f for p in s.patches for f in p.files}]
    dirty = dirty_paths(touched)
    if dirty:
        raise ForkError(
            f"uncommitted changes in {dirty[:3]}{'...' if len(dirty) > 3 else ''}; "
            f"commit or stash them, then rerun with --resume ({_rel(repo)} is kept)"
        )
    for msg in write_back(s, series, key["sha256"], new_base):
        say(f"write: {msg}")
    # The scratch repository holds both releases, so git abbreviates blob
    # ids in the diffs' index lines differently from build/vllm: rebuild
    # build/vllm on the new release (a fresh process reads the new
    # release.toml) and let `fork.py save` write the diffs as it keeps them.
    for step in (["build", "--force"], ["save"]):
        cmd = [sys.executable, "-m", "forktools.fork", *step]
        if subprocess.run(cmd, cwd=ROOT, check=False).returncode != 0:
            raise ForkError(f"`fork.py {' '.join(step)}` failed after the write")
    say(f"build/vllm is {s.new_tag} + the series; next: bash tools/test.sh")
    return 0


# --------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="release.py", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("take", help="rebase the series onto a new vLLM release")
    p.add_argument("version", help="the new release, like 0.34.0")
    p.add_argument("--sha256", required=True, help="the new sdist's sha256 (pinned)")
    p.add_argument("--from", dest="rev", default="HEAD",
                   help="project commit holding the series to take (HEAD)")  # fmt: skip
    p.add_argument("--each", action="store_true",
                   help="cherry-pick each patch alone onto the release")  # fmt: skip
    p.add_argument("--work", help="scratch directory (build/release/<version>)")
    p.add_argument("--dry-run", action="store_true",
                   help="never write the repository")  # fmt: skip
    p.add_argument("--resume", action="store_true",
                   help="continue a stopped rebase after resolving it")  # fmt: skip
    args = parser.parse_args(argv)
    if args.each and args.resume:
        parser.error("--each takes every patch alone: nothing to resume")
    try:
        return cmd_take(args)
    except ForkError as exc:
        print(f"release.py {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
