"""Draft-model proposer: a smaller model of the same vocabulary (or the target's own weights,
quantized online) proposes k tokens per request by greedy decoding.

The draft keeps its own per-layer K/V pools with the target pool's block count, indexed by the
target's block tables, so it needs no allocator. Per request it remembers how many leading tokens
its cache holds (the valid prefix): drafts it fed itself stay valid while the target accepts them.
A proposal is one batched catch-up forward (new prompts as chunks under max_num_batched_tokens,
typically 1-2 tokens for running requests) whose last positions give the first drafts, then
k - 1 batched single-token decodes. When the target uses CUDA graphs the draft has its own:
decode graphs for all-decode passes, piecewise graphs for catch-ups with chunks. Greedy drafts
are one-hot proposals, which the verification accepts losslessly at any temperature.

A new request always starts from an empty valid prefix: a prefix-cache hit shares the target's
blocks, but the draft's entries in those blocks may never have been written.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from peregrine.attention import get_attention_backend
from peregrine.attention.kv_dtype import kv_cache_bytes_per_block, kv_cache_torch_dtype
from peregrine.spec_decode.proposer import Proposer, ProposeInput
from peregrine.transfer import to_device
from peregrine.worker.cuda_graphs import (CudaGraphRunner, KVCaches, PiecewiseGraphs,
                                          decode_graph_bytes, prefill_graph_sizes)
from peregrine.worker.kv_memory import allocate_kv_caches
from peregrine.worker.loader import load_model
from peregrine.worker.step_buffers import StepBuffers

if TYPE_CHECKING:
    from peregrine.config import EngineConfig
    from peregrine.spec_decode.config import SpeculativeConfig


@dataclass
class _DraftState:
    """What the draft's cache holds for one request."""

    valid: int  # leading tokens whose K/V are the draft's for the request's real tokens
    fed: np.ndarray  # drafts written at positions valid, valid + 1, ... (valid while accepted)


@dataclass
class _Pass:
    """One forward over the step buffers: t tokens of b sequences, decodes first."""

    t: int
    b: int
    width: int  # block-table columns in use
    num_decodes: int
    max_query_len: int
    max_seq_len: int


