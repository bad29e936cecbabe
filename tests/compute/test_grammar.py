"""Structured output on the worker: the token masks (``compute.sampling.grammar``) exactly, and
guided requests through the real engine (kvstore, Redis, overlapped steps) on the tiny model: 200
random JSON Schemas whose outputs all parse and validate, choices and regular expressions that
match, a guide the grammar engine refuses failing alone."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import jsonschema
import pytest
import redis
import torch

from bench.byte_vocab import byte_level_tokenizer
from compute.model.models import byte_tokenizer, load_model, tiny_family_config
from compute.sampling.grammar import GrammarError, Grammars, mask_rows, unpack_bitmask
from contracts import queue_keys
from contracts.records import Guide, SamplingParams
from contracts.tokenizer import EOS
from pagedserve.json_schemas import MAX_INSTANCE_BYTES, random_schema
from tests.compute.driver import paged_model
from tests.compute.serving import prompts_of, run_engine
from tests.conftest import entry_record

VOCAB = 300  # the tiny model's logits are wider than its 259-token tokenizer


def test_unpack_bitmask_reads_bit_t_mod_32_of_word_t_div_32() -> None:
    rng = random.Random(3)
    words = [[rng.randrange(-(2**31), 2**31) for _ in range(10)] for _ in range(3)]
    got = unpack_bitmask(torch.tensor(words, dtype=torch.int32), VOCAB)
    want = [[bool((row[t // 32] >> (t % 32)) & 1) for t in range(VOCAB)] for row in words]
    assert got.tolist() == want


def test_mask_rows_leaves_exactly_the_grammar_s_tokens_in_the_guided_rows() -> None:
    grammars = Grammars(byte_tokenizer(), VOCAB)
    digits, letters = (
        grammars.matcher(Guide("regex", "[0-9]+")),
        grammars.matcher(Guide("regex", "[ab]x")),
    )
    logits = torch.randn(3, VOCAB)
    masked = mask_rows(logits, [0, 2], [digits, letters])
    assert torch.equal(masked[1], logits[1])  # unguided: untouched
    assert torch.isfinite(masked[0]).nonzero().flatten().tolist() == list(range(48, 58))
    assert torch.isfinite(masked[2]).nonzero().flatten().tolist() == [97, 98]
    assert letters.consume_token(97)  # "a": now only "x"
    assert torch.isfinite(mask_rows(logits, [0], [letters])[0]).nonzero().flatten().tolist() == [
        ord("x")
    ]
    assert letters.consume_token(ord("x"))  # complete: only EOS
    assert torch.isfinite(mask_rows(logits, [0], [letters])[0]).nonzero().flatten().tolist() == [
        EOS
    ]
    with pytest.raises(GrammarError, match="regex"):
        grammars.matcher(Guide("regex", "(unclosed"))


def _outputs(redis_url: str, rid: str) -> tuple[list[str], list[str | None]]:
    """(text, finish reason) of each sequence of ``rid``, from its records."""
    entries = redis.Redis.from_url(redis_url).xrange(queue_keys.output_key(rid))
    assert entries is not None
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    for record in map(entry_record, entries):
        texts[record.index] = texts.get(record.index, "") + record.text
        reasons[record.index] = record.finish_reason or reasons.get(record.index)
    return [texts[i] for i in sorted(texts)], [reasons[i] for i in sorted(texts)]


def test_200_random_schemas_give_output_that_parses_and_validates(
    redis_url: str, tiny: tuple
) -> None:
    """The tiny random model, greedy for half the requests and sampled (seeded) for the rest;
    ``ignore_eos`` is set and overridden: a guided sequence ends at its grammar's end."""
    rng = random.Random(12)
    schemas = {f"req{i}": random_schema(rng) for i in range(200)}
    prompts = prompts_of([rng.randint(4, 24) for _ in schemas], seed=13)
    params = {
        rid: SamplingParams(
            max_tokens=MAX_INSTANCE_BYTES,
            temperature=0.0 if i % 2 else 1.0,
            seed=i,
            ignore_eos=True,
            guide=Guide("json_schema", json.dumps(schema)),
        )
        for i, (rid, schema) in enumerate(schemas.items())
    }
    run_engine(redis_url, [], prompts, 1, tiny, max_num_seqs=100, params=params)
    for rid, schema in schemas.items():
        [text], [reason] = _outputs(redis_url, rid)
        assert reason == "stop", (rid, text)
        jsonschema.validate(json.loads(text), schema)


