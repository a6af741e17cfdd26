// The elementwise parts of the MoE block op (cpu_moe.cpp): the experts' GLU, their biases and
// the router-weighted sum, each rounding to the activations' dtype T where LinearExperts'
// per-expert path rounds (models/experts.py), so that the two agree up to the exp of silu /
// sigmoid (std::exp here, torch's vectorized exp there). Included by cpu_moe.cpp only.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace qs_moe {

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

// silu(gate) * up for one row, each rounded to T as the per-expert path rounds (the product in
// T, then torch's silu in T, then the GLU product in T).
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

// h [m, inter] = glu(gu [m, 2 * inter]) (each row gate's products, then up's).
template <typename T>
void glu_rows(const Glu& glu, const float* gu, int64_t m, int64_t inter, float* h) {
  for (int64_t r = 0; r < m; ++r, gu += 2 * inter, h += inter) {
    if (glu.kind == kClampedSwiglu)
      clamped_swiglu_row<T>(gu, inter, glu.alpha, glu.limit, h);
    else
      silu_row<T>(gu, inter, h);
  }
}

// y[p, n] += bias[experts[p], n] for the rows p (bias [E, n] fp32; null: none), in fp32 before
// any rounding, as qgemm adds a Linear's bias to its product.
inline void add_bias(float* y, const float* bias, const std::vector<int64_t>& experts, int64_t n) {
  if (bias == nullptr) return;
  for (size_t p = 0; p < experts.size(); ++p) {
    const float* b = bias + experts[p] * n;
    for (int64_t i = 0; i < n; ++i) y[p * n + i] += b[i];
  }
}

// out [tokens, n]: row t the sum over the rows p of y with token[p] == t, in p's order, of
// round_T(y[p]) * w[p] in fp32, each product rounded to fp32 before the add (no FMA
// contraction: torch multiplies and adds in two kernels); zeros for a token without rows.
template <typename T>
__attribute__((optimize("fp-contract=off"))) void weighted_sum(
    const float* y, const std::vector<float>& w, const std::vector<int64_t>& token, int64_t tokens,
    int64_t n, std::vector<float>& acc, T* out) {
  acc.assign(tokens * n, 0.f);
  std::vector<char> started(tokens, 0);
  for (size_t p = 0; p < token.size(); ++p) {
    float* a = acc.data() + token[p] * n;
    const float* yp = y + p * n;
    const float wp = w[p];
    if (!started[token[p]]) {
      for (int64_t i = 0; i < n; ++i) a[i] = round_to<T>(yp[i]) * wp;
      started[token[p]] = 1;
      continue;
    }
    for (int64_t i = 0; i < n; ++i) {
      const float prod = round_to<T>(yp[i]) * wp;
      a[i] = a[i] + prod;
    }
  }
  for (int64_t i = 0; i < tokens * n; ++i) out[i] = static_cast<T>(acc[i]);
}

}  // namespace qs_moe
