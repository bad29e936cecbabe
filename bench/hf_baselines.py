"""transformers' own ways to serve the engine-alone workload, for ``bench/serve.py``'s
baselines: its continuous batching manager, and ``generate`` over static batches. Each runs in a
process of its own that imports none of pagedserve's GPU code."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from bench.shapes import Jobs, build_model, llama_1b_config

if TYPE_CHECKING:
    from transformers.generation import ContinuousBatchingManager


class CanGenerate(Protocol):
    """A causal LM's ``generate`` (``GenerationMixin``). transformers annotates its ``self`` as
    its ``GenerativePreTrainedModel`` Protocol, which none of its models satisfies under mypy."""

    def generate(self, **kwargs: Any) -> object: ...


def run_hf_continuous(jobs: Jobs) -> dict:
    """transformers' continuous batching manager, one request per job with its own length."""
    from transformers import GenerationConfig

    model = build_model(llama_1b_config(), "paged|sdpa")
    gen = GenerationConfig(max_new_tokens=512, do_sample=False, eos_token_id=-1, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=gen)
    manager.start()
    try:
        warm = [manager.add_request(p, max_new_tokens=8) for p, _ in jobs[:4]]
        _collect(manager, set(warm))
        start = time.perf_counter()
        ids = [manager.add_request(prompt, max_new_tokens=m) for prompt, m in jobs]
        tokens = _collect(manager, set(ids))
        seconds = time.perf_counter() - start
    finally:
        manager.stop(block=True, timeout=60)
    return {"seconds": seconds, "tokens": tokens}


def _collect(manager: ContinuousBatchingManager, ids: set[str | None]) -> int:
    tokens = 0
    while ids:
        result = manager.get_result(timeout=600)
        if result is None:
            raise RuntimeError("transformers' continuous batching stopped early")
        if result.is_finished() and result.request_id in ids:
            ids.discard(result.request_id)
            tokens += len(result.generated_tokens)
    return tokens


def run_hf_static(jobs: Jobs, batch: int = 32) -> dict:
    model = build_model(llama_1b_config(), "sdpa")
    model.generation_config.pad_token_id = 0
    useful, start = 0, time.perf_counter()
    for lo in range(0, len(jobs), batch):
        part = jobs[lo : lo + batch]
        width = max(len(prompt) for prompt, _ in part)
        ids = torch.zeros(len(part), width, dtype=torch.long)
        mask = torch.zeros(len(part), width, dtype=torch.long)
        for i, (prompt, _) in enumerate(part):  # left padding
            ids[i, width - len(prompt) :] = torch.tensor(prompt)
            mask[i, width - len(prompt) :] = 1
        new = max(m for _, m in part)
        cast(CanGenerate, model).generate(
            input_ids=ids.cuda(),
            attention_mask=mask.cuda(),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
        )
        useful += sum(m for _, m in part)
    torch.cuda.synchronize()
    return {"seconds": time.perf_counter() - start, "tokens": useful}
