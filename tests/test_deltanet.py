"""第 7 章 deltanet.py：Gated DeltaNet 层（因果卷积、L2 归一化的 q/k、门、递推、门控 RMSNorm）与 transformers 的
linear_attn 相同：短的走递推，长的走第 8 章的分块形式；带状态一段一段地读与一次读完相同。"""

import pytest
import torch

from qwen.deltanet import DeltaNetState
from qwen.layer import RECURRENT_MAX_T


@pytest.mark.parametrize("T", [1, 5, RECURRENT_MAX_T + 7])
def test_deltanet_equals_the_reference(tiny, tiny_model, T):
    ours, theirs = tiny_model.layers[0].linear_attn, tiny[1].model.layers[0].linear_attn
    x = torch.randn(1, T, tiny_model.cfg.hidden_size, generator=torch.Generator().manual_seed(T))
    ref, got = theirs(x), ours(x)
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_deltanet_with_a_state_equals_reading_at_once(tiny_model):
    ours = tiny_model.layers[0].linear_attn
    x = torch.randn(1, 12, tiny_model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    state = DeltaNetState()
    parts = [ours(x[:, a:b], state) for a, b in [(0, 2), (2, 3), (3, 12)]]  # 卷积窗口与记忆 S 跨段带过去
    assert torch.allclose(torch.cat(parts, 1), ours(x), atol=1e-5)
