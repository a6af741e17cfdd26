// One token through k routed experts of a quantized MoE block, as the dispatcher op
// quantspec_cpu::moe_token (built with cpu_qgemm.cpp into one extension; see
// quantspec/kernels/cpu_moe.py, which stacks the layouts and binds the op).
//
// moe_token(x [1, H], ids int64 [k], weights [k], gu_w, gu_scales, gu_zeros, down_w, down_scales,
//           down_zeros, bits, gu_block, down_block, inter, panels, gu_bias, down_bias, glu, alpha,
//           limit) -> [1, H] in x's dtype:
//   sum over the slots j whose ids[j] is an expert e in [0, E) (others are dropped tokens) of
//   weights[j] * (down_e(glu(gate_e(x) + gb_e, up_e(x) + ub_e)) + db_e), the sum in fp32 in slot
//   order, where glu is SiLU(gate) * up (glu 0) or GPT-OSS's clamped SwiGLU (glu 1: gate clamped
//   above at limit, up to [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate)).
// The layouts are qgemm's (rows) or qgemm_panel's (panels) of every expert stacked along a first
// dimension E: gate and up as one product of 2 * inter rows (gate rows first, as
// kernels.siblings stacks them), down of H rows; no column gather (src). The biases (optional,
// fp32): gu_bias [E, 2 * inter] (gate's then up's, as kernels.siblings concatenates them),
// down_bias [E, H].
// The per-expert path of LinearExperts runs the same kernels once per product and rounds each
// result to x's dtype; this op adds the biases and rounds where that path does (a bias is added
// to the fp32 product before its rounding to x's dtype, as qgemm adds it; each elementwise op of
// the GLU rounds to x's dtype as torch's does; the weighting and the sum in fp32), so the two
// agree up to the exp of silu / sigmoid (std::exp here, torch's vectorized exp there). What it
// saves is the calls: every chosen expert's gate/up panels run in one parallel region, and the
// GLU, the down activations' quantization and every chosen expert's down panels in a second.

#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_qgemm.h"

