// 附录 · 零中心 RMSNorm 的一次调用（公式见第 3 章 norm.py）：y = x / sqrt(mean(x²) + eps) · scale，scale = 1 + w 换布局时算好。
//
// 解码一个 token 要做六十多次归一化，每次只有一两千个数：PyTorch 里它是五六个小运算（平方、求均值、加、开方、两次乘），
// 每个都有一份与大小无关的固定开销，还要拿着 GIL（几个请求一起生成时一个接一个地排队，见附录 qwen/serve）。这里一次做完、
// 放开 GIL。每一行各算各的（同一串运算，与一次算几行、分给几个线程无关）：验证的行与单独解码的行逐位相同（第 14 章）。

#include <cmath>
#include <cstdint>
#include <cstring>

#include <omp.h>

typedef float v16 __attribute__((vector_size(64)));  // 16 个 float32（AVX-512 一个寄存器；别的 CPU 上编译器拆开）

// Σ x²：16 个一组分开加（16 条互不等待的加法链，可以向量化），最后 16 个部分和按固定的顺序加起来，再加上不满 16 个的尾巴
inline float sum_squares(const float* x, int64_t D) {
  v16 acc{};
  int64_t i = 0;
  for (; i + 16 <= D; i += 16) {
    v16 v;
    std::memcpy(&v, x + i, sizeof v);
    acc += v * v;
  }
  float s = 0.0f;
  for (int j = 0; j < 16; ++j) s += acc[j];
  for (; i < D; ++i) s += x[i] * x[i];
  return s;
}

extern "C" void rms_norm(const float* x, int64_t rows, int64_t D, const float* scale, float eps, float* y) {
#pragma omp parallel for schedule(static) if (rows * D >= 65536 && !omp_in_parallel())  // 预填充的几百行分给各个线程
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * D;
    float* yr = y + r * D;
    const float inv = 1.0f / std::sqrt(sum_squares(xr, D) / D + eps);
    for (int64_t i = 0; i < D; ++i) yr[i] = xr[i] * inv * scale[i];
  }
}
