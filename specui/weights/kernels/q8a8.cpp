// 8-bit weight groups times 8-bit activation groups (specui/weights/q8a8.py): the product llama.cpp
// computes for Q8_0 weights (a GGUF's output head, the bundled one's included), for w4a8's output head
// on CPUs whose oneDNN int8 product saturates at 8-bit activations (AVX2 without VNNI). Reads each
// weight once for every row it is given.
//
// Weights: rows in blocks of 8, inputs in groups of 32, w = d * q (q in -127..127, d float16 per row and
// group: a GGUF's Q8_0 blocks exactly). Packed per (block, group) as 256 bytes: 8 vectors of 8 rows x 4
// bytes, bytes of row r in vector j holding inputs 4j .. 4j + 3; then the group's 8 d (float16, or
// their bits as int16) in `scales`.
// Activations: groups.h (llama.cpp's Q8 rounding: a in -127..127, one scale da per group).
// Output, per row and column, over the groups in order: acc = fma(float(sum(q a)), d * da, acc) in
// float32, written in x's dtype (float32 or float64). Nothing mixes rows and the order of every float
// operation is fixed, so a row's output is bit for bit the same whatever else is scored with it, and
// the AVX2 path and the portable one give the same bits: the int8 pairs are summed by
// _mm256_maddubs_epi16 on |a| and q signed by a, at most 2 x 127 x 127 = 32258, so nothing saturates.
#include "tensor.h"
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <string>

#include "groups.h"

namespace {

using specui_groups::kGroup;
using specui_groups::round_groups;
constexpr int64_t kRows = 8;     // output rows a block
constexpr int64_t kBytes = 256;  // packed bytes a (block, group)

inline float half_to_float(const at::Half* h) { return static_cast<float>(*h); }

// One block of 8 rows against rows [t0, t1) of the activations, one scalar at a time: the reference.
template <typename O>
void block_portable(const int8_t* wb, const at::Half* sb, const int8_t* a, const float* da, O* out,
                    int64_t t0, int64_t t1, int64_t NG, int64_t K, int64_t N, int64_t col) {
  const int64_t rows = std::min(kRows, N - col);
  for (int64_t t = t0; t < t1; ++t) {
    float acc[kRows] = {0};
    for (int64_t g = 0; g < NG; ++g) {
      const int8_t* wg = wb + g * kBytes;
      const int8_t* ag = a + t * K + g * kGroup;
      for (int64_t r = 0; r < rows; ++r) {
        int32_t s = 0;
        for (int64_t j = 0; j < 8; ++j)
          for (int64_t b = 0; b < 4; ++b) s += static_cast<int32_t>(wg[j * 32 + r * 4 + b]) * ag[4 * j + b];
        acc[r] = std::fma(static_cast<float>(s), half_to_float(sb + g * kRows + r) * da[t * NG + g], acc[r]);
      }
    }
    for (int64_t r = 0; r < rows; ++r) out[t * N + col + r] = static_cast<O>(acc[r]);
  }
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr bool kVector = true;
constexpr int64_t kAhead = 8;  // groups prefetched ahead
constexpr int kTile = 4;       // activation rows a pass over the block's weights

using specui_groups::store8;

template <int T, typename O>
inline void micro(const int8_t* wb, const at::Half* sb, const int8_t* a, const float* da, O* out, int64_t t0,
                  int64_t NG, int64_t K, int64_t N, int64_t col) {
  __m256 acc[T];
  const int32_t* at[T];
#pragma GCC unroll 4
  for (int u = 0; u < T; ++u) {
    acc[u] = _mm256_setzero_ps();
    at[u] = reinterpret_cast<const int32_t*>(a + (t0 + u) * K);
  }
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < NG; ++g) {
    const int8_t* wg = wb + g * kBytes;
    for (int c = 0; c < 4; ++c) _mm_prefetch(reinterpret_cast<const char*>(wg + kAhead * kBytes + 64 * c), _MM_HINT_T0);
    __m256i s[T];
#pragma GCC unroll 4
    for (int u = 0; u < T; ++u) s[u] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 32 * j));
#pragma GCC unroll 4
      for (int u = 0; u < T; ++u) {
        const __m256i a4 = _mm256_set1_epi32(at[u][g * 8 + j]);
        const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(a4), _mm256_sign_epi8(v, a4));
        s[u] = _mm256_add_epi32(s[u], _mm256_madd_epi16(pairs, ones));
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + g * kRows)));
#pragma GCC unroll 4
    for (int u = 0; u < T; ++u) {
      const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(da[(t0 + u) * NG + g]));
      acc[u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[u]), scale, acc[u]);
    }
  }
  const int64_t rows = std::min(kRows, N - col);
#pragma GCC unroll 4
  for (int u = 0; u < T; ++u) store8(out + (t0 + u) * N + col, rows, acc[u]);
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr int kWide = 8;  // activation rows a pass on VNNI: 8 sums + 8 accumulators of the 32 vector registers

