// 附录 · 几个 C++ 源文件共用的向量小工具：deltanet.cpp 的分块形式、attention.cpp 的预填充注意力（mul_rows、exp16），
// norm.cpp 与归一化（sum_squares），layer.cpp 的激活与路由（exp_poly）。
//
// 16 个 float32 一个向量（GCC 的向量扩展：AVX-512 上是一个寄存器，AVX2 上编译器拆成两个，别的 CPU 上拆得更碎），
// 一个 exp（exp_poly，layer.cpp 的激活与路由也用它）与它的 16 宽版本，和“几行乘一个矩阵”（mul_rows：4 行 × 64 列的
// 累加器放在寄存器里，权重的一行读一次乘 4 行）。
// -ffp-contract=off（kernel.py）：乘加要 FMA 就明写（fma16）。不包含 <immintrin.h>：它有几万行，每个源文件编译时光读它
// 就要 0.3 s，而第一次运行要等编译（第 14 章）。

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

typedef float v16 __attribute__((vector_size(64)));  // 16 个 float32：AVX-512 的一个寄存器，AVX2 上编译器拆成两个
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline v16 load16(const uint16_t* p) {  // 16 个 bfloat16：补上低 16 位的 0 就是 float32
  v16h h;
  std::memcpy(&h, p, sizeof h);
  return (v16)(__builtin_convertvector(h, v16i) << 16);
}

// e^x，|x| 夹在 87 以内：x = n·ln2 + r（ln2 分成两段，n·C1 是精确的），e^r 用 Cephes 的 expf 多项式，再乘 2^n（直接拼出指数位）。
// 只有加、乘与位运算，没有分支：编译器把循环向量化，向量的部分与标量的尾巴是同一串运算，结果逐位相同（误差约 1 ulp）
inline float exp_poly(float x) {
  x = std::min(87.0f, std::max(-87.0f, x));
  const float t = x * 1.44269504088896341f + 12582912.0f;  // 加 1.5·2^23：就近舍入到整数 n，n 在尾数的低位里
  const float n = t - 12582912.0f;
  int32_t bits;
  std::memcpy(&bits, &t, sizeof bits);
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const int32_t e = ((bits - 0x4B400000) + 127) << 23;  // 2^n 的位
  float two_n;
  std::memcpy(&two_n, &e, sizeof two_n);
  return p * two_n;
}

// 16 个一起的 exp_poly（长的提示词里 SiLU、softmax 要算上百万次 exp）：定长的循环，编译器整个向量化，每个数的运算与
// exp_poly 逐位相同
inline v16 exp16(v16 x) {
  v16 y;
  for (int i = 0; i < 16; ++i) y[i] = exp_poly(x[i]);
  return y;
}

// Σ x²：16 个一组分开加（16 条互不等待的加法链，可以向量化），最后 16 个部分和按固定的顺序加起来，再加上不满 16 个的尾巴
inline float sum_squares(const float* x, int64_t D) {
  v16 acc{};
  int64_t i = 0;
  for (; i + 16 <= D; i += 16) acc += load16(x + i) * load16(x + i);
  float s = 0.0f;
  for (int j = 0; j < 16; ++j) s += acc[j];
  for (; i < D; ++i) s += x[i] * x[i];
  return s;
}

inline v16 silu16(v16 x) { return x / (1.0f + exp16(-x)); }

// acc + a·x（-ffp-contract=off：FMA 要明写）。用的是 <immintrin.h> 里 _mm512_fmadd_ps、_mm256_fmadd_ps 背后的编译器内建函数
// （GCC 与 Clang 同名），不包含那个头文件；AVX2 上两半各一条，别的 CPU 上先乘再加
typedef float v8 __attribute__((vector_size(32)));
inline v16 fma16(v16 acc, v16 x, float a) {
#if defined(__AVX512F__)
  return __builtin_ia32_vfmaddps512_mask(x, v16{} + a, acc, -1, 4);  // 4：_MM_FROUND_CUR_DIRECTION
#elif defined(__FMA__)
  v8 half[2], xs[2];
  std::memcpy(half, &acc, sizeof acc), std::memcpy(xs, &x, sizeof x);
  for (int i = 0; i < 2; ++i) half[i] = __builtin_ia32_vfmaddps256(xs[i], v8{} + a, half[i]);
  std::memcpy(&acc, half, sizeof acc);
  return acc;
#else
  return acc + a * x;
#endif
}

// R 行（R ≤ 4）× 16·NV 列的一小块：Y[r, :] (+)= Σ_i X[r, i] · W[i, :]，i 从 0 到 K−1，累加器在寄存器里
template <int R, int NV>
void tile16(const float* X, int64_t ldx, int64_t K, const float* W, int64_t ldw, float* Y, int64_t ldy, bool add) {
  v16 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = add ? load16(Y + r * ldy + 16 * c) : v16{};
  for (int64_t i = 0; i < K; ++i) {
    v16 w[NV];
    for (int c = 0; c < NV; ++c) {
      w[c] = load16(W + i * ldw + 16 * c);
#if defined(__AVX512F__)
      __asm__("" : "+v"(w[c]));  // 留在寄存器里：不然编译器让每条 FMA 各从内存读一遍，读的次数是乘加的 R 倍
#endif
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < NV; ++c) acc[r][c] = fma16(acc[r][c], w[c], X[r * ldx + i]);
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) std::memcpy(Y + r * ldy + 16 * c, &acc[r][c], sizeof(v16));
}

template <int R>
void tile_rows(const float* X, int64_t ldx, int64_t K, const float* W, int64_t ldw, int64_t N, float* Y, int64_t ldy, bool add) {
  int64_t c = 0;
  for (; c + 64 <= N; c += 64) tile16<R, 4>(X, ldx, K, W + c, ldw, Y + c, ldy, add);
  for (; c < N; c += 16) tile16<R, 1>(X, ldx, K, W + c, ldw, Y + c, ldy, add);
}

// Y [R, N] (+)= X [R, K] · W [K, N]（各自的行距 ldx、ldw、ldy；N 是 16 的倍数）：每 4 行一组。不内联：十来处调用各展开
// 一份要多编译好几百毫秒，调用本身的开销比一次乘积小得多
__attribute__((noinline)) void mul_rows(const float* X, int64_t ldx, int64_t R, int64_t K, const float* W, int64_t ldw, int64_t N, float* Y, int64_t ldy,
              bool add) {
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) tile_rows<4>(X + r * ldx, ldx, K, W, ldw, N, Y + r * ldy, ldy, add);
  for (; r < R; ++r) tile_rows<1>(X + r * ldx, ldx, K, W, ldw, N, Y + r * ldy, ldy, add);
}

}  // namespace
