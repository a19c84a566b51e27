// What q4a8.cpp's AVX512-VNNI loop and q4a8_amx.cpp's AMX tiles share: the packed block's shape, and the
// float steps that turn a group's int32 sums of 16 weight rows into their accumulators and then into the
// output. Both paths take these steps from here, in this order, which is what keeps their bits equal.
#pragma once
#include "tensor.h"
#include <immintrin.h>
#include <algorithm>
#include <cstdint>

namespace specui_q4a8 {

constexpr int64_t kRows = 16;    // output rows a block
constexpr int64_t kBytes = 256;  // packed bytes a (block, group)

#if defined(__AVX512F__)
// A group's scales of the block's 16 rows: d (sb[0..16)) and m (sb[16..32)), float16 to float32.
inline __m512 scale_d(const at::Half* sb) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb)));
}
inline __m512 scale_m(const at::Half* sb) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 16)));
}

// One row's group sums s (16 weight rows) into its accumulator: acc = fma(fma(float(s), d, m * sa), da, acc).
inline __m512 add_group(__m512 acc, __m512i s, __m512 d, __m512 m, float sa, float da) {
  const __m512 term = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), d, _mm512_mul_ps(m, _mm512_set1_ps(sa)));
  return _mm512_fmadd_ps(term, _mm512_set1_ps(da), acc);
}

// The lanes of the block's rows that exist (N - col of them, at most 16).
inline __mmask16 kept_rows(int64_t N, int64_t col) {
  const int64_t rows = std::min(kRows, N - col);
  return rows == kRows ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << rows) - 1);
}

// An accumulator's 16 float32 sums into the output (float32, or widened exactly to float64).
inline void store(float* out, __mmask16 keep, __m512 v) { _mm512_mask_storeu_ps(out, keep, v); }

inline void store(double* out, __mmask16 keep, __m512 v) {  // float32 sums widened exactly
  _mm512_mask_storeu_pd(out, static_cast<__mmask8>(keep & 0xFF), _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
  _mm512_mask_storeu_pd(out + 8, static_cast<__mmask8>(keep >> 8), _mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1)));
}
#endif

}  // namespace specui_q4a8
