"""The one-kernel decode path in the engine (PEREGRINE_DECODE_LAYERS=split or rows,
models/one_kernel_decode.py; sm_90+): a bf16 4-bit AWQ Llama-shaped model decoding one sequence
at a time takes it, picks near-exact top-1 tokens of the float32 dequantized model as the
layer-by-layer path does, with logprobs as close to that model's as that path's, gives the same
tokens in CUDA graphs as eagerly, and serves batches of several sequences and prefix-cache hits
around it, in each form and placement the engine may keep."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from gpu_cases import DEV

pytestmark = pytest.mark.gpu

LAYERS = 4


def _hopper() -> None:
    if torch.cuda.get_device_capability(DEV) < (9, 0):
        pytest.skip("the one-kernel decode path needs sm_90+")


@pytest.fixture(scope="module")
def bf16_awq(tmp_path_factory: pytest.TempPathFactory):
    """(AWQ checkpoint, its float32 dequantized reference, prompts, params): Llama-shaped, four
    query heads a KV head of 128 channels, groups of 128."""
    from peregrine import SamplingParams
    from peregrine.testing.checkpoints import build_tiny_checkpoint
    from peregrine.testing.quant_pack import write_quantized_checkpoint
    root = tmp_path_factory.mktemp("awq-bf16")
    # (the row-tile form's chunks are 1,024 inputs)
    src = build_tiny_checkpoint(root / "src", "llama", hidden_size=1024, head_dim=128,
                                num_attention_heads=8, num_key_value_heads=2,
                                intermediate_size=2048, num_hidden_layers=LAYERS,
                                max_position_embeddings=1024)
    path, ref = write_quantized_checkpoint(src, root / "awq", "awq", group_size=128)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (3, 17, 40, 200)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    return str(path), ref, prompts, params


def _outputs(path: str, prompts, params: list, monkeypatch, on: str | None,
             together: bool = False, **engine_args) -> tuple[list, bool]:
    """Each prompt's (greedy tokens, each step's logprobs where its params ask for them), one
    prompt at a time (so its decode steps are one row; together: all at once), and whether
    the one-kernel path (in form `on`, None: off) was on. params: one a prompt."""
    from peregrine import LLM
    monkeypatch.setenv("PEREGRINE_DECODE_LAYERS", on or "0")
    engine_args.setdefault("num_gpu_blocks_override", 256)
    llm = LLM(path, dtype="bfloat16", max_model_len=512, seed=0, **engine_args)
    try:
        model = llm.engine.core_client.core.executor.worker.model_runner.model
        used = model.decode_layers is not None
        if together:
            done = llm.generate(prompts, params, use_tqdm=False)
        else:
            done = [llm.generate([p], [sp], use_tqdm=False)[0] for p, sp in zip(prompts, params)]
        outs = [(list(o.outputs[0].token_ids), list(o.outputs[0].logprobs or []))
                for o in done]
        return outs, used
    finally:
        del llm
        torch.cuda.empty_cache()


def _tokens(path: str, prompts, params, monkeypatch, on: str | None,
            **engine_args) -> tuple[list[list[int]], bool]:
    """Greedy tokens of each prompt, one at a time, and whether the one-kernel path was on."""
    outs, used = _outputs(path, prompts, [params] * len(prompts), monkeypatch, on,
                          **engine_args)
    return [tokens for tokens, _ in outs], used


def _gaps(ref: str, prompts, tokens: list[list[int]]) -> list[float]:
    """Each picked token's logit gap below the float32 dequantized model's top-1, over the
    row's RMS (0 where it is the top-1)."""
    from transformers import AutoModelForCausalLM
    exact = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).to(DEV).eval()
    gaps = []
    with torch.no_grad():
        for prompt, out in zip(prompts, tokens):
            seq = torch.tensor([prompt + out], device=DEV)
            rows = exact(seq).logits[0, len(prompt) - 1:-1].float()
            picked = rows.gather(1, torch.tensor(out, device=DEV)[:, None])[:, 0]
            gaps += ((rows.max(-1).values - picked) / rows.pow(2).mean(-1).sqrt()).tolist()
    del exact
    torch.cuda.empty_cache()
    return gaps


def _logprob_errors(ref: str, prompts, outputs) -> list[float]:
    """Per decode step: the largest difference between the engine's logprobs (the picked
    token's and the top ones') and the float32 dequantized model's log-softmax of the same
    tokens, teacher-forced on the sequence the engine made."""
    from transformers import AutoModelForCausalLM
    exact = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).to(DEV).eval()
    errors = []
    with torch.no_grad():
        for prompt, (out, steps) in zip(prompts, outputs):
            seq = torch.tensor([prompt + out], device=DEV)
            rows = torch.log_softmax(exact(seq).logits[0, len(prompt) - 1:-1].float(), -1)
            for row, step in zip(rows, steps):
                ids = torch.tensor(list(step), device=DEV)
                got = torch.tensor([lp.logprob for lp in step.values()], device=DEV)
                errors.append(float((got - row[ids]).abs().max()))
    del exact
    torch.cuda.empty_cache()
    return errors


