// 附录 · 长的预填充在 AMX 的矩阵单元上乘（Intel Xeon 的 Sapphire Rapids 之后；linear.py 的 BlockedLinear.forward 用）。
//
// 解码只有几行输入，时间花在读权重上（matvec.cpp）；预填充有几十到几百行，时间花在乘法上。AMX 有 8 个“块”寄存器
// （每个 16 行 × 64 字节），一条 tdpbf16ps 把 A 块（16 行 × 32 个 bfloat16）乘 B 块（16 对 × 16 列，每列一对输入）累加进
// C 块（16 × 16 个 float32）：一条指令 16·16·32 次乘加。B 块要求两个输入一对地排——bfloat16 的模型在有 AVX-512 BF16 的
// CPU 上本来就这样存（to_pairs：[⌈out/32⌉, in/2, 32, 2]，一块的一行是 32 个输出的一对输入，128 字节），所以这里直接从
// 分块布局读 B 块（步长 128 字节），不必像 F.linear 那样先把整个矩阵拼回普通布局（每次预填充都多一遍复制）。
//
// 每个 32 个输出的块（OpenMP 分给各线程）：行按 32 一组（两个 A 块），输入按 32 一段（两个 B 块：前 16 个、后 16 个输出），
// 4 个 C 块累加；一块的权重（in × 32 × 2 字节，0.8B 上至多 229 KB）在 L2 里被每组行重读。求和在 float32 里，按输入的顺序，
// 最后舍入成 bfloat16（round-to-nearest-even，vcvtneps2bf16）。int8、int4 的矩阵没有这种排法：每块先在线程自己的缓冲里
// 换成一对一对的 bfloat16（与 linear.py 的 dense() 逐位相同），再同样地乘——换一块只是几千条向量指令，缓冲留在 L2 里。
// 用之前进程要向 Linux 申请块寄存器的状态（arch_prctl ARCH_REQ_XCOMP_PERM，每个进程一次）；kernel.py 先在一个子进程里试
// 一次，记在磁盘上：虚拟机上块指令可能报 SIGILL，那时只有子进程死掉，这里退回 F.linear。
// 参考：Intel 64 and IA-32 Architectures Optimization Reference Manual 的 AMX 一章；oneDNN 的 brgemm。

#include <cstdint>
#include <cstdlib>
#include <cstring>

// 这里的瓦片按每块 32 个输出、每 32 个输入一个 int4 比例写（两个 16 列的瓦片一块）：尺寸变了要重写瓦片，编译时就报出来
static_assert(QWEN_BLOCK == 32 && QWEN_QGROUP == 32, "amx.cpp 的瓦片按 BLOCK = QGROUP = 32 写");

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define QWEN_AMX 1
#endif

extern "C" int amx_compiled() {  // 编进来了没有（-march=native 的 CPU 有 AMX 才有）
#ifdef QWEN_AMX
  return 1;
#else
  return 0;
#endif
}

extern "C" int amx_enable() {  // 向内核申请块寄存器的状态：1 = 可以用了
#ifdef QWEN_AMX
  const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
  return 0;
#endif
}

#ifdef QWEN_AMX
struct TileConfig {  // _tile_loadconfig 要的 64 字节：调色板 1，每个块的行数与每行字节数
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

static void store_bf16(const float* c, uint16_t* y, int64_t ldy) {  // 一个 C 块（16 × 16 float32）→ y 的 16 行 × 16 列
  for (int r = 0; r < 16; r++) {
    __m256bh v = _mm512_cvtneps_pbh(_mm512_loadu_ps(c + 16 * r));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy), (__m256i)v);
  }
}
#endif

#ifdef QWEN_AMX
// 一个 32 个输出的块：x [M, K] 乘 wb [K/2, 32, 2]（一对一对的 bfloat16）→ y 的 32 列（行距 ldy）。
static void block_amx(const uint16_t* x, int64_t M, int64_t K, const uint16_t* wb, uint16_t* y, int64_t ldy) {
  alignas(64) float c[4][256];
  for (int64_t m = 0; m < M; m += 32) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t k = 0; k < K; k += 32) {
      _tile_loadd(4, x + m * K + k, K * 2);  // 16 行 × 32 个输入
      _tile_loadd(5, x + (m + 16) * K + k, K * 2);
      _tile_loadd(6, wb + (k / 2) * 64, 128);  // 16 对 × 前 16 个输出
      _tile_loadd(7, wb + (k / 2) * 64 + 32, 128);  // 16 对 × 后 16 个输出
      _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c[0], 64); _tile_stored(1, c[1], 64);
    _tile_stored(2, c[2], 64); _tile_stored(3, c[3], 64);
    uint16_t* yb = y + m * ldy;
    store_bf16(c[0], yb, ldy); store_bf16(c[1], yb + 16, ldy);
    store_bf16(c[2], yb + 16 * ldy, ldy); store_bf16(c[3], yb + 16 * ldy + 16, ldy);
  }
}

