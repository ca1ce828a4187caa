// 附录 · 分块布局的矩阵乘几行输入：y[m, 32b + j] = Σ_i x[m, i] · w[b, i, j]（权重 w [B, in, 32]，见 linear.py 的 to_blocks）。
//
// 解码一步读一遍全部权重，速度的上限是内存带宽；这个内核就做这一件事：逐块顺序读权重，每读 32 个数，就乘加进每一行的
// 32 个累加器（AVX-512 上 2 个 16 宽的向量，AVX2 上 4 个 8 宽的）。几行输入共用一次读权重（验证 k 个草稿读的字节与解码
// 一个 token 一样多）。
//
// 每一行的求和顺序是固定的：沿输入维 i 从头到尾、每个输出一个累加器，与同时算几行、几个线程、哪个线程无关——
// 投机解码验证的每一行与单独解码那个 token 逐位相同（第 14 章）。所以编译时不许编译器把乘、加合成 FMA
// （-ffp-contract=off），要 FMA 就在代码里明写（madd），每一行都一样。
//
// 不包含 torch 的头文件（那些头文件很大，编译要久得多）：kernel.py 用这台机器的 C++ 编译器编译一次，用 ctypes 调用，
// 传进来的是张量的数据指针。线程用 OpenMP，与 PyTorch 共用同一个 libgomp，torch.set_num_threads 对它也管用。

#include <algorithm>
#include <array>
#include <type_traits>
#include <utility>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>
#if defined(__AVX__) || defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

typedef float v8f __attribute__((vector_size(32)));  // 8 个 float32：AVX2 的一个寄存器（别的 CPU 上编译器拆成两半）
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

// 一个向量寄存器：有 AVX-512 时 16 个 float32（32 个 zmm 寄存器），否则 8 个（AVX2 的 16 个 ymm）。宽窄只改每条指令算几个
// 输出：每个输出仍是自己的累加器、沿输入维从头到尾乘加，所以两种宽度的结果逐位相同
#if defined(__AVX512F__)
typedef float vec __attribute__((vector_size(64)));
constexpr int WIDTH = 16;
constexpr int GROUP = 8;  // 一次乘几行：8 行 × 2 个累加向量 + 8 个广播的输入，放得进 32 个寄存器
#else
typedef v8f vec;
constexpr int WIDTH = 8;
constexpr int GROUP = 3;  // 3 行 × 4 个累加向量 + 3 个广播的输入，正好放进 16 个寄存器
#endif

#if !defined(QWEN_BLOCK) || !defined(QWEN_QGROUP)
#error "块宽与量化的组长由 kernel.py 编译时给：-DQWEN_BLOCK=… -DQWEN_QGROUP=…（出处 qwen/fast/sizes.py）"
#endif
constexpr int BLOCK = QWEN_BLOCK;     // 每块的输出个数
constexpr int LANES = BLOCK / WIDTH;  // 每行几个累加向量
constexpr int AHEAD = 64;             // 预取提前几个输入（bfloat16 时 64 行 × 64 字节 = 4 KB）

inline vec madd(vec acc, vec x, vec w) {  // acc + x·w
#if defined(__AVX512F__)
  return (vec)_mm512_fmadd_ps((__m512)x, (__m512)w, (__m512)acc);
#elif defined(__FMA__)
  return (vec)_mm256_fmadd_ps((__m256)x, (__m256)w, (__m256)acc);
#else
  return acc + x * w;
#endif
}

inline vec broadcast(float v) {  // WIDTH 份 v。写成 vec{} + v 时编译器要多做一次加法（0 + (−0) 是 +0，不能省）
#if defined(__AVX512F__)
  return (vec)_mm512_set1_ps(v);
#elif defined(__AVX__)
  return (vec)_mm256_set1_ps(v);
#else
  return vec{} + v;
#endif
}

inline float bf16_to_float(uint16_t h) {  // bfloat16 就是 float32 的高 16 位
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// float16（int4 的比例）。不用编译器的 _Float16：GCC 12 之前的 x86 上没有它
inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  if (exp == 0) {  // 0 与次正规数：man · 2^-24
    const float f = std::ldexp(float(man), -24);
    return sign ? -f : f;
  }
  uint32_t u = sign | (exp == 31 ? 0x7f800000 | (man << 13) : ((exp + 112) << 23) | (man << 13));
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t float_to_half(float f) {  // 就近舍入到偶数；|f| ≤ 65504（调用的人保证），不处理 NaN
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint16_t sign = (u >> 16) & 0x8000;
  const float a = std::fabs(f);
  if (a < 6.103515625e-05f) return uint16_t(sign | uint16_t(std::nearbyint(a * 16777216.0f)));  // 次正规数：2^-24 的整数倍
  const uint32_t m = u & 0x7fffff, rest = m & 0x1fff;
  uint32_t h = ((((u >> 23) & 0xff) - 112) << 10) | (m >> 13);
  if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) ++h;  // 进位可以一直进到指数：仍是对的
  return uint16_t(sign | h);
}

