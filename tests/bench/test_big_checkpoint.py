"""``bench/big_checkpoint.py``: a checkpoint written tensor by tensor over two directories (the
second's files linked into the first) loads through the real loading code, whole with transformers
and as the shards of ``compute.parallel.sharding``, to the same logits; a run cut short writes
only what is missing."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from bench.big_checkpoint import INDEX, write_checkpoint
from bench.shapes import llama_config
from compute.parallel.layers import TPGroup
from compute.parallel.sharding import load_sharded


def test_a_checkpoint_spread_over_two_directories_loads_whole_and_sharded(tmp_path: Path) -> None:
    config = llama_config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          vocab_size=128256, max_position_embeddings=256)  # fmt: skip
    home, spill = tmp_path / "home", tmp_path / "spill"
    file_bytes = 10_000_000  # the embedding, the layers and the LM head (16 MB): a file each
    written: list[Path] = []

    def room(directory: Path) -> int:  # the first directory holds one file
        if directory == home and len(written) >= 1:
            return 0
        written.append(directory)
        return 1 << 40

    torch.manual_seed(0)
    assert write_checkpoint(config, [home, spill], "cpu", file_bytes, room) == home
    files = set(json.loads((home / INDEX).read_text())["weight_map"].values())
    assert len(files) == 3 and all((home / f).exists() for f in files)
    assert sorted(p.name for p in spill.iterdir()) == sorted(
        f for f in files if (home / f).is_symlink()
    )
    assert sum((home / f).is_symlink() for f in files) == 2
    whole = AutoModelForCausalLM.from_pretrained(home, dtype=torch.float32).eval()
    norms = [t for n, t in whole.state_dict().items() if n.endswith("norm.weight")]
    assert all(torch.equal(t, torch.ones_like(t)) for t in norms)
    weight = whole.model.layers[0].mlp.up_proj.weight
    assert 0.015 < float(weight.std()) < 0.025  # initializer_range 0.02
    shard = load_sharded(home, TPGroup(0, 1), torch.float32, "cpu", "eager")
    ids = torch.tensor([[1, 5, 900, 128000]])
    with torch.no_grad():
        torch.testing.assert_close(shard(ids).logits, whole(ids).logits)
    # a run cut short: only the file missing is written again
    kept = {f: (home / f).stat().st_mtime_ns for f in sorted(files)[:2]}
    lost = sorted(files)[2]
    (home / lost).unlink()
    assert write_checkpoint(config, [home, spill], "cpu", file_bytes, room) == home
    assert (home / lost).exists() and not list(home.glob("*.partial"))
    assert {f: (home / f).stat().st_mtime_ns for f in kept} == kept
