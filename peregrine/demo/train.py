"""Train the demo model and its draft on this Python's standard library (deterministic recipe)."""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import tarfile
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from peregrine.demo import corpus
from peregrine.demo.checkpoint import BOS_ID, EOS_ID, PAD_ID, save_model_folder
from peregrine.demo.evaluate import (encode_documents, model_cross_entropy, unigram_cross_entropy,
                                     unigram_log_probs)
from peregrine.demo.tokenizer import save_tokenizer, train_bpe_json

MAIN_DIR, DRAFT_DIR = "demo-model", "demo-draft"


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int


def llama_config(shape: ModelShape, vocab_size: int, max_len: int) -> Any:
    """A tied-embedding Llama config for the demo tokenizer's special ids."""
    from transformers import LlamaConfig

    if shape.hidden_size % shape.num_attention_heads:
        raise ValueError(f"hidden_size {shape.hidden_size} is not a multiple of "
                         f"num_attention_heads {shape.num_attention_heads}")
    if shape.num_attention_heads % shape.num_key_value_heads:
        raise ValueError(f"num_attention_heads {shape.num_attention_heads} is not a multiple of "
                         f"num_key_value_heads {shape.num_key_value_heads}")
    return LlamaConfig(
        vocab_size=vocab_size, max_position_embeddings=max_len, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
        pad_token_id=PAD_ID, architectures=["LlamaForCausalLM"], **asdict(shape))


def _add_dropout(model: Any, p: float) -> list[Any]:
    """Dropout (in training only) on the embeddings' output and on each decoder layer's output:
    the corpus is a few million tokens, so the models overfit without it. Nothing of it is
    saved; inference is unchanged."""
    if p <= 0.0:
        return []

    def drop(module: torch.nn.Module, inputs: Any, output: Any) -> Any:
        if not module.training:
            return output
        if isinstance(output, tuple):
            return (F.dropout(output[0], p, True),) + tuple(output[1:])
        return F.dropout(output, p, True)

    modules = [model.model.embed_tokens, *model.model.layers]
    return [m.register_forward_hook(drop) for m in modules]


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up to peak, then cosine decay to a tenth of it at the last step."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def batch_starts(num_windows: int, seq_len: int, batch_size: int, steps: int,
                 seed: int) -> torch.Tensor:
    """Window start offsets per step: each epoch visits every window once in a seeded order."""
    gen = torch.Generator().manual_seed(seed)
    needed = steps * batch_size
    orders = [torch.randperm(num_windows, generator=gen)
              for _ in range(math.ceil(needed / num_windows))]
    return (torch.cat(orders)[:needed] * seq_len).view(steps, batch_size)  # (S, B)