inline uint16_t float_to_bf16(float f) {  // 就近舍入到偶数（与 PyTorch 的 .bfloat16() 相同；不处理 NaN）
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return uint16_t((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

// 结果 y [M, B·32]：float32，或 bfloat16（bfloat16 的模型：舍入与 PyTorch 的 .to(torch.bfloat16) 相同），调用的人不必再转一次
struct Out {
  void* p;
  bool bf16;
  void put(int64_t at, const float* v) const {  // 从第 at 个数起写 32 个
    if (!bf16) {
      std::memcpy(static_cast<float*>(p) + at, v, BLOCK * sizeof(float));
      return;
    }
    uint16_t* o = static_cast<uint16_t*>(p) + at;
    for (int j = 0; j < BLOCK; ++j) o[j] = float_to_bf16(v[j]);
  }
};

// 读 WIDTH 个权重，转成 float32
inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vec load(const uint16_t* p) {  // bfloat16：补上低 16 位的 0 就是 float32
#if defined(__AVX512F__)
  return (vec)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
#elif defined(__AVX2__)  // 一条 vpmovzxwd 读 8 个（通用的写法 GCC 拆成两半再拼起来，慢得多）
  return (vec)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
#else
  v8h h;
  std::memcpy(&h, p, sizeof h);
  v8u u = __builtin_convertvector(h, v8u) << 16;
  vec f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}
// bfloat16 的模型（输入本来就是 bfloat16 的值）在有 AVX-512 BF16 的 CPU 上：一条 vdpbf16ps 把相邻两个输入的两个积
// 加进一个 float32（Intel 的定义：先加第 2i+1 个的积、舍入，再加第 2i 个的、舍入；bfloat16 的积在 float32 里是精确的；
// 次正规数当 0），一条指令 32 次乘加，不必先把权重转成 float32。权重按两个输入一对存放：Pair 是一块里一个输出的
// (w[2i], w[2i+1])，一块 [in/2, 32] 对；输入也两个一对（x 里存的是一对 bfloat16 的位，不是 float32）。
// 每个输出仍是自己的累加器、沿输入维一对一对从头到尾：与一次算几行无关。没有这条指令的 CPU 用不到它（kernel.py 不建
// 这种布局），下面的标量写法只是把定义写出来
struct Pair {
  uint32_t two;
};
inline vec load(const Pair* p) {
  vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vec broadcast_bits(const float* p) {  // 一对 bfloat16 的 32 位原样广播（不当作 float32 运算）
  uint32_t u;
  std::memcpy(&u, p, sizeof u);
  typedef uint32_t vu __attribute__((vector_size(WIDTH * 4)));
  return (vec)(vu{} + u);
}
inline vec dot_pairs(vec acc, vec x, vec w) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  return (vec)_mm512_dpbf16_ps((__m512)acc, (__m512bh)w, (__m512bh)x);
#else
  typedef uint32_t vu __attribute__((vector_size(WIDTH * 4)));
  vu xu = (vu)x, wu = (vu)w;
  for (int j = 0; j < WIDTH; ++j) {
    acc[j] += bf16_to_float(xu[j] >> 16) * bf16_to_float(wu[j] >> 16);
    acc[j] += bf16_to_float(xu[j] & 0xffff) * bf16_to_float(wu[j] & 0xffff);
  }
  return acc;
#endif
}

// G 行输入 x [G, in] 乘相邻的 N 块权重 w [N, in, 32] → out [N, G, 32]。一行只乘一两块时累加链太少：每个乘加要等上一个
// 乘加（同一个累加器）的结果，几个时钟周期才出来；同时乘相邻的几块，链多了，乘加单元不必空等。每个输出仍是自己的
// 累加器、沿输入维从头到尾乘加，同时乘几块、几行都不改变它的结果
// ahead：预取提前几个权重。几行一起乘时计算更重，先要后面的权重让内存与乘加重叠；只有一两行时这台 Zen 4 上不预取反而
// 更快（硬件自己的预取已经跟得上，多出来的预取指令只添乱；数字见 docs/performance.md），调用的人给 0：预取的是正要读的那一行
template <typename W, int G, int N>
void block_rows(const float* x, int64_t n_in, const W* w, int64_t ahead, float* out) {
  vec acc[N][G][LANES];
  for (int n = 0; n < N; ++n)
    for (int g = 0; g < G; ++g)
      for (int k = 0; k < LANES; ++k) acc[n][g][k] = vec{};
  for (int64_t i = 0; i < n_in; ++i) {
    vec xs[G];
    for (int g = 0; g < G; ++g) {  // 第 g 行的 x[i] 广播成 WIDTH 份
      if constexpr (std::is_same_v<W, Pair>) xs[g] = broadcast_bits(x + g * n_in + i);
      else xs[g] = broadcast(x[g * n_in + i]);
    }
    for (int n = 0; n < N; ++n) {
      const W* wn = w + n * n_in * BLOCK + i * BLOCK;
      __builtin_prefetch(wn + ahead);  // 先要后面的权重：乘加的同时内存已在送下一段（越过块尾就是下一块）
      for (int k = 0; k < LANES; ++k) {
        vec wv = load(wn + k * WIDTH);
        for (int g = 0; g < G; ++g) {
          if constexpr (std::is_same_v<W, Pair>) acc[n][g][k] = dot_pairs(acc[n][g][k], xs[g], wv);
          else acc[n][g][k] = madd(acc[n][g][k], xs[g], wv);
        }
      }
    }
  }
  std::memcpy(out, acc, sizeof acc);
}

// 浮点的块一次乘相邻的几块（1、2 或 4）：一组 rows 行、每行 LANES 个累加向量，一共至多 acc = FLOAT_ACC 个（其余寄存器放
// 广播的输入与权重），行少时就多乘几块（整数的块一次只乘一块，见 matvec_quantized）
constexpr int FLOAT_ACC = WIDTH == 16 ? 16 : 8;
constexpr int64_t adjacent_blocks(int acc, int64_t rows) {
  const int64_t fit = acc / (LANES * rows);
  return fit >= 4 ? 4 : fit >= 2 ? 2 : 1;
}

// 每个线程的一段连续的块里，一次乘几块、每块分几组乘几行。N 由整个矩阵的行数定（adjacent_blocks），一组的行数 G 不超过
// 它，而行越多块越少：只有 adjacent_blocks(acc, G) ≥ N 的组合会被调用。别的组合不展开（表里留空），第一次编译快得多
// （数字见 docs/performance.md）
template <typename W>
using RowsFn = void (*)(const float*, int64_t, const W*, int64_t, float*);
template <typename W, int G, int N>
constexpr RowsFn<W> rows_entry() {
  if constexpr (adjacent_blocks(FLOAT_ACC, G) >= N) return &block_rows<W, G, N>;
  else return nullptr;
}
template <typename W, int N, size_t... G>
std::array<RowsFn<W>, sizeof...(G)> make_table(std::index_sequence<G...>) {
  return {rows_entry<W, int(G) + 1, N>()...};
}
template <typename W, int N>
RowsFn<W> rows_of(int64_t g) {  // block_rows<W, g, N>
  static const auto table = make_table<W, N>(std::make_index_sequence<GROUP + 1>{});
  return table[g - 1];
}

// 带 AVX-512 的 AMD（Zen 4 起）：硬件预取跟得上一对一对的 bfloat16 与 int8，软件预取在 1～32 行都只添乱（数字见
// docs/performance.md）。运行时问一次 CPU 的厂商：同一个 .so 在别的 x86 上照旧
inline bool amd_avx512() {
#if defined(__AVX512F__) && (defined(__x86_64__) || defined(__i386__))
  static const bool yes = __builtin_cpu_is("amd");
  return yes;
#else
  return false;
#endif
}

// 软件预取提前多少（W 的个数）。行少时每个输入算得快，硬件的预取跟得上，软件预取反而占了读内存的位置；行多时每个输入
// 算得久，软件预取让内存在乘加的同时送下一段（分界在这台机器上量出，见 docs/performance.md）。一对一对的 bfloat16 一条指令
// 乘加两个输入，同样的行数算得快一倍，分界也翻倍；它每个输入（一对）128 字节，提前的输入减半：字节数与 bfloat16 一样
template <typename W>
int64_t ahead(int64_t M) {
  if constexpr (std::is_same_v<W, Pair>) return M > 4 && !amd_avx512() ? AHEAD / 2 * BLOCK : 0;
  else return M > 2 ? AHEAD * BLOCK : 0;
}

// 乘 w 的第 b…b+N−1 块（N 块相邻）：行多于 GROUP 时每块分几组乘，后几组读的是刚读过、还在缓存里的那几块。AVX2 上行数
// 除以 GROUP 余 1 时（4、7、10……行）第一组乘 4 行：不然最后一组只有 1 行，为它把权重再转一遍 float32。4 行的 16 个
// 累加向量放不下寄存器，编译器把几个留在 L1 里，乘加慢一些；放在第一组，正好与从内存读这一块的时间重叠
// 第 m0…m1−1 行（M = m1 − m0）
template <typename W, int N>
void tile(const float* x, int64_t m0, int64_t m1, int64_t n_in, const W* w, Out y, int64_t B, int64_t b) {
  float acc[N * (GROUP + 1) * BLOCK];
  const int64_t M = m1 - m0;
  for (int64_t m = m0, g = 0; m < m1; m += g) {
    g = WIDTH == 8 && m == m0 && M > 1 && M % GROUP == 1 ? GROUP + 1 : std::min<int64_t>(m1 - m, GROUP);
    rows_of<W, N>(g)(x + m * n_in, n_in, w + b * n_in * BLOCK, ahead<W>(M), acc);
    for (int n = 0; n < N; ++n)
      for (int64_t r = 0; r < g; ++r)
        y.put((m + r) * B * BLOCK + (b + n) * BLOCK, acc + (n * g + r) * BLOCK);
  }
}

// 行多时（预填充）一段一段地乘：一段的输入（约 256 KB）留在 L2 里，各块挨个读它。不分段时每一块都要把全部行的输入
// 从 L3、内存再读一遍（512 行 × 3584 个输入的 int8 就是 1.8 MB，再乘 32 块）。一段几行（group 的倍数；每行 row_bytes
// 字节）；每一行的结果与分不分段无关
inline int64_t chunk_rows(int64_t M, int64_t row_bytes, int64_t group) {
  return std::min<int64_t>(M, std::max<int64_t>(group, 262144 / row_bytes / group * group));
}

// 按块分给各个线程（每块 32 个输出互不相干），每个线程顺序读自己那一段：每 N 块一份，tile(n, b) 乘第 b 起的 n 块
// （n 是编译期的常数 1、2 或 4，至多 MAXN；不够 N 块的尾巴一块一块地乘）。work 很小的矩阵不值得叫醒别的线程；已经在
// 并行区里（layer.cpp 的专家混合：两个线程各乘几个专家）时不再另开线程，不然每个线程又各叫醒一队，线程比核多
template <int MAXN, typename F>
void for_tiles(int64_t B, int64_t N, int64_t work, F tile) {
  const int64_t tiles = (B + N - 1) / N;
#pragma omp parallel for schedule(static) if (work >= 32768 && !omp_in_parallel())
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t b = t * N;
    if constexpr (MAXN >= 4)
      if (N == 4 && b + 4 <= B) {
        tile(std::integral_constant<int, 4>{}, b);
        continue;
      }
    if constexpr (MAXN >= 2)
      if (N == 2 && b + 2 <= B) {
        tile(std::integral_constant<int, 2>{}, b);
        continue;
      }
    for (int64_t c = b; c < std::min(B, b + N); ++c) tile(std::integral_constant<int, 1>{}, c);
  }
}

// x [M, in] float32 乘 w [B, in, 32] → y [M, B·32] float32
template <typename W>
void matvec(const float* x, int64_t M, int64_t n_in, const W* w, Out y, int64_t B) {
  const int64_t N = adjacent_blocks(FLOAT_ACC, std::min<int64_t>(M, GROUP));
  const int64_t rows = chunk_rows(M, n_in * 4, GROUP);
  for (int64_t m0 = 0; m0 < M; m0 += rows)
    for_tiles<4>(B, N, B * n_in, [&](auto n, int64_t b) {
      tile<W, decltype(n)::value>(x, m0, std::min(M, m0 + rows), n_in, w, y, B, b);
    });
}

// 加载时换布局：矩阵 src [n, in] 是上下拼接的大矩阵里从第 row0 行起的 n 行，写进分块布局 out [B, in, 32] 里对应的位置，
// 顺便从 S 转成 D。一次读、一次写：不必先转 dtype、再拼接、再转置，各复制一遍
// pairs：bfloat16 按两个输入一对存放（Pair 的布局，[B, ⌈in/2⌉, 32, 2]；输入维是奇数时最后一对的后一个由调用的人补 0）
template <typename S, typename D, typename F>
void to_blocks(const S* src, int64_t n, int64_t n_in, int64_t row0, D* out, F convert, bool pairs = false) {
  int64_t b0 = row0 / BLOCK, b1 = (row0 + n + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static)
  for (int64_t b = b0; b < b1; ++b) {
    int64_t j0 = std::max<int64_t>(row0, b * BLOCK) - b * BLOCK, j1 = std::min<int64_t>(row0 + n, (b + 1) * BLOCK) - b * BLOCK;
    D* ob = out + b * (pairs ? (n_in + 1) / 2 * 2 : n_in) * BLOCK;
    D tile[BLOCK][16];  // 32 行 × 16 个输入：先按行连续地读进来（转好 dtype），再按列写出去，都在 L1 里
    for (int64_t i0 = 0; i0 < n_in; i0 += 16) {
      int64_t w = std::min<int64_t>(16, n_in - i0);
      for (int64_t j = j0; j < j1; ++j) {
        const S* row = src + (b * BLOCK + j - row0) * n_in + i0;
        for (int64_t ii = 0; ii < w; ++ii) tile[j][ii] = convert(row[ii]);
      }
      for (int64_t ii = 0; ii < w; ++ii)
        for (int64_t j = j0; j < j1; ++j) {
          const int64_t i = i0 + ii;
          ob[pairs ? ((i / 2) * BLOCK + j) * 2 + i % 2 : i * BLOCK + j] = tile[j][ii];
        }
    }
  }
}

// 对称的逐行 int8（linear.py 的 quantize_int8 的公式）：s = max|w 的这一行| / 127（全零的行取 1e-12 / 127），
// q = round(w / s)，一行读两遍（求最大值、量化），各行交给各个线程
template <typename S, typename F>
void quantize_int8(const S* w, int64_t n, int64_t n_in, int8_t* q, float* scale, F convert) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; ++r) {
    const S* row = w + r * n_in;
    float part[16] = {};  // 16 份各自的最大值：定长的内层循环，编译器向量化（取最大值与先后无关，结果不变）
    int64_t i = 0;
    for (; i + 16 <= n_in; i += 16)
      for (int k = 0; k < 16; ++k) part[k] = std::max(part[k], std::fabs(convert(row[i + k])));
    float m = 0.0f;
    for (; i < n_in; ++i) m = std::max(m, std::fabs(convert(row[i])));
    for (int k = 0; k < 16; ++k) m = std::max(m, part[k]);
    float s = std::max(m, 1e-12f) / 127.0f;
    scale[r] = s;
    for (int64_t i = 0; i < n_in; ++i)
      q[r * n_in + i] = int8_t(std::min(127.0f, std::max(-127.0f, std::nearbyint(convert(row[i]) / s))));
  }
}

