"""`EngineArgs`: every knob a user can set, flat and frozen; the CLI's flags and their help come
from its fields (`ENGINE_ARGS_HELP`). `create_engine_config` resolves it (config.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from peregrine.config import EngineConfig

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
    max_prefill_graph_tokens: int = 8192
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
    # Tensor-parallel all-reduces always through NCCL (else small ones over peer GPU memory).
    disable_custom_all_reduce: bool = False
    quantization: str | None = None  # None: as the checkpoint's quantization_config says
    kv_cache_dtype: str = "auto"  # auto: the model dtype
    swap_space: float = 4.0  # GiB of (pinned) CPU memory per GPU for swapped-out KV blocks
    preemption_mode: Literal["auto", "recompute", "swap"] = "auto"
    # vLLM's keys: {"method": "ngram", "num_speculative_tokens": 4, ...} or {"model": PATH, ...};
    # a JSON string on the CLI (spec_decode/config.py).
    speculative_config: dict[str, Any] | None = None

    def create_engine_config(self) -> EngineConfig:
        """Resolve the model folder and validate every field."""
        from peregrine.config import EngineConfig
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
    "disable_custom_all_reduce": "tensor-parallel all-reduces always through NCCL (default: "
                                 "messages up to 4 MiB go over peer GPU memory where the GPUs "
                                 "of one host can map each other's)",
    "quantization": "quantization method (default: the checkpoint's quantization_config; "
                    "must agree with it when both are given; awq_marlin and gptq_marlin ask "
                    "for the awq and gptq formats)",
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


def invalid_arg(field_name: str, msg: str) -> ValueError:
    """The error for a bad EngineArgs field: `invalid <field>: <what is wrong>`."""
    return ValueError(f"invalid {field_name}: {msg}")
