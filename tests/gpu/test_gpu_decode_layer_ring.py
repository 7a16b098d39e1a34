"""The persistent decode kernel (kernels/decode_layers.py; sm_90+): a step's layers at batch 1 in
one kernel, weights streamed through a TMA ring, against the same layers in torch with the same
rounding points (benchmarks/decode_layer_ring.py); and the int4 ring probe's GEMV phases
against x @ dequant(W)."""
from __future__ import annotations

import pytest
import torch
from benchmark_scripts import load

from gpu_cases import DEV

pytestmark = pytest.mark.gpu

SMALL = {"H": 512, "HEADS": 8, "KVH": 2, "D": 128, "INTER": 1024, "BS": 16, "theta": 10000.0,
         "eps": 1e-6}
# (consumer warps, ring stages, x's steps ahead through L2 (0: x copied into shared memory),
# registers a thread, scales with the chunks, attention making q, k and v from the qkv partials,
# tickets read after the program's next piece, two sets of accumulators)
FORMS = ((4, 16, 0, 128, True, 0, True, False), (4, 16, 0, 128, True, 1, True, False),
         (4, 16, 0, 128, True, 0, False, True), (4, 16, 0, 128, True, 0, True, True),
         (8, 8, 0, 168, True, 0, True, False), (8, 8, 0, 128, False, 1, False, True),
         (4, 16, 4, 128, True, 0, True, False), (4, 16, 4, 128, True, 1, False, False),
         (4, 16, 8, 168, True, 0, True, True), (8, 8, 4, 128, True, 0, False, False),
         (8, 8, 8, 168, True, 1, True, False), (4, 16, 4, 128, False, 0, True, False),
         (8, 12, 4, 128, False, 1, True, False))


def _hopper() -> None:
    if torch.cuda.get_device_capability(DEV) < (9, 0):
        pytest.skip("TMA and warp specialization need sm_90+")


def _build(shape: str, ctx: int, layers: int, warps: int, stages: int) -> tuple:
    """The benchmark module and its packed layers and inputs for this GPU (sm_90+ only)."""
    _hopper()
    bench = load("decode_layer_ring")
    cfg = SMALL if shape == "small" else bench.LLAMA3_8B
    P = torch.cuda.get_device_properties(DEV).multi_processor_count
    return bench, bench.build(layers, P, ctx, DEV, cfg, warps=warps, stages=stages)


def _run(bench, d: dict) -> dict:
    """One call of the kernels; a copy of what they left (the arena is reused by the next)."""
    bench.call(d)
    torch.cuda.synchronize()
    return {k: v.clone() for k, v in bench.state(d).items()}


def _turning_on_gives_the_same_bits(bench, d: dict, attr: str) -> dict:
    """A call as the packed layers are, then one with their attribute attr set: the same bits
    (returned)."""
    one = _run(bench, d)
    setattr(d["dl"], attr, True)
    got = _run(bench, d)
    for k, v in one.items():
        assert torch.equal(got[k], v), k
    return got


