// Small dense ops of the CPU decode path, as dispatcher ops in the quantspec_cpu namespace
// (built with cpu_qgemm.cpp into one extension; see quantspec/kernels/cpu_ext.py).
//
// rms_norm(x [..., D], w [D], eps) -> [..., D]: transformers' Llama RMSNorm, w * round_to_dtype(
//   x * rsqrt(mean(x^2) + eps)), the mean in fp32; one op instead of eight.
// rope(x [B, T, H, D], cos [B, T, D], sin [B, T, D]) -> [B, T, H, D]: rotary embedding with the
//   sign of rotate_half folded into sin (its first half negated): x * cos + roll(x, D/2) * sin,
//   rounded once; x may be a strided view (last dimension contiguous).
// silu_mul(gate, up) -> silu(gate) * up, each rounded as torch rounds them; gate and up may be
//   views of one fused product.
// bf16_gemv(x [M, K] bf16, w [N, K] bf16) -> [M, N] bf16: x @ w.T with fp32 accumulation of exact
//   bf16 products (AVX-512 BF16 vdpbf16ps), for the few-row products of decode, where torch's
//   bf16 matmul streams the weight at a third of the memory bandwidth. has_bf16_gemv() says
//   whether this CPU runs it.
// f32_gemv(x [M, K] fp32, w [N, K] fp32) -> [M, N] fp32: the same for fp32 (AVX-512F FMA), where
//   torch's fp32 matmul costs 2-3x more for 5 rows than for one (the verification of k = 4
//   speculative tokens). Both: tiles of up to 8 rows of x by 3-8 rows of w, blocks of 48 rows of
//   w read from memory once for every 8 rows of x.
// attend(q [B, t, H, D], k [B, t, KV, D], v [B, t, KV, D], cos [B, t, D], sin [B, t, D], kc, vc
//   [B, KV, cap, D], lo, scale, sinks, window) -> [B, t, H * D]: one decode step of a block's
//   attention with no holes in the cache: rope (as rope() above) on q and k, k and v written
//   into the caches at columns [lo, lo + t), and causal attention of query i over columns
//   [0, lo + i] (softmax in fp32, one rounding of the output); grouped-query heads share their
//   KV head. q, k, v may be strided views of one fused product. Five ops and two copies of
//   transformers' path in one. sinks (optional, fp32 [H]): one more logit per head in the
//   softmax's denominator, a column with no value (GPT-OSS's attention sinks). window > 0: query
//   i sees only columns (lo + i - window, lo + i] (sliding-window attention; without holes a
//   column is its position).
// argmax_rows(x [R, V] fp32 or bf16) -> int64 [R]: torch.argmax(x, -1) (the first maximum; a
//   NaN counts as the maximum, the first NaN wins), vectorised: torch's CPU argmax reads 49152
//   logits at a few hundred MB/s, a large share of a draft step of a small model.
// has_avx512f() says whether this CPU runs f32_gemv, attend and argmax_rows.

#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "cpu_dense.h"
#include "cpu_gemv.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define QS_X86 1
#endif

namespace {

template <typename T>
void rms_rows(const T* x, const T* w, T* y, int64_t rows, int64_t d, float eps) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, d)),
                   [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * d;
      float part[16] = {0.f};
      int64_t i = 0;
      for (; i + 16 <= d; i += 16)
        for (int j = 0; j < 16; ++j) {
          const float v = static_cast<float>(xr[i + j]);
          part[j] += v * v;
        }
      float sum = 0.f;
      for (int j = 0; j < 16; ++j) sum += part[j];
      for (; i < d; ++i) sum += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(d) + eps);
      T* yr = y + r * d;
      for (int64_t j = 0; j < d; ++j) {
        const T normed = static_cast<T>(static_cast<float>(xr[j]) * inv);  // rounded, as HF
        yr[j] = static_cast<T>(static_cast<float>(w[j]) * static_cast<float>(normed));
      }
    }
  });
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 1 && x.size(-1) == w.size(0),
              "rms_norm: x [..., D] and w [D] disagree");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "rms_norm: x and w must share a dtype");
  const torch::Tensor xc = x.contiguous(), wc = w.contiguous();
  torch::Tensor y = torch::empty_like(xc);
  const int64_t d = x.size(-1), rows = d ? xc.numel() / d : 0;
  const float e = static_cast<float>(eps);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_rows(xc.data_ptr<scalar_t>(), wc.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), rows, d, e);
  });
  return y;
}

