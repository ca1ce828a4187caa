// 附录 · 注意力层解码几个位置：投影之后、o_proj 之前的一段一次调用（公式见第 6 章 attention.py）。
//
//     q, g = 每个头 [查询 D | 门 D]；q = rope(q_norm(q))，k = rope(k_norm(k))，k、v 写进 KV 缓存
//     out = softmax(q kᵀ / sqrt(D)) v · sigmoid(g)          每个查询只看它自己和之前的位置
//
// PyTorch 里这是二十来个小运算（每个头的归一化、RoPE 的切片与拼接、写缓存、注意力、门），解码一个 token 时每个都有
// 一份与大小无关的固定开销。这里一次做完。softmax 按固定的 CHUNK 个位置一段：每段各求最大值、指数和与加权的 v，
// 再按段的顺序合起来（Milakov 与 Gimelshein 的“在线 softmax”，FlashAttention 的做法）。段界只由位置决定，与同时算几个
// 查询、几个线程无关：验证草稿时第 t 个查询看前 L − T + t + 1 个位置，与单独解码它时是同一串运算，结果逐位相同（第 14 章）。
// 几段分给几个线程，长的缓存也快。同一个键值头的 g = H / Hkv 个查询头一起读这一头的缓存：每个位置的 k、v 只读一遍。
// 点积按 16 个一组的向量累加、再按固定顺序求和（-ffp-contract=off，乘与加各自舍入）：换一种 CPU 结果也一样。

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"

extern "C" void rms_norm(const float* x, int64_t rows, int64_t D, const float* scale, float eps, float* y);

namespace {

constexpr int64_t CHUNK = 256;  // softmax 每段几个位置

inline float dot(const float* a, const float* b, int64_t D) {  // D 是 16 的倍数
  v16 acc = {};
  for (int64_t i = 0; i < D; i += 16) acc += load16(a + i) * load16(b + i);
  float s = 0.0f;
  for (int l = 0; l < 16; ++l) s += acc[l];
  return s;
}

inline float value(const void* p, bool bf16, int64_t i) {
  if (!bf16) return static_cast<const float*>(p)[i];
  const uint32_t u = uint32_t(static_cast<const uint16_t*>(p)[i]) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// 就地：前 rot 维 x·cos + rotate_half(x)·sin（NeoX 式：第 i 维与第 i + rot/2 维配对，第 5 章），其余不动
void rope(float* x, const float* cos, const float* sin, int64_t rot) {
  const int64_t half = rot / 2;
  std::vector<float> r(x, x + rot);
  for (int64_t i = 0; i < rot; ++i) x[i] = r[i] * cos[i] + (i < half ? -r[i + half] : r[i - half]) * sin[i];
}

// 一个键值头、一段位置 [j0, j1) 对 g 个查询头：每个查询头的 (最大值 m, 指数和 s, 加权的 v [D]) 写进 part [g, 2 + D]
void chunk_part(const float* q, int64_t g, const float* k, const float* v, int64_t j0, int64_t j1, int64_t D, float* part) {
  const float scale = 1.0f / std::sqrt(float(D));
  std::vector<float> sc(g * CHUNK);
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t r = 0; r < g; ++r) sc[r * CHUNK + (j - j0)] = dot(q + r * D, k + j * D, D) * scale;
  for (int64_t r = 0; r < g; ++r) {
    float* s = sc.data() + r * CHUNK;
    float m = s[0], sum = 0.0f;
    for (int64_t j = 1; j < j1 - j0; ++j) m = std::max(m, s[j]);
    for (int64_t j = 0; j < j1 - j0; ++j) sum += (s[j] = std::exp(s[j] - m));
    float* acc = part + r * (2 + D);
    acc[0] = m, acc[1] = sum;
    std::fill(acc + 2, acc + 2 + D, 0.0f);
    for (int64_t j = 0; j < j1 - j0; ++j)
      for (int64_t d = 0; d < D; ++d) acc[2 + d] += s[j] * v[(j0 + j) * D + d];
  }
}

}  // namespace

// 一个注意力层的常量与形状（kernel.py 的 AttentionParams，layers.py 换布局时填一次；layer.cpp 的 Layer 里也有一份）
struct Attention {
  const float *q_scale, *k_scale;  // q_norm、k_norm 的 1 + w [D]
  float eps;                       // q_norm、k_norm 的 eps
  int64_t H, Hkv, D;               // 查询头、键值头、头的维数（H = 0：这一层不走这里）
};

