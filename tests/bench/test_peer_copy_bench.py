"""``bench/peer_copy.py``'s CPU-tier table on two ``/dev/shm`` pools: the loads it times are
checked byte for byte inside it, and it prints a row per size."""

from __future__ import annotations

import pytest

from bench.peer_copy import cpu_tier_loads
from contracts.model_config import KVGeometry
from kvstore.device import DevicePools
from kvstore.peer_copy import PeerCopier


def test_the_cpu_tier_table_loads_every_size_byte_exact(capsys: pytest.CaptureFixture[str]) -> None:
    pools = [DevicePools(KVGeometry(2, 2, 16, "bfloat16"), 16, 64, 16, "cpu") for _ in range(2)]
    try:
        cpu_tier_loads(PeerCopier(pools), [1, 4, 16], 64)
    finally:
        for pool in pools:
            pool.close()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows[1:]] == ["| 1", "| 4", "| 16"]
