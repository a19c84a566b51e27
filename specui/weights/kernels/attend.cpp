// Attention whose every query row is computed by one fixed sequence of float operations, whatever
// else is scored with it (specui/weights/attend.py): a token scored alone (decoding) or among a
// chain's or a tree's tokens (verification) gets the same bits, so a float32 model whose matrices
// are as row-independent (the w4a8 / w8a8 kernels) verifies losslessly. torch's SDPA is not: its
// blocking depends on how many queries there are.
//
// query (B, H, q, D) contiguous; key / value (B, Hk, L, D), the last dimension contiguous (views of a
// cache); H = rep * Hk (grouped heads); allowed (B or 1, q, L) bool, or empty: row i sees keys
// 0 .. L - q + i. Per query row, over the keys in order 0 .. L - 1:
//   s_j = fma(k_j[D-1], q[D-1], ... fma(k_j[0], q[0], 0)) * scale + (0, or -inf where not allowed);
//   m = max s; e_j = exp(s_j - m) (exp below, exactly 0 for -inf); sum = e_0 + e_1 + ... in order;
//   out = (fma(e_{L-1}, v_{L-1}, ... fma(e_0, v_0, 0))) / sum, element by element.
// A masked key adds exact zeros, so a row that sees keys 0 .. n - 1 of a longer cache gets the bits
// it gets over a cache of n keys, and a block of rows reads only the keys from the first any of them
// sees to the last. Rows of a head group share each key read (lanes of a vector) and, up to 6 at a
// time, each value read.
#include "tensor.h"
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "vexp.h"

