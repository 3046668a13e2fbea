"""The one engine configuration; the CLI maps vLLM-named flags onto it."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field

from ladle.distributed.transfer_config import KVTransferConfig
from ladle.reasoning.parser import REASONING_PARSERS
from ladle.spec_decode.config import SpeculativeConfig

SCHEDULING_POLICIES = ("fcfs", "priority", "lpm")
QUANTIZATIONS = ("auto", "none", "int8", "fp8")  # ladle.model.quantization's and ladle.model.fp8's meanings
KV_8BIT_NAMES = ("int8", "fp8", "fp8_e4m3")  # ladle.model.kv_quant's formats (named here: no torch import)
EXECUTOR_BACKENDS = ("mp", "ray")  # ladle.distributed.tensor_parallel's
DEVICES = ("auto", "cpu", "cuda")  # ladle.platform's
ATTENTION_BACKENDS = ("auto", "torch", "triton")  # auto: the platform's own (torch on the CPU, triton on CUDA)
LOAD_FORMATS = ("auto", "dummy")  # dummy: random weights of the config's shapes, made where they are used
CPU_KV_CACHE_GIB = 4.0  # the CPU's pool when neither --kv-cache-memory-gib nor --num-kv-blocks is given


@dataclass
class EngineConfig:
    model: str | None = None  # HF folder, .gguf file, hub id ORG/NAME[:QUANT]; None: the embedded SmolLM2
    revision: str | None = None  # of a hub id: branch, tag or commit (None: the default branch)
    download_dir: str | None = None  # hub cache for a hub id (None: huggingface_hub's, HF_HUB_CACHE or HF_HOME/hub)
    served_model_name: str | None = None
    max_model_len: int | None = None  # None: the model's context, capped by the KV pool
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512  # token budget of one step (decodes + prefill chunks)
    long_prefill_token_threshold: int = 0  # >0: largest prefill chunk one sequence gets per step
    block_size: int = 16
    kv_cache_memory_gib: float | None = None  # None: CPU_KV_CACHE_GIB on the CPU; measured on CUDA (below)
    num_kv_blocks: int | None = None  # overrides kv_cache_memory_gib (tests force tiny pools)
    scheduling_policy: str = "fcfs"
    enable_prefix_caching: bool = True
    max_waiting_requests: int | None = None  # admission bound; past it the server answers 429
    num_threads: int | None = None  # torch intra-op threads; None: torch's default
    seed: int = 0  # for requests without their own seed
    deterministic: bool = False  # batch-invariant numerics: same bits cold or cached, alone or batched
    # compute dtype: auto (bf16 where the CPU computes it natively and faster), float32, ...;
    # LADLE_DTYPE sets the default (the test suite pins float32 with it)
    dtype: str = field(default_factory=lambda: os.environ.get("LADLE_DTYPE", "auto"))
    kv_cache_dtype: str = "auto"  # auto follows the compute dtype; int8 / fp8: 8 bits and a scale per token and head
    quantization: str = "auto"  # auto | none | int8 | fp8: how linear weights are held (ladle.model.quantization, fp8)
    speculative_config: SpeculativeConfig | None = None  # speculative decoding (ladle.spec_decode); None: off
    # multi-LoRA (ladle.lora): adapters by name=path, batched with the base model
    enable_lora: bool = False
    lora_modules: dict[str, str] = field(default_factory=dict)  # name -> PEFT folder, loaded at start
    max_loras: int = 1  # adapters resident for compute: at most this many in one step
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept in memory (least recently used paged out); None: max_loras
    # reasoning models (ladle.reasoning): think blocks, their budgets, and the effort-aware policy
    reasoning_parser: str | None = None  # splits <think>...</think> from the answer; None: replies are all content
    thinking_token_budget: int | None = None  # default budget of requests that set none; None: unlimited
    max_high_effort_seqs: int = 0  # >0: at most this many high-effort sequences run at once (the rest wait)
    high_effort_tokens: int = 1024  # a sequence whose thinking budget (else max_tokens) exceeds this is high-effort
    # the second KV tier (ladle.engine.kv_offload): evicted prefix blocks kept on local disk
    kv_offload_gib: float = 0.0  # 0: off
    kv_offload_dir: str | None = None  # where its files go (a private folder inside; None: the system temp dir)
    # hybrid models (Qwen3.5, Qwen3-Next): linear-attention states kept at block boundaries of cached prefixes
    max_state_snapshots: int = 64
    # vision-language models: the encoder cache's bound (each distinct image's tile embeddings, by content hash)
    mm_encoder_cache_mib: int = 256
    limit_mm_per_prompt: dict[str, int] = field(default_factory=dict)  # vLLM's: most items of a kind a prompt takes
    # disaggregated prefill/decode (ladle.distributed): this worker's role; None: serves whole requests only
    kv_transfer_config: KVTransferConfig | None = None
    # model parallelism (ladle.distributed.tensor_parallel): ranks that each compute a shard of the model
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False  # MoE experts spread whole over the ranks (all-to-all) instead of split
    distributed_executor_backend: str = "mp"  # how the ranks start: mp (local processes) or ray (a Ray cluster)
    # where it computes (ladle.platform): auto is CUDA when torch sees a GPU
    device: str = "auto"
    gpu_memory_utilization: float = 0.9  # CUDA: this share of the GPU's memory for weights, activations and KV
    enforce_eager: bool = False  # CUDA: no graphs (decode steps launch every kernel from Python)
    attention_backend: str = "auto"
    load_format: str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.kv_transfer_config, (dict, str)):
            self.kv_transfer_config = KVTransferConfig.parse(self.kv_transfer_config)
        if isinstance(self.speculative_config, (dict, str)):  # LLM(speculative_config={...}), as vLLM takes it
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}")
        from ladle.model.dtype import canonical_name  # validates the names early, with a clear message

        canonical_name(self.dtype)
        if self.kv_cache_dtype not in ("auto",) + KV_8BIT_NAMES:
            canonical_name(self.kv_cache_dtype)
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, not {self.quantization!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.block_size < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and block_size must be positive")
        if self.max_state_snapshots < 0:
            raise ValueError("max_state_snapshots (--max-state-snapshots) must be 0 or more")
        if self.mm_encoder_cache_mib < 0:
            raise ValueError("mm_encoder_cache_mib (--mm-encoder-cache-mib) must be 0 or more")
        if isinstance(self.limit_mm_per_prompt, str):
            self.limit_mm_per_prompt = mm_limits(self.limit_mm_per_prompt)
        if set(self.limit_mm_per_prompt) - {"image"} or any(n < 0 for n in self.limit_mm_per_prompt.values()):
            raise ValueError(f"limit_mm_per_prompt takes only {{'image': N}} with N >= 0, not "
                             f"{self.limit_mm_per_prompt!r}")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules (--lora-modules) needs enable_lora (--enable-lora)")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be positive")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}, not {self.reasoning_parser!r}")
        if self.thinking_token_budget is not None and (self.thinking_token_budget < 0 or self.reasoning_parser is None):
            raise ValueError("thinking_token_budget must be non-negative and needs reasoning_parser (--reasoning-parser)")
        if self.max_high_effort_seqs < 0 or self.high_effort_tokens < 0 or self.kv_offload_gib < 0:
            raise ValueError("max_high_effort_seqs, high_effort_tokens and kv_offload_gib must be non-negative")
        self._check_parallel()
        self._check_device()
        if self.max_num_batched_tokens < self.block_size:
            # canonical (scoring) chunks end on block boundaries: a smaller budget never reaches one
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                             f"block_size ({self.block_size})")

    @property
    def decode_graph_rows(self) -> int:
        """Rows of the largest decode step a graph replays: max_num_seqs decodes, or more where speculative
        verification computes more (each sequence's last token and its drafts)."""
        spec = self.speculative_config
        return max(self.max_num_seqs, spec.verify_rows(self.max_num_seqs)) if spec is not None else self.max_num_seqs

    def _check_device(self) -> None:
        for name, value, allowed in (("device", self.device, DEVICES),
                                     ("attention_backend", self.attention_backend, ATTENTION_BACKENDS),
                                     ("load_format", self.load_format, LOAD_FORMATS)):
            if value not in allowed:
                raise ValueError(f"{name} (--{name.replace('_', '-')}) must be one of {allowed}, not {value!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization (--gpu-memory-utilization) must be in (0, 1]")
        if self.kv_cache_memory_gib is not None and self.kv_cache_memory_gib <= 0:
            raise ValueError("kv_cache_memory_gib (--kv-cache-memory-gib) must be positive")

    def _check_parallel(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be at least 1")
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, not "
                             f"{self.distributed_executor_backend!r}")
        if self.tensor_parallel_size == 1:
            return
        # these read or write one rank's KV blocks or weights: not built for sharded ones yet
        clashes = {"enable_lora (--enable-lora)": self.enable_lora,
                   "load_format (--load-format) dummy": self.load_format == "dummy",
                   "kv_offload_gib (--kv-offload-gib)": self.kv_offload_gib > 0,
                   "kv_transfer_config (--kv-transfer-config)": self.kv_transfer_config is not None,
                   'speculative_config (--speculative-config) method "mtp"':
                   self.speculative_config is not None and self.speculative_config.method == "mtp"}
        bad = [name for name, on in clashes.items() if on]
        if bad:
            raise ValueError(f"tensor_parallel_size > 1 does not combine with {', '.join(bad)} yet")


def add_engine_arguments(parser) -> None:
    """Engine flags, with vLLM's names where vLLM has them."""
    g = parser.add_argument_group("engine")
    g.add_argument("model", nargs="?", default=None,
                   help="HF model folder, .gguf file, or Hugging Face Hub id ORG/NAME (ORG/NAME:QUANT for one "
                        "GGUF file of a repo), from the hub cache or downloaded (default: the embedded "
                        "SmolLM2-135M-Instruct)")
    g.add_argument("--revision", default=None, help="of a hub id: branch, tag or commit (default: main)")
    g.add_argument("--download-dir", default=None,
                   help="hub cache to look in and download to (default: huggingface_hub's, $HF_HUB_CACHE "
                        "or $HF_HOME/hub)")
    g.add_argument("--served-model-name", default=None,
                   help="the name the API serves the model under, in /v1/models and requests' `model` (default: "
                        "the model's folder or file name, or the hub id as given)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence, prompt plus output, in tokens (default: the model's context); never more "
                        "than the model's context or the KV pool holds")
    g.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs,
                   help="most sequences running at once; further requests wait in the queue")
    g.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens,
                   help="token budget of one step: decodes plus prefill chunks (at least --block-size)")
    g.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="largest prefill chunk one sequence gets in a step, in tokens, so a long prompt leaves "
                        "room for others (0: only the step's budget limits it)")
    g.add_argument("--block-size", type=int, default=EngineConfig.block_size,
                   help="tokens per KV block, the unit the KV pool is allocated and prefixes are cached in")
    g.add_argument("--kv-cache-memory-gib", type=float, default=None,
                   help=f"memory preallocated for the paged KV cache (default: {CPU_KV_CACHE_GIB} GiB on the CPU; "
                        "on CUDA what --gpu-memory-utilization leaves after weights and a profiled forward)")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="exact KV pool size in blocks (overrides memory)")
    g.add_argument("--scheduling-policy", "--schedule-policy", choices=SCHEDULING_POLICIES, default="fcfs",
                   help="fcfs, priority (request field `priority`, lower runs sooner) or lpm (longest cached prefix first)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the K/V of prompt prefixes computed before (a radix tree of KV blocks, the least "
                        "recently used evicted first; default: on)")
    g.add_argument("--no-prefix-cache", dest="enable_prefix_caching", action="store_false",
                   help="same as --no-enable-prefix-caching")
    g.add_argument("--max-waiting-requests", type=int, default=None,
                   help="queue bound: past it new requests get 429 with Retry-After")
    g.add_argument("--num-threads", type=int, default=None, help="torch threads (default: torch's choice)")
    g.add_argument("--seed", type=int, default=0,
                   help="seeds the sampling of requests that set no seed of their own, and --load-format "
                        "dummy's random weights")
    g.add_argument("--deterministic", action="store_true",
                   help="batch-invariant numerics: a prompt's logits are bit-identical cold or cached, "
                        "alone or batched (slower attention)")
    g.add_argument("--dtype", default=os.environ.get("LADLE_DTYPE", "auto"),
                   choices=("auto", "float32", "bfloat16", "float16", "float", "half"),
                   help="compute dtype; auto: bfloat16 where the CPU computes it natively and faster "
                        "(AMX-BF16, or AVX512-BF16 if a start-up measurement says so), else float32")
    g.add_argument("--kv-cache-dtype", default="auto",
                   choices=("auto", "float32", "bfloat16", "float16") + KV_8BIT_NAMES,
                   help="KV cache dtype; auto follows --dtype; int8 and fp8 (e4m3) store 8 bits with a float scale "
                        "per token and KV head: 3.8x float32's tokens in the same memory at head size 64")
    g.add_argument("--quantization", "-q", default="auto", choices=QUANTIZATIONS,
                   help="auto: weights as the checkpoint holds them (a GGUF's blocks served as grouped integers "
                        "with their scales: Q8_0 and Q6_K one to a byte, Q4_0, Q4_1 and Q4_K two to a byte; "
                        "float tensors as float); none: everything dequantised to float; int8: "
                        "float weights also quantised at load to int8 with a scale per output row; fp8: weights "
                        "quantised at load to float8 e4m3 with a scale per output row, activations per token "
                        "(GPUs with FP8, sm_89 and later; on the CPU a correctness path)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, as vLLM takes it: \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4}\'; also "draft_model" with "model": PATH, "early_exit" with '
                        '"draft_layers", and prompt_lookup_min, disable_by_batch_size (default 4); lossless: '
                        "greedy and seeded output unchanged")

    g = parser.add_argument_group("LoRA adapters")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (PEFT folders) over the base model, batched together; a request "
                        "names one in `model`")
    g.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="adapters to serve from the start (more at run time: POST /v1/load_lora_adapter)")
    g.add_argument("--max-loras", type=int, default=EngineConfig.max_loras,
                   help="adapters resident for compute at once: one step never mixes more; requests on "
                        "another adapter wait for a slot")
    g.add_argument("--max-lora-rank", type=int, default=EngineConfig.max_lora_rank,
                   help="the largest adapter rank accepted (slots are sized for it)")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept loaded in memory (default: --max-loras); the least recently used beyond "
                        "it are read from disk again when needed")

    g = parser.add_argument_group("reasoning models and long sessions")
    g.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="split <think>...</think> out of chat replies into reasoning_content (Qwen3, DeepSeek-R1; "
                        "deepseek_r1, qwen3 and think are one parser), or gpt-oss's analysis channel (gpt_oss, "
                        "or vLLM's openai_gptoss); enables thinking budgets")
    g.add_argument("--thinking-token-budget", type=int, default=None, metavar="N",
                   help="default thinking budget of requests that set none (thinking_token_budget or "
                        "reasoning_effort): past N reasoning tokens the engine closes the think block itself")
    g.add_argument("--max-high-effort-seqs", type=int, default=0, metavar="N",
                   help="effort-aware scheduling: at most N high-effort sequences run at once and low-effort "
                        "ones are admitted first, so long thinking cannot starve short requests (0: off)")
    g.add_argument("--high-effort-tokens", type=int, default=EngineConfig.high_effort_tokens, metavar="N",
                   help="a request is high-effort when its thinking budget (else its max_tokens) exceeds N")
    g.add_argument("--limit-mm-per-prompt", type=mm_limits, default={}, metavar="JSON",
                   help='vision-language models: the most images one prompt may hold, e.g. \'{"image": 2}\' '
                        "(vLLM's flag; default: no limit); a prompt over it is a 400 naming the first image past it")
    g.add_argument("--mm-encoder-cache-mib", type=int, default=EngineConfig.mm_encoder_cache_mib, metavar="MIB",
                   help="vision-language models: the vision encoder's outputs kept by image content hash, least "
                        "recently used dropped first, so an image sent again is not encoded again (0: none kept)")
    g.add_argument("--max-state-snapshots", type=int, default=EngineConfig.max_state_snapshots,
                   help="hybrid models (Qwen3.5, Qwen3-Next): how many linear-attention states the prefix cache "
                        "keeps, one per cached block boundary, least recently used dropped first; each costs one "
                        "sequence's state (the start log says how much). A prefix hit ends where one is kept")
    g.add_argument("--kv-offload-gib", type=float, default=0.0,
                   help="a second KV tier: prefix blocks the cache evicts are kept in up to this much local disk "
                        "and read back on a later prefix hit instead of recomputed (0: off)")
    g.add_argument("--kv-offload-dir", default=None,
                   help="folder for the tier's files (a private subfolder, removed at exit; default: the temp dir)")
    g = parser.add_argument_group("device")
    g.add_argument("--device", choices=DEVICES, default="auto",
                   help="where the model computes: auto is cuda when torch sees an NVIDIA GPU, else cpu")
    g.add_argument("--gpu-memory-utilization", type=float, default=EngineConfig.gpu_memory_utilization,
                   help="CUDA: the share of the GPU's memory this engine may use (weights, activations measured "
                        "by a profiling forward, and the KV pool: the rest of it); --kv-cache-memory-gib wins")
    g.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: do not capture CUDA graphs for decode steps")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="paged attention kernels: torch (the CPU's), triton (CUDA's; on the CPU only under "
                        "TRITON_INTERPRET=1, for tests); auto: the device's own")
    g.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                   help="dummy: random weights of the shapes config.json gives, made on the device (benchmarks "
                        "of a model's shape without its checkpoint)")
    g = parser.add_argument_group("disaggregated prefill/decode")
    g.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                   help='this worker\'s role, as vLLM takes it: \'{"kv_role": "kv_producer", "kv_port": 14579}\' '
                        "(a prefill worker serving its K/V over TCP), kv_consumer (a decode worker fetching it) "
                        "or kv_both; behind `ladle router --prefill URL --decode URL`")
    g = parser.add_argument_group("model parallelism")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over N ranks (processes joined by torch.distributed, gloo on CPU): "
                        "attention heads and MLP columns/rows, KV heads per rank, the LM head by vocabulary")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE models: place whole experts on the tensor-parallel ranks (all-to-all dispatch and "
                        "combine) instead of splitting every expert")
    g.add_argument("--distributed-executor-backend", choices=EXECUTOR_BACKENDS, default="mp",
                   help="how the tensor-parallel ranks start: mp, local processes; ray, actors on the Ray cluster "
                        "at RAY_ADDRESS (or a local one), which needs `pip install 'ladle[ray]'`")