static void load_tiles() {  // 每个线程用块寄存器之前：0–3 是 C，4–5 是 A，6–7 是 B，都是 16 行 × 64 字节
  TileConfig cfg;
  for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

// int8 的一块（to_quads：q [K/4, 32, 4]，一份 4 个输入 × 32 个输出）乘各输出的比例 s [32] → 一对一对的 bfloat16
// wb [K/2, 32, 2]：与 linear.py 的 dense() 逐位相同（int8 转成 float32 乘比例，再按 round-to-nearest-even 舍入成 bfloat16），
// 只是一块一块地做、留在 L2 里，不拼回整个矩阵。一份里第 4j + t 个字节是第 j 个输出、第 t 个输入：按原来的次序转成
// bfloat16，每 32 位就是一个输出的一对输入（t = 0、1 或 2、3），偶数的 32 位归前一对、奇数的归后一对。
static void dequantize_i8(const int8_t* q, const float* s, int64_t K, uint16_t* wb) {
  __m512 sc[8];  // 16 个字节（4 个输出 × 4 个输入）一个：每个输出的比例重复 4 次
  for (int c = 0; c < 8; c++)
    sc[c] = _mm512_permutexvar_ps(_mm512_set_epi32(15, 15, 15, 15, 14, 14, 14, 14, 13, 13, 13, 13, 12, 12, 12, 12) -
                                      _mm512_set1_epi32(12 - 4 * (c % 4)), _mm512_loadu_ps(s + 16 * (c / 4)));
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int64_t P = 0; P < K / 4; P++) {  // 一份 128 个字节
    __m512i bf[4];  // 第 h 个：输出 8h…8h+7 × 4 个输入的 bfloat16
    for (int h = 0; h < 4; h++) {
      auto f = [&](int c) {
        return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + P * 128 + 16 * c)))), sc[c]);
      };
      bf[h] = (__m512i)_mm512_cvtne2ps_pbh(f(2 * h + 1), f(2 * h));
    }
    for (int h = 0; h < 2; h++) {  // 输出 16h…16h+15
      _mm512_storeu_si512(wb + (2 * P) * 64 + 32 * h, _mm512_permutex2var_epi32(bf[2 * h], even, bf[2 * h + 1]));
      _mm512_storeu_si512(wb + (2 * P + 1) * 64 + 32 * h, _mm512_permutex2var_epi32(bf[2 * h], odd, bf[2 * h + 1]));
    }
  }
}

