// A few tokens through the routed experts of a quantized MoE block, as the dispatcher op
// quantspec_cpu::moe_token (built with cpu_qgemm.cpp into one extension; see
// quantspec/kernels/cpu_moe.py, which stacks the layouts and binds the op).
//
// moe_token(x [T, H], ids int64 [T, k], weights [T, k], gu_w, gu_scales, gu_zeros, down_w,
//           down_scales, down_zeros, bits, gu_block, down_block, inter, panels, gu_bias, down_bias,
//           glu, alpha, limit) -> [T, H] in x's dtype:
//   row t the sum over the slots j whose ids[t, j] is an expert e in [0, E) (others are dropped
//   tokens) of weights[t, j] * (down_e(glu(gate_e(x_t) + gb_e, up_e(x_t) + ub_e)) + db_e), in fp32,
//   where glu is SiLU(gate) * up (glu 0) or GPT-OSS's clamped SwiGLU (glu 1: gate clamped above at
//   limit, up to [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate)).
// The layouts are qgemm's (rows) or qgemm_panel's (panels) of every expert stacked along a first
// dimension E: gate and up as one product of 2 * inter rows (gate rows first, as
// kernels.siblings stacks them), down of H rows; no column gather (src). The biases (optional,
// fp32): gu_bias [E, 2 * inter] (gate's then up's, as kernels.siblings concatenates them),
// down_bias [E, H].
// The per-expert path of LinearExperts runs the same kernels once per expert and product and
// rounds each result to x's dtype; this op adds the biases and rounds where that path does (a
// bias is added to the fp32 product before its rounding to x's dtype, as qgemm adds it; each
// elementwise op of the GLU rounds to x's dtype as torch's does: cpu_moe_glu.h) and sums in that
// path's order (one token: slot order, as its _one_token; several: ascending expert, as its
// index_add_ per expert), so the two agree up to the exp of silu / sigmoid. What it saves is the
// calls: a (token, expert) pair's rows are grouped by expert (each expert's weights read once for
// all its tokens, as one M-row product of the same kernels), every group's gate/up runs in one
// parallel region, and the GLU, the down activations' quantization and every group's down in a
// second.

#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_moe_glu.h"
#include "cpu_qgemm.h"

namespace {

using qs_cpu::Acts;
using qs_cpu::Geometry;
using qs_moe::Glu;

// t (any shape, any float dtype) -> floats in buf.
void to_floats(const torch::Tensor& t, std::vector<float>& buf) {
  const torch::Tensor f = t.contiguous().to(torch::kFloat);
  buf.assign(f.data_ptr<float>(), f.data_ptr<float>() + f.numel());
}

Geometry with_rows(Geometry g, int64_t m) {
  g.M = m;
  return g;
}

// Quantized activation rows of one product (cpu_qgemm.h Acts): int8 codes [M, xld], block
// scales [M, nblk], group sums [M, G].
struct ActRows {
  std::vector<int8_t> xq;
  std::vector<float> sx, xg;

