"""Engine configuration: one flat, frozen `EngineArgs` (CLI flags come from its fields) and the
resolved, frozen sub-configs the engine runs on."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from peregrine import envs

if TYPE_CHECKING:
    import torch

    from peregrine.kv_cache.swap_cost import SwapCostModel
    from peregrine.layers.quantization import QuantizationConfig
    from peregrine.spec_decode.config import SpeculativeConfig

# NOTE: torch is imported inside the functions that need it, so that `peregrine --help` (whose
# flags come from EngineArgs) starts without importing torch.
_DTYPE_NAMES = {"float32": "float32", "float": "float32", "float16": "float16",
                "half": "float16", "bfloat16": "bfloat16"}
# A Hugging Face tokenizer folder holds at least one of these vocabulary files (or a *.tiktoken).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


@dataclass(frozen=True)
class EngineArgs:
    """Every knob a user can set; defaults live here and nowhere else."""

    model: str | None = None  # None -> the built-in demo model
    tokenizer: str | None = None
    revision: str | None = None  # of a Hugging Face model id: a branch, tag or commit
    download_dir: str | None = None  # where hub downloads go (default: the Hugging Face cache)
    served_model_name: str | None = None
    dtype: str = "auto"
    load_format: Literal["auto", "safetensors", "dummy"] = "auto"
    skip_tokenizer_init: bool = False
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    gpu_memory_utilization: float | None = None  # None: 0.9 on CUDA; refused on the CPU
    cpu_kv_cache_gb: float | None = None  # None: sized from the model (worker/kv_memory.py)
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    max_queue_len: int | None = None
    enforce_eager: bool = False
    # Mixed and prefill steps of up to this many tokens replay piecewise CUDA graphs (everything
    # but attention); 0 runs them eagerly. Decode-only steps always use full graphs.
    max_prefill_graph_tokens: int = 2048
    async_scheduling: bool | None = None  # None: on with CUDA (overlaps host and device work)
    # The scheduler and the model in a process of their own (None: on for the server on CUDA).
    engine_core_process: bool | None = None
    attention_backend: str | None = None  # torch | triton; None -> env or device default
    device: str = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # How the workers run: mp, one process per rank; ray, one Ray actor per rank (on one node or
    # several); uni, one worker in this process. None: mp when world > 1, else uni.
    distributed_executor_backend: Literal["mp", "ray", "uni"] | None = None
    quantization: str | None = None  # None: as the checkpoint's quantization_config says
    kv_cache_dtype: str = "auto"  # auto: the model dtype
    swap_space: float = 4.0  # GiB of (pinned) CPU memory per GPU for swapped-out KV blocks
    preemption_mode: Literal["auto", "recompute", "swap"] = "auto"
    # vLLM's keys: {"method": "ngram", "num_speculative_tokens": 4, ...} or {"model": PATH, ...};
    # a JSON string on the CLI (spec_decode/config.py).
    speculative_config: dict[str, Any] | None = None

    def create_engine_config(self) -> EngineConfig:
        """Resolve the model folder and validate every field."""
        return EngineConfig.from_args(self)


# One line of --help per EngineArgs field (the CLI's flags are generated from the fields).
ENGINE_ARGS_HELP: dict[str, str] = {
    "model": "local model folder or Hugging Face model id (default: the built-in demo model)",
    "tokenizer": "tokenizer folder or Hugging Face id (default: the model's)",
    "revision": "branch, tag or commit of a Hugging Face model id (default: main)",
    "download_dir": "where models fetched from the Hugging Face Hub are kept (default: its cache)",
    "served_model_name": "model name in the API (default: the model path)",
    "dtype": "weights and activations: auto (the checkpoint's), float32, float16, bfloat16",
    "load_format": "auto / safetensors: read the checkpoint; dummy: random weights",
    "skip_tokenizer_init": "load no tokenizer: prompts must be token ids, outputs carry no text",
    "seed": "seed of the sampler (requests without their own seed) and of dummy weights",
    "max_model_len": "longest prompt + output in tokens (default: the model's limit)",
    "block_size": "tokens per KV cache block (a power of two)",
    "gpu_memory_utilization": "fraction of GPU memory for weights, activations and the KV cache "
                              f"(default: {DEFAULT_GPU_MEMORY_UTILIZATION}; CUDA only)",
    "cpu_kv_cache_gb": "KV cache size on the CPU, in GiB (default: enough for max_num_seqs "
                       "sequences of max_model_len tokens, at most a quarter of the available "
                       "memory)",
    "num_gpu_blocks_override": "use this many KV cache blocks instead of sizing the cache from "
                               "memory (default: sized from memory)",
    "enable_prefix_caching": "reuse the KV cache of shared prompt prefixes",
    "max_num_seqs": "most requests running at once",
    "max_num_batched_tokens": "token budget of one step (default: 8192, at least max_model_len "
                              "without chunked prefill)",
    "enable_chunked_prefill": "split long prompts into chunks that share steps with decodes",
    "scheduling_policy": "fcfs: arrival order; priority: lowest priority value first "
                         "(ties by arrival), preempting lower-priority requests",
    "max_queue_len": "most waiting requests; more are refused (the server answers 429) "
                     "(default: no limit)",
    "enforce_eager": "run without CUDA graphs",
    "max_prefill_graph_tokens": "mixed and prefill steps up to this many tokens replay "
                                "piecewise CUDA graphs (0: run them eagerly)",
    "async_scheduling": "launch step N+1 while step N runs (default: on with CUDA)",
    "engine_core_process": "run the scheduler and the model in their own process, apart from "
                           "the API server (default: on for the server with CUDA)",
    "attention_backend": "torch (reference; the default on the CPU) or triton (the default on "
                         "CUDA; on the CPU only with TRITON_INTERPRET=1); also "
                         "$PEREGRINE_ATTENTION_BACKEND",
    "device": "auto, cpu or cuda[:N]",
    "tensor_parallel_size": "GPUs (or CPU processes) to split each layer over, one worker "
                            "each (on this host; on a Ray cluster's nodes with "
                            "--distributed-executor-backend ray)",
    "pipeline_parallel_size": "stages to split the decoder layers into, one group of "
                              "tensor_parallel_size workers each (uneven splits: "
                              "$PEREGRINE_PP_LAYER_PARTITION, e.g. 5,4)",
    "distributed_executor_backend": "how the workers run: mp (one process per rank, spawned), "
                                    "ray (one Ray actor per rank, on one node or several; needs "
                                    "the ray extra) or uni (one worker in the engine's process) "
                                    "(default: mp when "
                                    "tensor_parallel_size x pipeline_parallel_size > 1, else uni)",
    "quantization": "quantization method (default: the checkpoint's quantization_config; "
                    "must agree with it when both are given)",
    "kv_cache_dtype": "KV cache element type: auto (the model dtype), float16, bfloat16, float32, "
                      "fp8 (= fp8_e4m3, 1 byte: twice the tokens; scaled by the checkpoint's "
                      "k_scale / v_scale, else 1.0), fp8_e5m2",
    "swap_space": "CPU memory per GPU, in GiB, that holds the KV blocks of requests preempted by "
                  "swapping (pinned on CUDA; 0 turns swapping off; at most what max_num_seqs "
                  "sequences of max_model_len tokens can hold)",
    "preemption_mode": "how a request preempted for lack of KV blocks keeps its work: swap (its "
                       "blocks are copied to CPU memory and back), recompute (they are dropped "
                       "and its tokens prefilled again) or auto (per request, whichever costs "
                       "less: kv_cache/swap_cost.py)",
    "speculative_config": "speculative decoding as JSON, e.g. '{\"method\": \"ngram\", "
                          "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, "
                          "\"prompt_lookup_min\": 2}' or '{\"model\": DRAFT_PATH, "
                          "\"num_speculative_tokens\": 4}' (optional keys: quantization of "
                          "the draft, disable_by_batch_size); turns async scheduling off (default: off)",
}


def _bad(field_name: str, msg: str) -> ValueError:
    return ValueError(f"invalid {field_name}: {msg}")


@dataclass(frozen=True)
class ModelConfig:
    model: str
    tokenizer: str | None
    served_model_name: str
    architecture: str
    hf_config: dict[str, Any] = field(repr=False, hash=False, compare=False)
    dtype: torch.dtype
    max_model_len: int
    load_format: str
    skip_tokenizer_init: bool
    seed: int
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eos_token_ids: tuple[int, ...]
    generation_config: dict[str, Any] = field(repr=False, hash=False, compare=False)
    # The parsed quantization config (layers/quantization/), None when unquantized.
    quantization: QuantizationConfig | None = field(default=None, compare=False)

    @classmethod
    def from_args(cls, args: EngineArgs, model_dir: str) -> ModelConfig:
        from peregrine.layers.quantization import resolve_quantization
        path = Path(model_dir)
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise ValueError(f"model folder {model_dir!r} has no config.json (a Hugging Face "
                             "model folder holds config.json and its weights)")
        hf = json.loads(cfg_path.read_text())
        archs = hf.get("architectures") or []
        if not archs:
            raise ValueError(f"{cfg_path}: field 'architectures' is missing")
        for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size"):
            if key not in hf:
                raise ValueError(f"{cfg_path}: required field {key!r} is missing")
        num_heads = int(hf["num_attention_heads"])
        num_kv_heads = int(hf.get("num_key_value_heads") or num_heads)
        head_dim = int(hf.get("head_dim") or hf["hidden_size"] // num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(f"{cfg_path}: num_attention_heads {num_heads} is not a multiple of "
                             f"num_key_value_heads {num_kv_heads}")
        gen_cfg: dict[str, Any] = {}
        gen_path = path / "generation_config.json"
        if gen_path.is_file():
            gen_cfg = json.loads(gen_path.read_text())
        eos = gen_cfg.get("eos_token_id", hf.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        dtype = _resolve_dtype(args.dtype, hf)
        derived_max = int(hf.get("max_position_embeddings") or 2048)
        max_len = args.max_model_len or derived_max
        if max_len > derived_max:
            raise _bad("max_model_len", f"{max_len} exceeds the model's limit {derived_max} "
                       "(max_position_embeddings in config.json)")
        if max_len < 1:
            raise _bad("max_model_len", f"must be >= 1, got {max_len}")
        if args.load_format not in ("auto", "safetensors", "dummy"):
            raise _bad("load_format", f"{args.load_format!r} (expected auto, safetensors or dummy)")
        return cls(
            model=str(path), tokenizer=_tokenizer_path(args, path),
            served_model_name=args.served_model_name or (args.model or "peregrine-demo"),
            architecture=archs[0], hf_config=hf, dtype=dtype, max_model_len=int(max_len),
            load_format=args.load_format, skip_tokenizer_init=args.skip_tokenizer_init,
            seed=args.seed, vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
            num_layers=int(hf["num_hidden_layers"]), num_heads=num_heads,
            num_kv_heads=num_kv_heads, head_dim=head_dim, eos_token_ids=eos_ids,
            generation_config=gen_cfg,
            quantization=resolve_quantization(hf, args.quantization),
        )


def _tokenizer_path(args: EngineArgs, model_dir: Path) -> str:
    """The tokenizer's folder: the model's, or --tokenizer as a folder or a hub id."""
    if args.skip_tokenizer_init:
        return args.tokenizer or str(model_dir)
    if args.tokenizer is None:
        folder = str(model_dir)
    else:
        from peregrine.hub import resolve_model_path
        folder = resolve_model_path(args.tokenizer, None, args.download_dir)
    check_tokenizer_folder(folder, given=args.tokenizer is not None)
    return folder


def check_tokenizer_folder(folder: str, given: bool = False) -> None:
    """A one-line ValueError when `folder` holds none of a Hugging Face tokenizer's files."""
    if any((Path(folder) / name).is_file() for name in TOKENIZER_FILES) or any(
            Path(folder).glob("*.tiktoken")):
        return
    what = "tokenizer folder" if given else "model folder"
    raise ValueError(f"{what} {folder!r} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, "
                     "...): pass --tokenizer with a folder or Hugging Face id that has them, or "
                     "--skip-tokenizer-init to send token ids and get token ids back")


