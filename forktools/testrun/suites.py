# SPDX-License-Identifier: Apache-2.0
"""The suite table: one row of the summary per ``Suite``, in order; a suite's
``kind`` names its runner (``run_tests.RUNNERS``)."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

PY = r"\.pyi?$"
TETHERING_FILES = (
    r"^(tests/.*\.py|\.buildkite/(test_areas|hardware_tests|intel_jobs)/.*\.yaml"
    r"|\.buildkite/(test-amd|ci_config[^/]*)\.yaml"
    r"|tools/pre_commit/test_tethering_allowlist\.txt)$"
)

# check_spdx_header.py rewrites files it flags; run its check function only.
SPDX_CHECK = """\
import importlib.util, sys
spec = importlib.util.spec_from_file_location(
    "check_spdx_header", "tools/pre_commit/check_spdx_header.py")
c = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = c
spec.loader.exec_module(c)
bad = [f for f in sys.argv[1:] if c.check_spdx_header_status(f)
       not in (c.SPDXStatus.COMPLETE, c.SPDXStatus.EMPTY)]
for f in bad:
    print(f"{f}: missing SPDX header lines (license + copyright)")
sys.exit(1 if bad else 0)
"""


@dataclass(frozen=True)
class Suite:
    """One row of the summary table."""

    name: str
    kind: str
    _: KW_ONLY
    # lint: command run from build/vllm; "{py}" is the venv python.
    cmd: tuple[str, ...] = ()
    files: str | None = None  # lint: regex of touched files the tool takes
    pass_files: bool = True  # lint: append the matching files to cmd
    # pytest: paths relative to build/vllm/tests, marker, xdist workers.
    paths: tuple[str, ...] = ()
    marker: str | None = None
    workers: int = 0
    stock: int | None = None  # passed count on the stock release (for reference)
    quick: bool = False


def _lint(name: str, files: str | None, *cmd: str, pass_files: bool = True) -> Suite:
    return Suite(
        f"lint:{name}", "lint", cmd=cmd, files=files, pass_files=pass_files, quick=True
    )


UNIT = "v1/kv_connector/unit"
SUITES: list[Suite] = [
    _lint("ruff-check", PY, "ruff", "check", "--output-format", "concise"),
    _lint("ruff-format", PY, "ruff", "format", "--check", "--diff"),
    _lint("mypy", PY, "{py}", "tools/pre_commit/mypy.py", "3.11"),
    _lint("typos", None, "typos", "--format", "brief", "--force-exclude"),
    _lint("spdx-header", r"\.(py|rs|proto)$", "{py}", "-c", SPDX_CHECK),
    _lint("forbidden-imports", PY, "{py}",
          "tools/pre_commit/check_forbidden_imports.py"),
    _lint("torch-cuda", PY, "{py}", "tools/pre_commit/check_torch_cuda.py"),
    _lint("boolean-context-manager", PY, "{py}",
          "tools/pre_commit/check_boolean_context_manager.py"),
    _lint("trust-remote-code", r"^vllm/.*\.py$", "{py}",
          "tools/pre_commit/check_trust_remote_code.py"),
    _lint("root-lazy-imports", PY, "{py}",
          "tools/pre_commit/check_init_lazy_imports.py"),
    _lint("validate-config", None, "{py}", "tools/pre_commit/validate_config.py"),
    _lint("test-tethering", TETHERING_FILES, "{py}",
          "tools/pre_commit/check_test_tethering.py"),
    _lint("buildkite-step-keys", r"^\.buildkite/.*\.ya?ml$", "{py}",
          "tools/pre_commit/check_buildkite_step_keys.py", pass_files=False),
    # Upstream's pre-commit hook (markdownlint-cli2, its config), on docs.
    _lint("markdownlint", r"\.md$", "{markdownlint}", "--config",
          "tools/pre_commit/.markdownlint.yaml"),
    Suite("lint:project", "lint-project", quick=True),
    Suite("roundtrip", "roundtrip", quick=True),
    Suite("stack1-alone", "stack1", workers=2),
    Suite("save-canonical", "save-check", quick=True),
    Suite("root-final", "root-final", quick=True),
    # The series and pytest suites share one pytest run (run_batch).
    Suite("series-tests", "series", workers=2, quick=True),
    Suite("nixl-connector", "pytest", marker="cpu_test", workers=2, stock=29,
          paths=(f"{UNIT}/test_nixl_connector.py",)),
    Suite("nixl-connector-hma", "pytest", marker="cpu_test", workers=2, stock=103,
          paths=(f"{UNIT}/test_nixl_connector_hma.py",)),
    # Unmarked upstream: `-m cpu_test` would select nothing.
    Suite("nixl-push-connector", "pytest", workers=2, stock=91,
          paths=(f"{UNIT}/test_nixl_push_connector.py",)),
    # Unmarked too: the descriptor geometry of every registration branch.
    Suite("nixl-desc-geometry", "pytest", workers=2, stock=330,
          paths=(f"{UNIT}/test_nixl_desc_geometry.py",)),
    Suite("block-pool", "pytest", marker="cpu_test", workers=2, stock=309, paths=(
        "v1/core/test_prefix_caching.py",
        "v1/core/prefix_cache/test_partial_prefix_cache_primitives.py",
        "v1/core/test_single_type_kv_cache_manager.py",
        "v1/core/test_deferred_block_free.py",
    )),
    Suite("bisect", "bisect"),
    Suite("checks", "checks", workers=2),
    Suite("mutations", "mutations"),
    Suite("served", "served"),
]  # fmt: skip


def file_markers(paths: list[str]) -> dict[str, str]:
    """The marker each of ``paths`` runs with in its pytest suite, if any."""
    markers = {p: s.marker for s in SUITES for p in s.paths if s.marker}
    return {p: markers[p] for p in paths if p in markers}