// VNNI's dot product takes unsigned x signed bytes: the weights as w + 128 (the sign bit flipped, once
// per vector for every row), the activations as they are, and 128 * sum(a) (round_groups' sa, an exact
// integer) taken off each group's int32 sum. That sum is then the portable loop's exactly, and every float
// operation after it the same, so this path gives the same bits. Two neighbouring blocks (16 rows) go in one
// 512-bit register; a block without a neighbour in this thread's range goes as its own pair (`second`
// false: the upper half computed on it again and not stored). On a 2-core Zen 5, a 2048 x 8192 matrix
// (cache-warm) for 1 / 4 / 8 / 16 rows: 0.128 / 0.422 / 1.000 / 1.610 ms with AVX2's pairwise products,
// 0.120 / 0.235 / 0.426 / 0.833 here a block at a time in 256-bit registers, 0.106 / 0.177 / 0.270 / 0.511 so.
template <int T, typename O>
inline void micro_pair(const int8_t* wb, const int8_t* wb2, const at::Half* sb, const at::Half* sb2, bool second,
                       const int8_t* a, const float* da, const float* sa, O* out, int64_t t0, int64_t NG, int64_t K,
                       int64_t N, int64_t col) {
  __m512 acc[T];
  const int32_t* at[T];
#pragma GCC unroll 8
  for (int u = 0; u < T; ++u) {
    acc[u] = _mm512_setzero_ps();
    at[u] = reinterpret_cast<const int32_t*>(a + (t0 + u) * K);
  }
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t g = 0; g < NG; ++g) {
    const int8_t* wg = wb + g * kBytes;
    const int8_t* wg2 = wb2 + g * kBytes;
    for (int c = 0; c < 4; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(wg + kAhead * kBytes + 64 * c), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wg2 + kAhead * kBytes + 64 * c), _MM_HINT_T0);
    }
    __m512i s[T];
#pragma GCC unroll 8
    for (int u = 0; u < T; ++u) s[u] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m512i both = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 32 * j))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg2 + 32 * j)), 1);
      const __m512i v = _mm512_xor_si512(both, flip);
#pragma GCC unroll 8
      for (int u = 0; u < T; ++u) s[u] = _mm512_dpbusd_epi32(s[u], v, _mm512_set1_epi32(at[u][g * 8 + j]));
    }
    const __m256i halves = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + g * kRows))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb2 + g * kRows)), 1);
    const __m512 d = _mm512_cvtph_ps(halves);
#pragma GCC unroll 8
    for (int u = 0; u < T; ++u) {
      const int64_t i = (t0 + u) * NG + g;
      const __m512i exact = _mm512_sub_epi32(s[u], _mm512_set1_epi32(128 * static_cast<int32_t>(sa[i])));
      const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(da[i]));
      acc[u] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), scale, acc[u]);
    }
  }
  const int64_t rows = std::min(kRows, N - col), rows2 = second ? std::min(kRows, N - col - kRows) : 0;
#pragma GCC unroll 8
  for (int u = 0; u < T; ++u) {
    store8(out + (t0 + u) * N + col, rows, _mm512_castps512_ps256(acc[u]));
    if (rows2 > 0)
      store8(out + (t0 + u) * N + col + kRows, rows2,
             _mm256_castsi256_ps(_mm512_extracti64x4_epi64(_mm512_castps_si512(acc[u]), 1)));
  }
}

#define SPECUI_Q8A8_PAIRED 1

// Blocks wb and the next one (`second`), or wb alone, against every activation row, kWide rows a pass.
template <typename O>
void block_pair(const int8_t* wb, const at::Half* sb, bool second, const int8_t* a, const float* da, const float* sa,
                O* out, int64_t M, int64_t NG, int64_t K, int64_t N, int64_t col) {
  const int8_t* wb2 = second ? wb + NG * kBytes : wb;  // the next block's groups, or this one's again
  const at::Half* sb2 = second ? sb + NG * kRows : sb;
  int64_t t = 0;
  for (; M - t >= kWide; t += kWide) micro_pair<kWide, O>(wb, wb2, sb, sb2, second, a, da, sa, out, t, NG, K, N, col);
  switch (M - t) {
    case 7: micro_pair<7, O>(wb, wb2, sb, sb2, second, a, da, sa, out, t, NG, K, N, col); break;
    case 6: micro_pair<6, O>(wb, wb2, sb, sb2, second, a, da, sa, out, t, NG, K, N, col); break;
    case 5: micro_pair<5, O>(wb, wb2, sb, sb2, second, a, da, sa, out, t, NG, K, N, col); break;
    case 4: micro_pair<4, O>(wb, wb2, sb, sb2, second, a, da, sa, out, t, NG, K, N, col); break;
    case 3: micro_pair<3, O>(wb, wb2, sb, sb2, second, a, da, sa, out, t, NG, K, N, col); break;
    case 2: micro_pair<2, O>(wb, wb2, sb, sb2, second, a, da, sa, out, t, NG, K, N, col); break;
    case 1: micro_pair<1, O>(wb, wb2, sb, sb2, second, a, da, sa, out, t, NG, K, N, col); break;
    default: break;
  }
}

