// The argmax of an fp32 output head's logits without reading every fp32 weight (greedy decoding).
//
// screened_argmax(x [M, K] fp32, q [N, K] int8, scale [N] fp32, bound [N] fp32, w [N, K] fp32)
//   -> (int64 [M] argmax, int64 [M] candidates): for each row of x, the index that
//   torch.argmax(f32_gemv(x, w), -1) returns (the first maximum), exactly.
//
// 1. Screen: a[m, n] = scale[n] * (x[m] . q[n]), the logits of the head rounded to int8 per row
//    (a quarter of the fp32 head's bytes). ``bound`` (kernels/output_head.py) is built so that
//    |f32_gemv(x, w)[m, n] - a[m, n]| <= bound[n] * ||x[m]||_2: the rounding error of row n
//    (Cauchy-Schwarz on w[n] - scale[n] * q[n]) plus the fp32 rounding of both products.
// 2. The logit that wins is at least lo = max_n (a[m, n] - bound[n] * ||x[m]||); every row with
//    a[m, n] + bound[n] * ||x[m]|| >= lo is a candidate (every row that can reach the maximum).
// 3. The candidates' logits are computed by cpu_gemv.h's tile, the same bits as f32_gemv's, and
//    the first maximum among them (in index order) is the argmax. A few rows per token, usually.
// A row of x whose norm (or a screened logit) is not finite takes every row of w as a candidate,
// with torch.argmax's NaN rule (a NaN is the maximum, the first NaN wins).

#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include "cpu_gemv.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <tuple>

namespace {

#if defined(__x86_64__) || defined(_M_X64)
#define QS_SCREEN __attribute__((target("avx512f,avx512bw,avx512vl")))

// a[m, r] = scale[r] * (x[m] . q[r]) for R rows of q and MR rows of x (int8 codes widened to fp32).
template <int R, int MR>
QS_SCREEN void screen_tile(const float* x, const int8_t* q, int64_t K, const float* scale,
                           float* a, int64_t lda) {
  __m512 acc[MR][R];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[R];
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(q + (R + r) * K + k), _MM_HINT_T0);
      wv[r] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + r * K + k))));
    }
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  if (k < K) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 wv[R];
    for (int r = 0; r < R; ++r)
      wv[r] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, q + r * K + k)));
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) a[m * lda + r] = scale[r] * _mm512_reduce_add_ps(acc[m][r]);
}

template <int MR>
QS_SCREEN void screen_rows(const float* x, int64_t K, const int8_t* q, const float* scale,
                           int64_t n0, int64_t n1, float* a, int64_t N) {
  constexpr int R = MR <= 2 ? 8 : (MR <= 6 ? 4 : 3);
  int64_t n = n0;
  for (; n + R <= n1; n += R) screen_tile<R, MR>(x, q + n * K, K, scale + n, a + n, N);
  for (; n < n1; ++n) screen_tile<1, MR>(x, q + n * K, K, scale + n, a + n, N);
}

// a [M, N] for all rows of x: blocks of 64 rows of q, each read once for every 8 rows of x.
void screen_all(const float* x, const int8_t* q, const float* scale, float* a, int64_t M,
                int64_t K, int64_t N) {
  using Rows = void (*)(const float*, int64_t, const int8_t*, const float*, int64_t, int64_t,
                        float*, int64_t);
  static constexpr Rows rows[8] = {screen_rows<1>, screen_rows<2>, screen_rows<3>, screen_rows<4>,
                                   screen_rows<5>, screen_rows<6>, screen_rows<7>, screen_rows<8>};
  at::parallel_for(0, (N + 63) / 64, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, K)),
                   [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = 64 * b, n1 = std::min<int64_t>(N, n0 + 64);
      for (int64_t m = 0; m < M; m += 8)
        rows[std::min<int64_t>(8, M - m) - 1](x + m * K, K, q, scale, n0, n1, a + m * N, N);
    }
  });
}

// f32_gemv's logit of row n of w for one row of x (cpu_gemv.h: the same bits).
QS_SCREEN float exact_logit(const float* x, const float* w, int64_t K) {
  float y;
  qs_gemv::gemv_tile<qs_gemv::F32Lanes, 1, 1>(x, w, K, &y, 1);
  return y;
}

// torch.argmax's order: a NaN beats every number and the first NaN wins; else the larger wins,
// the first on ties (candidates come in index order).
inline bool beats(float v, float best) {
  if (std::isnan(best)) return false;
  return std::isnan(v) || v > best;
}