// 换布局、量化时逐个元素的转换。写成 lambda（每个是自己的类型）而不是函数指针：模板按它展开时转换内联进循环，循环才能
// 向量化；传函数指针时每个元素都是一次调用
constexpr auto same = [](float v) { return v; };
constexpr auto from_bf16 = [](uint16_t v) { return bf16_to_float(v); };
constexpr auto to_bf16 = [](float v) { return float_to_bf16(v); };

// ---------- int8、int4（quantize="int8"、"int4"）：整数点积 ----------
//
// 量化的权重还原成 float32 再乘加，每个权重要好几条指令（取出、转换、乘比例），解码就被计算卡住，读的字节再少也快不起来。
// 像 llama.cpp 的 Q8_0、Q4_0 那样换成整数：输入 x 每 32 个一组量化成 int8（dx = max|x| / 127，xq = round(x / dx)），
// 一条 vpdpbusd（AVX-512 VNNI）把 4 对 u8 × s8 的积加进一个 int32：一条指令 64 次乘加。一组 32 个输入的整数和是精确的，
// 与怎样分组、几行一起算、用哪种指令都无关；每组结束时它乘上这一组的比例、乘加进 float32 的累加器，沿输入维一组一组
// 从头到尾：每一行的结果与单独乘它时逐位相同，验证的行就是解码的行。
//
// 分块布局：一块（32 个输出）的输入按 4 个一份。int8 一份 128 个字节：第 4j + t 个字节是第 j 个输出、第 t 个输入的 q
// （int8，比例是每个输出一个，乘在最后）。int4 一份 64 个字节：第 4j + t 个字节的低 4 位是第 j 个输出、第 t 个输入，
// 高 4 位是第 j + 16 个输出（j < 16），存的是 q + 8，比例 [块, 组, 32] float16。输入维补到 32 的倍数（补的权重、输入都是 0）。

