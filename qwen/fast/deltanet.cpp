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

#include "simd.h"

namespace {

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }
inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }  // 同 F.softplus 的阈值 20

// y[0…n−1] ← silu(y)，16 个一组；不满 16 个的尾巴补到 16 个再算（每个数走同一个公式）
void silu_span(float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const v16 v = silu16(load16(y + i));
    std::memcpy(y + i, &v, sizeof v);
  }
  if (i < n) {
    float tail[16] = {};
    std::memcpy(tail, y + i, (n - i) * sizeof(float));
    const v16 v = silu16(load16(tail));
    std::memcpy(y + i, &v, (n - i) * sizeof(float));
  }
}

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

// 一个 DeltaNet 层的常量与形状（kernel.py 的 DeltaNetParams，layers.py 换布局时填一次；layer.cpp 的 Layer 里也有一份）
struct DeltaNet {
  const float *conv_w, *neg_A, *dt_bias, *norm_w;  // 卷积核 [K, C]、−exp(A_log) [Hv]、dt_bias [Hv]、门控 RMSNorm 的权重 [Dv]
  float eps;                                       // 门控 RMSNorm 的 eps
  int64_t Hk, Hv, Dk, Dv, K;                       // 键头、值头、各自的维数、卷积核长
};

namespace {

// 一次调用的输入：B 行、各 T 个相继的位置。proj 的第 b 行第 t 个位置在 proj + b·sb + t·ld，是 in_proj 的输出（依次是
// qkv [C]、z [Hv·Dv]、b [Hv]、a [Hv]），float32；conv [B, K−1, C] 是这之前最近 K−1 个 qkv 输入
struct Input {
  const float *proj, *conv;
  int64_t sb, ld, B, T, C, K;
  const float* at(int64_t b, int64_t j) const {  // 第 b 行第 j 个位置（j < 0：窗口里的旧输入）
    return j < 0 ? conv + (b * (K - 1) + (K - 1 + j)) * C : proj + b * sb + j * ld;
  }
};

// 一、卷积 + SiLU：每个位置的 q、k、v → y [B·T, C]
std::vector<float> convolve(const DeltaNet& p, const Input& in) {
  const int64_t BT = in.B * in.T, C = in.C, parts = (C + CONV_PART - 1) / CONV_PART;
  std::vector<float> y(BT * C);
#pragma omp parallel for schedule(static) if (BT * C >= 4096)  // 几千个 exp：分给各个线程
  for (int64_t i = 0; i < BT * parts; ++i) {
    const int64_t bt = i / parts, c0 = i % parts * CONV_PART, c1 = std::min(C, c0 + CONV_PART);
    float* yt = y.data() + bt * C;
    conv_part(in.proj, in.sb, in.ld, in.conv, p.conv_w, bt / in.T, bt % in.T, C, p.K, c0, c1, yt);
    for (int64_t c = c0; c < c1; ++c) yt[c] = silu(yt[c]);
  }
  return y;
}

// 二、卷积窗口往前挪 T 格 → conv_out [B, K−1, C]
void slide_window(const Input& in, float* conv_out) {
  for (int64_t b = 0; b < in.B; ++b)
    for (int64_t j = 0; j < in.K - 1; ++j)
      std::memcpy(conv_out + (b * (in.K - 1) + j) * in.C, in.at(b, in.T - in.K + 1 + j), in.C * sizeof(float));
}

// 三、每个位置每个键头的 q、k 做 L2 归一化（q 还要乘 1/sqrt(Dk)）
void normalize_qk(const DeltaNet& p, float* y, int64_t BT, int64_t C) {
  const int64_t key = p.Hk * p.Dk;
  for (int64_t bt = 0; bt < BT; ++bt)
    for (int64_t h = 0; h < p.Hk; ++h) {
      l2norm(y + bt * C + h * p.Dk, p.Dk, 1.0f / std::sqrt(float(p.Dk)));
      l2norm(y + bt * C + key + h * p.Dk, p.Dk, 1.0f);
    }
}

// 四、一个头、一个位置的递推：记忆 Sh [Dk, Dv] 只读一遍、写一遍 → o [Dv]。delta 是 Dv 个数的草稿纸
//     [Sᵀk, Sᵀq] = 旧 S 一次乘两个向量；δ = β(v − e^g Sᵀk)；o = e^g Sᵀq + (qᵀk) δ；S ← e^g S + k ⊗ δ
void delta_rule(float* Sh, const float* q, const float* k, const float* v, float beta, float d, int64_t Dk, int64_t Dv,
                float* delta, float* o) {
  std::fill(delta, delta + Dv, 0.0f);  // 先放 Sᵀk
  std::fill(o, o + Dv, 0.0f);          // 先放 Sᵀq
  float qk = 0.0f;
  for (int64_t i = 0; i < Dk; ++i) {  // 读一遍旧 S
    const float* row = Sh + i * Dv;
    qk += q[i] * k[i];
    for (int64_t j = 0; j < Dv; ++j) {
      delta[j] += row[j] * k[i];
      o[j] += row[j] * q[i];
    }
  }
  for (int64_t j = 0; j < Dv; ++j) {
    delta[j] = (v[j] - d * delta[j]) * beta;  // δ = β(v − e^g Sᵀk)
    o[j] = d * o[j] + qk * delta[j];          // o = e^g Sᵀq + (qᵀk) δ
  }
  for (int64_t i = 0; i < Dk; ++i) {  // 写一遍：S ← e^g S + k ⊗ δ
    float* row = Sh + i * Dv;
    for (int64_t j = 0; j < Dv; ++j) row[j] = row[j] * d + k[i] * delta[j];
  }
}

// 五、门控 RMSNorm：out = w · rms(o) · silu(z)
void gated_norm(const float* o, const float* z, const DeltaNet& p, float* out) {
  float ss = 0.0f;
  for (int64_t j = 0; j < p.Dv; ++j) ss += o[j] * o[j];
  const float r = 1.0f / std::sqrt(ss / p.Dv + p.eps);
  for (int64_t j = 0; j < p.Dv; ++j) out[j] = o[j] * r * p.norm_w[j] * silu(z[j]);
}

// 一个头 (b, h) 走完 T 个位置：门（β、衰减 e^g）、递推、门控 RMSNorm；记历史时第 t 个位置之后的记忆写进 history[t]
void head_steps(const DeltaNet& p, const Input& in, const float* y, int64_t b, int64_t h, float* S, float* const* history,
                float* out) {
  const int64_t key = p.Hk * p.Dk, C = in.C, bh = b * p.Hv + h, hk = h / (p.Hv / p.Hk);  // 相邻 Hv/Hk 个值头共用 q、k
  float* Sh = S + bh * p.Dk * p.Dv;  // 这个头的记忆 [Dk, Dv]
  std::vector<float> delta(p.Dv), o(p.Dv);
  for (int64_t t = 0; t < in.T; ++t) {
    const float* x = in.at(b, t);  // 这个位置的 in_proj 输出：z、b、a 在 qkv 之后
    const float* q = y + (b * in.T + t) * C + hk * p.Dk;
    const float beta = sigmoid(x[C + p.Hv * p.Dv + h]);                                            // 写入强度 β
    const float d = std::exp(p.neg_A[h] * softplus(x[C + p.Hv * p.Dv + p.Hv + h] + p.dt_bias[h]));  // 衰减 e^g
    delta_rule(Sh, q, q + key, y + (b * in.T + t) * C + 2 * key + h * p.Dv, beta, d, p.Dk, p.Dv, delta.data(), o.data());
    if (history && t + 1 < in.T) std::memcpy(history[t] + bh * p.Dk * p.Dv, Sh, p.Dk * p.Dv * sizeof(float));
    gated_norm(o.data(), x + C + h * p.Dv, p, out + ((b * in.T + t) * p.Hv + h) * p.Dv);
  }
}


// ---------- 长的提示词：第 8 章的分块形式，一个头一次调用走完 ----------
//
// PyTorch 里分块形式是几十个小运算：每块每个头十几次 32×128 的小矩阵乘法，外加 exp、掩码、拼接、复制，每个都分派一次、
// 分配一次输出。这里一个头 (b, h) 从头到尾走完所有块，块内的量都在 L1、L2 里，记忆 S（64 KB）一直留在 L2。一块 n 个位置，
// G_t 为块内累计对数衰减，Γ_tj = e^{G_t−G_j}（j ≤ t），S₀ 为块开始时的记忆（公式与推导见第 8 章 chunk.py）：
//     P = [Q; K] S₀                                两个 [n, Dk] 一次乘 S₀
//     U_t = β_t (v_t − e^{G_t} P_K[t]) − Σ_{j<t} β_t Γ_tj (k_tᵀk_j) U_j     逐行前代：就是 (I + A) U = βV − (βK ⊙ e^G) S₀
//     O_t = e^{G_t} P_Q[t] + Σ_{j≤t} Γ_tj (q_tᵀk_j) U_j
//     S   = e^{G_n} S₀ + Σ_t e^{G_n−G_t} k_t ⊗ U_t
// 与第 8 章只差 float32 的舍入：它先解出 (I + A)⁻¹ 再乘右端，这里直接前代（同一个三角方程）。三个大的乘积都是
// “几行乘一个矩阵”（simd.h 的 mul_rows）。

// 同 l2norm，平方和用 simd.h 的 sum_squares（16 个一组分开加；与 l2norm 只差求和顺序的舍入）
void unit16(float* x, int64_t D, float scale) {
  const float r = scale / std::sqrt(sum_squares(x, D) / D + 1e-6f / D) / std::sqrt(float(D));
  for (int64_t i = 0; i < D; ++i) x[i] *= r;
}

inline float decay(float x) { return x < -40.0f ? 0.0f : std::exp(x); }  // 同第 8 章：e^x，x < −40 时取 0

// 一个头的草稿纸：块长 C、每块的 q、k（归一化后）、它们与 k 的内积、P、U 等
struct Scratch {
  int64_t C, Cp, Dk, Dv;
  std::vector<float> qk, v, kt, gram, P, M, A, U, G;
  Scratch(int64_t C, int64_t Dk, int64_t Dv)
      : C(C), Cp((C + 15) / 16 * 16), Dk(Dk), Dv(Dv), qk(2 * C * Dk), v(C * Dv), kt(Dk * Cp), gram(2 * C * Cp), P(2 * C * Dv),
        M(C * C), A(C * C), U(C * Dv), G(C) {}
};

// 一个头读的输入：in_proj 的输出 x（第 t 个位置在 x + t·ld，X 是 float32 或 bfloat16），它之前的卷积窗口 past [K−1, C]，
// 卷积核 conv_w [K, C]；这个头的 q、k、v 在第 qc、kc、vc 个通道起
template <typename X>
struct Source {
  const X* x;
  int64_t ld;
  const float *past, *conv_w;
  int64_t K, C, qc, kc, vc;
};

// 第 t0…t0+n−1 个位置、通道 c0…c0+D−1 的卷积 + SiLU → dst [n, D]：y = Σ_j w[j] · x_{t−K+1+j}，j 从 0 起依次乘、加
// （同 conv_part，16 个通道一起），再过 SiLU（exp16）
template <typename X>
void conv_rows(const Source<X>& src, int64_t t0, int64_t n, int64_t c0, int64_t D, float* dst) {
  for (int64_t t = t0; t < t0 + n; ++t)
    for (int64_t c = c0; c < c0 + D; c += 16) {
      v16 y{};
      for (int64_t j = 0; j < src.K; ++j) {
        const int64_t at = t - src.K + 1 + j;
        const v16 in = at < 0 ? load16(src.past + (src.K - 1 + at) * src.C + c) : load16(src.x + at * src.ld + c);
        y = j == 0 ? in * load16(src.conv_w + j * src.C + c) : y + in * load16(src.conv_w + j * src.C + c);
      }
      const v16 out = silu16(y);
      std::memcpy(dst + (t - t0) * D + c - c0, &out, sizeof out);
    }
}

// 一块 n 个位置（从第 t0 个起）的 q、k、v：卷积 + SiLU，q、k 再归一化（q 再乘 1/sqrt(Dk)）进 s.qk 的前 n 行、后 n 行，v 进
// s.v，k 再转置进 s.kt [Dk, Cp]
template <typename X>
void load_chunk(const Source<X>& src, int64_t t0, int64_t n, Scratch& s) {
  conv_rows(src, t0, n, src.qc, s.Dk, s.qk.data());
  conv_rows(src, t0, n, src.kc, s.Dk, s.qk.data() + n * s.Dk);
  conv_rows(src, t0, n, src.vc, s.Dv, s.v.data());
  std::fill(s.kt.begin(), s.kt.end(), 0.0f);
  for (int64_t t = 0; t < n; ++t) {
    float *q = &s.qk[t * s.Dk], *k = &s.qk[(n + t) * s.Dk];
    unit16(q, s.Dk, 1.0f / std::sqrt(float(s.Dk)));
    unit16(k, s.Dk, 1.0f);
    for (int64_t i = 0; i < s.Dk; ++i) s.kt[i * s.Cp + t] = k[i];
  }
}

// 下一块（第 t0 起 next 个位置）的输入先取进缓存：各位置相隔一整行 in_proj 的输出，硬件的预取跟不上
template <typename X>
void prefetch_chunk(const Source<X>& src, int64_t t0, int64_t next, const Scratch& s) {
  for (int64_t t = t0; t < t0 + next; ++t)
    for (int64_t i = 0; i < s.Dk * int64_t(sizeof(X)); i += 64) {
      const char* row = reinterpret_cast<const char*>(src.x + t * src.ld);
      __builtin_prefetch(row + src.qc * sizeof(X) + i), __builtin_prefetch(row + src.kc * sizeof(X) + i);
      if (i < s.Dv * int64_t(sizeof(X))) __builtin_prefetch(row + src.vc * sizeof(X) + i);
    }
}

// 块内的两个下三角阵：M_tj = Γ_tj (q_tᵀk_j)（j ≤ t），A_tj = −β_t Γ_tj (k_tᵀk_j)（j < t，取负：前代时直接加）
void triangles(const float* beta, int64_t n, Scratch& s) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t j = 0; j < n; ++j) {
      const float gamma = j <= t ? decay(s.G[t] - s.G[j]) : 0.0f;
      s.M[t * s.C + j] = gamma * s.gram[t * s.Cp + j];
      s.A[t * s.C + j] = j < t ? -beta[t] * gamma * s.gram[(n + t) * s.Cp + j] : 0.0f;
    }
}

