"""Every environment variable Peregrine reads, in one place (read when called, never cached)."""
from __future__ import annotations

import os


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


def attention_backend() -> str | None:
    """PEREGRINE_ATTENTION_BACKEND: torch | triton; None when unset (the device decides)."""
    return os.environ.get("PEREGRINE_ATTENTION_BACKEND") or None


def fused_kernels() -> bool:
    """PEREGRINE_FUSED_KERNELS: Triton RMSNorm, RoPE, SiLU-and-mul on CUDA (default on; 0: off)."""
    return _flag("PEREGRINE_FUSED_KERNELS", True)


def dependent_launch() -> bool:
    """PEREGRINE_DEPENDENT_LAUNCH: on Hopper and later, the decode path's Triton kernels are
    launched while the kernel before them finishes and wait for its results on the GPU (default
    on; 0: each kernel is launched after the previous one ends). Read once per process."""
    return _flag("PEREGRINE_DEPENDENT_LAUNCH", True)


def wna16_gemv_variant() -> str | None:
    """PEREGRINE_WNA16_GEMV: the weight-only GEMV variant for one row of 4-bit weights (one of
    kernels/wna16_gemv.VARIANTS, for benchmarks; unset: the measured default). Read once per
    process."""
    return os.environ.get("PEREGRINE_WNA16_GEMV") or None


def decode_layers() -> str | None:
    """PEREGRINE_DECODE_LAYERS: a decode step of one sequence runs all the decoder layers of a
    4-bit Llama-style model in one persistent kernel on sm_90+ (models/one_kernel_decode.py),
    where the model qualifies; its packed copy of the weights costs their size again. Unset or
    0: off (the default: `rows` is faster at batch 1 on an H100 at short contexts, but slower at
    long ones and not yet timed on an H200 in its latest form, and its packed copy comes out of
    the KV cache's room; `split` measured slower; see the benchmarks);
    1 or `split`: kernels/decode_layers.py (each projection's tiles split over the programs);
    `rows`: kernels/decode_rows.py (whole-K row tiles, each phase starting on the inputs that
    are ready). The form, or None when off."""
    value = (os.environ.get("PEREGRINE_DECODE_LAYERS") or "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return None
    if value in ("1", "true", "yes", "on", "split"):
        return "split"
    if value == "rows":
        return "rows"
    raise ValueError(f"PEREGRINE_DECODE_LAYERS={value!r}: expected 0, 1, split or rows")


def graph_paths_on_cpu() -> bool:
    """PEREGRINE_GRAPH_PATHS_ON_CPU: for tests on a CPU machine, a worker without CUDA builds the
    CUDA-graph runners anyway and runs their steps eagerly over the same fixed buffers, so the
    engine's graph paths run there (default off)."""
    return _flag("PEREGRINE_GRAPH_PATHS_ON_CPU", False)


def debug_checks() -> bool:
    """PEREGRINE_DEBUG_CHECKS: per-layer shape checks on the hot path (default off; 1: on)."""
    return _flag("PEREGRINE_DEBUG_CHECKS", False)


def core_pacing() -> bool:
    """PEREGRINE_CORE_PACING: the core process listens for new requests while the device is busy
    and schedules its next step as late as the device allows (default on; 0: schedule at once)."""
    return _flag("PEREGRINE_CORE_PACING", True)


def transformers_tokenizer() -> bool:
    """PEREGRINE_TRANSFORMERS_TOKENIZER: load every tokenizer through transformers' AutoTokenizer,
    plain fast tokenizers too (default off: those load through `tokenizers` alone)."""
    return _flag("PEREGRINE_TRANSFORMERS_TOKENIZER", False)


def cache_dir() -> str | None:
    """PEREGRINE_CACHE_DIR: where the demo model is built (None: ~/.cache/peregrine)."""
    return os.environ.get("PEREGRINE_CACHE_DIR") or None


def api_key() -> str | None:
    """PEREGRINE_API_KEY: the server's API key when --api-key is not given."""
    return os.environ.get("PEREGRINE_API_KEY") or None


def triton_interpret() -> bool:
    """TRITON_INTERPRET: Triton kernels run in the CPU interpreter (set by tests before import)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pp_layer_partition() -> str | None:
    """PEREGRINE_PP_LAYER_PARTITION: decoder layers per pipeline stage, comma-separated (e.g.
    "5,4"; they must sum to the model's layers); None when unset (an even split)."""
    return os.environ.get("PEREGRINE_PP_LAYER_PARTITION") or None
