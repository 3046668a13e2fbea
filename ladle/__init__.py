"""ladle: a self-hosted LLM serving engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "LoRARequest", "SamplingParams", "EngineConfig", "__version__"]

if TYPE_CHECKING:
    from ladle.config import EngineConfig
    from ladle.engine.sampling_params import SamplingParams
    from ladle.llm import LLM, LoRARequest


def __getattr__(name: str) -> Any:
    # Lazy, so that `import ladle` (and the CLI) does not pay for torch until it is needed.
    if name in ("LLM", "LoRARequest"):
        from ladle import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from ladle.engine.sampling_params import SamplingParams

        return SamplingParams
    if name == "EngineConfig":
        from ladle.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)