template <typename T>
void rope_rows(const torch::Tensor& x, const T* c, const T* sn, T* y) {
  const int64_t B = x.size(0), Tn = x.size(1), H = x.size(2), D = x.size(3), half = D / 2;
  const T* xp = x.data_ptr<T>();
  const int64_t sb = x.stride(0), st = x.stride(1), sh = x.stride(2);
  at::parallel_for(0, B * Tn, std::max<int64_t>(1, 4096 / std::max<int64_t>(1, H * D)),
                   [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / Tn, t = r % Tn;
      const T* cr = c + r * D;
      const T* sr = sn + r * D;
      for (int64_t h = 0; h < H; ++h) {
        const T* xr = xp + b * sb + t * st + h * sh;
        T* yr = y + (r * H + h) * D;
        for (int64_t j = 0; j < D; ++j) {
          const int64_t o = j < half ? j + half : j - half;
          yr[j] = static_cast<T>(static_cast<float>(xr[j]) * static_cast<float>(cr[j]) +
                                 static_cast<float>(xr[o]) * static_cast<float>(sr[j]));
        }
      }
    }
  });
}

torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1, "rope: x must be [B, T, H, D], last dim contiguous");
  TORCH_CHECK(x.size(3) % 2 == 0, "rope: head_dim must be even");
  const std::vector<int64_t> cs{x.size(0), x.size(1), x.size(3)};
  TORCH_CHECK(cos.sizes() == cs && sin.sizes() == cs, "rope: cos and sin must be [B, T, D]");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rope: x, cos and sin must share a dtype");
  const torch::Tensor c = cos.contiguous(), sn = sin.contiguous();
  torch::Tensor y = torch::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope", [&] {
    rope_rows(x, c.data_ptr<scalar_t>(), sn.data_ptr<scalar_t>(), y.data_ptr<scalar_t>());
  });
  return y;
}

// The stride between rows of t viewed as [rows, t.size(-1)] with contiguous rows (a view of
// one part of a fused product qualifies), or -1 when t is not such a view.
int64_t row_stride(const torch::Tensor& t) {
  if (t.dim() == 0 || t.stride(-1) != 1) return -1;
  if (t.dim() == 1) return t.size(0);
  for (int64_t i = 0; i + 2 < t.dim(); ++i)
    if (t.size(i) > 1 && t.stride(i) != t.stride(i + 1) * t.size(i + 1)) return -1;
  return t.stride(-2);
}

template <typename T>
void silu_mul_rows(const T* g, int64_t sg, const T* u, int64_t su, T* y, int64_t rows, int64_t d) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, d)),
                   [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* gr = g + r * sg;
      const T* ur = u + r * su;
      T* yr = y + r * d;
      for (int64_t j = 0; j < d; ++j) {
        const float a = static_cast<float>(gr[j]);
        const T act = static_cast<T>(a / (1.0f + std::exp(-a)));  // silu rounded, as torch's
        yr[j] = static_cast<T>(static_cast<float>(act) * static_cast<float>(ur[j]));
      }
    }
  });
}

torch::Tensor silu_mul(const torch::Tensor& gate, const torch::Tensor& up) {
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.scalar_type() == up.scalar_type() &&
                  gate.dim() >= 1, "silu_mul: gate and up must share a shape and a dtype");
  const torch::Tensor g = row_stride(gate) < 0 ? gate.contiguous() : gate;
  const torch::Tensor u = row_stride(up) < 0 ? up.contiguous() : up;
  const int64_t d = gate.size(-1), rows = d ? gate.numel() / d : 0;
  const int64_t sg = row_stride(g), su = row_stride(u);
  torch::Tensor y = torch::empty(gate.sizes(), gate.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate.scalar_type(), "silu_mul", [&] {
    silu_mul_rows(g.data_ptr<scalar_t>(), sg, u.data_ptr<scalar_t>(), su, y.data_ptr<scalar_t>(),
                  rows, d);
  });
  return y;
}

