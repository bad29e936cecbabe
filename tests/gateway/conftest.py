"""The gateway tests' stack (``tests/stack.py``): real Redis, `pagedserve kvstore`, one
`pagedserve compute` worker and `pagedserve gateway`, shared by the package, on Redis database 3."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.stack import Stack, running_stack


@pytest.fixture(scope="package")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(redis_url, tmp_path_factory.mktemp("gateway-stack"), 3) as running:
        yield running
