"""On the GPU: a step's copies on streams of their own. The upload does not wait for the work
queued on the current stream, yet that stream's next work reads it; the download waits for the
current stream's queued work, yet that stream's next work does not wait for it; and the engine's
tokens are the same with and without the side streams."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from peregrine import transfer
from peregrine.transfer import download, side_stream, upload_packed

pytestmark = pytest.mark.gpu

_SLEEP_CYCLES = 200_000_000  # ~0.1 s of a GPU's clock: the current stream is busy meanwhile


def test_the_upload_overtakes_queued_work_and_is_read_after_it() -> None:
    dev = torch.device("cuda")
    stream = side_stream(dev)
    assert stream is not None
    out = torch.zeros(1000, dtype=torch.int64, device=dev)
    torch.cuda.synchronize()
    torch.cuda._sleep(_SLEEP_CYCLES)  # the current stream is busy
    values = np.arange(1000, dtype=np.int64) * 7 + 3
    packed, offsets = upload_packed([values, np.ones(3, np.int32)], dev, stream)
    arrived = torch.cuda.Event()
    arrived.record(stream)
    out.copy_(packed[offsets[0]:offsets[0] + values.nbytes].view(torch.int64))
    done = torch.cuda.Event()
    done.record()
    arrived.synchronize()
    assert not done.query()  # the copy ran while the current stream was still sleeping
    done.synchronize()
    assert torch.equal(out.cpu(), torch.from_numpy(values))


def test_the_download_follows_queued_work_and_the_current_stream_goes_on() -> None:
    dev = torch.device("cuda")
    stream = side_stream(dev)
    x = torch.zeros(4096, dtype=torch.int64, device=dev)
    torch.cuda.synchronize()
    torch.cuda._sleep(_SLEEP_CYCLES // 4)
    x.fill_(11)  # queued behind the sleep: the copy must see it
    host, event = download({"x": x}, dev, stream)
    torch.cuda._sleep(_SLEEP_CYCLES)  # the current stream's next work
    after = torch.cuda.Event()
    after.record()
    event.synchronize()
    assert not after.query()  # the copy did not wait for the work queued after it
    assert host["x"].is_pinned()
    assert torch.equal(host["x"], torch.full((4096,), 11, dtype=torch.int64))
    empty, event = download({}, dev, stream)
    assert empty == {} and event is not None
    event.synchronize()


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_the_engine_gives_the_same_outputs_without_side_streams(tmp_path, monkeypatch,
                                                                graphs) -> None:
    """Greedy rows with logprobs and seeded sampled rows, async scheduling, chunked prefill:
    the same tokens and logprobs with the copies on side streams as on the one stream."""
    import gc

    from peregrine import LLM, SamplingParams
    from peregrine.testing.checkpoints import build_tiny_checkpoint

    path = str(build_tiny_checkpoint(tmp_path / "m", "llama", dtype=torch.float32,
                                     hidden_size=256, head_dim=64, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=512,
                                     num_hidden_layers=2, max_position_embeddings=512))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (7, 33, 100, 250, 16)]
    params = [SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0, logprobs=2),
              SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.8, seed=5)]
    outs = []
    for side in (True, False):
        monkeypatch.setattr(transfer, "SIDE_STREAMS", side)
        llm = LLM(path, max_model_len=512, enforce_eager=not graphs, max_num_batched_tokens=64,
                  num_gpu_blocks_override=256)
        runner = llm.engine.core_client.core.executor.worker.model_runner
        assert (runner.buffers.upload_stream is not None) == side
        got = llm.generate(prompts, [params[i % 2] for i in range(len(prompts))], use_tqdm=False)
        outs.append([(o.outputs[0].token_ids,
                      [{k: v.logprob for k, v in d.items()} for d in o.outputs[0].logprobs or []])
                     for o in got])
        del llm, runner
        gc.collect()
        torch.cuda.empty_cache()
    assert all(len(t) == 40 for t, _ in outs[0])
    assert outs[0] == outs[1]