bool cpu_has_bf16() {
#ifdef QS_X86
  static const bool ok = (__builtin_cpu_init(), __builtin_cpu_supports("avx512bf16") &&
                                                    __builtin_cpu_supports("avx512bw"));
  return ok;
#else
  return false;
#endif
}

bool cpu_has_avx512f() {
#ifdef QS_X86
  static const bool ok = (__builtin_cpu_init(), __builtin_cpu_supports("avx512f"));
  return ok;
#else
  return false;
#endif
}

#ifdef QS_X86
using qs_gemv::Bf16Lanes;
using qs_gemv::F32Lanes;
using qs_gemv::gemv_tile;

// All MR rows of x against rows [n0, n1) of w in one pass: R rows of w per tile, R * MR <= 24
// accumulators (of 32 registers).
template <class L, int MR, typename Out>
QS_GEMV void gemv_rows(const typename L::T* x, int64_t K, const typename L::T* w, int64_t n0,
                       int64_t n1, Out* y, int64_t N) {
  constexpr int R = MR <= 2 ? 8 : (MR <= 6 ? 4 : 3);
  int64_t n = n0;
  for (; n + R <= n1; n += R) gemv_tile<L, R, MR>(x, w + n * K, K, y + n, N);
  for (; n < n1; ++n) gemv_tile<L, 1, MR>(x, w + n * K, K, y + n, N);
}

template <class L, typename Out>
void gemv_blocks(const typename L::T* x, const typename L::T* w, Out* y, int64_t M, int64_t K,
                 int64_t N) {
  using Rows = void (*)(const typename L::T*, int64_t, const typename L::T*, int64_t, int64_t,
                        Out*, int64_t);
  static constexpr Rows rows[8] = {gemv_rows<L, 1, Out>, gemv_rows<L, 2, Out>, gemv_rows<L, 3, Out>,
                                   gemv_rows<L, 4, Out>, gemv_rows<L, 5, Out>, gemv_rows<L, 6, Out>,
                                   gemv_rows<L, 7, Out>, gemv_rows<L, 8, Out>};
  // blocks of 48 rows of w (108 KB fp32 at K = 576), each read from memory once: it stays in L2
  // while every group of 8 rows of x passes over it
  at::parallel_for(0, (N + 47) / 48, std::max<int64_t>(1, 4096 / std::max<int64_t>(1, K)),
                   [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = 48 * b, n1 = std::min<int64_t>(N, n0 + 48);
      for (int64_t m = 0; m < M; m += 8)
        rows[std::min<int64_t>(8, M - m) - 1](x + m * K, K, w, n0, n1, y + m * N, N);
    }
  });
}
#endif

// x [M, K] @ w [N, K].T in x's dtype (bf16_gemv and f32_gemv): checks, output, dispatch.
torch::Tensor few_row_gemv(const torch::Tensor& x, const torch::Tensor& w, at::ScalarType dtype,
                           const char* name, bool supported) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), name,
              ": x [M, K] and w [N, K] disagree");
  TORCH_CHECK(x.scalar_type() == dtype && w.scalar_type() == dtype, name, ": x and w must be ",
              dtype);
  TORCH_CHECK(w.is_contiguous(), name, ": w must be contiguous");
  TORCH_CHECK(supported, name, " needs AVX-512 (with BF16 for bf16) on this CPU; use torch.matmul");
  const torch::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = w.size(0);
  torch::Tensor y = torch::empty({M, N}, torch::TensorOptions().dtype(dtype));
#ifdef QS_X86
  if (dtype == torch::kFloat) {
    gemv_blocks<F32Lanes>(xc.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), M, K, N);
  } else {
    gemv_blocks<Bf16Lanes>(reinterpret_cast<const uint16_t*>(xc.data_ptr<c10::BFloat16>()),
                           reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>()),
                           y.data_ptr<c10::BFloat16>(), M, K, N);
  }
