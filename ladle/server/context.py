"""What every route needs, owned by the app (app.state.ctx) rather than a module global."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import Request

from ladle.config import EngineConfig
from ladle.decisions.extensions import Extensions
from ladle.distributed.kv_transfer import KVTransferServer, TransferStats
from ladle.engine.async_engine import AsyncEngine
from ladle.engine.multimodal import ImagePrompt
from ladle.errors import InvalidRequestError
from ladle.model.hub import parse_hub_id
from ladle.model.tokenizer import Tokenizer
from ladle.reasoning.parser import ThinkTags, is_harmony, tags_for
from ladle.server.errors import APIError
from ladle.server.harmony import check_parsers
from ladle.server.kv_transfer_metrics import KVTransferCollector
from ladle.server.parallel_metrics import ParallelCollector
from ladle.server.live import LiveRequests
from ladle.server.logprobs import TokenNames
from ladle.server.media import MediaLimits, load_image
from ladle.server.metrics import Metrics
from ladle.server.protocol import MAX_LOGPROBS
from ladle.server.response_store import DEFAULT_MAX_STORED_RESPONSES, ResponseStore

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ServedModel:
    """What a request's `model` names: the base model's served name, or one of its LoRA adapters."""

    name: str  # as responses echo it
    lora: str | None = None  # the adapter the engine runs the request on; None: the base model


@dataclass
class ServerContext:
    engine: AsyncEngine
    model_name: str
    model_root: str | None = None
    decision_extensions: Extensions | None = None  # calibrations and heads questions may name
    tool_call_parser: str | None = None  # tool_choice "auto" parses replies with it; None: "auto" refused
    chat_template: str | None = None  # --chat-template: replaces the tokenizer's for chat requests
    max_logprobs: int = MAX_LOGPROBS  # --max-logprobs: the most top logprobs a request may ask for
    max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES
    media: MediaLimits = field(default_factory=MediaLimits)  # how image URLs are fetched and decoded
    created: int = field(default_factory=lambda: int(time.time()))
    names: TokenNames = field(init=False)
    metrics: Metrics = field(init=False)
    chat_tokenizer: Tokenizer = field(init=False)  # the tokenizer chat prompts are rendered with
    responses: ResponseStore = field(init=False)  # /v1/responses kept for previous_response_id
    live: LiveRequests = field(default_factory=LiveRequests)  # what POST /v1/requests/{id}/cancel may name
    # disaggregated prefill/decode (ladle.server.kv_handover): K/V moved in and out, and a
    # prefill worker's TCP server (started with the app)
    transfer_stats: TransferStats = field(default_factory=TransferStats)
    kv_transfer_server: "KVTransferServer | None" = None

    def __post_init__(self) -> None:
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"max_logprobs must be in [0, {MAX_LOGPROBS}] (the engine returns at most {MAX_LOGPROBS})")
        check_parsers(self.engine.engine.config.reasoning_parser, self.tool_call_parser)
        self.names = TokenNames(self.engine.tokenizer)
        self.metrics = Metrics(self.engine, self.model_name)
        if self.engine.engine.config.kv_transfer_config is not None:
            self.metrics.registry.register(KVTransferCollector(self.transfer_stats, self.engine.engine.handoffs,
                                                               self.model_name))
        self.metrics.registry.register(ParallelCollector(self.engine.engine, self.model_name))
        tok = self.engine.tokenizer
        self.chat_tokenizer = tok if self.chat_template is None else with_chat_template(tok, self.chat_template)
        self.responses = ResponseStore(self.max_stored_responses)

    @property
    def reasoning_tags(self) -> "ThinkTags | None":
        """The think-block tags of --reasoning-parser; None: replies are all content."""
        name = self.engine.engine.config.reasoning_parser
        return None if name is None else tags_for(name)

    @property
    def harmony(self) -> bool:
        """Whether chat replies are gpt-oss's harmony messages (--reasoning-parser gpt_oss)."""
        return is_harmony(self.engine.engine.config.reasoning_parser)

    def check_logprobs(self, requested: int | None, param: str) -> None:
        if requested is not None and requested > self.max_logprobs:
            raise APIError(400, f"{param} is {requested}, more than this server returns ({self.max_logprobs}: "
                           "its --max-logprobs)", param=param)

    def check_images(self, images: list[tuple[str, str]]) -> None:
        """Before anything is fetched, a 400 naming the image part (its name, its URL) at fault: the first
        one to a text-only model, or the first past --limit-mm-per-prompt."""
        engine = self.engine.engine
        if images and engine.images is None:
            raise InvalidRequestError(f"{images[0][0]}: this model is text-only: it takes no images",
                                      param=images[0][0])
        limit = engine.config.limit_mm_per_prompt.get("image")
        if limit is not None and len(images) > limit:
            where = images[limit][0]
            raise InvalidRequestError(f"{where}: {len(images)} images in one prompt, over the limit of {limit} "
                                      "(--limit-mm-per-prompt)", param=where)

    async def image_prompt(self, text: str, images: list[tuple[str, str]]) -> ImagePrompt:
        """text and the images its parts name ((part name, URL), in order), fetched and decoded; a 400
        names the part that fails."""
        return ImagePrompt(text, tuple([await load_image(url, where, self.media) for where, url in images]))

    def check_model(self, model: str | None, status: int = 404) -> ServedModel:
        """The model a request names: omitted (as vLLM allows) or the served name is the base model,
        an adapter's name that adapter. Anything else is refused naming `model`: 404 as OpenAI and
        vLLM answer, 400 on the decisions routes (their contract makes every refusal a 400)."""
        if model is None or model == self.model_name:
            return ServedModel(self.model_name)
        adapters = [ref.name for ref in self.engine.list_loras()]
        if model in adapters:
            return ServedModel(model, model)
        served = ", ".join(f"`{name}`" for name in [self.model_name, *adapters])
        raise APIError(status, f"The model `{model}` does not exist (this server serves {served}).",
                       param="model", code="model_not_found")


def get_context(request: Request) -> ServerContext:
    return request.app.state.ctx


def with_chat_template(tokenizer: Tokenizer, template: str) -> Tokenizer:
    """The same tokenizer rendering chats with another template (a bad template raises jinja2.TemplateError)."""
    config = {"add_bos_token": tokenizer.add_bos_token, **tokenizer.special_tokens}
    return Tokenizer(tokenizer.backend, config, template, sorted(tokenizer.eos_token_ids))


def served_model_name(config: EngineConfig) -> str:
    """--served-model-name, else the model's folder or file name, or its hub id as given (vLLM's
    habit: `ladle serve org/name` serves "org/name"), else the embedded model's name."""
    if config.served_model_name:
        return config.served_model_name
    if config.model is None:
        return DEFAULT_SERVED_NAME
    path = Path(config.model)
    if not path.exists() and parse_hub_id(config.model) is not None:
        return config.model
    return path.stem if path.suffix.lower() == ".gguf" else path.resolve().name