class DraftModelProposer(Proposer):
    """Greedy drafts from a draft model run on its own paged KV cache (one device; the
    speculative config refuses a draft model under tensor parallelism)."""

    def __init__(self, engine_config: EngineConfig, spec: SpeculativeConfig,
                 device: torch.device) -> None:
        super().__init__(engine_config, spec, device)
        if spec.draft is None:
            raise ValueError("speculative_config: the draft_model method needs a draft model "
                             "(speculative_config.model)")
        if engine_config.world_size > 1:
            raise ValueError(f"speculative_config: a draft model runs on one device, but the "
                             f"engine has {engine_config.world_size} workers "
                             f"(tensor_parallel_size {engine_config.tensor_parallel_size})")
        self.draft_config = spec.draft
        sc = engine_config.scheduler
        self.k = spec.k
        self.block_size = engine_config.cache.block_size
        self.token_budget = sc.max_num_batched_tokens
        self.max_num_reqs = sc.max_num_seqs
        # NOTE: the draft embeds positions below its RoPE table's length; drafts stop there.
        self.max_positions = int(spec.draft.hf_config.get("max_position_embeddings") or 2048)
        self.max_blocks = -(-(sc.max_model_len + self.k) // self.block_size)
        # NOTE: a decode pass holds every proposing request, which may exceed the token budget;
        # the warm-up pass (a decode beside a 3-token chunk) needs 2 rows and 4 tokens.
        self.buffers = StepBuffers(max(self.token_budget, self.max_num_reqs, 4),
                                   max(self.max_num_reqs, 2), self.max_blocks, device)
        self.model: nn.Module | None = None
        self.kv_caches: KVCaches = []
        self.graphs: CudaGraphRunner | None = None
        self.prefill_graphs: PiecewiseGraphs | None = None  # catch-up passes with chunks
        self._state: dict[str, _DraftState] = {}

    # ---- set-up ------------------------------------------------------------------------------
    def load_model(self, target_model: nn.Module) -> None:
        """Build and load the draft with the target's loader, dtype, backend and kernels."""
        mc, target = self.draft_config, self.engine_config.model
        if mc.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config.model: the draft's vocab_size {mc.vocab_size} "
                             f"differs from the target's {target.vocab_size}")
        if self.max_positions < target.max_model_len:
            raise ValueError(f"speculative_config.model: the draft's max_position_embeddings "
                             f"{self.max_positions} is below the target's max_model_len "
                             f"{target.max_model_len}")
        # NOTE: with load_format dummy the draft's config carries the target's seed, so a
        # self-draft draws the target's tensors (the online methods create the same 16-bit
        # parameters in the same order) and then quantizes them.
        self.model = load_model(mc, get_attention_backend(self.engine_config.attention_backend),
                                self.device)

    def kv_cache_bytes_per_block(self) -> int:
        return kv_cache_bytes_per_block(self.engine_config.cache, self.draft_config)

    def captures_graphs(self) -> bool:
        """Whether initialize_kv_cache captures decode graphs (as the target does: CUDA, the
        Triton backend, not enforce_eager)."""
        cfg = self.engine_config
        return (self.device.type == "cuda" and cfg.attention_backend == "triton"
                and not cfg.enforce_eager)

    def graph_memory_bytes(self) -> int:
        """GPU memory the draft's decode graphs keep for their logits (allocated after the KV
        cache is sized, like the target's graphs)."""
        if not self.captures_graphs():
            return 0
        return decode_graph_bytes(self.max_num_reqs, self.draft_config.vocab_size,
                                  self.draft_config.dtype)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """The draft's K/V pools (the target pool's block count and cache dtype); decode graphs
        when the target captures them."""
        if self.model is None:
            raise RuntimeError("the draft model is not loaded: call load_model first")
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        cfg, mc = self.engine_config, self.draft_config
        dtype = kv_cache_torch_dtype(cfg.cache, mc)
        self.kv_caches = allocate_kv_caches(mc, num_blocks, self.block_size, self.device, dtype)
        self._state.clear()
        if self.device.type != "cuda" or cfg.attention_backend != "triton":
            return
        from peregrine.kernels.decode_attention import precompile
        attn = self.model.layers[0].self_attn
        precompile(attn.num_heads, attn.num_kv_heads, attn.head_dim, self.block_size, mc.dtype,
                   self.device, dtype)
        self._warm_up()
        if self.captures_graphs():
            self.graphs = CudaGraphRunner(self.model, self.buffers, self.kv_caches,
                                          self.max_num_reqs, self.max_positions)
            sizes = prefill_graph_sizes(min(cfg.max_prefill_graph_tokens, self.token_budget))
            if sizes:
                self.prefill_graphs = PiecewiseGraphs(self.model, self.buffers, self.kv_caches,
                                                      sizes, pool=self.graphs.pool)

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """One eager pass of a decode beside a chunk, writing nothing: the draft's shapes compile
        their Triton kernels here rather than in the first proposal."""
        q = np.array([1, 3], np.int64)
        qsl = np.array([0, 1, 4], np.int64)
        table = np.zeros((2, 3), np.int32)  # block 0, whatever the block size
        p = self._fill(np.zeros(4, np.int64), np.array([0, 0, 1, 2]), np.array([0, 1, 1, 1]),
                       table, np.arange(2), q, qsl, q)
        self.buffers.slot_mapping_np[:4] = -1
        self._run(p, np.array([0, 3]))

    def remove_requests(self, req_ids: Iterable[str]) -> None:
        for rid in req_ids:
            self._state.pop(rid, None)

    # ---- proposing ---------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, inp: ProposeInput) -> list[list[int]]:
        if self.model is None or not self.kv_caches:
            raise RuntimeError("the draft model has no KV cache: call load_model and "
                               "initialize_kv_cache first")
        r = len(inp.req_ids)
        num_draft = np.asarray(inp.num_draft, np.int64).reshape(-1)  # (R,)
        if len(inp.token_ids) != r or len(inp.block_ids) != r or num_draft.size != r:
            raise ValueError(f"ProposeInput: {r} req_ids, {len(inp.token_ids)} token_ids, "
                             f"{len(inp.block_ids)} block_ids, {num_draft.size} num_draft")
        if r and (num_draft.min() < 0 or num_draft.max() > self.k):
            raise ValueError(f"ProposeInput.num_draft must be in [0, {self.k}], got "
                             f"{num_draft.tolist()}")
        n = np.fromiter(map(len, inp.token_ids), np.int64, r)  # (R,)
        if r and n.min() < 1:
            raise ValueError(f"request {inp.req_ids[int(n.argmin())]!r} has no tokens")
        # A fed draft sits at position <= n + d - 2, which the draft must be able to embed.
        want = np.clip(np.minimum(num_draft, self.max_positions + 1 - n), 0, None)  # (R,)
        drafts: list[list[int]] = [[] for _ in range(r)]
        active = np.flatnonzero(want > 0)  # (A,)
        if not active.size:
            return drafts
        ids = [inp.req_ids[i] for i in active.tolist()]
        tokens = [np.asarray(inp.token_ids[i]) for i in active.tolist()]
        n, d = n[active], want[active]  # (A,), (A,)
        table = self._block_table(ids, [inp.block_ids[i] for i in active.tolist()], n + d - 1)
        valid = self._valid_prefix(ids, tokens, n)  # (A,)
        out = torch.zeros(int(d.max()), active.size, dtype=torch.int64,
                          device=self.device)  # (max d, A)
        self._catch_up(tokens, n, valid, table, out)
        self._decode(n, d, table, out)
        host = out.t().cpu().numpy()  # (A, max d): the proposal's one device->host sync
        for i, (row, rid) in enumerate(zip(active.tolist(), ids)):
            drafts[row] = host[i, :d[i]].tolist()
            self._state[rid] = _DraftState(int(n[i]), host[i, :d[i] - 1].copy())
        return drafts

    def _block_table(self, ids: list[str], rows: list[np.ndarray],
                     need_pos: np.ndarray) -> np.ndarray:
        """(A, W) block ids covering positions < need_pos per request."""
        need = -(-need_pos // self.block_size)  # (A,)
        have = np.fromiter(map(len, rows), np.int64, len(rows))  # (A,)
        short = np.flatnonzero(have < need)
        if short.size:
            i = int(short[0])
            raise ValueError(f"request {ids[i]!r}: its drafts need {int(need[i])} KV blocks, "
                             f"its block table has {int(have[i])}")
        width = int(need.max())
        if width > self.max_blocks:
            raise ValueError(f"drafts need {width} KV blocks per request, more than the "
                             f"{self.max_blocks} of max_model_len + k tokens")
        table = np.zeros((len(rows), width), np.int32)  # (A, W)
        for i, (row, m) in enumerate(zip(rows, need.tolist())):
            table[i, :m] = row[:m]
        return table

    def _valid_prefix(self, ids: list[str], tokens: list[np.ndarray],
                      n: np.ndarray) -> np.ndarray:
        """(A,) leading tokens the draft's cache holds: its valid prefix, plus the drafts it fed
        that the target accepted; at most n - 1, so the last token always gives logits."""
        valid = np.zeros(len(ids), np.int64)  # (A,)
        for i, (rid, toks) in enumerate(zip(ids, tokens)):
            st = self._state.get(rid)
            if st is None:
                continue
            got = toks[st.valid:st.valid + st.fed.size]
            same = got == st.fed[:got.size]
            valid[i] = st.valid + (same.size if same.all() else int(same.argmin()))
        return np.minimum(valid, n - 1)

    def _catch_up(self, tokens: list[np.ndarray], n: np.ndarray, valid: np.ndarray,
                  table: np.ndarray, out: torch.Tensor) -> None:
        """Feed tokens valid..n-1 of every request, max_num_batched_tokens per forward; the last
        position's argmax is the first draft (out[0])."""
        counts = n - valid  # (A,) >= 1
        flat = np.concatenate([t[v:m] for t, v, m in zip(tokens, valid.tolist(), n.tolist())])
        qsl = np.zeros(n.size + 1, np.int64)  # (A + 1,)
        np.cumsum(counts, out=qsl[1:])
        owner = np.repeat(np.arange(n.size), counts)  # (C,)
        pos = np.arange(qsl[-1]) - np.repeat(qsl[:-1] - valid, counts)  # (C,)
        for s in range(0, int(qsl[-1]), self.token_budget):
            e = min(int(qsl[-1]), s + self.token_budget)
            rows, first, q = np.unique(owner[s:e], return_index=True, return_counts=True)
            order = np.argsort(q != 1, kind="stable")  # decodes first
            rows, first, q = rows[order], first[order] + s, q[order]  # (B,)
            pqsl = np.zeros(rows.size + 1, np.int64)  # (B + 1,)
            np.cumsum(q, out=pqsl[1:])
            idx = np.arange(e - s) + np.repeat(first - pqsl[:-1], q)  # (T,) into the stream
            seq_lens = pos[first] + q  # (B,)
            p = self._fill(flat[idx], pos[idx], owner[idx], table, rows, seq_lens, pqsl, q)
            done = np.flatnonzero(seq_lens == n[rows])  # rows whose last token is in this pass
            tok = self._run(p, pqsl[done + 1] - 1)  # (D,)
            if done.size:
                out[0].index_copy_(0, to_device(rows[done], self.device), tok)

    def _decode(self, n: np.ndarray, d: np.ndarray, table: np.ndarray,
                out: torch.Tensor) -> None:
        """Drafts 2..d: each pass feeds the previous draft of the requests that want more."""
        for j in range(1, int(d.max())):
            rows = np.flatnonzero(d > j)  # (B,)
            b = rows.size
            pos = n[rows] + j - 1  # (B,) where draft j goes
            qsl = np.arange(b + 1, dtype=np.int64)  # (B + 1,)
            rows_dev = to_device(rows, self.device)
            p = self._fill(np.zeros(b, np.int64), pos, rows, table, rows, pos + 1, qsl,
                           np.ones(b, np.int64))
            tok = self._run(p, np.arange(b), out[j - 1].index_select(0, rows_dev))  # (B,)
            out[j].index_copy_(0, rows_dev, tok)

    def _fill(self, ids: np.ndarray, pos: np.ndarray, owner: np.ndarray, table: np.ndarray,
              rows: np.ndarray, seq_lens: np.ndarray, qsl: np.ndarray, q: np.ndarray) -> _Pass:
        """Write one pass into the host step buffers: tokens (ids at pos of request owner),
        sequences (rows of `table`, decodes first)."""
        t, b, bs = ids.size, rows.size, self.block_size
        buf = self.buffers
        buf.input_ids_np[:t] = ids
        buf.positions_np[:t] = pos
        buf.slot_mapping_np[:t] = table[owner, pos // bs].astype(np.int64) * bs + pos % bs
        width = int(-(-seq_lens.max() // bs))
        buf.block_table_np[:b, :width] = table[rows, :width]
        buf.seq_lens_np[:b] = seq_lens
        buf.query_start_loc_np[:b + 1] = qsl
        return _Pass(t, b, width, int(np.searchsorted(q != 1, True)), int(q.max()),
                     int(seq_lens.max()))

    def _run(self, p: _Pass, sample: np.ndarray,
             input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Greedy tokens (S,) at flat token indices `sample` of the filled pass; input_ids (T,)
        on the device replace the host ids (a decode pass feeds the drafts without a sync)."""
        buf = self.buffers
        graph = self.graphs is not None and p.num_decodes == p.b and self.graphs.can_run(p.b)
        pad = self.graphs.padded(p.b) if graph else None
        pieces = (not graph and self.prefill_graphs is not None
                  and self.prefill_graphs.can_run(p.t))
        pad_t = self.prefill_graphs.padded(p.t) if pieces else pad
        ids, positions, meta = buf.to_device(p.t, p.b, p.width, pad_t=pad_t, pad_b=pad)
        if input_ids is not None:
            buf.d_input_ids[:p.t].copy_(input_ids)
        sample_dev = to_device(sample, self.device)  # (S,)
        if graph:  # a decode-only pass: its sequences' last tokens are rows 0..b-1
            logits = self.graphs.replay(p.b).index_select(0, sample_dev)  # (S, V)
        else:
            meta.num_decodes = p.num_decodes
            meta.max_query_len = p.max_query_len
            meta.max_seq_len = p.max_seq_len
            if pieces:
                hidden = self.prefill_graphs.run(p.t, meta)  # (T, hidden)
            else:
                hidden = self.model(ids, positions, self.kv_caches, meta)  # (T, hidden)
            if not sample.size:  # a chunk that only fills the cache
                return torch.zeros(0, dtype=torch.int64, device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, sample_dev))  # (S, V)
        if logits.device.type == "cuda":
            from peregrine.kernels.sampling import argmax_rows
            return argmax_rows(logits)  # (S,): torch.argmax's tokens, over the whole GPU
        return logits.argmax(dim=-1)  # (S,)