  void resize(const Geometry& g, int64_t m) {
    xq.resize(m * g.xld());
    sx.resize(m * g.nblk());
    xg.resize(m * g.G);
  }
  // the m rows of x (float [m, g.K]), as qgemm quantizes them
  void quantize(const float* x, const Geometry& g, int64_t m, bool simd) {
    resize(g, m);
    qs_cpu::quantize_rows(x, nullptr, with_rows(g, m), simd, xq.data(), sx.data(), xg.data());
  }
  Acts at(const Geometry& g, int64_t row) const {
    return Acts{xq.data() + row * g.xld(), sx.data() + row * g.nblk(), xg.data() + row * g.G};
  }
  void copy_row(const ActRows& from, int64_t src, int64_t dst, const Geometry& g) {
    std::copy_n(from.xq.data() + src * g.xld(), g.xld(), xq.data() + dst * g.xld());
    std::copy_n(from.sx.data() + src * g.nblk(), g.nblk(), sx.data() + dst * g.nblk());
    std::copy_n(from.xg.data() + src * g.G, g.G, xg.data() + dst * g.G);
  }
};

// Buffers of the calling thread, reused across calls (a decode step calls this once per block).
struct MoeScratch {
  std::vector<float> xf, w, gu, yd, acc;
  ActRows xa, ga;  // x's rows; group rows gathered from them
};

MoeScratch& moe_scratch() {
  thread_local MoeScratch s;
  return s;
}

// A call's chosen (token, expert) pairs, in the order the per-expert path sums each token's:
// one token's in slot order (its _one_token), several tokens' by ascending expert (stable: each
// expert's in token order, as its index_add_ per expert). A run of pairs of one expert is a group,
// its rows one M-row product.
struct Routing {
  std::vector<int64_t> expert, token;  // [pairs]
  std::vector<float> weight;           // [pairs]
  std::vector<int64_t> start;          // [groups + 1]: group i is pairs [start[i], start[i + 1])
  int64_t pairs() const { return static_cast<int64_t>(expert.size()); }
  int64_t groups() const { return static_cast<int64_t>(start.size()) - 1; }
};

Routing route(const torch::Tensor& ids, const std::vector<float>& weights, int64_t n_experts) {
  const torch::Tensor idc = ids.contiguous();
  const int64_t* id = idc.data_ptr<int64_t>();
  const int64_t tokens = ids.size(0), k = ids.size(1);
  std::vector<int64_t> slots;  // flat (t, j) of the slots kept
  for (int64_t i = 0; i < tokens * k; ++i)
    if (id[i] >= 0 && id[i] < n_experts) slots.push_back(i);  // others: a dropped token's slot
  if (tokens > 1)
    std::stable_sort(slots.begin(), slots.end(), [&](int64_t a, int64_t b) { return id[a] < id[b]; });
  Routing r;
  for (const int64_t i : slots) {
    if (r.expert.empty() || r.expert.back() != id[i]) r.start.push_back(r.pairs());
    r.expert.push_back(id[i]);
    r.token.push_back(i / k);
    r.weight.push_back(weights[i]);
  }
  r.start.push_back(r.pairs());
  return r;
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

// units [u0, u1) of expert e's product s against m rows of activations, into y (its outputs,
// rows s.g.N apart).
void run_units(const Block& b, const Stacked& s, int64_t e, const Acts& a, int64_t m, int64_t u0,
               int64_t u1, float* y) {
  const uint8_t* w = s.w + e * s.w_expert;
  const c10::Half* sc = s.scales + e * s.s_expert;
  const uint8_t* z = s.zeros + e * s.s_expert;
  const Geometry g = with_rows(s.g, m);
  if (b.panels)
    qs_cpu::panels_range(w, s.unit_bytes, sc, z, b.bits, a, g, u0, u1, y);
  else
    qs_cpu::rows_range(w, s.unit_bytes, sc, reinterpret_cast<const int8_t*>(z), b.bits, a, g,
                       b.simd, u0, u1, y);
}

// fn(group, u0, u1) over every (group, unit of s) item in one parallel region, item i being unit
// i % units of group i / units; a share is at least 32 KB of weights, as qgemm_panel's (smaller
// shares cost more to wake a thread for).
template <typename F>
void over_units(const Stacked& s, int64_t groups, const F& fn) {
  const int64_t units = s.units;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, s.unit_bytes));
  at::parallel_for(0, groups * units, grain, [&](int64_t i0, int64_t i1) {
    while (i0 < i1) {
      const int64_t gi = i0 / units, u0 = i0 % units, u1 = std::min(units, u0 + (i1 - i0));
      fn(gi, u0, u1);
      i0 += u1 - u0;
    }
  });
}

// Each group's gate/up activation rows: its tokens' rows of s.xa when they are consecutive (one
// token, or a run of tokens), else copies of them in s.ga at the group's pair rows.
std::vector<Acts> group_acts(const Routing& r, const Geometry& g, MoeScratch& s) {
  std::vector<Acts> acts;
  s.ga.resize(g, r.pairs());  // once: the Acts below point into it
  for (int64_t gi = 0; gi < r.groups(); ++gi) {
    const int64_t p0 = r.start[gi], p1 = r.start[gi + 1];
    bool run = true;
    for (int64_t p = p0 + 1; p < p1; ++p) run = run && r.token[p] == r.token[p0] + (p - p0);
    if (run) {
      acts.push_back(s.xa.at(g, r.token[p0]));
      continue;
    }
    for (int64_t p = p0; p < p1; ++p) s.ga.copy_row(s.xa, r.token[p], p, g);
    acts.push_back(s.ga.at(g, p0));
  }
  return acts;
}

