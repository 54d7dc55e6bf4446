# SPDX-License-Identifier: Apache-2.0
"""Build, save and export the vLLM NIXL patch series.

The repository holds only what the series adds on top of the vLLM release
sdist: new files at their upstream paths and one diff per patch against
upstream files, described in order by ``series/manifest.toml``. This tool
turns that into a git tree of the patched release (``build/vllm``) and back.

Subcommands:
    fetch       download the release sdist into build/cache and verify it
    build       recreate build/vllm: pristine release + one commit per patch
    export      git format-patch the series (default build/series-export)
    roundtrip   export, git am onto a fresh pristine tree, compare trees
    save        write the commits above the release tag back into the repo
    summary     print the series
    check-root  fail where a new file's root copy is not build/vllm HEAD's

Each new file is kept at the root as the whole series leaves it; ``build``
derives the version a patch adds by reverse-applying later patches' diffs.

Stdlib only; run it with any Python >= 3.11.
"""

from __future__ import annotations

import argparse
import email.utils as email_utils
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from forktools.manifest import (
    BASE_TAG,
    EXPORTED_STACKS,
    KINDS,
    MANIFEST,
    RELEASE,
    STACKS,
    VLLM_VERSION,
    ForkError,
    Manifest,
    Patch,
    _check_relpath,
    dump_manifest,
    load_manifest,
    patch_lines,
)
from forktools.paths import CACHE_DIR, ROOT, STACK1_TREE, TREE

SDIST_NAME = f"vllm-{VLLM_VERSION}.tar.gz"
SDIST_SHA256: str = RELEASE["sha256"]
# Commit id of the pristine base that `build` creates from the sdist. It only
# depends on the sdist content and the fixed identity/date below, so it is the
# same on every machine; a different value means the extracted tree differs.
BASE_COMMIT: str = RELEASE["base_commit"]
BASE_IDENTITY = ("vLLM release sdist", "noreply@vllm.invalid")
FIXED_DATE = "2026-01-01T00:00:00+00:00"
# Author of the series commits in the local build/vllm tree: fixed, so builds
# are reproducible, and never exported as anyone's sign-off. `export` authors
# and signs off every patch as `git config user.name/user.email`.
BUILD_IDENTITY = ("vLLM NIXL series (local build)", "build@localhost.invalid")
# The series was written with an AI assistant; upstream's contributing guide
# asks for a trailer on every such commit (and a note in the PR description,
# which the cover letters carry).
AI_TRAILER = "Assisted-by: Claude"

DIFF_DIR = ROOT / "series" / "diffs"
EXPORT_DIR = ROOT / "build" / "series-export"
# The layout stack's RFC: a file of its first patch, also exported as the
# text of an RFC issue.
RFC_DOC = "docs/design/nixl_kv_layout.md"
# Marker in build/vllm/.git naming the last HEAD that is known to be saved in
# the repository (written by `build` and `save`); `build` refuses to discard
# any other HEAD unless --force.
SAVED_HEAD_MARKER = "fork-saved-head"


def patch_id(index: int, patch: Patch) -> str:
    """'NNNN name' as used in messages (index is 1-based)."""
    return f"{index:04d} {patch.name}"


# --------------------------------------------------------------------------
# git helpers


def git_env(identity: tuple[str, str] | None = None) -> dict[str, str]:
    """Environment for reproducible git commands independent of user config."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("GIT_") or k in ("GIT_SSH", "GIT_SSL_CAINFO")
    }
    env["GIT_CONFIG_NOSYSTEM"] = "1"
    env["GIT_CONFIG_GLOBAL"] = os.devnull
    env["GIT_TERMINAL_PROMPT"] = "0"
    name, email = identity or BASE_IDENTITY
    for role in ("AUTHOR", "COMMITTER"):
        env[f"GIT_{role}_NAME"] = name
        env[f"GIT_{role}_EMAIL"] = email
        env[f"GIT_{role}_DATE"] = FIXED_DATE
    return env


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


def git(
    cwd: Path,
    *args: str,
    identity: tuple[str, str] | None = None,
    check: bool = True,
    stdin: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run git in cwd; raise ForkError with git's last stderr line on failure."""
    proc = subprocess.run(
        ["git", *GIT_OPTS, *args],
        cwd=cwd,
        env=git_env(identity),
        input=stdin,
        capture_output=True,
        text=True,
    )
    if check and proc.returncode != 0:
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        last = lines[-1] if lines else f"exit status {proc.returncode}"
        raise ForkError(f"git {args[0]} failed in {cwd}: {last}")
    return proc


