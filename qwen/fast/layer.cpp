// 附录 · 解码层的一次调用：解码一个 token（或验证几个草稿）时，一层里除了读权重的矩阵乘法，还有十几个只有几千个数的
// 小运算（归一化、转 dtype、激活、残差），每个在 PyTorch 里都有一份与大小无关的固定开销，加上 Python 本身的调用。
// 这一份开销每层每个 token 都要付，24 层乘起来与读权重的时间比不算小（数字见 docs/performance.md）。这里把一层的两半
// 各写成一串 C 调用（公式见第 9 章 layer.py、第 4 章 mlp.py）：
//     mlp_block：  x + down(act(gate_up(norm(x))))                       act(g, u) = silu(g) · u
//     delta_layer：x ← x + out_proj(deltanet(in_proj(norm(x))))，再接上 mlp_block 的那一半
//     attention_layer：同上，混合器换成注意力（attention.cpp，KV 缓存由调用的人留够位置）
//     moe_half：    专家混合层（第 4 章附 moe.py）的那一半代替 mlp_block 的：x + Σ w·expert(norm(x)) + 门·共享专家
// 里面调用的正是 matvec.cpp、deltanet.cpp、norm.cpp 的入口，每一步的舍入与 Python 里一个运算一个运算地调用它们时相同：
// 归一化之后转成模型的 dtype（bfloat16 就近舍入到偶数，与 .to(torch.bfloat16) 相同），矩阵乘法的结果是模型的 dtype，
// 残差流是 float32。所以服务时几个请求拼在一起的 layer_many（share.py，逐个运算地调用这些内核）与单独解码的这一串
// 逐位相同；每一行各算各的，验证的行与单独解码的行也逐位相同（第 14 章）。
// 激活在 PyTorch 里是 F.silu(g) * u：bfloat16 时先把 silu 舍入成 bfloat16、再乘、再舍入，这里照做（exp 是下面的多项式，
// 与 PyTorch 的向量化 exp 可能差一点舍入）。长的提示词（行多）的激活也用这里的（act_rows），只有编译的图里照旧是 PyTorch。

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"  // exp_poly

// 一个 DeltaNet 层的常量与形状：与 deltanet.cpp 的同一个定义（kernel.py 的 DeltaNetParams）
struct DeltaNet {
  const float *conv_w, *neg_A, *dt_bias, *norm_w;  // 卷积核 [K, C]、−exp(A_log) [Hv]、dt_bias [Hv]、门控 RMSNorm 的权重 [Dv]
  float eps;                                       // 门控 RMSNorm 的 eps
  int64_t Hk, Hv, Dk, Dv, K;                       // 键头、值头、各自的维数、卷积核长
};

// 一个注意力层的常量与形状：与 attention.cpp 的同一个定义（kernel.py 的 AttentionParams）
struct Attention {
  const float *q_scale, *k_scale;  // q_norm、k_norm 的 1 + w [D]
  float eps;                       // q_norm、k_norm 的 eps
  int64_t H, Hkv, D;               // 查询头、键值头、头的维数（H = 0：这一层不走这里）
};

