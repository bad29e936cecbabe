"""CUDA graphs of mixed steps: the whole decoder, attention included, one graph per token bucket.

A step that carries a prompt chunk beside the decodes cannot replay a decode graph: its attention
depends on its chunks. Run eagerly, a 1B-shaped step of 255 decodes and one 610-token chunk took
11 ms of host time to enqueue for 7 ms of device work. Piecewise graphs (everything captured but
attention, which ran eagerly between the pieces) brought the host's share to 5 ms: still as much
as the device's, so a burst of arrivals stayed launch-bound (BENCHMARKS-archive.md, issue 11).

Here attention is captured too. Its graph forms read the step's work from the device
(``kernels``): the decodes through ``paged_decode(count=...)`` over as many rows as the bucket can
have chunks, the prompt chunks through ``paged_prefill(tiles=..., num_tiles=...)``, a list of
(chunk, query tile) pairs as long as the bucket can need. Programs past the counts exit at once.
One replay runs every layer, whatever the step's chunks are; the lm_head then runs eagerly on
the sampled rows only.

Static inputs, sized for the largest bucket: token ids, positions and slots [T]; block tables
[R, W], row offsets [R + 1] and context lengths [R] of at most R = ``max_chunks`` chunks, W =
``max_blocks``; the tiles [I, 2]; the two counts. A step's inputs travel in one copy
(``compute.transfer.Staging``) and are scattered into them on the device; its block tables are
gathered there from the runner's ``DeviceBlockTables``. Token rows past the
step's hold slot -1 (``store_kv`` skips them) and no chunk or tile names them: they compute
garbage nobody reads. Stale table rows and columns are never read: the counts bound the rows,
each row's context its columns.

Every bucket's graph shares one memory pool: replaying one bucket and then another is safe,
which is the only order a step uses them in.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from compute.model.attention import PagedBatch, check_window
from compute.model.block_tables import DeviceBlockTables, TableRows
from compute.transfer import Staging
from contracts.model_config import kv_geometry

__all__ = ["MIXED_GRAPH_MODEL_TYPES", "MixedGraphs", "token_buckets"]

log = logging.getLogger("pagedserve.compute")

# The families whose causal-LM head is the lm_head over the decoder's last hidden state (no
# logit scaling or capping): the replay applies it itself, to the sampled rows only.
MIXED_GRAPH_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def token_buckets(max_tokens: int) -> list[int]:
    """Multiples of 64 up to 512, of 128 up to 1024, of 256 beyond: a step pads at most 64
    tokens below 512 tokens and ~20% beyond."""
    sizes = [*range(64, 513, 64), *range(640, 1025, 128), *range(1280, max_tokens + 256, 256)]
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens})


class MixedGraphs:
    """Captured forwards of ``model``'s decoder for steps of up to ``max_tokens`` tokens in up to
    ``max_chunks`` chunks, whose contexts fit ``max_blocks`` blocks."""

    def __init__(
        self,
        model: PreTrainedModel,
        pool: torch.Tensor,
        max_tokens: int,
        max_chunks: int,
        max_blocks: int,
        tables: DeviceBlockTables,
        buckets: Sequence[int] = (),
    ) -> None:
        """pool: [num_blocks, layers, 2, block_size, kv_heads, head_dim] on CUDA; ``tables``:
        the sequences' block tables on the device (the runner's); ``buckets``: the token counts
        to capture (default ``token_buckets(max_tokens)``; the largest must be ``max_tokens``)."""
        from kernels import prefill_tile_tokens

        assert pool.is_cuda, "CUDA graphs need the pool on a CUDA device"
        config = model.config
        if config.model_type not in MIXED_GRAPH_MODEL_TYPES:
            raise ValueError(f"no mixed-step graphs for {config.model_type!r} models")
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.pool = pool
        self.max_tokens = max_tokens
        self.max_chunks = max_chunks
        self.max_blocks = max_blocks
        self.block_tables = tables
        self.buckets = sorted(buckets) if buckets else token_buckets(max_tokens)
        if self.buckets[-1] != max_tokens:
            raise ValueError(f"buckets {self.buckets} must end at max_tokens {max_tokens}")
        geometry = kv_geometry(config, str(pool.dtype).removeprefix("torch."))
        group = int(config.num_attention_heads) // geometry.num_kv_heads
        self.tile_tokens = prefill_tile_tokens(geometry.head_dim, group)
        device, i32 = pool.device, torch.int32
        self.input_ids = torch.zeros(1, max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(1, max_tokens, dtype=torch.int64, device=device)
        self.slots = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        self.tables = torch.zeros(max_chunks, max_blocks, dtype=i32, device=device)
        self.cu = torch.zeros(max_chunks + 1, dtype=i32, device=device)
        self.context = torch.zeros(max_chunks, dtype=i32, device=device)
        self.tiles = torch.zeros(self._tile_room(max_tokens), 2, dtype=i32, device=device)
        self.decode_count = torch.zeros(1, dtype=i32, device=device)
        self.tile_count = torch.zeros(1, dtype=i32, device=device)
        # ids, positions, slots, kept rows: [T] each; offsets, contexts, table rows, fed rows
        # and their positions: [R] each (+1); the table writes (2 per block); the tiles; the
        # two counts
        room = 4 * max_tokens + 5 * (max_chunks + 1) + 2 * max_chunks * max_blocks
        self._staging = Staging(room + 2 * self.tiles.shape[0] + 2, device)
        self.windows: dict[int, int | None] = {}  # layer -> sliding window, seen at capture
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0  # a counter

    def _rows(self, size: int) -> int:
        """Chunks a step of ``size`` tokens can have."""
        return min(size, self.max_chunks)

    def _tile_room(self, size: int) -> int:
        """Query tiles a step of ``size`` tokens can need: one per ``tile_tokens`` tokens, plus
        one partial tile per chunk."""
        return -(-size // self.tile_tokens) + self._rows(size)

    def _paged(self, size: int) -> PagedBatch:
        rows = self._rows(size)
        return PagedBatch(
            slot_mapping=self.slots[:size],
            block_tables=self.tables[:rows],
            cu_seqlens_q=self.cu[: rows + 1],
            context_lens=self.context[:rows],
            max_query_len=size,
            max_context_len=0,  # windows are checked against each step at replay
            pool=self.pool,
            decode_count=self.decode_count,
            tiles=self.tiles[: self._tile_room(size)],
            tile_count=self.tile_count,
            observe=self._observe,
        )

    def _observe(self, layer: int, window: int | None) -> None:
        self.windows[layer] = window

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every bucket, largest first (they share one memory pool). The counts are 0
        while capturing: the warm-up before each capture attends to nothing."""
        pool = torch.cuda.graph_pool_handle()
        self.decode_count.zero_()
        self.tile_count.zero_()
        for i, size in enumerate(reversed(self.buckets)):
            paged = self._paged(size)
            self._decoder(size, paged)  # warm-up outside the graph: compiles kernels, allocates
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._decoder(size, paged)  # [size, hidden]
            self.graphs[size] = (graph, hidden)
            if i % 4 == 0 or size == self.buckets[0]:
                log.info(
                    "captured CUDA graphs of mixed steps for %d tokens (%d/%d)",
                    size,
                    i + 1,
                    len(self.buckets),
                )

    def _decoder(self, size: int, paged: PagedBatch) -> torch.Tensor:
        """The decoder over the first ``size`` static rows; hidden states [size, hidden]."""
        out = self.decoder(
            input_ids=self.input_ids[:, :size],
            position_ids=self.positions[:, :size],
            use_cache=False,
            paged=paged,
        )
        return out.last_hidden_state[0]

    def fits(self, tokens: int, chunks: int, width: int) -> bool:
        return tokens <= self.max_tokens and chunks <= self.max_chunks and width <= self.max_blocks

    def replay(
        self,
        *,
        ids: list[int],
        positions: list[int],
        slots: list[int],
        cu: list[int],
        context_lens: list[int],
        table: TableRows,
        num_decodes: int,
        keep: list[int],
        feed: tuple[torch.Tensor, list[int], list[int]] | None = None,
    ) -> torch.Tensor:
        """One step (its packed host lists, ``ModelRunner.pack``; the first ``num_decodes``
        chunks one token each; ``fits``; ``table``: the chunks' rows of ``block_tables``);
        logits [len(keep), vocab] of the packed rows ``keep``.
        ``feed`` = (source [R] int64 on the device, rows, packed positions): the token at each
        position is ``source[row]``, not its host id. Enqueues the work without waiting for the
        device."""
        from kernels import prefill_tiles

        tokens, chunks = len(ids), len(context_lens)
        size = next(s for s in self.buckets if s >= tokens)
        for window in set(self.windows.values()):
            check_window(window, max(context_lens))
        q_lens = [b - a for a, b in itertools.pairwise(cu)]
        tiles = prefill_tiles(q_lens, context_lens, num_decodes, self.tile_tokens)
        assert len(tiles) <= self._tile_room(size), "more tiles than a step can have"
        pad = size - tokens
        values = [*ids, *[0] * pad, *positions, *[0] * pad, *slots, *[-1] * pad, *cu]
        values += [*context_lens, *table.rows, *table.writes]
        values += [*(x for pair in tiles for x in pair), num_decodes, len(tiles), *keep]
        fed_rows, fed_positions = (feed[1], feed[2]) if feed is not None else ([], [])
        values += [*fed_rows, *fed_positions]
        lengths = [size, size, size, chunks + 1, chunks, chunks, len(table.writes)]
        lengths += [2 * len(tiles), 1, 1, len(keep), len(fed_rows), len(fed_positions)]
        parts = self._staging.copy(values).split(lengths)
        self.input_ids[0, :size].copy_(parts[0])
        self.positions[0, :size].copy_(parts[1])
        self.slots[:size].copy_(parts[2])
        self.cu[: chunks + 1].copy_(parts[3])
        self.context[:chunks].copy_(parts[4])
        self.block_tables.apply(parts[6], parts[5], table.width, self.tables)
        if tiles:
            self.tiles[: len(tiles)].copy_(parts[7].view(-1, 2))
        self.decode_count.copy_(parts[8])
        self.tile_count.copy_(parts[9])
        if feed is not None and fed_rows:
            self.input_ids[0].index_copy_(0, parts[12], feed[0][parts[11]])
        graph, hidden = self.graphs[size]
        graph.replay()
        self.replays += 1
        return self.lm_head(hidden.index_select(0, parts[10]))