namespace {

// 一次调用的输入与缓存：qkv 的第 (b, t) 个在 qkv + (b·T + t)·ld；cos、sin 的第 b 行从 b·cs_b 起，每个位置 rot 个；
// k_buf、v_buf [B, Hkv, cap, D]，前 length 个位置已在缓存里
struct Call {
  const void* qkv;
  bool bf16;
  int64_t ld, B, T;
  const float *cos, *sin;
  int64_t cs_b, rot;
  float *k_buf, *v_buf;
  int64_t cap, length;
};

// 一、每个位置：q 与门分开，q、k 各自 RMSNorm 再转 RoPE，k、v 写进缓存 → q [B·T, H, D]、gate [B·T, H, D]
void prepare(const Attention& p, const Call& c, float* q, float* gate) {
  const int64_t H = p.H, Hkv = p.Hkv, D = p.D;
  std::vector<float> raw(std::max(H, Hkv) * D);
  for (int64_t bt = 0; bt < c.B * c.T; ++bt) {
    const int64_t b = bt / c.T, t = bt % c.T, row = bt * c.ld;
    const float *cs = c.cos + b * c.cs_b + t * c.rot, *sn = c.sin + b * c.cs_b + t * c.rot;
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < D; ++d) {
        raw[h * D + d] = value(c.qkv, c.bf16, row + h * 2 * D + d);
        gate[(bt * H + h) * D + d] = value(c.qkv, c.bf16, row + h * 2 * D + D + d);
      }
    rms_norm(raw.data(), H, D, p.q_scale, p.eps, q + bt * H * D);
    for (int64_t h = 0; h < H; ++h) rope(q + (bt * H + h) * D, cs, sn, c.rot);
    for (int64_t i = 0; i < Hkv * D; ++i) raw[i] = value(c.qkv, c.bf16, row + H * 2 * D + i);
    for (int64_t h = 0; h < Hkv; ++h) {
      const int64_t at = ((b * Hkv + h) * c.cap + c.length + t) * D;  // 这个位置在缓存里的地方
      rms_norm(raw.data() + h * D, 1, D, p.k_scale, p.eps, c.k_buf + at);
      rope(c.k_buf + at, cs, sn, c.rot);
      for (int64_t d = 0; d < D; ++d) c.v_buf[at + d] = value(c.qkv, c.bf16, row + H * 2 * D + Hkv * D + h * D + d);
    }
  }
}

// 二、第 (b, t) 个查询看前 length + t + 1 个位置，分成 CHUNK 个一段；(b, t, 键值头, 段) 分给各个线程，
// 每段写下 g 个查询头的 (m, s, 加权的 v)：parts [B·T, Hkv, most, g, 2 + D]
void attend_chunks(const Attention& p, const Call& c, const float* q, int64_t most, float* parts) {
  const int64_t g = p.H / p.Hkv, D = p.D, items = c.B * c.T * p.Hkv * most;
#pragma omp parallel for schedule(dynamic) if (items >= 4)
  for (int64_t i = 0; i < items; ++i) {
    const int64_t bt = i / (p.Hkv * most), h = i / most % p.Hkv, k = i % most, L = c.length + bt % c.T + 1;
    if (k * CHUNK >= L) continue;
    const int64_t at = ((bt / c.T) * p.Hkv + h) * c.cap * D;
    chunk_part(q + (bt * p.H + h * g) * D, g, c.k_buf + at, c.v_buf + at, k * CHUNK, std::min(L, (k + 1) * CHUNK), D,
               parts + i * g * (2 + D));
  }
}

