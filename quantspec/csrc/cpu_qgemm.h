// The row and panel kernels of cpu_qgemm.cpp for other sources of the same extension
// (cpu_moe.cpp): the geometry of one product, its quantized activations, and the loops over a
// range of output rows (rows layout) or panels (panel layout) that qgemm and qgemm_panel run in
// their parallel regions. Nothing here starts a parallel region; callers split the work.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>

namespace qs_cpu {

struct Geometry {
  int64_t M, N, K, Kp, G, B;
  int64_t nblk() const { return Kp / B; }
  int64_t bpg() const { return (Kp / G) / B; }
  // Row stride of the int8 activations: a cache line more than a row, so that the rows of x
  // do not all fall into one L1 set when Kp is a multiple of 4 KB (AMX loads 16 rows at once).
  int64_t xld() const { return Kp + 64; }
};

// Per-block activation operands for one matmul call.
struct Acts {
  const int8_t* xq;  // [M, Kp], rows Geometry::xld() apart
  const float* sx;   // [M, nblk]
  const float* xg;   // [M, G]
};

bool has_avx2();
bool has_vnni();

// x (float [M, K]) -> int8 codes [M, xld()], block scales [M, nblk()], group sums [M, G], as
// qgemm quantizes them (src: int32 [Kp] column gather, or null for identity and zero padding).
void quantize_rows(const float* x, const int32_t* src, const Geometry& g, bool simd, int8_t* xq,
                   float* sx, float* xg);

// Rows layout: outputs [n0, n1) of every row of x, y[m * g.N + n] (w: [N, row_bytes] uint8,
// scales fp16 [N, G], zeros int8 [N, G]; bits 4 or 8).
void rows_range(const uint8_t* w, int64_t row_bytes, const c10::Half* scales, const int8_t* zeros,
                int bits, const Acts& a, const Geometry& g, bool simd, int64_t n0, int64_t n1,
                float* y);

// Panel layout (AVX-512 VNNI CPUs only): panels [p0, p1) of every row of x, outputs below g.N
// (w: [P, panel_bytes] uint8, scales fp16 [P, G, 16], zeros uint8 [P, G, 16]).
void panels_range(const uint8_t* w, int64_t panel_bytes, const c10::Half* scales,
                  const uint8_t* zeros, int bits, const Acts& a, const Geometry& g, int64_t p0,
                  int64_t p1, float* y);

}  // namespace qs_cpu
