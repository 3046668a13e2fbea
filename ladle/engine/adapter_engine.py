"""An AsyncEngine seen through one LoRA adapter: every request it takes runs on that adapter."""

from __future__ import annotations

from collections.abc import AsyncIterator

from ladle.engine.async_engine import AsyncEngine, RequestStream
from ladle.engine.request import StepOutput
from ladle.engine.sampling_params import SamplingParams


class AdapterEngine:
    """An AsyncEngine whose requests all run on one adapter, for code written against AsyncEngine
    (decisions, scoring) that should not thread an adapter through every call."""

    def __init__(self, engine: AsyncEngine, lora: str):
        self._engine, self.lora = engine, lora

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          priority: int = 0) -> RequestStream:
        return await self._engine.add_request(request_id, prompt, params, priority, self.lora)

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       priority: int = 0) -> AsyncIterator[StepOutput]:
        async for out in self._engine.generate(request_id, prompt, params, priority, self.lora):
            yield out

    def __getattr__(self, name: str):  # everything else is the engine's own
        return getattr(self._engine, name)
