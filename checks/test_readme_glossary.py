# SPDX-License-Identifier: Apache-2.0
"""README defines each word of its glossary before it first uses it."""

import re

from forktools.paths import ROOT

README = ROOT / "README.md"
SECTION = "## Words used here"


def _terms(text: str) -> list[tuple[str, int]]:
    """(word, offset of its entry) for each ``- **term**:`` of the glossary.

    ``A / B`` defines both words; ``Layout codes`` defines the codes its
    entry names (``LBNHC`` ...).
    """
    start = text.index(SECTION + "\n")
    body = text[start : text.index("\n## ", start + 1)]
    entries = list(re.finditer(r"^- \*\*(.+?)\*\*:", body, re.M))
    terms = []
    for m, nxt in zip(entries, [*entries[1:], None], strict=True):
        entry = body[m.start() : nxt.start() if nxt else len(body)]
        words = m.group(1).split(" / ")
        if m.group(1) == "Layout codes":
            words = re.findall(r"`([BLHNC]{5})`", entry)
        terms += [(word, start + m.start()) for word in words]
    return terms


def test_glossary_terms_are_defined_before_first_use() -> None:
    text = README.read_text(encoding="utf-8")
    terms = _terms(text)
    assert len(terms) >= 10, terms
    late = []
    title = text.index("\n")  # the page's name is not a use
    for word, entry in terms:
        # "Oracle" is also "oracle"; "READ" and "MLA" only as written.
        forms = {word, word.lower()} if word[1:].islower() else {word}
        pattern = "|".join(re.escape(form) for form in forms)
        m = re.compile(rf"(?<![\w-])(?:{pattern})(?![\w-])").search(text, title)
        assert m, f"{word!r} is in the glossary but not used"
        if m.start() < entry:
            line = text.count("\n", 0, m.start()) + 1
            late.append(f"{word!r} (line {line})")
    assert not late, f"used before the glossary defines them: {late}"
