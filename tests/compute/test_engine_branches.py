"""Requests with several sequences through the real kvstore daemon, Redis and the engine: beam
search against transformers' own, its block sharing, and taking over n > 1 and beam requests
from a dead worker."""

from __future__ import annotations

from collections import Counter

from contracts.records import SamplingParams, Streamed
from tests.compute.driver import generate_beams
from tests.compute.serving import BLOCK_BYTES, kill_and_take_over, prompts_of, run_engine
from tests.compute.test_engine import tokens_of

FLAGS = ["--kv-memory", "0.01GiB"]


def beam_params(prompt: list[int], tiny: tuple, max_tokens: int) -> SamplingParams:
    """Width 4, all 4 hypotheses returned; the stop token is the one the unconstrained search
    emits most, so hypotheses end at different lengths (the model's EOS is never emitted)."""
    free, _ = generate_beams(tiny[2], prompt, 4, max_tokens, None)
    stop = Counter(t for s in free for t in s).most_common(1)[0][0]
    return SamplingParams(
        max_tokens=max_tokens, n=4, beam_width=4, stop_token_ids=[stop], ignore_eos=True
    )


def hypotheses(streamed: Streamed) -> list[list[int]]:
    return [streamed.sequences[k].token_ids for k in sorted(streamed.sequences)]


def test_beam_search_equals_generate_and_shares_blocks(redis_url: str, tiny: tuple) -> None:
    """Width 4 over a 100-token prompt: the 4 hypotheses and their order are transformers'
    ``generate(num_beams=4)``; the beams hold far fewer blocks than 4 independent requests
    (distinct salts: nothing shared) of the same prompt and length."""
    prompt = prompts_of([100], seed=20)["req0"]
    params = beam_params(prompt, tiny, 12)
    want, _ = generate_beams(tiny[2], prompt, 4, 12, params.stop_token_ids[0])
    assert len({len(h) for h in want}) > 1  # some hypotheses stop early
    beams = run_engine(redis_url, FLAGS, {"beam": prompt}, 12, tiny, params={"beam": params})
    assert hypotheses(beams.streamed["beam"]) == want
    finish = [beams.streamed["beam"].sequences[k].finish_reason for k in range(4)]
    assert finish == ["stop" if h[-1] in params.stop_token_ids else "length" for h in want]
    four = {f"ind{i}": prompt for i in range(4)}
    salts = {rid: rid.encode() for rid in four}
    independent = run_engine(redis_url, FLAGS, four, 12, tiny, salts=salts)
    # 4 x 7 blocks for 112 tokens, 8 once a table's two lookahead slots pass 112 (the four end
    # about together); the beams share the prompt's 6 full blocks
    assert 4 * 7 <= independent.max_used <= 4 * 8
    assert beams.max_used <= 6 + 4 * 2, beams.max_used
    print(f"\nbeam width 4: {beams.max_used} blocks at most; 4 independent: {independent.max_used}")
    assert beams.stats.gpu.used == 0 and not beams.stats.requests


def test_beams_preempted_under_memory_pressure_give_the_same_answer(
    redis_url: str, tiny: tuple
) -> None:
    """Two beam searches in a 16-block pool, where each needs 10 blocks at the end: the later
    one's beams are preempted (swapped or recomputed; a round waits for every beam's logits)
    and resumed, and both answers are still transformers'."""
    prompts = prompts_of([40, 44], seed=21)
    params = {rid: beam_params(prompt, tiny, 16) for rid, prompt in prompts.items()}
    gib = 16 * BLOCK_BYTES / (1 << 30)
    swap = 8 * BLOCK_BYTES / (1 << 30)
    flags = ["--kv-memory", f"{gib:.9f}GiB", "--swap-memory", f"{swap:.9f}"]
    flags += ["--admission-watermark", "0"]
    served = run_engine(redis_url, flags, prompts, 16, tiny, params=params)
    for rid, prompt in prompts.items():
        stop = params[rid].stop_token_ids[0]
        assert hypotheses(served.streamed[rid]) == generate_beams(tiny[2], prompt, 4, 16, stop)[0]
    assert {d.req_id.split("#")[0] for d in served.stats.decisions} == {"req1"}
    assert served.stats.gpu.used == 0 and served.stats.cpu.used == 0


def test_a_dead_workers_n4_request_is_finished_by_another(redis_url: str, tiny: tuple) -> None:
    """n = 4 with a seed: w1 dies after every branch streamed 5 tokens; w2 adopts the four
    branches and finishes them exactly as an uninterrupted run, without the prompt again."""
    prompt = prompts_of([96], seed=22)["req0"]
    params = SamplingParams(max_tokens=14, temperature=0.8, seed=3, n=4, ignore_eos=True)
    whole = run_engine(redis_url, FLAGS, {"crash": prompt}, 14, tiny, params={"crash": params})
    run = kill_and_take_over(
        redis_url,
        tiny,
        prompt,
        params,
        lambda w1, out: all(len(tokens_of(out, k)) >= 5 for k in range(4)),
    )
    assert hypotheses(run.streamed) == hypotheses(whole.streamed["crash"])
    # at most the 9 remaining tokens of each branch plus its last block, never the prompt
    assert run.computed_by_w2 <= 4 * (9 + 16), run.computed_by_w2
    assert run.stats.gpu.used == 0 and not run.stats.requests


def test_a_dead_workers_beam_search_restarts_on_the_kept_blocks(
    redis_url: str, tiny: tuple
) -> None:
    """Beam search streams nothing until it ends, so w2 restarts it: on the prompt's blocks
    (adopted, or hit in the prefix cache), with the same answer."""
    prompt = prompts_of([96], seed=23)["req0"]
    params = beam_params(prompt, tiny, 10)
    want, _ = generate_beams(tiny[2], prompt, 4, 10, params.stop_token_ids[0])
    run = kill_and_take_over(
        redis_url, tiny, prompt, params, lambda w1, out: w1.tokens_computed >= 96 + 4 * 4
    )
    assert hypotheses(run.streamed) == want
    assert run.computed_by_w2 <= 16 + 4 * 10, run.computed_by_w2  # not the 96-token prompt


def test_a_worker_dead_before_making_a_copy_on_write_copy_is_taken_over_exactly(
    redis_url: str, tiny: tuple
) -> None:
    """n = 2, seeded: w1 dies right after the kvstore gave branch 0 a private copy of the
    prompt's shared last block, before w1 made the copy (its next launch would have). The
    kvstore does not trust that block until a worker confirms the copy, so w2 computes it
    again: the answer is an uninterrupted run's."""
    prompt = list(b"two ways")
    params = SamplingParams(max_tokens=8, n=2, seed=3, ignore_eos=True)
    whole = run_engine(redis_url, FLAGS, {"crash": prompt}, 8, tiny, params={"crash": params})
    run = kill_and_take_over(
        redis_url, tiny, prompt, params, lambda w1, out: w1.session.kvsync.owed_copies
    )
    assert hypotheses(run.streamed) == hypotheses(whole.streamed["crash"])
    assert run.stats.gpu.used == 0 and not run.stats.requests