def _resolve_dtype(dtype: str, hf: dict[str, Any]) -> torch.dtype:
    import torch
    if dtype == "auto":
        name = str(hf.get("torch_dtype") or hf.get("dtype") or "float32").replace("torch.", "")
        return getattr(torch, _DTYPE_NAMES.get(name, "float32"))
    if dtype not in _DTYPE_NAMES:
        raise _bad("dtype", f"{dtype!r} (expected auto, float32, float16 or bfloat16)")
    return getattr(torch, _DTYPE_NAMES[dtype])


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    gpu_memory_utilization: float
    cpu_kv_cache_gb: float | None  # None: sized from the model (worker/kv_memory.py)
    num_gpu_blocks_override: int | None
    enable_prefix_caching: bool
    cache_dtype: str = "auto"  # the KV cache's element type (attention/kv_dtype.py)
    swap_space: float = 0.0  # GiB of CPU swap space for preempted requests' KV blocks
    num_cpu_blocks: int = 0  # swap_space in blocks of the device cache's size (0: no swapping)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool
    policy: str
    max_queue_len: int | None
    preemption_mode: str = "auto"  # auto | recompute | swap
    # Swap-or-recompute costs for auto (None: auto recomputes).
    swap_cost: SwapCostModel | None = None
    # Steps in flight at once (pipeline_parallel_size): each holds requests no other one does.
    max_concurrent_batches: int = 1


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: str
    attention_backend: str
    enforce_eager: bool
    tensor_parallel_size: int
    async_scheduling: bool | None = None
    max_prefill_graph_tokens: int = 0
    engine_core_process: bool = False
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str = "uni"  # a key of executor.EXECUTOR_BACKENDS
    speculative: SpeculativeConfig | None = None
    # Decoder layers per pipeline stage, in stage order (sums to model.num_layers).
    pp_layer_partition: tuple[int, ...] = ()

    @property
    def world_size(self) -> int:
        """Workers the executor runs: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @classmethod
    def from_args(cls, args: EngineArgs) -> EngineConfig:
        if args.model is None:
            from peregrine.demo import demo_model_path
            model_dir = str(demo_model_path())
        else:
            from peregrine.hub import resolve_model_path
            model_dir = resolve_model_path(args.model, args.revision, args.download_dir)
        model = ModelConfig.from_args(args, model_dir)
        if args.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise _bad("block_size", f"{args.block_size} (expected a power of two up to 128)")
        gpu_util = args.gpu_memory_utilization
        if gpu_util is not None and not 0.0 < gpu_util <= 1.0:
            raise _bad("gpu_memory_utilization", f"{gpu_util} not in (0, 1]")
        if args.cpu_kv_cache_gb is not None and not args.cpu_kv_cache_gb > 0:
            raise _bad("cpu_kv_cache_gb", f"must be > 0, got {args.cpu_kv_cache_gb}")
        if args.num_gpu_blocks_override is not None and args.num_gpu_blocks_override < 1:
            raise _bad("num_gpu_blocks_override", "must be >= 1")
        if args.max_num_seqs < 1:
            raise _bad("max_num_seqs", "must be >= 1")
        if args.scheduling_policy not in ("fcfs", "priority"):
            raise _bad("scheduling_policy", f"{args.scheduling_policy!r} (expected fcfs or priority)")
        if args.max_prefill_graph_tokens < 0:
            raise _bad("max_prefill_graph_tokens", "must be >= 0 (0 turns the graphs off)")
        partition = _check_pipeline(args, model)
        executor_backend = _check_parallel(args, model)
        max_batched = args.max_num_batched_tokens
        if max_batched is None:
            max_batched = 8192 if args.enable_chunked_prefill else max(8192, model.max_model_len)
        if max_batched < 1:
            raise _bad("max_num_batched_tokens", "must be >= 1")
        if not args.enable_chunked_prefill and max_batched < model.max_model_len:
            raise _bad("max_num_batched_tokens", f"{max_batched} < max_model_len "
                       f"{model.max_model_len} with chunked prefill off")
        device = resolve_device(args.device)
        on_cuda = device.startswith("cuda")
        if gpu_util is not None and not on_cuda:
            raise _bad("gpu_memory_utilization", f"{gpu_util} was given but the engine runs on "
                       f"{device!r}, where it has no meaning; size the CPU KV cache with "
                       "cpu_kv_cache_gb instead (default: from the model)")
        backend = args.attention_backend or envs.attention_backend() or (
            "triton" if on_cuda else "torch")
        if backend not in ("torch", "triton"):
            raise _bad("attention_backend", f"{backend!r} (expected torch or triton)")
        if backend == "triton" and not on_cuda and not envs.triton_interpret():
            raise _bad("attention_backend", f"triton on {device!r} needs CUDA (Triton compiles "
                       "its kernels for the GPU): use the torch backend on the CPU, or set "
                       "TRITON_INTERPRET=1 to run the kernels in Triton's (slow) interpreter")
        from peregrine.attention.kv_dtype import check_kv_cache_dtype
        check_kv_cache_dtype(args.kv_cache_dtype)
        cache = CacheConfig(args.block_size,
                            DEFAULT_GPU_MEMORY_UTILIZATION if gpu_util is None else gpu_util,
                            args.cpu_kv_cache_gb,
                            args.num_gpu_blocks_override, args.enable_prefix_caching,
                            args.kv_cache_dtype)
        cache, swap_cost = _swap_config(args, cache, model, device, max(partition))
        sched = SchedulerConfig(args.max_num_seqs, max_batched, model.max_model_len,
                                args.enable_chunked_prefill, args.scheduling_policy,
                                args.max_queue_len, args.preemption_mode, swap_cost,
                                args.pipeline_parallel_size)
        spec = None
        async_scheduling = args.async_scheduling
        if args.speculative_config is not None:
            from peregrine.spec_decode.config import SpeculativeConfig
            # NOTE: async scheduling stays on: only the steps that propose or verify drafts
            # complete at once (StepPipeline in engine/core.py).
            spec = SpeculativeConfig.from_raw(args.speculative_config, args, model)
        return cls(model, cache, sched, device, backend, args.enforce_eager,
                   args.tensor_parallel_size, async_scheduling,
                   min(args.max_prefill_graph_tokens, max_batched),
                   bool(args.engine_core_process), args.pipeline_parallel_size, executor_backend,
                   spec, partition)


# EngineArgs fields that pipeline parallelism does not run with yet, refused by name when set:
# field -> what it turns on.
PIPELINE_UNSUPPORTED: dict[str, str] = {
    "speculative_config": "speculative decoding",
}


def _check_pipeline(args: EngineArgs, model: ModelConfig) -> tuple[int, ...]:
    """Validate pipeline_parallel_size; return the decoder layers of each stage."""
    pp = args.pipeline_parallel_size
    if pp < 1:
        raise _bad("pipeline_parallel_size", f"must be >= 1, got {pp}")
    if pp > 1:
        for name, what in PIPELINE_UNSUPPORTED.items():
            if getattr(args, name, None) not in (None, 0):
                raise _bad("pipeline_parallel_size", f"{pp} stages do not run with {what} "
                           f"({name} is set) yet")
    # NOTE: one stage holds every layer, whatever the variable says.
    spec = envs.pp_layer_partition() if pp > 1 else None
    return pipeline_layer_partition(model.num_layers, pp, spec)


def pipeline_layer_partition(num_layers: int, pp: int, spec: str | None = None
                             ) -> tuple[int, ...]:
    """Decoder layers per stage: `spec` ("5,4", from PEREGRINE_PP_LAYER_PARTITION) when given,
    else an even split whose remainder goes one layer each to the stages before the last (the
    last also holds the final norm and the LM head)."""
    if spec is not None:
        try:
            parts = tuple(int(x) for x in spec.split(","))
        except ValueError:
            raise ValueError(f"invalid PEREGRINE_PP_LAYER_PARTITION {spec!r}: expected "
                             f"{pp} comma-separated layer counts, e.g. "
                             f"{','.join(['2'] * pp)}") from None
        if len(parts) != pp:
            raise ValueError(f"invalid PEREGRINE_PP_LAYER_PARTITION {spec!r}: {len(parts)} "
                             f"stage(s) given, pipeline_parallel_size is {pp}")
        if min(parts) < 1:
            raise ValueError(f"invalid PEREGRINE_PP_LAYER_PARTITION {spec!r}: every stage "
                             "needs at least one layer")
        if sum(parts) != num_layers:
            raise ValueError(f"invalid PEREGRINE_PP_LAYER_PARTITION {spec!r}: the counts sum to "
                             f"{sum(parts)}, the model has {num_layers} layers")
        return parts
    if pp > num_layers:
        raise _bad("pipeline_parallel_size", f"{pp} stages for the model's {num_layers} layers "
                   "(each stage needs at least one)")
    base, extra = divmod(num_layers, pp)
    parts = [base] * pp
    for i in range(extra):
        parts[pp - 2 - i] += 1  # the second-to-last stage first; extra < pp spares the last
    return tuple(parts)


def _check_parallel(args: EngineArgs, model: ModelConfig) -> str:
    """Validate the tensor-parallel split; return the executor backend (mp, ray or uni)."""
    tp, world = args.tensor_parallel_size, args.tensor_parallel_size * args.pipeline_parallel_size
    if tp < 1:
        raise _bad("tensor_parallel_size", f"must be >= 1, got {tp}")
    hf = model.hf_config
    # NOTE: the vocabulary needs no check: the embedding and LM head pad it to a multiple of tp.
    sizes = {"num_attention_heads": model.num_heads, "num_key_value_heads": model.num_kv_heads,
             "intermediate_size": hf.get("intermediate_size")}
    for name, size in sizes.items():
        if size is not None and int(size) % tp:
            raise _bad("tensor_parallel_size", f"{tp} does not divide the model's {name} "
                       f"({size}); each rank holds an equal share")
    from peregrine.executor import EXECUTOR_BACKENDS
    backend = args.distributed_executor_backend or ("mp" if world > 1 else "uni")
    if backend not in EXECUTOR_BACKENDS:
        raise _bad("distributed_executor_backend", f"{backend!r} (expected "
                   f"{', '.join(sorted(EXECUTOR_BACKENDS))})")
    if backend == "uni" and world > 1:
        raise _bad("distributed_executor_backend", f"uni runs one worker, but tensor_parallel_size"
                   f" x pipeline_parallel_size is {world}: use mp (or ray)")
    if backend == "ray":
        from peregrine.executor.ray_executor import ray_missing
        missing = ray_missing()
        if missing:
            raise _bad("distributed_executor_backend", missing)
    if world > 1 and args.device.startswith("cuda:"):
        raise _bad("device", f"{args.device!r} names one GPU, but {world} workers use cuda:0 to "
                   f"cuda:{world - 1}: pass cuda (or limit CUDA_VISIBLE_DEVICES)")
    # NOTE: Ray places the ranks on its cluster's GPUs, which need not be this host's.
    if world > 1 and args.device in ("auto", "cuda") and backend != "ray":
        import torch
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if args.device == "cuda" or visible > 0:
            if visible < world:
                flag = ("tensor_parallel_size" if args.pipeline_parallel_size == 1 else
                        "tensor_parallel_size x pipeline_parallel_size")
                raise _bad(flag, f"{world} workers need {world} GPUs, {visible} are visible")
    return backend


def _swap_config(args: EngineArgs, cache: CacheConfig, model: ModelConfig,
                 device: str, stage_layers: int | None = None) -> tuple[CacheConfig, SwapCostModel]:
    """The CPU swap space in blocks, and the costs preemption_mode auto weighs."""
    import dataclasses

    from peregrine.attention.kv_dtype import kv_cache_bytes_per_block
    from peregrine.kv_cache.swap_cost import SwapCostModel
    if args.preemption_mode not in ("auto", "recompute", "swap"):
        raise _bad("preemption_mode", f"{args.preemption_mode!r} (expected auto, recompute or swap)")
    if not args.swap_space >= 0:
        raise _bad("swap_space", f"must be >= 0 GiB, got {args.swap_space}")
    if args.preemption_mode == "swap" and args.swap_space == 0:
        raise _bad("swap_space", "preemption_mode swap needs swap_space > 0 GiB")
    # NOTE: each tensor-parallel rank holds num_kv_heads / tp heads of every block, and each
    # pipeline stage its own layers' (the largest stage's count sizes every rank's swap space).
    layers = model.num_layers if stage_layers is None else stage_layers
    per_block = (kv_cache_bytes_per_block(cache, model) * layers // model.num_layers
                 // args.tensor_parallel_size)
    num_cpu = 0
    if args.preemption_mode != "recompute":
        # NOTE: no more than max_num_seqs full-length sequences can ever be swapped out, so a
        # larger swap space would only cost pinning time at start-up.
        most = args.max_num_seqs * -(-model.max_model_len // cache.block_size)
        num_cpu = min(int(args.swap_space * 2**30) // per_block, most)
    hf = model.hf_config
    cost = SwapCostModel.for_model(
        bytes_per_block=per_block, block_size=cache.block_size, num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        intermediate_size=int(hf.get("intermediate_size") or 4 * model.hidden_size),
        num_heads=model.num_heads, num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
        device=device)
    return dataclasses.replace(cache, swap_space=args.swap_space, num_cpu_blocks=num_cpu), cost


def resolve_device(device: str) -> str:
    """auto -> cuda when available, else cpu; a CUDA device without CUDA is refused."""
    import torch
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise _bad("device", f"{device!r} requested but CUDA is not available")
    return device

