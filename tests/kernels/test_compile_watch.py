"""CompileWatch: Triton's compile hooks set, chained and restored (CPU), and a real variant built
on the GPU counted and logged once."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import triton.language as tl
from triton import knobs

from kernels._tl_utils import jit
from kernels.compile_watch import CompileWatch


@pytest.fixture
def clean_hooks() -> Any:
    """No compile hook before the test, none left after it."""
    runtime = knobs.runtime
    saved = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
    runtime.jit_cache_hook = runtime.jit_post_compile_hook = None
    yield runtime
    runtime.jit_cache_hook, runtime.jit_post_compile_hook = saved


def test_hooks_chain_a_foreign_hook_and_are_restored(clean_hooks, caplog) -> None:
    calls: list[str] = []

    def foreign_before(**kwargs: Any) -> bool:
        calls.append(f"before {kwargs['key']}")
        return False

    def foreign_after(**kwargs: Any) -> None:
        calls.append(f"after {kwargs['key']}")

    clean_hooks.jit_cache_hook, clean_hooks.jit_post_compile_hook = foreign_before, foreign_after
    seen: list[tuple[str, float]] = []
    watch = CompileWatch(lambda name, seconds: seen.append((name, seconds)))
    assert watch.install()
    assert clean_hooks.jit_cache_hook == watch._before
    fn = type("Info", (), {"name": "_some_kernel"})()
    # what Triton passes around one build (keyword arguments only)
    with caplog.at_level(logging.WARNING, logger="pagedserve.kernels"):
        assert not clean_hooks.jit_cache_hook(key="k1", repr="_some_kernel(x: i32)", fn=fn)
        clean_hooks.jit_post_compile_hook(key="k1", repr="_some_kernel(x: i32)", fn=fn)
    assert calls == ["before k1", "after k1"]
    assert watch.count == 1 and len(seen) == 1 and seen[0][0] == "_some_kernel"
    assert watch.seconds == seen[0][1] >= 0.0
    assert "_some_kernel" in caplog.text and "_some_kernel(x: i32)" in caplog.text
    watch.uninstall()
    assert clean_hooks.jit_cache_hook is foreign_before
    assert clean_hooks.jit_post_compile_hook is foreign_after


def test_a_later_watch_replaces_an_earlier_one(clean_hooks) -> None:
    first, second = CompileWatch(), CompileWatch()
    first.install()
    second.install()  # not chained: one build counts once
    fn = type("Info", (), {"name": "k"})()
    clean_hooks.jit_cache_hook(key=1, fn=fn)
    clean_hooks.jit_post_compile_hook(key=1, fn=fn)
    assert (first.count, second.count) == (0, 1)
    second.uninstall()
    assert clean_hooks.jit_cache_hook is None and clean_hooks.jit_post_compile_hook is None
    first.uninstall()  # its hooks were replaced: nothing of it to restore
    assert clean_hooks.jit_cache_hook is None


def test_a_skipping_foreign_hook_is_obeyed(clean_hooks) -> None:
    """A chained pre-hook that returns True makes Triton skip the build: the watch passes it on."""
    clean_hooks.jit_cache_hook = lambda **kwargs: True
    watch = CompileWatch()
    watch.install()
    assert clean_hooks.jit_cache_hook(key="k", fn=None) is True
    watch.uninstall()


@jit
def _fill(out_ptr: tl.tensor, VALUE: tl.constexpr) -> None:
    tl.store(out_ptr + tl.arange(0, 16), tl.full([16], VALUE, tl.float32))


@pytest.mark.gpu
def test_a_real_variant_is_counted_once(clean_hooks, cuda, caplog) -> None:
    out = torch.zeros(16, device=cuda)
    _fill[(1,)](out, VALUE=1)  # built before the watch: not counted
    watch = CompileWatch()
    watch.install()
    with caplog.at_level(logging.WARNING, logger="pagedserve.kernels"):
        _fill[(1,)](out, VALUE=1)
        assert watch.count == 0
        _fill[(1,)](out, VALUE=7)  # a new constexpr: a new variant
        _fill[(1,)](out, VALUE=7)
    watch.uninstall()
    assert watch.count == 1 and watch.seconds > 0.0
    assert "_fill" in caplog.text
    assert out.eq(7).all()
