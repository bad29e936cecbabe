"""Fused RMSNorm and attention forwards (``compute.model.fused``): the same logits as transformers.

On this CPU the fused kernels run in Triton's interpreter (fp32), so every family's rewritten
attention forward (biases, Qwen3's q/k norms) is checked here; the GPU runs them in bf16.
"""

from __future__ import annotations

import pytest
import torch

from compute.model.fused import fuse_layers
from compute.model.models import FAMILIES, tiny_family_config
from compute.model.runner import ModelRunner, ScheduledChunk
from tests.compute.driver import paged_model, reference_model


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_forward_gives_transformers_logits(family: str) -> None:
    model = paged_model(tiny_family_config(family), seed=11)
    ref = reference_model(model)  # transformers' own forwards, before fusing
    state = {k: v.clone() for k, v in model.state_dict().items()}
    fused = fuse_layers(model)
    layers = 2
    assert fused.attentions == fused.mlps == fused.layers == layers
    assert all("forward" in vars(layer) for layer in model.model.layers)  # adds in the products
    assert fused.norms == 2 * layers + 1 + (2 * layers if family == "qwen3" else 0)
    assert "forward" in vars(model.model.norm) and "forward" not in vars(ref.model.norm)
    after = model.state_dict()  # the projections are views of the merged weights now
    assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.qkv_weight.data_ptr()
    runner = ModelRunner(model, torch.zeros(8, 2, 2, 16, 2, 16), 16)
    gen = torch.Generator().manual_seed(12)
    a = torch.randint(0, 256, (9,), generator=gen).tolist()
    b = torch.randint(0, 256, (20,), generator=gen).tolist()
    prefill = runner.forward([ScheduledChunk(a, 0, [3]), ScheduledChunk(b, 0, [1, 6])])
    decode = runner.forward([ScheduledChunk([7], 9, [3]), ScheduledChunk([8], 20, [1, 6])])
    with torch.inference_mode():
        for row, ids in enumerate((a, b)):
            want = ref(torch.tensor([ids])).logits[0, -1]
            torch.testing.assert_close(prefill[row], want, rtol=1e-4, atol=1e-4)
            want = ref(torch.tensor([[*ids, 7 + row]])).logits[0, -1]
            torch.testing.assert_close(decode[row], want, rtol=1e-4, atol=1e-4)