namespace {

constexpr int64_t kLanes = 16;  // query rows computed side by side (lanes): each lane on its own
constexpr int64_t kKeys = 4;    // keys whose dot products run interleaved (independent chains)

// exp by range reduction and a polynomial (Cephes' expf): exactly 0 for -inf and underflow. The
// vector path below computes the same operations lane by lane, so both give the same bits.
inline float exp_lane(float x) {
  const bool zero = !(x > -87.0f);
  x = std::max(std::min(x, 88.0f), -87.0f);
  const float n = std::floor(std::fma(x, 1.44269504088896341f, 0.5f));
  float r = std::fma(n, -0.693359375f, x);
  r = std::fma(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  const float y = std::fma(p, r * r, r) + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return zero ? 0.0f : y * scale;
}

inline double exp_lane(double x) { return std::exp(x); }  // float64: the library's, one value at a time

// The additive mask of one block of lanes over the keys [lo, hi) that some lane of it sees (the
// others add exact zeros to every sum, so they are left out: a causal prefill's first rows read only
// the keys before them): bias[(j - lo) * kLanes + lane] = 0 where the lane's query sees key j, else -inf
// (lanes past the block's rows see nothing). Empty (lo = hi) where no lane sees any key.
template <typename T>
struct LaneMask {
  int64_t lo = 0, hi = 0;
  std::vector<T> bias;
};

template <typename T>
LaneMask<T> lane_mask(const bool* mask, bool causal, const int64_t* query_of, int64_t w, int64_t Q, int64_t L) {
  LaneMask<T> m;
  m.lo = L;
  for (int64_t r = 0; r < w; ++r) {
    const int64_t i = query_of[r];
    if (causal) {
      m.lo = 0;
      m.hi = std::max(m.hi, L - Q + i + 1);  // i < Q: at most L
      continue;
    }
    const bool* row = mask + i * L;
    for (int64_t j = 0; j < L; ++j)
      if (row[j]) {
        m.lo = std::min(m.lo, j);
        m.hi = std::max(m.hi, j + 1);
      }
  }
  if (m.hi <= m.lo) {
    m.lo = m.hi = 0;
    return m;
  }
  const T hidden = -std::numeric_limits<T>::infinity();
  m.bias.assign(static_cast<size_t>((m.hi - m.lo) * kLanes), hidden);
  for (int64_t r = 0; r < w; ++r) {
    const int64_t i = query_of[r];
    const bool* row = causal ? nullptr : mask + i * L;
    for (int64_t j = m.lo; j < m.hi; ++j)
      if (causal ? j <= L - Q + i : row[j]) m.bias[(j - m.lo) * kLanes + r] = T(0);
  }
  return m;
}

// Scores of every key for the lanes: s[j][lane], masked and exponentiated in place; returns
// nothing, fills `sum` (per lane, in key order). The portable loop, for float64 and CPUs without
// AVX-512 or AVX2.
template <typename T>
void scores_portable(const T* qt, const T* key, int64_t L, int64_t D, int64_t k_stride, T scale, const T* bias,
                     T* s, T* sum) {
  const T hidden = -std::numeric_limits<T>::infinity();
  T top[kLanes];
  for (int64_t r = 0; r < kLanes; ++r) top[r] = hidden, sum[r] = T(0);
  for (int64_t j = 0; j < L; ++j) {
    const T* kj = key + j * k_stride;
    T acc[kLanes] = {0};
    for (int64_t d = 0; d < D; ++d)
      for (int64_t r = 0; r < kLanes; ++r) acc[r] = std::fma(kj[d], qt[d * kLanes + r], acc[r]);
    for (int64_t r = 0; r < kLanes; ++r) {
      s[j * kLanes + r] = acc[r] * scale + bias[j * kLanes + r];
      top[r] = std::max(top[r], s[j * kLanes + r]);
    }
  }
  for (int64_t j = 0; j < L; ++j)
    for (int64_t r = 0; r < kLanes; ++r) {
      T& e = s[j * kLanes + r];
      e = top[r] == hidden ? T(0) : exp_lane(e - top[r]);
      sum[r] += e;
    }
}

// Ahead of a group of kKeys keys from key j: the values they weigh, on their way while the scores
// compute (the next pass reads them), and the keys 32 further on. Both vector paths call it.
inline void prefetch_ahead(const float* key, const float* value, int64_t j, int64_t D, int64_t k_stride,
                           int64_t v_stride) {
  for (int64_t u = 0; u < kKeys; ++u)
    for (int64_t b = 0; b < D; b += 16) {
      _mm_prefetch(reinterpret_cast<const char*>(value + (j + u) * v_stride + b), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(key + (j + 32 + u) * k_stride + b), _MM_HINT_T0);
    }
}

#if defined(__AVX512F__)
using specui_vec::exp16;

void scores_vector(const float* qt, const float* key, int64_t L, int64_t D, int64_t k_stride, float scale,
                   const float* bias, float* s, float* sum, const float* value, int64_t v_stride) {
  const __m512 hidden = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 vscale = _mm512_set1_ps(scale);
  __m512 top = hidden;
  int64_t j = 0;
  for (; j + kKeys <= L; j += kKeys) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const float *k0 = key + j * k_stride, *k1 = k0 + k_stride, *k2 = k1 + k_stride, *k3 = k2 + k_stride;
    prefetch_ahead(key, value, j, D, k_stride, v_stride);
    for (int64_t d = 0; d < D; ++d) {
      const __m512 qd = _mm512_load_ps(qt + d * kLanes);
      a0 = _mm512_fmadd_ps(_mm512_set1_ps(k0[d]), qd, a0);
      a1 = _mm512_fmadd_ps(_mm512_set1_ps(k1[d]), qd, a1);
      a2 = _mm512_fmadd_ps(_mm512_set1_ps(k2[d]), qd, a2);
      a3 = _mm512_fmadd_ps(_mm512_set1_ps(k3[d]), qd, a3);
    }
    const __m512 acc[kKeys] = {a0, a1, a2, a3};
    for (int64_t u = 0; u < kKeys; ++u) {
      const __m512 v = _mm512_add_ps(_mm512_mul_ps(acc[u], vscale), _mm512_loadu_ps(bias + (j + u) * kLanes));
      _mm512_store_ps(s + (j + u) * kLanes, v);
      top = _mm512_max_ps(top, v);
    }
  }
  for (; j < L; ++j) {
    const float* kj = key + j * k_stride;
    __m512 a = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; ++d) a = _mm512_fmadd_ps(_mm512_set1_ps(kj[d]), _mm512_load_ps(qt + d * kLanes), a);
    const __m512 v = _mm512_add_ps(_mm512_mul_ps(a, vscale), _mm512_loadu_ps(bias + j * kLanes));
    _mm512_store_ps(s + j * kLanes, v);
    top = _mm512_max_ps(top, v);
  }
  const __mmask16 seen = _mm512_cmp_ps_mask(top, hidden, _CMP_NEQ_UQ);
  __m512 total = _mm512_setzero_ps();
  for (j = 0; j < L; ++j) {
    const __m512 e = _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(_mm512_load_ps(s + j * kLanes), top)));
    _mm512_store_ps(s + j * kLanes, e);
    total = _mm512_add_ps(total, e);
  }
  _mm512_storeu_ps(sum, total);
}