constexpr int QIN = QWEN_QGROUP;  // 输入每这么多个一组量化（int4 的权重也是每这么多个输入一个比例）
typedef int32_t ivec __attribute__((vector_size(WIDTH * 4)));  // WIDTH 个 int32，或 4·WIDTH 个字节
typedef uint8_t bvec __attribute__((vector_size(WIDTH * 4)));
typedef int8_t svec __attribute__((vector_size(WIDTH * 4)));

#if (defined(__AVX512VNNI__) && defined(__AVX512F__)) || (defined(__AVXVNNI__) && !defined(__AVX512F__))
constexpr bool VNNI = true;
#else
constexpr bool VNNI = false;
#endif

// acc[j] + Σ_t w.u8[4j + t] · x.s8[4j + t]：整数，精确（|w| ≤ 255、|x| ≤ 127；没有 VNNI 时 maddubs 先两两加成 int16，
// 调用的人保证 2·|w|·127 不饱和）
inline ivec dot_u8(ivec acc, ivec w, ivec x) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  return (ivec)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)w, (__m512i)x);
#elif defined(__AVX512BW__) && defined(__AVX512F__)  // u8 × s8 两两相加成 int16，再两两加成 int32
  return acc + (ivec)_mm512_madd_epi16(_mm512_maddubs_epi16((__m512i)w, (__m512i)x), _mm512_set1_epi16(1));
#elif defined(__AVXVNNI__) && !defined(__AVX512F__)
  return (ivec)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)w, (__m256i)x);
#elif defined(__AVX2__) && !defined(__AVX512F__)
  return acc + (ivec)_mm256_madd_epi16(_mm256_maddubs_epi16((__m256i)w, (__m256i)x), _mm256_set1_epi16(1));
#else
  bvec wb = (bvec)w;
  svec xb = (svec)x;
  for (int j = 0; j < WIDTH; ++j)
    for (int t = 0; t < 4; ++t) acc[j] += int32_t(wb[4 * j + t]) * int32_t(xb[4 * j + t]);
  return acc;
#endif
}

// int4 的一份里第 k 个向量：WIDTH 个输出 × 4 个输入的 u8 权重。AVX-512 上 k = 0 低 4 位、1 高 4 位；8 宽时 k = 0、1
// 是前后 32 个字节的低 4 位，2、3 是它们的高 4 位。有 VNNI 时高 4 位不移下来，原地取出（HI = 16 倍的值，0、16…240）：
// 少一条移位，整数和是精确的 16 倍，乘比例时再乘 1/16（2 的幂，不舍入，结果逐位相同）。没有 VNNI 时 maddubs 先把两个积
// 加成 int16，240·127·2 会饱和，所以移下来
constexpr int HI = VNNI ? 16 : 1;
constexpr int HALF = LANES / 2;  // 低 4 位占几个向量
struct Int4 {
  static constexpr int64_t QUAD = 2 * BLOCK;  // 一份几个字节
  static ivec weights(const uint8_t* p, int k) {
    bvec b;
    std::memcpy(&b, p + (k % HALF) * WIDTH * 4, sizeof b);
    return (ivec)(k < HALF ? b & 0x0F : HI == 16 ? b & 0xF0 : (b >> 4) & 0x0F);
  }
  static ivec dot(ivec acc, ivec w, ivec x) { return dot_u8(acc, w, x); }
  static int32_t offset(int k) { return k < HALF ? 8 : 8 * HI; }  // 整数和多出的是 offset · Σ xq（存的是 q + 8）
};

// int8 的一份里第 k 个向量：WIDTH 个输出 × 4 个输入的 s8 权重（|q| ≤ 127）。vpdpbusd 的一边要无符号：有 VNNI 时异或 0x80
// 就是 q + 128（0…254），整数和多出 128 · Σ xq；没有 VNNI 时 maddubs 会饱和（254·127·2），改乘 |q| 与带上 q 的符号的 x
// （127·127·2 不饱和）：整数和与 VNNI 的一样精确，结果逐位相同
struct Int8 {
  static constexpr int64_t QUAD = 4 * BLOCK;
  static ivec weights(const uint8_t* p, int k) {
    ivec w;
    std::memcpy(&w, p + k * WIDTH * 4, sizeof w);
    return VNNI ? w ^ int32_t(0x80808080) : w;
  }
  static ivec dot(ivec acc, ivec w, ivec x) {
    if constexpr (VNNI) return dot_u8(acc, w, x);
#if defined(__AVX512BW__) && defined(__AVX512F__)
    const __m512i xs = _mm512_mask_sub_epi8((__m512i)x, _mm512_movepi8_mask((__m512i)w), _mm512_setzero_si512(), (__m512i)x);
    return dot_u8(acc, (ivec)_mm512_abs_epi8((__m512i)w), (ivec)xs);
#elif defined(__AVX2__) && !defined(__AVX512F__)
    return dot_u8(acc, (ivec)_mm256_abs_epi8((__m256i)w), (ivec)_mm256_sign_epi8((__m256i)x, (__m256i)w));
#else
    svec wb = (svec)w, xb = (svec)x;
    for (int j = 0; j < WIDTH; ++j)
      for (int t = 0; t < 4; ++t) acc[j] += int32_t(wb[4 * j + t]) * int32_t(xb[4 * j + t]);
    return acc;
#endif
  }
  static int32_t offset(int) { return VNNI ? 128 : 0; }
};

inline vec load_half(const uint16_t* p) {  // WIDTH 个 float16 → float32（int4 的比例）
#if defined(__AVX512F__)
  return (vec)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
#elif defined(__F16C__)
  return (vec)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
#else
  vec v;
  for (int j = 0; j < WIDTH; ++j) v[j] = half_to_float(p[j]);
  return v;
#endif
}

// 量化好的输入：xq [M, 补齐的 in] int8，每组的 dx [M, 组] 与 Σ xq [M, 组]
struct QuantizedRows {
  std::vector<int8_t> xq;
  std::vector<float> dx;
  std::vector<int32_t> sum;
};

inline float value(float v) { return v; }
inline float value(uint16_t v) { return bf16_to_float(v); }

// 一组 QIN 个输入 v → q = round(v / dx)（就近、平局取偶），返回 dx = max|v| / 127；sum 是 Σ q
inline float quantize_group(const float* v, int8_t* q, int32_t* sum) {
#if defined(__AVX512F__)
  if constexpr (QIN == 32) {  // 同下面的逐个运算（除法、舍入都是逐个数精确规定的），只是 16 个一起：结果逐位相同
    const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
    const float d = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b))) / 127.0f;
    const __m512 dv = _mm512_set1_ps(d == 0.0f ? 1.0f : d);  // d = 0 时全部输入都是 0，q 也是 0
    const __m512i qa = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_div_ps(a, dv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m512i qb = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_div_ps(b, dv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qb));
    *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    return d;
  }
#endif
  float amax = 0.0f;
  for (int i = 0; i < QIN; ++i) amax = std::max(amax, std::fabs(v[i]));
  const float d = amax / 127.0f;
  int32_t s = 0;
  for (int i = 0; i < QIN; ++i) {
    q[i] = d == 0.0f ? 0 : int8_t(std::nearbyint(v[i] / d));
    s += q[i];
  }
  *sum = s;
  return d;
}