// Every pair's gate/up product (+ bias), into s.gu [pairs, 2 * inter]; x's rows quantized once
// for all experts (qgemm quantizes them the same way per call).
void gate_up(const Block& b, const torch::Tensor& x, const Routing& r, MoeScratch& s) {
  const Geometry& g1 = b.gu.g;
  to_floats(x, s.xf);
  s.xa.quantize(s.xf.data(), g1, x.size(0), b.simd);
  const std::vector<Acts> acts = group_acts(r, g1, s);
  s.gu.resize(r.pairs() * g1.N);
  float* gup = s.gu.data();
  over_units(b.gu, r.groups(), [&](int64_t gi, int64_t u0, int64_t u1) {
    const int64_t p0 = r.start[gi];
    run_units(b, b.gu, r.expert[p0], acts[gi], r.start[gi + 1] - p0, u0, u1, gup + p0 * g1.N);
  });
  qs_moe::add_bias(gup, b.gu_bias, r.expert, g1.N);
}

// Every pair's down product (+ bias) of its GLU, into s.yd [pairs, H]: each thread first forms
// the GLU rows and their quantized activations for the groups its share touches (a group split
// between two threads has them formed by both, identically: one parallel region fewer than a
// separate pass).
template <typename T>
void down_all(const Block& b, const Routing& r, MoeScratch& s) {
  const Geometry& g2 = b.down.g;
  const int64_t n_gu = b.gu.g.N;
  s.yd.resize(r.pairs() * b.hidden);
  const float* gup = s.gu.data();
  float* ydp = s.yd.data();
  over_units(b.down, r.groups(), [&](int64_t gi, int64_t u0, int64_t u1) {
    thread_local std::vector<float> h;
    thread_local ActRows a;
    const int64_t p0 = r.start[gi], m = r.start[gi + 1] - p0;
    h.resize(m * b.inter);
    qs_moe::glu_rows<T>(b.glu, gup + p0 * n_gu, m, b.inter, h.data());
    a.quantize(h.data(), g2, m, b.simd);
    run_units(b, b.down, r.expert[p0], a.at(g2, 0), m, u0, u1, ydp + p0 * b.hidden);
  });
  qs_moe::add_bias(ydp, b.down_bias, r.expert, b.hidden);
}

template <typename T>
torch::Tensor moe_rows_t(const torch::Tensor& x, const Routing& r, const Block& b) {
  MoeScratch& s = moe_scratch();
  const int64_t tokens = x.size(0);
  torch::Tensor out = torch::empty({tokens, b.hidden}, x.options());
  if (r.pairs() > 0) {
    gate_up(b, x, r, s);
    down_all<T>(b, r, s);
  }
  qs_moe::weighted_sum<T>(s.yd.data(), r.weight, r.token, tokens, b.hidden, s.acc, out.data_ptr<T>());
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
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1, "x must be [T, H] with T >= 1");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && ids.scalar_type() == torch::kLong,
              "ids must be int64 [T, k]");
  TORCH_CHECK(weights.sizes() == ids.sizes(), "weights must be [T, k], as ids");
  TORCH_CHECK(glu == qs_moe::kSilu || glu == qs_moe::kClampedSwiglu,
              "glu must be 0 (SiLU) or 1 (clamped SwiGLU), got ", glu);
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
  to_floats(weights, s.w);
  const Routing r = route(ids, s.w, n_experts);
  if (dtype == torch::kBFloat16) return moe_rows_t<c10::BFloat16>(x, r, b);
  if (dtype == torch::kHalf) return moe_rows_t<c10::Half>(x, r, b);
  return moe_rows_t<float>(x, r, b);
}

TORCH_LIBRARY_FRAGMENT(quantspec_cpu, m) {
  m.def("moe_token(Tensor x, Tensor ids, Tensor weights, Tensor gu_w, Tensor gu_scales, "
        "Tensor gu_zeros, Tensor down_w, Tensor down_scales, Tensor down_zeros, int bits, "
        "int gu_block, int down_block, int inter, bool panels, Tensor? gu_bias=None, "
        "Tensor? down_bias=None, int glu=0, float alpha=1.0, float limit=0.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(quantspec_cpu, CPU, m) { m.impl("moe_token", &moe_token); }