// 一个头走完一块（n 个位置，q、k、v 已由 load_chunk 放进 s）：beta、g 逐位置，Sh [Dk, Dv] 就地更新，输出 O 写进 out
// （位置之间隔 ldo）。与输入的 dtype 无关：只编译一份
void chunk_step(const float* beta, const float* g, int64_t n, float* Sh, float* out, int64_t ldo, Scratch& s) {
  const int64_t Dk = s.Dk, Dv = s.Dv;
  mul_rows(s.qk.data(), Dk, 2 * n, Dk, s.kt.data(), s.Cp, s.Cp, s.gram.data(), s.Cp, false);  // [Q; K] Kᵀ
  mul_rows(s.qk.data(), Dk, 2 * n, Dk, Sh, Dv, Dv, s.P.data(), Dv, false);                     // P = [Q; K] S₀
  for (int64_t t = 0; t < n; ++t) s.G[t] = (t ? s.G[t - 1] : 0.0f) + g[t];
  triangles(beta, n, s);
  for (int64_t t = 0; t < n; ++t) {  // U_t = β_t (v_t − e^{G_t} P_K[t]) + Σ_{j<t} A_tj U_j
    const float e = decay(s.G[t]), *v = &s.v[t * Dv], *pk = &s.P[(n + t) * Dv];
    float* u = &s.U[t * Dv];
    for (int64_t j = 0; j < Dv; ++j) u[j] = beta[t] * (v[j] - e * pk[j]);
    if (t) mul_rows(&s.A[t * s.C], s.C, 1, t, s.U.data(), Dv, Dv, u, Dv, true);
  }
  for (int64_t t = 0; t < n; ++t) {  // O_t = e^{G_t} P_Q[t] + Σ_{j≤t} M_tj U_j
    const float e = decay(s.G[t]);
    for (int64_t j = 0; j < Dv; ++j) out[t * ldo + j] = e * s.P[t * Dv + j];
  }
  mul_rows(s.M.data(), s.C, n, n, s.U.data(), Dv, Dv, out, ldo, true);
  const float last = s.G[n - 1];  // S = e^{G_n} S₀ + Σ_t e^{G_n−G_t} k_t ⊗ U_t
  for (int64_t t = 0; t < n; ++t) {
    const float e = decay(last - s.G[t]);
    for (int64_t i = 0; i < Dk; ++i) s.kt[i * s.Cp + t] *= e;
  }
  const float e = decay(last);
  for (int64_t i = 0; i < Dk * Dv; ++i) Sh[i] *= e;
  mul_rows(s.kt.data(), s.Cp, Dk, n, s.U.data(), Dv, Dv, Sh, Dv, true);
}