// 三、每个查询头按段的顺序合起来（在线 softmax），再乘输出门 sigmoid(gate) → out [B·T, H, D]
void merge(const Attention& p, const Call& c, const float* parts, int64_t most, const float* gate, float* out) {
  const int64_t g = p.H / p.Hkv, D = p.D;
  std::vector<float> o(D);
  for (int64_t bt = 0; bt < c.B * c.T; ++bt)
    for (int64_t h = 0; h < p.H; ++h) {
      const int64_t n = (c.length + bt % c.T + CHUNK) / CHUNK;  // 这个查询用到的段数
      const float* first = parts + ((bt * p.Hkv + h / g) * most * g + h % g) * (2 + D);
      auto part = [&](int64_t k) { return first + k * g * (2 + D); };
      float m = part(0)[0], total = 0.0f;
      for (int64_t k = 1; k < n; ++k) m = std::max(m, part(k)[0]);
      std::fill(o.begin(), o.end(), 0.0f);
      for (int64_t k = 0; k < n; ++k) {
        const float w = std::exp(part(k)[0] - m);
        total += part(k)[1] * w;
        for (int64_t d = 0; d < D; ++d) o[d] += part(k)[2 + d] * w;
      }
      const float* gt = gate + (bt * p.H + h) * D;
      float* y = out + (bt * p.H + h) * D;
      for (int64_t d = 0; d < D; ++d) y[d] = o[d] / total * (1.0f / (1.0f + std::exp(-gt[d])));
    }
}

// ---------- 长的提示词：预填充的注意力 ----------
//
// 几百个查询一起算时，PyTorch 的 SDPA 在这台 CPU 上只跑出 float32 乘加能力的一小半。这里照 FlashAttention 的做法：
// 同一个键值头的 g 个查询头、QBLOCK 个相继的查询排成 g·QBLOCK 行，键每 KBLOCK 个一段：
//     S = Q Kᵀ / sqrt(D)（一段的 Kᵀ 转置一次，g·QBLOCK 行都用它），m ← max(m, max S)，P = e^{S − m}（看不见的键取 0），
//     l ← l·e^{m_旧 − m} + Σ P，O ← O·e^{m_旧 − m} + P V
// 最后 O / l。两个乘积都是 simd.h 的 mul_rows。与 SDPA 只差 float32 的舍入（exp 是 exp16）。
constexpr int64_t QBLOCK = 32, KBLOCK = 64;

struct FlashScratch {
  std::vector<float> q, kt, s, o, m, l;
  FlashScratch(int64_t R, int64_t D) : q(R * D), kt(D * KBLOCK), s(R * KBLOCK), o(R * D), m(R), l(R) {}
};

// 一段键 [j0, j0 + nk)：S = Q Kᵀ，每行的在线 softmax（第 r 行只看前 limit(r) 个键），O ← O·修正 + P V
template <typename Limit>
void flash_keys(const float* k, const float* v, int64_t j0, int64_t nk, int64_t R, int64_t D, Limit limit, FlashScratch& f) {
  const int64_t N = (nk + 15) / 16 * 16;
  std::fill(f.kt.begin(), f.kt.end(), 0.0f);
  for (int64_t j = 0; j < nk; ++j)
    for (int64_t d = 0; d < D; ++d) f.kt[d * KBLOCK + j] = k[(j0 + j) * D + d];
  mul_rows(f.q.data(), D, R, D, f.kt.data(), KBLOCK, N, f.s.data(), KBLOCK, false);
  for (int64_t r = 0; r < R; ++r) {
    float* s = &f.s[r * KBLOCK];
    const int64_t seen = std::clamp<int64_t>(limit(r) - j0, 0, nk);  // 这一行看得见这段里的几个键
    float mx = f.m[r];
    for (int64_t j = 0; j < seen; ++j) mx = std::max(mx, s[j]);
    const float fix = seen ? std::exp(f.m[r] - mx) : 1.0f;  // 旧的和乘 e^{m_旧 − m}（m_旧 = −∞ 时是 0）
    float sum = 0.0f;
    for (int64_t j = 0; j < N; j += 16) {
      v16 p = exp16(load16(s + j) - mx);
      for (int i = 0; i < 16; ++i) p[i] = j + i < seen ? p[i] : 0.0f;
      for (int i = 0; i < 16; ++i) sum += p[i];
      std::memcpy(s + j, &p, sizeof p);
    }
    if (seen) f.m[r] = mx;
    f.l[r] = f.l[r] * fix + sum;
    for (int64_t d = 0; d < D; ++d) f.o[r * D + d] *= fix;
  }
  mul_rows(f.s.data(), KBLOCK, R, nk, v + j0 * D, D, D, f.o.data(), D, true);
}

}  // namespace

