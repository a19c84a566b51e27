// 4-bit weight groups times 8-bit activation groups (specui/weights/w4a8.py, `--quantization w4a8`):
// the product llama.cpp computes for Q4 weights (activations rounded to Q8 blocks of 32), here as
// one kernel that reads each weight once for every row it is given, so scoring k tokens costs
// little more than one where the CPU has an int8 dot product (AVX512-VNNI), or AVX2's pairwise one.
//
// Weights: rows in blocks of 16, inputs in groups of 32, w = d * q + m (q in 0..15; d and m float16
// per row and group, a GGUF's Q4_0 / Q4_1 blocks exactly). Packed per (block, group) as 256 bytes:
// 4 vectors of 16 rows x 4 bytes, byte i of row r in vector j holding inputs 4j + i (low nibble)
// and 16 + 4j + i (high); then the group's 16 d and 16 m (float16, or their bits as int16) in `scales`.
// Activations: each row of x, each group of 32 on its own: top = max|x|, a = round-half-even(x * 127
// / top) in int8, da = float(top / 127), sa = sum(a).
// Output, per row and column, over the groups in order: acc = fma(fma(float(sum(q a)), d, m * sa),
// da, acc) in float32, written in x's dtype (float32 or float64). Nothing mixes rows and the order of
// every float operation is fixed, so a row's output is bit for bit the same whatever else is scored
// with it, and the vector paths (VNNI, AVX2) and the portable one (any CPU) give the same bits:
// `q4a8_mm_portable` is there to check that.
#include "tensor.h"
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <string>

#include "groups.h"
#include "q4a8.h"

