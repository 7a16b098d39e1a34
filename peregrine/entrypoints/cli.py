"""The `peregrine` command: generate, serve, bench.

NOTE: nothing here imports torch at module level (nor do the bench parsers), so `peregrine --help`
and every subcommand's --help answer at once; torch loads when an engine is built.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import os
import sys
import typing
from collections.abc import Collection, Mapping, Sequence
from typing import TypeVar

from peregrine import __version__
from peregrine.config import ENGINE_ARGS_HELP, EngineArgs

T = TypeVar("T")

# Short spellings vLLM users type (`-tp 2`).
ENGINE_ARG_ALIASES: dict[str, tuple[str, ...]] = {
    "tensor_parallel_size": ("-tp",),
    "pipeline_parallel_size": ("-pp",),
}
# What `pip install "peregrine-llm[serve]"` brings (pyproject.toml's serve extra).
SERVE_EXTRA_MODULES = ("fastapi", "uvicorn", "pydantic", "prometheus_client")
SERVE_EXTRA_INSTALL = 'pip install "peregrine-llm[serve]"'


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, help_text: dict[str, str],
                       skip: Collection[str] = frozenset(),
                       aliases: Mapping[str, Sequence[str]] | None = None) -> None:
    """One --flag per field of a flat dataclass; defaults come from the dataclass, nowhere else."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flags = [*(aliases or {}).get(f.name, ()), "--" + f.name.replace("_", "-")]
        hint = hints[f.name]
        doc = help_text.get(f.name)
        if f.default is not None and doc is not None:
            doc += " (default: %(default)s)"
        # Optional[X] -> X; a bare Literal[...] keeps its own values as choices.
        base = hint
        if typing.get_origin(hint) is not typing.Literal:
            base = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
        if base is bool:  # --flag / --no-flag; for Optional[bool], unset means "decide automatically"
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, default=f.default,
                                help=doc)
        elif typing.get_origin(base) is typing.Literal:
            parser.add_argument(*flags, choices=typing.get_args(base), default=f.default, help=doc)
        else:
            parser.add_argument(*flags, type=base if base in (int, float, str) else str,
                                default=f.default, help=doc)


def dataclass_from(ns: argparse.Namespace, cls: type[T]) -> T:
    """The dataclass built from the parsed flags that add_dataclass_args added."""
    return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)
                  if hasattr(ns, f.name)})


def add_engine_args(parser: argparse.ArgumentParser, skip: Collection[str] = frozenset()) -> None:
    """One --flag per EngineArgs field (-tp / -pp as vLLM spells them, too)."""
    add_dataclass_args(parser, EngineArgs, ENGINE_ARGS_HELP, skip, ENGINE_ARG_ALIASES)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return dataclass_from(ns, EngineArgs)


# NOTE: a prompt of B UTF-8 bytes is at most B tokens for byte-level BPE, and at most a few
# more (a leading-space piece, BOS / EOS) for other tokenizers.
PROMPT_TOKEN_MARGIN = 16


def fit_to_prompts(args: EngineArgs, prompts: Sequence[str], chat: bool) -> EngineArgs:
    """The engine arguments cut to what generating `prompts` can use.

    All prompts are added at once, so no more than len(prompts) sequences ever run, and the
    only prefill step holds at most their tokens: decode graphs, the worst-case profile and the
    KV pool's cap need cover no more sequences, and piecewise graphs no more tokens (a step past
    them runs eagerly). Results do not change; start-up does less.
    """
    fit = {"max_num_seqs": min(args.max_num_seqs, max(1, len(prompts)))}
    if not chat:  # the chat template's own text is unknown before the tokenizer loads
        bound = sum(len(p.encode("utf-8")) + PROMPT_TOKEN_MARGIN for p in prompts)
        fit["max_prefill_graph_tokens"] = min(args.max_prefill_graph_tokens, bound)
    return dataclasses.replace(args, **fit)