def _replay_gives(bench, d: dict, want: dict) -> None:
    """A CUDA-graph capture and replay of the kernels gives want's bits."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        bench.call(d)
    graph.replay()
    torch.cuda.synchronize()
    for k, v in bench.state(d).items():
        assert torch.equal(v, want[k]), k


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shape,ctx,layers", (("small", 1, 1), ("small", 40, 1), ("small", 256, 1),
                                              ("small", 40, 3), ("llama3_8b", 256, 1),
                                              ("llama3_8b", 256, 2)))
def test_decode_layers_match_the_torch_layers(shape: str, ctx: int, layers: int,
                                              form: tuple) -> None:
    """q, the K/V rows stored, the attention output, silu(gate) * up, h and the next norm's
    input against torch's: one layer within a few ulps, several within a relative RMS (float32
    sums in another order flip a rounding now and then, and a flip moves what follows it);
    shares of the context left empty (ctx 1 and 40 over 16 splits) included; a CUDA-graph
    replay gives the same bits."""
    warps, stages, x_ahead, regs, sz, fold, defer, acc2 = form
    bench, d = _build(shape, ctx, layers, warps, stages)
    want = bench.reference_layers(d)
    dl = d["dl"]
    dl.x_ahead, dl.regs, dl.scales_in_chunk, dl.fold = max(x_ahead, 4), regs, sz, fold
    dl.x_smem, dl.defer, dl.acc2 = x_ahead == 0, defer, acc2
    bench.call(d)
    torch.cuda.synchronize()
    got = bench.state(d)
    bad = bench.mismatches(got, want, *(bench.ONE_LAYER if layers == 1 else bench.LAYERS))
    assert not bad, bad
    _replay_gives(bench, d, {k: v.clone() for k, v in got.items()})


@pytest.mark.parametrize("warps,stages,x_smem", ((4, 16, True), (4, 16, False), (8, 8, False)))
@pytest.mark.parametrize("shape,ctx,layers", (("small", 40, 1), ("small", 40, 3),
                                              ("llama3_8b", 256, 2)))
def test_two_chunks_between_barriers_match_the_torch_layers(shape: str, ctx: int, layers: int,
                                                            warps: int, stages: int,
                                                            x_smem: bool) -> None:
    """The form that takes two ring chunks between the consumer warps' barriers (pieces of odd
    and even lengths) gives the one-chunk form's bits."""
    bench, d = _build(shape, ctx, layers, warps, stages)
    dl = d["dl"]
    dl.x_smem = x_smem
    one = _run(bench, d)
    dl.pair = True
    bench.call(d)
    torch.cuda.synchronize()
    two = bench.state(d)
    for k, v in one.items():
        assert torch.equal(two[k], v), k
    bad = bench.mismatches(two, bench.reference_layers(d),
                           *(bench.ONE_LAYER if layers == 1 else bench.LAYERS))
    assert not bad, bad


@pytest.mark.parametrize("warps,stages,acc2", ((4, 16, False), (4, 16, True), (8, 8, False)))
@pytest.mark.parametrize("shape,ctx,layers", (("small", 40, 1), ("small", 40, 3),
                                              ("llama3_8b", 256, 2)))
def test_pipelined_chunks_give_the_one_chunk_bits(shape: str, ctx: int, layers: int,
                                                  warps: int, stages: int, acc2: bool) -> None:
    """The form that reads each chunk's registers while the chunk before's MMAs run (pieces
    of one chunk and of many) gives the one-chunk form's bits, within the torch layers'
    bounds, and a CUDA-graph replay gives them again."""
    bench, d = _build(shape, ctx, layers, warps, stages)
    dl = d["dl"]
    dl.x_smem, dl.acc2 = True, acc2
    one = _run(bench, d)
    dl.pipe = True
    got = _run(bench, d)
    for k, v in one.items():
        assert torch.equal(got[k], v), k
    bad = bench.mismatches(got, bench.reference_layers(d),
                           *(bench.ONE_LAYER if layers == 1 else bench.LAYERS))
    assert not bad, bad
    _replay_gives(bench, d, got)


@pytest.mark.parametrize("warps,stages,acc2", ((4, 16, False), (4, 16, True), (8, 8, False)))
@pytest.mark.parametrize("shape,ctx,layers", (("small", 40, 1), ("small", 40, 3),
                                              ("llama3_8b", 256, 2)))
def test_input_sums_written_once_match_the_torch_layers(shape: str, ctx: int, layers: int,
                                                        warps: int, stages: int,
                                                        acc2: bool) -> None:
    """The form that takes each group's input sum from the phase that wrote the input (the
    finishes, the attention merge, the prologue) instead of a constant-weight MMA a step is
    within the torch layers' bounds, as close to them as the MMA form, and a CUDA-graph replay
    gives its bits again."""
    bench, d = _build(shape, ctx, layers, warps, stages)
    dl = d["dl"]
    dl.x_smem, dl.pipe, dl.acc2 = True, True, acc2
    want = bench.reference_layers(d)
    bench.call(d)
    torch.cuda.synchronize()
    base = bench.compare(bench.state(d), want)
    dl.xsum = True
    got = _run(bench, d)
    bad = bench.mismatches(got, want, *(bench.ONE_LAYER if layers == 1 else bench.LAYERS))
    assert not bad, bad
    err = bench.compare(got, want)
    for k, e in err.items():  # (float32 sums in another order: a rounding flip, not a drift)
        assert e["rel_rms"] <= 1.5 * base[k]["rel_rms"] + 1e-3, (k, e, base[k])
    _replay_gives(bench, d, got)


