"""The official `openai` client against the running stack (Redis, kvstore, worker, gateway)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any, TypedDict, TypeVar

import jsonschema
import openai
import pytest
import torch
from openai.types import Completion, CompletionChoice, CompletionUsage
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageParam

from compute.model.models import load_model
from tests.compute.driver import reference_model
from tests.stack import Stack


@pytest.fixture
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


Chunk = TypeVar("Chunk", Completion, ChatCompletionChunk)


def stream_text(
    chunks: openai.Stream[Chunk],
) -> tuple[dict[int, str], dict[int, str | None], list[Chunk]]:
    """(text per choice, finish reason per choice, the chunks) of a completions stream."""
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    seen: list[Chunk] = []
    for chunk in chunks:
        seen.append(chunk)
        for choice in chunk.choices:
            text = (
                choice.text
                if isinstance(choice, CompletionChoice)
                else (choice.delta.content or "")
            )
            texts[choice.index] = texts.get(choice.index, "") + text
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    return texts, finish, seen


def test_completion_and_its_stream_agree(client: openai.OpenAI) -> None:
    done = client.completions.create(
        model="tiny", prompt="Hello", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    [choice] = done.choices
    assert choice.finish_reason == "length" and done.object == "text_completion"
    assert done.usage is not None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (6, 12)  # BOS + 5 bytes
    assert done.usage.prompt_tokens_details is not None
    assert done.usage.prompt_tokens_details.cached_tokens == 0
    stream = client.completions.create(
        model="tiny",
        prompt="Hello",
        max_tokens=12,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    texts, finish, _ = stream_text(stream)
    assert texts == {0: choice.text} and finish == {0: "length"}


def test_chat_and_its_stream_agree(client: openai.OpenAI) -> None:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
    ]
    done = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0, seed=1
    )
    [choice] = done.choices
    assert choice.message.role == "assistant" and done.object == "chat.completion"
    assert done.usage is not None and done.usage.completion_tokens <= 10
    # the plain template: "system: Be brief.\nuser: Hi!\nassistant:" after BOS
    assert done.usage.prompt_tokens == 1 + len("system: Be brief.\nuser: Hi!\nassistant:")
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0, seed=1, stream=True
    )
    texts, finish, chunks = stream_text(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert texts == {0: choice.message.content} and finish == {0: choice.finish_reason}


def test_n_2_gives_two_choices(client: openai.OpenAI) -> None:
    done = client.completions.create(
        model="tiny", prompt="Two", max_tokens=8, n=2, seed=5, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in done.choices) == [0, 1]
    assert done.usage is not None and done.usage.completion_tokens == 16
    assert done.choices[0].text != done.choices[1].text  # two seeded streams
    stream = client.completions.create(
        model="tiny",
        prompt="Two",
        max_tokens=8,
        n=2,
        seed=5,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    texts, finish, _ = stream_text(stream)
    assert texts == {c.index: c.text for c in done.choices}
    assert finish == {0: "length", 1: "length"}


def test_seed_reproduces_sampling(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        done = client.completions.create(
            model="tiny",
            prompt="Seeded",
            max_tokens=16,
            temperature=0.9,
            top_p=0.95,
            seed=seed,
            extra_body={"ignore_eos": True, "top_k": 100},
        )
        return done.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first


class CommonArgs(TypedDict):
    model: str
    prompt: str
    max_tokens: int
    temperature: float


def test_stop_string_cuts_the_text_stream_and_not(client: openai.OpenAI) -> None:
    kwargs: CommonArgs = {
        "model": "tiny",
        "prompt": "Stop here",
        "max_tokens": 40,
        "temperature": 0,
    }
    free = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    text = free.choices[0].text
    # a stop string from the middle of the greedy output, made of whole characters
    start = next(i for i in range(4, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    stop = text[start : start + 2]
    expected = text[: text.index(stop)]
    done = client.completions.create(**kwargs, stop=[stop], extra_body={"ignore_eos": True})
    assert (done.choices[0].text, done.choices[0].finish_reason) == (expected, "stop")
    stream = client.completions.create(
        **kwargs,
        stop=stop,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    texts, finish, _ = stream_text(stream)
    assert (texts[0], finish[0]) == (expected, "stop")  # no part of the stop string leaked


def test_include_usage_and_cached_tokens(client: openai.OpenAI) -> None:
    prompt = "A prompt of one hundred characters: the kvstore caches six full blocks of it. "
    prompt += "x" * (100 - len(prompt))  # 101 tokens with BOS: 6 full blocks, then a partial one

    def run() -> tuple[list[Completion], CompletionUsage | None]:
        stream = client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        return chunks, chunks[-1].usage

    chunks, usage = run()
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens == 101 and usage.prompt_tokens_details.cached_tokens == 0
    _, usage = run()
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 96
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=2
    )
    assert chat.usage is not None and chat.usage.prompt_tokens_details is not None
    assert chat.usage.prompt_tokens_details.cached_tokens == 0  # another prefix ("user: ...")


def test_models_list_and_retrieve(client: openai.OpenAI) -> None:
    [model] = client.models.list().data
    assert model.id == "tiny" and model.object == "model"
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_client_errors_are_typed(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt="x", max_tokens=0)
    assert bad.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[], stream=True)
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-4", prompt="x")
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model="tiny", prompt=[65] * 5000, max_tokens=1)


def test_beam_search_extension(client: openai.OpenAI) -> None:
    done = client.completions.create(
        model="tiny",
        prompt="Beams",
        max_tokens=6,
        n=2,
        extra_body={"use_beam_search": True, "beam_width": 3, "length_penalty": 1.0},
    )
    assert sorted(c.index for c in done.choices) == [0, 1]
    assert all(c.finish_reason in ("stop", "length") for c in done.choices)


def test_prompt_batch_and_echo(client: openai.OpenAI) -> None:
    done = client.completions.create(
        model="tiny",
        prompt=["First", "Second"],
        max_tokens=3,
        n=2,
        echo=True,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in done.choices) == [0, 1, 2, 3]  # prompt i, sequence k: 2i + k
    by_index = {c.index: c.text for c in done.choices}
    assert by_index[0].startswith("First") and by_index[1].startswith("First")
    assert by_index[2].startswith("Second") and by_index[3].startswith("Second")
    assert done.usage is not None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (6 + 7, 4 * 3)


def test_logit_bias_and_penalties_reach_the_sampler(client: openai.OpenAI) -> None:
    """A +100 bias makes greedy decoding repeat its token; with the penalties (OpenAI's fields,
    and vLLM's ``repetition_penalty`` and ``min_tokens`` through ``extra_body``) a
    frequency penalty large enough beats it after the first time."""
    biased = client.completions.create(
        model="tiny", prompt="hi", max_tokens=6, temperature=0, logit_bias={"70": 100}
    )
    text = biased.choices[0].text
    assert len(text) == 6 and len(set(text)) == 1, text
    other = client.completions.create(
        model="tiny", prompt="hi", max_tokens=6, temperature=0, logit_bias={"71": 100}
    )
    assert other.choices[0].text != text
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        temperature=0,
        logit_bias={"70": 10},
        frequency_penalty=2.0,
        presence_penalty=2.0,
        extra_body={"repetition_penalty": 100.0, "min_tokens": 6},
    )
    reply = chat.choices[0].message.content or ""
    assert chat.choices[0].finish_reason == "length" and reply.count(text[0]) <= 1, reply


@pytest.fixture(scope="module")
def truth() -> torch.nn.Module:
    """The workers' tiny model as transformers runs it (fp32, CPU): the logprobs' oracle."""
    model, _ = load_model("tiny", "float32", "cpu")
    return reference_model(model)


def log_softmax_rows(model: torch.nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), vocab]: log_softmax of transformers' own forward at each output position."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + output[:-1]])).logits[0, len(prompt) - 1 :]
    return torch.log_softmax(logits.float(), dim=-1)


def test_completion_logprobs_equal_log_softmax_streamed_or_not(
    client: openai.OpenAI, truth: torch.nn.Module
) -> None:
    prompt = [72, 101, 108, 108, 111, 44, 32]
    kwargs: dict[str, Any] = dict(
        model="tiny", prompt=prompt, max_tokens=8, temperature=0, logprobs=3
    )
    out = client.completions.create(**kwargs)
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    tokenizer = load_model("tiny", "float32", "cpu")[1]
    output = tokenizer.encode(out.choices[0].text, add_special_tokens=False)
    assert len(output) == 8 and logprobs.tokens == [tokenizer.decode([t]) for t in output]
    want = log_softmax_rows(truth, prompt, output)
    for i, token in enumerate(output):
        assert abs(logprobs.token_logprobs[i] - float(want[i, token])) < 1e-4, i
        top = logprobs.top_logprobs[i] if logprobs.top_logprobs else {}
        ranked = want[i].topk(3)
        assert list(top) == [tokenizer.decode([int(t)]) for t in ranked.indices]
        assert all(
            abs(v - float(w)) < 1e-4 for v, w in zip(top.values(), ranked.values, strict=True)
        )
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(8)]
    streamed = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kwargs)]
    joined = [
        x for chunk in streamed if chunk and chunk.token_logprobs for x in chunk.token_logprobs
    ]
    assert joined == logprobs.token_logprobs


def test_echo_logprobs_score_the_prompt_after_a_prefix_cache_hit(
    client: openai.OpenAI, truth: torch.nn.Module
) -> None:
    """Evaluation harnesses' request: ``echo``, ``max_tokens: 0``, ``logprobs``. Each prompt
    token after the first gets log_softmax of transformers' forward at the position before it,
    although the prompt's first blocks are in the prefix cache (the request computes them
    again: ``cached_tokens`` 0). With output tokens, streamed or not, the prompt's entries come
    first."""
    prompt = [33 + (i * 7) % 90 for i in range(40)]  # printable ASCII: one character a token
    tokenizer = load_model("tiny", "float32", "cpu")[1]
    for _ in range(2):  # the second finds the first's two full blocks cached (the first ends
        # on the token its prompt drew: its blocks join the index through ``Step.finals``)
        warm = client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
    assert warm.usage and warm.usage.prompt_tokens_details
    assert warm.usage.prompt_tokens_details.cached_tokens == 32
    scored = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=0,
        echo=True,
        logprobs=3,
        temperature=0,
        extra_body={"return_tokens_as_token_ids": True},  # top tokens that are no character
    )
    [choice] = scored.choices
    logprobs = choice.logprobs
    assert choice.text == tokenizer.decode(prompt) and choice.finish_reason == "length"
    assert scored.usage and scored.usage.completion_tokens == 0
    assert scored.usage.prompt_tokens_details
    assert scored.usage.prompt_tokens_details.cached_tokens == 0
    assert logprobs and logprobs.token_logprobs and logprobs.top_logprobs and logprobs.tokens
    assert logprobs.tokens == [f"token_id:{t}" for t in prompt]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    lengths = [len(t) for t in logprobs.tokens]
    assert logprobs.text_offset == [sum(lengths[:i]) for i in range(40)]
    with torch.inference_mode():
        want = torch.log_softmax(truth(torch.tensor([prompt])).logits[0].float(), dim=-1)
    for i in range(1, len(prompt)):
        assert abs(logprobs.token_logprobs[i] - float(want[i - 1, prompt[i]])) < 1e-4, i
        ranked = want[i - 1].topk(3)
        assert list(logprobs.top_logprobs[i]) == [f"token_id:{t}" for t in ranked.indices]
        values = logprobs.top_logprobs[i].values()
        assert all(abs(v - float(w)) < 1e-4 for v, w in zip(values, ranked.values, strict=True))
    kwargs: dict[str, Any] = dict(
        model="tiny", prompt=prompt, max_tokens=4, echo=True, logprobs=1, temperature=0
    )
    done = client.completions.create(**kwargs)
    [choice] = done.choices
    assert choice.logprobs and choice.logprobs.token_logprobs and choice.logprobs.tokens
    assert choice.logprobs.token_logprobs[:40] == logprobs.token_logprobs
    assert len(choice.logprobs.tokens) == 44 and choice.text.startswith(scored.choices[0].text)
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    joined = [
        x
        for c in chunks
        if c.choices[0].logprobs
        for x in c.choices[0].logprobs.token_logprobs or []
    ]
    assert joined == choice.logprobs.token_logprobs


def test_structured_output_through_the_sdk_parses_and_validates(client: openai.OpenAI) -> None:
    """``response_format`` with a JSON Schema (streamed and not), and vLLM's ``guided_choice``
    and ``guided_regex`` on completions, on the tiny random model."""
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": False,
    }
    response_format: Any = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
    kwargs: dict[str, Any] = dict(
        model="tiny",
        messages=[{"role": "user", "content": "a person"}],
        max_tokens=200,
        temperature=1.0,
        seed=3,
        response_format=response_format,
    )
    out = client.chat.completions.create(**kwargs)
    text = out.choices[0].message.content or ""
    assert out.choices[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), schema)
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(stream=True, **kwargs)
        if c.choices
    )
    assert streamed == text  # seeded: the same output
    choices = ["red", "green", "blue"]
    picked = client.completions.create(
        model="tiny",
        prompt="colour:",
        max_tokens=20,
        n=3,
        seed=4,
        extra_body={"guided_choice": choices},
    )
    assert all(c.text in choices for c in picked.choices), picked.choices
    matched = client.completions.create(
        model="tiny",
        prompt="code:",
        max_tokens=20,
        extra_body={"guided_regex": r"[A-Z]{2}[0-9]{2}"},
    )
    assert re.fullmatch(r"[A-Z]{2}[0-9]{2}", matched.choices[0].text), matched.choices[0].text


def test_chat_logprobs_and_top_logprobs(client: openai.OpenAI, truth: torch.nn.Module) -> None:
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = out.choices[0].logprobs.content if out.choices[0].logprobs else None
    assert content is not None and len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.logprob
        assert entry.top_logprobs[0].token == entry.token  # greedy: the sampled token is the best
        assert entry.bytes == list(entry.token.encode())
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], top_logprobs=2
        )


def test_logprobs_are_of_the_distribution_before_penalties(
    client: openai.OpenAI, truth: torch.nn.Module
) -> None:
    """vLLM's default (raw logprobs): the sampled token's logprob is the model's, even where a
    penalty made greedy decoding pick another token than the model's best. The tokens come as
    ``token_id:<id>`` (vLLM's ``return_tokens_as_token_ids``): some are bytes of no character."""
    prompt = [72, 72, 72, 101, 101, 32]
    out = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=10,
        temperature=0,
        logprobs=0,
        extra_body={"repetition_penalty": 5.0, "return_tokens_as_token_ids": True},
    )
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs and logprobs.tokens
    assert all(t.startswith("token_id:") for t in logprobs.tokens)
    output = [int(t.removeprefix("token_id:")) for t in logprobs.tokens]
    want = log_softmax_rows(truth, prompt, output)
    got = logprobs.token_logprobs
    assert all(abs(got[i] - float(want[i, t])) < 1e-4 for i, t in enumerate(output))
    assert any(int(want[i].argmax()) != t for i, t in enumerate(output)), "no penalty effect"
    assert logprobs.top_logprobs == [{}] * 10
