"""Engine configuration: the resolved, frozen configs the engine runs on (`EngineConfig` with
`ModelConfig`, `CacheConfig`, `SchedulerConfig`), built from the flat, frozen `EngineArgs` (whose
fields the CLI's flags come from). The arguments, the model's config and the parallel checks live
in engine_args.py, model_config.py and parallel_config.py; their names are importable from here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from peregrine import envs
from peregrine.engine_args import (DEFAULT_GPU_MEMORY_UTILIZATION, ENGINE_ARGS_HELP, EngineArgs,
                                   invalid_arg)
from peregrine.model_config import TOKENIZER_FILES, ModelConfig, check_tokenizer_folder
from peregrine.parallel_config import (PIPELINE_UNSUPPORTED, check_parallel, check_pipeline,
                                       pipeline_layer_partition)

if TYPE_CHECKING:
    from peregrine.kv_cache.swap_cost import SwapCostModel
    from peregrine.spec_decode.config import SpeculativeConfig

__all__ = ["DEFAULT_GPU_MEMORY_UTILIZATION", "ENGINE_ARGS_HELP", "PIPELINE_UNSUPPORTED",
           "TOKENIZER_FILES", "CacheConfig", "EngineArgs", "EngineConfig", "ModelConfig",
           "SchedulerConfig", "check_tokenizer_folder", "pipeline_layer_partition",
           "resolve_device"]

# NOTE: torch is imported inside the functions that need it, so that `peregrine --help` (whose
# flags come from EngineArgs) starts without importing torch.


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
    disable_custom_all_reduce: bool = False  # tensor-parallel all-reduces only through NCCL

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
            raise invalid_arg("block_size",
                              f"{args.block_size} (expected a power of two up to 128)")
        gpu_util = args.gpu_memory_utilization
        if gpu_util is not None and not 0.0 < gpu_util <= 1.0:
            raise invalid_arg("gpu_memory_utilization", f"{gpu_util} not in (0, 1]")
        if args.cpu_kv_cache_gb is not None and not args.cpu_kv_cache_gb > 0:
            raise invalid_arg("cpu_kv_cache_gb", f"must be > 0, got {args.cpu_kv_cache_gb}")
        if args.num_gpu_blocks_override is not None and args.num_gpu_blocks_override < 1:
            raise invalid_arg("num_gpu_blocks_override", "must be >= 1")
        if args.max_num_seqs < 1:
            raise invalid_arg("max_num_seqs", "must be >= 1")
        if args.scheduling_policy not in ("fcfs", "priority"):
            raise invalid_arg("scheduling_policy",
                              f"{args.scheduling_policy!r} (expected fcfs or priority)")
        if args.max_prefill_graph_tokens < 0:
            raise invalid_arg("max_prefill_graph_tokens", "must be >= 0 (0 turns the graphs off)")
        partition = check_pipeline(args, model)
        executor_backend = check_parallel(args, model)
        max_batched = args.max_num_batched_tokens
        if max_batched is None:
            max_batched = 8192 if args.enable_chunked_prefill else max(8192, model.max_model_len)
        if max_batched < 1:
            raise invalid_arg("max_num_batched_tokens", "must be >= 1")
        if not args.enable_chunked_prefill and max_batched < model.max_model_len:
            raise invalid_arg("max_num_batched_tokens", f"{max_batched} < max_model_len "
                              f"{model.max_model_len} with chunked prefill off")
        device = resolve_device(args.device)
        on_cuda = device.startswith("cuda")
        if gpu_util is not None and not on_cuda:
            raise invalid_arg("gpu_memory_utilization",
                              f"{gpu_util} was given but the engine runs on {device!r}, where it "
                              "has no meaning; size the CPU KV cache with cpu_kv_cache_gb "
                              "instead (default: from the model)")
        backend = args.attention_backend or envs.attention_backend() or (
            "triton" if on_cuda else "torch")
        if backend not in ("torch", "triton"):
            raise invalid_arg("attention_backend", f"{backend!r} (expected torch or triton)")
        if backend == "triton" and not on_cuda and not envs.triton_interpret():
            raise invalid_arg("attention_backend",
                              f"triton on {device!r} needs CUDA (Triton compiles its kernels for "
                              "the GPU): use the torch backend on the CPU, or set "
                              "TRITON_INTERPRET=1 to run the kernels in Triton's (slow) "
                              "interpreter")
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
                   spec, partition, bool(args.disable_custom_all_reduce))

def _swap_config(args: EngineArgs, cache: CacheConfig, model: ModelConfig,
                 device: str, stage_layers: int | None = None) -> tuple[CacheConfig, SwapCostModel]:
    """The CPU swap space in blocks, and the costs preemption_mode auto weighs."""
    import dataclasses

    from peregrine.attention.kv_dtype import kv_cache_bytes_per_block
    from peregrine.kv_cache.swap_cost import SwapCostModel
    if args.preemption_mode not in ("auto", "recompute", "swap"):
        raise invalid_arg("preemption_mode",
                          f"{args.preemption_mode!r} (expected auto, recompute or swap)")
    if not args.swap_space >= 0:
        raise invalid_arg("swap_space", f"must be >= 0 GiB, got {args.swap_space}")
    if args.preemption_mode == "swap" and args.swap_space == 0:
        raise invalid_arg("swap_space", "preemption_mode swap needs swap_space > 0 GiB")
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
        raise invalid_arg("device", f"{device!r} requested but CUDA is not available")
    return device
