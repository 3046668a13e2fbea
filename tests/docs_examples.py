"""The code examples of the README and the docs site, read from their Markdown.

Every fenced ```python and ```bash block is an example. The line right before its fence may say how
it is checked (docs/contributing.md#examples-that-run):

    (nothing)                  it runs against a plain `ladle serve` on the embedded model
    <!-- server: FLAGS -->     it runs against `ladle serve FLAGS`
    <!-- not run: REASON -->   it does not run, for one of NOT_RUN's reasons; its `ladle` commands
                               still parse with ladle's own flags, its `make` targets exist, and
                               python compiles

and a block (of any language) after `<!-- output -->` shows the output of the example above it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).parents[1]
LANGUAGES = ("python", "bash")
NOT_RUN = ("starts a server", "needs a GPU", "needs several machines", "takes minutes", "needs files",
           "needs peer servers", "runs the test suite")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)\s*(?P<info>[^\s`]*)")
MARKER = re.compile(r"^\s*<!--\s*(?P<kind>server|not run|output)\s*(?::\s*(?P<value>.*?))?\s*-->\s*$")


@dataclass
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    marker: str = ""  # "", "server", "not run" or "output"
    value: str = ""  # the server's flags or the reason not to run
    output: Block | None = None  # the block shown as this example's output

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def is_example(self) -> bool:
        return self.language in LANGUAGES and self.marker != "output"


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of one Markdown file, each with the marker on the line before it, and each
    example with the output block that follows it."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        body, j = [], i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        before = MARKER.match(lines[i - 1]) if i > 0 else None
        block = Block(path, i + 1, opening["info"].lower(), "\n".join(body) + "\n",
                      before["kind"] if before else "", (before["value"] or "") if before else "")
        if block.marker == "output":
            if not found or not found[-1].is_example or found[-1].output is not None:
                raise ValueError(f"{block.where}: <!-- output --> follows no example")
            found[-1].output = block
        found.append(block)
        i = j + 1
    return found


def examples() -> list[Block]:
    return [b for path in markdown_files() for b in blocks(path) if b.is_example]


def commands(code: str) -> list[str]:
    """A bash block's commands: comments dropped, backslash continuations joined."""
    joined = re.sub(r"\\\n\s*", " ", code)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]
