"""Reversible blocks in a model nobody here wrote for them: a pre-norm transformer.

f is the attention sublayer and g the MLP sublayer, on halves of the feature dimension (as in
the Reformer and reversible vision transformers), with dropout in both.
"""

import pytest
import torch
from torch import nn

import revnets
from revnets.memory import measure_memory

from conftest import max_grad_error, rel_error, twin


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attention = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=x.dtype)
        out, _ = self.attention(h, h, h, attn_mask=mask, need_weights=False, is_causal=True)
        return self.dropout(out)


def mlp(dim: int, dropout: float) -> nn.Module:
    return nn.Sequential(
        nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(dropout),
        nn.Linear(4 * dim, dim), nn.Dropout(dropout),
    )


def transformer(depth: int, dim: int = 8, dropout: float = 0.0, **kwargs) -> nn.Module:
    """Token embeddings of width 2 * dim in, 2 * dim out; f and g each see one half."""
    return revnets.ReversibleSequence(
        (
            revnets.ReversibleBlock(Attention(dim, 2, dropout), mlp(dim, dropout), split_dim=-1)
            for _ in range(depth)
        ),
        **kwargs,
    )


def step(model: nn.Module, x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    out = model(x)
    out.square().mean().backward()
    return out


@pytest.mark.parametrize("store_last_blocks", [0, 1])
@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_float64_gradients_equal_ordinary_backprop(dropout, store_last_blocks):
    """With dropout, equality also needs the attention and MLP masks replayed exactly."""
    model = transformer(4, dropout=dropout, memory=revnets.Reconstruct(store_last_blocks)).double()
    plain = twin(model)
    x = torch.randn(3, 6, 16, dtype=torch.float64, requires_grad=True)
    x_plain = x.detach().clone().requires_grad_()
    out, out_plain = step(model, x), step(plain, x_plain)
    assert out.grad_fn.name() == "ReversibleFunctionBackward"
    assert torch.equal(out, out_plain)
    assert rel_error(x.grad, x_plain.grad) <= 1e-10
    assert max_grad_error(model, plain) <= 1e-10


def test_bfloat16_autocast_matches_ordinary_autocast():
    model = transformer(4)
    plain = twin(model)
    x = torch.randn(3, 6, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, out_plain = step(model, x), step(plain, x)
    assert out.dtype == out_plain.dtype
    assert torch.equal(out, out_plain)
    # Both ran the same bfloat16 kernels; only the reconstruction's round-off tells them apart
    # (float32 here: bfloat16 outputs of f and g added to float32 halves).
    assert max_grad_error(model, plain) <= 1e-4


def test_activation_memory_flat_in_depth():
    def peak(depth: int) -> int:
        model = transformer(depth, dim=32)
        x = torch.randn(4, 64, 64, requires_grad=True)
        return measure_memory(step, model, x).above_model_state_bytes

    def ordinary_peak(depth: int) -> int:
        model = transformer(depth, dim=32, memory=revnets.Store())
        x = torch.randn(4, 64, 64, requires_grad=True)
        return measure_memory(step, model, x).above_model_state_bytes

    assert peak(12) == peak(3)
    assert ordinary_peak(12) > 3 * peak(12)


def test_eval_mode_runs_the_plain_forward():
    model = transformer(2, dropout=0.5).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        out = model(x)
        assert torch.allclose(model.inverse(out), x, atol=1e-5)