#endif
  return y;
}

torch::Tensor bf16_gemv(const torch::Tensor& x, const torch::Tensor& w) {
  return few_row_gemv(x, w, torch::kBFloat16, "bf16_gemv", cpu_has_bf16());
}

torch::Tensor f32_gemv(const torch::Tensor& x, const torch::Tensor& w) {
  return few_row_gemv(x, w, torch::kFloat, "f32_gemv", cpu_has_avx512f());
}

#ifdef QS_X86
// The whole attention region is compiled for AVX-512F: GCC does not pass a function's target
// attribute on to the lambdas inside it (at::parallel_for bodies), so on a host whose -march has
// no AVX-512 (AVX2-only EPYC) those lambdas failed to build. Called only where the CPU has it.
#pragma GCC push_options
#pragma GCC target("avx512f")
__attribute__((target("avx512f"))) inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f"))) inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
__attribute__((target("avx512f"))) inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <typename T>
__attribute__((target("avx512f"))) void attend_rows(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const T* cs,
    const T* sn, torch::Tensor& kc, torch::Tensor& vc, int64_t lo, float scale, const float* sinks,
    int64_t window, T* out) {
  const int64_t B = q.size(0), Tn = q.size(1), H = q.size(2), D = q.size(3), KV = k.size(2);
  const int64_t half = D / 2, group = H / KV, cap = kc.size(2);
  const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
  T *kcp = kc.data_ptr<T>(), *vcp = vc.data_ptr<T>();
  auto rope_at = [&](const T* x, const T* c, const T* s, int64_t j) {
    const int64_t o = j < half ? j + half : j - half;
    return static_cast<T>(static_cast<float>(x[j]) * static_cast<float>(c[j]) +
                          static_cast<float>(x[o]) * static_cast<float>(s[j]));
  };
  // the new keys (roped) and values into the caches
  at::parallel_for(0, B * Tn * KV, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / (Tn * KV), i = (r / KV) % Tn, g = r % KV;
      const T* kr = kp + b * k.stride(0) + i * k.stride(1) + g * k.stride(2);
      const T* vr = vp + b * v.stride(0) + i * v.stride(1) + g * v.stride(2);
      const T* c = cs + (b * Tn + i) * D;
      const T* s = sn + (b * Tn + i) * D;
      T* kd = kcp + ((b * KV + g) * cap + lo + i) * D;
      T* vd = vcp + ((b * KV + g) * cap + lo + i) * D;
      for (int64_t j = 0; j < D; ++j) {
        kd[j] = rope_at(kr, c, s, j);
        vd[j] = vr[j];
      }
    }
  });
  at::parallel_for(0, B * Tn * H, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> qf(D), score(lo + Tn);
    __m512 acc[16];  // D <= 256
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / (Tn * H), i = (r / H) % Tn, hh = r % H, g = hh / group;
      const T* qr = qp + b * q.stride(0) + i * q.stride(1) + hh * q.stride(2);
      const T* c = cs + (b * Tn + i) * D;
      const T* s = sn + (b * Tn + i) * D;
      for (int64_t j = 0; j < D; ++j) qf[j] = static_cast<float>(rope_at(qr, c, s, j));
      const T* kb = kcp + (b * KV + g) * cap * D;
      const T* vb = vcp + (b * KV + g) * cap * D;
      const int64_t L = lo + i + 1;
      const int64_t first = window > 0 ? std::max<int64_t>(0, L - window) : 0;
      float top = sinks ? sinks[hh] : -INFINITY;
      for (int64_t col = first; col < L; ++col) {
        __m512 dot = _mm512_setzero_ps();
        for (int64_t j = 0; j < D; j += 16)
          dot = _mm512_fmadd_ps(_mm512_loadu_ps(qf.data() + j), load16(kb + col * D + j), dot);
        score[col] = _mm512_reduce_add_ps(dot) * scale;
        top = std::max(top, score[col]);
      }
      float total = sinks ? std::exp(sinks[hh] - top) : 0.f;
      for (int64_t col = first; col < L; ++col) total += (score[col] = std::exp(score[col] - top));
      for (int64_t j = 0; j < D / 16; ++j) acc[j] = _mm512_setzero_ps();
      for (int64_t col = first; col < L; ++col) {
        const __m512 p = _mm512_set1_ps(score[col]);
        for (int64_t j = 0; j < D; j += 16)
          acc[j / 16] = _mm512_fmadd_ps(p, load16(vb + col * D + j), acc[j / 16]);
      }
      T* o = out + ((b * Tn + i) * H + hh) * D;
      const __m512 inv = _mm512_set1_ps(1.0f / total);
      float buf[16];
      for (int64_t j = 0; j < D; j += 16) {
        _mm512_storeu_ps(buf, _mm512_mul_ps(acc[j / 16], inv));
        for (int e = 0; e < 16; ++e) o[j + e] = static_cast<T>(buf[e]);
      }
    }
  });
}
#pragma GCC pop_options
#endif

torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                     const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor kc,
                     torch::Tensor vc, int64_t lo, double scale,
                     const c10::optional<torch::Tensor>& sinks, int64_t window) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes() && q.size(0) == k.size(0) &&
                  q.size(1) == k.size(1) && q.size(3) == k.size(3),
              "attend: q [B, t, H, D], k and v [B, t, KV, D] disagree");
  const int64_t B = q.size(0), Tn = q.size(1), H = q.size(2), D = q.size(3), KV = k.size(2);
  TORCH_CHECK(H % KV == 0 && D % 16 == 0 && D <= 256,
              "attend: needs H a multiple of KV and D a multiple of 16 up to 256");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "attend: q, k, v need a contiguous last dimension");
  TORCH_CHECK(kc.dim() == 4 && kc.sizes() == vc.sizes() && kc.size(0) == B && kc.size(1) == KV &&
                  kc.size(3) == D && kc.is_contiguous() && vc.is_contiguous(),
              "attend: caches must be contiguous [B, KV, cap, D]");
  TORCH_CHECK(lo >= 0 && lo + Tn <= kc.size(2), "attend: columns [lo, lo + t) outside the cache");
  const std::vector<int64_t> cshape{B, Tn, D};
  TORCH_CHECK(cos.sizes() == cshape && sin.sizes() == cshape, "attend: cos and sin must be [B, t, D]");
  for (const torch::Tensor& t : {k, v, cos, sin, kc, vc})
    TORCH_CHECK(t.scalar_type() == q.scalar_type(), "attend: all tensors must share a dtype");
  TORCH_CHECK(!sinks.has_value() || (sinks->scalar_type() == torch::kFloat && sinks->dim() == 1 &&
                                      sinks->size(0) == H && sinks->is_contiguous()),
              "attend: sinks must be contiguous fp32 [H]");
  TORCH_CHECK(window >= 0, "attend: window must be >= 0 (0: none)");
  TORCH_CHECK(cpu_has_avx512f(), "attend needs AVX-512F");
  const float* sk = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  const torch::Tensor c = cos.contiguous(), sn = sin.contiguous();
  torch::Tensor out = torch::empty({B, Tn, H * D}, q.options());
#ifdef QS_X86
  AT_DISPATCH_SWITCH(q.scalar_type(), "attend",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      attend_rows<scalar_t>(q, k, v, c.data_ptr<scalar_t>(), sn.data_ptr<scalar_t>(), kc, vc, lo,
                            static_cast<float>(scale), sk, window, out.data_ptr<scalar_t>());
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      attend_rows<scalar_t>(q, k, v, c.data_ptr<scalar_t>(), sn.data_ptr<scalar_t>(), kc, vc, lo,
                            static_cast<float>(scale), sk, window, out.data_ptr<scalar_t>());
    })
    AT_DISPATCH_CASE(at::kHalf, [&] {
      attend_rows<scalar_t>(q, k, v, c.data_ptr<scalar_t>(), sn.data_ptr<scalar_t>(), kc, vc, lo,
                            static_cast<float>(scale), sk, window, out.data_ptr<scalar_t>());
    }));
