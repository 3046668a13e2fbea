"""The docs site's sources: the HTTP reference's copy of /openapi.json is the live server's, and the
README stays a page a newcomer reads (the rest lives on the site, which `make docs` builds with
--strict: CI runs it). LADLE_UPDATE_DOCS=1 rewrites the copy from the live server."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
from server_utils import Server

ROOT = Path(__file__).parents[1]
OPENAPI_COPY = ROOT / "docs" / "reference" / "openapi.json"


def test_the_http_reference_is_the_served_openapi_document(server: Server) -> None:
    served = httpx.get(f"{server.url}/openapi.json").json()
    if os.environ.get("LADLE_UPDATE_DOCS") == "1":
        OPENAPI_COPY.write_text(json.dumps(served, indent=1) + "\n")
    assert OPENAPI_COPY.exists(), "no docs/reference/openapi.json: run this test with LADLE_UPDATE_DOCS=1"
    if json.loads(OPENAPI_COPY.read_text()) != served:
        pytest.fail("docs/reference/openapi.json differs from the served /openapi.json: run this test with "
                    "LADLE_UPDATE_DOCS=1 and commit the file")


def test_the_readme_is_at_most_200_lines_and_points_at_the_site() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert "make docs" in readme and "docs/index.md" in readme


def test_every_page_is_in_the_nav_and_every_nav_entry_is_a_page() -> None:
    nav_pages = set()
    for line in (ROOT / "mkdocs.yml").read_text().split("\nnav:\n", 1)[1].splitlines():
        if line.strip().endswith(".md"):
            nav_pages.add(line.rsplit(":", 1)[1].strip())
    pages = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert nav_pages == pages


def test_every_flag_of_every_subcommand_says_what_it_does() -> None:
    """The command line reference is generated from the parsers: a flag without help would be a blank row."""
    import argparse

    from ladle.cli import SUBCOMMANDS, subcommand_parser

    def silent(parser: argparse.ArgumentParser, prog: str) -> list[str]:
        found = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    found += silent(sub, f"{prog} {name}")
            elif not isinstance(action, argparse._HelpAction) and not action.help:
                found.append(f"{prog} {'/'.join(action.option_strings) or action.dest}")
        return found

    missing = [flag for name in SUBCOMMANDS for flag in silent(subcommand_parser(name), f"ladle {name}")]
    assert not missing, f"flags without help: {missing}"
