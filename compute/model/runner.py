"""ModelRunner: one forward pass over a packed batch of prefill chunks and decodes.

The runner is stateless between steps: the caller (the engine loop) owns each request's tokens,
how many of them are computed, and its block table (from the kvstore's ``Placement``/``Growth``).
For every step it passes one ``ScheduledChunk`` per request and gets back the logits of each
request's last scheduled token (of every scheduled token for a chunk marked ``every_row``: prompt
logprobs). Tokens whose KV is written are the caller's to report
(``append(..., num_computed=start + len(token_ids))``).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from transformers import PreTrainedModel

from compute.model.attention import ATTN_NAME, PagedBatch, copy_blocks_inplace
from compute.model.block_tables import DeviceBlockTables, TableRows
from compute.model.graphs import DecodeGraphs
from compute.model.mixed_graphs import MIXED_GRAPH_MODEL_TYPES, MixedGraphs
from compute.parallel.layers import TPGroup
from compute.parallel.step_plan import (
    StepPlan,
    TableMirror,
    broadcast_fed,
    receive_plan,
    send_plan,
)
from compute.transfer import to_device
from contracts.model_config import kv_geometry
from kvstore import protocol as p

__all__ = ["Feed", "ForwardPath", "ModelRunner", "ScheduledChunk"]

ForwardPath = Literal["decode_graph", "mixed_graph", "eager"]  # how a forward ran

log = logging.getLogger("pagedserve.compute")


@dataclass(frozen=True)
class Packed:
    """One step's inputs as host lists: T packed tokens of B chunks."""

    ids: list[int]  # [T]
    positions: list[int]  # [T]
    slots: list[int]  # [T] pool slot of each token
    cu: list[int]  # [B + 1] row offsets
    context_lens: list[int]  # [B]
    width: int  # blocks the longest context reads: the step's block-table width


@dataclass(frozen=True)
class Feed:
    """Tokens of a step that are on the device only: chunk ``chunks[i]`` (one token) takes
    ``source[rows[i]]``, a token drawn by the step before, in place of its host token id."""

    source: torch.Tensor  # [R] int64 on the device
    rows: list[int]
    chunks: list[int]


class ScheduledChunk(NamedTuple):  # made per token per step: 4x cheaper than a frozen dataclass
    """One request's share of a step: compute ``token_ids`` at positions ``start, start+1, ...``.

    ``start`` is the number of the request's tokens whose KV is already in its blocks (its
    ``num_computed``); ``block_ids`` is its whole block table, which must cover
    ``start + len(token_ids)`` tokens. A decode is a chunk of one token. ``every_row``: the
    logits of each of its tokens are kept, not only its last one's. ``key``: the sequence's id,
    under which the runner keeps its block table on the device between steps (None: the chunk's
    place in the step stands for it, so its row is rewritten whenever its table differs from
    that of the sequence last in that place).
    """

    token_ids: Sequence[int]
    start: int
    block_ids: Sequence[int]
    every_row: bool = False
    key: str | None = None