def train_model(name: str, shape: ModelShape, stream: torch.Tensor, val_stream: torch.Tensor,
                args: argparse.Namespace, device: torch.device, lr: float) -> tuple[Any, dict]:
    """Train one model; returns it (on the CPU, float32, best validation weights) and its log."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(args.seed)
    config = llama_config(shape, args.vocab_size, args.seq_len)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).to(device)
    hooks = _add_dropout(model, args.dropout)
    num_windows = (stream.numel() - 1) // args.seq_len
    if num_windows < 1:
        raise ValueError(f"the training stream ({stream.numel()} tokens) is shorter than one "
                         f"window of seq_len {args.seq_len}")
    steps = args.max_steps or max(1, math.ceil(args.epochs * num_windows / args.batch_size))
    starts = batch_starts(num_windows, args.seq_len, args.batch_size, steps, args.seed).to(device)
    offsets = torch.arange(args.seq_len + 1, device=device)  # (L + 1,)
    data = stream.to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    warmup = min(args.warmup, max(1, steps // 10))
    log = {"steps": steps, "epochs": steps * args.batch_size / num_windows, "lr": lr,
           "params": sum(p.numel() for p in model.parameters()), "validation": []}
    best = (math.inf, -1, None)
    t0 = time.perf_counter()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
        batch = data[starts[step][:, None] + offsets]  # (B, L + 1)
        with autocast:
            logits = model(input_ids=batch[:, :-1], use_cache=False).logits  # (B, L, V)
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        last = step == steps - 1
        if (step + 1) % args.eval_every == 0 or last:
            model.eval()
            with autocast:
                val = model_cross_entropy(model, val_stream, args.seq_len)
            model.train()
            elapsed = time.perf_counter() - t0
            log["validation"].append({"step": step + 1, "train_loss": round(float(loss), 4),
                                      "val_ce": round(val, 4), "seconds": round(elapsed, 1)})
            print(f"[{name}] step {step + 1}/{steps} loss {float(loss):.3f} val {val:.3f} "
                  f"{(step + 1) * args.batch_size * args.seq_len / elapsed:,.0f} tok/s",
                  flush=True)
            if val < best[0]:
                best = (val, step + 1, {k: v.detach().clone() for k, v in
                                        model.state_dict().items()})
    for h in hooks:
        h.remove()
    model.load_state_dict(best[2])
    log.update(best_step=best[1], best_val_ce=best[0], seconds=time.perf_counter() - t0)
    return model.cpu().float(), log


def packaged_cross_entropy(model: Any, stream: torch.Tensor, seq_len: int,
                           device: torch.device) -> float:
    """Held-out cross-entropy of the weights as packaged: rounded to bf16, computed in float32."""
    import copy

    rounded = copy.deepcopy(model).to(torch.bfloat16).float().to(device).eval()
    return model_cross_entropy(rounded, stream, seq_len)


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def write_tar(folder: Path, tar_path: Path) -> None:
    """A reproducible tar of folder (sorted members, fixed times and owners)."""
    def clean(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
        info.mode = 0o644
        return info
    with tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(folder.iterdir()):
            tar.add(path, arcname=f"{folder.name}/{path.name}", filter=clean)


def markdown_table(report: dict[str, Any]) -> str:
    """The numbers of docs/DEMO_MODEL.md, as a markdown table."""
    m, d, u = report["main"], report["draft"], report["unigram"]
    def row(name: str, r: dict[str, Any]) -> tuple[str, ...]:
        return (name, f"{r['params']:,}", f"{r['folder_bytes'] / 1e6:.2f}",
                f"{r['held_out_ce']:.3f}", f"{r['held_out_bits_per_byte']:.3f}", str(r["steps"]),
                f"{r['seconds']:.0f}")
    rows = [("model", "parameters", "folder (MB)", "held-out CE (nats/token)",
             "bits per byte", "steps", "train seconds"), row("main", m), row("draft", d),
            ("unigram (add-one)", "", "", f"{u['held_out_ce']:.3f}",
             f"{u['held_out_bits_per_byte']:.3f}", "", "")]
    lines = ["| " + " | ".join(r) + " |" for r in rows]
    lines.insert(1, "|" + "---|" * len(rows[0]))
    t = report["tokens"]
    lines.append("")
    lines.append(f"Held out: {', '.join(report['held_out_modules'])} ({t['held_out']:,} tokens); "
                 f"trained on {report['files']['train']} files, {t['train']:,} tokens; "
                 f"{report['device']}, {report['wall_seconds']:.0f} s in all.")
    return "\n".join(lines)


def setup_determinism(seed: int) -> None:
    # NOTE: cuBLAS reads this when its first handle is made, so it must be set before any CUDA
    # matmul; ops without a deterministic kernel warn (counted in the report) instead of failing.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.manual_seed(seed)


def versions() -> dict[str, str]:
    import tokenizers
    import transformers
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
            "cuda": str(torch.version.cuda)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Train the demo model and draft on this Python's standard library. The "
                    "defaults are the packaged recipe (one GPU, a few minutes).")
    p.add_argument("--out-dir", required=True, help="where the model folders and report go")
    p.add_argument("--tar", action="store_true",
                   help=f"write {MAIN_DIR}.tar and {DRAFT_DIR}.tar instead of the two folders")
    p.add_argument("--stdlib", default=None, help="stdlib folder (default: this Python's)")
    p.add_argument("--max-files", type=int, default=None,
                   help="train on the first N files only (tiny runs; held-out modules kept)")
    p.add_argument("--device", default="auto", help="auto (cuda if present), cuda or cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=512, help="training length = max_model_len")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=float, default=8.0, help="passes over the training tokens")
    p.add_argument("--max-steps", type=int, default=None, help="fixed step count (overrides "
                   "--epochs; both models)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--draft-lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--dropout", type=float, default=0.1,
                   help="training-only dropout on the embedding and decoder-layer outputs")
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--max-eval-tokens", type=int, default=None,
                   help="evaluate on the first N validation and held-out tokens (tiny runs)")
    p.add_argument("--attention", choices=["math", "auto"], default="math",
                   help="SDPA kernels on CUDA: math (deterministic backward) or auto")
    for prefix, shape in (("", MAIN_SHAPE), ("draft-", DRAFT_SHAPE)):
        for field, value in asdict(shape).items():
            p.add_argument(f"--{prefix}{field.replace('_', '-')}", type=int, default=value)
    args = p.parse_args(argv)
    for name in ("vocab_size", "seq_len", "batch_size", "eval_every", "warmup"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.epochs <= 0:
        p.error("--epochs must be > 0")
    return args


MAIN_SHAPE = ModelShape(hidden_size=256, num_hidden_layers=8, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=768)
DRAFT_SHAPE = ModelShape(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=384)


def _shape(args: argparse.Namespace, prefix: str) -> ModelShape:
    return ModelShape(**{f: getattr(args, prefix + f) for f in asdict(MAIN_SHAPE)})


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cuda", "cpu"):
        raise ValueError(f"--device must be auto, cuda or cpu, got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but CUDA is not available")
    return torch.device(name)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole recipe: corpus, tokenizer, both models, evaluation, folders and report."""
    from tokenizers import Tokenizer

    t_start = time.perf_counter()
    setup_determinism(args.seed)
    device = _device(args.device)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    split = corpus.load_split(args.stdlib, max_files=args.max_files)
    t_tok = time.perf_counter()
    tok_json = train_bpe_json((f.text for f in split.train), args.vocab_size)
    tokenizer = Tokenizer.from_str(tok_json)
    train_ids = encode_documents(tokenizer, [f.text for f in split.train])
    val_ids = encode_documents(tokenizer, [f.text for f in split.validation])
    held_ids = encode_documents(tokenizer, [f.text for f in split.held_out])
    if args.max_eval_tokens is not None:
        val_ids, held_ids = val_ids[:args.max_eval_tokens], held_ids[:args.max_eval_tokens]
    tok_seconds = time.perf_counter() - t_tok
    print(f"corpus: {len(split.train)} train files ({train_ids.numel():,} tokens), "
          f"{len(split.held_out)} held-out ({held_ids.numel():,}), tokenizer and encoding "
          f"{tok_seconds:.1f} s", flush=True)
    # NOTE: bytes of the evaluated tokens (bos/eos count as none), for bits per byte.
    held_bytes = len(tokenizer.decode(held_ids.tolist(), skip_special_tokens=True).encode())
    bits_per_byte = (held_ids.numel() - 1) / held_bytes / math.log(2)
    unigram = unigram_cross_entropy(unigram_log_probs(train_ids, args.vocab_size), held_ids)

    stage = Path(tempfile.mkdtemp(prefix="demo-train-")) if args.tar else out
    results: dict[str, dict[str, Any]] = {}
    caught: list[str] = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for key, folder, prefix, lr in (("main", MAIN_DIR, "", args.lr),
                                        ("draft", DRAFT_DIR, "draft_", args.draft_lr)):
            shape = _shape(args, prefix)
            with _sdpa_context(args.attention, device):
                model, log = train_model(key, shape, train_ids, val_ids, args, device, lr)
            ce = packaged_cross_entropy(model, held_ids, args.seq_len, device)
            path = save_model_folder(model, stage / folder, torch.bfloat16)
            save_tokenizer(tok_json, path, model_max_length=args.seq_len)
            results[key] = {**log, "shape": asdict(shape), "held_out_ce": ce,
                            "held_out_bits_per_byte": ce * bits_per_byte,
                            "folder_bytes": folder_bytes(path)}
            print(f"[{key}] held-out CE {ce:.4f} nats/token, {results[key]['params']:,} params, "
                  f"{results[key]['folder_bytes'] / 1e6:.2f} MB", flush=True)
        caught = sorted({str(w.message).split("\n")[0] for w in seen
                         if "deterministic" in str(w.message)})
    if args.tar:
        for folder in (MAIN_DIR, DRAFT_DIR):
            write_tar(stage / folder, out / f"{folder}.tar")
        shutil.rmtree(stage, ignore_errors=True)
    report = {
        "held_out_modules": list(corpus.HELD_OUT_MODULES),
        "validation_modules": list(corpus.VALIDATION_MODULES),
        "held_out_files": [f.rel for f in split.held_out],
        "excluded": {"folders": sorted(corpus.EXCLUDED_DIRS) + ["config-*"],
                     "max_file_bytes": corpus.MAX_FILE_BYTES, "counts": split.excluded},
        "stdlib": str(args.stdlib or corpus.stdlib_root()),
        "files": {"train": len(split.train), "validation": len(split.validation),
                  "held_out": len(split.held_out)},
        "tokens": {"train": train_ids.numel(), "validation": val_ids.numel(),
                   "held_out": held_ids.numel()},
        "held_out_bytes": held_bytes, "vocab_size": args.vocab_size, "seq_len": args.seq_len,
        "main": results["main"], "draft": results["draft"],
        "unigram": {"held_out_ce": unigram, "held_out_bits_per_byte": unigram * bits_per_byte},
        "tokenizer_seconds": tok_seconds, "wall_seconds": time.perf_counter() - t_start,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "nondeterministic_ops": caught, "versions": versions(),
        "args": {k: v for k, v in vars(args).items() if k not in ("out_dir",)},
    }
    report["markdown"] = markdown_table(report)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(report["markdown"], flush=True)
    return report


def _sdpa_context(attention: str, device: torch.device) -> Any:
    import contextlib

    if attention == "math" and device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return sdpa_kernel([SDPBackend.MATH])
    return contextlib.nullcontext()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