// One row of x: the argmax over the candidates of its screened logits a [N]; returns the count.
// In fp32: ``bound`` carries the slack for rounding a -/+ bound * ||x|| once each.
QS_SCREEN int64_t pick(const float* x, const float* a, const float* bound, const float* w,
                       int64_t K, int64_t N, int64_t* out) {
  double sq = 0.0;
  for (int64_t k = 0; k < K; ++k) sq += static_cast<double>(x[k]) * x[k];
  const float xn = static_cast<float>(std::sqrt(sq) * (1.0 + 1e-6));
  int64_t best = -1, count = 0;
  float best_v = 0.f;
  auto consider = [&](int64_t n) {
    const float v = exact_logit(x, w + n * K, K);
    if (best < 0 || beats(v, best_v)) best = n, best_v = v;
    ++count;
  };
  const __m512 vx = _mm512_set1_ps(xn), inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  const __m512 sign = _mm512_set1_ps(-0.0f);
  __m512 vlo = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 bad = 0;
  auto mask_at = [&](int64_t n) {
    return static_cast<__mmask16>(N - n >= 16 ? 0xFFFF : (1u << (N - n)) - 1);
  };
  for (int64_t n = 0; n < N; n += 16) {
    const __mmask16 m = mask_at(n);
    const __m512 va = _mm512_maskz_loadu_ps(m, a + n), vb = _mm512_maskz_loadu_ps(m, bound + n);
    vlo = _mm512_mask_max_ps(vlo, m, vlo, _mm512_fnmadd_ps(vb, vx, va));
    // not finite: |a| == inf or a NaN (unordered with itself)
    bad |= _mm512_mask_cmp_ps_mask(m, _mm512_andnot_ps(sign, va), inf, _CMP_NLT_UQ);
  }
  const float lo = _mm512_reduce_max_ps(vlo);
  if (bad || !std::isfinite(xn) || !std::isfinite(lo)) {  // fp32 overflow or a non-finite x
    for (int64_t n = 0; n < N; ++n) consider(n);
  } else {
    const __m512 vl = _mm512_set1_ps(lo);
    for (int64_t n = 0; n < N; n += 16) {
      const __mmask16 m = mask_at(n);
      const __m512 va = _mm512_maskz_loadu_ps(m, a + n), vb = _mm512_maskz_loadu_ps(m, bound + n);
      uint32_t hit = _mm512_mask_cmp_ps_mask(m, _mm512_fmadd_ps(vb, vx, va), vl, _CMP_GE_OQ);
      for (; hit; hit &= hit - 1) consider(n + __builtin_ctz(hit));
    }
  }
  *out = best;
  return count;
}
#endif

bool cpu_has_screen() {
#if defined(__x86_64__) || defined(_M_X64)
  static const bool ok = (__builtin_cpu_init(), __builtin_cpu_supports("avx512f") &&
                                                    __builtin_cpu_supports("avx512bw") &&
                                                    __builtin_cpu_supports("avx512vl"));
  return ok;
#else
  return false;
#endif
}

std::tuple<torch::Tensor, torch::Tensor> screened_argmax(const torch::Tensor& x,
                                                         const torch::Tensor& q,
                                                         const torch::Tensor& scale,
                                                         const torch::Tensor& bound,
                                                         const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && w.dim() == 2 && x.size(1) == q.size(1) &&
                  w.sizes() == q.sizes() && scale.dim() == 1 && bound.dim() == 1 &&
                  scale.size(0) == q.size(0) && bound.size(0) == q.size(0),
              "screened_argmax: x [M, K], q and w [N, K], scale and bound [N] disagree");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat &&
                  q.scalar_type() == torch::kChar && scale.scalar_type() == torch::kFloat &&
                  bound.scalar_type() == torch::kFloat,
              "screened_argmax: x, w, scale and bound must be fp32, q int8");
  TORCH_CHECK(q.is_contiguous() && w.is_contiguous() && scale.is_contiguous() &&
                  bound.is_contiguous(), "screened_argmax: q, w, scale and bound must be contiguous");
  TORCH_CHECK(q.size(0) > 0, "screened_argmax: the head has no rows");
  TORCH_CHECK(cpu_has_screen(), "screened_argmax needs AVX-512 (F, BW, VL); use argmax of the logits");
  const torch::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = q.size(0);
  torch::Tensor out = torch::empty({M}, torch::TensorOptions().dtype(torch::kLong));
  torch::Tensor count = torch::empty({M}, torch::TensorOptions().dtype(torch::kLong));
#if defined(__x86_64__) || defined(_M_X64)
  std::unique_ptr<float[]> buf(new float[static_cast<size_t>(M * N)]);  // every element written
  float* a = buf.get();
  screen_all(xc.data_ptr<float>(), q.data_ptr<int8_t>(), scale.data_ptr<float>(), a, M, K, N);
  int64_t* op = out.data_ptr<int64_t>();
  int64_t* cp = count.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m)
    cp[m] = pick(xc.data_ptr<float>() + m * K, a + m * N, bound.data_ptr<float>(),
                 w.data_ptr<float>(), K, N, op + m);
#endif
  return {out, count};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(quantspec_cpu, m) {
  m.def("screened_argmax(Tensor x, Tensor q, Tensor scale, Tensor bound, Tensor w) -> (Tensor, Tensor)");
  m.def("has_screened_argmax() -> bool", &cpu_has_screen);
}

TORCH_LIBRARY_IMPL(quantspec_cpu, CPU, m) {
  m.impl("screened_argmax", &screened_argmax);
}