def test_choices_and_regular_expressions_match_whole_outputs_and_a_refused_guide_fails_alone(
    redis_url: str, tiny: tuple
) -> None:
    choices = ["yes", "no", "maybe so"]
    guides = {
        "choice": Guide("choice", json.dumps(choices)),
        "regex": Guide("regex", r"[0-9]{3}-[a-z]{2,4}"),
        "object": Guide("json_object"),
        "refused": Guide("regex", "(unclosed"),
    }
    prompts = prompts_of([9, 14, 30, 5, 12], seed=14)
    rids = [*guides, "plain"]
    prompts = dict(zip(rids, prompts.values(), strict=True))
    params = {
        rid: SamplingParams(max_tokens=200, temperature=1.0, seed=5, n=3, guide=guide)
        for rid, guide in guides.items()
    }
    run_engine(redis_url, [], prompts, 6, tiny, params=params)
    texts, _ = _outputs(redis_url, "choice")
    assert len(texts) == 3 and all(t in choices for t in texts), texts
    texts, _ = _outputs(redis_url, "regex")
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t) for t in texts), texts
    texts, reasons = _outputs(redis_url, "object")  # unbounded: max_tokens may cut it first
    assert all(t.startswith("{") for t in texts), texts
    finished = [t for t, r in zip(texts, reasons, strict=True) if r == "stop"]
    assert all(isinstance(json.loads(t), dict) for t in finished), finished
    entries = redis.Redis.from_url(redis_url).xrange(queue_keys.output_key("refused"))
    assert entries is not None
    [failed] = map(entry_record, entries)
    assert failed.finish_reason == "error" and failed.error and "guide" in failed.error
    texts, reasons = _outputs(redis_url, "plain")
    assert reasons == ["length"] and len(texts[0]) > 0


def test_a_multi_byte_vocabulary_whose_eos_the_model_config_does_not_name(
    redis_url: str, tmp_path: Path
) -> None:
    """The benchmark's kind of checkpoint: a byte-level tokenizer with multi-byte tokens
    (``bench/byte_vocab.py``), whose EOS (the grammar's end) is not the model config's EOS
    (257: a two-byte token there; ``ignore_eos``, as the benchmark sends, keeps it from
    stopping anything). Guided outputs still end at the grammar's end, and parse and
    validate."""
    config = tiny_family_config("llama")
    config.vocab_size = 1024
    paged_model(config, seed=23).save_pretrained(tmp_path)
    tokenizer = byte_level_tokenizer(1024)
    assert tokenizer.eos_token_id == 1022 != config.eos_token_id
    tokenizer.save_pretrained(tmp_path)
    model, loaded = load_model(str(tmp_path), "float32", "cpu")
    rng = random.Random(24)
    schemas = {f"req{i}": random_schema(rng) for i in range(20)}
    prompts = prompts_of([rng.randint(4, 24) for _ in schemas], seed=25)
    params = {
        rid: SamplingParams(
            max_tokens=MAX_INSTANCE_BYTES,
            temperature=1.0,
            seed=i,
            ignore_eos=True,
            guide=Guide("json_schema", json.dumps(schema)),
        )
        for i, (rid, schema) in enumerate(schemas.items())
    }
    tiny = (model, loaded, None)
    run_engine(redis_url, [], prompts, 1, tiny, 20, params, kv_model=str(tmp_path))
    for rid, schema in schemas.items():
        [text], [reason] = _outputs(redis_url, rid)
        assert reason == "stop", (rid, text)
        jsonschema.validate(json.loads(text), schema)