namespace {

using specui_groups::kGroup;  // inputs a group
using specui_groups::round_groups;
using specui_q4a8::kBytes;  // packed bytes a (block, group)
using specui_q4a8::kRows;   // output rows a block

inline float half_to_float(const at::Half* h) { return static_cast<float>(*h); }

// One block of 16 rows against rows [t0, t1) of the activations, one scalar at a time: the
// reference arithmetic (and the path of CPUs without AVX512-VNNI).
template <typename O>
void block_portable(const uint8_t* wb, const at::Half* sb, const int8_t* a, const float* da, const float* sa,
                    O* out, int64_t t0, int64_t t1, int64_t NG, int64_t K, int64_t N, int64_t col) {
  const int64_t rows = std::min(kRows, N - col);
  for (int64_t t = t0; t < t1; ++t) {
    float acc[kRows] = {0};
    for (int64_t g = 0; g < NG; ++g) {
      const uint8_t* wg = wb + g * kBytes;
      const int8_t* ag = a + t * K + g * kGroup;
      const int64_t i = t * NG + g;
      for (int64_t r = 0; r < rows; ++r) {
        int32_t s = 0;
        for (int64_t j = 0; j < 4; ++j)
          for (int64_t b = 0; b < 4; ++b) {
            const uint8_t byte = wg[j * 64 + r * 4 + b];
            s += static_cast<int32_t>(byte & 15) * ag[4 * j + b] + static_cast<int32_t>(byte >> 4) * ag[16 + 4 * j + b];
          }
        const float d = half_to_float(sb + g * 32 + r), m = half_to_float(sb + g * 32 + 16 + r);
        acc[r] = std::fma(std::fma(static_cast<float>(s), d, m * sa[i]), da[i], acc[r]);
      }
    }
    for (int64_t r = 0; r < rows; ++r) out[t * N + col + r] = static_cast<O>(acc[r]);
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr bool kVector = true;
constexpr int64_t kAhead = 16;  // groups prefetched ahead (5 KB)
constexpr int64_t kFar = 48;    // groups prefetched ahead into L2 for 2 rows or more (12 KB)
constexpr int64_t kTile = 12;   // rows of activations a pass over the weights: 2 x 12 + 6 of the 32 vector registers
using specui_q4a8::add_group;
using specui_q4a8::kept_rows;
using specui_q4a8::scale_d;
using specui_q4a8::scale_m;
using specui_q4a8::store;

// T activation rows at once (T <= kTile), their sums and accumulators in registers across all groups;
// each group's weights unpacked a quarter at a time (2 registers), which leaves room for 12 rows.
template <int T, typename O>
inline void micro(const uint8_t* wb, const at::Half* sb, const int8_t* a, const float* da, const float* sa,
                  O* out, int64_t t0, int64_t NG, int64_t K, int64_t N, int64_t col) {
  __m512 acc[T];
  const int32_t* at[T];
#pragma GCC unroll 16
  for (int u = 0; u < T; ++u) {
    acc[u] = _mm512_setzero_ps();
    at[u] = reinterpret_cast<const int32_t*>(a + (t0 + u) * K);
  }
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < NG; ++g) {
    const uint8_t* wg = wb + g * kBytes;
    // the group kAhead on into L1 (prefetching never faults past the end): this loop computes too long per
    // byte for the hardware's prefetchers to keep memory busy; with it, 48 matrices of 8192x2112 out of
    // cache cost 0.47 / 0.65 ms a matrix for 1 / 9 rows against 0.67 / 1.12 without (2-core Xeon, README).
    // With 2 rows or more the loop is slower per byte still, and the group kFar on goes to L2 as well:
    // a 1.7b stand-in's forward of 3 / 4 tokens 43 / 49 -> 38.5 / 44 ms on a 2-core Zen 4, 26.3 / 27.2 ->
    // 24.8 / 24.9 on a Zen 5 (with the split sums below); for one row the second stream cost 10% on the
    // Zen 4, so one row keeps the one prefetch.
    for (int c = 0; c < 4; ++c) _mm_prefetch(reinterpret_cast<const char*>(wg + kAhead * kBytes + 64 * c), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(sb + (g + kAhead) * 32), _MM_HINT_T0);
    if constexpr (T >= 2) {
      for (int c = 0; c < 4; ++c) _mm_prefetch(reinterpret_cast<const char*>(wg + kFar * kBytes + 64 * c), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(sb + (g + kFar) * 32), _MM_HINT_T1);
    }
    // Few rows leave registers to spare: the low and high nibbles' products go into two int32 sums added
    // at the group's end (exact: integer adds), which halves the chain of dependent dot products.
    constexpr bool kSplitSums = T <= 6;  // 7 or 8 rows split measured slower (register pressure, Zen 5)
    __m512i s[T], s2[kSplitSums ? T : 1];
    __m512i* const shi = kSplitSums ? s2 : s;  // where the high nibbles' products go
#pragma GCC unroll 16
    for (int u = 0; u < T; ++u) s[u] = _mm512_setzero_si512();
#pragma GCC unroll 16
    for (int u = 0; u < (kSplitSums ? T : 0); ++u) s2[u] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_loadu_si512(wg + 64 * j);
      const __m512i lo = _mm512_and_si512(v, low4);                            // inputs 4j .. 4j + 3
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);      // inputs 16 + 4j ..
#pragma GCC unroll 16
      for (int u = 0; u < T; ++u) s[u] = _mm512_dpbusd_epi32(s[u], lo, _mm512_set1_epi32(at[u][g * 8 + j]));
#pragma GCC unroll 16
      for (int u = 0; u < T; ++u) shi[u] = _mm512_dpbusd_epi32(shi[u], hi, _mm512_set1_epi32(at[u][g * 8 + 4 + j]));
    }
    if constexpr (kSplitSums) {
#pragma GCC unroll 16
      for (int u = 0; u < T; ++u) s[u] = _mm512_add_epi32(s[u], s2[u]);
    }
    const __m512 d = scale_d(sb + g * 32), m = scale_m(sb + g * 32);
#pragma GCC unroll 16
    for (int u = 0; u < T; ++u) {
      const int64_t i = (t0 + u) * NG + g;
      acc[u] = add_group(acc[u], s[u], d, m, sa[i], da[i]);
    }
  }
  const __mmask16 keep = kept_rows(N, col);
#pragma GCC unroll 16
  for (int u = 0; u < T; ++u) store(out + (t0 + u) * N + col, keep, acc[u]);
}

template <typename O>
void tile(int64_t T, const uint8_t* wb, const at::Half* sb, const int8_t* a, const float* da, const float* sa,
          O* out, int64_t t0, int64_t NG, int64_t K, int64_t N, int64_t col) {
  switch (T) {
    case 12: micro<12, O>(wb, sb, a, da, sa, out, t0, NG, K, N, col); break;
    case 11: micro<11, O>(wb, sb, a, da, sa, out, t0, NG, K, N, col); break;
    case 10: micro<10, O>(wb, sb, a, da, sa, out, t0, NG, K, N, col); break;
    case 9: micro<9, O>(wb, sb, a, da, sa, out, t0, NG, K, N, col); break;
    case 8: micro<8, O>(wb, sb, a, da, sa, out, t0, NG, K, N, col); break;
    case 7: micro<7, O>(wb, sb, a, da, sa, out, t0, NG, K, N, col); break;
    case 6: micro<6, O>(wb, sb, a, da, sa, out, t0, NG, K, N, col); break;
    case 5: micro<5, O>(wb, sb, a, da, sa, out, t0, NG, K, N, col); break;
    case 4: micro<4, O>(wb, sb, a, da, sa, out, t0, NG, K, N, col); break;
    case 3: micro<3, O>(wb, sb, a, da, sa, out, t0, NG, K, N, col); break;
    case 2: micro<2, O>(wb, sb, a, da, sa, out, t0, NG, K, N, col); break;
    default: micro<1, O>(wb, sb, a, da, sa, out, t0, NG, K, N, col); break;
  }
}