def git_out(cwd: Path, *args: str) -> str:
    return git(cwd, *args).stdout.strip()


def user_identity() -> tuple[str, str] | None:
    """``git config user.name/user.email`` of whoever runs this, if both set."""
    values = []
    for key in ("user.name", "user.email"):
        proc = subprocess.run(
            ["git", "config", key], cwd=ROOT, capture_output=True, text=True
        )
        values.append(proc.stdout.strip() if proc.returncode == 0 else "")
    name, email = values
    return (name, email) if name and email else None


def require_user_identity() -> tuple[str, str]:
    identity = user_identity()
    if identity is None:
        raise ForkError(
            "set git config user.name and user.email; exported patches "
            "are authored and signed off (DCO) by whoever exports them"
        )
    return identity


# --------------------------------------------------------------------------
# fetch


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _rel(path: Path) -> str:
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def verify_sdist(path: Path, sha256: str = SDIST_SHA256) -> None:
    got = sha256_of(path)
    if got != sha256:
        raise ForkError(
            f"sdist sha256 mismatch: got {got}, expected {sha256}; "
            f"delete {_rel(path)} and retry"
        )


def env_python() -> Path:
    """Python of the project venv (needed by `pip download`, see fetch)."""
    if os.environ.get("FORK_PYTHON"):
        return Path(os.environ["FORK_PYTHON"])
    env_dir = Path(os.environ.get("ENV_DIR", ".venv"))
    if not env_dir.is_absolute():
        env_dir = ROOT / env_dir
    return env_dir / "bin" / "python"


def fetch_sdist(version: str = VLLM_VERSION, sha256: str | None = SDIST_SHA256) -> Path:
    """Return the verified sdist path, downloading it first if needed.

    The sdist's metadata build needs torch==2.14 in an isolated build env
    (GBs). Building metadata without isolation from the project venv, which
    already has torch 2.13 (CPU) and setuptools, takes seconds instead.
    ``sha256=None`` skips the check (``forktools/release.py`` prints the hash of
    a release nobody has pinned yet and refuses to take it).
    """
    name = f"vllm-{version}.tar.gz"
    target = CACHE_DIR / name
    if target.exists():
        if sha256:
            verify_sdist(target, sha256)
        return target
    python = env_python()
    if not python.exists():
        raise ForkError(
            f"cannot download {name}: no venv python at {_rel(python)}; "
            "run `bash tools/setup_env.sh` (it fetches the sdist) or set FORK_PYTHON"
        )
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    log = CACHE_DIR / "fetch.log"
    env = dict(os.environ)
    env.update(VLLM_VERSION_OVERRIDE=version, VLLM_TARGET_DEVICE="empty")
    with tempfile.TemporaryDirectory(dir=CACHE_DIR, prefix=".download-") as tmp:
        cmd = [
            str(python), "-m", "pip", "download", "--no-deps",
            "--no-binary", "vllm", "--no-build-isolation",
            "--retries", "2", "--timeout", "30",
            f"vllm=={version}", "-d", tmp,
        ]  # fmt: skip
        print(f"fetch: downloading {name} from the package index", flush=True)
        with open(log, "w", encoding="utf-8") as logf:
            proc = subprocess.run(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT)
        got = Path(tmp) / name
        if proc.returncode != 0 or not got.exists():
            pinned = f" (sha256 {sha256[:12]}...)" if sha256 else ""
            raise ForkError(
                f"sdist download failed (pip exit {proc.returncode}), likely no "
                "network / PyPI unreachable: check connectivity or proxy settings "
                f"and retry, or copy {name}{pinned} "
                f"into {_rel(CACHE_DIR)}/; pip log: {_rel(log)}"
            )
        shutil.move(str(got), target)
    if sha256:
        verify_sdist(target, sha256)
    return target