def lora_modules(specs: list[str]) -> dict[str, str]:
    """NAME=PATH specs (vLLM also takes JSON objects with name and path) -> {name: path}."""
    import json

    out = {}
    for spec in specs:
        if spec.lstrip().startswith("{"):
            obj = json.loads(spec)
            name, path = obj.get("name"), obj.get("path")
        else:
            name, _, path = spec.partition("=")
        if not name or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH, not {spec!r}")
        out[name.strip()] = path.strip()
    return out


def mm_limits(value: str) -> dict[str, int]:
    """--limit-mm-per-prompt as vLLM takes it: a JSON object of counts by modality, e.g. {"image": 2}."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict) or not all(isinstance(n, int) for n in parsed.values()):
        raise argparse.ArgumentTypeError(f'expected a JSON object of counts, e.g. \'{{"image": 2}}\', not {value!r}')
    return parsed


def engine_config_from_args(args) -> EngineConfig:
    return EngineConfig(
        model=args.model, revision=args.revision, download_dir=args.download_dir,
        served_model_name=args.served_model_name, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold, block_size=args.block_size,
        kv_cache_memory_gib=args.kv_cache_memory_gib, num_kv_blocks=args.num_kv_blocks,
        scheduling_policy=args.scheduling_policy, enable_prefix_caching=args.enable_prefix_caching,
        max_waiting_requests=args.max_waiting_requests, num_threads=args.num_threads, seed=args.seed,
        deterministic=args.deterministic, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        speculative_config=SpeculativeConfig.parse(args.speculative_config) if args.speculative_config else None,
        enable_lora=args.enable_lora, lora_modules=lora_modules(args.lora_modules), max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras,
        reasoning_parser=args.reasoning_parser, thinking_token_budget=args.thinking_token_budget,
        max_high_effort_seqs=args.max_high_effort_seqs, high_effort_tokens=args.high_effort_tokens,
        kv_offload_gib=args.kv_offload_gib, kv_offload_dir=args.kv_offload_dir,
        max_state_snapshots=args.max_state_snapshots, limit_mm_per_prompt=args.limit_mm_per_prompt,
        mm_encoder_cache_mib=args.mm_encoder_cache_mib,
        kv_transfer_config=KVTransferConfig.parse(args.kv_transfer_config) if args.kv_transfer_config else None,
        tensor_parallel_size=args.tensor_parallel_size, enable_expert_parallel=args.enable_expert_parallel,
        distributed_executor_backend=args.distributed_executor_backend,
        device=args.device, gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
        attention_backend=args.attention_backend, load_format=args.load_format,
    )
