"""The stack `pagedserve bench`'s tests run against (``tests/stack.py``), shared by the package, on
Redis database 3 (the gateway tests' stack, torn down before this package starts, used it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.stack import Stack, running_stack


@pytest.fixture(scope="package")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(redis_url, tmp_path_factory.mktemp("pagedserve-stack"), 3) as running:
        yield running