template <typename O>
void block_vector(const int8_t* wb, const at::Half* sb, const int8_t* a, const float* da, const float* sa, O* out,
                  int64_t M, int64_t NG, int64_t K, int64_t N, int64_t col) {
  block_pair<O>(wb, sb, false, a, da, sa, out, M, NG, K, N, col);
}
constexpr const char* kPath = "AVX512-VNNI";
#else
template <typename O>
void block_vector(const int8_t* wb, const at::Half* sb, const int8_t* a, const float* da, const float*, O* out,
                  int64_t M, int64_t NG, int64_t K, int64_t N, int64_t col) {
  int64_t t = 0;
  for (; M - t >= kTile; t += kTile) micro<kTile, O>(wb, sb, a, da, out, t, NG, K, N, col);
  switch (M - t) {
    case 3: micro<3, O>(wb, sb, a, da, out, t, NG, K, N, col); break;
    case 2: micro<2, O>(wb, sb, a, da, out, t, NG, K, N, col); break;
    case 1: micro<1, O>(wb, sb, a, da, out, t, NG, K, N, col); break;
    default: break;
  }
}
constexpr const char* kPath = "AVX2";
#endif
#else
constexpr bool kVector = false;
constexpr const char* kPath = "portable loop";
template <typename O>
void block_vector(const int8_t* wb, const at::Half* sb, const int8_t* a, const float* da, const float*, O* out,
                  int64_t M, int64_t NG, int64_t K, int64_t N, int64_t col) {
  block_portable(wb, sb, a, da, out, 0, M, NG, K, N, col);
}
#endif

template <typename O>
void blocks(const int8_t* w, const at::Half* s, const int8_t* a, const float* da, const float* sa, O* o, int64_t M,
            int64_t N, int64_t K, bool vector) {
  const int64_t NG = K / kGroup, NB = (N + kRows - 1) / kRows;
  at::parallel_for(0, NB, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
#if defined(SPECUI_Q8A8_PAIRED)
      if (vector && b + 1 < b1) {  // two blocks at once (both in this thread's range)
        block_pair<O>(w + b * NG * kBytes, s + b * NG * kRows, true, a, da, sa, o, M, NG, K, N, b * kRows);
        ++b;
        continue;
      }
#endif
      if (vector) {
        block_vector<O>(w + b * NG * kBytes, s + b * NG * kRows, a, da, sa, o, M, NG, K, N, b * kRows);
      } else {
        block_portable<O>(w + b * NG * kBytes, s + b * NG * kRows, a, da, o, 0, M, NG, K, N, b * kRows);
      }
    }
  });
}

// (M, K) float32 / float64 x -> (M, N) products in x's dtype (float32 sums, widened for float64)
torch::Tensor product(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, int64_t N, bool vector) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "a contiguous (rows, K) input");
  TORCH_CHECK(packed.scalar_type() == torch::kInt8 && packed.is_contiguous(), "packed int8 weights");
  TORCH_CHECK((scales.scalar_type() == torch::kFloat16 || scales.scalar_type() == torch::kInt16) && scales.is_contiguous(),
              "float16 scales (or their bits as int16)");
  const int64_t M = x.size(0), K = x.size(1), NG = K / kGroup, NB = (N + kRows - 1) / kRows;
  TORCH_CHECK(K % kGroup == 0 && packed.numel() == NB * NG * kBytes && scales.numel() == NB * NG * kRows,
              "weights packed for another shape");
  auto a = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto da = torch::empty({M, NG}, x.options().dtype(torch::kFloat32));
  auto sa = torch::empty({M, NG}, x.options().dtype(torch::kFloat32));  // sum(a) a group: VNNI's offset
  auto out = torch::empty({M, N}, x.options());
  const int8_t* w = packed.data_ptr<int8_t>();
  const at::Half* s = reinterpret_cast<const at::Half*>(scales.data_ptr());
  if (x.scalar_type() == torch::kFloat64) {
    round_groups<double>(x.data_ptr<double>(), M, K, a.data_ptr<int8_t>(), da.data_ptr<float>(), sa.data_ptr<float>());
    blocks<double>(w, s, a.data_ptr<int8_t>(), da.data_ptr<float>(), sa.data_ptr<float>(), out.data_ptr<double>(), M, N,
                   K, vector);
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32, "float32 or float64 input");
    round_groups<float>(x.data_ptr<float>(), M, K, a.data_ptr<int8_t>(), da.data_ptr<float>(), sa.data_ptr<float>());
    blocks<float>(w, s, a.data_ptr<int8_t>(), da.data_ptr<float>(), sa.data_ptr<float>(), out.data_ptr<float>(), M, N,
                  K, vector);
  }
  return out;
}

}  // namespace

torch::Tensor q8a8_mm(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, int64_t N) {
  return product(x, packed, scales, N, kVector);
}

torch::Tensor q8a8_mm_portable(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, int64_t N) {
  return product(x, packed, scales, N, false);
}

bool q8a8_vector() { return kVector; }

std::string q8a8_path() { return kPath; }
