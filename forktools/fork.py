# SPDX-License-Identifier: Apache-2.0
"""Build, save and export the vLLM NIXL patch series.

``--help`` lists the subcommands; project-docs/fork.md says what each does.
Stdlib only; any Python >= 3.11 runs it.
"""

from __future__ import annotations

import argparse
import email.utils as email_utils
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from forktools import paths
from forktools.build_tree import SDIST_SHA256, build, fetch_sdist, make_base
from forktools.git_ops import (
    BASE_IDENTITY,
    BUILD_IDENTITY,
    git,
    git_out,
    rel,
    require_tree,
    require_user_identity,
    series_commits,
    stack_commits,
    user_identity,
)
from forktools.manifest import (
    BASE_TAG,
    EXPORTED_STACKS,
    KINDS,
    STACKS,
    VLLM_VERSION,
    ForkError,
    Patch,
    load_manifest,
    patch_lines,
)
from forktools.pages import DIRECTIVE
from forktools.save_series import check_root, save

# Upstream's contributing guide asks for it on AI-assisted commits.
AI_TRAILER = "Assisted-by: Claude"
# The layout stack's RFC, also exported as the text of an RFC issue.
RFC_DOC = "docs/design/nixl_kv_layout.md"
# A patch's PR description ("cover letter"): series/covers/<name>.md, upstream's
# PR template, with LINES filled with the patch's size.
COVERS = paths.SERIES / "covers"
LINES = "<!-- lines -->"


def stack_dir(out_dir: Path, stack: str) -> Path:
    """Where ``export`` writes one stack: ``1-fixes``, ``2-layout``."""
    return out_dir / f"{EXPORTED_STACKS.index(stack) + 1}-{stack}"


