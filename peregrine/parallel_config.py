"""Tensor- and pipeline-parallel settings of EngineArgs checked against the model: the executor
backend, and the decoder layers of each pipeline stage."""
from __future__ import annotations

from typing import TYPE_CHECKING

from peregrine import envs
from peregrine.engine_args import invalid_arg

if TYPE_CHECKING:
    from peregrine.engine_args import EngineArgs
    from peregrine.model_config import ModelConfig

# EngineArgs fields that pipeline parallelism does not run with yet, refused by name when set:
# field -> what it turns on.
PIPELINE_UNSUPPORTED: dict[str, str] = {
    "speculative_config": "speculative decoding",
}


def check_pipeline(args: EngineArgs, model: ModelConfig) -> tuple[int, ...]:
    """Validate pipeline_parallel_size; return the decoder layers of each stage."""
    pp = args.pipeline_parallel_size
    if pp < 1:
        raise invalid_arg("pipeline_parallel_size", f"must be >= 1, got {pp}")
    if pp > 1:
        for name, what in PIPELINE_UNSUPPORTED.items():
            if getattr(args, name, None) not in (None, 0):
                raise invalid_arg("pipeline_parallel_size", f"{pp} stages do not run with {what} "
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
        raise invalid_arg("pipeline_parallel_size", f"{pp} stages for the model's {num_layers} "
                          "layers (each stage needs at least one)")
    base, extra = divmod(num_layers, pp)
    parts = [base] * pp
    for i in range(extra):
        parts[pp - 2 - i] += 1  # the second-to-last stage first; extra < pp spares the last
    return tuple(parts)


def check_parallel(args: EngineArgs, model: ModelConfig) -> str:
    """Validate the tensor-parallel split; return the executor backend (mp, ray or uni)."""
    tp, world = args.tensor_parallel_size, args.tensor_parallel_size * args.pipeline_parallel_size
    if tp < 1:
        raise invalid_arg("tensor_parallel_size", f"must be >= 1, got {tp}")
    hf = model.hf_config
    # NOTE: the vocabulary needs no check: the embedding and LM head pad it to a multiple of tp.
    sizes = {"num_attention_heads": model.num_heads, "num_key_value_heads": model.num_kv_heads,
             "intermediate_size": hf.get("intermediate_size")}
    for name, size in sizes.items():
        if size is not None and int(size) % tp:
            raise invalid_arg("tensor_parallel_size", f"{tp} does not divide the model's {name} "
                              f"({size}); each rank holds an equal share")
    from peregrine.executor import EXECUTOR_BACKENDS
    backend = args.distributed_executor_backend or ("mp" if world > 1 else "uni")
    if backend not in EXECUTOR_BACKENDS:
        raise invalid_arg("distributed_executor_backend", f"{backend!r} (expected "
                          f"{', '.join(sorted(EXECUTOR_BACKENDS))})")
    if backend == "uni" and world > 1:
        raise invalid_arg("distributed_executor_backend",
                          f"uni runs one worker, but tensor_parallel_size x "
                          f"pipeline_parallel_size is {world}: use mp (or ray)")
    if backend == "ray":
        from peregrine.executor.ray_executor import ray_missing
        missing = ray_missing()
        if missing:
            raise invalid_arg("distributed_executor_backend", missing)
    if world > 1 and args.device.startswith("cuda:"):
        raise invalid_arg("device", f"{args.device!r} names one GPU, but {world} workers use "
                          f"cuda:0 to cuda:{world - 1}: pass cuda (or limit "
                          "CUDA_VISIBLE_DEVICES)")
    # NOTE: Ray places the ranks on its cluster's GPUs, which need not be this host's.
    if world > 1 and args.device in ("auto", "cuda") and backend != "ray":
        import torch
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if args.device == "cuda" or visible > 0:
            if visible < world:
                flag = ("tensor_parallel_size" if args.pipeline_parallel_size == 1 else
                        "tensor_parallel_size x pipeline_parallel_size")
                raise invalid_arg(flag, f"{world} workers need {world} GPUs, {visible} are visible")
    return backend