def cmd_fetch(_: argparse.Namespace) -> int:
    path = fetch_sdist()
    print(f"fetch: {_rel(path)} ok (sha256 {SDIST_SHA256[:12]}...)")
    return 0


# --------------------------------------------------------------------------
# build


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


def commit_message(patch: Patch) -> str:
    body = patch.body.strip("\n")
    return f"{patch.subject}\n\n{body}\n" if body else f"{patch.subject}\n"


def _apply_error(pid: str, diff_rel: str, stderr: str) -> ForkError:
    errors = [
        ln[len("error: ") :] for ln in stderr.splitlines() if ln.startswith("error: ")
    ]
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


def _copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    shutil.copymode(src, dst)


def _glob_escape(path: str) -> str:
    return re.sub(r"([*?\[\\])", r"\\\1", path)


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
    for rel in {f for p in patches for f in p.files}:
        if (root / rel).is_file():
            _copy(root / rel, state / rel)
    dirs: list[Path] = []
    for index in range(len(patches), 0, -1):
        patch = patches[index - 1]
        dirs.append(work / f"{index:04d}")
        for rel in patch.files:
            if not (state / rel).is_file():
                raise ForkError(
                    f"patch {patch_id(index, patch)}: new file {rel} is missing "
                    "from the repo"
                )
            _copy(state / rel, dirs[-1] / rel)
            (state / rel).unlink()
        earlier = {f for p in patches[: index - 1] for f in p.files}
        if not patch.diff or not earlier:
            continue
        diff = root / patch.diff
        if not diff.is_file():
            continue  # apply_patch says so
        stat = git_out(state, "apply", "--numstat", "-z", str(diff))
        touched = [f.split("\t")[-1] for f in stat.split("\0")] if stat else []
        undo = sorted(earlier.intersection(touched))
        if not undo:
            continue
        proc = git(
            state, "apply", "-R", "--whitespace=nowarn",
            *(f"--include={_glob_escape(f)}" for f in undo), str(diff), check=False,
        )  # fmt: skip
        if proc.returncode != 0:
            raise ForkError(
                f"patch {patch_id(index, patch)}: its diff of {', '.join(undo)} "
                "does not reverse-apply to the repository's (final) copies: "
                + (proc.stderr.strip().splitlines() or ["?"])[-1]
            )
    return dirs[::-1]


def apply_patch(tree: Path, index: int, patch: Patch, files: Path) -> None:
    """Add the patch's files (from ``files``), apply its diff and commit it."""
    pid = patch_id(index, patch)
    for rel in patch.files:
        src = files / rel
        dst = tree / rel
        if not src.is_file():
            raise ForkError(f"patch {pid}: new file {rel} is missing from the repo")
        if dst.exists() or dst.is_symlink():
            raise ForkError(
                f"patch {pid}: new file {rel} already exists in the tree; "
                "changes to existing files belong in the patch's diff"
            )
        _copy(src, dst)
    if patch.files:
        git(tree, "add", "-f", "--", *patch.files)
    if patch.diff:
        diff_path = ROOT / patch.diff
        if not diff_path.is_file():
            raise ForkError(f"patch {pid}: diff {patch.diff} not found")
        proc = git(
            tree, "apply", "--index", "--whitespace=nowarn", str(diff_path),
            check=False,
        )  # fmt: skip
        if proc.returncode != 0:
            raise _apply_error(pid, patch.diff, proc.stderr)
    staged = git(tree, "diff", "--cached", "--quiet", check=False).returncode
    if staged == 0:
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
        return f"{_rel(tree)} has {n} uncommitted change(s)"
    head = git(tree, "rev-parse", "-q", "--verify", "HEAD", check=False).stdout
    marker = tree / ".git" / SAVED_HEAD_MARKER
    saved = marker.read_text().strip() if marker.exists() else ""
    if head.strip() and head.strip() != saved:
        return f"{_rel(tree)} HEAD {head.strip()[:12]} is not saved to the series"
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
    if tree.exists() and not force:
        reason = unsaved_reason(tree)
        if reason:
            raise ForkError(
                f"{reason}; commit and run `python3 -m forktools.fork save` first, "
                "or rerun build with --force to discard it"
            )
    with tempfile.TemporaryDirectory(prefix="fork-files-") as tmp:
        versions = added_versions(ROOT, manifest.patches, Path(tmp))
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


