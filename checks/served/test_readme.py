# SPDX-License-Identifier: Apache-2.0
"""README's CPU P/D commands are the suite's; the served page is its data's.

No servers: these read files and build command lines only.
"""

from __future__ import annotations

import json
import re
import shlex

from checks.served import commands, report
from checks.served.models import LLAMA
from forktools.paths import ROOT

README = ROOT / "README.md"
SECTION = "## Run P/D with the series"
SUBSECTION = "### On CPU, as the test command runs it"


def _cpu_block() -> str:
    text = README.read_text(encoding="utf-8")
    assert text.count(SECTION + "\n") == 1, f"README has no '{SECTION}' section"
    section = text.split(SECTION + "\n", 1)[1].split("\n## ", 1)[0]
    assert SUBSECTION in section, f"'{SECTION}' has no '{SUBSECTION}'"
    sub = section.split(SUBSECTION, 1)[1]
    m = re.search(r"```bash\n(.*?)\n```", sub, re.S)
    assert m, f"no bash block under '{SUBSECTION}'"
    return m.group(1)


def test_readme_cpu_block_is_the_suites() -> None:
    assert _cpu_block() == commands.readme_block(), (
        "README's CPU commands differ from checks/served/commands.py; "
        "paste `python -m checks.served.commands` into README"
    )


def _words(cmd: str) -> list[str]:
    return shlex.split(cmd.replace("\\\n", " ").rstrip(" &"))


def test_readme_serve_lines_are_the_suites_command() -> None:
    """Each README server line, read as the shell reads it, is the suite's
    command for that role (the suite passes other ports, its site and
    interpreter, and the stock tree for stock servers)."""
    blocks = [b for b in _cpu_block().split("\n\n") if "cli.main serve" in b]
    assert len(blocks) == 2, blocks
    for block, role in zip(blocks, ("prefill", "decode"), strict=True):
        body = "\n".join(ln for ln in block.splitlines() if not ln.startswith("#"))
        port, side = commands.README_PORTS[role]
        cmd = commands.serve(LLAMA, "$MODEL", role, "build/vllm", port, side)
        expected = [f"{k}={v}" for k, v in cmd.env.items()] + cmd.argv
        assert _words(body) == expected, role


def test_served_page_regenerates_from_its_data() -> None:
    data = json.loads(report.DATA.read_text(encoding="utf-8"))
    assert report.PAGE.read_text(encoding="utf-8") == report.render(data), (
        "project-docs/served.md differs from what its data renders: "
        "run python -m checks.served.report --from-page-data"
    )
    assert report.PLOT.exists()