template <typename X>  // 输入 x 是 float32 或 bfloat16（bfloat16 的模型不必先转成 float32）
QuantizedRows quantize_rows(const X* x, int64_t M, int64_t n_in, int64_t groups) {
  QuantizedRows r{std::vector<int8_t>(M * groups * QIN), std::vector<float>(M * groups), std::vector<int32_t>(M * groups)};
#pragma omp parallel for schedule(static) if (M * n_in >= 65536 && !omp_in_parallel())  // 预填充的几百行：各行分给各个线程
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < groups; ++c) {
      float v[QIN];  // 这一组的输入（补的是 0）
      for (int i = 0; i < QIN; ++i) v[i] = c * QIN + i < n_in ? value(x[m * n_in + c * QIN + i]) : 0.0f;
      r.dx[m * groups + c] = quantize_group(v, &r.xq[(m * groups + c) * QIN], &r.sum[m * groups + c]);
    }
  return r;
}

// G 行（量化好的输入，从第 m0 行起）的第 c0…c1−1 组输入乘相邻的 N 块，累加进 out [N, G, 32]（c0 = 0 时从 0 起）。
// int4：每组的整数和乘 (权重的比例 · dx)；int8：乘 dx，全部组加完（c1 = groups）再乘每个输出的比例。
// 一组一组分几次乘与一次乘完逐位相同：累加器存进 out、再读出来是精确的，每个输出的乘加顺序不变
template <typename Q, int G, int N>
void int_rows(const QuantizedRows& x, int64_t m0, int64_t c0, int64_t c1, int64_t groups, const uint8_t* w,
              const void* scales, int64_t ahead, float* out) {
  const int64_t stride = groups * (QIN / 4) * Q::QUAD;  // 一块几个字节
  vec acc[N][G][LANES];
  if (c0 > 0) std::memcpy(acc, out, sizeof acc);
  else
    for (int n = 0; n < N; ++n)
      for (int g = 0; g < G; ++g)
        for (int k = 0; k < LANES; ++k) acc[n][g][k] = vec{};
  for (int64_t c = c0; c < c1; ++c) {
    ivec dot[N][G][LANES];  // 这一组的整数和，从 −offset · Σ xq 起
    for (int g = 0; g < G; ++g) {
      const int32_t sum = x.sum[(m0 + g) * groups + c];
      for (int n = 0; n < N; ++n)
        for (int k = 0; k < LANES; ++k) dot[n][g][k] = ivec{} - Q::offset(k) * sum;
    }
    for (int p = 0; p < QIN / 4; ++p) {
      ivec xs[G];  // 第 g 行这 4 个输入的 int8，广播到每个 int32
      for (int g = 0; g < G; ++g) {
        int32_t four;
        std::memcpy(&four, &x.xq[((m0 + g) * groups + c) * QIN + 4 * p], 4);
        xs[g] = ivec{} + four;
      }
      for (int n = 0; n < N; ++n) {
        const uint8_t* wn = w + n * stride + (c * QIN / 4 + p) * Q::QUAD;
        if (ahead) __builtin_prefetch(wn + ahead);
        for (int k = 0; k < LANES; ++k) {
          const ivec wv = Q::weights(wn, k);
          for (int g = 0; g < G; ++g) dot[n][g][k] = Q::dot(dot[n][g][k], wv, xs[g]);
        }
      }
    }
    for (int n = 0; n < N; ++n)
      for (int k = 0; k < LANES; ++k) {
        vec sw = broadcast(1.0f);
        if constexpr (std::is_same_v<Q, Int4>)
          sw = load_half(static_cast<const uint16_t*>(scales) + (n * groups + c) * BLOCK + k * WIDTH) * (k < HALF ? 1.0f : 1.0f / HI);
        for (int g = 0; g < G; ++g) {
          const vec dx = broadcast(x.dx[(m0 + g) * groups + c]);
          acc[n][g][k] = madd(acc[n][g][k], __builtin_convertvector(dot[n][g][k], vec), std::is_same_v<Q, Int4> ? sw * dx : dx);
        }
      }
  }
  if (std::is_same_v<Q, Int8> && c1 == groups)
    for (int n = 0; n < N; ++n)
      for (int k = 0; k < LANES; ++k) {
        const vec s = load(static_cast<const float*>(scales) + n * BLOCK + k * WIDTH);
        for (int g = 0; g < G; ++g) acc[n][g][k] = acc[n][g][k] * s;
      }
  std::memcpy(out, acc, sizeof acc);
}

// 一组几行。每行要两套累加器（整数的与 float32 的）：AVX-512 上 8 行放不下 32 个寄存器，float32 的那套（每组只用一次）
// 有几个留在 L1 里；换来的是验证 5 个 token、服务时 8 个请求都只读一遍权重
constexpr int QROWS = WIDTH == 16 ? 8 : 2;

using IntFn = void (*)(const QuantizedRows&, int64_t, int64_t, int64_t, int64_t, const uint8_t*, const void*, int64_t, float*);
template <typename Q, int N, size_t... G>
std::array<IntFn, sizeof...(G)> int_table(std::index_sequence<G...>) {
  return {&int_rows<Q, int(G) + 1, N>...};
}

// 第 b 块起的比例：int4 每块 [组, 32] 个 float16，int8 每块 32 个 float32
template <typename Q>
const void* block_scales(const void* s, int64_t groups, int64_t b) {
  if constexpr (std::is_same_v<Q, Int4>) return static_cast<const uint16_t*>(s) + b * groups * BLOCK;
  else return static_cast<const float*>(s) + b * BLOCK;
}

// 整数的权重提前预取多少字节：与 bfloat16 提前同样多（4 KB）。带 AVX-512 的 AMD 上 int8 不预取，int4 从 3 行起才预取
template <typename Q>
int64_t int_ahead(int64_t M) {
  if (amd_avx512() && (std::is_same_v<Q, Int8> || M <= 2)) return 0;
  return 2 * AHEAD * BLOCK;
}

