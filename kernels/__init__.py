"""Triton kernels of PagedAttention: paged decode / prefill attention and KV-cache writes.

Pure-torch references live in ``kernels.reference``. The Triton launchers are imported lazily
(PEP 562), so ``import kernels.reference`` never imports triton.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAUNCHERS = {
    "store_kv": "kernels.cache_ops",
    "copy_blocks": "kernels.cache_ops",
    "copy_blocks_between": "kernels.cache_ops",
    "paged_decode": "kernels.decode",
    "choose_num_splits": "kernels.decode",
    "compile_variants": "kernels.decode",
    "paged_prefill": "kernels.prefill",
    "prefill_tile_tokens": "kernels.prefill",
    "prefill_tiles": "kernels.prefill",
    "rms_norm": "kernels.layer_ops",
    "rotary_store": "kernels.layer_ops",
    "silu_mul": "kernels.layer_ops",
}

__all__ = [
    "choose_num_splits",
    "compile_variants",
    "copy_blocks",
    "copy_blocks_between",
    "paged_decode",
    "paged_prefill",
    "prefill_tile_tokens",
    "prefill_tiles",
    "rms_norm",
    "rotary_store",
    "silu_mul",
    "store_kv",
]


def __getattr__(name: str) -> Any:
    if name in _LAUNCHERS:
        return getattr(importlib.import_module(_LAUNCHERS[name]), name)
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")