def cmd_build(args: argparse.Namespace) -> int:
    manifest = build(TREE, args.force)
    head = git_out(TREE, "rev-parse", "--short=12", "HEAD")
    print(
        f"build: {_rel(TREE)} = {BASE_TAG} + {len(manifest.patches)} patch(es), "
        f"HEAD {head}"
    )
    return 0


# --------------------------------------------------------------------------
# export / roundtrip


def require_tree() -> None:
    if not (TREE / ".git").is_dir():
        raise ForkError(f"{_rel(TREE)} missing: run `python3 -m forktools.fork build`")


def series_commits(tree: Path) -> list[str]:
    merges = git_out(tree, "rev-list", "--merges", f"{BASE_TAG}..HEAD")
    if merges:
        raise ForkError(f"{_rel(tree)}: merge commits above {BASE_TAG}; keep it linear")
    out = git_out(tree, "rev-list", "--reverse", f"{BASE_TAG}..HEAD")
    return out.split() if out else []


def stack_commits(manifest: Manifest) -> dict[str, list[str]]:
    """The build tree's commits of each stack (manifest order = commit order)."""
    commits = series_commits(TREE)
    if len(commits) != len(manifest.patches):
        raise ForkError(
            f"{_rel(TREE)} has {len(commits)} commit(s) but the manifest "
            f"{len(manifest.patches)} patch(es); run `fork.py save` or `build`"
        )
    out: dict[str, list[str]] = {}
    for commit, patch in zip(commits, manifest.patches, strict=True):
        out.setdefault(patch.stack, []).append(commit)
    return out


def stack_dir(out_dir: Path, stack: str) -> Path:
    """Where ``export`` writes one stack: ``1-fixes``, ``2-layout``."""
    return out_dir / f"{EXPORTED_STACKS.index(stack) + 1}-{stack}"


def export(out_dir: Path, identity: tuple[str, str]) -> list[Path]:
    """``git format-patch`` each exported stack, signed off by ``identity``.

    One directory per stack (``stack_dir``), patches numbered from 1 in
    each; a stack applies on the previous one. Project patches are not
    exported. The local build's author and date are replaced by
    ``identity`` and the time of the export; the Signed-off-by trailer is
    ``identity``'s.
    """
    require_tree()
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("**/*.patch"):
        old.unlink()
    by_stack = stack_commits(load_manifest())
    for stack in EXPORTED_STACKS:
        commits = by_stack.get(stack)
        if not commits:
            continue
        dest = stack_dir(out_dir, stack)
        dest.mkdir(parents=True, exist_ok=True)
        git(
            TREE, "format-patch", "-q", "--no-signature", "--no-renames",
            "--signoff", "-o", str(dest.resolve()),
            f"{commits[0]}^..{commits[-1]}", identity=identity,
        )  # fmt: skip
    name, email = identity
    date = email_utils.formatdate(localtime=True)
    patches = [
        path
        for stack in EXPORTED_STACKS
        for path in sorted(stack_dir(out_dir, stack).glob("*.patch"))
    ]
    for path in patches:
        header, sep, rest = path.read_text(encoding="utf-8").partition("\n\n")
        for key, value in (("From", f"{name} <{email}>"), ("Date", date)):
            header = re.sub(
                rf"^{key}: .*$",
                lambda _, line=f"{key}: {value}": line,
                header,
                count=1,
                flags=re.M,
            )
        # docs/contributing/README.md, "AI Assisted Contributions": mark commits.
        signoff = f"\nSigned-off-by: {name} <{email}>"
        rest = rest.replace(signoff, f"\n{AI_TRAILER}{signoff}", 1)
        path.write_text(header + sep + rest, encoding="utf-8")
    return patches