// 第 m0…m1−1 行乘第 b 起的 N 块，每 QROWS 行一组。行多于一组时（预填充）输入维也分段：一块权重的一段（约 16 KB）
// 留在 L1 里，各组行挨个乘它，累加器在 acc 里等下一段；不分段时输入维长的块（3584 个输入的 int8 一块 112 KB）每组行
// 都要从 L2 再读一遍。解码、验证（一组行）不分段
template <typename Q, int N>
void int_tile(const QuantizedRows& x, int64_t m0, int64_t m1, int64_t groups, const uint8_t* w, const void* s, Out y,
              int64_t B, int64_t b) {
  static const auto table = int_table<Q, N>(std::make_index_sequence<QROWS>{});
  constexpr int64_t SIZE = N * QROWS * BLOCK;  // 一组行的累加器
  const bool sets = m1 - m0 > QROWS;  // 不止一组行
  const int64_t seg = sets ? std::max<int64_t>(1, 16384 / ((QIN / 4) * Q::QUAD)) : groups;
  float one[SIZE];  // 解码、验证：一组行，累加器在栈上（每块一次堆上的分配在解码时也看得出来，见 docs/perf-history.md）
  std::vector<float> many(sets ? (m1 - m0 + QROWS - 1) / QROWS * SIZE : 0);
  float* acc = sets ? many.data() : one;
  const uint8_t* wb = w + b * groups * (QIN / 4) * Q::QUAD;
  for (int64_t c = 0; c < groups; c += seg)
    for (int64_t m = m0; m < m1; m += QROWS)
      table[std::min<int64_t>(m1 - m, QROWS) - 1](x, m, c, std::min(groups, c + seg), groups, wb, block_scales<Q>(s, groups, b),
                                                  int_ahead<Q>(m1 - m0), &acc[(m - m0) / QROWS * SIZE]);
  for (int64_t m = m0; m < m1; m += QROWS) {
    const int64_t g = std::min<int64_t>(m1 - m, QROWS);
    for (int n = 0; n < N; ++n)
      for (int64_t r = 0; r < g; ++r)
        y.put((m + r) * B * BLOCK + (b + n) * BLOCK, &acc[(m - m0) / QROWS * SIZE + (n * g + r) * BLOCK]);
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
// ---------- 行多时（预填充）：16 行放进一个向量的 16 格 ----------
//
// 上面的内核把 32 个输出放进向量的格子，每行的 4 个输入广播出来：8 行 × 2 个向量的整数累加器，再加上同样多的 float32
// 累加器，32 个寄存器放不下，每组（32 个输入）换算 float32 时要进出 L1。行多时反过来：一个向量装 16 行的同 4 个输入
// （x + 128，无符号的一边），一个输出的 4 个权重直接从内存广播进 vpdpbusd（有符号的一边，int8 原样，int4 先解成 q）。
// 8 个输出 × 16 行：整数与 float32 的累加器各 8 个，都在寄存器里。整数和多出的 128 · Σ_组 w 是权重的常数，每块算一次。
// 每一行、每个输出做的运算与上面逐个相同（同一组的精确整数和，同样的乘 dx、乘比例、乘加的顺序），结果逐位相同：
// int4 上面的高 4 位和是 16 倍、比例乘 1/16，两个精确的 2 的幂相抵，乘积与这里的一样（见 Int4）。
constexpr int LANE_OUT = 8;    // 一次算几个输出
constexpr int64_t LANE_SEG = 16;  // 输入维一段几组
typedef int32_t int32_alias __attribute__((may_alias));  // 把 4 个 int8 当一个 int32 读

// acc + Σ_t xv.u8[4i + t] · w[t]（w 是内存里的 4 个 int8，广播到 16 格）：广播写进这条 vpdpbusd 本身（{1to16}），不另占
// 一条指令、一个寄存器。编译器不肯这样合，所以明写
inline __m512i dot_broadcast(__m512i acc, __m512i xv, const int32_alias* w) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(xv), "m"(*w));
  return acc;
}

// 量化好的 M 行重排成每 16 行一片：xu [片, 组·8, 16, 4]（x + 128），dx [片, 组, 16]；不满 16 行的补 x = 0、dx = 0
struct LaneRows {
  std::vector<uint8_t> xu;
  std::vector<float> dx;
};

LaneRows lane_rows(const QuantizedRows& x, int64_t m0, int64_t m1, int64_t groups) {
  const int64_t tiles = (m1 - m0 + 15) / 16, quads = groups * (QIN / 4);
  LaneRows r{std::vector<uint8_t>(tiles * quads * 64, 128), std::vector<float>(tiles * groups * 16, 0.0f)};
  for (int64_t m = m0; m < m1; ++m) {
    const int64_t t = (m - m0) / 16, lane = (m - m0) % 16;
    for (int64_t p = 0; p < quads; ++p) {  // 4 个 int8 一起搬：x + 128 就是每个字节异或 0x80
      uint32_t four;
      std::memcpy(&four, &x.xq[m * groups * QIN + 4 * p], 4);
      four ^= 0x80808080u;
      std::memcpy(&r.xu[((t * quads + p) * 16 + lane) * 4], &four, 4);
    }
    for (int64_t c = 0; c < groups; ++c) r.dx[(t * groups + c) * 16 + lane] = x.dx[m * groups + c];
  }
  return r;
}

// 一块的权重作 vpdpbusd 有符号的一边 [组·8, 32, 4] int8（返回它：int8 就是 w 本身；int4 解成 q = 存的 − 8，写进 wq），
// corr [组, 32] 是 −128 · Σ_组 q，sw [组, 32] 是 int4 每组的比例（float32）
template <typename Q>
const int8_t* lane_weights(const uint8_t* w, const void* scales, int64_t groups, std::vector<int8_t>& wq, std::vector<int32_t>& corr,
                           std::vector<float>& sw) {
  const int64_t quads = groups * (QIN / 4);
  const int8_t* q = std::is_same_v<Q, Int8> ? reinterpret_cast<const int8_t*>(w) : wq.data();  // int8 不必复制
  if constexpr (std::is_same_v<Q, Int4>)
    for (int64_t p = 0; p < quads; ++p)
      for (int j = 0; j < 16; ++j)
        for (int t = 0; t < 4; ++t) {
          const uint8_t b = w[p * 64 + 4 * j + t];
          wq[p * 128 + 4 * j + t] = int8_t((b & 0x0F) - 8), wq[p * 128 + 4 * (j + 16) + t] = int8_t((b >> 4) - 8);
        }
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t c = 0; c < groups; ++c) {
    __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
    for (int p = 0; p < QIN / 4; ++p) {
      lo = _mm512_dpbusd_epi32(lo, ones, _mm512_loadu_si512(q + (c * (QIN / 4) + p) * 128));
      hi = _mm512_dpbusd_epi32(hi, ones, _mm512_loadu_si512(q + (c * (QIN / 4) + p) * 128 + 64));
    }
    _mm512_storeu_si512(&corr[c * 32], _mm512_mullo_epi32(lo, _mm512_set1_epi32(-128)));
    _mm512_storeu_si512(&corr[c * 32 + 16], _mm512_mullo_epi32(hi, _mm512_set1_epi32(-128)));
    if constexpr (std::is_same_v<Q, Int4>)
      for (int j = 0; j < 32; ++j) sw[c * 32 + j] = half_to_float(static_cast<const uint16_t*>(scales)[c * 32 + j]);
  }
  return q;
}

// 一片 16 行 × 第 j0…j0+7 个输出，第 c0…c1−1 组：累加进 out [8, 16]（第 o 个输出的 16 行；c0 = 0 时从 0 起），
// int8 在最后一组（c1 = groups）之后乘每个输出的比例
template <typename Q>
void lane_tile(const uint8_t* xu, const float* dx, int64_t c0, int64_t c1, int64_t groups, const int8_t* wq, const int32_t* corr,
               const float* sw, const float* s8, int j0, float* out) {
  __m512 acc[LANE_OUT];
  for (int o = 0; o < LANE_OUT; ++o) acc[o] = c0 > 0 ? _mm512_loadu_ps(out + o * 16) : _mm512_setzero_ps();
  for (int64_t c = c0; c < c1; ++c) {
    __m512i dot[LANE_OUT];
    for (int o = 0; o < LANE_OUT; ++o) dot[o] = _mm512_set1_epi32(corr[c * 32 + j0 + o]);
    for (int p = 0; p < QIN / 4; ++p) {
      const int64_t q = c * (QIN / 4) + p;
      const __m512i xv = _mm512_loadu_si512(xu + q * 64);
      const int32_alias* four = reinterpret_cast<const int32_alias*>(wq + q * 128 + 4 * j0);
      for (int o = 0; o < LANE_OUT; ++o) dot[o] = dot_broadcast(dot[o], xv, four + o);
    }
    const __m512 d = _mm512_loadu_ps(dx + c * 16);
    for (int o = 0; o < LANE_OUT; ++o) {
      const __m512 scale = std::is_same_v<Q, Int4> ? _mm512_mul_ps(_mm512_set1_ps(sw[c * 32 + j0 + o]), d) : d;
      acc[o] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[o]), scale, acc[o]);
    }
  }
  for (int o = 0; o < LANE_OUT; ++o) {
    if (std::is_same_v<Q, Int8> && c1 == groups) acc[o] = _mm512_mul_ps(acc[o], _mm512_set1_ps(s8[j0 + o]));
    _mm512_storeu_ps(out + o * 16, acc[o]);
  }
}

