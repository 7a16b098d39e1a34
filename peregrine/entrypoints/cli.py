"""The `peregrine` command: generate, serve, bench."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import typing
from collections.abc import Collection
from typing import TypeVar

from peregrine.config import ENGINE_ARGS_HELP, EngineArgs

T = TypeVar("T")


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, help_text: dict[str, str],
                       skip: Collection[str] = frozenset()) -> None:
    """One --flag per field of a flat dataclass; defaults come from the dataclass, nowhere else."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        doc = help_text.get(f.name)
        if f.default is not None and doc is not None:
            doc += " (default: %(default)s)"
        # Optional[X] -> X; a bare Literal[...] keeps its own values as choices.
        base = hint
        if typing.get_origin(hint) is not typing.Literal:
            base = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
        if base is bool:  # Optional[bool]: --flag / --no-flag, unset means "decide automatically"
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                                help=doc)
        elif typing.get_origin(base) is typing.Literal:
            parser.add_argument(flag, choices=typing.get_args(base), default=f.default, help=doc)
        else:
            parser.add_argument(flag, type=base if base in (int, float, str) else str,
                                default=f.default, help=doc)


def dataclass_from(ns: argparse.Namespace, cls: type[T]) -> T:
    """The dataclass built from the parsed flags that add_dataclass_args added."""
    return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)
                  if hasattr(ns, f.name)})


def add_engine_args(parser: argparse.ArgumentParser, skip: Collection[str] = frozenset()) -> None:
    """One --flag per EngineArgs field."""
    add_dataclass_args(parser, EngineArgs, ENGINE_ARGS_HELP, skip)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return dataclass_from(ns, EngineArgs)


def _generate(ns: argparse.Namespace) -> int:
    from peregrine.entrypoints.llm import LLM
    from peregrine.sampling_params import SamplingParams
    args = engine_args_from(ns)
    llm = LLM(**dataclasses.asdict(args))
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p,
                            top_k=ns.top_k, seed=ns.sampling_seed)
    prompts = ns.prompt or ["Once upon a time"]
    if ns.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        print(f"Prompt: {prompt!r}")
        for o in out.outputs:
            print(f"Output: {o.text!r}  [{len(o.token_ids)} tokens, finish_reason={o.finish_reason}]")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="peregrine", description="Peregrine LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text offline from prompts")
    gen.add_argument("prompt", nargs="*", help="prompt(s); default: a demo prompt")
    add_engine_args(gen)
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.set_defaults(func=_generate)
    sub.add_parser("serve", help="run the OpenAI-compatible server", add_help=False)
    bench = sub.add_parser("bench", help="benchmarks: throughput, latency, serve", add_help=False)
    bench.add_argument("kind", choices=["throughput", "latency", "serve"])
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if argv[:1] == ["serve"]:
        from peregrine.entrypoints.serve import serve_main
        return serve_main(argv[1:]) or 0
    if argv[:1] == ["bench"] and len(argv) > 1:
        kind, rest = argv[1], argv[2:]
        if kind == "serve":
            from peregrine.bench.serve import main as bench_serve
            return bench_serve(rest) or 0
        if kind in ("throughput", "latency"):
            from peregrine.bench.offline import main as bench_offline
            return bench_offline(kind, rest) or 0
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
