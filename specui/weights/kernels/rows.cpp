// The arithmetic around an int8 x int8 product (specui/weights/w8a8.py), one pass each instead of
// five small torch ops a matrix. Bit for bit what W8A8Linear's torch ops compute:
//   round_rows: top = max(max|x|, 1e-30) per row (NaN where the row has one), q = uint8(round-half-even(
//               fma(x, levels / top, zero))), in the input's precision (torch's addcmul fuses the same way);
//   scale_rows: out = T(product) * top, T the precision of top (torch's promotion of float32 * T).
#include "tensor.h"
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

namespace {

template <typename T>
inline T top_tail(const T* x, int64_t k0, int64_t K, T big, bool& nan) {
  for (int64_t k = k0; k < K; ++k) {
    nan |= std::isnan(x[k]);
    big = std::max(big, std::abs(x[k]));
  }
  return big;
}

template <typename T>
inline void round_tail(const T* x, uint8_t* q, int64_t k0, int64_t K, T t, T zero) {
  for (int64_t k = k0; k < K; ++k)
    q[k] = static_cast<uint8_t>(static_cast<int32_t>(std::nearbyint(std::fma(x[k], t, zero))));
}

#if defined(__AVX512F__)
constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

inline int64_t top_vec(const double* x, int64_t K, double& big, bool& nan) {
  __m512d b = _mm512_setzero_pd();
  __mmask8 n = 0;
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m512d v = _mm512_loadu_pd(x + k);
    n |= _mm512_cmp_pd_mask(v, v, _CMP_UNORD_Q);
    b = _mm512_max_pd(b, _mm512_abs_pd(v));
  }
  big = _mm512_reduce_max_pd(b);
  nan = n != 0;
  return k;
}

inline int64_t top_vec(const float* x, int64_t K, float& big, bool& nan) {
  __m512 b = _mm512_setzero_ps();
  __mmask16 n = 0;
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 v = _mm512_loadu_ps(x + k);
    n |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    b = _mm512_max_ps(b, _mm512_abs_ps(v));
  }
  big = _mm512_reduce_max_ps(b);
  nan = n != 0;
  return k;
}

inline __m256i round8(const double* x, __m512d t, __m512d zero) {
  return _mm512_cvtpd_epi32(_mm512_roundscale_pd(_mm512_fmadd_pd(_mm512_loadu_pd(x), t, zero), kNearest));
}

inline int64_t round_vec(const double* x, uint8_t* q, int64_t K, double t, double zero) {
  const __m512d tv = _mm512_set1_pd(t), zv = _mm512_set1_pd(zero);
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(round8(x + k, tv, zv)), round8(x + k + 8, tv, zv), 1);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtepi32_epi8(both));
  }
  return k;
}

inline int64_t round_vec(const float* x, uint8_t* q, int64_t K, float t, float zero) {
  const __m512 tv = _mm512_set1_ps(t), zv = _mm512_set1_ps(zero);
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 v = _mm512_roundscale_ps(_mm512_fmadd_ps(_mm512_loadu_ps(x + k), tv, zv), kNearest);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));
  }
  return k;
}
#else  // AVX2 builds: the scalar loops do it all (the compiler vectorizes what it can)
template <typename T>
inline int64_t top_vec(const T*, int64_t, T& big, bool& nan) {
  big = 0;
  nan = false;
  return 0;
}
template <typename T>
inline int64_t round_vec(const T*, uint8_t*, int64_t, T, T) { return 0; }
#endif

template <typename T>
void round_rows_of(const T* x, uint8_t* q, T* top, int64_t M, int64_t K, T levels, T zero) {
  at::parallel_for(0, M, 4, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const T* xr = x + m * K;
      uint8_t* qr = q + m * K;
      T big;
      bool nan;
      const int64_t k0 = top_vec(xr, K, big, nan);  // sets big and nan for the first k0 inputs
      big = top_tail(xr, k0, K, big, nan);
      big = nan ? std::numeric_limits<T>::quiet_NaN() : std::max(big, static_cast<T>(1e-30));
      top[m] = big;
      const T t = levels / big;
      const int64_t k1 = round_vec(xr, qr, K, t, zero);
      round_tail(xr, qr, k1, K, t, zero);
    }
  });
}

template <typename T>
void scale_rows_of(const float* p, const T* top, T* out, int64_t M, int64_t N) {
  for (int64_t m = 0; m < M; ++m) {
    const T t = top[m];
    const float* pr = p + m * N;
    T* o = out + m * N;
    for (int64_t n = 0; n < N; ++n) o[n] = static_cast<T>(pr[n]) * t;
  }
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> round_rows(torch::Tensor x, double levels, double zero) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "a contiguous (rows, K) input");
  const int64_t M = x.size(0), K = x.size(1);
  auto q = torch::empty({M, K}, x.options().dtype(torch::kUInt8));
  auto top = torch::empty({M, 1}, x.options());
  if (x.scalar_type() == torch::kFloat64) {
    round_rows_of<double>(x.data_ptr<double>(), q.data_ptr<uint8_t>(), top.data_ptr<double>(), M, K, levels, zero);
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32, "float32 or float64 input");
    round_rows_of<float>(x.data_ptr<float>(), q.data_ptr<uint8_t>(), top.data_ptr<float>(), M, K,
                         static_cast<float>(levels), static_cast<float>(zero));
  }
  return {q, top};
}

torch::Tensor scale_rows(torch::Tensor product, torch::Tensor top) {
  TORCH_CHECK(product.dim() == 2 && product.is_contiguous() && product.scalar_type() == torch::kFloat32,
              "a contiguous (rows, N) float32 product");
  TORCH_CHECK(top.is_contiguous() && top.numel() == product.size(0), "one top per row");
  const int64_t M = product.size(0), N = product.size(1);
  auto out = torch::empty({M, N}, product.options().dtype(top.scalar_type()));
  if (top.scalar_type() == torch::kFloat64) {
    scale_rows_of<double>(product.data_ptr<float>(), top.data_ptr<double>(), out.data_ptr<double>(), M, N);
  } else {
    TORCH_CHECK(top.scalar_type() == torch::kFloat32, "float32 or float64 scales");
    scale_rows_of<float>(product.data_ptr<float>(), top.data_ptr<float>(), out.data_ptr<float>(), M, N);
  }
  return out;
}