namespace {

using qs_cpu::Acts;
using qs_cpu::Geometry;

// Buffers of the calling thread, reused across calls (a decode step calls this once per block).
struct MoeScratch {
  std::vector<float> xf, gu, yd, sx, xg, w;
  std::vector<int8_t> xq;
};

MoeScratch& moe_scratch() {
  thread_local MoeScratch s;
  return s;
}

// t (1-D or 2-D, any float dtype) -> floats in buf.
void to_floats(const torch::Tensor& t, std::vector<float>& buf) {
  const torch::Tensor f = t.contiguous().to(torch::kFloat);
  buf.assign(f.data_ptr<float>(), f.data_ptr<float>() + f.numel());
}

template <typename T>
inline float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// The experts' GLU (kernels/cpu_moe.py's GLU_SILU / GLU_CLAMPED_SWIGLU).
enum GluKind : int64_t { kSilu = 0, kClampedSwiglu = 1 };

struct Glu {
  int64_t kind;
  float alpha, limit;  // the clamped SwiGLU's
};

// silu(gate) * up for one expert, each rounded to T as LinearExperts' per-expert path rounds
// (the product in T, then torch's silu in T, then the GLU product in T).
template <typename T>
void silu_row(const float* gu, int64_t inter, float* h) {
  for (int64_t i = 0; i < inter; ++i) {
    const float g = round_to<T>(gu[i]), u = round_to<T>(gu[inter + i]);
    const float act = round_to<T>(g / (1.0f + std::exp(-g)));
    h[i] = round_to<T>(act * u);
  }
}

// GPT-OSS's (up + 1) * (gate * sigmoid(gate * alpha)) with gate clamped above at limit and up to
// [-limit, limit] (models/experts.py ClampedSwiGLU), each torch op's result rounded to T in the
// same order (torch's clamp, mul, sigmoid and add of a T tensor and a scalar compute in fp32).
template <typename T>
void clamped_swiglu_row(const float* gu, int64_t inter, float alpha, float limit, float* h) {
  for (int64_t i = 0; i < inter; ++i) {
    const float g = round_to<T>(std::min(round_to<T>(gu[i]), limit));
    const float u = round_to<T>(std::clamp(round_to<T>(gu[inter + i]), -limit, limit));
    const float z = round_to<T>(g * alpha);
    const float sig = round_to<T>(1.0f / (1.0f + std::exp(-z)));
    h[i] = round_to<T>(round_to<T>(u + 1.0f) * round_to<T>(g * sig));
  }
}

template <typename T>
void glu_row(const Glu& glu, const float* gu, int64_t inter, float* h) {
  if (glu.kind == kClampedSwiglu)
    clamped_swiglu_row<T>(gu, inter, glu.alpha, glu.limit, h);
  else
    silu_row<T>(gu, inter, h);
}

// y[j, n] += bias[experts[j], n] for the kv chosen experts (bias [E, n] fp32; null: none), in
// fp32 before any rounding, as qgemm adds a Linear's bias to its product.
void add_bias(float* y, const float* bias, const int64_t* experts, int64_t kv, int64_t n) {
  if (bias == nullptr) return;
  for (int64_t j = 0; j < kv; ++j) {
    const float* b = bias + experts[j] * n;
    for (int64_t i = 0; i < n; ++i) y[j * n + i] += b[i];
  }
}

// out[n] = sum_j round_T(y[j, n]) * w[j] in slot order, each product rounded to fp32 before the
// add (no FMA contraction: torch multiplies and adds in two kernels).
template <typename T>
__attribute__((optimize("fp-contract=off"))) void weighted_sum(const float* y, const float* w,
                                                               int64_t kv, int64_t n, T* out) {
  for (int64_t i = 0; i < n; ++i) {
    float acc = round_to<T>(y[i]) * w[0];
    for (int64_t j = 1; j < kv; ++j) {
      const float p = round_to<T>(y[j * n + i]) * w[j];
      acc = acc + p;
    }
    out[i] = static_cast<T>(acc);
  }
}

// The layout of one stacked product: its geometry and per-expert strides.
struct Stacked {
  const uint8_t* w;
  const c10::Half* scales;
  const uint8_t* zeros;  // int8 for rows, uint8 for panels (read through the kernel's type)
  int64_t w_expert, s_expert, unit_bytes, units;  // units: panels or rows of one expert
  Geometry g;
};

Stacked stacked(const torch::Tensor& w, const torch::Tensor& scales, const torch::Tensor& zeros,
                bool panels, int64_t bits, int64_t block, int64_t n, int64_t k, const char* what) {
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.is_contiguous(), what, ": w must be contiguous uint8");
  TORCH_CHECK(scales.scalar_type() == torch::kHalf && scales.is_contiguous(), what,
              ": scales must be contiguous fp16");
  TORCH_CHECK(zeros.is_contiguous() && zeros.sizes() == scales.sizes() &&
                  zeros.scalar_type() == (panels ? torch::kUInt8 : torch::kChar),
              what, ": zeros must be contiguous ", panels ? "uint8" : "int8", " shaped as scales");
  Stacked s{};
  s.w = w.data_ptr<uint8_t>();
  s.scales = scales.data_ptr<c10::Half>();
  s.zeros = static_cast<const uint8_t*>(zeros.data_ptr());
  int64_t Kp, G;
  if (panels) {  // w [E, P, steps, 64], scales [E, P, G, 16]
    TORCH_CHECK(w.dim() == 4 && w.size(3) == 64 && scales.dim() == 4 && scales.size(3) == 16 &&
                    scales.size(1) == w.size(1), what, ": panel layouts must be [E, P, steps, 64] and [E, P, G, 16]");
    TORCH_CHECK(n <= 16 * w.size(1) && n > 16 * (w.size(1) - 1), what, ": ", n, " rows do not fit ",
                w.size(1), " panels");
    Kp = w.size(2) * (bits == 4 ? 8 : 4);
    G = scales.size(2);
    s.units = w.size(1);
    s.unit_bytes = w.size(2) * 64;
  } else {  // w [E, N, row_bytes], scales [E, N, G]
    TORCH_CHECK(w.dim() == 3 && scales.dim() == 3 && w.size(1) == n && scales.size(1) == n, what,
                ": row layouts must be [E, N, bytes] and [E, N, G] with N = ", n);
    Kp = w.size(2) * (bits == 4 ? 2 : 1);
    G = scales.size(2);
    s.units = n;
    s.unit_bytes = w.size(2);
    TORCH_CHECK(bits == 8 || Kp % 64 == 0, what, ": 4-bit Kp must be a multiple of 64");
  }
  TORCH_CHECK(w.size(0) == scales.size(0), what, ": w and scales disagree on E");
  TORCH_CHECK(G > 0 && Kp % G == 0 && (Kp / G) % block == 0 && k <= Kp, what, ": Kp=", Kp,
              " is not G=", G, " groups of whole blocks of ", block);
  s.w_expert = w.numel() / w.size(0);
  s.s_expert = scales.numel() / scales.size(0);
  s.g = Geometry{1, n, k, Kp, G, block};
  return s;
}

