// The squared errors of the "mse" KV-scale search (quantspec/runtime/kv_quant.py,
// scale_errors), as the dispatcher op quantspec_cpu::kv_scale_errors (built with cpu_qgemm.cpp
// into one extension; see quantspec/kernels/cpu_ext.py).
//
// kv_scale_errors(x [H, N] fp32, scales [M, H] fp32, kind) -> [M, H] fp32:
//   out[m, h] = sum_n (round(x[h, n] / s) * s - x[h, n])^2 with s = scales[m, h], where round is
//   kind 0: the nearest E4M3FN value, saturating at +-448 (round to nearest even, as torch's
//   float8_e4m3fn cast after a clamp), kind 1: the nearest integer (even on ties), clamped to
//   +-127 (int8).
// Every squared term is computed with the same fp32 operations as the torch reference (divide,
// round, multiply, subtract, square), so the terms are bit-equal to it; only the sum's order
// differs (fp64 here). Parallel over (m, h).

#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace {

inline float round_e4m3(float y) {
  // |y| clamped to 448; subnormals (below 2**-6) are multiples of 2**-9; normal values keep 3
  // mantissa bits, rounded to nearest even on the fp32 bit pattern.
  const float a = std::fmin(std::fabs(y), 448.0f);
  uint32_t bits;
  std::memcpy(&bits, &a, sizeof bits);
  bits = (bits + 0x7FFFFu + ((bits >> 20) & 1u)) & 0xFFF00000u;
  float normal;
  std::memcpy(&normal, &bits, sizeof normal);
  const float sub = std::nearbyint(a * 512.0f) * (1.0f / 512.0f);
  const float r = a < 0.015625f ? sub : normal;
  return std::copysign(r, y);
}

inline float round_int8(float y) { return std::fmin(std::fmax(std::nearbyint(y), -127.0f), 127.0f); }

#if defined(__AVX512F__)
// r * s - v must stay two roundings (a multiply, then a subtract) as in torch: no fused multiply-add.
__attribute__((optimize("fp-contract=off"))) inline __m512 term16(__m512 v, __m512 s, int kind) {
  const __m512 y = _mm512_div_ps(v, s);
  __m512 r;
  if (kind == 0) {
    const __m512i sign_mask = _mm512_set1_epi32(static_cast<int>(0x80000000u));
    const __m512 a = _mm512_min_ps(_mm512_abs_ps(y), _mm512_set1_ps(448.0f));
    __m512i bits = _mm512_castps_si512(a);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 20), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFFF), odd));
    bits = _mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0xFFF00000u)));
    const __m512 sub = _mm512_mul_ps(
        _mm512_roundscale_ps(_mm512_mul_ps(a, _mm512_set1_ps(512.0f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
        _mm512_set1_ps(1.0f / 512.0f));
    const __mmask16 small = _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.015625f), _CMP_LT_OQ);
    r = _mm512_mask_blend_ps(small, _mm512_castsi512_ps(bits), sub);
    r = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(r),
                                            _mm512_and_si512(_mm512_castps_si512(y), sign_mask)));
  } else {
    r = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm512_min_ps(_mm512_max_ps(r, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f));
  }
  const __m512 p = _mm512_mul_ps(r, s);
  return _mm512_sub_ps(p, v);
}
#endif

__attribute__((optimize("fp-contract=off"))) inline float term(float v, float s, int kind) {
  const float r = kind == 0 ? round_e4m3(v / s) : round_int8(v / s);
  const float p = r * s;
  return p - v;
}

double head_error(const float* x, int64_t n, float s, int kind) {
  double total = 0.0;
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 vs = _mm512_set1_ps(s);
  for (; i + 1024 <= n; i += 1024) {  // fp32 lanes over 1024 values, then into the fp64 total
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j < 1024; j += 16) {
      const __m512 d = term16(_mm512_loadu_ps(x + i + j), vs, kind);
      acc = _mm512_add_ps(acc, _mm512_mul_ps(d, d));
    }
    total += static_cast<double>(_mm512_reduce_add_ps(acc));
  }
#endif
  for (; i < n; ++i) {
    const float d = term(x[i], s, kind);
    total += static_cast<double>(d * d);
  }
  return total;
}

torch::Tensor kv_scale_errors(const torch::Tensor& x, const torch::Tensor& scales, int64_t kind) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "kv_scale_errors: x must be fp32 [H, N]");
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == torch::kFloat && scales.size(1) == x.size(0),
              "kv_scale_errors: scales must be fp32 [M, H]");
  TORCH_CHECK(kind == 0 || kind == 1, "kv_scale_errors: kind must be 0 (fp8) or 1 (int8)");
  const torch::Tensor xc = x.contiguous(), sc = scales.contiguous();
  const int64_t H = xc.size(0), N = xc.size(1), M = sc.size(0);
  torch::Tensor out = torch::empty({M, H}, torch::TensorOptions().dtype(torch::kFloat));
  const float* xp = xc.data_ptr<float>();
  const float* sp = sc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, M * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t h = p % H;
      op[p] = static_cast<float>(head_error(xp + h * N, N, sp[p], static_cast<int>(kind)));
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(quantspec_cpu, m) {
  m.def("kv_scale_errors(Tensor x, Tensor scales, int kind) -> Tensor");
}

TORCH_LIBRARY_IMPL(quantspec_cpu, CPU, m) { m.impl("kv_scale_errors", &kv_scale_errors); }