// 门控 RMSNorm 的一行（就地）：o ← w · rms(o) · silu(z)，同 gated_norm，平方和用 sum_squares、SiLU 用 exp16
template <typename Z>
void gate_row(const DeltaNet& p, float* o, const Z* z) {
  const float r = 1.0f / std::sqrt(sum_squares(o, p.Dv) / p.Dv + p.eps);
  for (int64_t j = 0; j < p.Dv; j += 16) {
    const v16 v = load16(o + j) * r * load16(p.norm_w + j) * silu16(load16(z + j));
    std::memcpy(o + j, &v, sizeof v);
  }
}

// x86 上把次正规数当 0（FTZ、DAZ），调用结束时还原：块内的衰减乘来乘去会落进次正规数，乘加它们慢十几倍（见第 8 章的 TINY）
struct FlushDenormals {
#if defined(__SSE__)
  unsigned saved = __builtin_ia32_stmxcsr();
  FlushDenormals() { __builtin_ia32_ldmxcsr(saved | 0x8040); }
  ~FlushDenormals() { __builtin_ia32_ldmxcsr(saved); }
#endif
};

// 一个头 (b, h) 走完 T 个位置的所有块，每块之后做门控 RMSNorm（输出门 z 在 in_proj 输出里 qkv 之后，这一块的输出还在缓存里）
template <typename X>
void chunk_head(const DeltaNet& p, const Source<X>& src, int64_t T, int64_t h, const float* beta, const float* g, float* Sh,
                int64_t chunk, float* out, Scratch& s) {
  std::vector<float> bt(T), gt(T);
  for (int64_t t = 0; t < T; ++t) bt[t] = beta[t * p.Hv + h], gt[t] = g[t * p.Hv + h];
  for (int64_t t0 = 0; t0 < T; t0 += chunk) {
    const int64_t n = std::min(chunk, T - t0);
    float* o = out + t0 * p.Hv * p.Dv + h * p.Dv;  // 这个头在第 t0 个位置的输出
    prefetch_chunk(src, t0 + n, std::clamp<int64_t>(T - t0 - chunk, 0, chunk), s);
    load_chunk(src, t0, n, s);
    chunk_step(&bt[t0], &gt[t0], n, Sh, o, p.Hv * p.Dv, s);
    for (int64_t t = 0; t < n; ++t) gate_row(p, o + t * p.Hv * p.Dv, src.x + (t0 + t) * src.ld + src.C + h * p.Dv);
  }
}

}  // namespace

