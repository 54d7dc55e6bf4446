# SPDX-License-Identifier: Apache-2.0
"""Build the release's CPU extension (``vllm/_C``) offline, once, and cache it.

The real engines need the compiled CPU kernels; the series changes Python
only, so one build serves both trees. The build applies the patches in
``series/release.toml``'s ``cpu_patches`` folder to the verified sdist and
builds with CMake only the target ``CpuPlatform.import_kernels`` loads here,
into ``build/cache/cpu-ext/<key>/``, the key hashing everything it depends
on. Needs CMake and ninja (the venv has both), gcc >= 12.2 and ``numa.h``.

    python3 -m forktools.cpu_ext install build/vllm build/stock
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from forktools.build_tree import SDIST_SHA256, fetch_sdist
from forktools.manifest import RELEASE, VLLM_VERSION
from forktools.paths import BUILD, CACHE_DIR, ROOT

PATCH_DIR = ROOT / RELEASE.get("cpu_patches", "tools/cpu_ext")
EXT_CACHE = CACHE_DIR / "cpu-ext"
WORK = BUILD / "cpu-ext"
LOG = WORK / "build.log"
PYTHON = sys.executable
BIN = Path(PYTHON).parent
CMAKE_ARGS = ["-DVLLM_TARGET_DEVICE=cpu", "-DCMAKE_BUILD_TYPE=Release",
              "-DVLLM_CPU_ONEDNN=OFF"]  # fmt: skip
# What the log lines that say why a build failed hold, most specific first.
CAUSES = ("internal compiler error", "fatal error:", "error:", "cmake error",
          "failed:", "no such file", "not found")  # fmt: skip


class BuildError(Exception):
    pass


def target() -> str:
    """The library ``CpuPlatform.import_kernels`` loads on this machine."""
    import torch

    if not torch.cpu._is_avx512_supported():
        return "_C_AVX2"
    return "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"


def _tool_version(*cmd: str) -> str:
    try:
        out = subprocess.run(list(cmd), capture_output=True, text=True, check=False)
    except FileNotFoundError:
        return "missing"
    text = out.stdout or out.stderr
    return text.splitlines()[0] if text else ""


def key(tgt: str) -> str:
    """What the cached library depends on."""
    import torch

    h = hashlib.sha256()
    compiler = _tool_version("c++", "--version")
    for part in (SDIST_SHA256, tgt, torch.__version__, compiler, " ".join(CMAKE_ARGS)):
        h.update(part.encode() + b"\0")
    for patch in sorted(PATCH_DIR.glob("*.diff")):
        h.update(patch.name.encode() + b"\0" + patch.read_bytes())
    return h.hexdigest()[:16]


def cached(tgt: str) -> Path | None:
    found = sorted((EXT_CACHE / key(tgt)).glob(f"{tgt}.*so"))
    return found[0] if found else None


def _run(cmd: list[str], cwd: Path, what: str) -> None:
    start = LOG.stat().st_size if LOG.exists() else 0
    with open(LOG, "a", encoding="utf-8") as log:
        log.write(f"--- {what}: {' '.join(cmd)}\n")
        log.flush()
        env = dict(
            os.environ,
            PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            # The sources sit inside the project's checkout: without a ceiling
            # git would take that repository for theirs, and `git apply` would
            # skip every path (it applies relative to the repository's root).
            GIT_CEILING_DIRECTORIES=str(WORK),
        )
        rc = subprocess.run(cmd, cwd=cwd, env=env, stdout=log,
                            stderr=subprocess.STDOUT).returncode  # fmt: skip
    if rc == 0 and "Skipped patch" in LOG.read_text(errors="replace")[start:]:
        rc = 1
        with open(LOG, "a", encoding="utf-8") as log:
            log.write(f"error: {what}: git apply skipped a file of the patch\n")
    if rc != 0:
        raise BuildError(f"{what} failed: {_cause() or 'see log'}; full log: {LOG}")


def _cause() -> str:
    lines = LOG.read_text(encoding="utf-8", errors="replace").splitlines()
    for cause in CAUSES:
        hits = [
            ln.strip() for ln in lines if cause in ln.lower() and "warning" not in ln
        ]
        if hits:
            return hits[0][:240]
    return ""


def _ensure_numa() -> None:
    if Path("/usr/include/numa.h").exists():
        return
    apt = shutil.which("apt-get")
    if apt is None or os.geteuid() != 0:
        raise BuildError(
            "numa.h is missing: install libnuma-dev (Debian/Ubuntu) or "
            "numactl-devel, then run again"
        )
    print("cpu_ext: installing libnuma-dev (apt-get)", flush=True)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    with open(LOG, "a", encoding="utf-8") as log:
        for cmd in ([apt, "install", "-y", "-q", "libnuma-dev"],
                    [apt, "update", "-q"],
                    [apt, "install", "-y", "-q", "libnuma-dev"]):  # fmt: skip
            rc = subprocess.run(cmd, env=env, stdout=log,
                                stderr=subprocess.STDOUT).returncode  # fmt: skip
            if rc == 0 and cmd[1] == "install":
                return
    raise BuildError(f"apt-get install libnuma-dev failed: {_cause()}; log {LOG}")


def build() -> Path:
    """The cached library, built first when the key has none.

    One build at a time per checkout: every build works in ``build/cpu-ext``,
    so a second process (another test run, a parallel session) waits on a
    lock, then finds the first one's library in the cache.
    """
    tgt = target()
    lib = cached(tgt)
    if lib is None:
        WORK.mkdir(parents=True, exist_ok=True)
        with open(WORK / ".lock", "w", encoding="utf-8") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print("cpu_ext: another build runs here; waiting", flush=True)
                fcntl.flock(lock, fcntl.LOCK_EX)
            return cached(tgt) or _build(tgt)
    print(f"cpu_ext: {tgt} cached ({lib.relative_to(ROOT)})")
    return lib


def _build(tgt: str) -> Path:
    LOG.write_text("", encoding="utf-8")
    begin = time.monotonic()
    print(f"cpu_ext: building {tgt} for vLLM {VLLM_VERSION} (log: "
          f"{LOG.relative_to(ROOT)}; ~10 min on 2 cores)", flush=True)  # fmt: skip
    for tool in ("cmake", "ninja"):
        if not (BIN / tool).exists() and shutil.which(tool) is None:
            raise BuildError(f"{tool} not found: run bash tools/setup_env.sh")
    _ensure_numa()
    sdist = fetch_sdist(VLLM_VERSION, SDIST_SHA256)
    src = WORK / "src"
    bld = WORK / "bld"
    shutil.rmtree(src, ignore_errors=True)
    shutil.rmtree(bld, ignore_errors=True)
    with tarfile.open(sdist) as tar:
        tar.extractall(WORK, filter="data")
    (WORK / f"vllm-{VLLM_VERSION}").rename(src)
    for patch in sorted(PATCH_DIR.glob("*.diff")):
        _run(["git", "apply", "--verbose", str(patch)], src, f"apply {patch.name}")
    _run(["cmake", "-S", str(src), "-B", str(bld), "-G", "Ninja",
          f"-DVLLM_PYTHON_EXECUTABLE={PYTHON}", *CMAKE_ARGS], src,
         "cmake configure")  # fmt: skip
    jobs = str(os.cpu_count() or 1)
    _run(["cmake", "--build", str(bld), "--target", tgt, "-j", jobs], src,
         f"build {tgt}")  # fmt: skip
    built = sorted(bld.glob(f"{tgt}.*so"))
    if not built:
        raise BuildError(f"the build made no {tgt}.*so in {bld}; log {LOG}")
    dest = EXT_CACHE / key(tgt)
    dest.mkdir(parents=True, exist_ok=True)
    tmp = dest / (built[0].name + ".tmp")
    shutil.copy2(built[0], tmp)
    tmp.rename(dest / built[0].name)
    seconds = time.monotonic() - begin
    # run_costs reads how long the build took.
    info = json.dumps({"seconds": round(seconds, 1)}) + "\n"
    (dest / "build.json").write_text(info, encoding="utf-8")
    shutil.rmtree(src, ignore_errors=True)
    shutil.rmtree(bld, ignore_errors=True)
    print(f"cpu_ext: built {tgt} in {seconds:.0f} s")
    return dest / built[0].name


def install(trees: list[Path]) -> None:
    lib = build()
    for tree in trees:
        pkg = tree / "vllm"
        if not pkg.is_dir():
            raise BuildError(f"{tree} is not a vLLM tree (no vllm/)")
        for old in pkg.glob("_C*.so"):
            old.unlink()
        (pkg / lib.name).symlink_to(lib.resolve())
        print(f"cpu_ext: {pkg / lib.name} -> {lib.relative_to(ROOT)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("install").add_argument("trees", nargs="+", type=Path)
    args = parser.parse_args(argv)
    try:
        install(args.trees)
    except BuildError as e:
        print(f"cpu_ext: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