def _generate(ns: argparse.Namespace) -> int:
    from peregrine.entrypoints.llm import LLM
    from peregrine.sampling_params import SamplingParams
    prompts = ns.prompt or ["def fibonacci(n):"]
    args = fit_to_prompts(engine_args_from(ns), prompts, ns.chat)
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p,
                            top_k=ns.top_k, seed=ns.sampling_seed)
    llm = LLM(**dataclasses.asdict(args))
    try:
        if ns.chat:
            outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params,
                            use_tqdm=False)
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
    except RuntimeError as e:  # the engine failed (a dead core, a failed step)
        logging.getLogger("peregrine").debug("generate failed", exc_info=True)
        print(f"error: generation failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        llm.shutdown()
    failed = 0
    for prompt, out in zip(prompts, outs):
        print(f"Prompt: {prompt!r}")
        for o in out.outputs:
            print(f"Output: {o.text!r}  [{len(o.token_ids)} tokens, finish_reason={o.finish_reason}]")
            if o.finish_reason == "error":
                failed += 1
                print(f"error: the request for prompt {prompt!r} failed: "
                      f"{out.error or 'no reason given'}", file=sys.stderr)
    return 1 if failed else 0


def _add_generate(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="generate text offline from prompts",
                         description="Generate text offline from prompts. The engine is sized "
                         "for them: --max-num-seqs and --max-prefill-graph-tokens are cut to "
                         "what the prompts can use.")
    gen.add_argument("prompt", nargs="*", help="prompt(s) (default: a demo prompt)")
    add_engine_args(gen)
    gen.add_argument("--max-tokens", type=int, default=32,
                     help="most tokens to generate per prompt (default: %(default)s)")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="sampling temperature; 0 is greedy (default: %(default)s)")
    gen.add_argument("--top-p", type=float, default=1.0,
                     help="nucleus sampling threshold (default: %(default)s)")
    gen.add_argument("--top-k", type=int, default=0,
                     help="sample from the k likeliest tokens; 0 is off (default: %(default)s)")
    gen.add_argument("--sampling-seed", type=int, default=None,
                     help="seed of the requests' sampling (default: the engine's --seed)")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=False,
                     help="wrap each prompt in the chat template (default: %(default)s)")
    gen.set_defaults(func=_generate)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from peregrine.bench import offline, serve
    bench = sub.add_parser("bench", help="benchmarks: throughput, latency, serve",
                           description="Benchmarks: offline throughput and latency, and a "
                           "serving benchmark against a running server.")
    kinds = bench.add_subparsers(dest="bench_kind", required=True, metavar="{throughput,latency,serve}")
    for kind, text in (("throughput", "offline throughput of many requests (W1)"),
                       ("latency", "offline latency of one request (W2)")):
        p = kinds.add_parser(kind, help=text, description=text[0].upper() + text[1:] + ".")
        offline.add_cli_args(p, kind)
        p.set_defaults(func=lambda ns, kind=kind: offline.run(kind, ns))
    p = kinds.add_parser("serve", help="TTFT, TPOT, ITL and throughput through a running server",
                         description=serve.__doc__)
    serve.add_cli_args(p)
    p.set_defaults(func=serve.run)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with `command` "generate", the bench parsers (and the imports
    they need) are left out, since that command line cannot reach them."""
    parser = argparse.ArgumentParser(prog="peregrine", description="Peregrine LLM inference engine")
    parser.add_argument("-V", "--version", action="version", version=f"peregrine {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    # `serve` parses its own flags (entrypoints/serve.py); listed here for --help.
    sub.add_parser("serve", help="run the OpenAI-compatible server (needs the serve extra)",
                   add_help=False)
    if command == "generate":
        sub.add_parser("bench", help="benchmarks: throughput, latency, serve", add_help=False)
    else:
        _add_bench(sub)
    return parser


def missing_serve_modules() -> list[str]:
    """The serve extra's modules that are not installed."""
    def installed(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            return False
    return [m for m in SERVE_EXTRA_MODULES if not installed(m)]


def _serve(argv: list[str]) -> int:
    missing = missing_serve_modules()
    if not missing:
        try:
            from peregrine.entrypoints.serve import serve_main
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] not in SERVE_EXTRA_MODULES:
                raise
            missing = [e.name.split(".")[0]]
    if missing:
        print(f"error: peregrine serve needs the serve extra ({', '.join(missing)} not "
              f"installed): {SERVE_EXTRA_INSTALL}", file=sys.stderr)
        return 1
    return serve_main(argv) or 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if argv[:1] == ["serve"]:
        return _serve(argv[1:])
    ns = build_parser(argv[0] if argv else None).parse_args(argv)
    try:
        return ns.func(ns)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run() -> None:
    """The `peregrine` program. After `generate` (its engine shut down, its output printed) the
    process exits at once: tearing down the interpreter's modules and the device's memory
    piece by piece only delays the exit that releases them all."""
    argv = sys.argv[1:]
    code = main(argv)
    if argv[:1] != ["generate"]:
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    run()
