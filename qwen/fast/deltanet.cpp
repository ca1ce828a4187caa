// 附录 · DeltaNet 层解码一个位置：卷积、L2 归一化、门、递推、门控 RMSNorm 合成一次调用（公式见第 7 章 deltanet.py）。
//
// 解码一个 token 时，DeltaNet 层除了两个矩阵乘法，还有二三十个只有几千个数的小运算（卷积、归一化、门、读写记忆 S），
// 每个运算在 PyTorch 里都有一份与大小无关的固定开销（分派、分配输出），而且要拿着 Python 的 GIL：几个请求一起生成时
// （附录 qwen/serve），这些开销一个接一个地排队。这里一次做完，调用时放开 GIL；记忆 S 只读一遍、写一遍：
//     [Sᵀk, Sᵀq] = 旧 S 一次乘两个向量          （与 layers.py 的 recurrent_in_place 同一个重排）
//     δ = β(v − e^g Sᵀk)，  o = e^g Sᵀq + (qᵀk) δ，  S ← e^g S + k ⊗ δ
// 验证几个草稿、读短的提示词时一次给几个相继的位置，逐个位置地走：每个位置做的运算与单独解码它时完全一样，结果逐位相同
// （第 14 章）；每个头的记忆在缓存里走完这几步。
// 与 matvec.cpp 一样，-ffp-contract=off：乘加不被编译器悄悄合并，每个位置、每一行都是同一串运算。

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }
inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }  // 同 F.softplus 的阈值 20

inline float value(float v) { return v; }
inline float value(uint16_t v) {  // bfloat16 就是 float32 的高 16 位
  const uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// 因果深度卷积的一段通道 [c0, c1)：y[c] = Σ_j w[j, c] · x_{t−K+1+j}[c]，j 从 0 到 K−1 依次乘加（最后一项是这个位置的输入）。
// 第 b 行第 s 个输入：s < 0 时在窗口 conv [B, K−1, C] 里（float32），否则在 x + b·sb + s·ld（float32 或 bfloat16）
template <typename X>
void conv_part(const X* x, int64_t sb, int64_t ld, const float* conv, const float* conv_w, int64_t b, int64_t t,
               int64_t C, int64_t K, int64_t c0, int64_t c1, float* y) {
  for (int64_t j = 0; j < K; ++j) {
    const int64_t s = t - K + 1 + j;
    const float* w = conv_w + j * C;
    auto add = [&](auto p) {
      if (j == 0)
        for (int64_t c = c0; c < c1; ++c) y[c] = value(p[c]) * w[c];
      else
        for (int64_t c = c0; c < c1; ++c) y[c] += value(p[c]) * w[c];
    };
    if (s < 0) add(conv + (b * (K - 1) + (K - 1 + s)) * C);
    else add(x + b * sb + s * ld);
  }
}
constexpr int64_t CONV_PART = 512;  // 每次算几个通道：解码一个位置时也分得开给几个线程

// 就地 x ← x / sqrt(mean(x²) + eps / D) · scale，即 l2norm（第 7 章）再乘 scale
void l2norm(float* x, int64_t D, float scale) {
  float s = 0.0f;
  for (int64_t i = 0; i < D; ++i) s += x[i] * x[i];
  const float r = scale / std::sqrt(s / D + 1e-6f / D) / std::sqrt(float(D));
  for (int64_t i = 0; i < D; ++i) x[i] *= r;
}

}  // namespace

extern "C" {

// B 行、各 T 个相继的位置（解码 T = 1；验证草稿、短的提示词 T > 1）。proj：第 b 行第 t 个位置在 proj + b·sb + t·ld，
// 是 in_proj 的输出（依次是 qkv [C]、z [Hv·Dv]、b [Hv]、a [Hv]），float32。conv [B, K−1, C]：最近 K−1 个 qkv 输入（读）；
// conv_out 同形状：T 个位置之后的窗口（写）。conv_w [K, C]。neg_A [Hv] = −exp(A_log)；dt_bias [Hv]；norm_w [Dv]：门控
// RMSNorm 的权重。S [B, Hv, Dk, Dv]：就地更新成最后一个位置之后的记忆。history：空，或 T−1 个 [B, Hv, Dk, Dv] 的缓冲区，
// 第 t 个写第 t 个位置之后的记忆（投机解码回滚时取用）。out [B, T, Hv·Dv]：门控 RMSNorm 之后、out_proj 之前的输出。
// 每个位置做的运算与一次只给一个位置时完全一样（同样的求和顺序），所以结果与逐个位置地调用逐位相同；一次给 T 个，
// 每个头的记忆（64 KB）在缓存里走完 T 步，不必每个位置从内存读一遍、写一遍（记历史时也只多写那几份）。
void deltanet_step(const float* proj, int64_t sb, int64_t ld, int64_t T, const float* conv, float* conv_out,
                   const float* conv_w, const float* neg_A, const float* dt_bias, const float* norm_w, float eps, float* S,
                   float* const* history, float* out, int64_t B, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv, int64_t K) {
  const int64_t key = Hk * Dk, C = 2 * key + Hv * Dv, BT = B * T;
  // 第 b 行的第 j 个输入（j < 0 是窗口里的旧输入）
  auto input = [&](int64_t b, int64_t j) { return j < 0 ? conv + (b * (K - 1) + (K - 1 + j)) * C : proj + b * sb + j * ld; };
  std::vector<float> y(BT * C);  // 每个位置卷积 + SiLU 之后的 q、k、v
  const int64_t parts = (C + CONV_PART - 1) / CONV_PART;
#pragma omp parallel for schedule(static) if (BT * C >= 4096)  // 几千个 exp：分给各个线程
  for (int64_t i = 0; i < BT * parts; ++i) {
    const int64_t bt = i / parts, c0 = i % parts * CONV_PART, c1 = std::min(C, c0 + CONV_PART);
    float* yt = y.data() + bt * C;
    conv_part(proj, sb, ld, conv, conv_w, bt / T, bt % T, C, K, c0, c1, yt);
    for (int64_t c = c0; c < c1; ++c) yt[c] = silu(yt[c]);
  }
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t j = 0; j < K - 1; ++j)  // 窗口往前挪 T 格
      std::memcpy(conv_out + (b * (K - 1) + j) * C, input(b, T - K + 1 + j), C * sizeof(float));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < Hk; ++h) {
        float* yt = y.data() + (b * T + t) * C;
        l2norm(yt + h * Dk, Dk, 1.0f / std::sqrt(float(Dk)));  // q 还要乘 1/sqrt(Dk)
        l2norm(yt + key + h * Dk, Dk, 1.0f);
      }
  }
