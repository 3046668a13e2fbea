"""Offline API: `LLM(model).generate(prompts, SamplingParams(...))` and `.chat(messages)`."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Sequence

from ladle.config import EngineConfig
from ladle.engine.engine import LLMEngine
from ladle.engine.multimodal import ImagePrompt
from ladle.engine.request import RequestTimings, StepOutput, TokenLogprob
from ladle.engine.sampling_params import SamplingParams
from ladle.engine.stop import keep_stop_strings

Prompt = str | list[int] | dict[str, Any]  # a dict: vLLM's {"prompt": text, "multi_modal_data": {"image": ...}}
Messages = list[dict[str, Any]]


@dataclass(frozen=True)
class LoRARequest:
    """An adapter to run prompts on, as vLLM names it: loaded from lora_path on first use."""

    lora_name: str
    lora_int_id: int = 0  # vLLM's; ladle keys adapters by name
    lora_path: str | None = None


@dataclass
class Completion:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    label_logprobs: list[float] | None = None  # scoring requests (SamplingParams.label_token_ids)
    hidden_states: dict[int, list[float]] | None = None  # SamplingParams.hidden_state_layers: layer -> state
    num_reasoning_tokens: int | None = None  # --reasoning-parser: tokens inside the think block


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[Completion]
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (vLLM's RequestOutput field)
    timings: RequestTimings | None = None  # when it passed each stage, once finished

    def absorb(self, out: StepOutput) -> None:
        self.num_cached_tokens = out.num_cached_tokens
        self.timings = out.timings or self.timings
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        for d in out.deltas:
            c = self.outputs[d.index]
            c.text += d.text
            c.token_ids += d.token_ids
            c.logprobs += d.logprobs
            c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
            if d.label_logprobs is not None:
                c.label_logprobs = d.label_logprobs
            if d.hidden_states is not None:
                c.hidden_states = d.hidden_states
            if d.num_reasoning_tokens is not None:
                c.num_reasoning_tokens = d.num_reasoning_tokens


def _with_images(prompt: Prompt) -> str | list[int] | ImagePrompt:
    """vLLM's prompt with images, {"prompt": text, "multi_modal_data": {"image": one or a list}}, as the
    engine takes it (a plain prompt as it is)."""
    if not isinstance(prompt, dict):
        return prompt
    images = prompt.get("multi_modal_data", {}).get("image", [])
    return ImagePrompt(prompt["prompt"], tuple(images) if isinstance(images, (list, tuple)) else (images,))


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[GenerationResult]:
        """Run all prompts through the engine together; results come back in input order.
        lora_request: one adapter for every prompt, or one (or None: the base) per prompt."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        loras = lora_request if isinstance(lora_request, Sequence) else [lora_request] * len(prompts)
        results: dict[str, GenerationResult] = {}
        keeps_stop_strings: set[str] = set()
        for prompt, p, lora in zip(prompts, params_list, loras, strict=True):
            rid = str(next(self._ids))
            ids = self.engine.add_request(rid, _with_images(prompt), p, lora=self._adapter_name(lora))
            results[rid] = GenerationResult(rid, ids, [Completion(i) for i in range(p.n)])
            if p.include_stop_str_in_output:
                keeps_stop_strings.add(rid)
        bar = _progress(len(results)) if use_tqdm else None
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.request_id in keeps_stop_strings:
                    keep_stop_strings(out)
                results[out.request_id].absorb(out)
                if out.finished and bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return list(results.values())

    def _adapter_name(self, lora: LoRARequest | None) -> str | None:
        if lora is None:
            return None
        known = {ref.name: ref for ref in self.engine.list_loras()}
        if lora.lora_name not in known and lora.lora_path is not None:
            self.engine.add_lora(lora.lora_name, lora.lora_path)
        return lora.lora_name

    def chat(self, messages: Messages | Sequence[Messages], params: SamplingParams | None = None,
             use_tqdm: bool = False, **template_kwargs: Any) -> list[GenerationResult]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(m, add_generation_prompt=True, **template_kwargs)
                   for m in conversations]
        return self.generate(prompts, params, use_tqdm=use_tqdm)


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req")