// The vector operations the value sums below are written in (16 float32 lanes here).
using VecF = __m512;
constexpr int64_t kWidth = 16;
inline VecF vzero() { return _mm512_setzero_ps(); }
inline VecF vload(const float* p) { return _mm512_loadu_ps(p); }
inline VecF vset1(float x) { return _mm512_set1_ps(x); }
inline VecF vfma(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
inline VecF vdiv(VecF a, VecF b) { return _mm512_div_ps(a, b); }
inline void vstore(float* p, VecF v) { _mm512_storeu_ps(p, v); }
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2: the 16 lanes as two vectors of 8, the same operations lane by lane as the AVX-512 path.
using specui_vec::exp8;

void scores_vector(const float* qt, const float* key, int64_t L, int64_t D, int64_t k_stride, float scale,
                   const float* bias, float* s, float* sum, const float* value, int64_t v_stride) {
  const __m256 hidden = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256 vscale = _mm256_set1_ps(scale);
  __m256 top0 = hidden, top1 = hidden;
  int64_t j = 0;
  for (; j + kKeys <= L; j += kKeys) {
    __m256 a[kKeys][2];
    for (int64_t u = 0; u < kKeys; ++u) a[u][0] = a[u][1] = _mm256_setzero_ps();
    const float* k0 = key + j * k_stride;
    prefetch_ahead(key, value, j, D, k_stride, v_stride);
    for (int64_t d = 0; d < D; ++d) {
      const __m256 q0 = _mm256_load_ps(qt + d * kLanes), q1 = _mm256_load_ps(qt + d * kLanes + 8);
#pragma GCC unroll 4
      for (int64_t u = 0; u < kKeys; ++u) {
        const __m256 kd = _mm256_set1_ps(k0[u * k_stride + d]);
        a[u][0] = _mm256_fmadd_ps(kd, q0, a[u][0]);
        a[u][1] = _mm256_fmadd_ps(kd, q1, a[u][1]);
      }
    }
    for (int64_t u = 0; u < kKeys; ++u) {
      const float* b = bias + (j + u) * kLanes;
      const __m256 v0 = _mm256_add_ps(_mm256_mul_ps(a[u][0], vscale), _mm256_loadu_ps(b));
      const __m256 v1 = _mm256_add_ps(_mm256_mul_ps(a[u][1], vscale), _mm256_loadu_ps(b + 8));
      _mm256_store_ps(s + (j + u) * kLanes, v0);
      _mm256_store_ps(s + (j + u) * kLanes + 8, v1);
      top0 = _mm256_max_ps(top0, v0);
      top1 = _mm256_max_ps(top1, v1);
    }
  }
  for (; j < L; ++j) {
    const float* kj = key + j * k_stride;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    for (int64_t d = 0; d < D; ++d) {
      const __m256 kd = _mm256_set1_ps(kj[d]);
      a0 = _mm256_fmadd_ps(kd, _mm256_load_ps(qt + d * kLanes), a0);
      a1 = _mm256_fmadd_ps(kd, _mm256_load_ps(qt + d * kLanes + 8), a1);
    }
    const __m256 v0 = _mm256_add_ps(_mm256_mul_ps(a0, vscale), _mm256_loadu_ps(bias + j * kLanes));
    const __m256 v1 = _mm256_add_ps(_mm256_mul_ps(a1, vscale), _mm256_loadu_ps(bias + j * kLanes + 8));
    _mm256_store_ps(s + j * kLanes, v0);
    _mm256_store_ps(s + j * kLanes + 8, v1);
    top0 = _mm256_max_ps(top0, v0);
    top1 = _mm256_max_ps(top1, v1);
  }
  const __m256 seen0 = _mm256_cmp_ps(top0, hidden, _CMP_NEQ_UQ), seen1 = _mm256_cmp_ps(top1, hidden, _CMP_NEQ_UQ);
  __m256 total0 = _mm256_setzero_ps(), total1 = total0;
  for (j = 0; j < L; ++j) {
    float* sj = s + j * kLanes;
    const __m256 e0 = _mm256_and_ps(seen0, exp8(_mm256_sub_ps(_mm256_load_ps(sj), top0)));
    const __m256 e1 = _mm256_and_ps(seen1, exp8(_mm256_sub_ps(_mm256_load_ps(sj + 8), top1)));
    _mm256_store_ps(sj, e0);
    _mm256_store_ps(sj + 8, e1);
    total0 = _mm256_add_ps(total0, e0);
    total1 = _mm256_add_ps(total1, e1);
  }
  _mm256_storeu_ps(sum, total0);
  _mm256_storeu_ps(sum + 8, total1);
}

// The vector operations the value sums below are written in (8 float32 lanes here).
using VecF = __m256;
constexpr int64_t kWidth = 8;
inline VecF vzero() { return _mm256_setzero_ps(); }
inline VecF vload(const float* p) { return _mm256_loadu_ps(p); }
inline VecF vset1(float x) { return _mm256_set1_ps(x); }
inline VecF vfma(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
inline VecF vdiv(VecF a, VecF b) { return _mm256_div_ps(a, b); }
inline void vstore(float* p, VecF v) { _mm256_storeu_ps(p, v); }
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// The value sums of up to R rows at once over C vectors of dimensions from d0 (R x C accumulators;
// 24 of AVX-512's 32 registers, 12 of AVX2's 16): each key's values are read once for all R rows,
// and each element's fma chain is the one-row loop's, so the same bits.
template <int C, int R>
inline void weigh_rows(const float* s, const float* sum, float* const* out_rows, int64_t r0, const float* value,
                       int64_t L, int64_t v_stride, int64_t d0) {
  VecF acc[R][C];
#pragma GCC unroll 8
  for (int u = 0; u < R; ++u)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[u][c] = vzero();
  for (int64_t j = 0; j < L; ++j) {
    const float* vj = value + j * v_stride + d0;
    VecF v[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) v[c] = vload(vj + kWidth * c);
#pragma GCC unroll 8
    for (int u = 0; u < R; ++u) {
      const VecF e = vset1(s[j * kLanes + r0 + u]);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[u][c] = vfma(e, v[c], acc[u][c]);
    }
  }
#pragma GCC unroll 8
  for (int u = 0; u < R; ++u) {
    float* o = out_rows[r0 + u] + d0;
    const float total = sum[r0 + u];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) vstore(o + kWidth * c, total > 0.0f ? vdiv(acc[u][c], vset1(total)) : acc[u][c]);
  }
}

// All w rows, R at a time, over D in slices of C vectors.
template <int C, int R>
void weigh_grouped(const float* s, const float* sum, float* const* out_rows, int64_t w, const float* value, int64_t L,
                   int64_t D, int64_t v_stride) {
  for (int64_t d0 = 0; d0 < D; d0 += kWidth * C) {
    int64_t r0 = 0;
    for (; r0 + R <= w; r0 += R) weigh_rows<C, R>(s, sum, out_rows, r0, value, L, v_stride, d0);
    switch (w - r0) {  // the rest, fewer than R rows
      case 1: weigh_rows<C, 1>(s, sum, out_rows, r0, value, L, v_stride, d0); break;
      case 2: if constexpr (R > 2) weigh_rows<C, 2>(s, sum, out_rows, r0, value, L, v_stride, d0); break;
      case 3: if constexpr (R > 3) weigh_rows<C, 3>(s, sum, out_rows, r0, value, L, v_stride, d0); break;
      case 4: if constexpr (R > 4) weigh_rows<C, 4>(s, sum, out_rows, r0, value, L, v_stride, d0); break;
      case 5: if constexpr (R > 5) weigh_rows<C, 5>(s, sum, out_rows, r0, value, L, v_stride, d0); break;
      case 6: if constexpr (R > 6) weigh_rows<C, 6>(s, sum, out_rows, r0, value, L, v_stride, d0); break;
      case 7: if constexpr (R > 7) weigh_rows<C, 7>(s, sum, out_rows, r0, value, L, v_stride, d0); break;
      default: break;
    }
  }
}

// Whether the grouped value sums serve D, and then computed them: AVX-512 head sizes 16 / 32 / 64 / 128
// in one slice, AVX2 16, or multiples of 32 up to 128 in slices of 32 dimensions.
inline bool weigh_fast(const float* s, const float* sum, float* const* out_rows, int64_t w, const float* value,
                       int64_t L, int64_t D, int64_t v_stride) {
  if constexpr (kWidth == 16) {
    switch (D) {
      case 16: weigh_grouped<1, 8>(s, sum, out_rows, w, value, L, D, v_stride); return true;
      case 32: weigh_grouped<2, 8>(s, sum, out_rows, w, value, L, D, v_stride); return true;
      case 64: weigh_grouped<4, 6>(s, sum, out_rows, w, value, L, D, v_stride); return true;
      case 128: weigh_grouped<8, 3>(s, sum, out_rows, w, value, L, D, v_stride); return true;
      default: return false;
    }
  } else {
    if (D == 16) {
      weigh_grouped<2, 5>(s, sum, out_rows, w, value, L, D, v_stride);
      return true;
    }
    if (D % 32 == 0 && D <= 128) {
      weigh_grouped<4, 3>(s, sum, out_rows, w, value, L, D, v_stride);
      return true;
    }
    return false;
  }
}
#endif

template <typename T>
void scores(const T* qt, const T* key, int64_t L, int64_t D, int64_t k_stride, T scale, const T* bias, T* s, T* sum,
            const T* value, int64_t v_stride) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  if constexpr (std::is_same_v<T, float>) {
    scores_vector(qt, key, L, D, k_stride, scale, bias, s, sum, value, v_stride);
    return;
  }
#endif
  scores_portable<T>(qt, key, L, D, k_stride, scale, bias, s, sum);
}

