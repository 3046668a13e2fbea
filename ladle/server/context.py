"""What every route needs, owned by the app (app.state.ctx) rather than a module global."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import Request

from ladle.config import EngineConfig
from ladle.decisions.extensions import Extensions
from ladle.engine.async_engine import AsyncEngine
from ladle.server.errors import APIError
from ladle.server.logprobs import TokenNames
from ladle.server.metrics import Metrics

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"


@dataclass
class ServerContext:
    engine: AsyncEngine
    model_name: str
    model_root: str | None = None
    decision_extensions: Extensions | None = None  # calibrations and heads questions may name
    tool_call_parser: str | None = None  # tool_choice "auto" parses replies with it; None: "auto" refused
    created: int = field(default_factory=lambda: int(time.time()))
    names: TokenNames = field(init=False)
    metrics: Metrics = field(init=False)

    def __post_init__(self) -> None:
        self.names = TokenNames(self.engine.tokenizer)
        self.metrics = Metrics(self.engine, self.model_name)

    def check_model(self, model: str | None) -> None:
        """Requests may omit the model (as vLLM allows) or must name the one served.
        An unknown model is a bad parameter: 400 naming `model`, as ladle's API promises."""
        if model is not None and model != self.model_name:
            raise APIError(400, f"The model `{model}` does not exist (this server serves `{self.model_name}`).",
                           param="model", code="model_not_found")


def get_context(request: Request) -> ServerContext:
    return request.app.state.ctx


def served_model_name(config: EngineConfig) -> str:
    """--served-model-name, else the model's folder or file name, else the embedded model's name."""
    if config.served_model_name:
        return config.served_model_name
    if config.model is None:
        return DEFAULT_SERVED_NAME
    path = Path(config.model)
    return path.stem if path.suffix.lower() == ".gguf" else path.resolve().name
