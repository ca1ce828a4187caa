// 附录 · 零中心 RMSNorm 的一次调用（公式见第 3 章 norm.py）：y = x / sqrt(mean(x²) + eps) · scale，scale = 1 + w 换布局时算好。
//
// 解码一个 token 要做六十多次归一化，每次只有一两千个数：PyTorch 里它是五六个小运算（平方、求均值、加、开方、两次乘），
// 每个都有一份与大小无关的固定开销，还要拿着 GIL（几个请求一起生成时一个接一个地排队，见附录 qwen/serve）。这里一次做完、
// 放开 GIL。每一行各算各的（同一串运算，与一次算几行、分给几个线程无关）：验证的行与单独解码的行逐位相同（第 14 章）。

#include <cmath>
#include <cstdint>
#include <cstring>

#include <omp.h>

#include "simd.h"  // sum_squares

extern "C" void rms_norm(const float* x, int64_t rows, int64_t D, const float* scale, float eps, float* y) {
#pragma omp parallel for schedule(static) if (rows * D >= 65536 && !omp_in_parallel())  // 预填充的几百行分给各个线程
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * D;
    float* yr = y + r * D;
    const float inv = 1.0f / std::sqrt(sum_squares(xr, D) / D + eps);
    for (int64_t i = 0; i < D; ++i) yr[i] = xr[i] * inv * scale[i];
  }
}
