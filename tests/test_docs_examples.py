"""Every code example in the README and the docs works: each runs against a live server on the embedded
model, or, marked not run (a GPU, several machines, minutes of work), is checked as far as it can be
here: its `ladle` commands parse with ladle's own flags, its `make` targets and scripts exist, its
python compiles. Where the page shows an example's output, the example still prints that kind of
output. tests/docs_examples.py reads the blocks and their markers."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from docs_examples import FENCE, LANGUAGES, MARKER, NOT_RUN, ROOT, Block, blocks, commands, examples, markdown_files
from server_utils import Server, own_server

EXAMPLES = examples()
DEFAULT_URLS = ("http://127.0.0.1:8000", "http://localhost:8000")
MAKE_TARGETS = set(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), re.M))


@contextlib.contextmanager
def serve_with_flags(flags: str) -> Iterator[Server]:
    """`ladle serve FLAGS`, in this process: the flags parsed by its own parser, as the CLI builds it."""
    from ladle.server.cli import serving_config

    config, _, app_args = serving_config(ladle_parser("serve").parse_args(shlex.split(flags)))
    with own_server(config, **app_args) as server:
        yield server


@pytest.fixture(scope="module")
def served() -> Iterator[Callable[[str], Server]]:
    """served(flags): a server started with those flags, one per distinct set, for the module."""
    started: dict[str, Server] = {}
    with contextlib.ExitStack() as stack:
        def get(flags: str) -> Server:
            if flags not in started:
                started[flags] = stack.enter_context(serve_with_flags(flags))
            return started[flags]

        yield get


def ladle_parser(subcommand: str) -> argparse.ArgumentParser:
    from ladle.cli import SUBCOMMANDS, subcommand_parser

    assert subcommand in SUBCOMMANDS, f"ladle has no subcommand {subcommand!r}"
    return subcommand_parser(subcommand)


def pointed_at(code: str, url: str) -> str:
    for default in DEFAULT_URLS:
        code = code.replace(default, url)
    return code


def run(example: Block, url: str, workdir: Path) -> str:
    """The example's standard output, run against the server at `url` (its exit status 0)."""
    code = pointed_at(example.code, url)
    if example.language == "python":
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, example.where, "exec"), {"__name__": "__main__"})
        return out.getvalue()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", code], cwd=workdir, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, \
        f"{example.where}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return done.stdout


def shape(value: Any) -> Any:
    """What a JSON value's kind is made of: the keys of its objects, all the way down (lists by their
    first item), not their values."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return None


def assert_same_kind(shown: Block, printed: str) -> None:
    try:
        want = json.loads(shown.code)
    except ValueError:  # text: there must be some
        assert printed.strip(), f"{shown.where}: the example printed nothing"
        return
    assert shape(json.loads(printed)) == shape(want), f"{shown.where}: the example's JSON has other keys now"


def check_not_run(example: Block) -> None:
    assert example.value in NOT_RUN, f"{example.where}: not run for {example.value!r}, not one of {NOT_RUN}"
    if example.language == "python":
        compile(example.code, example.where, "exec")
        return
    for command in commands(example.code):
        argv = shlex.split(command, comments=True)
        while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", argv[0]):  # VAR=value before the command
            argv.pop(0)
        program = Path(argv[0]).name if argv else ""
        if program == "ladle" and len(argv) > 1 and not argv[1].startswith("-"):
            parse_or_fail(example, argv)
        elif program == "make":
            assert set(a for a in argv[1:] if "=" not in a and not a.startswith("-")) <= MAKE_TARGETS, \
                f"{example.where}: {command}: no such make target"
        elif program.startswith("python") and len(argv) > 1 and argv[1].endswith(".py"):
            assert (ROOT / argv[1]).is_file(), f"{example.where}: {argv[1]} does not exist"


def parse_or_fail(example: Block, argv: list[str]) -> None:
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            ladle_parser(argv[1]).parse_args(argv[2:])
    except SystemExit as e:
        if e.code not in (0, None):  # --help exits 0
            pytest.fail(f"{example.where}: `{shlex.join(argv)}` does not parse: {errors.getvalue().strip()}")


def test_every_marker_sits_on_a_fence_it_applies_to() -> None:
    assert len(EXAMPLES) >= 20
    for path in markdown_files():
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if re.match(r"\s*<!--\s*(server|not run|output)\b", line):
                where = f"{path.relative_to(ROOT)}:{i + 1}"
                assert MARKER.match(line) and MARKER.match(line)["kind"] == "output" or MARKER.match(line)["value"], \
                    f"{where}: a marker that does not parse: {line!r}"
                assert i + 1 < len(lines) and FENCE.match(lines[i + 1]), f"{where}: the marker is not on a fence"
        for block in blocks(path):
            assert block.marker in ("", "output") or block.language in LANGUAGES, \
                f"{block.where}: a {block.marker} marker on a {block.language or 'plain'} block, which never runs"


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.where for e in EXAMPLES])
def test_example(example: Block, request: pytest.FixtureRequest, served: Callable[[str], Server],
                 tmp_path: Path) -> None:
    if example.marker == "not run":
        check_not_run(example)
        return
    server = served(example.value) if example.marker == "server" else request.getfixturevalue("server")
    printed = run(example, server.url, tmp_path)
    if example.output is not None:
        assert_same_kind(example.output, printed)