// int4 的一块（quantize_int4：q [K/4, 64] 字节，第 4j + t 个字节的低 4 位是第 j 个输出、第 t 个输入，高 4 位是第 j + 16 个
// 输出，存的是 q + 8；s [K/32, 32] float16）→ 一对一对的 bfloat16 wb [K/2, 32, 2]，同样与 dense() 逐位相同。
static void dequantize_q4(const uint8_t* q, const uint16_t* s, int64_t K, uint16_t* wb) {
  const __m512i low4 = _mm512_set1_epi8(15), eight = _mm512_set1_epi32(8);
  const __m512i dup_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);  // 每个输出的比例重复两次
  const __m512i dup_hi = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
  __m512 sc[4];  // 这一组（32 个输入）的比例：输出 0–7、8–15、16–23、24–31，一对一个
  for (int64_t P = 0; P < K / 4; P++) {  // 一份 64 个字节：4 个输入 × 32 个输出
    if (P % 8 == 0) {
      const __m512 g0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(s + (P / 8) * 32)));
      const __m512 g1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(s + (P / 8) * 32 + 16)));
      sc[0] = _mm512_permutexvar_ps(dup_lo, g0); sc[1] = _mm512_permutexvar_ps(dup_hi, g0);
      sc[2] = _mm512_permutexvar_ps(dup_lo, g1); sc[3] = _mm512_permutexvar_ps(dup_hi, g1);
    }
    const __m512i v = _mm512_loadu_si512(q + P * 64);
    const __m512i nib[2] = {_mm512_and_si512(v, low4), _mm512_and_si512(_mm512_srli_epi16(v, 4), low4)};
    for (int h = 0; h < 2; h++) {  // 低 4 位：输出 0–15；高 4 位：输出 16–31
      for (int r = 0; r < 2; r++) {  // 这 4 个输入里的前一对、后一对：每个 32 位里的低、高 16 位
        __m256i pair = _mm512_cvtepi32_epi16(_mm512_srli_epi32(nib[h], 16 * r));  // 16 个输出 × 一对输入（字节）
        auto f = [&](__m128i b8) { return _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(b8), eight)); };
        __m512 a = _mm512_mul_ps(f(_mm256_castsi256_si128(pair)), sc[2 * h]);
        __m512 b = _mm512_mul_ps(f(_mm256_extracti128_si256(pair, 1)), sc[2 * h + 1]);
        _mm512_storeu_si512(wb + (2 * P + r) * 64 + 32 * h, (__m512i)_mm512_cvtne2ps_pbh(b, a));
      }
    }
  }
}
#endif

#ifdef QWEN_AMX
// 三种矩阵共用的外层：32 个输出一块，分给各线程；pairs_of(b, wb) 给出第 b 块的一对一对的 bfloat16
// （bfloat16 的矩阵直接指进它自己，量化的换进线程自己的缓冲 wb 再指向 wb）。
template <typename PairsOf>
static void gemm_blocks(const uint16_t* x, int64_t M, int64_t K, int64_t nb, uint16_t* y, PairsOf pairs_of) {
#pragma omp parallel
  {
    load_tiles();
    uint16_t* wb = static_cast<uint16_t*>(aligned_alloc(64, K * 64));  // K/2 对 × 32 × 2 个 bfloat16
#pragma omp for schedule(static)
    for (int64_t b = 0; b < nb; b++) block_amx(x, M, K, pairs_of(b, wb), y + b * QWEN_BLOCK, nb * QWEN_BLOCK);
    free(wb);
    _tile_release();
  }
}
#endif

// x [M, K] bfloat16（M 是 32 的倍数，K 是 32 的倍数）乘 w [nb, K/2, 32, 2] → y [M, nb·32] bfloat16。
extern "C" void gemm_pairs_amx(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t nb, uint16_t* y) {
#ifdef QWEN_AMX
  gemm_blocks(x, M, K, nb, y, [&](int64_t b, uint16_t*) { return w + b * (K / 2) * 64; });
#else
  (void)x; (void)M; (void)K; (void)w; (void)nb; (void)y;
#endif
}

// int8 的矩阵（to_quads 的 [nb, K/4, 32, 4] 与每个输出的比例 [nb, 32]）：每块先换成一对一对的 bfloat16，再乘。
extern "C" void gemm_i8_amx(const uint16_t* x, int64_t M, int64_t K, const int8_t* q, const float* scales, int64_t nb,
                            uint16_t* y) {
#ifdef QWEN_AMX
  gemm_blocks(x, M, K, nb, y, [&](int64_t b, uint16_t* wb) {
    dequantize_i8(q + b * K * 32, scales + b * 32, K, wb);
    return static_cast<const uint16_t*>(wb);
  });
#else
  (void)x; (void)M; (void)K; (void)q; (void)scales; (void)nb; (void)y;
#endif
}

// int4 的矩阵（quantize_int4 的 q [nb, K/4, 64] 与比例 [nb, K/32, 32] float16）：同样一块一块地换成 bfloat16 再乘。
extern "C" void gemm_q4_amx(const uint16_t* x, int64_t M, int64_t K, const uint8_t* q, const uint16_t* scales, int64_t nb,
                            uint16_t* y) {
#ifdef QWEN_AMX
  gemm_blocks(x, M, K, nb, y, [&](int64_t b, uint16_t* wb) {
    dequantize_q4(q + b * (K / 4) * 64, scales + b * (K / 32) * 32, K, wb);
    return static_cast<const uint16_t*>(wb);
  });
#else
  (void)x; (void)M; (void)K; (void)q; (void)scales; (void)nb; (void)y;
#endif
}