extern "C" {

// DeltaNet 层 T 个相继的位置（解码 T = 1；验证草稿、短的提示词 T > 1），五步：卷积 + SiLU、窗口前移、q/k 归一化、
// 每个头逐个位置的递推、门控 RMSNorm。proj、sb、ld、conv 见 Input；conv_out 同 conv 的形状：T 个位置之后的窗口（写）。
// S [B, Hv, Dk, Dv]：就地更新成最后一个位置之后的记忆。history：空，或 T−1 个 [B, Hv, Dk, Dv] 的缓冲区，第 t 个写第
// t 个位置之后的记忆（投机解码回滚时取用）。out [B, T, Hv·Dv]：门控 RMSNorm 之后、out_proj 之前的输出。
// 每个位置做的运算与一次只给一个位置时完全一样（同样的求和顺序），所以结果与逐个位置地调用逐位相同；一次给 T 个，
// 每个头的记忆（64 KB）在缓存里走完 T 步，不必每个位置从内存读一遍、写一遍（记历史时也只多写那几份）。
void deltanet_step(const DeltaNet* p, const float* proj, int64_t sb, int64_t ld, int64_t B, int64_t T, const float* conv,
                   float* conv_out, float* S, float* const* history, float* out) {
  const Input in{proj, conv, sb, ld, B, T, 2 * p->Hk * p->Dk + p->Hv * p->Dv, p->K};
  std::vector<float> y = convolve(*p, in);  // [B·T, C]
  slide_window(in, conv_out);
  normalize_qk(*p, y.data(), B * T, in.C);
#pragma omp parallel for schedule(static) if (B * p->Hv * p->Dk * p->Dv >= 65536)  // 各头的记忆互不相干，分给各个线程
  for (int64_t bh = 0; bh < B * p->Hv; ++bh) head_steps(*p, in, y.data(), bh / p->Hv, bh % p->Hv, S, history, out);
}

// 长的提示词（分块形式，第 8 章）的卷积：x [B, T, C]（第 b 行第 t 个位置在 x + b·sb + t·ld；x_bf16 时是 bfloat16），窗口
// conv [B, K−1, C]，conv_w [K, C] → y [B, T, C] float32，已过 SiLU（exp16）。
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
    silu_span(y + bt * C + c0, c1 - c0);
  }
}

