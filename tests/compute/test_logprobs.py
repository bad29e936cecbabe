"""Logprobs of sampled tokens through the real engine (kvstore, Redis, overlapped steps), for a
Llama and a Qwen2 checkpoint: each equals log_softmax of transformers' own fp32 forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
import torch

from compute.model.models import byte_tokenizer, load_model, tiny_family_config
from contracts import queue_keys
from contracts.records import SamplingParams, TokenLogprob
from tests.compute.driver import paged_model, reference_model
from tests.compute.serving import prompts_of, run_engine
from tests.conftest import entry_record


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_engine_logprobs_equal_log_softmax(redis_url: str, family: str, tmp_path: Path) -> None:
    paged_model(tiny_family_config(family), seed=21).save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    model, tokenizer = load_model(str(tmp_path), "float32", "cpu")
    truth = reference_model(model)
    prompts = prompts_of([9, 26, 14], seed=8)
    asked = {"req0": 4, "req1": 0}  # req2 asks for none
    params = {
        rid: SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=k)
        for rid, k in asked.items()
    }
    served = run_engine(
        redis_url, [], prompts, 12, (model, tokenizer, truth), params=params, kv_model=str(tmp_path)
    )
    r = redis.Redis.from_url(redis_url)
    for rid, prompt in prompts.items():
        entries = r.xrange(queue_keys.output_key(rid))
        assert entries is not None
        records = [entry_record(e) for e in entries]
        logprobs: list[TokenLogprob] = []
        for record in records:
            if rid not in asked:
                assert record.logprobs is None
            elif record.token_ids:
                assert record.logprobs is not None and len(record.logprobs) == len(record.token_ids)
                logprobs += record.logprobs
        if rid not in asked:
            continue
        output = served.outputs[rid]
        assert len(logprobs) == len(output) == 12
        with torch.inference_mode():
            logits = truth(torch.tensor([prompt + output[:-1]])).logits[0, len(prompt) - 1 :]
        want = torch.log_softmax(logits.float(), dim=-1)
        for i, (token, got) in enumerate(zip(output, logprobs, strict=True)):
            assert abs(got.logprob - float(want[i, token])) < 1e-4, (rid, i)
            top = want[i].topk(asked[rid])
            assert [t for t, _ in got.top] == top.indices.tolist(), (rid, i)
            assert all(
                abs(v - float(w)) < 1e-4 for (_, v), w in zip(got.top, top.values, strict=True)
            )


def _prompt_truth(truth: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    """log_softmax of transformers' forward over the prompt: row i predicts token i + 1."""
    with torch.inference_mode():
        return torch.log_softmax(truth(torch.tensor([prompt])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_engine_prompt_logprobs_equal_log_softmax_across_prefill_chunks(
    redis_url: str, family: str, tmp_path: Path
) -> None:
    """Prompts longer than the step's token budget (64) are computed in chunks; each chunk's
    rows give the logprobs of the prompt tokens they predict. Requests that ask for none share
    the steps."""
    paged_model(tiny_family_config(family), seed=22).save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    model, tokenizer = load_model(str(tmp_path), "float32", "cpu")
    truth = reference_model(model)
    prompts = prompts_of([150, 9, 70, 1], seed=9)
    asked = {"req0": 5, "req1": 0, "req3": 2}  # req2 asks for none; req3's prompt is one token
    params = {
        rid: SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=k)
        for rid, k in asked.items()
    }
    params["req0"] = SamplingParams(
        max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=5, n=2
    )
    served = run_engine(
        redis_url, [], prompts, 4, (model, tokenizer, truth), params=params, kv_model=str(tmp_path)
    )
    r = redis.Redis.from_url(redis_url)
    for rid, prompt in prompts.items():
        entries = r.xrange(queue_keys.output_key(rid))
        assert entries is not None
        records = [entry_record(e) for e in entries]
        carrying = [rec for rec in records if rec.prompt_logprobs is not None]
        if rid not in asked:
            assert carrying == []
            continue
        [record] = carrying  # one record carries them: the first with tokens, of choice 0
        assert record is next(rec for rec in records if rec.token_ids) and record.index == 0
        got = record.prompt_logprobs
        assert got is not None and len(got) == len(prompt) and got[0] is None
        want = _prompt_truth(truth, prompt)
        for position in range(1, len(prompt)):
            entry = got[position]
            assert entry is not None, (rid, position)
            expected = float(want[position - 1, prompt[position]])
            assert abs(entry.logprob - expected) < 1e-4, (rid, position)
            top = want[position - 1].topk(asked[rid])
            assert [t for t, _ in entry.top] == top.indices.tolist(), (rid, position)
            assert all(
                abs(v - float(w)) < 1e-4 for (_, v), w in zip(entry.top, top.values, strict=True)
            )
        assert served.cached[rid] == 0
