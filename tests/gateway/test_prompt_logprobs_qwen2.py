"""Prompt logprobs through the whole HTTP stack for a Qwen2-shaped checkpoint (q/k/v biases):
the other family the issue names, besides the Llama-shaped ``tiny`` of the package's stack.
A request for the prompt's logprobs after a prefix-cache hit equals log_softmax of
transformers' own fp32 forward at every position, with equal top ranks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from compute.model.models import byte_tokenizer, load_model, tiny_family_config
from tests.compute.driver import paged_model, reference_model
from tests.stack import Stack, running_stack


@pytest.fixture(scope="module")
def qwen2(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Path]]:
    checkpoint = tmp_path_factory.mktemp("qwen2")
    paged_model(tiny_family_config("qwen2"), seed=31).save_pretrained(checkpoint)
    byte_tokenizer().save_pretrained(checkpoint)
    logs = tmp_path_factory.mktemp("qwen2-stack")
    with running_stack(redis_url, logs, 6, model=str(checkpoint)) as stack:
        yield stack, checkpoint


def test_qwen2_prompt_logprobs_after_a_prefix_cache_hit(qwen2: tuple[Stack, Path]) -> None:
    stack, checkpoint = qwen2
    model, _ = load_model(str(checkpoint), "float32", "cpu")
    truth = reference_model(model)
    prompt = [40 + (i * 11) % 80 for i in range(37)]
    with openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0) as client:
        name = client.models.list().data[0].id
        for _ in range(2):
            warm = client.completions.create(model=name, prompt=prompt, max_tokens=1)
        assert warm.usage and warm.usage.prompt_tokens_details
        assert warm.usage.prompt_tokens_details.cached_tokens == 32
        scored = client.completions.create(
            model=name,
            prompt=prompt,
            max_tokens=0,
            echo=True,
            logprobs=4,
            extra_body={"return_tokens_as_token_ids": True},
        )
    logprobs = scored.choices[0].logprobs
    assert logprobs and logprobs.token_logprobs and logprobs.top_logprobs
    assert logprobs.token_logprobs[0] is None and len(logprobs.token_logprobs) == len(prompt)
    with torch.inference_mode():
        want = torch.log_softmax(truth(torch.tensor([prompt])).logits[0].float(), dim=-1)
    for i in range(1, len(prompt)):
        assert abs(logprobs.token_logprobs[i] - float(want[i - 1, prompt[i]])) < 1e-4, i
        ranked = want[i - 1].topk(4)
        assert list(logprobs.top_logprobs[i]) == [f"token_id:{t}" for t in ranked.indices]