// 第 m0…m1−1 行乘第 b 块（lanes 是这几行重排好的）：每片 16 行、每次 8 个输出，转回 [行, 32] 写进 y
template <typename Q>
void lane_block(const LaneRows& lanes, int64_t m0, int64_t m1, int64_t groups, const uint8_t* w, const void* s, Out y,
                int64_t B, int64_t b) {
  const int64_t quads = groups * (QIN / 4);
  std::vector<int8_t> wq(std::is_same_v<Q, Int4> ? quads * 128 : 0);
  std::vector<int32_t> corr(groups * 32);
  std::vector<float> sw(std::is_same_v<Q, Int4> ? groups * 32 : 0);
  const int8_t* q = lane_weights<Q>(w + b * quads * Q::QUAD, block_scales<Q>(s, groups, b), groups, wq, corr, sw);
  const float* s8 = std::is_same_v<Q, Int8> ? static_cast<const float*>(block_scales<Q>(s, groups, b)) : nullptr;
  for (int64_t t = 0; t * 16 < m1 - m0; ++t) {
    float part[32 * 16], rows[16][32];
    for (int64_t c0 = 0; c0 < groups; c0 += LANE_SEG)  // 输入维分段：一段的输入与权重（共 24 KB）留在 L1 里，4 次 8 个输出都读它
      for (int j0 = 0; j0 < 32; j0 += LANE_OUT)
        lane_tile<Q>(&lanes.xu[t * quads * 64], &lanes.dx[t * groups * 16], c0, std::min(groups, c0 + LANE_SEG), groups, q,
                     corr.data(), sw.data(), s8, j0, part + j0 * 16);
    for (int j = 0; j < 32; ++j)
      for (int r = 0; r < 16; ++r) rows[r][j] = part[j * 16 + r];
    for (int64_t r = 0; r < std::min<int64_t>(16, m1 - m0 - t * 16); ++r) y.put((m0 + t * 16 + r) * B * BLOCK + b * BLOCK, rows[r]);
  }
}
constexpr int64_t LANE_FROM = 48;  // 至少这么多行才走这里（更少时上面的内核不慢）
#endif

// x [M, in] float32 乘量化的块 w（int4 [B, 补齐的 in / 4, 64] 字节与比例 [B, 组, 32] float16；int8 [B, 补齐的 in / 4, 32, 4]
// 与比例 [B, 32] float32）→ y [M, B·32]
template <typename Q>
void matvec_quantized(const QuantizedRows& xq, int64_t M, int64_t n_in, const uint8_t* w, const void* s, Out y, int64_t B) {
  const int64_t groups = (n_in + QIN - 1) / QIN;
  // 一次只乘一块（不像浮点的块那样行少时同时乘相邻的几块）：解码一行时同时乘 4 块，每个线程要同时读 8 条流（4 块的
  // 权重与比例），从内存读得反而慢（数字见 docs/perf-history.md）
  const int64_t rows = chunk_rows(M, groups * QIN, QROWS);
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  if (QIN == 32 && BLOCK == 32 && M >= LANE_FROM) {
    // 一段的输入（重排后约 4 MB）留在 L3 里：每块的权重（解开、求和一次）乘完一整段，不必像上面那样每 256 KB 一段就把全部
    // 权重再读一遍、int4 再解一遍
    const int64_t lane_rows_at_once = std::min<int64_t>(M, std::max<int64_t>(16, (4 << 20) / (groups * QIN) / 16 * 16));
    for (int64_t m0 = 0; m0 < M; m0 += lane_rows_at_once) {
      const int64_t m1 = std::min(M, m0 + lane_rows_at_once);
      const LaneRows lanes = lane_rows(xq, m0, m1, groups);
      for_tiles<1>(B, 1, B * n_in, [&](auto, int64_t b) { lane_block<Q>(lanes, m0, m1, groups, w, s, y, B, b); });
    }
    return;
  }
#endif
  for (int64_t m0 = 0; m0 < M; m0 += rows)
    for_tiles<1>(B, 1, B * n_in, [&](auto n, int64_t b) {
      int_tile<Q, decltype(n)::value>(xq, m0, std::min(M, m0 + rows), groups, w, s, y, B, b);
    });
}

template <typename Q>
void matvec_int(const void* x, bool x_bf16, int64_t M, int64_t n_in, const uint8_t* w, const void* s, Out y, int64_t B) {
  const int64_t groups = (n_in + QIN - 1) / QIN;
  const QuantizedRows xq = x_bf16 ? quantize_rows(static_cast<const uint16_t*>(x), M, n_in, groups)
                                  : quantize_rows(static_cast<const float*>(x), M, n_in, groups);
  matvec_quantized<Q>(xq, M, n_in, w, s, y, B);
}

// 量化好的输入 all（quantize_input 的 xq、dx、sum）里的第 rows[0…M−1] 行乘量化的块：专家混合层里一行的输入要乘 k 个专家，
// 只量化一次（逐行量化，一行的结果与它和哪些行一起乘无关）
template <typename Q>
void matvec_rows(const int8_t* xq, const float* dx, const int32_t* sum, const int64_t* rows, int64_t M, int64_t n_in,
                 const uint8_t* w, const void* s, Out y, int64_t B) {
  const int64_t groups = (n_in + QIN - 1) / QIN;
  QuantizedRows r{std::vector<int8_t>(M * groups * QIN), std::vector<float>(M * groups), std::vector<int32_t>(M * groups)};
  for (int64_t m = 0; m < M; ++m) {
    std::memcpy(&r.xq[m * groups * QIN], xq + rows[m] * groups * QIN, groups * QIN);
    std::memcpy(&r.dx[m * groups], dx + rows[m] * groups, groups * sizeof(float));
    std::memcpy(&r.sum[m * groups], sum + rows[m] * groups, groups * sizeof(int32_t));
  }
  matvec_quantized<Q>(r, M, n_in, w, s, y, B);
}

// 对称的 int4，每个输出每 32 个输入一组（像 llama.cpp 的 Q4_0）：m 是这一组里绝对值最大的那个权重（带符号），
// s = float16(m / −8)，q = clamp(round(w / s), −8, 7)（m 自己正好是 −8，16 个值都用上）；s 舍入成 0 时 q 也是 0。
// src [n, in] 是上下拼接的大矩阵里从第 row0 行起的 n 行，写进 q（上面的布局；调用的人先填满 0x88，即 q = 0）与 scales
// 里对应的位置。各块交给各个线程：一个字节的两个权重在同一块里
template <typename S, typename F>
void quantize_int4(const S* src, int64_t n, int64_t n_in, int64_t row0, uint8_t* q, uint16_t* scales, F convert) {
  const int64_t groups = (n_in + QIN - 1) / QIN, b0 = row0 / BLOCK, b1 = (row0 + n + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static)
  for (int64_t b = b0; b < b1; ++b) {
    int64_t j0 = std::max<int64_t>(row0, b * BLOCK) - b * BLOCK, j1 = std::min<int64_t>(row0 + n, (b + 1) * BLOCK) - b * BLOCK;
    for (int64_t j = j0; j < j1; ++j) {
      const S* row = src + (b * BLOCK + j - row0) * n_in;
      for (int64_t c = 0; c < groups; ++c) {
        const int64_t i0 = c * QIN, i1 = std::min<int64_t>(n_in, i0 + QIN);
        float m = 0.0f;
        for (int64_t i = i0; i < i1; ++i)
          if (std::fabs(convert(row[i])) > std::fabs(m)) m = convert(row[i]);
        const uint16_t h = float_to_half(std::max(-65504.0f, std::min(65504.0f, m / -8.0f)));  // float16 的范围之内
        const float sc = half_to_float(h);
        scales[(b * groups + c) * BLOCK + j] = h;
        for (int64_t i = i0; i < i1; ++i) {
          const int v = sc == 0.0f ? 0 : int(std::min(7.0f, std::max(-8.0f, std::nearbyint(convert(row[i]) / sc))));
          uint8_t& byte = q[b * groups * QIN * (BLOCK / 2) + (i / 4) * 2 * BLOCK + (j % (BLOCK / 2)) * 4 + i % 4];
          byte = j < BLOCK / 2 ? uint8_t((byte & 0xF0) | (v + 8)) : uint8_t((byte & 0x0F) | ((v + 8) << 4));
        }
      }
    }
  }
}

}  // namespace

