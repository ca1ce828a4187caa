// 附录 · 解码层的一次调用：解码一个 token（或验证几个草稿）时，一层里除了读权重的矩阵乘法，还有十几个只有几千个数的
// 小运算（归一化、转 dtype、激活、残差），每个在 PyTorch 里都有一份与大小无关的固定开销，加上 Python 本身的调用。
// 这一份开销每层每个 token 都要付，24 层乘起来与读权重的时间比不算小（数字见 docs/performance.md）。这里把一层的两半
// 各写成一串 C 调用（公式见第 9 章 layer.py、第 4 章 mlp.py）：
//     mlp_block：  x + down(act(gate_up(norm(x))))                       act(g, u) = silu(g) · u
//     delta_layer：x ← x + out_proj(deltanet(in_proj(norm(x))))，再接上 mlp_block 的那一半
//     attention_layer：同上，混合器换成注意力（attention.cpp，KV 缓存由调用的人留够位置）
// 里面调用的正是 matvec.cpp、deltanet.cpp、norm.cpp 的入口，每一步的舍入与 Python 里一个运算一个运算地调用它们时相同：
// 归一化之后转成模型的 dtype（bfloat16 就近舍入到偶数，与 .to(torch.bfloat16) 相同），矩阵乘法的结果是模型的 dtype，
// 残差流是 float32。所以服务时几个请求拼在一起的 layer_many（share.py，逐个运算地调用这些内核）与单独解码的这一串
// 逐位相同；每一行各算各的，验证的行与单独解码的行也逐位相同（第 14 章）。
// 激活在 PyTorch 里是 F.silu(g) * u：bfloat16 时先把 silu 舍入成 bfloat16、再乘、再舍入，这里照做（exp 是下面的多项式，
// 与 PyTorch 的向量化 exp 可能差一点舍入：所以行数多的预填充照旧用 PyTorch，行数少的这几条路径都用这里的，见 layers.py）。

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

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

// 一层的常量（kernel.py 的 LayerParams，换布局之后填一次）：bf16 是模型的 dtype 是不是 bfloat16
struct Layer {
  int64_t bf16, hidden, inter;
  float eps1, eps2;            // 两个 RMSNorm 的 eps
  const float *norm1, *norm2;  // 两个 RMSNorm 的 1 + w
  Lin in_proj, out_proj, gate_up, down;
  DeltaNet delta;  // DeltaNet 层的常量与形状（注意力层不用）
  Attention attn;  // 注意力层的（in_proj、out_proj 是 qkv 与 o_proj；attn.H = 0：这一层不走 attention.cpp）
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
  if (width != L.n_out) {  // 去掉每行末尾补的零列（往前挪，就地）
    const int64_t size = y.bf16 ? 2 : 4;
    char* p = static_cast<char*>(y.data());
    for (int64_t m = 1; m < M; ++m) std::memmove(p + m * L.n_out * size, p + m * width * size, L.n_out * size);
    y.resize(M * L.n_out);
  }
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

// MLP 那一半：out = x + down(act(gate_up(norm2(x))))，x、out [M, hidden] float32
void mlp_half(const Layer& p, const float* x, int64_t M, float* out) {
  Rows h = normed(x, M, p.hidden, p.norm2, p.eps2, p.bf16);
  Rows gu = linear(p.gate_up, h, M);  // [M, 2·inter]：前一半是 gate，后一半是 up
  Rows a{gu.bf16, {}, {}};
  a.resize(M * p.inter);
  for (int64_t m = 0; m < M; ++m) {
    const int64_t in = m * 2 * p.inter, at = m * p.inter;
    if (a.bf16) act_bf16(gu.h.data() + in, gu.h.data() + in + p.inter, p.inter, a.h.data() + at);
    else act_f32(gu.f.data() + in, gu.f.data() + in + p.inter, p.inter, a.f.data() + at);
  }
  add_rows(x, linear(p.down, a, M), M * p.hidden, out);
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
