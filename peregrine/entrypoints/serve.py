"""`peregrine serve [MODEL] ...`: flags come from the EngineArgs and ServerArgs fields."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from peregrine import envs
from peregrine.config import EngineArgs
from peregrine.entrypoints.cli import (add_dataclass_args, add_engine_args, dataclass_from,
                                       engine_args_from)
from peregrine.entrypoints.model_path import model_folder
from peregrine.entrypoints.openai.api_server import ServerArgs
from peregrine.entrypoints.openai.serving_common import MIN_PROMPT_CHARS, PROMPT_CHARS_PER_TOKEN

logger = logging.getLogger(__name__)

_SERVER_HELP = {
    "host": "address to listen on; the default answers this machine only, 0.0.0.0 (or ::) "
            "listens on every interface",
    "port": "port to listen on (0: any free port)",
    "api_key": "require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize and "
               "/tokenizer_info (default: $PEREGRINE_API_KEY)",
    "max_request_body_bytes": "larger request bodies get 413",
    "health_no_progress_timeout": "/health answers 503 after this many seconds without "
                                  "engine progress while work is pending",
    "log_stats_interval": "seconds between stats log lines (0: off)",
    "retry_after": "Retry-After seconds sent with 429 (queue full)",
    "uvicorn_log_level": "uvicorn's log level",
    "trust_request_chat_template": "accept chat templates sent in requests (chat_template, "
                                   "chat_template_kwargs.chat_template); they are Jinja programs "
                                   "that run without a time bound, so only for trusted clients",
    "max_prompt_chars": "longest text prompt in characters, checked before tokenizing (default: "
                        f"{PROMPT_CHARS_PER_TOKEN} per token of max_model_len, at least "
                        f"{MIN_PROMPT_CHARS}; a longer text cannot fit the context in practice)",
    "shutdown_timeout": "on SIGTERM/SIGINT stop accepting, let open requests run this many "
                        "seconds, then abort the rest (streams end with an error event and "
                        "[DONE], others get 503); a second signal aborts at once",
    "max_connections": "open connections beyond this get 503, /health included (default: the "
                       "open-file limit less a reserve of 64)",
    "keep_alive_timeout": "seconds an idle keep-alive connection stays open",
    "request_read_timeout": "seconds a connection has to send a whole request (headers and "
                            "body) after it opens or after its last response; then it is closed",
    "max_header_bytes": "most bytes of an unfinished request head (request line and headers) "
                        "buffered; beyond that 400",
    "reasoning_parser": "split the model's <think>...</think> text into reasoning_content in chat "
                        "answers and streams: qwen3 or deepseek_r1",
    "enable_auto_tool_choice": "parse tool calls out of the model's text (tool_choice auto); "
                               "needs --tool-call-parser",
    "tool_call_parser": "the model's tool-call format: hermes (Qwen2.5, Qwen3), llama3_json, "
                        "mistral",
    "relax_openai_limits": "accept what the engine accepts instead of OpenAI's documented limits "
                           "(temperature up to 100 instead of 2, up to 64 stop strings instead "
                           "of 4)",
}


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Add `serve`'s arguments: MODEL, every EngineArgs flag, every ServerArgs flag."""
    parser.add_argument("model", nargs="?", default=None,
                        help="local model folder, Hugging Face model id, or a config .json "
                        "(dummy weights, token-id prompts only); default: the built-in demo model")
    parser.add_argument("--model", dest="model_option", default=None, metavar="MODEL",
                        help="the same as the positional MODEL (as in vLLM)")
    add_engine_args(parser, skip={"model"})
    add_dataclass_args(parser, ServerArgs, _SERVER_HELP)


def server_args_from(ns: argparse.Namespace) -> ServerArgs:
    args = dataclass_from(ns, ServerArgs)
    if args.api_key is None and envs.api_key():
        args = dataclasses.replace(args, api_key=envs.api_key())
    return args


def resolve_model_arg(args: EngineArgs) -> EngineArgs:
    """A config .json instead of a folder: serve that architecture with dummy weights, no tokenizer."""
    if args.model is None or not args.model.endswith(".json") or not os.path.isfile(args.model):
        return args
    folder = model_folder(args.model)
    load_format = "dummy" if args.load_format == "auto" else args.load_format
    logger.info("serving %s with %s weights and no tokenizer (token-id prompts only)",
                args.model, load_format)
    return dataclasses.replace(args, model=folder, load_format=load_format,
                               skip_tokenizer_init=True,
                               served_model_name=args.served_model_name or args.model)


def serve_main(argv: list[str] | None = None) -> int:
    """Parse the flags, build the engine, serve until interrupted; returns the exit code."""
    parser = argparse.ArgumentParser(prog="peregrine serve",
                                     description="Run the OpenAI-compatible server.")
    add_serve_args(parser)
    ns = parser.parse_args(argv)
    if ns.model_option is not None:
        if ns.model is not None and ns.model != ns.model_option:
            parser.error(f"two models given: {ns.model!r} and --model {ns.model_option!r}")
        ns.model = ns.model_option
    try:
        engine_args = resolve_model_arg(engine_args_from(ns))
        server_args = server_args_from(ns)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from peregrine.entrypoints.openai.api_server import listen_or_explain, run_server
    # NOTE: the port is taken (bound and listening) before the model loads, so a busy port is
    # a one-line error in a second, not after minutes of loading.
    try:
        sock = listen_or_explain(server_args.host, server_args.port)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        from peregrine.engine.async_engine import AsyncEngine
        engine = AsyncEngine.from_engine_args(engine_args)
    except ValueError as e:
        sock.close()
        print(f"error: {e}", file=sys.stderr)
        return 2
    run_server(engine, server_args, sock)
    return 0


if __name__ == "__main__":
    sys.exit(serve_main())