// out_r = (sum over keys in order of fma(e_j, v_j, .)) / sum_r, for the block's w lanes.
template <typename T>
void weigh_values(const T* s, const T* sum, T* const* out_rows, int64_t w, const T* value, int64_t L, int64_t D,
                  int64_t v_stride) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    if (weigh_fast(s, sum, out_rows, w, value, L, D, v_stride)) return;
    if (D % 16 == 0 && D <= 256) {  // the same fma chain per element, 16 elements a vector
      const int64_t chunks = D / 16;
      for (int64_t r = 0; r < w; ++r) {
        __m512 acc[16];
        for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_setzero_ps();
        for (int64_t j = 0; j < L; ++j) {
          const __m512 e = _mm512_set1_ps(s[j * kLanes + r]);
          const float* vj = value + j * v_stride;
          for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_fmadd_ps(e, _mm512_loadu_ps(vj + 16 * c), acc[c]);
        }
        float* o = out_rows[r];
        const __m512 total = _mm512_set1_ps(sum[r]);
        for (int64_t c = 0; c < chunks; ++c)
          _mm512_storeu_ps(o + 16 * c, sum[r] > 0.0f ? _mm512_div_ps(acc[c], total) : acc[c]);
      }
      return;
    }
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, float>) {
    if (weigh_fast(s, sum, out_rows, w, value, L, D, v_stride)) return;
    if (D % 8 == 0 && D <= 128) {  // the same fma chain per element, 8 elements a vector
      const int64_t chunks = D / 8;
      for (int64_t r = 0; r < w; ++r) {
        __m256 acc[16];
        for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm256_setzero_ps();
        for (int64_t j = 0; j < L; ++j) {
          const __m256 e = _mm256_set1_ps(s[j * kLanes + r]);
          const float* vj = value + j * v_stride;
          for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm256_fmadd_ps(e, _mm256_loadu_ps(vj + 8 * c), acc[c]);
        }
        float* o = out_rows[r];
        const __m256 total = _mm256_set1_ps(sum[r]);
        for (int64_t c = 0; c < chunks; ++c)
          _mm256_storeu_ps(o + 8 * c, sum[r] > 0.0f ? _mm256_div_ps(acc[c], total) : acc[c]);
      }
      return;
    }
  }
