"""What each quantization method costs in quality: held-out cross-entropy (nats per token) of the
built-in demo model on the standard-library modules it never saw (textwrap, csv, json), through
the engine's own quantized layers, beside the unquantized model.

    python benchmarks/quant_quality.py --out quant_quality.json [--tokens 8192] [--device cpu]

Each method builds its own LLM (prompt log-probabilities of consecutive windows of the model's
context, overlapping by one token, so every token after the first is scored once). On the CPU the
quantized layers run their dequantize-then-matmul path, which computes with exactly the rounded
weights the GPU kernels read; activations are float32 there unless --dtype says otherwise.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (label, LLM keyword arguments)
METHODS: list[tuple[str, dict]] = [
    ("unquantized", {}),
    ("int8 RTN g128", {"quantization": "rtn-int8"}),
    ("int6 RTN g128", {"quantization": "rtn-int6"}),
    ("int4 RTN g128", {"quantization": "rtn-int4"}),
    ("FP8 W8A8 (online)", {"quantization": "fp8"}),
    ("FP8 KV cache (e4m3; scales 1.0)", {"kv_cache_dtype": "fp8"}),
]


def held_out_stream(model_dir: Path, tokens: int) -> list[int]:
    """bos, tokens, eos per held-out module file (textwrap and csv first), cut to tokens + 1."""
    from tokenizers import Tokenizer

    from peregrine.demo import corpus
    from peregrine.demo.evaluate import encode_documents
    split = corpus.load_split()
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    order = {"textwrap.py": 0, "csv.py": 1}
    files = sorted(split.held_out, key=lambda f: (order.get(f.module, 2), f.rel))
    return encode_documents(tok, [f.text for f in files])[:tokens + 1].tolist()


def cross_entropy(model_dir: Path, stream: list[int], window: int, dtype: str, device: str,
                  chunk: int, **kw) -> float:
    """Mean negative log-probability of every token after the first, in windows that fit in
    `window` positions (the model's context)."""
    from peregrine import LLM, SamplingParams
    # NOTE: prefill in chunks of `chunk` tokens, so each token attends to most of its context
    # through the KV cache (what an FP8 cache changes), as decoding does.
    llm = LLM(str(model_dir), dtype=dtype, device=device, max_model_len=window,
              enable_prefix_caching=False, enable_chunked_prefill=True,
              max_num_batched_tokens=chunk, seed=0, **kw)
    length = window - 1  # room for the one token each request must generate
    prompts = [{"prompt_token_ids": stream[s:s + length]}
               for s in range(0, len(stream) - 1, length - 1)]
    prompts = [p for p in prompts if len(p["prompt_token_ids"]) > 1]
    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    total, count = 0.0, 0
    for p, out in zip(prompts, llm.generate(prompts, sp, use_tqdm=False)):
        ids = p["prompt_token_ids"]
        for i in range(1, len(ids)):  # position 0 has no prediction
            total -= out.prompt_logprobs[i][ids[i]].logprob
            count += 1
    del llm
    gc.collect()
    return total / count


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="write the table as JSON here")
    p.add_argument("--tokens", type=int, default=8192, help="held-out tokens scored")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="auto")
    p.add_argument("--chunk", type=int, default=32, help="prefill chunk (tokens per step)")
    p.add_argument("--methods", default=None,
                   help="comma-separated labels to run (default: all)")
    ns = p.parse_args()
    from peregrine.demo import demo_model_path
    model_dir = Path(demo_model_path())
    window = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
    stream = held_out_stream(model_dir, ns.tokens)
    wanted = None if ns.methods is None else set(ns.methods.split(","))
    rows = []
    base = None
    print(f"held-out tokens scored: {len(stream) - 1}, window {window}, dtype {ns.dtype}, "
          f"prefill chunks of {ns.chunk}")
    for label, kw in METHODS:
        if wanted is not None and label not in wanted:
            continue
        t0 = time.perf_counter()
        ce = cross_entropy(model_dir, stream, window, ns.dtype, ns.device, ns.chunk, **kw)
        base = ce if label == "unquantized" else base
        delta = None if base is None else ce - base
        rows.append({"method": label, "settings": kw, "cross_entropy": ce,
                     "delta_vs_unquantized": delta, "perplexity": math.exp(ce),
                     "seconds": time.perf_counter() - t0})
        extra = "" if delta is None else f"  ({delta:+.5f})"
        print(f"{label:34s} {ce:.5f} nats/token{extra}", flush=True)
    Path(ns.out).write_text(json.dumps({"tokens": len(stream) - 1, "window": window,
                                        "dtype": ns.dtype, "chunk": ns.chunk, "rows": rows},
                                       indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