def cmd_export(args: argparse.Namespace) -> int:
    from forktools.docs_tables import CoverError, write_cover_letters

    manifest = load_manifest()
    out_dir = Path(args.dir) if args.dir else EXPORT_DIR
    patches = export(out_dir, require_user_identity())
    if not patches:
        print("export: empty series, nothing to export")
        return 0
    print(f"export: {len(patches)} patch(es) in {_rel(out_dir.resolve())}")
    for p in patches:
        print(f"  {p.parent.name}/{p.name}")
    if len(manifest.exported) != len(patches):
        raise ForkError(
            f"export: {len(patches)} commits but {len(manifest.exported)} exported "
            "manifest patches; run `fork.py save` first"
        )
    by_file = dict(zip(patches, manifest.exported, strict=True))
    texts = {p: patch_message(p.read_text(encoding="utf-8")) for p in patches}
    for stack in EXPORTED_STACKS:
        dest = stack_dir(out_dir, stack)
        try:
            covers = write_cover_letters(
                [(by_file[f].name, by_file[f].subject, f) for f in patches
                 if f.parent == dest],
                dest / "cover-letters",
            )  # fmt: skip
        except CoverError as exc:
            raise ForkError(f"export: {exc}") from None
        texts.update((c, c.read_text(encoding="utf-8")) for c in covers)
        print(f"export: {len(covers)} cover letter(s) in {_rel(dest.resolve())}")
    rfc = TREE / RFC_DOC
    if rfc.is_file():
        dest = stack_dir(out_dir, "layout") / "RFC-issue.md"
        texts[dest] = rfc_issue(rfc.read_text(encoding="utf-8"))
        dest.write_text(texts[dest], encoding="utf-8")
        print(f"export: the RFC as an issue in {_rel(dest.resolve())}")
    # A reviewer has the vLLM tree, not this project: no commit message,
    # cover or RFC text may send them to the project's tools/.
    cited = [_rel(path) for path, text in texts.items() if "tools/" in text]
    if cited:
        raise ForkError(f"export: {', '.join(cited)} cite tools/ of this project")
    return 0


def patch_message(text: str) -> str:
    """The commit message of a ``git format-patch`` file (headers and body)."""
    return text.split("\n---\n", 1)[0]


def rfc_issue(doc: str) -> str:
    """The RFC document as the text of a GitHub issue (``[RFC]: `` title).

    The document's first heading becomes the title line; the rest is the
    body, relative links pointing at the upstream tree.
    """
    lines = doc.splitlines()
    title = next(ln for ln in lines if ln.startswith("# "))
    body = "\n".join(lines[lines.index(title) + 1 :]).strip("\n")
    body = re.sub(
        r"\]\((?!https?:|#)([^)]+)\)",
        lambda m: f"](https://github.com/vllm-project/vllm/blob/main/docs/design/"
        f"{m.group(1)})",
        body,
    )
    return f"Title: [RFC]: {title[2:].strip()}\n\n{body}\n"


