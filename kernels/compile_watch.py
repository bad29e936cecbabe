"""Triton compiles after start-up, logged and timed: ``CompileWatch``.

Triton builds a kernel variant the first time a process launches the kernel with a new
specialization: new constexprs, an integer argument of a new class (1, a multiple of 16, other)
or a pointer of a new alignment (16 bytes or not). From Triton's on-disk cache that takes
milliseconds; without it (a fresh machine, a new Triton or kernel version) 0.3 s to seconds,
and the launching thread, the engine's loop, stalls every request meanwhile. A worker compiles
every variant it can foresee before it takes traffic (``compute.model.runner``); a variant it missed
shows here: one WARNING per variant, with its kernel, its specialization and how long it took,
and running totals the step timeline reports (the ``compile`` phase).

The hooks are Triton's process-wide ``knobs.runtime.jit_cache_hook`` (before a variant is built)
and ``jit_post_compile_hook`` (after). Hooks set by others are chained; a later ``CompileWatch``
replaces an earlier one rather than chaining it (each compile counts once).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

__all__ = ["CompileWatch"]

log = logging.getLogger("pagedserve.kernels")

Hook = Callable[..., Any]


class CompileWatch:
    """Times every Triton kernel variant this process builds from ``install()`` on; calls
    ``on_compile(kernel name, seconds)`` after each (in the thread that launched it)."""

    def __init__(self, on_compile: Callable[[str, float], None] | None = None) -> None:
        self.count = 0  # variants built since install(), a counter
        self.seconds = 0.0  # their build time, a counter
        self._on_compile = on_compile
        self._started: dict[Any, float] = {}  # variant key -> perf_counter at its pre-hook
        self._previous: tuple[Hook | None, Hook | None] = (None, None)
        self._installed = False

    def install(self) -> bool:
        """Sets the hooks; False where this Triton has no ``knobs`` (before 3.4)."""
        try:
            from triton import knobs
        except ImportError:
            return False
        runtime = knobs.runtime
        before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook
        self._previous = (_foreign(before), _foreign(after))
        runtime.jit_cache_hook = self._before
        runtime.jit_post_compile_hook = self._after
        self._installed = True
        return True

    def uninstall(self) -> None:
        """Restores the hooks it chained, if its own are still set."""
        if not self._installed:
            return
        from triton import knobs

        runtime = knobs.runtime
        if runtime.jit_cache_hook == self._before:
            runtime.jit_cache_hook = self._previous[0]
        if runtime.jit_post_compile_hook == self._after:
            runtime.jit_post_compile_hook = self._previous[1]
        self._installed = False

    def _before(self, **kwargs: Any) -> bool | None:
        """Triton's pre-compile hook: True from a chained hook skips the build."""
        previous = self._previous[0]
        skip = previous(**kwargs) if previous is not None else None
        if not skip:
            self._started[kwargs["key"]] = time.perf_counter()
        return skip

    def _after(self, **kwargs: Any) -> bool | None:
        now = time.perf_counter()
        seconds = now - self._started.pop(kwargs["key"], now)
        name = str(getattr(kwargs.get("fn"), "name", "?"))
        self.count += 1
        self.seconds += seconds
        log.warning(
            "Triton built a variant of %s after start-up in %.3f s (a stall of every running "
            "request; milliseconds when Triton's disk cache has it): %s",
            name,
            seconds,
            kwargs.get("repr", ""),
        )
        if self._on_compile is not None:
            self._on_compile(name, seconds)
        previous = self._previous[1]
        return previous(**kwargs) if previous is not None else None


def _foreign(hook: Hook | None) -> Hook | None:
    """``hook`` unless it is another ``CompileWatch``'s (replaced, not chained)."""
    return None if isinstance(getattr(hook, "__self__", None), CompileWatch) else hook