extern "C" {

// 长的提示词的注意力（预填充，layers.py 的 FastAttention.attend）：q [B, H, T, D]（连续，已归一化、转过 RoPE），缓存 k_buf、
// v_buf [B, Hkv, cap, D] 的前 L 个位置（最后 T 个是这些查询自己），第 t 个查询看前 L − T + t + 1 个 → out [B, T, H·D]
// （输出门之前）。(b, 键值头, QBLOCK 个查询) 分给各个线程，后面的查询看得多，先分
void attention_prefill(const float* q, int64_t B, int64_t H, int64_t T, int64_t D, const float* k_buf, const float* v_buf,
                       int64_t Hkv, int64_t cap, int64_t L, float* out) {
  const int64_t g = H / Hkv, blocks = (T + QBLOCK - 1) / QBLOCK, units = B * Hkv * blocks;
  const float scale = 1.0f / std::sqrt(float(D));
#pragma omp parallel
  {
    FlashScratch f(g * QBLOCK, D);
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = units - 1; u >= 0; --u) {
      const int64_t b = u / (Hkv * blocks), h = u / blocks % Hkv, t0 = u % blocks * QBLOCK, n = std::min(QBLOCK, T - t0);
      const int64_t R = g * n;  // 第 r 行：查询头 h·g + r / n、第 t0 + r % n 个查询
      for (int64_t r = 0; r < R; ++r) {
        const float* qr = q + ((b * H + h * g + r / n) * T + t0 + r % n) * D;
        for (int64_t d = 0; d < D; ++d) f.q[r * D + d] = qr[d] * scale;
      }
      std::fill(f.o.begin(), f.o.end(), 0.0f), std::fill(f.l.begin(), f.l.end(), 0.0f);
      std::fill(f.m.begin(), f.m.end(), -INFINITY);
      const int64_t most = L - T + t0 + n, at = (b * Hkv + h) * cap * D;  // 这一片最多看前 most 个键
      auto limit = [&](int64_t r) { return L - T + t0 + r % n + 1; };
      for (int64_t j0 = 0; j0 < most; j0 += KBLOCK)
        flash_keys(k_buf + at, v_buf + at, j0, std::min(KBLOCK, most - j0), R, D, limit, f);
      for (int64_t r = 0; r < R; ++r) {
        float* y = out + ((b * T + t0 + r % n) * H + h * g + r / n) * D;
        for (int64_t d = 0; d < D; ++d) y[d] = f.o[r * D + d] / f.l[r];
      }
    }
  }
}


// 注意力层 B 行、各 T 个相继的位置，三步：prepare（归一化、RoPE、写缓存）、attend_chunks（分段的注意力）、merge（合起来、
// 乘输出门）。qkv：投影（模型的 dtype，qkv_bf16 时 bfloat16），第 (b, t) 个在 qkv + (b·T + t)·ld：q（连同门）[H, 2D]、
// k [Hkv, D]、v [Hkv, D]。cos、sin [T, rot]（第 b 行从 b·cs_b 起：批里每行自己的位置时 cs_b = T·rot）。k_buf、v_buf
// [B, Hkv, cap, D] float32：前 length 个位置是缓存，这 T 个写在其后（调用的人已留够位置）。out [B, T, H·D] float32：
// 乘过输出门的注意力结果（o_proj 之前）
void attention_step(const Attention* p, const void* qkv, int64_t qkv_bf16, int64_t ld, int64_t B, int64_t T,
                    const float* cos, const float* sin, int64_t cs_b, int64_t rot, float* k_buf, float* v_buf, int64_t cap,
                    int64_t length, float* out) {
  const Call c{qkv, qkv_bf16 != 0, ld, B, T, cos, sin, cs_b, rot, k_buf, v_buf, cap, length};
  const int64_t most = (length + T + CHUNK - 1) / CHUNK;  // 最长的那个查询用到的段数
  std::vector<float> q(B * T * p->H * p->D), gate(q.size()), parts(B * T * p->Hkv * most * (p->H / p->Hkv) * (2 + p->D));
  prepare(*p, c, q.data(), gate.data());
  attend_chunks(*p, c, q.data(), most, parts.data());
  merge(*p, c, parts.data(), most, gate.data(), out);
}
}
