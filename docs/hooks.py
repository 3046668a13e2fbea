"""MkDocs hooks: the reference pages generated from the code, so that they cannot drift from it.

On a page, the line `<!-- generated: cli -->` becomes every `ladle` subcommand's flags, read from the
argparse parsers the CLI itself builds, and `<!-- generated: http -->` becomes every HTTP route with
its request fields, read from docs/reference/openapi.json: the served `/openapi.json`, which
tests/test_docs.py holds equal to a live server's. (The Python API pages use mkdocstrings.)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

DOCS = Path(__file__).parent
MARKERS = {"<!-- generated: cli -->": lambda: cli_reference(), "<!-- generated: http -->": lambda: http_reference()}


def on_page_markdown(markdown: str, **_: Any) -> str:
    for marker, render in MARKERS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, render())
    return markdown


# -- the command line --------------------------------------------------------------------------------


def cli_reference() -> str:
    from ladle.cli import SUBCOMMANDS, subcommand_parser

    return "\n".join(parser_section(subcommand_parser(name), level=2) for name in SUBCOMMANDS)


def parser_section(parser: argparse.ArgumentParser, level: int) -> str:
    """A heading for the parser's command, its description, a table of its flags, then each of its
    subcommands' sections one level down."""
    lines = [f"{'#' * level} `{parser.prog}`", ""]
    if parser.description:
        lines += [_one_line(parser.description), ""]
    rows = [action for action in parser._actions
            if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction))]
    if rows:
        lines += ["| flag | default | what it does |", "| --- | --- | --- |"]
        lines += [flag_row(action) for action in rows]
        lines.append("")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases map to the same parser
                lines.append(parser_section(sub, level + 1))
    return "\n".join(lines)


def flag_row(action: argparse.Action) -> str:
    names = ", ".join(f"`{name}`" for name in action.option_strings) or f"`{action.dest}` (positional)"
    if action.metavar and action.option_strings and action.nargs != 0:
        names += f" `{action.metavar if isinstance(action.metavar, str) else ' '.join(action.metavar)}`"
    default = "" if action.default in (None, argparse.SUPPRESS, False) or action.nargs == 0 else f"`{action.default}`"
    what = _one_line(action.help % vars(action) if action.help and "%(" in action.help else action.help or "")
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        what += f" (one of: {', '.join(f'`{c}`' for c in action.choices)})"
    if action.required:
        what = "**required.** " + what
    return f"| {names} | {_cell(default)} | {_cell(what)} |"


# -- the HTTP API ------------------------------------------------------------------------------------


def http_reference() -> str:
    spec = json.loads((DOCS / "reference" / "openapi.json").read_text())
    schemas = spec.get("components", {}).get("schemas", {})
    lines = []
    for path, methods in spec["paths"].items():
        for method, op in methods.items():
            lines += [f"## `{method.upper()} {path}`", ""]
            if op.get("summary") or op.get("description"):
                lines += [_one_line(op.get("description") or op["summary"]), ""]
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            if body:
                lines += request_fields(_resolve(body, schemas), schemas)
    return "\n".join(lines)


def request_fields(schema: dict, schemas: dict) -> list[str]:
    properties = schema.get("properties", {})
    if not properties:
        return [f"Request body: {_type_of(schema, schemas)}.", ""]
    required = set(schema.get("required", []))
    lines = ["| field | type | what it does |", "| --- | --- | --- |"]
    for name, prop in properties.items():
        what = _one_line(prop.get("description", ""))
        if name in required:
            what = "**required.** " + what
        lines.append(f"| `{name}` | {_cell(_type_of(prop, schemas))} | {_cell(what)} |")
    return lines + [""]


def _resolve(schema: dict, schemas: dict) -> dict:
    while "$ref" in schema:
        schema = schemas[schema["$ref"].rsplit("/", 1)[1]]
    return schema


def _type_of(schema: dict, schemas: dict) -> str:
    if "$ref" in schema:
        return schema["$ref"].rsplit("/", 1)[1]
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " or ".join(dict.fromkeys(_type_of(s, schemas) for s in schema[key]))
    kind = schema.get("type", "any")
    if kind == "array":
        return f"array of {_type_of(schema.get('items', {}), schemas)}"
    if "enum" in schema:
        return " or ".join(f"`{v}`" for v in schema["enum"])
    return kind


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _cell(text: str) -> str:
    return text.replace("|", "\\|")