#endif
  for (int64_t r = 0; r < w; ++r) {
    T* o = out_rows[r];
    std::fill(o, o + D, T(0));
    for (int64_t j = 0; j < L; ++j) {
      const T e = s[j * kLanes + r];
      const T* vj = value + j * v_stride;
      for (int64_t d = 0; d < D; ++d) o[d] = std::fma(e, vj[d], o[d]);
    }
    if (sum[r] > T(0))
      for (int64_t d = 0; d < D; ++d) o[d] /= sum[r];
  }
}

template <typename T>
void attend_all(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                const torch::Tensor& allowed, double scale, torch::Tensor& out) {
  const int64_t B = query.size(0), H = query.size(1), Q = query.size(2), D = query.size(3);
  const int64_t Hk = key.size(1), L = key.size(2), rep = H / Hk;
  const T* qp = query.data_ptr<T>();
  const T* kp = key.data_ptr<T>();
  const T* vp = value.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const bool causal = allowed.numel() == 0;
  const bool* mp = causal ? nullptr : allowed.data_ptr<bool>();
  const int64_t mask_batch = causal || allowed.size(0) == 1 ? 0 : Q * L;
  const int64_t rows = rep * Q;  // rows of one head group: (head, query) pairs, head-major
  const int64_t blocks = (rows + kLanes - 1) / kLanes;
  // the lanes' masks, the same for every head group of a batch row: built once
  std::vector<LaneMask<T>> masks(static_cast<size_t>(B * blocks));
  for (int64_t c = 0; c < B * blocks; ++c) {
    const int64_t b = c / blocks, r0 = (c % blocks) * kLanes, w = std::min(kLanes, rows - r0);
    int64_t query_of[kLanes];
    for (int64_t r = 0; r < w; ++r) query_of[r] = (r0 + r) % Q;
    masks[c] = lane_mask<T>(causal ? nullptr : mp + b * mask_batch, causal, query_of, w, Q, L);
  }
  at::parallel_for(0, B * Hk * blocks, 1, [&](int64_t p0, int64_t p1) {
    std::vector<T> s(static_cast<size_t>(L * kLanes) + 16);
    std::vector<T> qt(static_cast<size_t>(D * kLanes) + 16);
    T* sa = reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(s.data()) + 63) & ~uintptr_t(63));
    T* qa = reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(qt.data()) + 63) & ~uintptr_t(63));
    T* out_rows[kLanes];
    T sum[kLanes];
    for (int64_t p = p0; p < p1; ++p) {
      // a head group's blocks taken first, last, second, second to last, ...: a causal prefill's short
      // and long blocks alternate, so the threads' contiguous shares cost about the same
      const int64_t k = p % blocks, bg = p / blocks, b = bg / Hk, g = bg % Hk;
      const int64_t c = k % 2 == 0 ? k / 2 : blocks - 1 - k / 2;
      const int64_t r0 = c * kLanes, w = std::min(kLanes, rows - r0);
      std::fill(qa, qa + D * kLanes, T(0));
      for (int64_t r = 0; r < w; ++r) {
        const int64_t h = g * rep + (r0 + r) / Q, i = (r0 + r) % Q;
        const T* qr = qp + ((b * H + h) * Q + i) * D;
        for (int64_t d = 0; d < D; ++d) qa[d * kLanes + r] = qr[d];
        out_rows[r] = op + ((b * Q + i) * H + h) * D;
      }
      const LaneMask<T>& m = masks[b * blocks + c];
      const T* kg = kp + b * key.stride(0) + g * key.stride(1) + m.lo * key.stride(2);
      const T* vg = vp + b * value.stride(0) + g * value.stride(1) + m.lo * value.stride(2);
      scores<T>(qa, kg, m.hi - m.lo, D, key.stride(2), static_cast<T>(scale), m.bias.data(), sa, sum, vg,
                value.stride(2));
      weigh_values<T>(sa, sum, out_rows, w, vg, m.hi - m.lo, D, value.stride(2));
    }
  });
}

}  // namespace


