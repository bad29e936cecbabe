"""A minimal greedy engine loop for tests: the real ``KVCacheManager`` (in process) allocates
blocks, a CPU pool tensor holds the KV, ``ModelRunner`` runs one packed batch per step.

Not the compute worker's engine (no Redis, no RPC, no preemption): just enough scheduling to
drive prefill chunks and decodes through the model path the way the worker will.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
from transformers import AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers.generation import GenerateBeamDecoderOnlyOutput
from transformers.generation.utils import GenerateOutput

from compute.model.attention import ATTN_NAME
from compute.model.runner import ModelRunner, ScheduledChunk
from compute.parallel.layers import TPGroup
from contracts.model_config import kv_geometry
from kvstore.manager import KVCacheManager

WORKER = "w0"
EOS = 257


@dataclass
class Seq:
    req_id: str
    tokens: list[int]  # prompt, then generated tokens
    prompt_len: int
    max_new: int
    block_ids: list[int]  # the worker's copy of its block table (Placement, then Growth)
    num_computed: int  # tokens whose KV is in the pool
    num_cached_tokens: int  # prefix-cache hit reported at admission
    done: bool = False
    sampled_logits: list[torch.Tensor] = field(default_factory=list)  # [vocab] per output token

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :]


@dataclass
class GreedyDriver:
    model: PreTrainedModel
    num_blocks: int = 64
    block_size: int = 16
    token_budget: int | None = None  # max tokens per step; None packs everything pending
    cuda_graph_max_batch: int = 0  # > 0: decode steps replay CUDA graphs (CUDA only)
    cuda_graph_max_tokens: int = 0  # > 0: other steps replay graphs of mixed steps (CUDA only)
    group: TPGroup | None = None  # rank 0 of a tensor-parallel group: ``model`` is its shards
    seqs: dict[str, Seq] = field(default_factory=dict)
    steps: list[list[tuple[str, int, int]]] = field(default_factory=list)  # (req, start, n)

    def __post_init__(self) -> None:
        pool = garbage_pool(self.model, self.num_blocks, self.block_size, self.group)
        self.manager = KVCacheManager(self.num_blocks, 0, self.block_size)
        self.runner = ModelRunner(
            self.model,
            pool,
            self.block_size,
            self.cuda_graph_max_batch,
            self.cuda_graph_max_tokens,
            group=self.group,
        )
        self.pending_copies: list[tuple[int, int]] = []

    def admit(self, req_id: str, prompt: list[int], max_new: int) -> Seq:
        placement = self.manager.admit(req_id, WORKER, prompt, None)
        seq = Seq(
            req_id,
            list(prompt),
            len(prompt),
            max_new,
            list(placement.block_ids),
            placement.num_computed,
            placement.num_cached_tokens,
        )
        self.seqs[req_id] = seq
        return seq

    def step(self) -> None:
        """Schedules every running request's uncomputed tokens (in admission order, within the
        token budget), runs one forward, samples greedily where a request's last token was
        computed, and reports the step to the manager."""
        budget = self.token_budget if self.token_budget is not None else 1 << 30
        scheduled: list[tuple[Seq, int]] = []
        for seq in self.seqs.values():
            n = min(len(seq.tokens) - seq.num_computed, budget)
            if seq.done or n <= 0:
                continue
            scheduled.append((seq, n))
            budget -= n
        assert scheduled, "nothing to run"
        self.runner.copy_blocks(self.pending_copies)
        self.pending_copies = []
        batch = [
            ScheduledChunk(
                s.tokens[s.num_computed : s.num_computed + n],
                s.num_computed,
                s.block_ids,
                key=s.req_id,  # as the engine keys them (the runner's device block tables)
            )
            for s, n in scheduled
        ]
        self.steps.append([(s.req_id, s.num_computed, n) for s, n in scheduled])
        logits = self.runner.forward(batch)  # [B, vocab]
        for row, (seq, n) in enumerate(scheduled):
            computed = seq.num_computed + n
            new: list[int] = []
            if computed == len(seq.tokens):  # the last known token ran: sample the next
                token = int(logits[row].argmax())
                seq.sampled_logits.append(logits[row].cpu())
                seq.tokens.append(token)
                new.append(token)
                seq.done = token == EOS or len(seq.output) >= seq.max_new
            seq.num_computed = computed
            if seq.done:
                self.manager.free(seq.req_id, WORKER)
                continue
            growth = self.manager.append(seq.req_id, WORKER, new, computed)
            seq.block_ids.extend(growth.new_block_ids)
            for position, src, dst in growth.copies:
                seq.block_ids[position] = dst
                self.pending_copies.append((src, dst))
            assert seq.block_ids == self.manager.requests[seq.req_id].block_ids
        self.manager.check_integrity()

    def run(self) -> None:
        while any(not s.done for s in self.seqs.values()):
            self.step()


def garbage_pool(
    model: PreTrainedModel, num_blocks: int, block_size: int, group: TPGroup | None = None
) -> torch.Tensor:
    """A pool for ``model`` (its rank's KV heads in a group) full of garbage, not zeros: reading a
    slot that was never written changes the output."""
    size = group.size if group is not None else 1
    geo = kv_geometry(model.config, str(model.dtype).removeprefix("torch."), size)
    shape = (num_blocks, geo.num_layers, 2, block_size, geo.num_kv_heads, geo.head_dim)
    gen = torch.Generator().manual_seed(1234)
    return (torch.randn(shape, generator=gen) * 10).to(model.device, model.dtype)


def reference_model(model: PreTrainedModel) -> PreTrainedModel:
    """The same weights with transformers' own attention (SDPA) and forwards (those that
    ``compute.model.fused`` bound to the instances are dropped)."""
    ref = copy.deepcopy(model)
    for module in ref.modules():
        vars(module).pop("forward", None)
    ref.set_attn_implementation("sdpa")
    assert model.config._attn_implementation == ATTN_NAME
    return ref.eval()


def paged_model(config: object, seed: int) -> PreTrainedModel:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=ATTN_NAME).eval()


def moved(model: PreTrainedModel, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
    """``model.to(device, dtype)``: in place, ``model`` itself. Called through ``nn.Module``'s
    signature: transformers wraps ``PreTrainedModel.to`` in ``functools.wraps``, which mypy types
    as a callable that does not bind ``self``."""
    module: torch.nn.Module = model
    module.to(device, dtype)
    return model


class CanGenerate(Protocol):
    """A causal LM's ``generate`` (``GenerationMixin``). transformers annotates its ``self`` as
    its ``GenerativePreTrainedModel`` Protocol, which none of its models satisfies under mypy."""

    def generate(
        self, inputs: torch.Tensor, **kwargs: Any
    ) -> GenerateOutput | torch.LongTensor: ...


@torch.inference_mode()
def generate_greedy(ref: PreTrainedModel, prompt: list[int], max_new: int) -> list[int]:
    """transformers' greedy ``generate`` for one prompt (no padding); stops at EOS like the
    driver."""
    assert isinstance(ref, GenerationMixin)  # every causal LM; not PreTrainedModel itself
    ids = torch.tensor([prompt], device=ref.device)  # [1, L]
    out = cast(CanGenerate, ref).generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=EOS,
        pad_token_id=EOS,
    )
    assert isinstance(out, torch.Tensor)
    return out[0, len(prompt) :].tolist()


@torch.inference_mode()
def generate_beams(
    ref: PreTrainedModel,
    prompt: list[int],
    width: int,
    max_new: int,
    stop: int | None,
    length_penalty: float = 1.0,
    early_stopping: bool | str = "never",
    pad: int = 258,
) -> tuple[list[list[int]], list[float]]:
    """transformers' beam search (``num_beams=width``): the ``width`` hypotheses, best first,
    each cut after its ``stop`` token (padding follows it), and their scores."""
    assert isinstance(ref, GenerationMixin)  # every causal LM; not PreTrainedModel itself
    ids = torch.tensor([prompt], device=ref.device)  # [1, L]
    out = cast(CanGenerate, ref).generate(
        ids,
        attention_mask=torch.ones_like(ids),
        num_beams=width,
        num_return_sequences=width,
        do_sample=False,
        max_new_tokens=max_new,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        eos_token_id=stop,
        pad_token_id=pad,
        return_dict_in_generate=True,
        output_scores=True,
    )
    assert isinstance(out, GenerateBeamDecoderOnlyOutput) and out.sequences_scores is not None
    rows = out.sequences[:, len(prompt) :].tolist()
    ended = [row[: row.index(stop) + 1] if stop in row else row for row in rows]  # padded after
    return ended, out.sequences_scores.tolist()


def run_chunked_schedule(
    model: PreTrainedModel, prompts: list[list[int]], max_new: Sequence[int]
) -> GreedyDriver:
    """The chunked-and-mixed schedule the CPU and GPU tests share: a 48-token budget per step;
    r0-r2 admitted first, r3 after one step (its prefill runs beside the others' decodes)."""
    driver = GreedyDriver(model, token_budget=48)
    for i in range(3):
        driver.admit(f"r{i}", prompts[i], max_new[i])
    driver.step()
    driver.admit("r3", prompts[3], max_new[3])
    driver.run()
    return driver