@pytest.mark.parametrize("shape,ctx,layers", (("small", 40, 1), ("small", 40, 3),
                                              ("llama3_8b", 256, 2)))
def test_two_programs_an_sm_match_the_torch_layers(shape: str, ctx: int, layers: int) -> None:
    """Twice as many programs as SMs (a ring of 8 chunks, so that two fit an SM at once) are
    within the torch layers' bounds and replay their bits; a ring too deep for two an SM is
    refused before it launches (its programs would wait for each other forever)."""
    bench, d = _build(shape, ctx, layers, 4, 8)
    dl = d["dl"]
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    dl.place(2 * sms)
    got = _run(bench, d)
    bad = bench.mismatches(got, bench.reference_layers(d),
                           *(bench.ONE_LAYER if layers == 1 else bench.LAYERS))
    assert not bad, bad
    _replay_gives(bench, d, got)
    dl.stages = 16
    with pytest.raises(ValueError, match="an SM at once"):
        bench.call(d)


@pytest.mark.parametrize("per_sm,form", ((1, {}), (2, {}), (1, {"acc2": True}),
                                         (2, {"pair": True}), (1, {"pipe": True})))
@pytest.mark.parametrize("shape,ctx,layers", (("small", 40, 3), ("llama3_8b", 256, 2)))
def test_x_written_as_its_pairs_gives_the_same_bits(shape: str, ctx: int, layers: int,
                                                   per_sm: int, form: dict) -> None:
    """x's shared-memory copy rewritten once a phase as its bf16 B pairs (no MMA step pairs
    them) gives the bits of the copy read as rows, alone and with two accumulator sets, pairs
    of chunks or the pipelined loop; a CUDA-graph replay gives them again."""
    bench, d = _build(shape, ctx, layers, 4, 16 if per_sm == 1 else 8)
    dl = d["dl"]
    dl.x_smem = True
    for name, value in form.items():
        setattr(dl, name, value)
    dl.place(per_sm * torch.cuda.get_device_properties(DEV).multi_processor_count)
    got = _turning_on_gives_the_same_bits(bench, d, "x_pairs")
    _replay_gives(bench, d, got)


@pytest.mark.parametrize("poll_one", (True, False))
@pytest.mark.parametrize("per_sm", (1, 2))
def test_repeated_calls_give_the_same_bits(per_sm: int, poll_one: bool) -> None:
    """Three thousand calls on the same inputs (four Llama-3-8B layers, a 700-token context:
    attention programs that take three blocks each) give the first call's bits every time: no
    call's outcome depends on how the programs' phases happen to interleave. (The row-tile
    kernel's ring slots, refilled before their reads were ordered, showed in about 2 calls in
    1,000: forty calls rarely catch a fault that rare.)"""
    bench, d = _build("llama3_8b", 700, 4, 4, 16 if per_sm == 1 else 8)
    dl = d["dl"]
    dl.x_smem, dl.poll_one = True, poll_one
    dl.place(per_sm * torch.cuda.get_device_properties(DEV).multi_processor_count)
    first = _run(bench, d)
    differ, calls = [], 0
    for i in range(3000):
        bench.call(d)
        calls += 1
        got = bench.state(d)
        bad = sorted(k for k, v in first.items() if not torch.equal(got[k], v))
        if bad:
            differ.append((i, bad))
            if len(differ) == 5:
                break
    assert not differ, (f"{len(differ)} of {calls} calls differ", differ)


@pytest.mark.parametrize("per_sm", (1, 2))
@pytest.mark.parametrize("shape,ctx,layers", (("small", 40, 3), ("llama3_8b", 256, 2),
                                              ("llama3_8b", 700, 4)))
