// y = x W^T for the few rows a verification scores (specui/weights/stream.py): each weight is read
// from memory once for all the rows, and each output is summed in one fixed order whatever the
// number of rows, so a token's output does not depend on the tokens scored with it.
// W is (N, K) float32 or bfloat16 (widened exactly to float32); x (M, K) float32; K a multiple of
// the vector width. Lane l of an output's accumulator sums inputs k = l, l + L, ... in order of
// k; the lanes are then added in one fixed tree.
#include "tensor.h"
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <vector>

namespace {

#if defined(__AVX2__)
// the 8 lanes of a 256-bit vector added in one fixed tree (both instruction sets end with it)
inline float hsum8(__m256 s) {
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  t = _mm_add_ss(t, _mm_movehdup_ps(t));
  return _mm_cvtss_f32(t);
}
#endif

#if defined(__AVX512F__)
constexpr int L = 16;
using V = __m512;
inline V zero() { return _mm512_setzero_ps(); }
inline V loadx(const float* p) { return _mm512_loadu_ps(p); }
inline V loadw(const float* p) { return _mm512_loadu_ps(p); }
inline V loadw(const at::BFloat16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline void store(float* p, V v) { _mm512_storeu_ps(p, v); }
inline float hsum(V v) {  // the two halves added, then the 8 lanes as AVX2 does
  __m256 lo = _mm512_castps512_ps256(v);
  __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return hsum8(_mm256_add_ps(lo, hi));
}
constexpr int NT = 4, MT = 6;
const char* kIsa = "AVX-512";
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int L = 8;
using V = __m256;
inline V zero() { return _mm256_setzero_ps(); }
inline V loadx(const float* p) { return _mm256_loadu_ps(p); }
inline V loadw(const float* p) { return _mm256_loadu_ps(p); }
inline V loadw(const at::BFloat16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline void store(float* p, V v) { _mm256_storeu_ps(p, v); }
inline float hsum(V s) { return hsum8(s); }
constexpr int NT = 4, MT = 2;
const char* kIsa = "AVX2";
#else
#error "needs AVX2 and FMA"
#endif


constexpr int64_t KC = 512;  // inputs per chunk: a chunk of every row and of NT weight rows stay in L1

// rows m0..m0+MM of outputs n0..n0+NN over inputs k0..k1, continuing the partial sums in acc
template <int NN, int MM, typename W>
inline void tile(const float* x, const W* w, float* acc, int64_t K, int64_t m0, int64_t n0, int64_t k0, int64_t k1) {
  V a[NN][MM];
  for (int i = 0; i < NN; ++i)
    for (int j = 0; j < MM; ++j) a[i][j] = loadx(acc + ((m0 + j) * NT + i) * L);
  const W* wr[NN];
  for (int i = 0; i < NN; ++i) wr[i] = w + (n0 + i) * K;
  const float* xr[MM];
  for (int j = 0; j < MM; ++j) xr[j] = x + (m0 + j) * K;
  for (int64_t k = k0; k < k1; k += L) {
    V wv[NN];
    for (int i = 0; i < NN; ++i) wv[i] = loadw(wr[i] + k);
    for (int j = 0; j < MM; ++j) {
      V xv = loadx(xr[j] + k);
      for (int i = 0; i < NN; ++i) a[i][j] = fma(wv[i], xv, a[i][j]);
    }
  }
  for (int i = 0; i < NN; ++i)
    for (int j = 0; j < MM; ++j) store(acc + ((m0 + j) * NT + i) * L, a[i][j]);
}

template <int NN, typename W>
inline void rest(int rows, const float* x, const W* w, float* acc, int64_t K, int64_t m, int64_t n0, int64_t k0, int64_t k1) {
  switch (rows) {  // fewer than MT rows left
    case 1: tile<NN, 1>(x, w, acc, K, m, n0, k0, k1); break;
    case 2: tile<NN, 2>(x, w, acc, K, m, n0, k0, k1); break;
    case 3: tile<NN, 3>(x, w, acc, K, m, n0, k0, k1); break;
    case 4: if constexpr (MT > 4) tile<NN, 4>(x, w, acc, K, m, n0, k0, k1); break;
    case 5: if constexpr (MT > 5) tile<NN, 5>(x, w, acc, K, m, n0, k0, k1); break;
    default: break;
  }
}

template <int NN, typename W>
inline void column_block(const float* x, const W* w, float* y, float* acc, int64_t M, int64_t K, int64_t N, int64_t n0) {
  std::fill(acc, acc + M * NT * L, 0.0f);
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t k1 = std::min(K, k0 + KC);
    int64_t m = 0;
    for (; m + MT <= M; m += MT) tile<NN, MT>(x, w, acc, K, m, n0, k0, k1);
    if (m < M) rest<NN>(static_cast<int>(M - m), x, w, acc, K, m, n0, k0, k1);
  }
  for (int64_t m = 0; m < M; ++m)
    for (int i = 0; i < NN; ++i) y[m * N + n0 + i] = hsum(loadx(acc + (m * NT + i) * L));
}

template <typename W>
void run(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N) {
  const int64_t blocks = (N + NT - 1) / NT;
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    std::vector<float> acc(M * NT * L);  // this thread's partial sums between chunks of K
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * NT;
      if (n0 + NT <= N) {
        column_block<NT>(x, w, y, acc.data(), M, K, N, n0);
      } else {
        for (int64_t n = n0; n < N; ++n) column_block<1>(x, w, y, acc.data(), M, K, N, n);
      }
    }
  });
}

}  // namespace

torch::Tensor stream_mm(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "shapes (M, K) and (N, K)");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && w.is_contiguous(), "float32 x, contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % L == 0, "K must be a multiple of ", L);
  auto y = torch::empty({M, N}, x.options());
  if (w.scalar_type() == torch::kFloat32) {
    run(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), M, K, N);
  } else {
    TORCH_CHECK(w.scalar_type() == torch::kBFloat16, "float32 or bfloat16 weights");
    run(x.data_ptr<float>(), w.data_ptr<at::BFloat16>(), y.data_ptr<float>(), M, K, N);
  }
  return y;
}

std::string instructions() { return kIsa; }
