// The activations' side of SpecUI's group kernels (q4a8.cpp, q8a8.cpp): each row of x, each group of
// 32 inputs on its own, rounded as llama.cpp rounds to its Q8 blocks: top = max|x|, a = round-half-even(
// x * 127 / top) in int8 (so |a| <= 127), da = float(top / 127), sa = sum(a).
#pragma once
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <immintrin.h>

namespace specui_groups {

constexpr int64_t kGroup = 32;  // inputs a group

template <typename T>
inline void round_groups(const T* x, int64_t M, int64_t K, int8_t* a, float* da, float* sa) {
  const int64_t NG = K / kGroup;
  at::parallel_for(0, M * NG, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const T* xg = x + i * kGroup;  // rows are contiguous, so group i of the flat input
      T top = 0;
      for (int64_t k = 0; k < kGroup; ++k) top = std::max(top, static_cast<T>(std::abs(xg[k])));
      const T inv = top > 0 ? static_cast<T>(127) / top : static_cast<T>(0);
      int32_t sum = 0;
      for (int64_t k = 0; k < kGroup; ++k) {
        const int32_t q = static_cast<int32_t>(std::nearbyint(xg[k] * inv));
        a[i * kGroup + k] = static_cast<int8_t>(q);
        sum += q;
      }
      da[i] = static_cast<float>(top / static_cast<T>(127));
      sa[i] = static_cast<float>(sum);
    }
  });
}

#if defined(__AVX2__)
// The first `rows` of 8 float32 sums into the output (float32, or widened exactly to float64).
inline void store8(float* out, int64_t rows, __m256 v) {
  if (rows == 8) { _mm256_storeu_ps(out, v); return; }
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, v);
  for (int64_t r = 0; r < rows; ++r) out[r] = tmp[r];
}

inline void store8(double* out, int64_t rows, __m256 v) {  // float32 sums widened exactly
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, v);
  for (int64_t r = 0; r < rows; ++r) out[r] = static_cast<double>(tmp[r]);
}
#endif

}  // namespace specui_groups