// The rows in as few passes over the block's weights as kTile allows, the passes as even as can be
// (a tree's 9 tokens are one pass, 16 are 8 + 8): every pass after the first re-reads the block.
template <typename O>
void block_vector(const uint8_t* wb, const at::Half* sb, const int8_t* a, const float* da, const float* sa,
                  O* out, int64_t M, int64_t NG, int64_t K, int64_t N, int64_t col) {
  const int64_t passes = (M + kTile - 1) / kTile;
  for (int64_t p = 0, t = 0; p < passes; ++p) {
    const int64_t T = (M - t) / (passes - p);  // the rest shared evenly between the passes left
    tile<O>(T, wb, sb, a, da, sa, out, t, NG, K, N, col);
    t += T;
  }
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// AVX2 without an int8 dot product (Zen 3, older Intel): the sums llama.cpp's AVX2 path forms, with
// _mm256_maddubs_epi16 (nibble x int8 pairs into int16). Exact, because nothing can saturate: a pair is
// at most 2 x 15 x 127 and a group's 16 products in one int16 lane at most 30480 < 32767, so every
// group's int32 sum, and so every float operation after it, is the VNNI path's and the portable one's.
// A 64-byte vector of 16 rows is two halves of 8 rows here (256-bit registers).
constexpr bool kVector = true;
constexpr int64_t kAhead = 8;  // groups prefetched ahead

using specui_groups::store8;

// T activation rows against H halves (from half h0) of one block, sums in registers across all groups:
// H = 2 reads and unpacks each weight byte once for T rows. The T x H int16 sums of a group stay in
// registers (8 of the 16 at T = 4); the float accumulators, touched once a group, may live in memory.
template <int T, int H, typename O>
inline void micro(const uint8_t* wb, const at::Half* sb, const int8_t* a, const float* da, const float* sa,
                  O* out, int64_t t0, int64_t NG, int64_t K, int64_t N, int64_t col, int h0) {
  __m256 acc[T][H];
  const int32_t* at[T];
#pragma GCC unroll 8
  for (int u = 0; u < T; ++u) {
    at[u] = reinterpret_cast<const int32_t*>(a + (t0 + u) * K);
#pragma GCC unroll 2
    for (int h = 0; h < H; ++h) acc[u][h] = _mm256_setzero_ps();
  }
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < NG; ++g) {
    const uint8_t* wg = wb + g * kBytes;
    for (int c = 0; c < 4; ++c) _mm_prefetch(reinterpret_cast<const char*>(wg + kAhead * kBytes + 64 * c), _MM_HINT_T0);
    __m256i s[T][H];
#pragma GCC unroll 8
    for (int u = 0; u < T; ++u)
#pragma GCC unroll 2
      for (int h = 0; h < H; ++h) s[u][h] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      __m256i lo[H], hi[H];
#pragma GCC unroll 2
      for (int h = 0; h < H; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 64 * j + 32 * (h0 + h)));
        lo[h] = _mm256_and_si256(v, low4);                        // inputs 4j .. 4j + 3
        hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);  // inputs 16 + 4j ..
      }
#pragma GCC unroll 8
      for (int u = 0; u < T; ++u) {
        const __m256i bl = _mm256_set1_epi32(at[u][g * 8 + j]), bh = _mm256_set1_epi32(at[u][g * 8 + 4 + j]);
#pragma GCC unroll 2
        for (int h = 0; h < H; ++h) {
          s[u][h] = _mm256_add_epi16(s[u][h], _mm256_maddubs_epi16(lo[h], bl));
          s[u][h] = _mm256_add_epi16(s[u][h], _mm256_maddubs_epi16(hi[h], bh));
          // pinned in its register here: left free, GCC formed all 64 products of a group first and
          // spilled each to the stack (16 registers); pinned, 8 to 16 rows run 1.4x faster (Zen 3, README)
          asm("" : "+x"(s[u][h]));
        }
      }
    }
