"""Core modules at real sizes: RoPE against Meta's reference formulation, and meta-device builds that cost nothing."""
import resource

import torch

from torchtune_lit.models.llama3_1 import llama3_1_70b
from torchtune_lit.modules import Llama3ScaledRoPE, RotaryPositionalEmbeddings

def meta_reference_rope(x: torch.Tensor, base: float, freqs: torch.Tensor | None = None) -> torch.Tensor:
    """RoPE as Meta's llama/model.py computes it, in its precision (fp32 angles, complex64): freqs_cis =
    polar(1, outer(t, freqs)) times the interleaved pairs viewed as complex numbers. x: [batch, seq, heads, head_dim]."""
    b, s, h, d = x.shape
    if freqs is None:
        freqs = 1.0 / (base ** (torch.arange(0, d, 2)[: d // 2].float() / d))
    angles = torch.outer(torch.arange(s, dtype=torch.float32), freqs.float())
    freqs_cis = torch.polar(torch.ones_like(angles), angles)
    xc = torch.view_as_complex(x.float().reshape(b, s, h, d // 2, 2))
    return torch.view_as_real(xc * freqs_cis[None, :, None, :]).flatten(3)


def test_rope_matches_meta_reference_at_llama3_size():
    torch.manual_seed(0)
    x = torch.randn(2, 2048, 4, 128)
    rope = RotaryPositionalEmbeddings(dim=128, max_seq_len=2048, base=500_000)
    torch.testing.assert_close(rope(x), meta_reference_rope(x, 500_000), atol=1e-5, rtol=1e-5)


def test_rope_with_positions_matches_reference_rows():
    torch.manual_seed(1)
    x = torch.randn(1, 2048, 2, 64)
    rope = RotaryPositionalEmbeddings(dim=64, max_seq_len=4096, base=10_000)
    positions = torch.arange(1000, 1016)[None]                   # decoding far into a sequence
    reference = meta_reference_rope(torch.cat([torch.zeros(1, 1000, 2, 64), x[:, :16]], dim=1), 10_000)[:, 1000:]
    torch.testing.assert_close(rope(x[:, :16], input_pos=positions), reference, atol=1e-5, rtol=1e-5)


def test_scaled_rope_matches_meta_reference_with_scaled_frequencies():
    "Llama 3.1's reference applies the same complex product with apply_scaling(freqs); ours must agree."
    torch.manual_seed(2)
    x = torch.randn(1, 512, 2, 128)
    rope = Llama3ScaledRoPE(dim=128, max_seq_len=512, base=500_000, scale_factor=8.0)
    torch.testing.assert_close(rope(x), meta_reference_rope(x, 500_000, freqs=rope.theta), atol=1e-5, rtol=1e-5)


def test_building_a_70b_model_on_meta_costs_no_memory():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss           # KiB on Linux
    with torch.device("meta"):
        model = llama3_1_70b()
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert sum(p.numel() for p in model.parameters()) == 70_553_706_496     # Llama 3.1 70B's published count
    assert all(t.device.type == "meta" for t in list(model.parameters()) + list(model.buffers()))
    assert grown_mib < 200, f"peak RSS grew by {grown_mib:.0f} MiB"      # 70.6 B fp32 parameters would be 263 GiB
