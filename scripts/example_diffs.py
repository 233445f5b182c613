"""The docs' example diffs, regenerated from the examples: every ```diff block that follows a line naming
`diff -u examples/A.py examples/B.py` is that diff (module docstrings left out, unified, 3 lines of context).

    python scripts/example_diffs.py           # rewrite the blocks in docs/*.md
    python scripts/example_diffs.py --check   # exit 1 naming each stale block (tests/project/test_names.py runs it)
"""
from __future__ import annotations

import ast
import difflib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAMED = re.compile(r"diff -u (examples/[\w/]+\.py) (examples/[\w/]+\.py)")
BLOCK = re.compile(r"```diff\n.*?```", re.S)


def _without_docstring(path: Path) -> list[str]:
    text = path.read_text()
    body = ast.parse(text).body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        lines = text.splitlines(keepends=True)
        text = "".join(lines[body[0].end_lineno:])
    return text.splitlines(keepends=True)


def diff(a: str, b: str) -> str:
    out = difflib.unified_diff(_without_docstring(ROOT / a), _without_docstring(ROOT / b), n=3)
    lines = [ln if ln.endswith("\n") else ln + "\n" for ln in out][2:]  # no ---/+++ header
    return "```diff\n" + "".join(lines) + "```"


def regenerate(text: str) -> str:
    """Each named diff's next ```diff block, rewritten."""
    out, pos = [], 0
    for m in NAMED.finditer(text):
        if m.start() < pos:
            continue
        block = BLOCK.search(text, m.end())
        if block is None:
            continue
        out += [text[pos:block.start()], diff(m.group(1), m.group(2))]
        pos = block.end()
    return "".join(out) + text[pos:]


def main(argv: list[str]) -> int:
    stale = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = page.read_text()
        new = regenerate(text)
        if new != text:
            stale.append(str(page.relative_to(ROOT)))
            if "--check" not in argv:
                page.write_text(new)
    if stale and "--check" in argv:
        print(f"stale example diffs in {', '.join(stale)}: run python scripts/example_diffs.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
