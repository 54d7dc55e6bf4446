# SPDX-License-Identifier: Apache-2.0
"""Take a new vLLM release: rebase the patch series onto it.

    python3 -m forktools.release take NEW_VERSION --sha256 HASH [--from REV]
                             [--each] [--work DIR] [--dry-run] [--resume]

project-docs/releases.md says what it does and how a release is taken.
Stdlib only.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from forktools import paths
from forktools.build_tree import (
    added_versions,
    apply_patch,
    fetch_sdist,
    make_base,
    patch_id,
    sha256_of,
)
from forktools.git_ops import BUILD_IDENTITY, git, git_env, git_out, rel
from forktools.manifest import (
    MANIFEST_REL,
    RELEASE,
    RELEASE_FILE,
    ForkError,
    Manifest,
    Patch,
    dump_manifest,
    load_manifest,
)
from forktools.release_report import conflicted_files, recheck, report_conflict
from forktools.save_series import RepoWriter, remove_stale, saved_patch

WORK_DIR = paths.BUILD / "release"
PYPI_JSON = "https://pypi.org/pypi/vllm/{version}/json"
PYPI_PROJECT_JSON = "https://pypi.org/pypi/vllm/json"
PYPI_TIMEOUT = 5.0
VERSION_RE = re.compile(r"^\d+\.\d+\.\d+(?:[.\-+]?[a-z0-9]+)*$")
STATE_FILE = "release-state.json"


def say(msg: str = "") -> None:
    print(msg, flush=True)


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
    proc = git(
        paths.ROOT, "rev-parse", "-q", "--verify", f"{rev}^{{commit}}", check=False
    )
    if proc.returncode != 0 or not proc.stdout.strip():
        raise ForkError(f"--from {rev}: not a commit of this repository")
    return proc.stdout.strip()


def show(rev: str, path: str) -> str | None:
    """The text of ``path`` at project commit ``rev``, None if absent."""
    proc = git(paths.ROOT, "show", f"{rev}:{path}", check=False)
    return proc.stdout if proc.returncode == 0 else None


def constant(text: str | None, name: str) -> str | None:
    m = re.search(rf'^{name}(?:: *str)? *= *"([^"]+)"', text or "", re.M)
    return m.group(1) if m else None


def base_at(rev: str) -> Base:
    """The release of the series at ``rev`` (release.toml, else constants)."""
    text = show(rev, "series/release.toml")
    if text is not None:
        data = tomllib.loads(text)
        return Base(data["version"], data.get("sha256"), data.get("base_commit"))
    version = constant(show(rev, "tools/manifest.py"), "VLLM_VERSION")
    fork_py = show(rev, "tools/fork.py")
    if version is None:
        raise ForkError(
            f"{rev[:12]} has neither series/release.toml nor a VLLM_VERSION "
            "constant in tools/manifest.py: which release is its series on?"
        )
    return Base(
        version, constant(fork_py, "SDIST_SHA256"), constant(fork_py, "BASE_COMMIT")
    )


def read_series(rev: str, dest: Path) -> Series:
    """Extract the series of project commit ``rev`` into ``dest``."""
    base = base_at(rev)
    text = show(rev, MANIFEST_REL)
    if text is None:
        raise ForkError(f"{rev[:12]} has no {MANIFEST_REL}")
    (dest / "series").mkdir(parents=True)
    (dest / MANIFEST_REL).write_text(text, encoding="utf-8")
    manifest = load_manifest(path=dest / MANIFEST_REL)
    wanted = {MANIFEST_REL}
    for p in manifest.patches:
        wanted.update([*p.files, *([p.diff] if p.diff else [])])
    # A file the manifest names but ``rev`` lacks fails the archive.
    proc = subprocess.run(
        ["git", "archive", "--format=tar", rev, "--", *sorted(wanted)],
        cwd=paths.ROOT, capture_output=True, env=git_env(),
    )  # fmt: skip
    if proc.returncode != 0:
        raise ForkError(f"git archive {rev[:12]} failed: {proc.stderr.decode()[-200:]}")
    with tarfile.open(fileobj=io.BytesIO(proc.stdout)) as tf:
        tf.extractall(dest, filter="data")
    return Series(rev, base, manifest, dest)


def get_json(url: str) -> dict:
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
        files, source = get_json(url).get("urls", []), url
    except (OSError, ValueError) as exc:
        try:
            releases = get_json(PYPI_PROJECT_JSON).get("releases", {})
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
    say(f"sdist: {rel(path)}")
    say(f"  sha256 {got} (file)")
    say(f"  sha256 {pinned} (--sha256, pinned)")
    if index_sha:
        note = "" if index_sha == got else "  <- DIFFERS from the file"
        say(f"  sha256 {index_sha} ({source}){note}")
    else:
        say(f"  {source}: cannot show the package index's sha256")
    if got != pinned:
        raise ForkError(
            f"sdist sha256 mismatch: {rel(path)} is {got}, --sha256 pins "
            f"{pinned}; check the hash on https://pypi.org/project/vllm/{version}/"
            f"#files (a bad download: delete {rel(path)} and rerun)"
        )
    return path


def first_versions(root: Path, patches: list[Patch], work: Path) -> list[Path]:
    """``added_versions``; a series saved before the root kept each new file's
    final version (e.g. the 0.33.0 state) keeps the versions it adds."""
    try:
        return added_versions(root, patches, work)
    except ForkError as exc:
        say(f"series: root copies taken as the versions patches add ({exc})")
        return [root] * len(patches)


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


def build_old(repo: Path, series: Series, sdist: Path) -> None:
    """The old release + the series on branch series-<old>, as ``build``."""
    old = series.base
    make_base(repo, sdist, old.version, old.base_commit)
    patches = series.manifest.patches
    with tempfile.TemporaryDirectory(prefix="release-files-") as tmp:
        files = first_versions(series.root, patches, Path(tmp))
        for index, patch in enumerate(patches, start=1):
            try:
                apply_patch(repo, index, patch, files[index - 1], series.root)
            except ForkError as exc:
                raise ForkError(
                    f"the series of {series.rev[:12]} does not build on its own "
                    f"release v{old.version}: {exc}"
                ) from None
    git(repo, "branch", "-q", f"series-{old.version}")


def series_on_old(repo: Path, old: Base) -> list[str]:
    tags = f"v{old.version}..series-{old.version}"
    return git_out(repo, "rev-list", "--reverse", tags).split()


def build_scratch(work: Path, series: Series, old_sdist: Path, new: str,
                  new_sdist: Path) -> Scratch:  # fmt: skip
    """Old release + series (branch series-<old>) and the new release."""
    old, old_repo, repo = series.base, work / "old", work / "vllm"
    t0 = time.monotonic()
    build_old(old_repo, series, old_sdist)
    expect = RELEASE.get("base_commit") if RELEASE.get("version") == new else None
    new_base = make_base(repo, new_sdist, new, expect)
    # Whoever resolves a conflict there runs plain git: no background repack.
    git(repo, "config", "gc.auto", "0")
    # Borrow the old release's objects: the fetch below copies nothing.
    alternates = repo / ".git" / "objects" / "info" / "alternates"
    alternates.write_text(str((old_repo / ".git" / "objects").resolve()) + "\n")
    git(repo, "fetch", "-q", "--no-tags", str(old_repo.resolve()),
        f"refs/tags/v{old.version}:refs/tags/v{old.version}",
        f"refs/heads/series-{old.version}:refs/heads/series-{old.version}")  # fmt: skip
    commits = series_on_old(repo, old)
    say(
        f"scratch: {rel(repo)}: v{old.version} + {len(commits)} patch(es) "
        f"(branch series-{old.version}), v{new} = {new_base[:12]} "
        f"({time.monotonic() - t0:.0f}s)"
    )
    return Scratch(repo, old, new, commits, list(series.manifest.patches))


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


def write_back(s: Scratch, rev: str, new_sha: str, new_base: str) -> list[str]:
    """Write the rebased series and the new release.toml into the repository."""
    out = RepoWriter(check=False)
    commits = git_out(s.repo, "rev-list", "--reverse", f"{s.new_tag}..HEAD").split()
    patches = [
        saved_patch(s.repo, index, commit, old, out)[0]
        for index, (commit, old) in enumerate(zip(commits, s.patches, strict=True), 1)
    ]
    msgs = [f"removed {path}" for path in remove_stale(s.patches, patches, out)]
    new_manifest = Manifest(patches)
    manifest_path = paths.ROOT / MANIFEST_REL
    manifest_path.write_text(dump_manifest(new_manifest, s.new), encoding="utf-8")
    if load_manifest(path=manifest_path) != new_manifest:
        raise ForkError(f"internal error: {MANIFEST_REL} does not round-trip")
    msgs.append(
        f"wrote {MANIFEST_REL} ({len(patches)} patch(es)), "
        "series/diffs/ and the new files"
    )
    RELEASE_FILE.write_text(release_toml(s, new_sha, new_base, rev), encoding="utf-8")
    msgs.append(f"wrote {rel(RELEASE_FILE)}: {s.new_tag}, [previous] {s.old_tag}")
    return msgs


def release_toml(s: Scratch, sha: str, base: str, rev: str) -> str:
    """release.toml on the new release, the old one as [previous]."""
    text = RELEASE_FILE.read_text(encoding="utf-8")
    text = re.sub(r"\n\[previous\]\n(?:(?!\[)[^\n]*\n?)*", "\n", text).rstrip("\n")
    for key, value in (("version", s.new), ("sha256", sha), ("base_commit", base)):
        line = f"{key} = {json.dumps(value)}"
        text = re.sub(
            rf"^{key} *=.*$", lambda _, ln=line: ln, text, count=1, flags=re.M
        )
    return text + (
        f"\n\n[previous]\nversion = {json.dumps(s.old.version)}\n"
        f"sha256 = {json.dumps(s.old.sha256 or '')}\n"
        f"series_commit = {json.dumps(rev)}\n"
    )


def prepare_work(work: Path, key: dict, resume: bool) -> str:
    """'fresh' (an empty work dir), 'reuse' (the scratch of the same take,
    reset to the new release) or 'resume' (a stopped rebase, as it is)."""
    path = work / STATE_FILE
    state = json.loads(path.read_text()) if path.is_file() else None
    same = state is not None and all(state.get(k) == v for k, v in key.items())
    if resume:
        if state is None:
            raise ForkError(f"--resume: no release in progress in {rel(work)}")
        if not same:
            raise ForkError(
                f"--resume: {rel(work)} takes {state['new']} from "
                f"{state['rev'][:12]}; rerun with that version, --sha256 and --from"
            )
        return "resume"
    if state is not None and state.get("stopped"):
        raise ForkError(
            f"{rel(work)} holds a stopped rebase: resolve it and rerun with "
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


def save_state(work: Path, key: dict, stopped: bool) -> None:
    (work / STATE_FILE).write_text(json.dumps(dict(key, stopped=stopped)) + "\n")


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
    src = work / "series-src"
    if mode == "fresh":
        series = read_series(rev, src)
    else:
        series = Series(rev, old, load_manifest(path=src / MANIFEST_REL), src)
    say(
        f"take: vLLM {old.version} -> {new}: the series of {rev[:12]} "
        f"({len(series.manifest.patches)} patch(es))"
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
        commits = series_on_old(repo, old)
        s = Scratch(repo, old, new, commits, list(series.manifest.patches))
        say(f"scratch: {rel(repo)}: {mode}d ({len(commits)} patch(es))")
    rc = take_each(s) if args.each else take_all(s, key, args.dry_run)
    for line in recheck(s.repo, s.old_tag, s.new_tag):
        say(line)
    say(f"take: {time.monotonic() - t0:.0f}s")
    return rc


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
            what = f"conflicts ({', '.join(p for p, _ in conflicted_files(s.repo))})"
            git(s.repo, "cherry-pick", "--abort", check=False)
        say(f"  {patch_id(index, patch)}: {what}")
    git(s.repo, "checkout", "-q", "-f", "main")
    say(f"each: {applies} of {len(s.patches)} patch(es) apply alone on {s.new_tag}")
    return 0


def take_all(s: Scratch, key: dict, dry_run: bool) -> int:
    repo, work = s.repo, s.repo.parent
    if (repo / ".git" / "CHERRY_PICK_HEAD").exists():
        raise ForkError(
            f"{rel(repo)}: a cherry-pick is in progress; finish it "
            "(git add, git cherry-pick --continue) and rerun with --resume"
        )
    done = len(git_out(repo, "rev-list", f"{s.new_tag}..HEAD").split())
    if done:
        say(f"resume: {done} patch(es) already on {s.new_tag}")
    for index in range(done + 1, len(s.commits) + 1):
        pid = patch_id(index, s.patches[index - 1])
        ok, empty = cherry_pick(repo, s.commits[index - 1])
        if not ok:
            save_state(work, key, stopped=True)
            for line in report_conflict(repo, s.old_tag, s.new_tag, pid, index - 1):
                say(line)
            say("")
            say(
                f"stopped at {pid}: resolve in {rel(repo)} (edit, git add, git "
                "cherry-pick --continue), then rerun this command with --resume"
            )
            return 1
        note = " (empty: upstream has it; drop it from the manifest?)" if empty else ""
        say(f"  {pid}: applies{note}")
    save_state(work, key, stopped=False)
    new_base = git_out(repo, "rev-parse", f"{s.new_tag}^{{commit}}")
    say(f"all {len(s.commits)} patch(es) apply on {s.new_tag} (base {new_base[:12]})")
    if dry_run:
        say("--dry-run: the repository is not written")
        return 0
    touched = ["series", *{f for p in s.patches for f in p.files}]
    status = git_out(paths.ROOT, "status", "--porcelain", "--", *touched)
    dirty = [ln[3:] for ln in status.splitlines()]
    if dirty:
        raise ForkError(
            f"uncommitted changes in {dirty[:3]}{'...' if len(dirty) > 3 else ''}; "
            f"commit or stash them, then rerun with --resume ({rel(repo)} is kept)"
        )
    for msg in write_back(s, key["rev"], key["sha256"], new_base):
        say(f"write: {msg}")
    # The scratch repository holds both releases, so git abbreviates blob
    # ids in the diffs' index lines differently from build/vllm: rebuild
    # build/vllm on the new release (a fresh process reads the new
    # release.toml) and let `fork.py save` write the diffs as it keeps them.
    for step in (["build", "--force"], ["save"]):
        cmd = [sys.executable, "-m", "forktools.fork", *step]
        if subprocess.run(cmd, cwd=paths.ROOT, check=False).returncode != 0:
            raise ForkError(f"`fork.py {' '.join(step)}` failed after the write")
    say(f"build/vllm is {s.new_tag} + the series; next: bash tools/test.sh")
    return 0


def main(argv: list[str] | None = None) -> int:
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
