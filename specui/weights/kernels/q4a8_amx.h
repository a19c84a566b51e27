// AMX's int8 tiles for the 4-bit x 8-bit product (q4a8.cpp), on Xeons that have them (Sapphire Rapids
// and later): one TDPBSUD multiplies a group's 32 inputs for up to 16 activation rows by 16 weight rows
// (8192 products, exact int32 sums of signed activations x unsigned nibbles), where AVX512-VNNI needs
// 128 `vpdpbusd`. The group's sums are then scaled exactly as q4a8.cpp's vector loop scales them (the
// same float operations in the same order), so a row's output is bit for bit the same on either path
// and whatever else is scored with it. Used from kAmxMinRows rows on (one row stays on VNNI: it is
// bound by reading the weights, and a tile's fixed costs would only add to that).
#pragma once
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AMX_TILE__) && \
    defined(__AMX_INT8__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#define SPECUI_Q4A8_AMX 1

namespace specui_amx {

constexpr int64_t kAmxMinRows = 2;  // activation rows from which the tiles take over (README: measured)
constexpr int64_t kAmxTile = 16;    // activation rows a tile holds

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux gives a process the tiles' 8 KB of state only when it asks (once; every thread then has it).
inline bool permitted() {
  static const bool ok = [] {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return ok;
}

// SPECUI_AMX=0 keeps the VNNI loop (to compare the two in one process, or to rule the tiles out): read at
// every product, which costs ~0.1 us against the product's tens.
inline bool allowed() {
  const char* env = std::getenv("SPECUI_AMX");
  return (env == nullptr || std::strcmp(env, "0") != 0) && permitted();
}

// A (block, group)'s 256 packed bytes as TDPBSUD's B tile: 8 rows of 16 weight rows x 4 inputs. Packed
// vector j holds inputs 4j .. 4j + 3 in its low nibbles and 16 + 4j .. in its high ones, row for row in
// the tile's order, so tile rows j and 4 + j are that vector's two nibbles.
inline void unpack(const uint8_t* wg, uint8_t* tile) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    const __m512i v = _mm512_loadu_si512(wg + 64 * j);
    _mm512_store_si512(tile + 64 * j, _mm512_and_si512(v, low4));
    _mm512_store_si512(tile + 64 * (4 + j), _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
  }
}

// Group g's int32 sums (T rows x 16 weight rows) into the float accumulators: q4a8.cpp's micro, exactly.
template <int T>
inline void scale(const int32_t* c, const at::Half* sb, const float* da, const float* sa, __m512* acc, int64_t t0,
                  int64_t NG, int64_t g) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + g * 32)));
  const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + g * 32 + 16)));
#pragma GCC unroll 16
  for (int u = 0; u < T; ++u) {
    const int64_t i = (t0 + u) * NG + g;
    const __m512 s = _mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * u));
    const __m512 term = _mm512_fmadd_ps(s, d, _mm512_mul_ps(m, _mm512_set1_ps(sa[i])));
    acc[u] = _mm512_fmadd_ps(term, _mm512_set1_ps(da[i]), acc[u]);
  }
}

// Group h's product issued on one set of tiles (sums C, activations A, weights B), from weight buffer
// w[C]: the tile instructions name their registers by literal number.
#define SPECUI_AMX_ISSUE(C, A, B, h)                 \
  do {                                               \
    unpack(wb + (h) * 256, w[C]);                    \
    _tile_loadd(B, w[C], 64);                        \
    _tile_loadd(A, rows + (h) * 32, K);              \
    _tile_zero(C);                                   \
    _tile_dpbsud(C, A, B);                           \
  } while (0)

// T activation rows (2 <= T <= 16) against one block of 16 weight rows. Two sets of tiles take turns,
// so the next group's product is under way while this one's sums are scaled (a tile's product and the
// trip of its sums through memory take longer than the scaling itself). `store` writes an
// accumulator (q4a8.cpp's, for float32 or float64).
template <int T, typename O, typename Store>
void micro(const uint8_t* wb, const at::Half* sb, const int8_t* a, const float* da, const float* sa, O* out,
           int64_t t0, int64_t NG, int64_t K, int64_t N, int64_t col, int64_t ahead, int64_t far, Store store) {
  TileConfig config;
  for (int tmm = 0; tmm < 2; ++tmm) config.rows[tmm] = T, config.colsb[tmm] = 64;  // sums: T x 16 int32
  for (int tmm = 2; tmm < 4; ++tmm) config.rows[tmm] = T, config.colsb[tmm] = 32;  // a group: T x 32 int8
  for (int tmm = 4; tmm < 6; ++tmm) config.rows[tmm] = 8, config.colsb[tmm] = 64;  // weights: 8 x 64 bytes
  _tile_loadconfig(&config);
  alignas(64) uint8_t w[2][512];
  alignas(64) int32_t c[2][T * 16];
  __m512 acc[T];
#pragma GCC unroll 16
  for (int u = 0; u < T; ++u) acc[u] = _mm512_setzero_ps();
  const int8_t* rows = a + t0 * K;
  SPECUI_AMX_ISSUE(0, 2, 4, 0);
  for (int64_t g = 0; g < NG; g += 2) {
    for (int64_t h = g; h < g + 2; ++h) {  // prefetching never faults past the end
      const uint8_t* wg = wb + h * 256;
      for (int q = 0; q < 4; ++q) _mm_prefetch(reinterpret_cast<const char*>(wg + ahead * 256 + 64 * q), _MM_HINT_T0);
      for (int q = 0; q < 4; ++q) _mm_prefetch(reinterpret_cast<const char*>(wg + far * 256 + 64 * q), _MM_HINT_T1);
    }
    _mm_prefetch(reinterpret_cast<const char*>(sb + (g + ahead) * 32), _MM_HINT_T0);
    if (g + 1 < NG) SPECUI_AMX_ISSUE(1, 3, 5, g + 1);
    _tile_stored(0, c[0], 64);
    scale<T>(c[0], sb, da, sa, acc, t0, NG, g);
    if (g + 2 < NG) SPECUI_AMX_ISSUE(0, 2, 4, g + 2);
    if (g + 1 < NG) {
      _tile_stored(1, c[1], 64);
      scale<T>(c[1], sb, da, sa, acc, t0, NG, g + 1);
    }
  }
  _tile_release();
  const int64_t n = std::min<int64_t>(16, N - col);
  const __mmask16 keep = n == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
#pragma GCC unroll 16
  for (int u = 0; u < T; ++u) store(out + (t0 + u) * N + col, keep, acc[u]);
}

#undef SPECUI_AMX_ISSUE

}  // namespace specui_amx
#endif
