"""The grammar layer on the engine: cache, masks, rollback, preemption, offline API."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from ladle import LLM, SamplingParams
from ladle.structured.matcher import GrammarState, apply_grammar_masks
from ladle.structured.spec import StructuredOutputsParams

POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                          "label": {"type": "string", "maxLength": 6}},
         "required": ["x", "label"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(smollm2_dir) -> LLM:
    return LLM(str(smollm2_dir))


def _allowed(state: GrammarState, vocab: int) -> torch.Tensor:
    logits = torch.zeros(1, vocab)
    apply_grammar_masks(logits, [0], [state])
    return torch.isfinite(logits[0])


def test_compiled_once_per_schema(llm: LLM) -> None:
    grammars = llm.engine.grammars
    first = grammars.compile(StructuredOutputsParams(json=POINT))
    hits = grammars.hits
    again = grammars.compile(StructuredOutputsParams(json=json.loads(json.dumps(POINT))))  # equal, not the same dict
    assert again is first and grammars.hits == hits + 1


def test_masks_follow_the_grammar_and_rollback_restores_them(llm: LLM) -> None:
    vocab, tok = llm.engine.model_config.vocab_size, llm.tokenizer
    state = GrammarState(llm.engine.grammars.compile(StructuredOutputsParams(json=POINT)))
    prefix, more = tok.encode('{"x": 3'), tok.encode(', "label": "ab')
    for t in prefix:
        assert state.accept(t)
    before = _allowed(state, vocab)
    allowed_text = {tok.decode([int(i)]) for i in before.nonzero()[:, 0].tolist()}
    assert "," in allowed_text and "}" not in allowed_text and "a" not in allowed_text  # label is required
    for t in more:
        assert state.accept(t)
    assert not torch.equal(_allowed(state, vocab), before)
    state.rollback(len(more))  # what speculative decoding does with rejected drafts
    assert torch.equal(_allowed(state, vocab), before) and state.num_accepted == len(prefix)
    assert not state.accept(tok.encode("]")[0])  # a forbidden token is refused, and changes nothing
    assert torch.equal(_allowed(state, vocab), before)


def test_unconstrained_rows_are_untouched() -> None:
    logits = torch.randn(3, 64)
    untouched = logits.clone()

    class Nothing:
        def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
            bitmask[row] = 0  # forbid everything

    apply_grammar_masks(logits, [1], [Nothing()])
    assert torch.equal(logits[[0, 2]], untouched[[0, 2]]) and torch.isneginf(logits[1]).all()


def test_offline_structured_generation_survives_preemption(smollm2_dir) -> None:
    llm = LLM(str(smollm2_dir), num_kv_blocks=11, block_size=8, max_num_batched_tokens=64)
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "A point as JSON, please."}])
    spec = StructuredOutputsParams(json=POINT)
    outs = llm.generate([prompt] * 6, [SamplingParams(temperature=1.0, seed=i, max_tokens=40, structured_outputs=spec)
                                       for i in range(6)])
    assert llm.engine.scheduler.num_preemptions > 0
    for out in outs:
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), POINT)
