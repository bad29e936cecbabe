"""The CUDA path: Triton ``store_kv`` / ``paged_prefill`` inside real models (``-m gpu``).

Half precision makes greedy ties likely, so the check is teacher-forced: every logits row the
runner produced during a chunked-prefill + decode run is compared with transformers' SDPA forward
over the same tokens, and every greedy choice must be SDPA's argmax unless the two are a near tie.
The fused forwards (``compute.model.fused``, what the worker runs) are held to an fp32 forward
instead, as accurate as SDPA's bf16 (``check_as_accurate_as_sdpa``).
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch
from transformers import PreTrainedModel

from compute.model.fused import fuse_layers
from compute.model.models import FAMILIES, load_model, tiny_family_config
from compute.model.runner import Feed, ModelRunner, ScheduledChunk
from tests.compute.driver import (
    GreedyDriver,
    Seq,
    moved,
    paged_model,
    reference_model,
    run_chunked_schedule,
)

PROMPT_LENS = (5, 17, 33, 40)
MAX_NEW = (12, 8, 16, 10)


@pytest.fixture
def cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda")


def check_against_sdpa(driver: GreedyDriver, tol: float) -> None:
    ref = reference_model(driver.model)
    for seq in driver.seqs.values():
        got = torch.stack(seq.sampled_logits).float()  # [n_out, vocab]
        with torch.inference_mode():
            ids = torch.tensor([seq.tokens[:-1]], device=ref.device)
            want = ref(ids).logits[0, seq.prompt_len - 1 :].float().cpu()  # [n_out, vocab]
        assert got.shape == want.shape
        scale = want.abs().max().item()
        err = (got - want).abs().max().item()
        assert err <= tol * scale, f"{seq.req_id}: max error {err} vs logit scale {scale}"
        for i, token in enumerate(seq.output):
            best = int(want[i].argmax())
            assert token == best or want[i, best] - want[i, token] <= 2 * tol * scale


def check_as_accurate_as_sdpa(
    seqs: Iterable[Seq], model: PreTrainedModel, margin: float = 1.5
) -> None:
    """The fused forwards round differently from transformers' (``compute.model.fused``), so the
    logits of ``seqs`` are compared with the truth instead: an fp32 forward of ``model`` (the
    paged model they ran on, or the whole model its shards stand for) over the same tokens.
    Their error must stay within ``margin`` times the error of transformers' own bf16 SDPA
    forward (plus 1% of the logit scale), and every greedy choice be the truth's unless a near
    tie."""
    sdpa = reference_model(model)
    exact = moved(reference_model(model), sdpa.device, torch.float32)
    for seq in seqs:
        got = torch.stack(seq.sampled_logits).float()  # [n_out, vocab]
        with torch.inference_mode():
            ids = torch.tensor([seq.tokens[:-1]], device=sdpa.device)
            truth = exact(ids).logits[0, seq.prompt_len - 1 :].float().cpu()
            base = sdpa(ids).logits[0, seq.prompt_len - 1 :].float().cpu()
        scale = truth.abs().max().item()
        err, base_err = (got - truth).abs().max().item(), (base - truth).abs().max().item()
        bound = margin * base_err + 0.01 * scale
        assert err <= bound, f"{seq.req_id}: error {err} vs SDPA's {base_err} (scale {scale})"
        for i, token in enumerate(seq.output):
            best = int(truth[i].argmax())
            assert token == best or truth[i, best] - truth[i, token] <= 2 * bound


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("head_dim", [16, 128])
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_chunked_prefill_and_decode_match_sdpa(
    family: str, head_dim: int, fused: bool, cuda: torch.device
) -> None:
    config = tiny_family_config(family)
    config.head_dim = head_dim
    model = moved(paged_model(config, seed=FAMILIES.index(family)), cuda, torch.bfloat16)
    if fused:  # as the worker loads it (compute.model.models.load_model)
        fuse_layers(model)
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    driver = run_chunked_schedule(model, prompts, MAX_NEW)
    assert driver.steps[1][2:] == [("r2", 26, 7), ("r3", 0, 39)]  # chunks mixed with decodes
    if fused:
        check_as_accurate_as_sdpa(driver.seqs.values(), driver.model)
    else:
        check_against_sdpa(driver, tol=0.03)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_cuda_graph_decodes_match_sdpa(family: str, cuda: torch.device) -> None:
    """Decode steps of the fused model replayed from CUDA graphs (batches 20 down to 1, padded
    to their bucket; a 700-token context among them) are as accurate as SDPA."""
    config = tiny_family_config(family)
    config.head_dim = 64
    config.max_position_embeddings = 1024  # the graphs' block tables are this wide
    model = moved(paged_model(config, seed=5), cuda, torch.bfloat16)
    fuse_layers(model)
    gen = torch.Generator().manual_seed(11)
    driver = GreedyDriver(model, num_blocks=512, cuda_graph_max_batch=32)
    for i in range(20):
        n = 700 if i == 3 else int(torch.randint(1, 90, (1,), generator=gen))
        prompt = torch.randint(0, 256, (n,), generator=gen).tolist()
        driver.admit(f"r{i}", prompt, 3 + i)
    driver.run()
    graphs = driver.runner.graphs
    assert graphs is not None and graphs.replays >= 20  # every step after the prefill
    check_as_accurate_as_sdpa(driver.seqs.values(), driver.model)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_cuda_graphs_of_mixed_steps_match_sdpa(family: str, cuda: torch.device) -> None:
    """Steps of prompt chunks beside decodes replay whole-decoder graphs, attention included
    (up to 128 tokens: buckets 64 and 128, padded; one or several prompt chunks per step);
    steps of more tokens run eagerly, decode-only steps their own graphs. All as accurate as
    SDPA."""
    config = tiny_family_config(family)
    config.head_dim = 64
    config.max_position_embeddings = 1024
    model = moved(paged_model(config, seed=7), cuda, torch.bfloat16)
    fuse_layers(model)
    gen = torch.Generator().manual_seed(13)
    driver = GreedyDriver(
        model, num_blocks=512, token_budget=160, cuda_graph_max_batch=16, cuda_graph_max_tokens=128
    )
    mixed = driver.runner.mixed
    assert mixed is not None and mixed.buckets == [64, 128]
    for i in range(14):
        n = 300 if i == 5 else int(torch.randint(1, 70, (1,), generator=gen))
        prompt = torch.randint(0, 256, (n,), generator=gen).tolist()
        driver.admit(f"r{i}", prompt, 4 + i)
        if i not in (2, 8):  # there the next prompt joins the same step
            driver.step()  # every admission after the first joins running decodes
    driver.run()
    steps = [step for step in driver.steps if any(n > 1 for *_, n in step)]
    tokens = [sum(n for *_, n in step) for step in steps]
    assert any(t > 128 for t in tokens) and sum(t <= 128 for t in tokens) >= 8
    assert any(sum(n > 1 for *_, n in step) > 1 for step in steps), "no step of two prompts"
    assert mixed.replays == sum(t <= 128 for t in tokens)
    check_as_accurate_as_sdpa(driver.seqs.values(), driver.model)


@pytest.mark.gpu
def test_cuda_mixed_graph_takes_fed_tokens_and_matches_eager(cuda: torch.device) -> None:
    """A mixed step replayed from its graph with its decodes' tokens fed from the device (as the
    overlapped engine runs it) gives the logits of the same step with host token ids, bitwise,
    and those of the eager forward up to rounding; rows of every chunk, every_row included."""
    config = tiny_family_config("llama")
    config.head_dim = 64
    config.max_position_embeddings = 1024
    model = moved(paged_model(config, seed=3), cuda, torch.bfloat16)
    fuse_layers(model)
    pool = torch.randn(64, config.num_hidden_layers, 2, 16, config.num_key_value_heads, 64)
    pool = pool.to(cuda, torch.bfloat16)
    graphed = ModelRunner(model, pool, 16, 0, 128, max_chunks=8)
    eager = ModelRunner(model, pool, 16)
    ids = [5, 77, 130]
    batch = [
        ScheduledChunk([ids[0]], 40, [1, 2, 3]),
        ScheduledChunk([ids[1]], 100, [4, 5, 6, 7, 8, 9, 10]),
        ScheduledChunk([ids[2]], 7, [11]),
        ScheduledChunk(list(range(30, 60)), 16, [12, 13, 14]),  # a chunk after a cached block
        ScheduledChunk(list(range(9, 14)), 0, [15], every_row=True),
    ]
    # the prompt chunks write their slots: the same step must find the same pool each time
    snapshot = pool.clone()
    want = graphed.forward(batch)
    pool.copy_(snapshot)
    placeholders = [ScheduledChunk([0], c.start, c.block_ids) for c in batch[:3]]
    source = torch.tensor([0, *ids], device=cuda)
    feed = Feed(source, rows=[1, 2, 3], chunks=[0, 1, 2])
    got = graphed.forward([*placeholders, *batch[3:]], feed)
    assert graphed.mixed is not None and graphed.mixed.replays == 2
    assert got.shape == (4 + 5, config.vocab_size) and torch.equal(got, want)
    pool.copy_(snapshot)
    plain = eager.forward(batch)
    scale = plain.abs().max().item()
    assert (got - plain).abs().max().item() <= 0.02 * scale


@pytest.mark.gpu
def test_cuda_fp16_prefix_hit_and_block_size_32(cuda: torch.device) -> None:
    model = moved(paged_model(tiny_family_config("qwen3"), seed=1), cuda, torch.float16)
    gen = torch.Generator().manual_seed(4)
    prefix = torch.randint(0, 256, (64,), generator=gen).tolist()
    driver = GreedyDriver(model, block_size=32)
    driver.admit("a", [*prefix, 1, 2, 3], 6)
    driver.step()
    b = driver.admit("b", [*prefix, 7, 8], 9)
    assert b.num_cached_tokens == 64
    driver.run()
    check_against_sdpa(driver, tol=0.03)


@pytest.mark.gpu
def test_load_tiny_on_cuda(cuda: torch.device) -> None:
    model, tok = load_model("tiny", "bfloat16", "cuda")
    assert model.device.type == "cuda"
    assert "forward" in vars(model.model.norm)  # fused (compute.model.fused)
    pool = torch.zeros(4, 2, 2, 16, 2, 16, dtype=torch.bfloat16, device=cuda)
    ids = tok("on the GPU")["input_ids"]
    logits = ModelRunner(model, pool, 16).forward([ScheduledChunk(ids, 0, [3])])
    with torch.inference_mode():
        want = reference_model(model)(torch.tensor([ids], device=cuda)).logits[0, -1].float()
    assert (logits[0] - want).abs().max() <= 0.03 * want.abs().max()