// kernel.py 用 ctypes 调用的入口：名字里是权重（源）与结果的 dtype。这个文件编两遍，两个编译同时跑（kernel.py 的 UNITS，
// 第一次编译少等一些，数字见 docs/performance.md）：QWEN_PART=1 只生成浮点的入口，2 只生成 int8、int4 的，各自只展开用到的模板
extern "C" {
#if !defined(QWEN_PART) || QWEN_PART == 1  // 浮点：bfloat16、float32 的块、一对一对的 bfloat16、换布局
int matvec_width() { return WIDTH; }  // 编出来的向量有几个 float32 宽：16（AVX-512）或 8（AVX2 及别的）
int matvec_fma() {                   // 乘加是不是一条 FMA（不是的话先乘、舍入，再加）
#if defined(__FMA__) || defined(__AVX512F__)
  return 1;
#else
  return 0;
#endif
}
// matvec_*：y_bf16 时结果写成 bfloat16；int8、int4 的 x_bf16 时输入是 bfloat16（否则 float32）
void matvec_f32(const float* x, int64_t, int64_t M, int64_t n_in, const float* w, const float*, void* y, int64_t B, int64_t y_bf16) {
  matvec(x, M, n_in, w, Out{y, y_bf16 != 0}, B);
}
void matvec_bf16(const float* x, int64_t, int64_t M, int64_t n_in, const uint16_t* w, const float*, void* y, int64_t B,
                 int64_t y_bf16) {
  matvec(x, M, n_in, w, Out{y, y_bf16 != 0}, B);
}
void to_blocks_f32_f32(const float* src, int64_t n, int64_t n_in, int64_t row0, float* out) {
  to_blocks(src, n, n_in, row0, out, same);
}
void to_blocks_bf16_f32(const uint16_t* src, int64_t n, int64_t n_in, int64_t row0, float* out) {
  to_blocks(src, n, n_in, row0, out, from_bf16);
}
void to_blocks_bf16_bf16(const uint16_t* src, int64_t n, int64_t n_in, int64_t row0, uint16_t* out) {
  to_blocks(src, n, n_in, row0, out, [](uint16_t v) { return v; });
}
void to_blocks_f32_bf16(const float* src, int64_t n, int64_t n_in, int64_t row0, uint16_t* out) {
  to_blocks(src, n, n_in, row0, out, to_bf16);
}
void to_pairs_bf16(const uint16_t* src, int64_t n, int64_t n_in, int64_t row0, uint16_t* out) {
  to_blocks(src, n, n_in, row0, out, [](uint16_t v) { return v; }, true);
}
void to_pairs_f32(const float* src, int64_t n, int64_t n_in, int64_t row0, uint16_t* out) {
  to_blocks(src, n, n_in, row0, out, to_bf16, true);
}
#if defined(__AVX512BF16__) && defined(__AVX512F__)
// x [M, 2P] bfloat16（P 对）乘 Pair 布局的 w [B, P, 32, 2] → y [M, B·32] bfloat16
void matvec_pairs(const uint16_t* x, int64_t M, int64_t P, const uint16_t* w, void* y, int64_t B) {
  matvec(reinterpret_cast<const float*>(x), M, P, reinterpret_cast<const Pair*>(w), Out{y, true}, B);
}
#endif
#endif
#if !defined(QWEN_PART) || QWEN_PART == 2  // int8、int4：整数点积与量化
int matvec_vnni() { return VNNI; }  // int8、int4 的整数点积是不是一条 vpdpbusd（VNNI）
void matvec_i8(const void* x, int64_t x_bf16, int64_t M, int64_t n_in, const int8_t* w, const float* s, void* y, int64_t B,
               int64_t y_bf16) {
  matvec_int<Int8>(x, x_bf16 != 0, M, n_in, reinterpret_cast<const uint8_t*>(w), s, Out{y, y_bf16 != 0}, B);
}
void matvec_q4(const void* x, int64_t x_bf16, int64_t M, int64_t n_in, const uint8_t* w, const uint16_t* s, void* y, int64_t B,
               int64_t y_bf16) {
  matvec_int<Int4>(x, x_bf16 != 0, M, n_in, w, s, Out{y, y_bf16 != 0}, B);
}
// 输入量化一次、乘几个矩阵（layer.cpp 的专家混合）：xq [M, 组·32]、dx [M, 组]、sum [M, 组]
void quantize_input(const void* x, int64_t x_bf16, int64_t M, int64_t n_in, int8_t* xq, float* dx, int32_t* sum) {
  const int64_t groups = (n_in + QIN - 1) / QIN;
  const QuantizedRows r = x_bf16 ? quantize_rows(static_cast<const uint16_t*>(x), M, n_in, groups)
                                 : quantize_rows(static_cast<const float*>(x), M, n_in, groups);
  std::memcpy(xq, r.xq.data(), r.xq.size());
  std::memcpy(dx, r.dx.data(), r.dx.size() * sizeof(float));
  std::memcpy(sum, r.sum.data(), r.sum.size() * sizeof(int32_t));
}
void matvec_i8_rows(const int8_t* xq, const float* dx, const int32_t* sum, const int64_t* rows, int64_t M, int64_t n_in,
                    const int8_t* w, const float* s, void* y, int64_t B, int64_t y_bf16) {
  matvec_rows<Int8>(xq, dx, sum, rows, M, n_in, reinterpret_cast<const uint8_t*>(w), s, Out{y, y_bf16 != 0}, B);
}
void matvec_q4_rows(const int8_t* xq, const float* dx, const int32_t* sum, const int64_t* rows, int64_t M, int64_t n_in,
                    const uint8_t* w, const uint16_t* s, void* y, int64_t B, int64_t y_bf16) {
  matvec_rows<Int4>(xq, dx, sum, rows, M, n_in, w, s, Out{y, y_bf16 != 0}, B);
}
void quantize_int4_f32(const float* w, int64_t n, int64_t n_in, int64_t row0, uint8_t* q, uint16_t* scales) {
  quantize_int4(w, n, n_in, row0, q, scales, same);
}
void quantize_int4_bf16(const uint16_t* w, int64_t n, int64_t n_in, int64_t row0, uint8_t* q, uint16_t* scales) {
  quantize_int4(w, n, n_in, row0, q, scales, from_bf16);
}
void quantize_int8_f32(const float* w, int64_t n, int64_t n_in, int8_t* q, float* scale) {
  quantize_int8(w, n, n_in, q, scale, same);
}
void quantize_int8_bf16(const uint16_t* w, int64_t n, int64_t n_in, int8_t* q, float* scale) {
  quantize_int8(w, n, n_in, q, scale, from_bf16);
}
#endif
}
