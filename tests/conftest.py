import pytest
import torch

from checkpoints import WIDTHS_08B, make_checkpoint

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """(路径, transformers 模型)：小宽度、值头多于键头的随机检查点。"""
    return make_checkpoint(tmp_path_factory.mktemp("tiny"), seed=1)


@pytest.fixture(scope="session")
def widths08b(tmp_path_factory):
    """(路径, transformers 模型)：0.8B 的全部宽度，4 层。"""
    return make_checkpoint(tmp_path_factory.mktemp("w08b"), seed=2, **WIDTHS_08B)
