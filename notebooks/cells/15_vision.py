# %% [markdown]
# # 第 15 章 · 看图：一张图怎样变成图像 token
#
# `qwen/vision.py`：图先缩放到两边都是 32 的倍数（`smart_resize`），切成 16×16 的小块（`prepare`），过视觉塔，
# 相邻 2×2 块合成一个图像 token；语言模型这边，图像 token 的位置是三维的 (t, h, w)（`Images.place`，位置再交给第 5 章的
# `mrope_tables`）。demo 检查点没有视觉塔，这里的图是 numpy 画的；要过塔的地方用一个随机初始化的小 `VisionTower`：
# 它的输出没有意义，只看形状与排列。

# %%
# 图直接画在笔记本里（Jupyter 的 matplotlib-inline 后端，不必写 %matplotlib inline）
import matplotlib.pyplot as plt
import numpy as np
import torch
from PIL import Image

import qwen
from qwen.cache import State
from qwen.vision import Images, VisionConfig, VisionTower, prepare, smart_resize

torch.manual_seed(0)
torch.set_num_threads(1)
plt.rcParams.update({"figure.figsize": (7, 3), "figure.dpi": 80, "font.size": 9,
                     "lines.antialiased": False})  # 线不抗锯齿：PNG 小得多，笔记本不臃肿

# %% [markdown]
# 一张 300×180 的合成图：渐变的底色、一个红色的圆、一个蓝色的方块。

# %%
H, W = 180, 300
yy, xx = np.mgrid[0:H, 0:W]
pixels = np.stack([xx / W, yy / H, np.full((H, W), 0.6)], -1) * 160
pixels[(yy - 80) ** 2 + (xx - 90) ** 2 < 45**2] = [230, 40, 40]  # 红色的圆
pixels[40:130, 180:260] = [40, 60, 220]  # 蓝色的方块
img = Image.fromarray(pixels.astype(np.uint8))
print(img.size, img.mode)

# %% [markdown]
# ## smart_resize：两边都是 32 的倍数，面积在范围之内
#
# 0.8B 的默认设置（`VisionConfig()`）：每块 16 像素，2×2 合并，所以因子是 32；面积至少 65536、至多 16777216 像素。
# 这张图四舍五入到 32 的倍数后面积不够 65536，按面积放大、向上取整；很大的图按面积缩小、向下取整；长宽比尽量不变。
# 一个图像 token 管 32×32 个像素。

# %%
vcfg = VisionConfig()
factor = vcfg.patch_size * vcfg.spatial_merge_size
for h, w in [(H, W), (480, 640), (1080, 1920), (6000, 8000), (64, 2000)]:
    rh, rw = smart_resize(h, w, factor, vcfg.min_pixels, vcfg.max_pixels)
    print(f"{w:5d} x {h:<5d} -> {rw:5d} x {rh:<5d}  patches {rw // 16:3d} x {rh // 16:<3d}  image tokens {rh * rw // 32**2:5d}")

# %% [markdown]
# ## prepare 的小块网格
#
# `prepare` 缩放（双三次）、归一化到约 [-1, 1]、切成 16×16 的小块：静止的图当作两帧相同的视频，每块 3·2·16·16 = 1536 个数。
# 小块不是按行排的，而是按 2×2 合并块的顺序：同一个图像 token 的 4 块挨在一起。把小块按这个顺序拼回去，得到的正是缩放后的图。
# 下图左边是原图，右边是拼回的图，细线是 16×16 的小块，粗线是 32×32 的合并块（一个图像 token）。

