"""Worker: one device's share of the engine (later, one process per GPU runs one)."""
from __future__ import annotations

import logging
import os

import torch

from peregrine import envs
from peregrine.attention import get_attention_backend
from peregrine.attention.kv_dtype import kv_cache_torch_dtype
from peregrine.config import EngineConfig
from peregrine.messages import ModelRunnerOutput, SchedulerOutput
from peregrine.spec_decode.proposer import build_proposer
from peregrine.startup_timing import STARTUP
from peregrine.worker.cuda_graphs import (CudaGraphRunner, PiecewiseGraphs, decode_graph_bytes,
                                          prefill_graph_sizes)
from peregrine.distributed import pp_rank
from peregrine.models.protocol import PipelineStage
from peregrine.worker.kv_memory import allocate_kv_caches, determine_num_blocks, rank_model_config
from peregrine.worker.loader import load_model
from peregrine.worker.model_runner import ModelRunner, StepHandle
from peregrine.worker.profile import profile_run
from peregrine.worker.step_buffers import StageBuffers
from peregrine.worker.verify_graphs import VerifyGraphs, verify_graph_batch, verify_graph_bytes

logger = logging.getLogger("peregrine")


class Worker:
    """Owns the device: loads the model, sizes and allocates the KV cache, captures CUDA graphs.

    Protocol: `determine_num_blocks()`, then `initialize_cache(num_blocks)` with the executor's
    choice (the minimum over workers), then `execute_model` / `collect` once per step.
    """

    def __init__(self, config: EngineConfig, rank: int = 0, local_rank: int = 0,
                 device: torch.device | str | None = None) -> None:
        self.config = config
        self.rank = rank
        self.local_rank = local_rank
        dev = torch.device(device if device is not None else config.device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", local_rank)
        self.device = dev
        STARTUP.take_pre_engine()  # a worker in a process of its own: its process's imports
        with STARTUP.phase("device", dev):  # the CUDA context is created by the phase's sync
            if dev.type == "cuda":
                torch.cuda.set_device(dev)
        with STARTUP.phase("attention_backend"):  # the Triton backend's first import of triton
            backend = get_attention_backend(config.attention_backend)
        # This rank's pipeline stage (the whole model without pipeline parallelism).
        self.stage = PipelineStage.of(config.pp_layer_partition, pp_rank())
        # NOTE: load_model chooses the fused kernels for the device when it builds the layers.
        with STARTUP.phase("model", dev):
            self.model = load_model(config.model, backend, dev, stage=self.stage)
            if envs.decode_layers():
                self._prepare_decode_layers()
        # The KV cache holds this rank's heads of its stage's layers.
        self.kv_model_config = rank_model_config(config, len(self.model.layers))
        with STARTUP.phase("runner", dev):
            self.model_runner = ModelRunner(config, self.model, dev, self.stage)
        # Speculative decoding: the proposer loads what it runs once the target is loaded.
        with STARTUP.phase("proposer", dev):
            self.proposer = build_proposer(config, dev)
            if self.proposer is not None:
                self.proposer.load_model(self.model)
                self.model_runner.proposer = self.proposer
        self.num_blocks: int | None = None

    def _prepare_decode_layers(self) -> None:
        """Pack the model's layers for one-row decode steps in one kernel, where it qualifies
        (before the KV cache is sized: the packed copy takes memory)."""
        from peregrine.models import one_kernel_decode
        cfg = self.config
        reason = one_kernel_decode.prepare(self.model, cfg.cache.block_size,
                                           kv_cache_torch_dtype(cfg.cache, cfg.model),
                                           self.device, envs.decode_layers())
        if reason is not None:
            logger.info("PEREGRINE_DECODE_LAYERS: not for this model: %s", reason)
            return
        packed = self.model.decode_layers_packed
        logger.info("PEREGRINE_DECODE_LAYERS: layers packed for one-row decode steps "
                    "(%.2f GiB more weights)", packed.weight_bytes / 2**30)

    def determine_num_blocks(self) -> int:
        """How many KV blocks fit on this device (profiles a worst-case step on a GPU)."""
        r, sc = self.model_runner, self.config.scheduler

        def profile() -> None:
            # NOTE: on a machine's first run this step compiles the Triton kernels (tens of
            # seconds); say so, or a cold start looks like a hang.
            logger.info("profiling one worst-case step to size the KV cache (a first run also "
                        "compiles the Triton kernels; later runs reuse Triton's cache)")
            with STARTUP.phase("kv_profile", self.device):
                profile_run(self.model, r.buffers, self.kv_model_config,
                            sc.max_num_batched_tokens, sc.max_num_seqs,
                            self.config.cache.block_size, self._max_sampled_rows())

        extra = self.proposer.kv_cache_bytes_per_block() if self.proposer is not None else 0
        return determine_num_blocks(self.config, self.device, profile, self._graph_reserve(),
                                    self.kv_model_config, extra)

    def _max_sampled_rows(self) -> int:
        """Most logits rows one step samples: a verify step samples k + 1 per sequence."""
        spec, sc = self.config.speculative, self.config.scheduler
        if spec is None:
            return sc.max_num_seqs
        seqs = sc.max_num_seqs
        if spec.disable_by_batch_size is not None:
            seqs = min(seqs, spec.disable_by_batch_size)
        return max(sc.max_num_seqs, seqs * (spec.num_speculative_tokens + 1))

    def _captures_graphs(self) -> bool:
        """Whether initialize_cache will capture CUDA graphs (on a CPU with
        PEREGRINE_GRAPH_PATHS_ON_CPU: build the same runners, run eagerly)."""
        cfg = self.config
        if cfg.enforce_eager or cfg.attention_backend != "triton":
            return False
        return self.device.type == "cuda" or envs.graph_paths_on_cpu()

    def _stage_tokens(self) -> int:
        """Tokens the pipeline stage buffers hold: the largest decode graph's or piecewise
        graph's step."""
        sizes = prefill_graph_sizes(self.config.max_prefill_graph_tokens)
        return max([self._decode_graph_batch()] + sizes)

    def _decode_graph_batch(self) -> int:
        # NOTE: a decode batch of B sequences is B tokens, so B is capped by the token budget too.
        sc = self.config.scheduler
        return min(sc.max_num_seqs, sc.max_num_batched_tokens)

    def _graph_reserve(self) -> int:
        """Bytes the KV sizing leaves for the decode and verify graphs' logits (captured after
        sizing)."""
        if not self._captures_graphs():
            return 0
        cfg = self.config
        vocab, dtype = cfg.model.vocab_size, cfg.model.dtype
        total = 0
        if self.stage.is_last:  # the stages before it compute no logits
            total += decode_graph_bytes(self._decode_graph_batch(), vocab, dtype)
        if cfg.pipeline_parallel_size > 1:
            total += StageBuffers.nbytes(self.stage, self._stage_tokens(),
                                         cfg.model.hidden_size, dtype)
        b = self._verify_graph_batch()
        if b:
            total += verify_graph_bytes(b, self.config.speculative.num_speculative_tokens, vocab)
        return total

    def _verify_graph_batch(self) -> int:
        """The largest verify batch the verify graphs cover (0: no speculation)."""
        spec, sc = self.config.speculative, self.config.scheduler
        if spec is None:
            return 0
        return verify_graph_batch(sc.max_num_seqs, sc.max_num_batched_tokens,
                                  spec.num_speculative_tokens, spec.disable_by_batch_size)

    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate `num_blocks` KV blocks per layer, capture CUDA graphs, warm up the sampler."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        cfg, r = self.config, self.model_runner
        cache_dtype = kv_cache_torch_dtype(cfg.cache, cfg.model)
        with STARTUP.phase("kv_alloc", self.device):
            kv = allocate_kv_caches(self.kv_model_config, num_blocks, cfg.cache.block_size,
                                    self.device, cache_dtype)
            if self.proposer is not None:
                self.proposer.initialize_kv_cache(num_blocks)
        with STARTUP.phase("swap_space", self.device):
            r.initialize_kv_cache(kv)
        if getattr(self.model, "decode_layers_packed", None) is not None:
            from peregrine.models import one_kernel_decode
            reason = one_kernel_decode.bind(self.model, kv)
            if reason is None:
                logger.info("PEREGRINE_DECODE_LAYERS: %s", one_kernel_decode.describe(
                    self.model.decode_layers, len(self.model.layers)))
            else:
                logger.warning("PEREGRINE_DECODE_LAYERS: the one-kernel decode failed its first "
                               "run (%s); the layers run one kernel a phase", reason)
        self.num_blocks = num_blocks
        if self.device.type != "cuda":
            if self._captures_graphs():
                self._capture_graphs()
            self._startup_done()
            return
        if cfg.attention_backend == "triton":
            from peregrine.kernels.decode_attention import precompile
            attn = self.model.layers[0].self_attn
            with STARTUP.phase("precompile", self.device):
                precompile(attn.num_heads, attn.num_kv_heads, attn.head_dim,
                           cfg.cache.block_size, cfg.model.dtype, self.device, cache_dtype,
                           max_context=r.max_blocks_per_req * cfg.cache.block_size)
        if self._captures_graphs():
            if cfg.pipeline_parallel_size > 1:
                logger.info("capturing CUDA graphs of pipeline stage %d of %d (layers %d-%d; "
                            "--enforce-eager skips them)", pp_rank(), cfg.pipeline_parallel_size,
                            self.stage.start_layer, self.model.end_layer - 1)
            else:
                logger.info("capturing CUDA graphs (--enforce-eager skips them)")
            self._capture_graphs()
        # Compile the sampling kernel now, not inside the first (timed) steps.
        with STARTUP.phase("sampler_warmup", self.device):
            r.sampler.warm_up(r.vocab_size, self.device)
        self._startup_done()

    def _startup_done(self) -> None:
        # NOTE: an engine in this process logs the phases itself; a worker process logs its own.
        if not STARTUP.active and self.rank == 0:
            STARTUP.finish(f"worker rank {self.rank}, pid {os.getpid()}")

    def _capture_graphs(self) -> None:
        r, cfg, sc = self.model_runner, self.config, self.config.scheduler
        cuda = self.device.type == "cuda"  # else: the same runners, run eagerly (tests)
        free_before = torch.cuda.mem_get_info(self.device)[0] if cuda else 0
        sb = None
        if cfg.pipeline_parallel_size > 1:
            sb = r.stage_buffers = StageBuffers(self.stage, self._stage_tokens(),
                                                cfg.model.hidden_size, cfg.model.dtype,
                                                self.device)
        with STARTUP.phase("decode_graphs", self.device):
            r.graphs = CudaGraphRunner(self.model, r.buffers, r.kv_caches,
                                       self._decode_graph_batch(), sc.max_model_len,
                                       capture=cuda, stage_buffers=sb)
        sizes = prefill_graph_sizes(cfg.max_prefill_graph_tokens)
        if sizes:
            with STARTUP.phase("piecewise_graphs", self.device):
                r.prefill_graphs = PiecewiseGraphs(self.model, r.buffers, r.kv_caches, sizes,
                                                   capture=cuda, pool=r.graphs.pool,
                                                   stage_buffers=sb)
        b = self._verify_graph_batch()
        if b:
            with STARTUP.phase("verify_graphs", self.device):
                r.verify_graphs = VerifyGraphs(
                    self.model, r.buffers, r.kv_caches, b,
                    self.config.speculative.num_speculative_tokens, sc.max_model_len,
                    capture=cuda, pool=r.graphs.pool)
        if not cuda:
            return
        # NOTE: the KV sizing reserved only the graphs' logits; the rest comes out of the
        # (1 - gpu_memory_utilization) slack. Say how much.
        logger.info("CUDA graphs use %.2f GiB of GPU memory (decode graphs %.2f GiB; %.2f GiB was "
                    "reserved when sizing the KV cache)",
                    (free_before - torch.cuda.mem_get_info(self.device)[0]) / 2**30,
                    r.graphs.memory_bytes / 2**30, self._graph_reserve() / 2**30)

    def execute_model(self, scheduler_output: SchedulerOutput) -> StepHandle:
        """Launch one step; returns a handle for `collect` without waiting for the device."""
        return self.model_runner.execute_model(scheduler_output)

    def collect(self, handle: StepHandle) -> ModelRunnerOutput:
        """Wait for a launched step and return its results."""
        return self.model_runner.collect(handle)

    def check_health(self) -> None:
        """Raise if this worker cannot run steps."""
        if not self.model_runner.kv_caches:
            raise RuntimeError("the worker's KV cache is not allocated")