def cmd_roundtrip(_: argparse.Namespace) -> int:
    require_tree()
    commits = series_commits(TREE)
    if not commits:
        print("roundtrip: empty series, nothing to check")
        return 0
    sdist = fetch_sdist()
    by_stack = stack_commits(load_manifest())
    (ROOT / "build").mkdir(exist_ok=True)
    counts = []
    with tempfile.TemporaryDirectory(dir=ROOT / "build", prefix="roundtrip-") as tmp:
        # Only the trees are compared: any identity will do.
        out = Path(tmp) / "export"
        export(out, user_identity() or BUILD_IDENTITY)
        fresh = Path(tmp) / "vllm"
        make_base(fresh, sdist)
        for stack in EXPORTED_STACKS:
            if not by_stack.get(stack):
                continue
            patches = sorted(stack_dir(out, stack).glob("*.patch"))
            want = git_out(TREE, "rev-parse", f"{by_stack[stack][-1]}^{{tree}}")
            proc = git(
                fresh, "am", "-q", "--whitespace=nowarn", *map(str, patches),
                identity=BASE_IDENTITY, check=False,
            )  # fmt: skip
            if proc.returncode != 0:
                lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln]
                print(f"roundtrip: FAIL: git am of {stack} failed: {lines[:3]}")
                return 1
            got = git_out(fresh, "rev-parse", "HEAD^{tree}")
            if got != want:
                stat = git(fresh, "diff", "--stat", want, got, check=False).stdout
                print(
                    f"roundtrip: FAIL: {stack}: {len(patches)} exported patch(es) "
                    f"give tree {got[:12]}, build/vllm's is {want[:12]}\n{stat}"
                )
                return 1
            counts.append(f"{len(patches)} {stack}")
            if stack == EXPORTED_STACKS[0]:
                if STACK1_TREE.exists():
                    shutil.rmtree(STACK1_TREE)
                shutil.copytree(fresh, STACK1_TREE, symlinks=True)
    project = len(by_stack.get("project", []))
    print(
        f"roundtrip: OK: {' + '.join(counts)} patch(es) export and `git am` "
        f"onto a fresh {BASE_TAG}, each stack to build/vllm's tree at its last "
        f"patch ({project} project patch(es) not exported); "
        f"{_rel(STACK1_TREE)} holds {BASE_TAG} + the first stack alone"
    )
    return 0


# --------------------------------------------------------------------------
# save


def commit_text(tree: Path, commit: str) -> tuple[str, str]:
    """Subject and body of a commit, without Signed-off-by trailers."""
    msg = git(tree, "log", "-1", "--format=%B", commit).stdout.strip("\n")
    lines = msg.splitlines()
    subject = lines[0].strip() if lines else ""
    body_lines = [ln.rstrip() for ln in lines[1:]]
    body_lines = [ln for ln in body_lines if not ln.startswith("Signed-off-by:")]
    body = "\n".join(body_lines).strip("\n")
    body = re.sub(r"\n{3,}", "\n\n", body)
    return subject, body


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
        if not status:
            continue
        (added if status == "A" else other).append(path)
    return added, other


def read_blob(tree: Path, commit: str, path: str) -> tuple[bytes, int]:
    """Content and file mode of ``path`` at ``commit``."""
    data = subprocess.run(
        ["git", "show", f"{commit}:{path}"], cwd=tree, capture_output=True,
        check=True, env=git_env(),
    ).stdout  # fmt: skip
    mode = git_out(tree, "ls-tree", commit, "--", path).split()[0]
    return data, 0o755 if mode == "100755" else 0o644


def final_blob(tree: Path, path: str) -> tuple[bytes, int] | None:
    """``read_blob`` at HEAD; None where the series deletes the file again."""
    if not git_out(tree, "ls-tree", "HEAD", "--", path):
        return None
    return read_blob(tree, "HEAD", path)


