"""Structured outputs: what the grammar mask costs, what compiling costs, and what it buys.

  decode   ms per decode step at batch 1 and 16, unconstrained against a JSON-schema constraint
           (the same prompts; every row runs to max_tokens: unconstrained rows ignore EOS, the
           schema asks for a long array, so neither ends early), and the ratio
  compile  grammar compile time per schema: cold (first compile) and cached (the engine's cache)
  parse    of N seeded requests asking for JSON in words (temperature 0.7), the share whose
           unconstrained output fails to parse or to validate, against the constrained outputs

Runs offline on the engine (no HTTP), the embedded model by default.

Usage: python benchmarks/structured.py [--model PATH] [--dtype float32] [--requests 50] [--steps 48] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jsonschema
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
from common import machine  # noqa: E402

from ladle import LLM, SamplingParams  # noqa: E402
from ladle.structured.spec import StructuredOutputsParams  # noqa: E402

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 16}}, "required": ["name", "age", "city"], "additionalProperties": False}
PEOPLE = {"type": "array", "items": PERSON, "minItems": 64}  # long enough that no row ends before max_tokens
SCHEMAS = {
    "person": PERSON,
    "people": PEOPLE,
    "order": {"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "lines": {"type": "array", "maxItems": 5, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "maxLength": 8}, "qty": {"type": "integer", "minimum": 1, "maximum": 99},
            "price": {"type": "number", "minimum": 0}}, "required": ["sku", "qty", "price"]}},
        "status": {"enum": ["new", "paid", "shipped", "returned"]},
        "note": {"anyOf": [{"type": "string", "maxLength": 40}, {"type": "null"}]}},
        "required": ["id", "lines", "status"]},
}
TOPICS = ["a chef", "a pilot", "a teacher", "a farmer", "a painter", "a nurse", "a miner", "a poet", "a baker",
          "a sailor"]


def chat_prompt(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def ms_per_step(llm: LLM, batch: int, steps: int, constrained: bool) -> float:
    """Median ms of the decode steps once every row has its first token."""
    engine = llm.engine
    spec = StructuredOutputsParams(json=PEOPLE) if constrained else None
    for i in range(batch):
        ids = chat_prompt(llm, f"List people like {TOPICS[i % len(TOPICS)]} as a JSON array of objects.")
        params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=not constrained,
                                structured_outputs=spec)
        engine.add_request(f"{'c' if constrained else 'u'}{batch}-{i}", ids, params)
    times, prefilled = [], set()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        if len(prefilled) == batch and engine.has_unfinished_requests():
            times.append(dt)
        prefilled |= {o.request_id for o in outs if any(d.token_ids for d in o.deltas)}
    return 1e3 * statistics.median(times)


def decode_case(llm: LLM, steps: int, repeats: int = 3, batches: tuple[int, ...] = (1, 16)) -> list[str]:
    """Unconstrained and constrained runs alternate; each side keeps its fastest median (the
    machine's noise is larger than the mask's cost at batch 1)."""
    lines = ["| batch | unconstrained ms/step | JSON schema ms/step | ratio |", "| --- | --- | --- | --- |"]
    for batch in batches:
        ms_per_step(llm, batch, 4, True)  # warm: compile, first masks
        runs = {False: [], True: []}
        for _ in range(repeats):
            for constrained in (False, True):
                runs[constrained].append(ms_per_step(llm, batch, steps, constrained))
        plain, masked = min(runs[False]), min(runs[True])
        lines.append(f"| {batch} | {plain:.2f} | {masked:.2f} | {masked / plain:.3f}x |")
    return lines


def compile_case(llm: LLM) -> list[str]:
    from ladle.structured.grammar import GrammarCompiler

    e = llm.engine
    compiler = GrammarCompiler(e.tokenizer, e.model_config.vocab_size, sorted(e.eos_token_ids))
    t = time.perf_counter()
    compiler.compile(StructuredOutputsParams(regex="a"))  # builds the tokenizer info once
    setup = time.perf_counter() - t
    lines = [f"tokenizer info (once per engine): {setup * 1e3:.0f} ms", "",
             "| schema | cold ms | cached ms |", "| --- | --- | --- |"]
    for name, schema in SCHEMAS.items():
        spec = StructuredOutputsParams(json=schema)
        t = time.perf_counter()
        compiler.compile(spec)
        cold = time.perf_counter() - t
        t = time.perf_counter()
        compiler.compile(StructuredOutputsParams(json=json.loads(json.dumps(schema))))  # an equal schema, new object
        cached = time.perf_counter() - t
        lines.append(f"| {name} | {cold * 1e3:.1f} | {cached * 1e3:.3f} |")
    return lines


def parse_case(llm: LLM, n: int) -> list[str]:
    schema = SCHEMAS["person"]
    ask = ("Describe {topic} as a JSON object with keys name (string), age (integer) and city (string). "
           "Reply with the JSON only.")
    prompts = [chat_prompt(llm, ask.format(topic=TOPICS[i % len(TOPICS)])) for i in range(n)]
    results = {}
    for label, spec in (("unconstrained", None), ("JSON schema", StructuredOutputsParams(json=schema))):
        params = [SamplingParams(temperature=0.7, seed=i, max_tokens=96, structured_outputs=spec) for i in range(n)]
        outs = llm.generate(prompts, params, use_tqdm=True)
        results[label] = [_failure(o.outputs[0].text, schema) for o in outs]
    lines = ["| output | not JSON | JSON, fails the schema | valid |", "| --- | --- | --- | --- |"]
    for label, failures in results.items():
        counts = [sum(f == k for f in failures) for k in ("not json", "invalid", None)]
        lines.append(f"| {label} | " + " | ".join(f"{c}/{n} ({c / n:.0%})" for c in counts) + " |")
    return lines


def _failure(text: str, schema: dict) -> str | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return "not json"
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return "invalid"
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--steps", type=int, default=48, help="decode steps timed per case")
    ap.add_argument("--quick", action="store_true", help="smoke run: batches 1 and 2, 4 steps, one repeat, 2 requests")
    args = ap.parse_args()
    repeats, batches = (1, (1, 2)) if args.quick else (3, (1, 16))
    if args.quick:
        args.requests, args.steps = 2, 4
    llm = LLM(args.model, dtype=args.dtype)
    print(f"{machine()}; model {args.model or 'embedded SmolLM2-135M-Instruct'}; dtype {args.dtype}\n", flush=True)
    sections = [("Decode step with and without the grammar mask", lambda: decode_case(llm, args.steps, repeats, batches)),
                ("Grammar compile time", lambda: compile_case(llm)),
                (f"Parse failures over {args.requests} seeded requests", lambda: parse_case(llm, args.requests))]
    for title, run in tqdm(sections, desc="cases"):
        lines = run()
        print(f"\n## {title}\n\n" + "\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