extern "C" {  // 别的源文件里的入口
void rms_norm(const float* x, int64_t rows, int64_t D, const float* scale, float eps, float* y);
void matvec_f32(const float* x, int64_t, int64_t M, int64_t n_in, const float* w, const float*, void* y, int64_t B, int64_t y_bf16);
void matvec_bf16(const float* x, int64_t, int64_t M, int64_t n_in, const uint16_t* w, const float*, void* y, int64_t B,
                 int64_t y_bf16);
void matvec_i8(const void* x, int64_t x_bf16, int64_t M, int64_t n_in, const int8_t* w, const float* s, void* y, int64_t B,
               int64_t y_bf16);
void matvec_q4(const void* x, int64_t x_bf16, int64_t M, int64_t n_in, const uint8_t* w, const uint16_t* s, void* y, int64_t B,
               int64_t y_bf16);
void quantize_input(const void* x, int64_t x_bf16, int64_t M, int64_t n_in, int8_t* xq, float* dx, int32_t* sum);
void matvec_i8_rows(const int8_t* xq, const float* dx, const int32_t* sum, const int64_t* rows, int64_t M, int64_t n_in,
                    const int8_t* w, const float* s, void* y, int64_t B, int64_t y_bf16);
void matvec_q4_rows(const int8_t* xq, const float* dx, const int32_t* sum, const int64_t* rows, int64_t M, int64_t n_in,
                    const uint8_t* w, const uint16_t* s, void* y, int64_t B, int64_t y_bf16);
#if defined(__AVX512BF16__) && defined(__AVX512F__)  // 只在有 AVX-512 BF16 的 CPU 上编进去（别的 CPU 不建这种布局）
void matvec_pairs(const uint16_t* x, int64_t M, int64_t P, const uint16_t* w, void* y, int64_t B);
#endif
void deltanet_step(const DeltaNet* p, const float* proj, int64_t sb, int64_t ld, int64_t B, int64_t T, const float* conv,
                   float* conv_out, float* S, float* const* history, float* out);
void attention_step(const Attention* p, const void* qkv, int64_t qkv_bf16, int64_t ld, int64_t B, int64_t T,
                    const float* cos, const float* sin, int64_t cs_b, int64_t rot, float* k_buf, float* v_buf, int64_t cap,
                    int64_t length, float* out);
}

