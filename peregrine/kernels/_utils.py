"""Small launch helpers shared by the Triton kernels."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from peregrine import envs

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def is_gpu(x: torch.Tensor) -> bool:
    """True when x lives on a GPU (compiled kernels); False on CPU (the Triton interpreter)."""
    return x.device.type == "cuda"


def dot_dtype(x: torch.Tensor) -> tl.dtype:
    """The dtype tl.dot operands are cast to: the 16-bit input dtype on a GPU, else fp32."""
    if x.dtype not in _TL_DTYPES:
        raise ValueError(f"unsupported dtype {x.dtype} (expected float32, float16 or bfloat16)")
    # NOTE: the Triton CPU interpreter computes bf16 dots wrongly, so on CPU every dot runs in fp32.
    # On a GPU, casting the fp32 values (loaded from 16-bit) back to 16-bit is lossless and keeps
    # the tensor cores at full rate; the accumulator is fp32 either way.
    if not is_gpu(x):
        return tl.float32
    return _TL_DTYPES[x.dtype]


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP16_MAX = 65504.0


def kv_dot_dtype(q: torch.Tensor, cache: torch.Tensor) -> tuple[tl.dtype, bool]:
    """The dtype attention's tl.dot operands are cast to for queries q over K/V `cache`, and
    whether q must be clamped to the fp16 range first.

    An FP8 cache runs its dots in fp16 on a GPU, whatever q's 16-bit type: FP8 to fp16 is one
    packed hardware conversion per two elements, while FP8 to bf16 goes through fp32 and costs
    more issue slots than the halved loads save. fp16 holds every FP8 value and p in [0, 1]
    exactly, and has more mantissa than bf16; only a bf16 query beyond +-65504 would not fit,
    so it is clamped there (a query that large saturates the softmax either way)."""
    if is_gpu(q) and cache.dtype in FP8_DTYPES and q.dtype in (torch.bfloat16, torch.float16):
        return tl.float16, q.dtype == torch.bfloat16
    return dot_dtype(q), False


def dot_precision(x: torch.Tensor) -> str:
    """How tl.dot treats fp32 operands: exact on CPU, 3-pass tf32 (~fp32 accuracy) on a GPU."""
    # NOTE: plain "tf32" would silently round fp32 inputs to 10 mantissa bits; "ieee" runs on FMA
    # units and spills at flash-attention tile sizes. 16-bit operands ignore this setting.
    return "tf32x3" if is_gpu(x) else "ieee"


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (and >= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def check_block_size(block_size: int) -> None:
    """Paged kernels index tokens with shifts and masks: block_size must be a power of two."""
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def has_fp8_convert(device: torch.device) -> bool:
    """True on a CUDA GPU with the packed FP8 -> fp16 conversion instructions (sm_89 and later)."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index) >= (8, 9)


@functools.lru_cache(maxsize=None)
def _max_shared_memory(index: int) -> int:
    import triton
    return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])