torch::Tensor attend(torch::Tensor query, torch::Tensor key, torch::Tensor value, torch::Tensor allowed,
                     double scale) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4, "(B, H, q, D) query, (B, Hk, L, D) key/value");
  TORCH_CHECK(query.is_contiguous(), "a contiguous query");
  TORCH_CHECK(key.stride(3) == 1 && value.stride(3) == 1, "key and value contiguous in their last dimension");
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type(),
              "query, key and value of one dtype");
  TORCH_CHECK(key.sizes() == value.sizes() && key.size(0) == query.size(0) && key.size(3) == query.size(3),
              "key and value of the query's batch and head size");
  TORCH_CHECK(query.size(1) % key.size(1) == 0, "query heads a multiple of key/value heads");
  const int64_t Q = query.size(2), L = key.size(2);
  TORCH_CHECK(L >= Q || allowed.numel() > 0, "fewer keys than queries needs a mask");
  if (allowed.numel() > 0) {
    TORCH_CHECK(allowed.scalar_type() == torch::kBool && allowed.is_contiguous() && allowed.dim() == 3,
                "a contiguous bool (B or 1, q, L) mask");
    TORCH_CHECK(allowed.size(1) == Q && allowed.size(2) == L &&
                (allowed.size(0) == 1 || allowed.size(0) == query.size(0)), "a mask of (B or 1, q, L)");
  }
  auto out = torch::empty({query.size(0), Q, query.size(1), query.size(3)}, query.options());
  if (query.scalar_type() == torch::kFloat64) {
    attend_all<double>(query, key, value, allowed, scale, out);
  } else {
    TORCH_CHECK(query.scalar_type() == torch::kFloat32, "float32 or float64");
    attend_all<float>(query, key, value, allowed, scale, out);
  }
  return out;
}