// units [u0, u1) of expert e's product against one row of activations, into y (its outputs).
void run_units(const Stacked& s, bool panels, int bits, bool simd, int64_t e, const Acts& a,
               int64_t u0, int64_t u1, float* y) {
  const uint8_t* w = s.w + e * s.w_expert;
  const c10::Half* sc = s.scales + e * s.s_expert;
  const uint8_t* z = s.zeros + e * s.s_expert;
  if (panels)
    qs_cpu::panels_range(w, s.unit_bytes, sc, z, bits, a, s.g, u0, u1, y);
  else
    qs_cpu::rows_range(w, s.unit_bytes, sc, reinterpret_cast<const int8_t*>(z), bits, a, s.g,
                       simd, u0, u1, y);
}

// Every chosen expert's product of the same activations in one parallel region: work item i is
// unit i % units of the (i / units)-th chosen expert.
void all_experts(const Stacked& s, bool panels, int bits, bool simd, const int64_t* experts,
                 int64_t kv, const Acts& a, float* y) {
  const int64_t units = s.units, total = kv * units;
  // at least 32 KB of weights per thread, as qgemm_panel: smaller shares cost more to wake
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, s.unit_bytes));
  at::parallel_for(0, total, grain, [&](int64_t i0, int64_t i1) {
    while (i0 < i1) {
      const int64_t j = i0 / units, u0 = i0 % units, u1 = std::min(units, u0 + (i1 - i0));
      run_units(s, panels, bits, simd, experts[j], a, u0, u1, y + j * s.g.N);
      i0 += u1 - u0;
    }
  });
}

// One MoE block's stacked products, biases and GLU, with the call's kernel choices.
struct Block {
  Stacked gu, down;
  const float* gu_bias;    // [E, 2 * inter] fp32, or null
  const float* down_bias;  // [E, H] fp32, or null
  Glu glu;
  bool panels, simd;
  int bits;
  int64_t inter, hidden;
};

// Every chosen expert's gate/up product (+ bias) of x, into s.gu [kv, 2 * inter]; x quantized
// once for all of them (qgemm quantizes it the same way per call).
void gate_up(const Block& b, const torch::Tensor& x, const std::vector<int64_t>& experts,
             MoeScratch& s) {
  const int64_t kv = static_cast<int64_t>(experts.size());
  to_floats(x, s.xf);
  const Geometry& g1 = b.gu.g;
  s.xq.resize(g1.xld());
  s.sx.resize(g1.nblk());
  s.xg.resize(g1.G);
  qs_cpu::quantize_rows(s.xf.data(), nullptr, g1, b.simd, s.xq.data(), s.sx.data(), s.xg.data());
  const Acts ax{s.xq.data(), s.sx.data(), s.xg.data()};
  s.gu.resize(kv * g1.N);
  all_experts(b.gu, b.panels, b.bits, b.simd, experts.data(), kv, ax, s.gu.data());
  add_bias(s.gu.data(), b.gu_bias, experts.data(), kv, g1.N);
}

// Every chosen expert's down product (+ bias) of its GLU, into s.yd [kv, H]: each thread first
// forms the GLU and its quantized activations for the experts its share touches (an expert split
// between two threads has them formed by both, identically: one parallel region fewer than a
// separate pass).
template <typename T>
void down_all(const Block& b, const std::vector<int64_t>& experts, MoeScratch& s) {
  const int64_t kv = static_cast<int64_t>(experts.size());
  const Geometry& g2 = b.down.g;
  s.yd.resize(kv * b.hidden);
  const int64_t units = b.down.units, total = kv * units, n_gu = b.gu.g.N;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, b.down.unit_bytes));
  const float* gup = s.gu.data();
  float* ydp = s.yd.data();
  at::parallel_for(0, total, grain, [&](int64_t i0, int64_t i1) {
    thread_local std::vector<float> h, sx, xg;
    thread_local std::vector<int8_t> xq;
    h.resize(b.inter);
    xq.resize(g2.xld());
    sx.resize(g2.nblk());
    xg.resize(g2.G);
    while (i0 < i1) {
      const int64_t j = i0 / units, u0 = i0 % units, u1 = std::min(units, u0 + (i1 - i0));
      glu_row<T>(b.glu, gup + j * n_gu, b.inter, h.data());
      qs_cpu::quantize_rows(h.data(), nullptr, g2, b.simd, xq.data(), sx.data(), xg.data());
      run_units(b.down, b.panels, b.bits, b.simd, experts[j], Acts{xq.data(), sx.data(), xg.data()},
                u0, u1, ydp + j * b.hidden);
      i0 += u1 - u0;
    }
  });
  add_bias(ydp, b.down_bias, experts.data(), kv, b.hidden);
}

