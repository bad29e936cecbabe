"""Fused forwards for the decoder layers of the supported families (``fuse_layers``).

transformers runs a layer's small ops one torch kernel at a time: an RMSNorm is seven kernels,
the rotary embedding of q and k ten, the gated MLP's activation two, q/k/v and gate/up are
separate matrix products, and attention's inputs are copied to a token-major layout. At decode
batch sizes each of those kernels is tiny, and together they took a third of a 1B-shaped decode
step on the H200 (BENCHMARKS-archive.md). ``fuse_layers`` rebinds, on each instance only (the
library's classes and functions are left alone, so a reference model in the same process stays
transformers' own):

- every RMSNorm module's ``forward`` to ``kernels.rms_norm`` (one kernel);
- every attention module's ``forward`` to ``attention_forward``: one q/k/v product (biases
  included), Qwen3's per-head q/k norms, ``kernels.rotary_store`` (q and k rotated, q written
  token-major, k and v stored in the pool: one kernel), then the paged attention directly;
- every gated SiLU MLP's ``forward`` to ``mlp_forward``: one gate/up product, then
  ``kernels.silu_mul``;
- every decoder layer whose attention and MLP were both rebound to ``decoder_layer_forward``:
  the two residual adds go into the o and down products (``addmm_`` into the layer's input:
  cuBLAS adds the product to it in the same kernel), two kernels fewer per layer.

The merged products read one weight made by stacking the separate ones; each original
``Linear`` keeps a view of its rows, so nothing is stored twice and the state dict is unchanged.
The worker fuses on CUDA for fp16/bf16 models (``compute.model.models.load_model``). The kernels
also run on the CPU under TRITON_INTERPRET=1, which is how the tests compare fused and unfused
models.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional

from compute.model.attention import attend as attend_paged
from compute.model.attention import paged_layer

__all__ = [
    "Fused",
    "attention_forward",
    "decoder_layer_forward",
    "fuse_layers",
    "mlp_forward",
    "rms_norm_forward",
]

FUSED_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
FUSED_ATTENTIONS = ("LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention")
FUSED_MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP")
FUSED_LAYERS = (
    "LlamaDecoderLayer",
    "MistralDecoderLayer",
    "Qwen2DecoderLayer",
    "Qwen3DecoderLayer",
)


@dataclass(frozen=True)
class Fused:
    """How many modules ``fuse_layers`` rebound, per kind."""

    norms: int
    attentions: int
    mlps: int
    layers: int


# ``self`` below is the transformers module the function is bound to (typed Any: its attributes
# are the family's).
def rms_norm_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """The Llama-family RMSNorm (``weight * x * rsqrt(mean(x^2) + eps)``) as one kernel."""
    from kernels import rms_norm

    return rms_norm(hidden_states.contiguous(), self.weight, float(self.variance_epsilon))


def attention_forward(
    self: Any,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None = None,
    past_key_values: object = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A Llama/Mistral/Qwen2/Qwen3 attention module's forward over the paged pool. hidden_states:
    [1, T, hidden]; position_embeddings: (cos, sin), each [1, T, head_dim]; ``kwargs`` carry
    ``paged`` (``compute.model.attention.PagedBatch``)."""
    out = attend(
        self, hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs
    )
    return self.o_proj(out), None


def attend(
    self: Any,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    past_key_values: object,
    **kwargs: Any,
) -> torch.Tensor:
    """``attention_forward`` up to the o product: [1, T, heads * head_dim]. The rotary
    embedding and the K/V store are one kernel (``kernels.rotary_store``); ``kwargs`` carry the
    step's ``paged`` batch."""
    from kernels import rotary_store

    if past_key_values is not None:
        raise ValueError("the paged forward keeps K/V in the pool, not in past_key_values")
    window = getattr(self, "sliding_window", getattr(self.config, "sliding_window", None))
    paged = kwargs.get("paged")
    layer = paged_layer(self, attention_mask, paged, window, None)
    assert paged is not None  # paged_layer refuses None
    tokens, head_dim = hidden_states.shape[1], self.head_dim
    qkv = functional.linear(hidden_states[0], self.qkv_weight, self.qkv_bias)
    q_size, kv_size = self.q_proj.out_features, self.k_proj.out_features
    q = qkv[:, :q_size].view(tokens, -1, head_dim)  # [T, heads, D], token stride q+2kv
    k = qkv[:, q_size : q_size + kv_size].view(tokens, -1, head_dim)
    v = qkv[:, q_size + kv_size :].view(tokens, -1, head_dim)
    if hasattr(self, "q_norm"):  # Qwen3: an RMSNorm per head before the rotary embedding
        q, k = self.q_norm(q), self.k_norm(k)
    cos, sin = position_embeddings
    k_cache, v_cache = paged.pool[:, layer, 0], paged.pool[:, layer, 1]
    q = rotary_store(q, k, v, cos[0].contiguous(), sin[0].contiguous(), k_cache, v_cache,
                     paged.slot_mapping)  # fmt: skip
    out = attend_paged(q, layer, paged, self.scaling)  # [T, heads, D]
    return out.view(*hidden_states.shape[:-1], -1)


def mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) with gate and up as one product and one activation kernel."""
    return self.down_proj(gated(self, x))


def gated(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``mlp_forward`` up to the down product: silu(gate(x)) * up(x)."""
    from kernels import silu_mul

    gate_up = functional.linear(x, self.gate_up_weight, self.gate_up_bias)
    act = silu_mul(gate_up.reshape(-1, gate_up.shape[-1]))
    return act.view(*gate_up.shape[:-1], -1)


def decoder_layer_forward(
    self: Any,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    past_key_values: object = None,
    use_cache: bool | None = False,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """transformers' pre-norm decoder layer with its attention and MLP rebound (above), the
    residual adds done by the o and down products. Mutates ``hidden_states`` (the layer's
    input, which nothing reads after the layer: the paged forward collects no hidden states)
    and returns it."""
    assert position_embeddings is not None, "the decoder passes the rotary embedding"
    attention, mlp = self.self_attn, self.mlp
    normed = self.input_layernorm(hidden_states)
    out = attend(attention, normed, position_embeddings, attention_mask, past_key_values, **kwargs)
    hidden = add_product(hidden_states, out, attention.o_proj)
    return add_product(hidden, gated(mlp, self.post_attention_layernorm(hidden)), mlp.down_proj)


def add_product(residual: torch.Tensor, x: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor:
    """residual + linear(x): in place, in the product's kernel, where it can be (a plain
    ``Linear`` without bias, a contiguous residual); else out of place."""
    plain = type(linear) is torch.nn.Linear and linear.bias is None
    if not plain or not residual.is_contiguous():
        return residual + linear(x)
    flat = residual.view(-1, residual.shape[-1])
    flat.addmm_(x.reshape(-1, x.shape[-1]), linear.weight.t())
    return residual


def fuse_layers(model: torch.nn.Module) -> Fused:
    """Rebinds the forwards of ``model``'s RMSNorm, attention and gated-MLP modules (classes
    named in ``FUSED_NORMS`` / ``FUSED_ATTENTIONS`` / ``FUSED_MLPS``), then of the decoder
    layers (``FUSED_LAYERS``) whose attention and MLP both were; call it once the model is on
    its device. Mutates those module instances only: their ``forward``, merged weights
    (``qkv_weight``, ``gate_up_weight`` and biases) and their projections' parameters, which
    become views of the merged ones. Modules whose projections mix biased and unbiased ones, or
    an MLP whose activation is not SiLU, keep transformers' forward."""
    norms = attentions = mlps = 0
    for module in model.modules():
        name = type(module).__name__
        if name in FUSED_NORMS:
            module.forward = types.MethodType(rms_norm_forward, module)
            norms += 1
        elif name in FUSED_ATTENTIONS and _merge(module, "qkv", ("q_proj", "k_proj", "v_proj")):
            module.forward = types.MethodType(attention_forward, module)
            attentions += 1
        elif (
            name in FUSED_MLPS
            and getattr(module.config, "hidden_act", None) in ("silu", "swish")
            and _merge(module, "gate_up", ("gate_proj", "up_proj"))
        ):
            module.forward = types.MethodType(mlp_forward, module)
            mlps += 1
    layers = 0
    for module in model.modules():
        if type(module).__name__ in FUSED_LAYERS and _rebound(module):
            module.forward = types.MethodType(decoder_layer_forward, module)
            layers += 1
    return Fused(norms, attentions, mlps, layers)


def _rebound(layer: torch.nn.Module) -> bool:
    """The layer's attention and MLP run the forwards above, and nothing is hooked on them."""
    parts = [getattr(layer, "self_attn", None), getattr(layer, "mlp", None)]
    wanted = (attention_forward, mlp_forward)
    return all(
        isinstance(part, torch.nn.Module)
        and getattr(vars(part).get("forward"), "__func__", None) is function
        and not (part._forward_hooks or part._forward_pre_hooks)
        for part, function in zip(parts, wanted, strict=True)
    )


def _merge(module: torch.nn.Module, merged: str, names: tuple[str, ...]) -> bool:
    """Sets ``module.<merged>_weight`` / ``_bias`` to the rows of the ``names`` linears stacked,
    and makes each linear's parameters views of them. False (nothing changed) if the linears
    do not all have a bias or all lack one."""
    linears = [getattr(module, n) for n in names]
    has_bias = {lin.bias is not None for lin in linears}
    if len(has_bias) != 1:
        return False
    with torch.no_grad():
        weight = torch.cat([lin.weight for lin in linears])
        bias = torch.cat([lin.bias for lin in linears]) if has_bias == {True} else None
    row = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = torch.nn.Parameter(weight[row : row + rows], requires_grad=False)
        if bias is not None:
            lin.bias = torch.nn.Parameter(bias[row : row + rows], requires_grad=False)
        row += rows
    setattr(module, f"{merged}_weight", weight)
    setattr(module, f"{merged}_bias", bias)
    return True