def root_differences(manifest: Manifest) -> list[str]:
    """Active patches' new files whose repository copy is not the tree's HEAD's.

    The repository keeps each new file as the whole series leaves it
    (``build`` derives earlier versions from the later patches' diffs).
    """
    bad: list[str] = []
    for rel in sorted({f for p in manifest.patches for f in p.files}):
        final, dest = final_blob(TREE, rel), ROOT / rel
        if final is None:
            if dest.exists():
                bad.append(f"{rel} (deleted by the series, still at the root)")
        elif not dest.is_file():
            bad.append(f"{rel} (missing at the root)")
        elif dest.read_bytes() != final[0]:
            bad.append(f"{rel} (content)")
        elif dest.stat().st_mode & 0o777 != final[1]:
            bad.append(f"{rel} (mode)")
    return bad


def cmd_check_root(_: argparse.Namespace) -> int:
    require_tree()
    manifest = load_manifest()
    stack_commits(manifest)  # the tree holds the manifest's patches
    bad = root_differences(manifest)
    if bad:
        print(
            f"check-root: FAIL: root copies differ from {_rel(TREE)} HEAD's: "
            + "; ".join(bad)
        )
        return 1
    n = sum(len(p.files) for p in manifest.patches)
    print(f"check-root: OK: {n} new file(s) at the root are {_rel(TREE)} HEAD's")
    return 0


class RepoWriter:
    """Writes and deletions of `save`, or with ``check`` only their diff."""

    def __init__(self, check: bool) -> None:
        self.check = check
        self.differs: list[str] = []

    def write(self, rel: str, data: bytes, mode: int = 0o644) -> None:
        dest = ROOT / rel
        if self.check:
            same = dest.is_file() and dest.read_bytes() == data
            if not same or (dest.stat().st_mode & 0o777) != mode:
                self.differs.append(rel)
            return
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
        dest.chmod(mode)

    def remove(self, rel: str) -> bool:
        if not (ROOT / rel).is_file():
            return False
        if self.check:
            self.differs.append(rel)
        else:
            (ROOT / rel).unlink()
        return True


def cmd_save(args: argparse.Namespace) -> int:
    check = bool(getattr(args, "check", False))
    out = RepoWriter(check)
    require_tree()
    manifest = load_manifest(require_subject=False)
    status = git_out(TREE, "status", "--porcelain")
    if status:
        raise ForkError(
            f"{_rel(TREE)} has uncommitted changes; commit or amend them there first"
        )
    commits = series_commits(TREE)
    if len(commits) != len(manifest.patches):
        raise ForkError(
            f"{_rel(TREE)} has {len(commits)} commit(s) above {BASE_TAG} but "
            f"{_rel(MANIFEST)} has {len(manifest.patches)} [[patch]] table(s); "
            "commits map to tables by order, so add a table with just "
            '`name = "<slug>"` for each new commit (or drop tables) and rerun'
        )
    # Parked patches are not in build/vllm: their files and diffs stay.
    old_files = {f for p in manifest.patches for f in p.files}
    old_diffs = {p.diff for p in manifest.patches if p.diff}
    new_patches: list[Patch] = []
    for index, (commit, old) in enumerate(
        zip(commits, manifest.patches, strict=True), start=1
    ):
        subject, body = commit_text(TREE, commit)
        added, other = changed_paths(TREE, commit)
        for path in added:  # the root copy is the final version (HEAD's)
            _check_relpath(f"commit {commit[:12]}", path)
            final = final_blob(TREE, path)
            if final is None:
                out.remove(path)
            else:
                out.write(path, *final)
        diff_rel: str | None = None
        if other:
            numstat = git_out(TREE, "diff", "--numstat", f"{commit}^", commit,
                              "--", *other)  # fmt: skip
            binary = any(ln.startswith("-\t-\t") for ln in numstat.splitlines())
            extra = ["--binary"] if binary else []
            text = git(
                TREE, "diff", "--no-renames", "--no-color", *extra,
                f"{commit}^", commit, "--", *other,
            ).stdout  # fmt: skip
            diff_rel = f"series/diffs/{index:04d}-{old.name}.diff"
            out.write(diff_rel, text.encode("utf-8"))
        # Keep the manifest's file order; new files go last, sorted.
        files = [f for f in old.files if f in added]
        files += sorted(set(added) - set(files))
        new_patches.append(Patch(old.name, subject, body, files, diff_rel, old.stack))
        if not check:
            print(
                f"save: {patch_id(index, old)}: {len(added)} new file(s), "
                f"{len(other)} upstream file(s) changed"
            )
    new_files = {f for p in new_patches for f in p.files}
    new_diffs = {p.diff for p in new_patches if p.diff}
    for stale in sorted((old_files - new_files) | (old_diffs - new_diffs)):
        if out.remove(stale) and not check:
            print(f"save: removed {stale}")
    new_manifest = Manifest(new_patches, manifest.parked)
    out.write(
        str(MANIFEST.relative_to(ROOT)), dump_manifest(new_manifest).encode("utf-8")
    )
    if check:
        if out.differs:
            print(f"save --check: FAIL: save would change {sorted(out.differs)}")
            return 1
        print(f"save --check: OK: the repository holds build/vllm's {BASE_TAG}..HEAD")
        return 0
    if load_manifest() != new_manifest:  # the hand-written TOML must round-trip
        raise ForkError(f"internal error: {_rel(MANIFEST)} does not round-trip")
    mark_saved(TREE)
    print(f"save: wrote {_rel(MANIFEST)} ({len(new_patches)} patch(es))")
    return 0