#pragma GCC unroll 2
    for (int h = 0; h < H; ++h) {
      const int64_t r0 = 8 * (h0 + h);
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + g * 32 + r0)));
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + g * 32 + 16 + r0)));
#pragma GCC unroll 8
      for (int u = 0; u < T; ++u) {
        const int64_t i = (t0 + u) * NG + g;
        const __m256 sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[u][h], ones));
        const __m256 term = _mm256_fmadd_ps(sum, d, _mm256_mul_ps(m, _mm256_set1_ps(sa[i])));
        acc[u][h] = _mm256_fmadd_ps(term, _mm256_set1_ps(da[i]), acc[u][h]);
      }
    }
  }
#pragma GCC unroll 2
  for (int h = 0; h < H; ++h) {
    const int64_t r0 = 8 * (h0 + h), rows = std::min<int64_t>(8, N - col - r0);
    if (rows <= 0) continue;
#pragma GCC unroll 8
    for (int u = 0; u < T; ++u) store8(out + (t0 + u) * N + col + r0, rows, acc[u][h]);
  }
}

// The rows 4 at a time over both halves, then the 3, 2 or 1 left in one more pass: every pass reads the
// block's weights once. (4 rows one half after the other, as before 2026-12-03, read each 64-byte line
// twice and left 3 rows to two passes: on a 2-core Zen 3, 8192 x 2048 matrices out of cache, 3 / 4 rows
// cost 1.28-1.46x / 1.55-1.61x one row that way, 1.07-1.14x / 1.24-1.27x with this tiling, and 1.16x /
// 1.00x once micro's sums were pinned to their registers.)
template <typename O>
void block_vector(const uint8_t* wb, const at::Half* sb, const int8_t* a, const float* da, const float* sa,
                  O* out, int64_t M, int64_t NG, int64_t K, int64_t N, int64_t col) {
  int64_t t = 0;
  for (; M - t >= 4; t += 4) micro<4, 2, O>(wb, sb, a, da, sa, out, t, NG, K, N, col, 0);
  switch (M - t) {
    case 3: micro<3, 2, O>(wb, sb, a, da, sa, out, t, NG, K, N, col, 0); break;
    case 2: micro<2, 2, O>(wb, sb, a, da, sa, out, t, NG, K, N, col, 0); break;
    case 1: micro<1, 2, O>(wb, sb, a, da, sa, out, t, NG, K, N, col, 0); break;
    default: break;
  }
}
#else
constexpr bool kVector = false;
template <typename O>
void block_vector(const uint8_t* wb, const at::Half* sb, const int8_t* a, const float* da, const float* sa,
                  O* out, int64_t M, int64_t NG, int64_t K, int64_t N, int64_t col) {
  block_portable(wb, sb, a, da, sa, out, 0, M, NG, K, N, col);
}
#endif

}  // namespace

// q4a8_amx.cpp: blocks [b0, b1) of the product on AMX tiles
bool q4a8_amx_ready();
void q4a8_amx_blocks(const uint8_t* w, const at::Half* s, const int8_t* a, const float* da, const float* sa,
                     float* out, int64_t b0, int64_t b1, int64_t M, int64_t NG, int64_t K, int64_t N);
void q4a8_amx_blocks(const uint8_t* w, const at::Half* s, const int8_t* a, const float* da, const float* sa,
                     double* out, int64_t b0, int64_t b1, int64_t M, int64_t NG, int64_t K, int64_t N);