def test_one_thread_polling_gives_the_same_bits(shape: str, ctx: int, layers: int,
                                                per_sm: int) -> None:
    """Phase waits polled by one thread of a program (the others at a barrier) give the bits
    of waits polled by every thread; a CUDA-graph replay gives them again."""
    bench, d = _build(shape, ctx, layers, 4, 16 if per_sm == 1 else 8)
    dl = d["dl"]
    dl.x_smem, dl.poll_one = True, False
    dl.place(per_sm * torch.cuda.get_device_properties(DEV).multi_processor_count)
    got = _turning_on_gives_the_same_bits(bench, d, "poll_one")
    _replay_gives(bench, d, got)


@pytest.mark.parametrize("warps,stages,pair", ((4, 16, False), (4, 16, True), (8, 8, False)))
@pytest.mark.parametrize("shape,ctx,layers", (("small", 40, 1), ("small", 40, 3),
                                              ("llama3_8b", 256, 2)))
def test_fp16_operands_match_the_torch_layers(shape: str, ctx: int, layers: int, warps: int,
                                              stages: int, pair: bool) -> None:
    """The form on fp16 MMA operands (x rewritten as fp16 pairs in its shared-memory copy, the
    weights' values decoded against two magics) within the bf16 form's bounds of the torch
    layers; a CUDA-graph replay gives the same bits."""
    bench, d = _build(shape, ctx, layers, warps, stages)
    dl = d["dl"]
    dl.x_smem, dl.f16, dl.pair = True, True, pair
    got = _run(bench, d)
    bad = bench.mismatches(got, bench.reference_layers(d),
                           *(bench.ONE_LAYER if layers == 1 else bench.LAYERS))
    assert not bad, bad
    _replay_gives(bench, d, got)


def test_ring_int4_gemv_phases_are_the_exact_products() -> None:
    """Two layers of the four projections, 4 and 8 consumer warps, one and two accumulator
    sets, x through L2 or from its shared-memory copy: every output within an output ulp of
    x @ dequant(W)."""
    _hopper()
    probe = load("ring_int4_probe")
    forms = ["ring_mma", "ring_mma_acc2", "ring_mma_xs", "ring_mma_acc2_xs"]
    for warps, stages in ((4, 16), (8, 8)):
        res = probe.run(2, warps, stages, 4, 2, forms, DEV)
        for form in forms:
            assert res[form]["max_ulps"] <= 1.0, (warps, form, res[form])


def test_the_prologue_looks_the_tokens_row_up() -> None:
    """A call given the embedding table and a token gives the bits of a call given that row."""
    _hopper()
    bench = load("decode_layer_ring")
    P = torch.cuda.get_device_properties(DEV).multi_processor_count
    d = bench.build(2, P, 40, DEV, SMALL)
    want = _run(bench, d)
    table = torch.randn(50, SMALL["H"], device=DEV).to(torch.bfloat16)
    table[37] = d["h0"][0]
    for kc, vc in d["caches"]:  # the step's own K/V rows and the arena written afresh
        kc.reshape(-1, SMALL["KVH"], SMALL["D"])[d["slot"]] = 0
        vc.reshape(-1, SMALL["KVH"], SMALL["D"])[d["slot"]] = 0
    d["dl"].vec.zero_()
    d["dl"](table, d["positions"], d["slots"], d["block_table"], d["cos_sin"],
            token=torch.tensor([37], device=DEV))
    torch.cuda.synchronize()
    for k, v in bench.state(d).items():
        assert torch.equal(v, want[k]), k


@pytest.mark.parametrize("splits,ctx", ((14, 40), (14, 300), (9, 256)))
def test_attention_over_fewer_programs_a_kv_head(splits: int, ctx: int) -> None:
    """As many attention programs a KV head as a GPU with fewer SMs allows (14 on 114 SMs, 9 on
    78): the same layers."""
    _hopper()
    bench = load("decode_layer_ring")
    P = torch.cuda.get_device_properties(DEV).multi_processor_count
    d = bench.build(2, P, ctx, DEV, bench.LLAMA3_8B, splits=splits)
    want = bench.reference_layers(d)
    bench.call(d)
    torch.cuda.synchronize()
    bad = bench.mismatches(bench.state(d), want, *bench.LAYERS)
    assert not bad, bad