template <typename T>
torch::Tensor moe_token_t(const torch::Tensor& x, const std::vector<int64_t>& experts,
                          const std::vector<float>& wts, const Block& b) {
  MoeScratch& s = moe_scratch();
  const int64_t kv = static_cast<int64_t>(experts.size());
  torch::Tensor out = torch::empty({1, b.hidden}, x.options());
  T* op = out.data_ptr<T>();
  if (kv == 0) {
    std::fill(op, op + b.hidden, static_cast<T>(0.f));
    return out;
  }
  gate_up(b, x, experts, s);
  down_all<T>(b, experts, s);
  weighted_sum<T>(s.yd.data(), wts.data(), kv, b.hidden, op);
  return out;
}

// An optional bias as fp32 [E, n] data (null when absent).
const float* bias_data(const c10::optional<torch::Tensor>& bias, int64_t experts, int64_t n,
                       const char* what) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->dim() == 2 &&
                  bias->size(0) == experts && bias->size(1) == n,
              what, " must be contiguous fp32 [", experts, ", ", n, "]");
  return bias->data_ptr<float>();
}

}  // namespace

torch::Tensor moe_token(const torch::Tensor& x, const torch::Tensor& ids, const torch::Tensor& weights,
                        const torch::Tensor& gu_w, const torch::Tensor& gu_scales,
                        const torch::Tensor& gu_zeros, const torch::Tensor& down_w,
                        const torch::Tensor& down_scales, const torch::Tensor& down_zeros,
                        int64_t bits, int64_t gu_block, int64_t down_block, int64_t inter,
                        bool panels, const c10::optional<torch::Tensor>& gu_bias,
                        const c10::optional<torch::Tensor>& down_bias, int64_t glu, double alpha,
                        double limit) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1, "x must be [1, H]");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kLong, "ids must be int64 [k]");
  TORCH_CHECK(weights.numel() == ids.numel(), "weights must have one value per id");
  TORCH_CHECK(glu == kSilu || glu == kClampedSwiglu, "glu must be 0 (SiLU) or 1 (clamped SwiGLU), got ", glu);
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat || dtype == torch::kBFloat16 || dtype == torch::kHalf,
              "x must be fp32, bf16 or fp16");
  const bool simd = qs_cpu::has_avx2();
  TORCH_CHECK(!panels || qs_cpu::has_vnni(), "the panel layout needs AVX-512 VNNI");
  const int64_t hidden = x.size(1);
  const Stacked gu = stacked(gu_w, gu_scales, gu_zeros, panels, bits, gu_block, 2 * inter, hidden, "gate/up");
  const Stacked down = stacked(down_w, down_scales, down_zeros, panels, bits, down_block, hidden, inter, "down");
  TORCH_CHECK(gu_w.size(0) == down_w.size(0), "gate/up and down disagree on the number of experts");
  const int64_t n_experts = gu_w.size(0);
  const Block b{gu, down, bias_data(gu_bias, n_experts, 2 * inter, "gu_bias"),
                bias_data(down_bias, n_experts, hidden, "down_bias"),
                Glu{glu, static_cast<float>(alpha), static_cast<float>(limit)}, panels, simd,
                static_cast<int>(bits), inter, hidden};
  MoeScratch& s = moe_scratch();
  to_floats(weights.reshape(-1), s.w);
  const torch::Tensor idc = ids.contiguous();
  const int64_t* idp = idc.data_ptr<int64_t>();
  std::vector<int64_t> experts;
  std::vector<float> wts;
  for (int64_t j = 0; j < ids.numel(); ++j) {
    if (idp[j] < 0 || idp[j] >= n_experts) continue;  // a dropped token's slot
    experts.push_back(idp[j]);
    wts.push_back(s.w[j]);
  }
  if (dtype == torch::kBFloat16) return moe_token_t<c10::BFloat16>(x, experts, wts, b);
  if (dtype == torch::kHalf) return moe_token_t<c10::Half>(x, experts, wts, b);
  return moe_token_t<float>(x, experts, wts, b);
}

TORCH_LIBRARY_FRAGMENT(quantspec_cpu, m) {
  m.def("moe_token(Tensor x, Tensor ids, Tensor weights, Tensor gu_w, Tensor gu_scales, "
        "Tensor gu_zeros, Tensor down_w, Tensor down_scales, Tensor down_zeros, int bits, "
        "int gu_block, int down_block, int inter, bool panels, Tensor? gu_bias=None, "
        "Tensor? down_bias=None, int glu=0, float alpha=1.0, float limit=0.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(quantspec_cpu, CPU, m) { m.impl("moe_token", &moe_token); }