# --------------------------------------------------------------------------
# summary


def cmd_summary(_: argparse.Namespace) -> int:
    manifest = load_manifest()
    if not manifest.patches:
        print(f"series on vLLM {VLLM_VERSION}: empty series (0 patches)")
        return 0
    print(
        f"series on vLLM {VLLM_VERSION}: {len(manifest.patches)} patch(es); "
        "lines added/removed per kind (new files and diffs to upstream files)"
    )
    header = ("#", "name", *KINDS, "subject")
    rows: list[tuple[str, ...]] = []
    for index, p in enumerate(manifest.patches, start=1):
        counts = patch_lines(p)
        cells = [f"+{a}/-{r}" if a or r else "-" for a, r in counts.values()]
        rows.append((f"{index:04d}", p.name, *cells, p.subject))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(r: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()

    print(line(header))
    stack = None
    for p, r in zip(manifest.patches, rows, strict=True):
        if p.stack != stack:
            stack = p.stack
            print(f"-- {STACKS[stack]}")
        print(line(r))
    for p in manifest.parked:
        print(f"-- parked (not built, not exported): {p.name}: {p.parked}")
    for stack in STACKS:
        code = sum(
            patch_lines(p, nonblank=True)["code"][0]
            for p in manifest.patches
            if p.stack == stack
        )
        if code:
            print(
                f"-- {stack}: {code} non-blank code lines added (not tests, docs, ci)"
            )
    return 0


# --------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fork.py", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("fetch", help="download and verify the release sdist")
    p_build = sub.add_parser("build", help="recreate build/vllm from the series")
    p_build.add_argument(
        "--force", action="store_true", help="discard unsaved work in build/vllm"
    )
    p_export = sub.add_parser("export", help="git format-patch the series")
    p_export.add_argument("dir", nargs="?", help="output dir (build/series-export)")
    sub.add_parser("roundtrip", help="check export + git am reproduces build/vllm")
    p_save = sub.add_parser("save", help="write build/vllm commits back into the repo")
    p_save.add_argument(
        "--check",
        action="store_true",
        help="write nothing; fail if save would change the repository",
    )
    sub.add_parser("summary", help="print the series")
    sub.add_parser(
        "check-root", help="fail if a root copy of a new file is not build/vllm's"
    )
    args = parser.parse_args(argv)
    handlers = {
        "fetch": cmd_fetch,
        "build": cmd_build,
        "export": cmd_export,
        "roundtrip": cmd_roundtrip,
        "save": cmd_save,
        "summary": cmd_summary,
        "check-root": cmd_check_root,
    }
    try:
        return handlers[args.command](args)
    except ForkError as exc:
        print(f"fork.py {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