#pragma omp parallel for schedule(static) if (B * Hv * Dk * Dv >= 65536)  // 各头的记忆互不相干，分给各个线程
  for (int64_t bh = 0; bh < B * Hv; ++bh) {
    const int64_t b = bh / Hv, h = bh % Hv, hk = h / (Hv / Hk);  // 值头多于键头时，相邻 Hv/Hk 个值头共用一个 q、k 头
    float* Sh = S + bh * Dk * Dv;  // 这个头的记忆 [Dk, Dv]
    std::vector<float> pred(Dv), read(Dv), o(Dv);
    for (int64_t t = 0; t < T; ++t) {
      const float* x = input(b, t);
      const float* q = y.data() + (b * T + t) * C + hk * Dk;
      const float* k = q + key;
      const float* v = y.data() + (b * T + t) * C + 2 * key + h * Dv;
      const float beta = sigmoid(x[C + Hv * Dv + h]);  // 写入强度 β
      const float d = std::exp(neg_A[h] * softplus(x[C + Hv * Dv + Hv + h] + dt_bias[h]));  // 衰减 e^g
      std::fill(pred.begin(), pred.end(), 0.0f);
      std::fill(read.begin(), read.end(), 0.0f);
      float qk = 0.0f;
      for (int64_t i = 0; i < Dk; ++i) {  // 读一遍旧 S：Sᵀk、Sᵀq
        const float* row = Sh + i * Dv;
        qk += q[i] * k[i];
        for (int64_t j = 0; j < Dv; ++j) {
          pred[j] += row[j] * k[i];
          read[j] += row[j] * q[i];
        }
      }
      std::vector<float>& delta = pred;  // δ 写在 Sᵀk 的位置上
      float ss = 0.0f;
      for (int64_t j = 0; j < Dv; ++j) {
        delta[j] = (v[j] - d * pred[j]) * beta;  // δ = β(v − e^g Sᵀk)
        o[j] = d * read[j] + qk * delta[j];      // o = e^g Sᵀq + (qᵀk) δ
        ss += o[j] * o[j];
      }
      for (int64_t i = 0; i < Dk; ++i) {  // 写一遍：S ← e^g S + k ⊗ δ
        float* row = Sh + i * Dv;
        for (int64_t j = 0; j < Dv; ++j) row[j] = row[j] * d + k[i] * delta[j];
      }
      if (history && t + 1 < T) std::memcpy(history[t] + bh * Dk * Dv, Sh, Dk * Dv * sizeof(float));
      const float r = 1.0f / std::sqrt(ss / Dv + eps);  // 门控 RMSNorm：w · rms(o) · silu(z)
      const float* z = x + C + h * Dv;
      float* oh = out + ((b * T + t) * Hv + h) * Dv;
      for (int64_t j = 0; j < Dv; ++j) oh[j] = o[j] * r * norm_w[j] * silu(z[j]);
    }
  }
}

// 长的提示词（分块形式，第 8 章）的卷积：x [B, T, C]（第 b 行第 t 个位置在 x + b·sb + t·ld；x_bf16 时是 bfloat16），窗口
// conv [B, K−1, C]，conv_w [K, C] → y [B, T, C] float32（还没有 SiLU：调用的人就地做，PyTorch 的 exp 是向量化的）。
// 一遍读完输入、写一遍输出，不必先拼接、转 float32，再四次乘加各读写一遍 [B, T, C]
void causal_conv(const void* x, int64_t x_bf16, int64_t sb, int64_t ld, int64_t T, const float* conv, const float* conv_w,
                 float* y, int64_t B, int64_t C, int64_t K) {
  const int64_t parts = (C + CONV_PART - 1) / CONV_PART;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < B * T * parts; ++i) {
    const int64_t bt = i / parts, c0 = i % parts * CONV_PART, c1 = std::min(C, c0 + CONV_PART);
    if (x_bf16)
      conv_part(static_cast<const uint16_t*>(x), sb, ld, conv, conv_w, bt / T, bt % T, C, K, c0, c1, y + bt * C);
    else
      conv_part(static_cast<const float*>(x), sb, ld, conv, conv_w, bt / T, bt % T, C, K, c0, c1, y + bt * C);
  }
}
}