#endif
  return out;
}

#ifdef QS_X86
template <typename T>
__attribute__((target("avx512f"))) int64_t argmax_row(const T* x, int64_t V) {
  // pass 1: the maximum, and whether any NaN is present
  __m512 best = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  int64_t j = 0;
  for (; j + 16 <= V; j += 16) {
    const __m512 v = load16(x + j);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    best = _mm512_max_ps(best, v);
  }
  float top = _mm512_reduce_max_ps(best);
  bool any_nan = nan != 0;
  for (int64_t t = j; t < V; ++t) {
    const float v = static_cast<float>(x[t]);
    any_nan |= std::isnan(v);
    top = std::max(top, v);
  }
  // pass 2: the first index holding it
  const __m512 topv = _mm512_set1_ps(top);
  int64_t t = 0;
  for (; t + 16 <= V; t += 16) {
    const __m512 v = load16(x + t);
    const __mmask16 hit = any_nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)
                                  : _mm512_cmp_ps_mask(v, topv, _CMP_EQ_OQ);
    if (hit) return t + __builtin_ctz(static_cast<unsigned>(hit));
  }
  for (; t < V; ++t) {
    const float v = static_cast<float>(x[t]);
    if (any_nan ? std::isnan(v) : v == top) return t;
  }
  return 0;
}
#endif

torch::Tensor argmax_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "argmax_rows: x must be [R, V] with V > 0");
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16,
              "argmax_rows: x must be fp32 or bf16");
  TORCH_CHECK(cpu_has_avx512f(), "argmax_rows needs AVX-512F; use torch.argmax");
  const torch::Tensor xc = x.contiguous();
  const int64_t R = xc.size(0), V = xc.size(1);
  torch::Tensor out = torch::empty({R}, torch::TensorOptions().dtype(torch::kLong));
  int64_t* op = out.data_ptr<int64_t>();
#ifdef QS_X86
  for (int64_t r = 0; r < R; ++r) {
    if (x.scalar_type() == torch::kFloat)
      op[r] = argmax_row(xc.data_ptr<float>() + r * V, V);
    else
      op[r] = argmax_row(xc.data_ptr<c10::BFloat16>() + r * V, V);
  }
#endif
  return out;
}

}  // namespace

// For cpu_decode.cpp (cpu_dense.h): the same functions, outside this file's anonymous namespace.
namespace qs_cpu {

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  return ::rms_norm(x, w, eps);
}
torch::Tensor silu_mul(const torch::Tensor& gate, const torch::Tensor& up) {
  return ::silu_mul(gate, up);
}
torch::Tensor f32_gemv(const torch::Tensor& x, const torch::Tensor& w) { return ::f32_gemv(x, w); }
torch::Tensor bf16_gemv(const torch::Tensor& x, const torch::Tensor& w) { return ::bf16_gemv(x, w); }
torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                     const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor kc,
                     torch::Tensor vc, int64_t lo, double scale,
                     const std::optional<torch::Tensor>& sinks, int64_t window) {
  return ::attend(q, k, v, cos, sin, kc, vc, lo, scale, sinks, window);
}

}  // namespace qs_cpu

TORCH_LIBRARY_FRAGMENT(quantspec_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("bf16_gemv(Tensor x, Tensor w) -> Tensor");
  m.def("has_bf16_gemv() -> bool", &cpu_has_bf16);
  m.def("f32_gemv(Tensor x, Tensor w) -> Tensor");
  m.def("has_avx512f() -> bool", &cpu_has_avx512f);
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("attend(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) kc, Tensor(b!) vc, "
        "int lo, float scale, Tensor? sinks=None, int window=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(quantspec_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rope", &rope);
  m.impl("silu_mul", &silu_mul);
  m.impl("bf16_gemv", &bf16_gemv);
  m.impl("f32_gemv", &f32_gemv);
  m.impl("attend", &attend);
  m.impl("argmax_rows", &argmax_rows);
}