namespace {

// 一个分块布局的矩阵（kernel.py 的 Lin）：kind 0 float32 块、1 bfloat16 块、2 一对一对的 bfloat16、3 int8、4 int4
struct Lin {
  int64_t kind, blocks, n_in, n_out;
  const void* w;
  const void* s;
};

// 专家混合的前馈（第 4 章附，kernel.py 的 MoeParams）：路由器与共享专家的门拼成的 router [E + 1, hidden]（模型的 dtype），
// 共享专家的 gate_up、down，E 个专家各自的 gate_up [2I, hidden]、down [hidden, I]（数组，各 E 个）
struct Moe {
  int64_t experts, top_k, inter;  // E、每个 token 用几个、专家的中间宽度（共享专家的是 Layer 的 inter）
  Lin router;
  const Lin *gate_up, *down;
};

// 一层的常量（kernel.py 的 LayerParams，换布局之后填一次）：bf16 是模型的 dtype 是不是 bfloat16
struct Layer {
  int64_t bf16, hidden, inter;
  float eps1, eps2;            // 两个 RMSNorm 的 eps
  const float *norm1, *norm2;  // 两个 RMSNorm 的 1 + w
  Lin in_proj, out_proj, gate_up, down;  // 专家混合层：gate_up、down 是共享专家的
  DeltaNet delta;  // DeltaNet 层的常量与形状（注意力层不用）
  Attention attn;  // 注意力层的（in_proj、out_proj 是 qkv 与 o_proj；attn.H = 0：这一层不走 attention.cpp）
  const Moe* moe;  // 专家混合层的路由器与专家；稠密的 MLP 是空指针
};

inline float bf16_value(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t bf16_round(float f) {  // 就近舍入到偶数（与 matvec.cpp 的 float_to_bf16、PyTorch 的 .bfloat16() 相同）
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return uint16_t((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

// 模型 dtype 的几行：bfloat16 的模型存 uint16，float32 的存 float。逐个数的循环把 dtype 的判断放在循环外：循环体没有
// 分支，编译器把它向量化
struct Rows {
  bool bf16;
  std::vector<uint16_t> h;
  std::vector<float> f;
  void resize(int64_t n) { bf16 ? h.resize(n) : f.resize(n); }
  void* data() { return bf16 ? static_cast<void*>(h.data()) : static_cast<void*>(f.data()); }
  const void* cdata() const { return bf16 ? static_cast<const void*>(h.data()) : static_cast<const void*>(f.data()); }
  void to_float(float* out, int64_t n) const {  // .float()
    if (bf16)
      for (int64_t i = 0; i < n; ++i) out[i] = bf16_value(h[i]);
    else
      std::memcpy(out, f.data(), n * sizeof(float));
  }
};

Rows model_rows(bool bf16, const float* x, int64_t n) {  // float32 → 模型的 dtype（.to(dtype)）
  Rows r{bf16, {}, {}};
  r.resize(n);
  if (bf16)
    for (int64_t i = 0; i < n; ++i) r.h[i] = bf16_round(x[i]);
  else
    std::memcpy(r.f.data(), x, n * sizeof(float));
  return r;
}

void trim(Rows& y, const Lin& L, int64_t M);

// y = x [M, n_in] 乘 L → [M, n_out]，模型的 dtype（与 kernel.py 的 Kernel.matvec 一样地调用内核，再去掉补的零列）
Rows linear(const Lin& L, Rows& x, int64_t M) {
  const int64_t width = L.blocks * QWEN_BLOCK;
  Rows y{x.bf16, {}, {}};
  y.resize(M * width);
  if (L.kind == 2) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    matvec_pairs(x.h.data(), M, L.n_in / 2, static_cast<const uint16_t*>(L.w), y.data(), L.blocks);
#endif
  } else if (L.kind == 3) {
    matvec_i8(x.data(), x.bf16, M, L.n_in, static_cast<const int8_t*>(L.w), static_cast<const float*>(L.s), y.data(),
              L.blocks, x.bf16);
  } else if (L.kind == 4) {
    matvec_q4(x.data(), x.bf16, M, L.n_in, static_cast<const uint8_t*>(L.w), static_cast<const uint16_t*>(L.s), y.data(),
              L.blocks, x.bf16);
  } else {  // float32 或 bfloat16 的块读 float32 的输入
    std::vector<float> xf(M * L.n_in);
    x.to_float(xf.data(), M * L.n_in);
    if (L.kind == 0) matvec_f32(xf.data(), 0, M, L.n_in, static_cast<const float*>(L.w), nullptr, y.data(), L.blocks, x.bf16);
    else matvec_bf16(xf.data(), 0, M, L.n_in, static_cast<const uint16_t*>(L.w), nullptr, y.data(), L.blocks, x.bf16);
  }
  trim(y, L, M);
  return y;
}

void trim(Rows& y, const Lin& L, int64_t M) {  // 去掉每行末尾补的零列（往前挪，就地）
  const int64_t width = L.blocks * QWEN_BLOCK, size = y.bf16 ? 2 : 4;
  if (width == L.n_out) return;
  char* p = static_cast<char*>(y.data());
  for (int64_t m = 1; m < M; ++m) std::memmove(p + m * L.n_out * size, p + m * width * size, L.n_out * size);
  y.resize(M * L.n_out);
}

// 量化好的输入（quantize_input，每行一次）的第 rows[0…M−1] 行乘 int8 或 int4 的 L：与 linear 的结果逐位相同
struct Quantized {
  std::vector<int8_t> xq;
  std::vector<float> dx;
  std::vector<int32_t> sum;
};

Rows linear_rows(const Lin& L, const Quantized& x, const int64_t* rows, int64_t M, bool bf16) {
  Rows y{bf16, {}, {}};
  y.resize(M * L.blocks * QWEN_BLOCK);
  if (L.kind == 3)
    matvec_i8_rows(x.xq.data(), x.dx.data(), x.sum.data(), rows, M, L.n_in, static_cast<const int8_t*>(L.w),
                   static_cast<const float*>(L.s), y.data(), L.blocks, bf16);
  else
    matvec_q4_rows(x.xq.data(), x.dx.data(), x.sum.data(), rows, M, L.n_in, static_cast<const uint8_t*>(L.w),
                   static_cast<const uint16_t*>(L.s), y.data(), L.blocks, bf16);
  trim(y, L, M);
  return y;
}

Rows normed(const float* x, int64_t M, int64_t D, const float* scale, float eps, bool bf16) {  // norm(x).to(dtype)
  std::vector<float> y(M * D);
  rms_norm(x, M, D, scale, eps, y.data());
  return model_rows(bf16, y.data(), M * D);
}

void add_rows(const float* x, const Rows& y, int64_t n, float* out) {  // out = x + y.float()
  y.to_float(out, n);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] + out[i];
}

// 一段 MLP 的激活：a = silu(g) · u（silu 先舍入成模型的 dtype，与 PyTorch 的 F.silu(g) * u 一样两次舍入）
void act_bf16(const uint16_t* g, const uint16_t* u, int64_t n, uint16_t* a) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = bf16_value(g[i]);
    a[i] = bf16_round(bf16_value(bf16_round(x / (1.0f + exp_poly(-x)))) * bf16_value(u[i]));
  }
}
void act_f32(const float* g, const float* u, int64_t n, float* a) {
  for (int64_t i = 0; i < n; ++i) a[i] = g[i] / (1.0f + exp_poly(-g[i])) * u[i];
}

Rows swiglu_of(Rows gu, const Lin& down, int64_t inter, int64_t M);

// 一个 SwiGLU：down(act(gate_up(h)))，h [M, hidden] 模型的 dtype → [M, hidden] 模型的 dtype
Rows swiglu(const Lin& gate_up, const Lin& down, int64_t inter, Rows& h, int64_t M) {
  return swiglu_of(linear(gate_up, h, M), down, inter, M);
}

// SwiGLU 的后一半：gate_up 的输出 gu [M, 2·inter]（前一半是 gate，后一半是 up）→ down(act(gu))
Rows swiglu_of(Rows gu, const Lin& down, int64_t inter, int64_t M) {
  Rows a{gu.bf16, {}, {}};
  a.resize(M * inter);
  for (int64_t m = 0; m < M; ++m) {
    const int64_t in = m * 2 * inter, at = m * inter;
    if (a.bf16) act_bf16(gu.h.data() + in, gu.h.data() + in + inter, inter, a.h.data() + at);
    else act_f32(gu.f.data() + in, gu.f.data() + in + inter, inter, a.f.data() + at);
  }
  return linear(down, a, M);
}

// 路由（第 4 章附的 route，逐行）：scores 的前 E 个过 softmax（float32），取最大的 k 个（同分时编号小的在前），除以它们
// 按从大到小的顺序加起来的和，再舍入成模型的 dtype → (专家编号, 权重) 各 k 个
void route_row(const float* s, int64_t E, int64_t k, bool bf16, int64_t* idx, float* w) {
  float top = s[0];
  for (int64_t e = 1; e < E; ++e) top = std::max(top, s[e]);
  std::vector<float> p(E);
  float sum = 0.0f;
  for (int64_t e = 0; e < E; ++e) sum += (p[e] = exp_poly(s[e] - top));
  std::vector<int64_t> order(E);
  for (int64_t e = 0; e < E; ++e) order[e] = e;
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int64_t a, int64_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
  float total = 0.0f;
  for (int64_t j = 0; j < k; ++j) total += p[order[j]] / sum;
  for (int64_t j = 0; j < k; ++j) {
    idx[j] = order[j];
    const float v = (p[order[j]] / sum) / total;
    w[j] = bf16 ? bf16_value(bf16_round(v)) : v;
  }
}

// h 的第 rows 行乘 L（bfloat16、float32 的专家）
Rows gathered(const Lin& L, const Rows& h, const std::vector<int64_t>& rows) {
  const int64_t n = rows.size(), H = L.n_in, size = h.bf16 ? 2 : 4;
  Rows xe{h.bf16, {}, {}};
  xe.resize(n * H);
  for (int64_t r = 0; r < n; ++r)
    std::memcpy(static_cast<char*>(xe.data()) + r * H * size, static_cast<const char*>(h.cdata()) + rows[r] * H * size, H * size);
  return linear(L, xe, n);
}

// 专家混合的那一半：out = x + Σ_j w_j · expert_j(h) + sigmoid(gate(h)) · shared(h)，h = norm2(x)。每个被选中的专家对选了
// 它的那些行乘一次（两个线程各拿一些专家）；一行的各项按专家编号从小到大加：一行的结果与同时有哪些行无关
void moe_half(const Layer& p, const float* x, int64_t M, float* out) {
  const Moe& q = *p.moe;
  const int64_t H = p.hidden, E = q.experts, k = q.top_k;
  Rows h = normed(x, M, H, p.norm2, p.eps2, p.bf16);
  Rows scores = linear(q.router, h, M);  // [M, E + 1]
  std::vector<float> sf(M * (E + 1)), w(M * k), acc(M * H);
  std::vector<int64_t> idx(M * k);
  scores.to_float(sf.data(), M * (E + 1));
  for (int64_t m = 0; m < M; ++m) route_row(&sf[m * (E + 1)], E, k, p.bf16, &idx[m * k], &w[m * k]);
  Rows shared = swiglu(p.gate_up, p.down, p.inter, h, M);
  shared.to_float(acc.data(), M * H);
  for (int64_t m = 0; m < M; ++m) {  // 共享专家乘它的门 sigmoid(g)
    const float g = 1.0f / (1.0f + exp_poly(-sf[m * (E + 1) + E]));
    for (int64_t i = 0; i < H; ++i) acc[m * H + i] = acc[m * H + i] * g;
  }
  std::vector<std::vector<int64_t>> picks(E);  // 专家 e → 选了它的 (行·k + 第几个选择)
  for (int64_t r = 0; r < M * k; ++r) picks[idx[r]].push_back(r);
  std::vector<int64_t> hit;
  for (int64_t e = 0; e < E; ++e)
    if (!picks[e].empty()) hit.push_back(e);
  std::vector<Rows> ys(hit.size(), Rows{h.bf16, {}, {}});  // 每个专家的输出（模型的 dtype）
  const bool integer = q.gate_up[0].kind == 3 || q.gate_up[0].kind == 4;  // int8、int4：每行的输入只量化一次
  Quantized hq;
  if (integer) {
    const int64_t groups = (H + QWEN_QGROUP - 1) / QWEN_QGROUP;
    hq = Quantized{std::vector<int8_t>(M * groups * QWEN_QGROUP), std::vector<float>(M * groups), std::vector<int32_t>(M * groups)};
    quantize_input(h.data(), h.bf16, M, H, hq.xq.data(), hq.dx.data(), hq.sum.data());
  }
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < int64_t(hit.size()); ++i) {
    const std::vector<int64_t>& rs = picks[hit[i]];
    const int64_t n = rs.size();
    std::vector<int64_t> rows(n);
    for (int64_t r = 0; r < n; ++r) rows[r] = rs[r] / k;
    ys[i] = swiglu_of(integer ? linear_rows(q.gate_up[hit[i]], hq, rows.data(), n, h.bf16) : gathered(q.gate_up[hit[i]], h, rows),
                      q.down[hit[i]], q.inter, n);
  }
  for (size_t i = 0; i < hit.size(); ++i) {  // 专家编号从小到大；y.float() · w 加进各自的行
    const std::vector<int64_t>& rs = picks[hit[i]];
    for (size_t r = 0; r < rs.size(); ++r) {
      float* a = &acc[(rs[r] / k) * H];
      const float wr = w[rs[r]];
      if (ys[i].bf16)
        for (int64_t j = 0; j < H; ++j) a[j] = a[j] + bf16_value(ys[i].h[r * H + j]) * wr;
      else
        for (int64_t j = 0; j < H; ++j) a[j] = a[j] + ys[i].f[r * H + j] * wr;
    }
  }
  for (int64_t i = 0; i < M * H; ++i) out[i] = x[i] + acc[i];
}

