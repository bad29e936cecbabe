"""``bench/redis_cost.py`` on a real local redis-server: one row per K, Redis's own positive
microseconds for the publish EVAL and the XREAD."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def test_the_table_has_a_row_per_stream_count() -> None:
    done = subprocess.run(
        [sys.executable, "bench/redis_cost.py", "--streams", "4,8", "--calls", "20"],
        capture_output=True, text=True, timeout=120, cwd=ROOT, check=True,
    )  # fmt: skip
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines()[2:]]
    assert [int(row[0]) for row in rows] == [4, 8]
    assert all(float(cell) > 0 for row in rows for cell in row[1:])