class ModelRunner:
    """Runs a transformers causal LM loaded with ``attn_implementation="paged"`` on a paged pool.

    pool: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] on the model's device,
    in the model's dtype (the kvstore's layout; block-major).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        pool: torch.Tensor,
        block_size: int,
        cuda_graph_max_batch: int = 0,
        cuda_graph_max_tokens: int = 0,
        max_chunks: int = 256,
        cuda_graph_token_buckets: Sequence[int] = (),
        group: TPGroup | None = None,
    ) -> None:
        """``cuda_graph_max_batch`` > 0 (CUDA only): capture decode forwards of up to that many
        requests as CUDA graphs now, and replay them for decode-only steps.
        ``cuda_graph_max_tokens`` > 0 (CUDA, Llama/Mistral/Qwen2/Qwen3): capture forwards of up
        to that many tokens in up to ``max_chunks`` chunks (``compute.model.mixed_graphs``), and
        replay them for the other steps that fit; ``cuda_graph_token_buckets``: only graphs of these
        token counts (a profile's scratch runner; default: ``token_buckets``). ``startup_s``:
        the seconds construction spent compiling kernels and capturing each kind of graph.
        ``group``: the model is this rank's shards (``compute.parallel``) and ``pool`` its KV
        heads; rank 0 sends every call to the other ranks, which ``follow`` it. Every rank
        captures the same graphs in the same order (their all-reduces pair up), and replays the
        ones rank 0 does, since each takes the same path for the same call."""
        config = model.config
        if config._attn_implementation != ATTN_NAME:
            raise ValueError(
                f"model must be loaded with attn_implementation={ATTN_NAME!r}, "
                f"got {config._attn_implementation!r}"
            )
        dtype = str(model.dtype).removeprefix("torch.")
        self.group = group
        self._mirror = TableMirror()  # the block tables of the group's last forward plan
        ranks = group.size if group is not None else 1
        geometry = kv_geometry(config, dtype, ranks)
        want = (
            geometry.num_layers,
            2,
            block_size,
            geometry.num_kv_heads,
            geometry.head_dim,
        )
        if pool.dim() != 6 or tuple(pool.shape[1:]) != want:
            raise ValueError(f"pool {tuple(pool.shape)} does not match (blocks, *{want})")
        if pool.dtype != model.dtype or pool.device != model.device:
            raise ValueError(
                f"pool is {pool.dtype} on {pool.device}, model is {model.dtype} on {model.device}"
            )
        self.model = model
        self.pool = pool
        self.block_size = block_size
        self.device = pool.device
        self.startup_s: dict[str, float] = {}
        started = time.perf_counter()
        if pool.is_cuda:  # no Triton compile mid-traffic
            from kernels import compile_variants

            heads = int(config.num_attention_heads) // ranks
            compile_variants(pool[:, 0, 0], pool[:, 0, 1], heads)
            self.startup_s["kernels"] = time.perf_counter() - started
        self.graphs: DecodeGraphs | None = None
        # a table reaches past its last token (the kvstore's ``LOOKAHEAD_SLOTS``)
        max_blocks = -(-(config.max_position_embeddings + p.LOOKAHEAD_SLOTS) // block_size)
        # the graphs' block tables, kept on the device between steps: two rows per sequence a
        # step can hold, so the rows of sequences that left are reclaimed in batches
        rows = 2 * max(cuda_graph_max_batch, min(max_chunks, cuda_graph_max_tokens), 1)
        self.tables = DeviceBlockTables(rows, max_blocks, pool.device)
        if cuda_graph_max_batch > 0 and pool.is_cuda:
            self.graphs = DecodeGraphs(
                model, pool, block_size, cuda_graph_max_batch, max_blocks, self.tables
            )
            started = time.perf_counter()
            self.graphs.capture()
            self.startup_s["decode graphs"] = time.perf_counter() - started
        self.mixed: MixedGraphs | None = None
        self.last_path: ForwardPath = "eager"  # of the last forward, for the timeline
        if cuda_graph_max_tokens > 0 and pool.is_cuda:
            if config.model_type in MIXED_GRAPH_MODEL_TYPES:
                chunks = min(max_chunks, cuda_graph_max_tokens)
                started = time.perf_counter()
                self.mixed = MixedGraphs(
                    model,
                    pool,
                    cuda_graph_max_tokens,
                    chunks,
                    max_blocks,
                    self.tables,
                    cuda_graph_token_buckets,
                )
                self.mixed.capture()
                self.startup_s["mixed graphs"] = time.perf_counter() - started
            else:
                log.info(
                    "no CUDA graphs of mixed steps for %s models: they run eagerly",
                    config.model_type,
                )

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Performs copy-on-write block copies, the ``(src, dst)`` of each ``(position, src,
        dst)`` in the kvstore's ``Growth.copies``; must run before the forward that writes the
        destination blocks."""
        if not copies:
            return
        if (group := self._leader_group()) is not None:
            send_plan(StepPlan("copy", copies=list(copies)), group)
        src = to_device([s for s, _ in copies], self.device)  # [N]
        dst = to_device([d for _, d in copies], self.device)  # [N]
        copy_blocks_inplace(self.pool, src, dst)

    def pack(self, batch: Sequence[ScheduledChunk]) -> Packed:
        """Host-side packing of one step (plain lists, no tensor yet). Runs every step over
        every chunk: a decode (one token) takes a path without generators."""
        if not batch:
            raise ValueError("empty batch")
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu, lens, total = [0], [], 0
        for chunk in batch:
            tokens, start, blocks = chunk.token_ids, chunk.start, chunk.block_ids
            n = len(tokens)
            end = start + n
            if n == 0:
                raise ValueError("every scheduled request needs at least one token")
            if -(-end // bs) > len(blocks):
                raise ValueError(f"{len(blocks)} blocks cannot hold {end} tokens")
            if n == 1:
                ids.append(tokens[0])
                positions.append(start)
                slots.append(blocks[start // bs] * bs + start % bs)
            else:
                ids.extend(tokens)
                positions.extend(range(start, end))
                for k in range(start // bs, (end - 1) // bs + 1):  # a run of slots per block
                    base = (blocks[k] - k) * bs  # position p in block k: slot base + p
                    slots.extend(range(base + max(start, k * bs), base + min(end, k * bs + bs)))
            total += n
            cu.append(total)
            lens.append(end)
        return Packed(ids, positions, slots, cu, lens, -(-max(lens) // bs))

    @staticmethod
    def padded_table(batch: Sequence[ScheduledChunk], width: int) -> list[list[int]]:
        """The step's block tables as host rows [B, width], zero-padded (the eager path's)."""
        zeros = [0] * width
        return [[*row, *zeros[len(row) :]] for row in (c.block_ids[:width] for c in batch)]

    def prepare(
        self, batch: Sequence[ScheduledChunk], packed: Packed | None = None
    ) -> tuple[dict[str, torch.Tensor], PagedBatch]:
        """Model inputs and the paged metadata of one step, on the device (``packed``: the
        batch's ``pack``, if already made)."""
        packed = self.pack(batch) if packed is None else packed

        def tensor(values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
            return to_device(values, self.device, dtype)

        cu = packed.cu
        keep = self.kept_rows(batch, cu)
        inputs = {
            "input_ids": tensor([packed.ids], torch.int64),  # [1, T]
            "position_ids": tensor([packed.positions], torch.int64),  # [1, T]
            "logits_to_keep": tensor(keep, torch.int64),  # [K] the rows whose logits are kept
        }
        max_query_len = max(b - a for a, b in itertools.pairwise(cu))
        paged = PagedBatch(
            slot_mapping=tensor(packed.slots, torch.int64),  # [T]
            block_tables=tensor(self.padded_table(batch, packed.width), torch.int32),  # [B, W]
            cu_seqlens_q=tensor(cu, torch.int32),  # [B + 1]
            context_lens=tensor(packed.context_lens, torch.int32),  # [B]
            max_query_len=max_query_len,
            max_context_len=max(packed.context_lens),
            pool=self.pool,
            num_decodes=self.leading_decodes(batch),
        )
        return inputs, paged

    @staticmethod
    def kept_rows(batch: Sequence[ScheduledChunk], cu: list[int]) -> list[int]:
        """The packed rows whose logits a step returns: each chunk's last row, every row of an
        ``every_row`` chunk."""
        if not any(chunk.every_row for chunk in batch):
            return [end - 1 for end in cu[1:]]
        return [
            row
            for chunk, start, end in zip(batch, cu, cu[1:], strict=False)
            for row in (range(start, end) if chunk.every_row else (end - 1,))
        ]

    @staticmethod
    def leading_decodes(batch: Sequence[ScheduledChunk]) -> int:
        """How many chunks at the head of the step are one token each."""
        return next((i for i, c in enumerate(batch) if len(c.token_ids) > 1), len(batch))

    @torch.inference_mode()
    def forward(self, batch: Sequence[ScheduledChunk], feed: Feed | None = None) -> torch.Tensor:
        """Writes the KV of every scheduled token into the pool; returns logits [K, vocab] (fp32)
        of each request's last scheduled token (of each of its tokens if ``every_row``), in
        batch order (K = B without ``every_row`` chunks). ``feed``: chunks whose
        token is taken from the device (their host token id is a placeholder). Enqueues the
        work; waits for the device only where an eager model does."""
        packed = self.pack(batch)  # once: every path below takes its lists
        if (group := self._leader_group()) is not None:  # a step pack refuses stays on rank 0
            self._send_forward(batch, feed, group)
        width = packed.width
        graphs, mixed = self.graphs, self.mixed
        decodes = len(packed.ids) == len(batch)  # one token per chunk
        if graphs is not None and decodes and graphs.fits(len(batch), width):
            source = None
            if feed is not None:  # one token per chunk: chunk i is input row i
                rows = [-1] * len(batch)
                for chunk, row in zip(feed.chunks, feed.rows, strict=True):
                    rows[chunk] = row
                source = (feed.source, rows)
            graphs.load(
                packed.ids,
                packed.positions,
                packed.slots,
                self._table_rows(batch, width),
                packed.context_lens,
                source,
            )
            self.last_path = "decode_graph"
            return graphs.replay(len(batch)).float()
        if mixed is not None and mixed.fits(len(packed.ids), len(packed.context_lens), width):
            fed = (feed.source, feed.rows, [packed.cu[i] for i in feed.chunks]) if feed else None
            logits = mixed.replay(
                ids=packed.ids,
                positions=packed.positions,
                slots=packed.slots,
                cu=packed.cu,
                context_lens=packed.context_lens,
                table=self._table_rows(batch, width),
                num_decodes=self.leading_decodes(batch),
                keep=self.kept_rows(batch, packed.cu),
                feed=fed,
            )
            self.last_path = "mixed_graph"
            return logits.float()
        inputs, paged = self.prepare(batch, packed)
        if feed is not None:
            positions = [packed.cu[i] for i in feed.chunks]
            self._scatter(inputs["input_ids"][0], feed, positions)
        out = self.model(**inputs, use_cache=False, paged=paged)
        self.last_path = "eager"
        return out.logits[0].float()  # [B, vocab]

    # ------------------------------------------------------------------ tensor parallel
    def _leader_group(self) -> TPGroup | None:
        """The group, if this rank leads one (rank 0 of several)."""
        group = self.group
        return group if group is not None and group.size > 1 and group.rank == 0 else None

    def _send_forward(
        self, batch: Sequence[ScheduledChunk], feed: Feed | None, group: TPGroup
    ) -> None:
        chunks = self._mirror.plan(batch)
        if feed is None:
            send_plan(StepPlan("forward", chunks), group)
            return
        rows = len(feed.source)
        send_plan(StepPlan("forward", chunks, rows, feed.rows, feed.chunks), group)
        broadcast_fed(feed.source, rows, group, self.device)

    def follow(self) -> StepPlan:
        """A rank other than 0: runs every call rank 0 sends, until one that is not a runner's
        (``map`` or ``scratch``: a new pool; ``release``: this runner's end; ``stop``), which it
        returns."""
        assert self.group is not None and self.group.rank > 0, "rank 0 leads, it does not follow"
        while True:
            plan = receive_plan(self.group)
            if plan.kind in ("map", "scratch", "release", "stop"):
                return plan
            if plan.kind == "copy":
                self.copy_blocks(plan.copies)
                continue
            feed = None
            if plan.fed_len:
                source = broadcast_fed(None, plan.fed_len, self.group, self.device)
                feed = Feed(source, plan.fed_rows, plan.fed_chunks)
            batch = [
                ScheduledChunk(c.token_ids, c.start, table, c.every_row, c.key)
                for c, table in zip(plan.chunks, self._mirror.tables(plan.chunks), strict=True)
            ]
            self.forward(batch, feed)

    def stop_followers(self, kind: Literal["stop", "release"] = "stop") -> None:
        """Rank 0: the other ranks' ``follow`` returns (``release``: this runner is done with,
        the group goes on; ``stop``: the group ends)."""
        if (group := self._leader_group()) is not None:
            send_plan(StepPlan(kind), group)

    def _table_rows(self, batch: Sequence[ScheduledChunk], width: int) -> TableRows:
        """The step's block tables as rows of ``self.tables`` and the writes they need."""
        return self.tables.plan([c.key for c in batch], [c.block_ids for c in batch], width)

    def _scatter(self, input_ids: torch.Tensor, feed: Feed, positions: list[int]) -> None:
        """input_ids[positions[i]] = feed.source[feed.rows[i]], on the device."""
        rows = to_device(feed.rows, self.device)
        input_ids.index_copy_(0, to_device(positions, self.device), feed.source[rows])
