"""ModelRunner and the paged attention function: CPU cache writes, copies, packing, contracts."""

from __future__ import annotations

import pytest
import torch

from compute.model.attention import PagedBatch, copy_blocks_inplace, store_kv_inplace
from compute.model.models import load_model, tiny_family_config
from compute.model.runner import ModelRunner, ScheduledChunk
from compute.transfer import host_tensor
from kernels.reference import copy_blocks_reference, store_kv_reference
from tests.compute.driver import paged_model, reference_model

# pool of 6 blocks, 2 layers, block size 8, 2 KV heads, head_dim 16
POOL_SHAPE = (6, 2, 2, 8, 2, 16)


def test_store_kv_inplace_matches_reference_and_writes_the_pool() -> None:
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(POOL_SHAPE, generator=gen)
    before = pool.clone()
    key = torch.randn(5, 2, 16, generator=gen)  # [T, Hkv, D]
    value = torch.randn(5, 2, 16, generator=gen)
    slots = torch.tensor([3, 17, -1, 40, 8], dtype=torch.int64)
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    want_k, want_v = store_kv_reference(key, value, k_cache, v_cache, slots)
    store_kv_inplace(key, value, k_cache, v_cache, slots)
    assert torch.equal(pool[:, 1, 0], want_k) and torch.equal(pool[:, 1, 1], want_v)
    assert torch.equal(pool[:, 0], before[:, 0])  # the other layer is untouched
    assert not torch.equal(pool, before)


def test_copy_blocks_inplace_matches_reference() -> None:
    pool = torch.randn(POOL_SHAPE, generator=torch.Generator().manual_seed(1))
    src = torch.tensor([0, 2], dtype=torch.int64)
    dst = torch.tensor([4, 5], dtype=torch.int64)
    want = copy_blocks_reference(pool, src, dst)
    copy_blocks_inplace(pool, src, dst)
    assert torch.equal(pool, want)


