"""``bench/tensor_parallel.py``'s server names: how many worker groups of how many ranks."""

from __future__ import annotations

import pytest

from bench.tensor_parallel import server_shape


@pytest.mark.parametrize(
    ("run", "shape"),
    [("tp1", (1, 1)), ("tp2", (1, 2)), ("tp2-nccl", (1, 2)), ("tp4", (1, 4)), ("dp2xtp2", (2, 2))],
)
def test_a_server_name_gives_its_groups_and_ranks(run: str, shape: tuple[int, int]) -> None:
    assert server_shape(run) == shape


@pytest.mark.parametrize("run", ["tp", "dp2", "tp2x", "dp2xtp2-nccl-x", "two"])
def test_an_unknown_server_name_is_one_clear_line(run: str) -> None:
    with pytest.raises(SystemExit, match="unknown server"):
        server_shape(run)
