"""compute.sampling.penalties against direct references: Hugging Face's
RepetitionPenaltyLogitsProcessor and OpenAI's formula, batched with rows that use none; then token
for token through the engine."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from compute.sampling.penalties import ProcessedRow, process_logits
from contracts.records import SamplingParams
from tests.compute.serving import prompts_of, run_engine

VOCAB = 40


def reference(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt: list[int],
    output: list[int],
    banned: list[int],
) -> torch.Tensor:
    """One row [vocab], processed the way the module's docstring defines, op by op."""
    out = logits.clone()
    for token in banned:
        out[token] = float("-inf")
    for token, bias in params.logit_bias.items():
        out[token] += bias
    if params.repetition_penalty != 1.0:
        hf = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)
        out = hf(torch.tensor([prompt + output]), out[None])[0]
    for token, count in Counter(output).items():
        out[token] -= count * params.frequency_penalty + params.presence_penalty
    return out


def test_processed_rows_match_the_references_and_the_others_stay_as_they_are() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, VOCAB, generator=gen) * 3
    source = torch.tensor([11, 3, 29])  # a step's draw: row 1 of it is fed to one row below
    cases = [  # (row, params, prompt, output, fed, banned)
        (0, SamplingParams(repetition_penalty=1.7), [1, 2, 2, 30], [5, 1], -1, []),
        (2, SamplingParams(frequency_penalty=0.8, presence_penalty=-0.5), [4], [5, 5, 7], -1, []),
        (3, SamplingParams(logit_bias={7: 5.0, 39: -100.0}, min_tokens=4), [9], [8], -1, [0, 3]),
        (4, SamplingParams(repetition_penalty=0.6, frequency_penalty=1.5), [3, 6], [6, 6], 1, []),
    ]
    rows = [ProcessedRow(r, p, pr, out, fed, banned) for r, p, pr, out, fed, banned in cases]
    got = process_logits(logits, rows, source)
    for row, params, prompt, output, fed, banned in cases:
        full = output + ([int(source[fed])] if fed >= 0 else [])
        want = reference(logits[row], params, prompt, full, banned)
        assert torch.allclose(got[row], want, atol=1e-5), row
        assert not torch.equal(got[row], logits[row]), f"row {row} was not processed"
    for row in (1, 5):
        assert torch.equal(got[row], logits[row])
    assert got[3, 0] == float("-inf") and got[3, 3] == float("-inf")


def test_uses_processors_only_for_non_default_fields() -> None:
    assert not SamplingParams().uses_processors()
    for field in (
        {"presence_penalty": 0.1},
        {"frequency_penalty": -0.1},
        {"repetition_penalty": 1.1},
        {"logit_bias": {3: 0.5}},
        {"min_tokens": 1},
    ):
        assert SamplingParams(**field).uses_processors(), field


def greedy_reference(
    model: torch.nn.Module, prompt: list[int], params: SamplingParams, eos: set[int]
) -> list[int]:
    """Greedy decoding with transformers' own forward over the whole sequence at every step,
    each step's logits processed by ``reference``; stops at a stop id, as the engine does."""
    tokens = list(prompt)
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else eos)
    for _ in range(params.max_tokens):
        with torch.inference_mode():
            logits = model(torch.tensor([tokens])).logits[0, -1].float()
        output = tokens[len(prompt) :]
        banned = sorted(stops) if len(output) < params.min_tokens else []
        token = int(reference(logits, params, prompt, output, banned).argmax())
        tokens.append(token)
        if token in stops:
            break
    return tokens[len(prompt) :]


def test_engine_greedy_output_with_penalties_equals_the_reference(
    redis_url: str, tiny: tuple
) -> None:
    """Requests with penalties, bias and min_tokens beside plain greedy ones, through the real
    engine (kvstore, Redis, overlapped steps: the newest token of a penalized row is fed from
    the device): token for token the reference's greedy decoding."""
    _, tokenizer, model = tiny  # model: transformers' own forward
    eos = {int(tokenizer.eos_token_id)}
    prompts = prompts_of([12, 30, 7, 21, 16, 9], seed=5)
    forced = max(eos)  # EOS with a +100 bias: it would end the request at once but for min_tokens
    params = {
        "req0": SamplingParams(
            max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=1.8
        ),
        "req1": SamplingParams(
            max_tokens=24,
            temperature=0.0,
            ignore_eos=True,
            frequency_penalty=1.2,
            presence_penalty=0.6,
        ),
        "req2": SamplingParams(
            max_tokens=20, temperature=0.0, ignore_eos=True, logit_bias={65: 3.0, 66: -100.0}
        ),
        "req3": SamplingParams(
            max_tokens=20, temperature=0.0, min_tokens=6, logit_bias={forced: 100.0}
        ),
    }  # req4, req5: plain greedy
    served = run_engine(redis_url, [], prompts, 24, tiny, params=params)
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for rid, prompt in prompts.items():
        want = greedy_reference(model, prompt, params.get(rid, plain), eos)
        assert served.outputs[rid] == want, rid
    assert len(served.outputs["req3"]) == 7 and served.outputs["req3"][-1] == forced
    assert served.streamed["req3"].sequences[0].finish_reason == "stop"
    for rid in ("req0", "req1"):  # the penalties changed what greedy decoding picks
        assert served.outputs[rid] != greedy_reference(model, prompts[rid], plain, eos), rid


def test_the_contract_refuses_out_of_range_fields() -> None:
    for field, message in (
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logit_bias": {5: 100.5}}, "logit_bias"),
        ({"min_tokens": 17}, "min_tokens"),
        ({"beam_width": 2, "min_tokens": 1}, "beam search"),
    ):
        with pytest.raises(ValueError, match=message):
            SamplingParams(**field).validate()
