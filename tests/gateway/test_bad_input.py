"""Bad input gets an OpenAI-style error with a 4xx status, and the server keeps serving."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from tests.stack import MAX_BODY_BYTES, Stack


def post(stack: Stack, path: str, body: bytes | dict[str, Any]) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        f"{stack.url}{path}", data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def ok_completion(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "ok", "max_tokens": 2} | extra


def ok_chat(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "ok"}], "max_tokens": 2} | (
        extra
    )


COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
CASES: dict[str, tuple[str, bytes | dict[str, Any], int, str | None, str | None]] = {
    # name: (path, body, status, param, code)
    "prompt_longer_than_context": (
        COMPLETIONS,
        ok_completion(prompt=[65] * 4096),
        400,
        "prompt",
        "context_length_exceeded",
    ),
    "chat_longer_than_context": (
        CHAT,
        ok_chat(messages=[{"role": "user", "content": "y" * 5000}]),
        400,
        "messages",
        "context_length_exceeded",
    ),
    "max_tokens_zero": (COMPLETIONS, ok_completion(max_tokens=0), 400, "max_tokens", None),
    "max_tokens_negative": (CHAT, ok_chat(max_tokens=-3), 400, "max_tokens", None),
    "max_tokens_past_context": (
        COMPLETIONS,
        ok_completion(max_tokens=4095),
        400,
        "max_tokens",
        "context_length_exceeded",
    ),
    "n_zero": (COMPLETIONS, ok_completion(n=0), 400, "n", None),
    "n_too_large": (CHAT, ok_chat(n=129), 400, "n", None),
    "best_of_below_n": (COMPLETIONS, ok_completion(n=3, best_of=2), 400, "best_of", None),
    "best_of_too_large": (COMPLETIONS, ok_completion(best_of=10_000), 400, "best_of", None),
    "wrong_type_n": (COMPLETIONS, ok_completion(n="2"), 400, "n", "invalid_type"),
    "wrong_type_temperature": (CHAT, ok_chat(temperature="hot"), 400, "temperature", None),
    "wrong_type_prompt": (COMPLETIONS, ok_completion(prompt={"text": "x"}), 400, "prompt", None),
    "wrong_type_stop": (COMPLETIONS, ok_completion(stop=[1, 2]), 400, "stop[0]", None),
    "wrong_type_messages": (CHAT, ok_chat(messages="hello"), 400, "messages", None),
    "wrong_type_stream": (CHAT, ok_chat(stream="yes"), 400, "stream", None),
    "missing_prompt": (COMPLETIONS, {"model": "tiny"}, 400, "prompt", None),
    "token_out_of_vocabulary": (COMPLETIONS, ok_completion(prompt=[1, 999]), 400, "prompt", None),
    "negative_temperature": (COMPLETIONS, ok_completion(temperature=-1), 400, "temperature", None),
    "top_p_zero": (COMPLETIONS, ok_completion(top_p=0), 400, "top_p", None),
    "unknown_model": (COMPLETIONS, ok_completion(model="gpt-4"), 404, "model", "model_not_found"),
    "priority_out_of_range": (COMPLETIONS, ok_completion(priority=2**31), 400, "priority", None),
    "unknown_model_chat": (CHAT, ok_chat(model="llama"), 404, "model", "model_not_found"),
    "invalid_json": (COMPLETIONS, b'{"model": "tiny", "prompt": ', 400, None, "invalid_json"),
    "not_an_object": (CHAT, b"[1, 2, 3]", 400, None, None),
    "empty_body": (COMPLETIONS, b"", 400, None, "invalid_json"),
    "not_utf8": (COMPLETIONS, b'{"prompt": "\xff\xfe"}', 400, None, "invalid_json"),
    "lone_surrogate": (
        COMPLETIONS,
        b'{"model": "tiny", "prompt": "\\ud800", "max_tokens": 2}',
        400,
        None,
        "invalid_json",
    ),
    "lone_surrogate_chat": (
        CHAT,
        b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\udc00b"}]}',
        400,
        None,
        "invalid_json",
    ),
    "empty_messages": (CHAT, ok_chat(messages=[]), 400, "messages", None),
    "unknown_role": (
        CHAT,
        ok_chat(messages=[{"role": "wizard", "content": "x"}]),
        400,
        "messages[0].role",
        None,
    ),
    "image_content": (
        CHAT,
        ok_chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
        400,
        "messages[0].content[0]",
        "unsupported_parameter",
    ),
    "body_over_size_limit": (
        COMPLETIONS,
        ok_completion(prompt="z" * (MAX_BODY_BYTES + 1)),
        413,
        None,
        "request_too_large",
    ),
    "empty_prompt_list": (COMPLETIONS, ok_completion(prompt=[]), 400, "prompt", None),
    "echo_logprobs_above_20": (
        COMPLETIONS,
        ok_completion(logprobs=21, echo=True),
        400,
        "logprobs",
        None,
    ),
    "max_tokens_negative_with_echo": (
        COMPLETIONS,
        ok_completion(max_tokens=-1, echo=True),
        400,
        "max_tokens",
        None,
    ),
    "logprobs_above_20": (COMPLETIONS, ok_completion(logprobs=21), 400, "logprobs", None),
    "response_format_of_no_known_type": (
        CHAT,
        ok_chat(response_format={"type": "xml"}),
        400,
        "response_format",
        None,
    ),
    "json_schema_without_a_schema": (
        CHAT,
        ok_chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        400,
        "response_format",
        None,
    ),
    "schema_the_grammar_engine_refuses": (
        COMPLETIONS,
        ok_completion(guided_json={"type": "frob"}),
        400,
        "guided_json",
        None,
    ),
    "guided_json_that_is_no_json": (
        COMPLETIONS,
        ok_completion(guided_json="{nope"),
        400,
        "guided_json",
        None,
    ),
    "two_structured_outputs": (
        CHAT,
        ok_chat(response_format={"type": "json_object"}, guided_regex="a+"),
        400,
        "guided_regex",
        None,
    ),
    "regex_that_does_not_parse": (
        COMPLETIONS,
        ok_completion(guided_regex="(unclosed"),
        400,
        "guided_regex",
        None,
    ),
    "empty_choice": (COMPLETIONS, ok_completion(guided_choice=[]), 400, "guided_choice", None),
    "choice_of_numbers": (
        COMPLETIONS,
        ok_completion(guided_choice=[1, 2]),
        400,
        "guided_choice",
        None,
    ),
    "grammar_with_beam_search": (
        COMPLETIONS,
        ok_completion(use_beam_search=True, best_of=2, guided_choice=["a"]),
        400,
        "use_beam_search",
        "unsupported",
    ),
    "grammar_with_min_tokens": (
        COMPLETIONS,
        ok_completion(min_tokens=2, guided_choice=["a"]),
        400,
        "min_tokens",
        None,
    ),
    "top_logprobs_without_logprobs": (CHAT, ok_chat(top_logprobs=2), 400, "top_logprobs", None),
    "logprobs_with_beam_search": (
        COMPLETIONS,
        ok_completion(use_beam_search=True, best_of=2, logprobs=1),
        400,
        "logprobs",
        "unsupported",
    ),
    "seed_too_large": (COMPLETIONS, ok_completion(seed=2**70), 400, "seed", None),
    "presence_penalty_above_2": (
        CHAT,
        ok_chat(presence_penalty=2.5),
        400,
        "presence_penalty",
        None,
    ),
    "frequency_penalty_not_finite": (
        COMPLETIONS,
        b'{"model": "tiny", "prompt": "x", "frequency_penalty": -1e999}',
        400,
        "frequency_penalty",
        None,
    ),
    "repetition_penalty_zero": (
        COMPLETIONS,
        ok_completion(repetition_penalty=0),
        400,
        "repetition_penalty",
        None,
    ),
    "logit_bias_key_not_a_token": (
        CHAT,
        ok_chat(logit_bias={"hello": 1}),
        400,
        "logit_bias",
        None,
    ),
    "logit_bias_key_of_unicode_digits": (
        COMPLETIONS,
        ok_completion(logit_bias={"\u00b2": 1, "9" * 5000: 1}),
        400,
        "logit_bias",
        None,
    ),
    "logit_bias_token_out_of_vocabulary": (
        COMPLETIONS,
        ok_completion(logit_bias={"99999": 1}),
        400,
        "logit_bias",
        None,
    ),
    "logit_bias_above_100": (
        COMPLETIONS,
        ok_completion(logit_bias={"65": 101}),
        400,
        "logit_bias",
        None,
    ),
    "min_tokens_above_max_tokens": (
        COMPLETIONS,
        ok_completion(min_tokens=3),
        400,
        "min_tokens",
        None,
    ),
    "penalty_with_beam_search": (
        COMPLETIONS,
        ok_completion(use_beam_search=True, best_of=2, presence_penalty=0.5),
        400,
        "presence_penalty",
        "unsupported",
    ),
    "stop_with_beam_search": (
        COMPLETIONS,
        ok_completion(use_beam_search=True, best_of=2, stop=["x"]),
        400,
        "stop",
        None,
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_gets_an_openai_error(stack: Stack, case: str) -> None:
    path, body, status, param, code = CASES[case]
    got, answer = post(stack, path, body)
    assert got == status, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error


def test_unknown_route_and_method_get_json_errors(stack: Stack) -> None:
    status, answer = post(stack, "/v1/embeddings", {"input": "x"})
    assert status == 404 and answer["error"]["message"]
    request = urllib.request.Request(f"{stack.url}/v1/completions")  # GET
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=10)
    assert err.value.code == 405 and json.loads(err.value.read())["error"]["message"]


def test_after_all_that_a_normal_request_succeeds(stack: Stack) -> None:
    status, answer = post(stack, COMPLETIONS, ok_completion(max_tokens=3, ignore_eos=True))
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] == 3
    status, answer = post(stack, CHAT, ok_chat(max_tokens=3, ignore_eos=True))
    assert status == 200 and answer["choices"][0]["finish_reason"] == "length"
    with urllib.request.urlopen(f"{stack.url}/health", timeout=10) as response:
        assert json.loads(response.read())["status"] == "ok"