// 长的提示词（T 个位置，分块形式，第 8 章）：proj 是 in_proj 的输出（第 b 行第 t 个位置在 proj + b·sb + t·ld，依次是
// qkv [C]、z [Hv·Dv]、b、a；x_bf16 时是 bfloat16，否则 float32），conv [B, K−1, C] 是这之前的卷积窗口，beta、g [B, T, Hv]
// （写入强度、对数衰减），S [B, Hv, Dk, Dv] 就地更新成最后一个位置之后的记忆。卷积 + SiLU、q 与 k 的 L2 归一化、分块形式、
// 门控 RMSNorm 都在这里 → out [B, T, Hv·Dv]（out_proj 之前）。块长 chunk（≤ 64）；各头分给各个线程，每个头只卷积自己的
// 通道，卷积的结果不写回内存。Dk、Dv 要是 16 的倍数（调用的人查）。一块一块地走，块界只看位置：同一段输入一次给完，
// 与切成块长整数倍的几段分几次给，结果逐位相同
void delta_chunks(const DeltaNet* p, const void* proj, int64_t x_bf16, int64_t sb, int64_t ld, int64_t B, int64_t T,
                  const float* conv, const float* beta, const float* g, float* S, int64_t chunk, float* out) {
  const int64_t Dk = p->Dk, Dv = p->Dv, key = p->Hk * Dk, C = 2 * key + p->Hv * Dv, group = p->Hv / p->Hk;
#pragma omp parallel
  {
    FlushDenormals flush;
    Scratch s(chunk, Dk, Dv);
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < B * p->Hv; ++bh) {
      const int64_t b = bh / p->Hv, h = bh % p->Hv, hk = h / group;  // 相邻 group 个值头共用 q、k
      const float* past = conv + b * (p->K - 1) * C;
      const float *bb = beta + b * T * p->Hv, *gb = g + b * T * p->Hv;
      float *Sh = S + bh * Dk * Dv, *ob = out + b * T * p->Hv * Dv;
      if (x_bf16) {
        const Source<uint16_t> src{static_cast<const uint16_t*>(proj) + b * sb, ld, past, p->conv_w, p->K, C, hk * Dk, key + hk * Dk,
                                   2 * key + h * Dv};
        chunk_head(*p, src, T, h, bb, gb, Sh, chunk, ob, s);
      } else {
        const Source<float> src{static_cast<const float*>(proj) + b * sb, ld, past, p->conv_w, p->K, C, hk * Dk, key + hk * Dk,
                                2 * key + h * Dv};
        chunk_head(*p, src, T, h, bb, gb, Sh, chunk, ob, s);
      }
    }
  }
}
}