def export(out_dir: Path, identity: tuple[str, str]) -> list[Path]:
    """``git format-patch`` each exported stack, signed off by ``identity``.

    One directory per stack, patches numbered from 1 in each; a stack applies
    on the previous one. The local build's author and date are replaced by
    ``identity`` and the time of the export.
    """
    require_tree()
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("**/*.patch"):
        old.unlink()
    by_stack = stack_commits(load_manifest())
    for stack in EXPORTED_STACKS:
        if commits := by_stack.get(stack):
            dest = stack_dir(out_dir, stack)
            dest.mkdir(parents=True, exist_ok=True)
            git(
                paths.TREE, "format-patch", "-q", "--no-signature", "--no-renames",
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
            line = f"{key}: {value}"
            header = re.sub(
                rf"^{key}: .*$", lambda _, ln=line: ln, header, count=1, flags=re.M
            )
        # docs/contributing/README.md, "AI Assisted Contributions": mark commits.
        signoff = f"\nSigned-off-by: {name} <{email}>"
        rest = rest.replace(signoff, f"\n{AI_TRAILER}{signoff}", 1)
        path.write_text(header + sep + rest, encoding="utf-8")
    return patches


def render_cover(text: str, patch: Patch) -> str:
    """The cover template ``text`` of ``patch`` with its size filled in.

    A description quotes only what runs in a vLLM tree, so a project table
    directive in it is refused.
    """
    out: list[str] = []
    for n, line in enumerate(text.splitlines(), start=1):
        if DIRECTIVE.match(line.strip()):
            raise ForkError(
                f"export: cover {patch.name}: line {n}: {line.strip()}: a PR "
                "description quotes a test or snippet that runs in a vLLM "
                "tree, not a table of this project"
            )
        if line.strip() == LINES:
            counts = patch_lines(patch).items()
            size = ", ".join(f"{kind} +{a}/-{r}" for kind, (a, r) in counts if a or r)
            line = f"Size (new files and hunks): {size}."
        out.append(line)
    return "\n".join(out).rstrip("\n") + "\n"


def write_cover_letters(patches: list[tuple[Patch, Path]], out_dir: Path) -> list[Path]:
    """Write ``out_dir/<patch file stem>.md`` for each ``(patch, exported
    .patch file)`` whose patch has a template; return the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("*.md"):
        old.unlink()
    written: list[Path] = []
    for patch, patch_file in patches:
        template = COVERS / f"{patch.name}.md"
        if not template.exists():
            continue
        body = render_cover(template.read_text(encoding="utf-8"), patch)
        head = f"# {patch.subject}\n\nPatch: `{patch_file.name}`\n\n"
        dest = out_dir / f"{patch_file.stem}.md"
        dest.write_text(head + body, encoding="utf-8")
        written.append(dest)
    return written


def cmd_export(args: argparse.Namespace) -> int:
    manifest = load_manifest()
    out_dir = Path(args.dir) if args.dir else paths.BUILD / "series-export"
    patches = export(out_dir, require_user_identity())
    if not patches:
        print("export: empty series, nothing to export")
        return 0
    print(f"export: {len(patches)} patch(es) in {rel(out_dir.resolve())}")
    for p in patches:
        print(f"  {p.parent.name}/{p.name}")
    if len(manifest.exported) != len(patches):
        raise ForkError(
            f"export: {len(patches)} commits but {len(manifest.exported)} exported "
            "manifest patches; run `fork.py save` first"
        )
    by_file = dict(zip(patches, manifest.exported, strict=True))
    # The commit message of a ``git format-patch`` file (headers and body).
    texts = {p: p.read_text(encoding="utf-8").split("\n---\n", 1)[0] for p in patches}
    for stack in EXPORTED_STACKS:
        dest = stack_dir(out_dir, stack)
        mine = [(by_file[f], f) for f in patches if f.parent == dest]
        covers = write_cover_letters(mine, dest / "cover-letters")
        texts.update((c, c.read_text(encoding="utf-8")) for c in covers)
        print(f"export: {len(covers)} cover letter(s) in {rel(dest.resolve())}")
    rfc = paths.TREE / RFC_DOC
    if rfc.is_file():
        dest = stack_dir(out_dir, "layout") / "RFC-issue.md"
        texts[dest] = rfc_issue(rfc.read_text(encoding="utf-8"))
        dest.write_text(texts[dest], encoding="utf-8")
        print(f"export: the RFC as an issue in {rel(dest.resolve())}")
    # A reviewer has the vLLM tree, not this project: no commit message,
    # cover or RFC text may send them to the project's tools/.
    cited = [rel(path) for path, text in texts.items() if "tools/" in text]
    if cited:
        raise ForkError(f"export: {', '.join(cited)} cite tools/ of this project")
    return 0


def rfc_issue(doc: str) -> str:
    """The RFC document as the text of a GitHub issue (``[RFC]: `` title).

    The document's first heading becomes the title line; the rest is the
    body, relative links pointing at the upstream tree.
    """
    lines = doc.splitlines()
    title = next(ln for ln in lines if ln.startswith("# "))
    body = "\n".join(lines[lines.index(title) + 1 :]).strip("\n")
    upstream = "https://github.com/vllm-project/vllm/blob/main/docs/design/"
    body = re.sub(r"\]\((?!https?:|#)([^)]+)\)", rf"]({upstream}\1)", body)
    return f"Title: [RFC]: {title[2:].strip()}\n\n{body}\n"


def roundtrip_stack(fresh: Path, patches: list[Path], want: str, stack: str) -> bool:
    """``git am`` one exported stack onto ``fresh``; False (said) if its tree
    is not ``want``."""
    proc = git(fresh, "am", "-q", "--whitespace=nowarn", *map(str, patches),
               identity=BASE_IDENTITY, check=False)  # fmt: skip
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln]
        print(f"roundtrip: FAIL: git am of {stack} failed: {lines[:3]}")
        return False
    got = git_out(fresh, "rev-parse", "HEAD^{tree}")
    if got != want:
        stat = git(fresh, "diff", "--stat", want, got, check=False).stdout
        print(
            f"roundtrip: FAIL: {stack}: {len(patches)} exported patch(es) "
            f"give tree {got[:12]}, build/vllm's is {want[:12]}\n{stat}"
        )
        return False
    return True


def cmd_roundtrip(_: argparse.Namespace) -> int:
    require_tree()
    if not series_commits(paths.TREE):
        print("roundtrip: empty series, nothing to check")
        return 0
    sdist = fetch_sdist()
    by_stack = stack_commits(load_manifest())
    stack1 = paths.STACK1_TREE
    counts = []
    (paths.ROOT / "build").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(
        dir=paths.ROOT / "build", prefix="roundtrip-"
    ) as tmp:
        out = Path(tmp) / "export"
        export(out, user_identity() or BUILD_IDENTITY)  # any identity will do
        fresh = Path(tmp) / "vllm"
        make_base(fresh, sdist)
        for stack in EXPORTED_STACKS:
            if not by_stack.get(stack):
                continue
            patches = sorted(stack_dir(out, stack).glob("*.patch"))
            tree = f"{by_stack[stack][-1]}^{{tree}}"
            if not roundtrip_stack(
                fresh, patches, git_out(paths.TREE, "rev-parse", tree), stack
            ):
                return 1
            counts.append(f"{len(patches)} {stack}")
            if stack == EXPORTED_STACKS[0]:
                if stack1.exists():
                    shutil.rmtree(stack1)
                shutil.copytree(fresh, stack1, symlinks=True)
    project = len(by_stack.get("project", []))
    print(
        f"roundtrip: OK: {' + '.join(counts)} patch(es) export and `git am` "
        f"onto a fresh {BASE_TAG}, each stack to build/vllm's tree at its last "
        f"patch ({project} project patch(es) not exported); "
        f"{rel(stack1)} holds {BASE_TAG} + the first stack alone"
    )
    return 0


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
        cells = [f"+{a}/-{r}" if a or r else "-" for a, r in patch_lines(p).values()]
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
    for stack in STACKS:
        mine = [p for p in manifest.patches if p.stack == stack]
        if code := sum(patch_lines(p, nonblank=True)["code"][0] for p in mine):
            print(
                f"-- {stack}: {code} non-blank code lines added (not tests, docs, ci)"
            )
    return 0


def cmd_fetch(_: argparse.Namespace) -> int:
    path = fetch_sdist()
    print(f"fetch: {rel(path)} ok (sha256 {SDIST_SHA256[:12]}...)")
    return 0


def cmd_build(args: argparse.Namespace) -> int:
    manifest = build(paths.TREE, args.force)
    head = git_out(paths.TREE, "rev-parse", "--short=12", "HEAD")
    print(
        f"build: {rel(paths.TREE)} = {BASE_TAG} + {len(manifest.patches)} "
        f"patch(es), HEAD {head}"
    )
    return 0


HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "fetch": cmd_fetch,
    "build": cmd_build,
    "export": cmd_export,
    "roundtrip": cmd_roundtrip,
    "save": lambda args: save(args.check),
    "summary": cmd_summary,
    "check-root": lambda _: check_root(),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fork.py", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("fetch", help="download and verify the release sdist")
    sub.add_parser("build", help="recreate build/vllm from the series").add_argument(
        "--force", action="store_true", help="discard unsaved work in build/vllm"
    )
    sub.add_parser("export", help="git format-patch the series").add_argument(
        "dir", nargs="?", help="output dir (build/series-export)"
    )
    sub.add_parser("roundtrip", help="check export + git am reproduces build/vllm")
    sub.add_parser(
        "save", help="write build/vllm commits back into the repo"
    ).add_argument(
        "--check",
        action="store_true",
        help="write nothing; fail if save would change the repository",
    )
    sub.add_parser("summary", help="print the series")
    sub.add_parser(
        "check-root", help="fail if a root copy of a new file is not build/vllm's"
    )
    args = parser.parse_args(argv)
    try:
        return HANDLERS[args.command](args)
    except ForkError as exc:
        print(f"fork.py {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