def max_shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one program may use on a CUDA device (opt-in maximum); 0 on CPU
    or without a GPU."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return 0
    return _max_shared_memory(device.index if device.index is not None
                              else torch.cuda.current_device())


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of device; a small fixed number on CPU (the interpreter)."""
    if device.type != "cuda":
        return 4
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def check_q_and_caches(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
                       ) -> tuple[int, int]:
    """(block_size, num_kv_heads) of caches shaped (blocks, block_size, Hkv, D) that fit q (.., Hq, D)."""
    num_q_heads, head_dim = q.shape[-2], q.shape[-1]
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)} / "
                         f"{tuple(v_cache.shape)}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads "
                         f"{num_kv_heads}")
    return block_size, num_kv_heads


def check_window_and_out(fn: str, q: torch.Tensor, out: torch.Tensor | None,
                         k_cache: torch.Tensor, v_cache: torch.Tensor,
                         window: int | None) -> torch.Tensor:
    """The attention kernels' shared launch checks (sliding window, last-dim contiguity); returns
    `out`, allocated like q when None."""
    if window is not None and window < 1:
        raise ValueError(f"{fn}: window must be >= 1, got {window}")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    for name, x in (("q", q), ("out", out), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"{fn}: {name} must be contiguous in its last dim")
    return out


def may_reuse_launches(x: torch.Tensor) -> bool:
    """Whether a kernel launched on x's device may keep its compiled launch for the step's other
    layers: on a GPU, outside CUDA-graph capture (a captured launch is replayed without Python,
    so reusing it saves nothing, and capture keeps the path every graph was checked with)."""
    return x.device.type == "cuda" and not torch.cuda.is_current_stream_capturing()


def reusable_launch(kernel, grid: tuple[int, ...], args: tuple, kwargs: dict,
                    options: dict) -> tuple[object, list] | None:
    """Launch a Triton kernel through its JIT (args and kwargs: its parameters; options: launch
    options such as num_warps), and return what launches the same compiled kernel again without
    the JIT's argument binding: (launcher, every parameter's value in the kernel's order), the
    list to be edited in place for the next launch. None where there is no compiled kernel to
    reuse (the interpreter)."""
    import inspect
    compiled = kernel[grid](*args, **kwargs, **options)
    if compiled is None or not hasattr(compiled, "__getitem__"):
        return None
    bound = inspect.signature(kernel.fn).bind(*args, **kwargs)
    # NOTE: a compiled kernel's launcher takes a 3-dim grid (the JIT pads shorter ones itself).
    return compiled[tuple(grid) + (1,) * (3 - len(grid))], list(bound.arguments.values())


@functools.lru_cache(maxsize=None)
def _dependent_launch(index: int) -> dict:
    if envs.dependent_launch() and _capability(index) >= (9, 0):
        return _PDL
    return _NO_PDL


# Whether the short kernels that come right before a decode GEMV (RMSNorm, the decode merge,
# SiLU-and-mul) let it be scheduled at their start rather than as their programs exit: at one
# row the GEMV's programs are then resident and launched when the short kernel ends (on an H200,
# Llama-3-8B int4 batch-1 decode 460.4 tok/s against 444.4 / 445.1, FP8 W8A8 377.1 against
# 369.1). Their one or few programs are already running, so the waiting ones take no SM slot
# they need. Only at batches a GEMV serves (RELEASE_MAX_ROWS: the GEMVs' largest row cut-off,
# gemv.GEMV_MAX_ROWS, which the int layout's tensor-core GEMV takes); larger ones are followed by
# GEMMs and keep the release at exit.
RELEASE_BEFORE_GEMV = True
RELEASE_MAX_ROWS = 8

_NO_PDL = {"PDL": False}
_PDL = {"PDL": True, "launch_pdl": True}


# Whether the norm/RoPE/K-V store kernel of a decode step (at the batches above) releases the
# decode split kernel after it at its start, so that the split kernel's programs are resident
# when it ends. None: on where the layer's projections are this project's GEMVs, launched as
# dependents (the quantization methods' `dependent_launches`), off elsewhere; True / False force
# it. On an H200 at batch 1, same runs: Llama-3-8B int4 469.6 / 469.7 tok/s against 465.8 /
# 465.7, FP8 W8A8 384.5 / 385.1 against 382.7 / 382.8; but with bf16 weights (cuBLAS
# projections) 214.4 / 214.8 against 220.6 / 220.6. The split kernel releasing at its start too
# (the merge and the output projection's GEMV then waiting through attention) cost FP8 W8A8 6%.
RELEASE_ROPE_STORE: bool | None = None


# Whether the short kernels of the attention layer (norm/RoPE/K-V store; the decode split and
# merge kernels where the batch's kv rows are fewer than the SMs) read the step's inputs before
# their dependent-launch wait: the positions, slot mapping, sequence lengths and block table. The host copies them in before a step's first
# kernel and no kernel of the step writes them, so a kernel may read them while the one ahead
# of it still runs; their loads (and the loads that depend on them: the RoPE table rows, the
# first tile's cache block ids) then leave the critical path.
EARLY_STEP_INPUTS = True


def early_step_inputs(pdl: dict) -> bool:
    """The EARLY constexpr of a kernel launched with the `pdl` arguments that may read the
    step's inputs before its wait (EARLY_STEP_INPUTS)."""
    return pdl["PDL"] and EARLY_STEP_INPUTS


def release_rope_store(pdl: dict, rows: int, gemv_projections: bool = False) -> bool:
    """The RELEASE constexpr of the norm/RoPE/K-V store kernel of `rows` tokens, launched with
    the `pdl` arguments, in a layer whose projections are (gemv_projections) or are not
    dependent-launch GEMVs."""
    release = gemv_projections if RELEASE_ROPE_STORE is None else RELEASE_ROPE_STORE
    return release_before_gemv(pdl, rows) and release


def release_before_gemv(pdl: dict, rows: int) -> bool:
    """The RELEASE constexpr of a short kernel of `rows` rows that may come before a GEMV
    (RMSNorm, the decode merge, SiLU-and-mul), launched with the `pdl` arguments."""
    return pdl["PDL"] and RELEASE_BEFORE_GEMV and rows <= RELEASE_MAX_ROWS


def pdl_args(x: torch.Tensor) -> dict:
    """Launch arguments for a kernel with a PDL constexpr that calls pdl_wait before it touches
    anything another kernel writes or reads: on a Hopper or later GPU it is launched as a
    programmatic dependent of the kernel before it (it may be scheduled while that one finishes,
    and waits for it on the GPU, inside CUDA graphs too); elsewhere a plain launch."""
    if x.device.type != "cuda":
        return _NO_PDL
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return _dependent_launch(index)


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait until the kernel before this one has finished and its writes are visible. Nothing
    this kernel reads or writes that another kernel touches may come before it: only constant
    weights, and the step's inputs the host wrote before the step (EARLY_STEP_INPUTS), may be
    loaded earlier."""
    if PDL:
        gdc_wait()


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """Let the next kernel be scheduled now (it still waits for this one in pdl_wait): called
    by a long kernel once its main loop is done, so the next one's launch overlaps its
    epilogue, or by a short kernel before a GEMV at its start (RELEASE_BEFORE_GEMV). A kernel
    that never calls it releases the next one as its programs exit.
    NOTE: every kernel releasing at its start measured slower on an H200 (the waiting programs
    hold SM slots through the whole of a long kernel)."""
    if PDL:
        gdc_launch_dependents()
