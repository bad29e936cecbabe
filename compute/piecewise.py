"""Piecewise CUDA graphs of mixed steps: everything but attention captured, per token bucket.

A step that carries a prompt chunk beside the decodes cannot replay a decode graph: its
attention grid depends on its chunks. Run eagerly, a 1B-shaped step of 255 decodes and one
610-token chunk took 11 ms of host time to enqueue, for 7 ms of device work (BENCHMARKS.md):
the device waited for Python. The launches are nearly all outside attention, in the products,
norms, rotary and activation of each layer, and those depend only on the step's token count.

So, per token bucket, ``PiecewiseGraphs`` captures the model's decoder in ``num_layers + 1``
pieces, cut at every layer's attention (``PagedBatch.split``): piece ``i`` ends with layer
``i``'s K/V stored in the pool and its query copied to a static buffer; the next piece starts
by reading the attention output from another static buffer. A replay runs the pieces in order
with the step's real attention (``compute.attention.attend``) enqueued eagerly between them,
then the lm_head on the rows that are sampled. A step's tokens fill the first rows of the
bucket; the rest are padding that computes garbage nobody reads (slot -1: ``store_kv`` skips
it; no chunk owns it, so attention never reads or writes it).

Every bucket's pieces share one memory pool: replaying one bucket's pieces in order and then
another's is safe, which is the only order a step uses them in.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch
from transformers import PreTrainedModel

from compute.attention import PagedBatch, attend, check_window
from contracts.model_config import kv_geometry

__all__ = ["PiecewiseGraphs", "token_buckets"]

log = logging.getLogger("pagedserve.compute")

# The families whose causal-LM head is the lm_head over the decoder's last hidden state (no
# logit scaling or capping): the replay applies it itself, to the sampled rows only.
PIECEWISE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def token_buckets(max_tokens: int) -> list[int]:
    """Multiples of 64 up to 512, of 128 up to 1024, of 256 beyond: a step pads at most 64
    tokens below 512 tokens and ~20% beyond."""
    sizes = [*range(64, 513, 64), *range(640, 1025, 128), *range(1280, max_tokens + 256, 256)]
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens})


class PiecewiseGraphs:
    """Captured pieces of ``model``'s decoder for steps of up to ``max_tokens`` tokens."""

    def __init__(self, model: PreTrainedModel, pool: torch.Tensor, max_tokens: int) -> None:
        """pool: [num_blocks, layers, 2, block_size, kv_heads, head_dim] on CUDA."""
        assert pool.is_cuda, "CUDA graphs need the pool on a CUDA device"
        config = model.config
        if config.model_type not in PIECEWISE_MODEL_TYPES:
            raise ValueError(f"no piecewise graphs for {config.model_type!r} models")
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.pool = pool
        self.max_tokens = max_tokens
        self.buckets = token_buckets(max_tokens)
        device, dtype = pool.device, pool.dtype
        head_dim = kv_geometry(config, str(dtype).removeprefix("torch.")).head_dim
        heads = int(config.num_attention_heads)
        self.input_ids = torch.zeros(1, max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(1, max_tokens, dtype=torch.int64, device=device)
        self.slots = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        # each piece but the last writes its layer's query here; the attention of the step
        # writes its output into ``attended``, which the next piece reads
        self.query = torch.zeros(max_tokens, heads, head_dim, dtype=dtype, device=device)
        self.attended = torch.zeros_like(self.query)
        self.layers: list[tuple[float, int | None]] = []  # (scaling, sliding window) per layer
        self.pieces: dict[int, tuple[list[torch.cuda.CUDAGraph], torch.Tensor]] = {}
        self.replays = 0  # a counter
        self._capturing: list[torch.cuda.CUDAGraph] = []
        self._pool = torch.cuda.graph_pool_handle()  # of every piece

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every bucket, largest first (their pieces share one memory pool)."""
        stream = torch.cuda.Stream()
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            for i, size in enumerate(reversed(self.buckets)):
                paged = self._placeholder(size)
                self._decoder(size, paged)  # warm-up: compiles kernels, allocates
                stream.synchronize()
                self.layers = []
                self._capturing = [self._begin()]
                hidden = self._decoder(size, replace(paged, split=self._cut))  # [size, hidden]
                self._capturing[-1].capture_end()
                self.pieces[size] = (self._capturing, hidden)
                if i % 4 == 0 or size == self.buckets[0]:
                    log.info(
                        "captured CUDA graph pieces for %d-token steps (%d/%d)",
                        size,
                        i + 1,
                        len(self.buckets),
                    )
        torch.cuda.synchronize()
        self._capturing = []

    def _begin(self) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self._pool)
        return graph

    def _cut(
        self, layer: int, query: torch.Tensor, scaling: float, window: int | None
    ) -> torch.Tensor:
        """``PagedBatch.split`` while capturing: ends the piece with the layer's query in the
        static buffer, starts the next one, which reads the attention output."""
        assert layer == len(self.layers), f"layer {layer} cut out of order"
        tokens = query.shape[0]
        self.query[:tokens].copy_(query)
        self._capturing[-1].capture_end()
        self._capturing.append(self._begin())
        self.layers.append((scaling, window))
        return self.attended[:tokens]

    def _placeholder(self, size: int) -> PagedBatch:
        """Attention metadata of one chunk of ``size`` tokens over block 0: never read while
        capturing (the cut replaces attention), harmless in the warm-up (the static slots are
        -1 then: nothing is stored). Its ``max_context_len`` is 0: a model's sliding window is
        checked against each real step when it is replayed."""
        device = self.pool.device
        block_size = self.pool.shape[3]
        return PagedBatch(
            slot_mapping=self.slots[:size],
            block_tables=torch.zeros(1, -(-size // block_size), dtype=torch.int32, device=device),
            cu_seqlens_q=torch.tensor([0, size], dtype=torch.int32, device=device),
            context_lens=torch.tensor([size], dtype=torch.int32, device=device),
            max_query_len=size,
            max_context_len=0,
            pool=self.pool,
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

    def fits(self, tokens: int) -> bool:
        return tokens <= self.max_tokens

    def replay(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        paged: PagedBatch,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        """One step of T = input_ids.numel() <= max_tokens tokens (on the device: ``input_ids``,
        ``positions`` and ``paged.slot_mapping`` [T], as ``ModelRunner.prepare`` builds them);
        logits [len(rows), vocab] of the packed rows ``rows`` [B] int64. Enqueues the work
        without waiting for the device."""
        tokens = input_ids.numel()
        size = next(s for s in self.buckets if s >= tokens)
        pieces, hidden = self.pieces[size]
        self.input_ids[0, :tokens].copy_(input_ids.view(-1))
        self.positions[0, :tokens].copy_(positions.view(-1))
        self.slots[:tokens].copy_(paged.slot_mapping)
        self.slots[tokens:size].fill_(-1)
        query, attended = self.query[:tokens], self.attended[:tokens]
        for layer, piece in enumerate(pieces[:-1]):
            piece.replay()
            scaling, window = self.layers[layer]
            check_window(window, paged.max_context_len)
            attend(query, layer, paged, scaling, out=attended)
        pieces[-1].replay()
        self.replays += 1
        return self.lm_head(hidden.index_select(0, rows))
