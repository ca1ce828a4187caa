import os
import tempfile

import pytest
import torch
from hypothesis import settings

from checkpoints import WIDTHS_08B, make_checkpoint, make_moe_checkpoint

torch.set_num_threads(2)
# 附录记在磁盘上的测量（能不能编译、起草的代价）写进本次测试自己的目录，不碰用户的 ~/.cache/qwen
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="qwen-test-cache-")
settings.register_profile("deterministic", derandomize=True, deadline=None)  # 同样的例子，每次都一样
settings.load_profile("deterministic")


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """(路径, transformers 模型)：小宽度、值头多于键头的随机检查点。"""
    return make_checkpoint(tmp_path_factory.mktemp("tiny"), seed=1)


@pytest.fixture(scope="session")
def widths08b(tmp_path_factory):
    """(路径, transformers 模型)：0.8B 的全部宽度，4 层。"""
    return make_checkpoint(tmp_path_factory.mktemp("w08b"), seed=2, **WIDTHS_08B)


@pytest.fixture(scope="session")
def lively(tmp_path_factory):
    """(路径, transformers 模型)：写回残差流的投影尺度为 1，贪心续写多样，用来测生成与投机解码。"""
    return make_checkpoint(tmp_path_factory.mktemp("lively"), seed=3, out_scale=1.0)


@pytest.fixture(scope="session")
def lively_moe(tmp_path_factory):
    """(路径, transformers 模型)：专家混合（256 个专家、每个 token 8 个，窄的宽度），续写多样；主干的专家堆叠存放，
    MTP 层按专家分开存（35B-A3B 的布局）。"""
    return make_moe_checkpoint(tmp_path_factory.mktemp("lively_moe"), seed=5, out_scale=1.0)


@pytest.fixture(scope="session")
def model(lively):
    """lively 经附录 qwen.fast 变换过的模型（打包的布局、float32）：生成、对话、投机解码的测试共用。"""
    from qwen.fast import load_model

    return load_model(lively[0], layout="packed", dtype=torch.float32)


@pytest.fixture(scope="session")
def lively_model(lively):
    """lively 上各章的普通模型（不变换）。"""
    from qwen import Model

    return Model.from_pretrained(lively[0], dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny_model(tiny):
    """各章的普通模型（pack=False，不变换）：逐位与参考实现比，也是快路径的对照。"""
    from qwen import Model

    return Model.from_pretrained(tiny[0], dtype=torch.float32)
