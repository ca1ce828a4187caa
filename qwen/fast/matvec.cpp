// 附录 · 分块布局的矩阵乘几行输入：y[m, 32b + j] = Σ_i x[m, i] · w[b, i, j]（权重 w [B, in, 32]，见 linear.py 的 to_blocks）。
//
// 解码一步读一遍全部权重，速度的上限是内存带宽；这个内核就做这一件事：逐块顺序读权重，每读 32 个数，就乘加进每一行的
// 32 个累加器（4 个 8 宽的向量）。几行输入共用一次读权重（验证 k 个草稿读的字节与解码一个 token 一样多）。
//
// 每一行的求和顺序是固定的：沿输入维 i 从头到尾、每个输出一个累加器，与同时算几行、几个线程、哪个线程无关——
// 投机解码验证的每一行与单独解码那个 token 逐位相同（第 14 章）。所以编译时不许编译器把乘、加合成 FMA
// （-ffp-contract=off），要 FMA 就在代码里明写（madd），每一行都一样。
//
// 由 kernel.py 用这台机器的 C++ 编译器编译一次（-O3 -march=native），按机器与 torch 版本缓存在磁盘上。

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#if defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

typedef float v8f __attribute__((vector_size(32)));  // 8 个 float32：AVX2 的一个寄存器（别的 CPU 上编译器拆成两半）
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef int8_t v8b __attribute__((vector_size(8)));

constexpr int BLOCK = 32;            // 每块的输出个数
constexpr int LANES = BLOCK / 8;     // 每行 4 个累加向量
constexpr int GROUP = 3;             // 一次最多乘几行：3 行 × 4 个累加向量 + 3 个广播的输入，正好放进 16 个寄存器

inline v8f madd(v8f acc, v8f x, v8f w) {  // acc + x·w
#if defined(__FMA__)
  return (v8f)_mm256_fmadd_ps((__m256)x, (__m256)w, (__m256)acc);
#else
  return acc + x * w;
#endif
}

// 读 8 个权重，转成 float32
inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline v8f load8(const c10::BFloat16* p) {  // bfloat16 就是 float32 的高 16 位
  v8h h;
  std::memcpy(&h, p, sizeof h);
  v8u u = __builtin_convertvector(h, v8u) << 16;
  v8f f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline v8f load8(const int8_t* p) {  // int8（quantize="int8"）：比例在累加完之后再乘
  v8b b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(__builtin_convertvector(b, v8i), v8f);
}

// G 行输入 x [G, in] 乘一块权重 w [in, 32] → out [G, 32]
template <typename W, int G>
void block_rows(const float* x, int64_t n_in, const W* w, float* out) {
  v8f acc[G][LANES];
  for (int g = 0; g < G; ++g)
    for (int k = 0; k < LANES; ++k) acc[g][k] = v8f{};
  for (int64_t i = 0; i < n_in; ++i) {
    v8f xs[G];
    for (int g = 0; g < G; ++g) xs[g] = v8f{} + x[g * n_in + i];  // 第 g 行的 x[i] 广播成 8 份
    for (int k = 0; k < LANES; ++k) {
      v8f wv = load8(w + i * BLOCK + k * 8);
      for (int g = 0; g < G; ++g) acc[g][k] = madd(acc[g][k], xs[g], wv);
    }
  }
  std::memcpy(out, acc, sizeof acc);
}

template <typename W>
void run(const float* x, int64_t M, int64_t n_in, const W* w, const float* scales, float* y, int64_t B) {
  // 按块分给各个线程（每块 32 个输出互不相干）；每个线程顺序读自己那些块。行多于 GROUP 时每块分几次乘，
  // 后几次读的是刚读过、还在缓存里的那块
  at::parallel_for(0, B, 16, [&](int64_t b0, int64_t b1) {
    float acc[GROUP * BLOCK];
    for (int64_t b = b0; b < b1; ++b) {
      const W* wb = w + b * n_in * BLOCK;
      for (int64_t m = 0; m < M; m += GROUP) {
        int64_t g = M - m < GROUP ? M - m : GROUP;
        if (g == 3) block_rows<W, 3>(x + m * n_in, n_in, wb, acc);
        else if (g == 2) block_rows<W, 2>(x + m * n_in, n_in, wb, acc);
        else block_rows<W, 1>(x + m * n_in, n_in, wb, acc);
        for (int64_t r = 0; r < g; ++r) {
          float* yr = y + (m + r) * B * BLOCK + b * BLOCK;
          for (int j = 0; j < BLOCK; ++j) yr[j] = scales ? acc[r * BLOCK + j] * scales[b * BLOCK + j] : acc[r * BLOCK + j];
        }
      }
    }
  });
}

// x [M, in]（float32 或 bfloat16）乘 blocks [B, in, 32]（float32、bfloat16 或 int8），scales [B, 32] 或 None → [M, B·32]，dtype 同 x
at::Tensor matvec(const at::Tensor& x, const at::Tensor& blocks, const std::optional<at::Tensor>& scales) {
  TORCH_CHECK(x.dim() == 2 && blocks.dim() == 3 && blocks.size(2) == BLOCK && x.size(1) == blocks.size(1),
              "matvec: 要 x [M, in] 与 blocks [B, in, 32]");
  auto xf = x.to(at::kFloat).contiguous();
  auto w = blocks.contiguous();
  int64_t M = x.size(0), n_in = x.size(1), B = blocks.size(0);
  auto y = at::empty({M, B * BLOCK}, x.options().dtype(at::kFloat));
  at::Tensor s;
  if (scales.has_value()) s = scales->to(at::kFloat).contiguous();
  const float* sp = scales.has_value() ? s.data_ptr<float>() : nullptr;
  const float* xp = xf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  switch (w.scalar_type()) {
    case at::kFloat: run(xp, M, n_in, w.data_ptr<float>(), sp, yp, B); break;
    case at::kBFloat16: run(xp, M, n_in, w.data_ptr<c10::BFloat16>(), sp, yp, B); break;
    case at::kChar: run(xp, M, n_in, w.data_ptr<int8_t>(), sp, yp, B); break;
    default: TORCH_CHECK(false, "matvec: 权重只能是 float32、bfloat16 或 int8");
  }
  return y.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(qwen_fast, m) {  // FRAGMENT：同一个名字空间里还有 layers.py 在 Python 里定义的算子
  m.def("matvec(Tensor x, Tensor blocks, Tensor? scales) -> Tensor");
  m.impl("matvec", c10::DeviceType::CPU, &matvec);
}