// MLP 那一半：out = x + down(act(gate_up(norm2(x))))，x、out [M, hidden] float32；专家混合层换成 moe_half
void mlp_half(const Layer& p, const float* x, int64_t M, float* out) {
  if (p.moe) return moe_half(p, x, M, out);
  Rows h = normed(x, M, p.hidden, p.norm2, p.eps2, p.bf16);
  add_rows(x, swiglu(p.gate_up, p.down, p.inter, h, M), M * p.hidden, out);
}

// 混合器的输出 o [M, ·] float32 之后：out = mlp 那一半(x + out_proj(o.to(dtype)))
void mixer_out(const Layer& p, const float* x, const std::vector<float>& o, int64_t M, float* out) {
  Rows om = model_rows(p.bf16, o.data(), int64_t(o.size()));
  std::vector<float> mid(M * p.hidden);
  add_rows(x, linear(p.out_proj, om, M), M * p.hidden, mid.data());
  mlp_half(p, mid.data(), M, out);
}

}  // namespace

extern "C" {

// 一层的 MLP 那一半（混合器在 Python 里走时——没有缓存、左填充、服务时拼在一起的 layer_many——之后调用这个）：
// x [M, hidden] float32 → out（可以就是 x）
void mlp_block(const Layer* p, const float* x, float* out, int64_t M) { mlp_half(*p, x, M, out); }
// 长的提示词的激活（行多，layers.py 的 FastMLP）：gu [M, 2·inter]（前一半 gate，后一半 up；bf16 时是 bfloat16，否则 float32）
// → a [M, inter]，与 mlp_block 里的是同一个 act，各行分给各个线程
void act_rows(const void* gu, int64_t bf16, int64_t M, int64_t inter, void* a) {
#pragma omp parallel for schedule(static)
  for (int64_t m = 0; m < M; ++m) {
    if (bf16) {
      const uint16_t* g = static_cast<const uint16_t*>(gu) + m * 2 * inter;
      act_bf16(g, g + inter, inter, static_cast<uint16_t*>(a) + m * inter);
    } else {
      const float* g = static_cast<const float*>(gu) + m * 2 * inter;
      act_f32(g, g + inter, inter, static_cast<float*>(a) + m * inter);
    }
  }
}

// DeltaNet 层的一整层：x [B, T, hidden] float32 → out，B 行、各 T 个相继的位置。conv、conv_out、S、history 同
// deltanet.cpp 的 deltanet_step；proj_out：空，或 [B, T, in_proj 的输出] float32，写下 in_proj 的输出（记历史时
// 要完整的卷积输入）
void delta_layer(const Layer* lp, const float* x, float* out, int64_t B, int64_t T, const float* conv, float* conv_out,
                 float* S, float* const* history, float* proj_out) {
  const Layer& p = *lp;
  const int64_t M = B * T, P = p.in_proj.n_out;
  Rows h = normed(x, M, p.hidden, p.norm1, p.eps1, p.bf16);
  Rows proj = linear(p.in_proj, h, M);  // [M, P]
  std::vector<float> pf(M * P), o(M * p.delta.Hv * p.delta.Dv);
  proj.to_float(pf.data(), M * P);  // .float()
  if (proj_out) std::memcpy(proj_out, pf.data(), M * P * sizeof(float));
  deltanet_step(&p.delta, pf.data(), T * P, P, B, T, conv, conv_out, S, history, o.data());
  mixer_out(p, x, o, M, out);
}

// 注意力层的一整层：x [B, T, hidden] float32 → out。cos、sin、cs_b、rot、k_buf、v_buf、cap、length 同 attention.cpp 的
// attention_step（调用的人已给缓存留够位置）
void attention_layer(const Layer* lp, const float* x, float* out, int64_t B, int64_t T, const float* cos, const float* sin,
                     int64_t cs_b, int64_t rot, float* k_buf, float* v_buf, int64_t cap, int64_t length) {
  const Layer& p = *lp;
  const int64_t M = B * T;
  Rows h = normed(x, M, p.hidden, p.norm1, p.eps1, p.bf16);
  Rows qkv = linear(p.in_proj, h, M);
  std::vector<float> o(M * p.attn.H * p.attn.D);
  attention_step(&p.attn, qkv.data(), qkv.bf16, p.in_proj.n_out, B, T, cos, sin, cs_b, rot, k_buf, v_buf, cap, length, o.data());
  mixer_out(p, x, o, M, out);
}
}
