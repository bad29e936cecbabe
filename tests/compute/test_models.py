"""``load_model``: ``tiny`` and a local checkpoint directory (the ``--model DIR`` code path)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from compute.model.attention import ATTN_NAME
from compute.model.models import FAMILIES, byte_tokenizer, load_model, tiny_family_config
from contracts.model_config import kv_geometry, tiny_config
from tests.compute.driver import GreedyDriver, generate_greedy, paged_model, reference_model

TEXT = "héllo, wörld ✓ \x00\n"


def test_byte_tokenizer_ids_are_bytes() -> None:
    tok = byte_tokenizer()
    ids = tok(TEXT)["input_ids"]
    assert ids == [256, *TEXT.encode()]
    assert tok.decode(ids, skip_special_tokens=True) == TEXT
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (256, 257, 258)
    assert len(tok) == 259


def test_tiny_is_seeded_and_paged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="pagedserve.compute"):
        model, tok = load_model("tiny", "auto", "cpu")
    assert "model ready" in caplog.text
    again, _ = load_model("tiny", "float32", "cpu")
    assert model.config._attn_implementation == ATTN_NAME
    assert model.dtype == torch.float32 and not model.training
    assert kv_geometry(model.config, "float32") == kv_geometry(tiny_config(), "float32")
    for (name, p), (name2, p2) in zip(
        model.state_dict().items(), again.state_dict().items(), strict=True
    ):
        assert name == name2 and torch.equal(p, p2), name
    assert tok(TEXT)["input_ids"] == byte_tokenizer()(TEXT)["input_ids"]
    # seeding is local: loading neither resets nor consumes the global RNG
    torch.manual_seed(5)
    load_model("tiny", "float32", "cpu")
    after_load = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(after_load, torch.rand(3))


def test_tiny_greedy_matches_generate() -> None:
    model, tok = load_model("tiny", "float32", "cpu")
    prompt = tok("The quick brown fox")["input_ids"]
    driver = GreedyDriver(model)
    seq = driver.admit("r", prompt, 12)
    driver.run()
    assert seq.output == generate_greedy(reference_model(model), prompt, 12)


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_round_trip(family: str, tmp_path: Path) -> None:
    original = paged_model(tiny_family_config(family), seed=11)
    original.save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)

    model, tok = load_model(str(tmp_path), "auto", "cpu")
    assert type(model) is type(original)
    assert model.config._attn_implementation == ATTN_NAME
    assert model.dtype == torch.float32
    loaded, saved = model.state_dict(), original.state_dict()
    assert loaded.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name
    assert tok(TEXT)["input_ids"] == [256, *TEXT.encode()]
    assert tok.decode(tok(TEXT)["input_ids"], skip_special_tokens=True) == TEXT
    assert AutoTokenizer.from_pretrained(tmp_path, local_files_only=True).eos_token_id == 257

    prompt = tok("paged attention")["input_ids"]
    driver = GreedyDriver(model)
    seq = driver.admit("r", prompt, 8)
    driver.run()
    assert seq.output == generate_greedy(reference_model(original), prompt, 8)


def test_checkpoint_dtype_override(tmp_path: Path) -> None:
    paged_model(tiny_family_config("llama"), seed=3).save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    model, _ = load_model(str(tmp_path), "bfloat16", "cpu")
    assert model.dtype == torch.bfloat16


def test_missing_directory_and_bad_dtype(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_model(str(tmp_path / "absent"), "auto", "cpu")
    with pytest.raises(ValueError, match="unsupported dtype"):
        load_model("tiny", "float64", "cpu")
    with pytest.raises(ValueError, match="unknown family"):
        tiny_family_config("gpt2")


def test_auto_dtype_is_the_configs_but_half_precision_on_cuda() -> None:
    """The kvstore and the workers resolve 'auto' alike; on CUDA fp32 becomes bf16 (the Triton
    kernels take fp16/bf16 only)."""
    from contracts.model_config import resolve_dtype, tiny_config

    config = tiny_config()  # no dtype: fp32
    assert resolve_dtype(config, "auto", "cpu") == "float32"
    assert resolve_dtype(config, "auto", "cuda:0") == "bfloat16"
    assert resolve_dtype(config, "float16", "cuda") == "float16"
    config.dtype = "float16"
    assert resolve_dtype(config, "auto", "cuda") == "float16"