# %%
patches, grid = prepare(img, vcfg)
t, gh, gw = grid
print("patches", tuple(patches.shape), "grid (t, h, w) =", grid, "-> image tokens", gh * gw // 4)
x = patches.view(gh // 2, gw // 2, 2, 2, 3, 2, 16, 16)[..., 0, :, :]  # 第一帧：[行块, 列块, 2, 2, 3, 16, 16]
x = x.permute(4, 0, 2, 5, 1, 3, 6).reshape(3, gh * 16, gw * 16)  # [3, 高, 宽]
back = (x * torch.tensor(vcfg.image_std)[:, None, None] + torch.tensor(vcfg.image_mean)[:, None, None]).permute(1, 2, 0)
resized = np.asarray(img.resize((gw * 16, gh * 16), Image.BICUBIC)) / 255
print(f"max |patches put back - bicubic resize| = {np.abs(back.numpy() - resized).max():.1e}")
fig, (a1, a2) = plt.subplots(1, 2, figsize=(8, 2.8))
a1.imshow(img)
a1.set_title(f"original {W} x {H}")
a2.imshow(back.clamp(0, 1))
for i in range(0, gh * 16 + 1, 16):
    a2.axhline(i - 0.5, color="w", lw=1.5 if i % 32 == 0 else 0.5, alpha=1 if i % 32 == 0 else 0.4)
for j in range(0, gw * 16 + 1, 16):
    a2.axvline(j - 0.5, color="w", lw=1.5 if j % 32 == 0 else 0.5, alpha=1 if j % 32 == 0 else 0.4)
a2.set_title(f"prepare: {gw * 16} x {gh * 16}, {gw} x {gh} patches of 16 x 16")
plt.show()

# %% [markdown]
# ## 2×2 合并成图像 token
#
# 左图：左上角 4×8 个小块在 `prepare` 输出里的序号，折线按序号把它们连起来：先走完一个 2×2 合并块的四块，再到右边的下一个，
# 走完两行再换下两行。塔的最后一步（merger）于是直接把相邻的 4 行拼成 4·hidden 维：`view(-1, 4 * hidden)`。
# 右图：每个合并块就是一个图像 token，数字是它在提示词里的顺序（按行）。

# %%
order = torch.arange(gh * gw).view(gh // 2, gw // 2, 2, 2).permute(0, 2, 1, 3).reshape(gh, gw)  # 位置 → 序号
corner = order[:4, :8]
fig, (a1, a2) = plt.subplots(1, 2, figsize=(8, 2.8))
a1.imshow(corner, cmap="viridis", interpolation="nearest")
for (i, j), n in np.ndenumerate(corner.numpy()):
    a1.text(j, i, str(n), ha="center", va="center", fontsize=7, color="w")
for rows in ((0, 1), (2, 3)):  # 每两行一段：序号连续的一串
    cells = sorted((int(order[i, j]), i, j) for i in rows for j in range(8))
    a1.plot([c[2] for c in cells], [c[1] for c in cells], color="tab:red", lw=1, alpha=0.7)
for i in range(0, 5, 2):
    a1.axhline(i - 0.5, color="w", lw=2)
for j in range(0, 9, 2):
    a1.axvline(j - 0.5, color="w", lw=2)
a1.set(title="patch index in prepare's output (corner)", xlabel="patch column", ylabel="patch row")
a2.imshow(back.clamp(0, 1), extent=(-0.5, gw / 2 - 0.5, gh / 2 - 0.5, -0.5))
for m in range(gh * gw // 4):
    a2.text(m % (gw // 2), m // (gw // 2), str(m), ha="center", va="center", fontsize=6, color="w")
a2.set(title=f"{gh * gw // 4} image tokens (2 x 2 patches each)", xlabel="token column", ylabel="token row")
plt.show()

# %% [markdown]
# 一个随机初始化的小视觉塔（宽度都很小，两层；输出的宽度取 demo 语言模型的 hidden_size），看形状：
# 308 个小块 → 塔里每块一个向量 → 合并后每个图像 token 一个向量。`Images` 是第 15 章交给语言模型的东西。

# %%
small = VisionConfig(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, num_position_embeddings=64,
                     out_hidden_size=256, image_token_id=4095)  # 4095：demo 词表里的一个 id，充当 <|image_pad|>
tower = VisionTower(small).eval()
with torch.inference_mode():
    embeds = tower(patches, [grid])
images = Images(embeds, [grid], small, ["synthetic"])
print("patches", tuple(patches.shape), "-> tower", tuple(embeds.shape), "image tokens per image:", images.counts())

# %% [markdown]
# ## 图像 token 的三维位置 (t, h, w)
#
# 提示词里一个 `<|image_pad|>` 由 `Images.expand` 展开成 77 个；`Images.place(x, ids, start)` 把它们的嵌入换成塔的输出，
# 并排出三维位置：图前的文字三个分量相同、逐个加一；图像 token 的 t 不变，h、w 是它在合并网格里的行、列，都从图前的位置起；
# 图之后的文字从 max(位置) + 1 接着数。上图是图像 token 的 t、h、w 三个分量（排成合并网格），下图是整个提示词的三个分量。

# %%
model = qwen.Model.from_pretrained("demo")
chat = qwen.Chat(model)
before, after = chat.encode("# look at this picture:\n")[0], chat.encode("\n# it shows a circle and a square\n")[0]
assert small.image_token_id not in before.tolist() + after.tolist()
ids = images.expand(torch.cat([before, torch.tensor([small.image_token_id]), after])[None])
with torch.inference_mode():
    x, positions = images.place(model.embed_tokens(ids[0]), ids[0], start=0)  # [T, hidden]、[3, T]
where = (ids[0] == small.image_token_id).nonzero()[:, 0]
print("prompt tokens", ids.shape[1], "image tokens at", int(where[0]), "...", int(where[-1]))
fig, axes = plt.subplots(1, 3, figsize=(8, 1.9))
low, high = int(positions[:, where].min()), int(positions[:, where].max())
for ax, name, p in zip(axes, "thw", positions[:, where]):
    ax.imshow(p.view(gh // 2, gw // 2), cmap="viridis", interpolation="nearest", vmin=low, vmax=high + (high - low) / 3)
    for m, value in enumerate(p.tolist()):
        ax.text(m % (gw // 2), m // (gw // 2), str(value), ha="center", va="center", fontsize=5, color="w")
    ax.set(title=f"{name} of image tokens", xticks=[], yticks=[])
plt.show()

# %%
fig, ax = plt.subplots(figsize=(7, 2.6))
for row, name in zip(positions, ("t", "h", "w")):
    ax.plot(row, ".", ms=3, label=name)
ax.axvspan(int(where[0]) - 0.5, int(where[-1]) + 0.5, color="0.9", zorder=0)
ax.set(xlabel="token index in the prompt", ylabel="position id", title="3-D position ids (grey: image tokens)")
ax.legend()
plt.show()

# %% [markdown]
# 同样的提示词交给 demo 语言模型：`images.inputs` 给出第 10 章的模型要的两样——向量（图像 token 换成塔的输出）与三维位置，
# `model(ids, state, embeds=…, positions=…)` 与 transformers 的 inputs_embeds、position_ids 一样，不知道那是图。
# `state.pos` 数读过的 token，`State.shift` 记下位置比它少了多少——77 个图像 token 只占了 11 个位置，下一个 token 的位置是
# pos + shift，正是上图最后一个位置加一。

# %%
with torch.inference_mode():
    state = State(model)
    inputs = images.inputs(model, ids, state)  # {"embeds": [1, T, hidden], "positions": [3, 1, T]}
    model(ids, state, last=True, **inputs)
print(f"state.pos = {state.pos}, state.shift = {state.shift}, next position = {state.pos + state.shift}, "
      f"max position so far = {int(positions.max())}")
assert state.pos + state.shift == int(positions.max()) + 1