@pytest.mark.parametrize("form", ("split", "rows"))
def test_one_row_decode_picks_near_exact_tokens_as_the_layer_path_does(bf16_awq, monkeypatch,
                                                                       form) -> None:
    """No more tokens off the float32 dequantized model's top-1 than twice the layer-by-layer
    path's (or a tenth). (Near-ties decide which: how far each path's numbers are from the
    exact ones is the next test's measure.)"""
    _hopper()
    path, ref, prompts, params = bf16_awq
    ours, used = _tokens(path, prompts, params, monkeypatch, on=form)
    assert used
    theirs, used = _tokens(path, prompts, params, monkeypatch, on=None)
    assert not used
    g_ours, g_theirs = _gaps(ref, prompts, ours), _gaps(ref, prompts, theirs)
    assert len(g_ours) == len(prompts) * params.max_tokens
    off = sum(g > 0 for g in g_ours)
    assert off <= max(2 * sum(g > 0 for g in g_theirs), len(g_ours) // 10), off


def _as_close_as_the_layer_path(path: str, ref: str, prompts, params, monkeypatch,
                                record_property, form: str = "split", **kw) -> None:
    """Each step's logprobs (the picked token and the top 20) against the float32 dequantized
    model's, teacher-forced, with the one-kernel path on and off: its errors are those of
    another bf16 rounding of the same layers, so their median and largest are within 1.25 and
    2 times the layer-by-layer path's (a wrong head, position or weight gives errors of order
    one)."""
    params = [replace(p, logprobs=20) for p in params]
    runs = {}
    for on in (form, None):
        outs, used = _outputs(path, prompts, params, monkeypatch, on=on, **kw)
        assert used == (on is not None)
        runs[on] = _logprob_errors(ref, prompts, outs)
    ours, theirs = torch.tensor(runs[form]), torch.tensor(runs[None])
    assert len(ours) == len(theirs) == sum(p.max_tokens for p in params)
    assert not torch.equal(ours, theirs)  # (the one-kernel path ran: its roundings differ)
    stats = {"ours": (float(ours.median()), float(ours.max())),
             "theirs": (float(theirs.median()), float(theirs.max()))}
    for who, (median, largest) in stats.items():
        record_property(f"logprob_error_median_{who}", round(median, 5))
        record_property(f"logprob_error_max_{who}", round(largest, 5))
    assert ours.median() <= 1.25 * theirs.median(), stats
    assert ours.max() <= 2 * theirs.max(), stats


@pytest.mark.parametrize("form,placement", (("split", (1, 16)), ("split", (2, 8)),
                                            ("rows", (2, 4, False)), ("rows", (2, 4, True)),
                                            ("rows", (1, 8, False))))
def test_one_row_decode_is_as_close_to_exact_as_the_layer_path(bf16_awq, monkeypatch,
                                                              record_property, form,
                                                              placement) -> None:
    """In each placement the engine may keep (programs an SM, ring stages; the row-tile form's
    group sums made once or not), made the only one it times."""
    _hopper()
    from peregrine.kernels import decode_layers, decode_rows
    kernels = decode_rows if form == "rows" else decode_layers
    assert placement in kernels.PLACEMENTS
    monkeypatch.setattr(kernels, "PLACEMENTS", (placement,))
    path, ref, prompts, params = bf16_awq
    _as_close_as_the_layer_path(path, ref, prompts, [params] * len(prompts), monkeypatch,
                                record_property, form)


@pytest.mark.parametrize("form,placement", (("split", (1, 16)), ("split", (2, 8)),
                                            ("rows", (2, 4, False)), ("rows", (2, 4, True)),
                                            ("rows", (1, 8, False))))
def test_graphs_give_the_eager_tokens(bf16_awq, monkeypatch, form, placement) -> None:
    """The path in CUDA graphs gives its eager tokens, in each placement the engine may keep,
    made the only one it times (placements round differently: the two engines' timings could
    keep different ones)."""
    _hopper()
    from peregrine.kernels import decode_layers, decode_rows
    kernels = decode_rows if form == "rows" else decode_layers
    assert placement in kernels.PLACEMENTS
    monkeypatch.setattr(kernels, "PLACEMENTS", (placement,))
    path, ref, prompts, params = bf16_awq
    graphs, used = _tokens(path, prompts, params, monkeypatch, on=form)
    eager, _ = _tokens(path, prompts, params, monkeypatch, on=form, enforce_eager=True)
    assert used and graphs == eager


@pytest.mark.parametrize("form", ("split", "rows"))
def test_batches_and_prefix_hits(bf16_awq, monkeypatch, record_property, form) -> None:
    """Several sequences at once, of several lengths (the layer-by-layer path's steps until
    one is left), and a repeated prompt (a prefix-cache hit) stay as close to the exact model
    as the layer-by-layer path."""
    _hopper()
    path, ref, prompts, params = bf16_awq
    # (the first prompt decodes alone for its last 12 steps: one-row steps, the kernel's)
    lengths = (params.max_tokens, 16, 22, 28, 10)
    _as_close_as_the_layer_path(path, ref, prompts + prompts[:1],
                                [replace(params, max_tokens=n) for n in lengths], monkeypatch,
                                record_property, form, together=True,
                                enable_prefix_caching=True)
