"""A transformers causal LM split over a tensor-parallel group, each rank loading only its slices
of the checkpoint's safetensors files.

``load_sharded`` builds the model on the meta device (no memory), replaces its projections,
embedding and LM head with the layers of ``compute.parallel.layers`` (``shard_model``), then
reads every parameter from the checkpoint: a parallel layer's slice (``get_slice``: only those
bytes are read), anything else whole (norms, Qwen3's per-head q/k norms). Per decoder layer:

- q, k, v: column parallel by heads (a rank's heads; KV heads fewer than ranks are replicated);
- o: row parallel, one all-reduce;
- gate, up: column parallel; down: row parallel, one all-reduce;

so a rank's attention runs on its heads only, unchanged (transformers infers the head count from
the projections' width). The families: Llama, Mistral, Qwen2 (q/k/v biases) and Qwen3.
"""

from __future__ import annotations

import json
import logging
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from compute.parallel.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    TensorSlice,
    TPGroup,
    VocabParallelEmbedding,
    even_slice,
    head_rows,
)

__all__ = ["SHARDED_FAMILIES", "checkpoint_dir", "load_sharded", "shard_model"]

log = logging.getLogger("pagedserve.compute")
SHARDED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def shard_model(model: PreTrainedModel, group: TPGroup, **factory: Any) -> None:
    """Replaces ``model``'s projections, embedding and LM head with this rank's parallel layers
    (empty, allocated with ``factory``: ``device``, ``dtype``); the rest is left as it is."""
    config = model.config
    if config.model_type not in SHARDED_FAMILIES:
        raise ValueError(
            f"tensor parallelism supports {', '.join(SHARDED_FAMILIES)}, not {config.model_type}"
        )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q_rows = head_rows(config.num_attention_heads, head_dim, group)
    kv_rows = head_rows(config.num_key_value_heads, head_dim, group)
    hidden = config.hidden_size
    mlp_rows = even_slice(config.intermediate_size, 0, group)

    def column(full: nn.Linear, rows: TensorSlice) -> ColumnParallelLinear:
        return ColumnParallelLinear(hidden, rows, full.bias is not None, group, **factory)

    def row(full: nn.Linear) -> RowParallelLinear:
        bias = full.bias is not None
        return RowParallelLinear(full.in_features, full.out_features, bias, group, **factory)

    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.q_proj = column(attn.q_proj, q_rows)
        attn.k_proj = column(attn.k_proj, kv_rows)
        attn.v_proj = column(attn.v_proj, kv_rows)
        attn.o_proj = row(attn.o_proj)
        attn.num_key_value_groups = (q_rows.stop - q_rows.start) // (kv_rows.stop - kv_rows.start)
        mlp.gate_proj = column(mlp.gate_proj, mlp_rows)
        mlp.up_proj = column(mlp.up_proj, mlp_rows)
        mlp.down_proj = row(mlp.down_proj)
    embed = VocabParallelEmbedding(config.vocab_size, hidden, group, **factory)
    model.model.embed_tokens = embed
    tied = embed.weight if config.tie_word_embeddings else None
    model.lm_head = ParallelLMHead(config.vocab_size, hidden, group, tied, **factory)


def load_sharded(
    path: Path, group: TPGroup, dtype: torch.dtype, device: str, attn_implementation: str
) -> PreTrainedModel:
    """This rank's part of the checkpoint at ``path`` (safetensors), in eval mode on ``device``."""
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attn_implementation
        )
    shard_model(model, group, device=device, dtype=dtype)
    files = checkpoint_files(path)
    read = 0
    with ExitStack() as stack, torch.no_grad():
        handles = {f: stack.enter_context(safe_open(path / f, "pt")) for f in set(files.values())}
        done: set[int] = set()
        for module_name, module in model.named_modules():
            for name, param in list(module.named_parameters(recurse=False)):
                if id(param) in done:  # tied: the embedding's, read already
                    continue
                full = f"{module_name}.{name}" if module_name else name
                if full not in files:
                    raise KeyError(f"{path}: no tensor {full!r} in the checkpoint")
                cut = module.slice_of(name) if hasattr(module, "slice_of") else None
                tensor = read_slice(handles[files[full]].get_slice(full), cut)
                read += tensor.numel() * tensor.element_size()
                if param.is_meta:
                    setattr(module, name, nn.Parameter(tensor.to(device, dtype), False))
                else:
                    param.copy_(tensor)
                done.add(id(getattr(module, name)))
    with torch.device(device):  # its inverse frequencies: a buffer computed, not stored
        model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"tensors not loaded on rank {group.rank}: {left[:5]}")
    log.info("rank %d of %d: read %.1f MiB of %s", group.rank, group.size, read / 2**20, path)
    return model.eval()


def checkpoint_dir(model: str) -> Path:
    """The checkpoint directory of ``--model`` (``contracts.checkpoints.resolve_model``);
    ValueError, in one line, for a model without one (``tiny``)."""
    from contracts.checkpoints import resolve_model

    path = Path(resolve_model(model))
    if not path.is_dir():
        raise ValueError(
            f"tensor parallelism loads a safetensors checkpoint directory; {model!r} is none"
        )
    return path


def checkpoint_files(path: Path) -> dict[str, str]:
    """Tensor name -> the safetensors file (in ``path``) that holds it."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return weight_map
    single = path / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{path}: no safetensors checkpoint (tensor parallelism reads it)")
    with safe_open(single, "pt") as handle:
        return dict.fromkeys(handle.keys(), single.name)


def read_slice(tensor: Any, cut: TensorSlice | None) -> torch.Tensor:
    """``cut`` of a safetensors slice (the whole tensor if None), padded with zero rows."""
    if cut is None:
        return tensor[:]
    rows = slice(cut.start, cut.stop)
    part: torch.Tensor = tensor[rows] if cut.dim == 0 else tensor[:, rows]
    if cut.pad:
        part = torch.cat([part, part.new_zeros((cut.pad, *part.shape[1:]))])
    return part
