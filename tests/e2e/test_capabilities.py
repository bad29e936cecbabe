"""What a model cannot do is known before a request is accepted: a checkpoint whose tokenizer the
grammar engine cannot read (a character-level ``WordLevel`` tokenizer with a ``Fuse`` decoder)
is served by `pagedserve up`; a structured-output request gets a 400 naming the parameter and the
reason, ``/v1/models`` and ``/health`` say what is unsupported, a guided request written to Redis
directly (no gateway to refuse it) ends with an error record, and no process restarts."""

from __future__ import annotations

import json
import signal
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import redis

from contracts import queue_keys
from contracts.records import Guide, RequestRecord, SamplingParams
from pagedserve.redis_server import free_port
from tests.checkpoints import save_char_level_checkpoint
from tests.compute.serving import submit
from tests.conftest import banner_of, entry_record
from tests.pagedserve.test_up import start_up, wait_final

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def call(url: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, method="GET" if body is None else "POST")
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_structured_output_on_a_tokenizer_the_grammar_engine_cannot_read(tmp_path: Path) -> None:
    checkpoint = save_char_level_checkpoint(tmp_path / "char-level")
    port = free_port()
    up = start_up(port, tmp_path / "redis", checkpoint)
    try:
        banner = banner_of(up, 180)
        redis_url = banner.split("redis ")[1].split(",")[0]
        base = f"http://127.0.0.1:{port}"
        status, models = call(f"{base}/v1/models")
        card = models["data"][0]
        assert status == 200 and "grammar engine" in card["unsupported"]["structured_output"]
        assert card["chat_template"] is True
        status, health = call(f"{base}/health")
        assert status == 200 and "structured_output" in health["unsupported"], health
        chat = {
            "model": card["id"],
            "messages": [{"role": "user", "content": "Where?"}],
            "max_tokens": 8,
        }
        response_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
        status, refused = call(
            f"{base}/v1/chat/completions", chat | {"response_format": response_format}
        )
        assert status == 400, refused
        error = refused["error"]
        assert error["param"] == "response_format" and error["code"] == "unsupported_parameter"
        assert "structured output is not available for this model" in error["message"]
        # written to Redis directly, past the gateway's check: the worker refuses it alone
        guided = SamplingParams(max_tokens=8, guide=Guide("json_schema", json.dumps(SCHEMA)))
        submit(redis_url, [RequestRecord("direct-guided", [0, 40, 41], guided, "m")])
        r = redis.Redis.from_url(redis_url)
        wait_final(r, "direct-guided")
        last = entry_record((r.xrange(queue_keys.output_key("direct-guided")) or [])[-1])
        assert last.finish_reason == "error" and last.error_code == "unsupported_parameter", last
        status, answer = call(f"{base}/v1/chat/completions", chat)
        assert status == 200 and answer["usage"]["completion_tokens"] >= 1, answer
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(120)
    log = up.stdout.read()  # type: ignore[union-attr]
    assert "restarting in" not in log, log  # no process of the stack died
    assert "unsupported_parameter" in log or "structured output is not available" in log, log
