"""Voice-agent turns against `ladle serve` on the embedded model: wait for the end of turn vs eager drafts.

Starts `ladle serve` on a free port (flags after `--` go to it), replays the shipped voice turn scripts
in real time with `ladle bench voice` in both modes (interleaved passes, --repeat per mode, server
timings recorded), and reports per mode p50/p95 of end of speech -> first token and -> first sentence,
draft use and cancellation, wasted tokens, and the median ratio eager/wait. Writes the distributions
as a PNG and the bench's result (with the machine) as JSON next to it.

Usage: python benchmarks/voice.py [--repeat 3] [--max-concurrency 4] [--copies 1] [--cancel route] [--script booking]
                                  [--png docs/voice.png] [--json docs/voice.json] [--quick] [-- SERVE FLAGS ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_name, free_port, machine, running_server  # noqa: E402

from ladle.bench.voice_report import format_voice_table, plot_voice  # noqa: E402

LADLE = str(Path(sys.executable).with_name("ladle"))  # the venv's console script
# --quick: one caller, one turn of about a second with an eager draft the caller resumes past
QUICK_SCRIPT = {"conversation": "quick", "turn": 0, "system": "You are a helpful assistant on a phone line.",
                "events": [{"at": 0.05, "type": "partial", "text": "Can I book"},
                           {"at": 0.2, "type": "eager", "text": "Can I book"}, {"at": 0.4, "type": "resumed"},
                           {"at": 0.6, "type": "partial", "text": "Can I book a table"},
                           {"at": 0.8, "type": "eager", "text": "Can I book a table"},
                           {"at": 1.0, "type": "end", "text": "Can I book a table?"}]}


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """This script's flags, and the `ladle serve` flags after `--`."""
    serve_flags: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, serve_flags = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=3, help="replays of the scripts per mode")
    p.add_argument("--max-concurrency", type=int, default=4, help="conversations at once")
    p.add_argument("--copies", type=int, default=1, help="callers per shipped conversation in each pass")
    p.add_argument("--cancel", choices=("disconnect", "route"), default="route",
                   help="how drafts are cancelled (route falls back to disconnect where the server has none)")
    p.add_argument("--script", nargs="+", default=None, help="turn scripts (default: every shipped one)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--no-server-timings", action="store_true", help="for a server without include_timings")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for /health")
    p.add_argument("--png", default=None, help="default: docs/voice.png (--quick: a temporary folder)")
    p.add_argument("--json", default=None, help="default: the PNG's path with .json")
    p.add_argument("--replot", default=None, metavar="JSON", help="only redraw the PNG from a saved JSON")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: one one-turn script, one replay per mode, 16 tokens; no files under docs/")
    args = p.parse_args(argv)
    if args.quick:
        args.repeat, args.max_tokens = 1, 16
        quick = Path(tempfile.mkdtemp(prefix="ladle-voice-quick-"))
        if args.script is None:
            (quick / "quick.jsonl").write_text(json.dumps(QUICK_SCRIPT) + "\n")
            args.script = [str(quick / "quick.jsonl")]
        args.png = args.png or str(quick / "voice.png")
    args.png = args.png or "docs/voice.png"
    return args, serve_flags


def bench(args: argparse.Namespace, serve_flags: list[str], work: Path) -> tuple[dict, int, list[str]]:
    port = free_port()
    serve_cmd = [LADLE, "serve", "--host", "127.0.0.1", "--port", str(port), "--uvicorn-log-level", "warning",
                 *serve_flags]
    with running_server(serve_cmd, dict(os.environ), port, work / "serve.log", args.startup_timeout) as base:
        cmd = [LADLE, "bench", "voice", "--base-url", base, "--repeat", str(args.repeat),
               "--max-concurrency", str(args.max_concurrency), "--copies", str(args.copies), "--cancel", args.cancel,
               "--max-tokens", str(args.max_tokens), "--result-dir", str(work), "--result-filename", "voice.json"]
        if not args.no_server_timings:
            cmd.append("--server-timings")
        if args.script:
            cmd += ["--script", *args.script]
        print(f"\n== ladle bench voice ==\n  $ {' '.join(cmd)}", flush=True)
        with open(work / "bench.log", "wb") as log:  # the table is printed below, once; progress stays on stderr
            rc = subprocess.run(cmd, stdout=log).returncode
        if not (work / "voice.json").exists():
            sys.stdout.write((work / "bench.log").read_text(errors="replace"))
            raise RuntimeError(f"ladle bench voice exited with {rc} and wrote no result")
    return json.loads((work / "voice.json").read_text()), rc, serve_cmd


def report(result: dict) -> None:
    print(f"\nmachine: {result['machine']}")
    print(format_voice_table(result))
    ratios = result.get("ratios") or {}
    if ratios.get("p50_first_token") is not None:
        print(f"eager/wait, median end of speech -> first token: {ratios['p50_first_token']:.2f} "
              f"(first sentence {ratios['p50_first_sentence']:.2f})")
    for err in result.get("errors", [])[:5]:
        print(f"error: {err}")


def main() -> None:
    args, serve_flags = parse(sys.argv[1:])
    json_path = Path(args.json or Path(args.png).with_suffix(".json"))
    if args.replot:
        saved = json.loads(Path(args.replot).read_text())
        plot_voice(saved, args.png, saved.get("cpu"))
        print(f"wrote {args.png}")
        return
    with tempfile.TemporaryDirectory(prefix="ladle-voice-") as tmp:
        result, rc, serve_cmd = bench(args, serve_flags, Path(tmp))
    result["machine"], result["cpu"] = machine(), cpu_name()
    result["server_command"] = ["ladle", *serve_cmd[1:]]
    report(result)
    Path(args.png).parent.mkdir(parents=True, exist_ok=True)
    plot_voice(result, args.png, result["cpu"])
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.png} and {json_path}")
    sys.exit(rc)


if __name__ == "__main__":
    main()
