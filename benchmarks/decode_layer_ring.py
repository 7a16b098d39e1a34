"""Checks and times the persistent decode kernel (kernels/decode_layers.py) on Llama-3-8B's
layers at batch 1 with random 4-bit weights.

`build` makes random layouts (scales, zero points), norm weights, a paged K/V cache holding the
context's earlier tokens and the step's position and slot, and packs them with
`DecodeLayers`; `reference_layers` is the same layers in torch with the kernel's rounding points
(without them, transformers' Llama layers: see the tests). Each form's outputs are compared with
it, then timed as CUDA-graph replays of 32 layers:

- `ring`: the kernel as the engine runs it;
- `ring_now`: each piece's ticket read at once (not after the program's next piece);
- `ring_fold`: the attention programs make their q, k and v rows from the qkv phase's partials,
  so the qkv tiles have no finish (a ticket, a read of the partials and a store less between
  the two phases);
- `ring_traced` / `ring_fold_traced`: with %globaltimer stamps where each program's wait ended
  and its phase ended (a mean timeline of the middle layers);
- `ring_free`: no waits between the phases: the stream and the phases' own work, the floor this
  design allows;
- `no_finishes` / `no_attention`: `ring` without the tiles' finishes / attention's work.
The last three are for their times only (their outputs are not the layers').

    python benchmarks/decode_layer_ring.py --out /tmp/out/decode_layer_ring.json

`--ncu`: one launch of the first ring, variant and form between cudaProfilerStart/Stop (no
timing, no reference), for a profiler attached from outside:

    ncu --clock-control none --profile-from-start off -k regex:decode_layers_kernel \
        --section WarpStateStats --section SourceCounters -o /tmp/out/ring \
        python benchmarks/decode_layer_ring.py --ncu --out /tmp/out/ncu.json --rings 4x16
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cuda_timing import graph_replay_ms, write_results  # noqa: E402
from peregrine.kernels.decode_layers import (DecodeLayers, Dims, LayerWeights,  # noqa: E402
                                             offsets)

LLAMA3_8B = {"H": 4096, "HEADS": 32, "KVH": 8, "D": 128, "INTER": 14336, "BS": 16,
             "theta": 500000.0, "eps": 1e-5}
# form: (the phases' waits, timestamps, what is left out: 1 the tiles' finishes, 2 attention's
# work, attention making q, k and v from the qkv partials, tickets read after the next piece)
FORMS = {"ring": (True, False, 0, 0, True), "ring_now": (True, False, 0, 0, False),
         "ring_fold": (True, False, 0, 1, True), "ring_traced": (True, True, 0, 0, True),
         "ring_fold_traced": (True, True, 0, 1, True), "ring_free": (False, False, 0, 0, True),
         "no_finishes": (True, False, 1, 0, True), "no_attention": (True, False, 2, 0, True)}


def dims_of(cfg: dict) -> Dims:
    return Dims(cfg["H"], cfg["HEADS"], cfg["KVH"], cfg["D"], cfg["INTER"], cfg["BS"],
                cfg["eps"])


def build(layers: int, P: int, ctx: int, dev: torch.device, cfg: dict = LLAMA3_8B,
          seed: int = 0, warps: int = 4, stages: int = 16, splits: int = 16,
          rows: bool = False) -> dict:
    """Random 4-bit layouts (scales, zero points) of `layers` layers and their norm weights,
    packed by DecodeLayers (with `rows`, by decode_rows.DecodeRows) for P programs; a paged
    K/V cache of ctx - 1 earlier tokens a layer (each layer's in its own blocks, one block
    table); the step's position ctx - 1 and slot; a RoPE table; the first layer's input h0."""
    from peregrine.layers.quantization.wna16 import WNA16Layout
    torch.manual_seed(seed)
    H, HEADS, KVH, D, INTER, BS = (cfg[k] for k in ("H", "HEADS", "KVH", "D", "INTER", "BS"))
    shapes = ((H, (HEADS + 2 * KVH) * D), (HEADS * D, H), (H, 2 * INTER), (INTER, H))
    norms = (1.0 + 0.1 * torch.randn(2 * layers + 1, H, device=dev)).to(torch.bfloat16)
    weights = []
    for layer in range(layers):
        ws = []
        for k, n in shapes:
            q = torch.randint(0, 16, (k, n), device=dev, dtype=torch.int32)
            sc = torch.rand(k // 128, n, device=dev) * (2.0 / k) ** 0.5 / 4 + 1e-4
            zp = torch.randint(0, 16, (k // 128, n), device=dev).float()
            ws.append(WNA16Layout.build(q, sc, zp, None, 4, torch.bfloat16))
            del q
        weights.append(LayerWeights(*ws, norms[2 * layer], norms[2 * layer + 1]))
    if rows:
        from peregrine.kernels.decode_rows import DecodeRows
        dl = DecodeRows(dims_of(cfg), weights, norms[2 * layers], dev, splits=splits,
                        programs=P)
    else:
        dl = DecodeLayers(dims_of(cfg), weights, norms[2 * layers], dev, warps=warps,
                          stages=stages, splits=splits, programs=P)
    blocks_a_layer = -(-ctx // BS) + 1
    shape = (layers * blocks_a_layer, BS, KVH, D)
    k_cache = torch.randn(shape, device=dev).to(torch.bfloat16)
    v_cache = torch.randn(shape, device=dev).to(torch.bfloat16)
    per = [(k_cache[i * blocks_a_layer:(i + 1) * blocks_a_layer],
            v_cache[i * blocks_a_layer:(i + 1) * blocks_a_layer]) for i in range(layers)]
    dl.bind_caches(per)
    # the sequence's blocks, shuffled, the same ids within each layer's own blocks
    block_table = torch.randperm(blocks_a_layer, device=dev).to(torch.int32)
    pos = ctx - 1
    slot = int(block_table[pos // BS]) * BS + pos % BS
    inv = cfg["theta"] ** (-torch.arange(0, D, 2, device=dev, dtype=torch.float64) / D)
    ang = torch.arange(ctx, device=dev, dtype=torch.float64)[:, None] * inv[None, :]
    return {"cfg": cfg, "dl": dl, "weights": weights, "norms": norms, "k_cache": k_cache,
            "v_cache": v_cache, "caches": per, "block_table": block_table,
            "blocks_a_layer": blocks_a_layer, "pos": pos, "slot": slot,
            "positions": torch.tensor([pos], device=dev),
            "slots": torch.tensor([slot], device=dev),
            "cos_sin": torch.cat([ang.cos(), ang.sin()], 1).float(),
            "h0": torch.randn(1, H, device=dev).to(torch.bfloat16)}


def call(d: dict) -> torch.Tensor:
    """The kernel over d's layers (DecodeLayers' current form)."""
    return d["dl"](d["h0"], d["positions"], d["slots"], d["block_table"], d["cos_sin"])


def _round(x: torch.Tensor) -> torch.Tensor:
    """Rounded to bf16, back in float32."""
    return x.to(torch.bfloat16).float()


def reference_layers(d: dict, rounding: bool = True) -> dict:
    """The kernel's layers in torch (float32 sums, the kernel's rounding points; without
    `rounding`, float32 throughout): the final h and xn, every layer's K/V rows at the step's
    slot, and the last layer's q, attention output and silu(gate) * up."""
    _rb = _round if rounding else (lambda x: x)
    cfg = d["cfg"]
    H, HEADS, KVH, D, INTER, BS = (cfg[k] for k in ("H", "HEADS", "KVH", "D", "INTER", "BS"))
    eps, pos = cfg["eps"], d["pos"]
    norms = d["norms"].float()
    cos, sin = d["cos_sin"][pos, :D // 2], d["cos_sin"][pos, D // 2:]
    h = d["h0"].float().reshape(H)
    toks = torch.arange(pos + 1, device=h.device)
    slots = d["block_table"].long()[toks // BS] * BS + toks % BS
    ks, vs = [], []

    def rope(x):  # (heads, D)
        x1, x2 = x[:, :D // 2], x[:, D // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], 1)

    def rms(x):
        return torch.rsqrt(x.pow(2).sum() / H + eps)

    for layer, w in enumerate(d["weights"]):
        xn = _rb(h * norms[2 * layer])
        qkv = _rb((xn @ w.qkv.dequantize(torch.float32).t()) * rms(h))
        q = _rb(rope(qkv[:HEADS * D].view(HEADS, D)))
        k = _rb(rope(qkv[HEADS * D:(HEADS + KVH) * D].view(KVH, D)))
        v = qkv[(HEADS + KVH) * D:].view(KVH, D)
        kc = d["caches"][layer][0].reshape(-1, KVH, D)[slots].float().clone()
        vc = d["caches"][layer][1].reshape(-1, KVH, D)[slots].float().clone()
        kc[-1], vc[-1] = k, v
        ks.append(k)
        vs.append(v)
        kk = kc.repeat_interleave(HEADS // KVH, 1)  # (ctx, HEADS, D)
        vv = vc.repeat_interleave(HEADS // KVH, 1)
        att = torch.softmax(torch.einsum("hd,thd->ht", q, kk) / math.sqrt(D), -1)
        attn = _rb(torch.einsum("ht,thd->hd", att, vv).reshape(-1))
        h = _rb(h + _rb(attn @ w.o.dequantize(torch.float32).t()))
        xn = _rb(h * norms[2 * layer + 1])
        gu = _rb((xn @ w.gate_up.dequantize(torch.float32).t()) * rms(h))
        gate, up = gu[:INTER], gu[INTER:]
        act = _rb(gate / (1.0 + torch.exp(-gate)) * up)
        h = _rb(h + _rb(act @ w.down.dequantize(torch.float32).t()))
    return {"h": h, "xn": _rb(h * norms[-1]), "k": torch.stack(ks), "v": torch.stack(vs),
            "q": q, "attn": attn, "act": act}


def state(d: dict) -> dict:
    """The kernel's outputs after a call, as reference_layers gives them."""
    cfg, dl = d["cfg"], d["dl"]
    H, KVH, D = cfg["H"], cfg["KVH"], cfg["D"]
    off = offsets(dl.dims)
    vec = dl.vec.float()
    return {"h": vec[:H], "xn": vec[H:2 * H],
            "k": torch.stack([k.reshape(-1, KVH, D)[d["slot"]] for k, _ in d["caches"]]).float(),
            "v": torch.stack([v.reshape(-1, KVH, D)[d["slot"]] for _, v in d["caches"]]).float(),
            "q": vec[off["q"]:off["attn"]].view(-1, D), "attn": vec[off["attn"]:off["act"]],
            "act": vec[off["act"]:off["size"]]}


# (largest difference in ulps, relative RMS) within which the kernel's outputs count as the
# reference's: float32 sums in another order flip a bf16 rounding now and then, and a flip moves
# what is computed from it (one layer: a few ulps; more: a relative RMS, no ulp bound)
ONE_LAYER = (8.0, 5e-3)
LAYERS = (None, 2e-2)


def mismatches(got: dict, want: dict, max_ulps: float | None, rel_rms: float) -> dict:
    """The outputs beyond the bounds, with their differences (empty: all within)."""
    return {name: e for name, e in compare(got, want).items()
            if (max_ulps is not None and e["max_ulps"] > max_ulps) or e["rel_rms"] > rel_rms}


def compare(got: dict, want: dict) -> dict:
    """Per output, the largest difference in bf16 ulps at the reference's magnitude (at least its
    RMS's), and the relative RMS difference."""
    out = {}
    for name, w in want.items():
        g = got[name]
        unit = torch.maximum(w.abs(), w.pow(2).mean().sqrt()) * 2.0 ** -8
        out[name] = {"max_ulps": round(((g - w).abs() / unit).max().item(), 2),
                     "rel_rms": float((g - w).pow(2).mean().sqrt() / w.pow(2).mean().sqrt())}
    return out


def timeline(times: torch.Tensor, per: int) -> list[dict]:
    """Per phase of a layer (the mean over the middle layers), in us from the layer's first
    phase's earliest start: when its programs' waits ended (first and last program) and when its
    last program ended; and, as the mean over programs (and the last), when they began to wait,
    had their input in shared memory, had their first piece's MMAs done and their last piece's
    (decode_layers.TRACE_POINTS)."""
    layers = times.shape[0] // per
    t = times.double() / 1e3
    mid = range(layers // 4, max(layers - layers // 4, layers // 4 + 1))
    out = []
    for j in range(per):
        acc: dict[str, float] = {}
        for layer in mid:
            t0 = t[layer * per, :, 0].min()
            f = t[layer * per + j] - t0
            vals = {"met_first": f[:, 0].min(), "met_last": f[:, 0].max(),
                    "end_last": f[:, 1].max(), "end_mean": f[:, 1].mean(),
                    "entry_mean": f[:, 2].mean(), "x_mean": f[:, 3].mean(),
                    "x_last": f[:, 3].max(), "first_piece_mean": f[:, 4].mean(),
                    "pieces_mean": f[:, 5].mean(), "pieces_last": f[:, 5].max()}
            for k, v in vals.items():
                acc[k] = acc.get(k, 0.0) + float(v) / len(mid)
        out.append({k: round(v, 2) for k, v in acc.items()})
    return out


def run(layers: int, ctx: int, warps: int, sz: bool, stages: list[int], splits: int,
        iters: int, forms: list[str], variants: list[tuple[int, int]], x_sources: list[str],
        acc2s: list[bool], tb: int, dev: torch.device, pairs: tuple[bool, ...] = (False,),
        f16s: tuple[bool, ...] = (False,), pipes: tuple[bool, ...] = (False,),
        xsums: tuple[bool, ...] = (False,), per_sms: tuple[int, ...] = (1,),
        polls: tuple[bool, ...] = (True,),
        x_pairs: tuple[bool, ...] = (False,)) -> list[dict]:
    """For each ring depth, where x comes from (`smem`: copied into shared memory once a phase;
    `l2`: read through L2 x_ahead steps ahead), one or two sets of accumulators and (x steps
    ahead, registers a thread): check the kernel against reference_layers (folded or not), then
    time each form (CUDA-graph replays). A form that does not launch (a deep ring beside x's
    copy outgrows shared memory) is recorded with its error."""
    P = torch.cuda.get_device_properties(dev).multi_processor_count
    t0 = time.time()
    d = build(layers, P * max(per_sms), ctx, dev, warps=warps, splits=splits)
    want = reference_layers(d)
    dl = d["dl"]
    dl.scales_in_chunk, dl.tb = sz, tb
    wbytes = (dl.words.numel() + dl.sz_rows.numel()) * 4 / layers
    out = []
    for s, per_sm in [(s, k) for s in stages for k in per_sms]:
        dl.stages = s
        dl.place(P * per_sm)
        res = {"layers": layers, "ctx": ctx, "tb": tb, "warps": warps, "scales_in_chunk": sz,
               "stages": s, "splits": splits, "programs": P * per_sm,
               "wall_us_per_layer": round(wbytes / 4.2e6, 2), "variants": []}
        for src, acc2, pair, f16, pipe, xsum, poll, xp, (x_ahead, regs) in [
                (src, a, pr, h, pp, xx, po, xq, v) for src in x_sources for a in acc2s
                for pr in pairs for h in f16s for pp in pipes for xx in xsums
                for po in polls for xq in x_pairs for v in variants]:
            if src == "smem" and x_ahead != variants[0][0]:
                continue  # (x_ahead is the L2 form's)
            dl.x_smem, dl.acc2, dl.x_ahead, dl.regs = src == "smem", acc2, x_ahead, regs
            if (f16 or pipe) and src != "smem":
                continue  # (the fp16 and pipelined forms read x from shared memory only)
            if pipe and (f16 or pair):
                continue  # (the pipelined form is on bf16 operands, a chunk at a time)
            if xsum and not pipe:
                continue  # (the input sums are the pipelined form's)
            if xp and (src != "smem" or f16):
                continue  # (x's bf16 pairs are written into its shared-memory copy)
            dl.pair, dl.f16, dl.pipe, dl.xsum, dl.poll_one = pair, f16, pipe, xsum, poll
            dl.x_pairs = xp
            v = {"x": src, "acc2": acc2, "pair": pair, "f16": f16, "pipe": pipe, "xsum": xsum,
                 "poll_one": poll, "x_pairs": xp, "x_ahead": x_ahead, "regs": regs}
            try:
                call(d)
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: record, go on
                v["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                res["variants"].append(v)
                print(json.dumps(v), flush=True)
                continue
            for fold in (0, 1):
                dl.wait, dl.trace, dl.skip, dl.fold, dl.defer = True, False, 0, fold, True
                call(d)
                torch.cuda.synchronize()
                v["errors_fold" if fold else "errors"] = compare(state(d), want)
            for name in forms:
                dl.wait, dl.trace, dl.skip, dl.fold, dl.defer = FORMS[name]
                ms = graph_replay_ms([lambda: call(d)], iters)
                v[name] = round(ms * 1e3 / layers, 2)
                if name == "ring" and layers == 32:  # the LM head at the wall, ~30 us a step
                    v["est_tok_s"] = round(1e6 / (ms * 1e3 + 250 + 30), 1)
                if dl.trace:
                    call(d)
                    torch.cuda.synchronize()
                    v[f"{name}_timeline"] = timeline(dl.times.cpu(), 5)
            res["variants"].append(v)
            print(json.dumps(v), f"(layers {layers}, warps {warps}, scales in the chunk {sz}, "
                  f"ring {s}, {per_sm} an SM; {time.time() - t0:.0f} s)", flush=True)
        out.append(res)
    return out


def profile_once(ns: argparse.Namespace, dev: torch.device) -> dict:
    """One launch of the first ring, variant, x source and form, for an outside profiler."""
    w, s = (int(v) for v in ns.rings.split(",")[0].split("x"))
    x_ahead, regs = (int(v) for v in ns.variants.split(",")[0].split("x"))
    P = torch.cuda.get_device_properties(dev).multi_processor_count
    d = build(int(ns.layers.split(",")[0]), P, ns.ctx, dev, warps=w, splits=ns.splits)
    dl = d["dl"]
    form = ns.forms.split(",")[0]
    dl.stages, dl.scales_in_chunk, dl.tb = s, ns.scales.split(",")[0] == "chunk", ns.tb
    dl.x_smem, dl.acc2 = ns.x.split(",")[0] == "smem", ns.acc2.split(",")[0] == "1"
    dl.x_ahead, dl.regs, dl.pair = x_ahead, regs, ns.pair.split(",")[0] == "1"
    dl.f16, dl.pipe = ns.f16.split(",")[0] == "1", ns.pipe.split(",")[0] == "1"
    dl.xsum = ns.xsum.split(",")[0] == "1"
    dl.poll_one = ns.poll.split(",")[0] == "1"
    dl.x_pairs = ns.x_pairs.split(",")[0] == "1"
    dl.wait, dl.trace, dl.skip, dl.fold, dl.defer = FORMS[form]
    for _ in range(3):
        call(d)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    call(d)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return {"profiled": form, "warps": w, "stages": s, "x_smem": dl.x_smem, "acc2": dl.acc2,
            "pair": dl.pair, "f16": dl.f16, "pipe": dl.pipe, "xsum": dl.xsum, "x_ahead": x_ahead,
            "regs": regs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--layers", default="32", help="layer counts to check and time")
    p.add_argument("--ctx", type=int, default=256, help="tokens in the context, this one included")
    p.add_argument("--rings", default="4x16,4x20,8x8,8x10",
                   help="consumer warps x ring stages (chunks of 16 word rows of 32 channels a "
                   "warp), comma-separated")
    p.add_argument("--scales", default="chunk",
                   help="chunk (each chunk carries its scales) and/or global, comma-separated")
    p.add_argument("--splits", type=int, default=16)
    p.add_argument("--forms", default=",".join(FORMS))
    p.add_argument("--variants", default="4x128,8x168",
                   help="x's steps ahead x registers a thread, comma-separated")
    p.add_argument("--x", default="smem,l2",
                   help="where the GEMVs read x: smem (copied once a phase) and/or l2")
    p.add_argument("--acc2", default="0,1",
                   help="one (0) and/or two (1) sets of accumulators a chunk, comma-separated")
    p.add_argument("--pair", default="0",
                   help="one (0) and/or two (1) ring chunks between the consumers' barriers")
    p.add_argument("--f16", default="0",
                   help="bf16 (0) and/or fp16 (1) MMA operands (x from shared memory only)")
    p.add_argument("--pipe", default="0",
                   help="each chunk read at once (0) and/or its registers read while the chunk "
                   "before's MMAs run (1; x from shared memory, bf16 operands, one chunk at a "
                   "time)")
    p.add_argument("--xsum", default="0",
                   help="each step's constant-weight MMA for the input sums (0) and/or the "
                   "groups' sums written once with the input (1; the pipelined form's)")
    p.add_argument("--poll", default="1",
                   help="a phase's counter polled by every warp of a program (0) and/or by one "
                   "thread while the others wait at a barrier (1, the engine's form)")
    p.add_argument("--x-pairs", default="0",
                   help="x's shared-memory copy as rows (0, each MMA step pairs them) and/or "
                   "rewritten once a phase as its bf16 B pairs (1; bf16 operands)")
    p.add_argument("--per-sm", default="1",
                   help="programs an SM (1 or 2: two only where both fit at once), "
                   "comma-separated")
    p.add_argument("--tb", type=int, default=16,
                   help="tokens an attention program reads a block (the first before its wait)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--ncu", action="store_true",
                   help="one launch of the first choice of each option, for a profiler")
    ns = p.parse_args()
    dev = torch.device("cuda")
    if ns.ncu:
        rec = profile_once(ns, dev)
        print(json.dumps(rec), flush=True)
        write_results(ns.out, dev, [rec])
        return
    results = []
    variants = [tuple(int(v) for v in x.split("x")) for x in ns.variants.split(",")]
    rings: dict[int, list[int]] = {}
    for ring in ns.rings.split(","):
        w, s = (int(v) for v in ring.split("x"))
        rings.setdefault(w, []).append(s)
    for n in ns.layers.split(","):
        for sz in ns.scales.split(","):
            for w, stages in rings.items():
                results += run(int(n), ns.ctx, w, sz == "chunk", stages, ns.splits, ns.iters,
                               ns.forms.split(","), variants, ns.x.split(","),
                               [a == "1" for a in ns.acc2.split(",")], ns.tb, dev,
                               tuple(x == "1" for x in ns.pair.split(",")),
                               tuple(x == "1" for x in ns.f16.split(",")),
                               tuple(x == "1" for x in ns.pipe.split(",")),
                               tuple(x == "1" for x in ns.xsum.split(",")),
                               tuple(int(x) for x in ns.per_sm.split(",")),
                               tuple(x == "1" for x in ns.poll.split(",")),
                               tuple(x == "1" for x in ns.x_pairs.split(",")))
            torch.cuda.empty_cache()
    write_results(ns.out, dev, results)


if __name__ == "__main__":
    main()