def test_runner_copy_on_write_then_append() -> None:
    """A block copied with ``copy_blocks`` serves as context for a chunk written after it."""
    model = paged_model(tiny_family_config("llama"), seed=2)
    pool = torch.zeros(8, 2, 2, 16, 2, 16)
    runner = ModelRunner(model, pool, 16)
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(3))[0].tolist()
    runner.forward([ScheduledChunk(ids[:20], 0, [1, 2])])
    runner.copy_blocks([(2, 5)])  # the partial block 2 is shared: the child writes into 5
    logits = runner.forward([ScheduledChunk(ids[20:], 20, [1, 5])])
    full = reference_model(model)(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(logits[0], full, rtol=1e-4, atol=1e-4)
    assert torch.equal(pool[2, :, :, :4], pool[5, :, :, :4])  # copied prefix of the block


def test_runner_logits_are_last_token_of_each_request() -> None:
    model = paged_model(tiny_family_config("qwen2"), seed=4)
    ref = reference_model(model)
    runner = ModelRunner(model, torch.zeros(8, 2, 2, 16, 2, 16), 16)
    gen = torch.Generator().manual_seed(5)
    a = torch.randint(0, 256, (9,), generator=gen).tolist()
    b = torch.randint(0, 256, (20,), generator=gen).tolist()
    logits = runner.forward([ScheduledChunk(a, 0, [3]), ScheduledChunk(b, 0, [0, 6])])
    assert logits.shape == (2, 259)
    with torch.inference_mode():
        for row, ids in enumerate((a, b)):
            want = ref(torch.tensor([ids])).logits[0, -1]
            torch.testing.assert_close(logits[row], want, rtol=1e-4, atol=1e-4)


def test_bf16_tiny_runs_on_cpu() -> None:
    model, tok = load_model("tiny", "bfloat16", "cpu")
    runner = ModelRunner(model, torch.zeros(4, 2, 2, 16, 2, 16, dtype=torch.bfloat16), 16)
    ids = tok("bfloat16 path")["input_ids"]
    logits = runner.forward([ScheduledChunk(ids, 0, [2])])
    with torch.inference_mode():
        want = reference_model(model)(torch.tensor([ids])).logits[0, -1].float()
    assert (logits[0] - want).abs().max() <= 0.05 * want.abs().max()


def test_runner_rejects_bad_setups() -> None:
    model = paged_model(tiny_family_config("llama"), seed=0)
    with pytest.raises(ValueError, match="does not match"):
        ModelRunner(model, torch.zeros(4, 2, 2, 16, 4, 16), 16)
    with pytest.raises(ValueError, match=r"is torch\.float16"):
        ModelRunner(model, torch.zeros(4, 2, 2, 16, 2, 16, dtype=torch.float16), 16)
    with pytest.raises(ValueError, match="attn_implementation"):
        ModelRunner(reference_model(model), torch.zeros(4, 2, 2, 16, 2, 16), 16)
    runner = ModelRunner(model, torch.zeros(4, 2, 2, 16, 2, 16), 16)
    with pytest.raises(ValueError, match="cannot hold"):
        runner.forward([ScheduledChunk(list(range(17)), 0, [0])])
    with pytest.raises(ValueError, match="at least one token"):
        runner.forward([ScheduledChunk([], 3, [0])])
    with pytest.raises(ValueError, match="paged=PagedBatch"):
        model(torch.tensor([[1, 2, 3]]), use_cache=False)


def test_sliding_window_beyond_context_is_refused() -> None:
    config = tiny_family_config("mistral")
    config.sliding_window = 8
    model = paged_model(config, seed=0)
    runner = ModelRunner(model, torch.zeros(4, 2, 2, 16, 2, 16), 16)
    runner.forward([ScheduledChunk(list(range(8)), 0, [0])])  # within the window: fine
    with pytest.raises(NotImplementedError, match="sliding window"):
        runner.forward([ScheduledChunk(list(range(9)), 0, [1])])


def test_paged_batch_is_frozen() -> None:
    runner = ModelRunner(
        paged_model(tiny_family_config("llama"), seed=0), torch.zeros(4, 2, 2, 16, 2, 16), 16
    )
    _, paged = runner.prepare([ScheduledChunk([1, 2, 3], 16, [0, 3]), ScheduledChunk([4], 0, [2])])
    assert isinstance(paged, PagedBatch)
    assert paged.slot_mapping.tolist() == [48, 49, 50, 32]
    assert paged.block_tables.tolist() == [[0, 3], [2, 0]]
    assert paged.cu_seqlens_q.tolist() == [0, 3, 4] and paged.context_lens.tolist() == [19, 1]
    assert (paged.max_query_len, paged.max_context_len) == (3, 19)
    with pytest.raises(AttributeError):
        paged.max_query_len = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("values", "dtype"),
    [
        ([3, -1, 2**40], torch.int64),
        ([[1, 2, 3], [4, 5, 6]], torch.int32),
        ([[], []], torch.int32),
        ([], torch.int64),
        ([0.5, 2.0], torch.float32),
        ([True, False], torch.bool),
    ],
)
def test_host_tensor_equals_torch_tensor(values: list, dtype: torch.dtype) -> None:
    got = host_tensor(values, dtype)
    want = torch.tensor(values, dtype=dtype)
    assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def test_pack_lays_out_decodes_and_chunks_exactly() -> None:
    """A step's host lists: decodes (their own path) and prompt chunks, slots through the block
    tables, offsets, contexts, tables cut or zero-padded to the longest context's blocks."""
    runner = ModelRunner(
        paged_model(tiny_family_config("llama"), seed=1), torch.zeros(8, 2, 2, 4, 2, 16), 4
    )
    batch = [
        ScheduledChunk([7], 5, [3, 1, 9]),  # position 5: block 1, offset 1
        ScheduledChunk([8, 9, 10], 2, [4, 6]),  # positions 2, 3 in block 4, then 4 in 6
        ScheduledChunk([11], 0, [2, 5, 0]),  # an unused block past the context: cut
    ]
    packed = runner.pack(batch)
    assert packed.ids == [7, 8, 9, 10, 11]
    assert packed.positions == [5, 2, 3, 4, 0]
    assert packed.slots == [1 * 4 + 1, 4 * 4 + 2, 4 * 4 + 3, 6 * 4 + 0, 2 * 4 + 0]
    assert packed.cu == [0, 1, 4, 5] and packed.context_lens == [6, 5, 1]
    assert packed.width == 2  # 6 tokens need 2 blocks of 4
    assert runner.padded_table(batch, packed.width) == [[3, 1], [4, 6], [2, 5]]
    assert runner.padded_table(batch[1:2], 3) == [[4, 6, 0]]
    whole = runner.pack([ScheduledChunk(list(range(9)), 0, [5, 2, 7])])  # whole blocks, a part
    assert whole.slots == [20, 21, 22, 23, 8, 9, 10, 11, 28]
    with pytest.raises(ValueError, match="2 blocks cannot hold 9 tokens"):
        runner.pack([ScheduledChunk([1, 2], 7, [0, 1])])
    with pytest.raises(ValueError, match="at least one token"):
        runner.pack([ScheduledChunk([], 0, [0])])