namespace {

// Rows from which q4a8_mm goes on AMX tiles where it can: where the VNNI loop needs a second pass over
// the weights (kTile = 12 rows a pass). The tiles form a group's sums for 16 rows at about one row's
// cost, but every row still takes 4 float steps a group (the same on both paths), so they pay only once
// VNNI's 8 dot products a row and group cost more than the tiles' fixed cost. On the 2-core AMX Xeon of
// README, 24 matrices of 8192 x 2112 out of cache, the two paths in turns (`python -m specui.bench.gemm
// --ways "w4a8,w4a8 VNNI"`), VNNI / AMX: 8 rows 0.96x, 12 rows 1.07x and 0.83x in two runs, 16 rows
// 1.15x and 1.32x, 32 rows 1.08x and 1.26x, 64 rows 1.17x and 1.25x.
constexpr int64_t kAmxFrom = 13;

enum class Path { kPortable, kVector, kAmx };

template <typename O>
void blocks(const uint8_t* w, const at::Half* s, const int8_t* a, const float* da, const float* sa, O* o,
            int64_t M, int64_t N, int64_t K, Path path) {
  const int64_t NG = K / kGroup, NB = (N + kRows - 1) / kRows;
  // every block on its own thread's share, however small the product: splitting a bundled-model token's
  // 210 matrices over 2 cores beat running each below ~20 us of work on one (7.4 against 9.9 ms, Zen 3),
  // though each fork costs ~10 us: the weights come from memory, and two cores keep more of it in flight
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    if (path == Path::kAmx) return q4a8_amx_blocks(w, s, a, da, sa, o, b0, b1, M, NG, K, N);  // tiles: per thread
    for (int64_t b = b0; b < b1; ++b) {
      if (path == Path::kVector) {
        block_vector<O>(w + b * NG * kBytes, s + b * NG * 32, a, da, sa, o, M, NG, K, N, b * kRows);
      } else {
        block_portable<O>(w + b * NG * kBytes, s + b * NG * 32, a, da, sa, o, 0, M, NG, K, N, b * kRows);
      }
    }
  });
}

// (M, K) float32 / float64 x -> (M, N) products in x's dtype (float32 sums, widened for float64)
torch::Tensor product(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, int64_t N, Path path) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "a contiguous (rows, K) input");
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous(), "packed uint8 weights");
  TORCH_CHECK((scales.scalar_type() == torch::kFloat16 || scales.scalar_type() == torch::kInt16) && scales.is_contiguous(),
              "float16 scales (or their bits as int16)");
  const int64_t M = x.size(0), K = x.size(1), NG = K / kGroup, NB = (N + kRows - 1) / kRows;
  TORCH_CHECK(K % kGroup == 0 && packed.numel() == NB * NG * kBytes && scales.numel() == NB * NG * 32,
              "weights packed for another shape");
  auto a = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto da = torch::empty({M, NG}, x.options().dtype(torch::kFloat32));
  auto sa = torch::empty({M, NG}, x.options().dtype(torch::kFloat32));
  if (x.scalar_type() == torch::kFloat64) {
    round_groups<double>(x.data_ptr<double>(), M, K, a.data_ptr<int8_t>(), da.data_ptr<float>(), sa.data_ptr<float>());
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32, "float32 or float64 input");
    round_groups<float>(x.data_ptr<float>(), M, K, a.data_ptr<int8_t>(), da.data_ptr<float>(), sa.data_ptr<float>());
  }
  auto out = torch::empty({M, N}, x.options());
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const at::Half* s = reinterpret_cast<const at::Half*>(scales.data_ptr());
  if (x.scalar_type() == torch::kFloat64) {
    blocks<double>(w, s, a.data_ptr<int8_t>(), da.data_ptr<float>(), sa.data_ptr<float>(), out.data_ptr<double>(),
                   M, N, K, path);
  } else {
    blocks<float>(w, s, a.data_ptr<int8_t>(), da.data_ptr<float>(), sa.data_ptr<float>(), out.data_ptr<float>(),
                  M, N, K, path);
  }
  return out;
}

}  // namespace

// The rows from which q4a8_mm goes on AMX tiles here (0: it never does: no AMX, no permission, SPECUI_AMX=0).
int64_t q4a8_amx_from() { return kVector && q4a8_amx_ready() ? kAmxFrom : 0; }

// amx_from: rows from which AMX tiles are used where this CPU and build have them (0: never)
torch::Tensor q4a8_mm_from(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, int64_t N, int64_t amx_from) {
  const bool amx = amx_from > 0 && x.size(0) >= amx_from && q4a8_amx_from() > 0;
  return product(x, packed, scales, N, amx ? Path::kAmx : kVector ? Path::kVector : Path::kPortable);
}

torch::Tensor q4a8_mm(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, int64_t N) {
  return q4a8_mm_from(x, packed, scales, N, kAmxFrom);
}

torch::Tensor q4a8_mm_portable(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, int64_t N) {
  return product(x, packed, scales, N, Path::kPortable);
}

bool q4a8_vector() { return kVector; }

// The path q4a8_mm runs on this build, for the load's notes.
std::string q4a8_path() {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  return "AVX512-VNNI";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  return "AVX2";
#else
  return "portable loop";
#endif
}
