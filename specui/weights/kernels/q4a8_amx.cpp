// q4a8.cpp's product on AMX tiles (Intel Xeon Sapphire Rapids and later): the int8 sums of a group for
// up to 16 activation rows x 16 weight rows in one TDPBSUD, so scoring k tokens costs about what reading
// the 4-bit weights once costs where AVX512-VNNI spends 8 dot products a row and group.
//
// Per (block of 16 weight rows, group of 32 inputs): tile B is the group's packed weights as they lie
// (q4a8.cpp's 4 vectors of 16 rows x 4 bytes are B's VNNI layout: the low nibbles are the rows of inputs
// 4j .. 4j + 3, the high nibbles those of 16 + 4j ..), unpacked to bytes; tile A is 16 activation rows
// of that group (signed int8, stride K); C = A B holds the exact int32 sums(q a), the same integers the
// VNNI and portable paths form. C goes to memory and every row's sums take the VNNI path's float steps in
// its order: acc = fma(fma(float(s), d, m * sa), da, acc). So this path's bits are theirs, whatever else
// is scored beside a row (tests/test_w4a8.py checks it against q4a8_mm_portable).
//
// Where a pass's time goes (24 matrices of 8192 x 2112, 16 rows, AMX Xeon, the parts switched off in turn):
// 19.7 ms in all, 14.6 without the float steps, 11.2 without the tiles (one row: 10.4). Every (row, weight
// row, group) int32 sum leaves its tile through memory (a C store a group and block, besides B's unpack
// stores), and that traffic, not the products, is what scoring 16 rows costs beyond reading the weights;
// issuing the next pair's tiles before this pair's float steps changed nothing (1.02x). Sums that stay
// in int32 across groups would need one scale a row for all groups: another arithmetic than llama.cpp's.
//
// Tiles need the kernel's permission for this process (Linux 5.16+: arch_prctl ARCH_REQ_XCOMP_PERM);
// where it is refused, the build has no AMX, or SPECUI_AMX=0, q4a8_amx_ready() is false and q4a8.cpp keeps
// VNNI.
#include "tensor.h"
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "groups.h"
#include "q4a8.h"

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__)
#include <sys/syscall.h>
#include <unistd.h>

namespace {

using specui_groups::kGroup;
using specui_q4a8::kBytes;
using specui_q4a8::kRows;
constexpr int64_t kAhead = 16;   // groups prefetched ahead into L1 (as the VNNI path)
constexpr int64_t kFar = 48;     // and into L2

struct TileConfig {  // palette 1's 64-byte layout
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {0};
  uint16_t colsb[16] = {0};
  uint8_t rows[16] = {0};
};

constexpr int64_t kLead = 4;  // groups unpacked ahead of their tile loads
constexpr int64_t kRing = 8;  // unpacked groups held (kLead + the pair in flight, rounded up)

// A group's packed weights unpacked to B's bytes (the low nibbles' 4 vectors, then the high ones'). Done
// kLead groups ahead of the tile load that reads them: a tile load right after the stores that wrote its
// bytes waits for them to reach the cache (no store forwarding into tiles), which cost more than the
// tiles' arithmetic (0.90 against 0.56 ms a matrix of 8192 x 2112 for one row, AMX Xeon).
inline void unpack(const uint8_t* wg, uint8_t* b) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    const __m512i v = _mm512_loadu_si512(wg + 64 * j);
    _mm512_store_si512(b + 64 * j, _mm512_and_si512(v, low4));
    _mm512_store_si512(b + 256 + 64 * j, _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
  }
}

// One group's tiles, in tile set S (tiles 3S, 3S + 1, 3S + 2: A, B, C): its int32 sums into c.
template <int S>
inline void group_sums(const uint8_t* b, const int8_t* ag, int64_t K, int32_t* c) {
  asm volatile("" ::: "memory");  // tileloadd's asm names no memory: b's stores must come first
  if constexpr (S == 0) {
    _tile_zero(2); _tile_loadd(0, ag, K); _tile_loadd(1, b, 64); _tile_dpbsud(2, 0, 1); _tile_stored(2, c, 64);
  } else {
    _tile_zero(5); _tile_loadd(3, ag, K); _tile_loadd(4, b, 64); _tile_dpbsud(5, 3, 4); _tile_stored(5, c, 64);
  }
}

// A group's sums (c) into T rows' accumulators: the VNNI path's float steps (q4a8.h), in its order.
template <int T>
inline void scale_sums(const int32_t* c, const at::Half* sg, const float* da, const float* sa, int64_t t0,
                       int64_t NG, int64_t g, __m512* acc) {
  asm volatile("" ::: "memory");  // tilestored's asm names no memory either: c is read only after it
  const __m512 d = specui_q4a8::scale_d(sg), m = specui_q4a8::scale_m(sg);
#pragma GCC unroll 16
  for (int u = 0; u < T; ++u) {
    const int64_t i = (t0 + u) * NG + g;
    acc[u] = specui_q4a8::add_group(acc[u], _mm512_load_si512(c + 16 * u), d, m, sa[i], da[i]);
  }
}

// T (<= 16) activation rows from t0 against one block, accumulators in registers across all groups;
// groups two at a time on two tile sets, so one group's tile work overlaps the other's float steps.
template <int T, typename O>
void micro(const uint8_t* wb, const at::Half* sb, const int8_t* a, const float* da, const float* sa, O* out,
           int64_t t0, int64_t NG, int64_t K, int64_t N, int64_t col) {
  alignas(64) uint8_t b[kRing][512];
  alignas(64) int32_t c[2][kRows * 16];
  __m512 acc[T];
#pragma GCC unroll 16
  for (int u = 0; u < T; ++u) acc[u] = _mm512_setzero_ps();
  const int8_t* at = a + t0 * K;
  for (int64_t g = 0; g < std::min(kLead, NG); ++g) unpack(wb + g * kBytes, b[g % kRing]);
  int64_t g = 0;
  for (; g + 2 <= NG; g += 2) {
    const uint8_t* wg = wb + g * kBytes;
    for (int q = 0; q < 8; ++q) {
      _mm_prefetch(reinterpret_cast<const char*>(wg + kAhead * kBytes + 64 * q), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wg + kFar * kBytes + 64 * q), _MM_HINT_T1);
    }
    _mm_prefetch(reinterpret_cast<const char*>(sb + (g + kAhead) * 32), _MM_HINT_T0);
    for (int64_t h = g + kLead; h < std::min(g + kLead + 2, NG); ++h) unpack(wb + h * kBytes, b[h % kRing]);
    group_sums<0>(b[g % kRing], at + g * kGroup, K, c[0]);
    group_sums<1>(b[(g + 1) % kRing], at + (g + 1) * kGroup, K, c[1]);
    scale_sums<T>(c[0], sb + g * 32, da, sa, t0, NG, g, acc);
    scale_sums<T>(c[1], sb + (g + 1) * 32, da, sa, t0, NG, g + 1, acc);
  }
  if (g < NG) {
    group_sums<0>(b[g % kRing], at + g * kGroup, K, c[0]);
    scale_sums<T>(c[0], sb + g * 32, da, sa, t0, NG, g, acc);
  }
  const __mmask16 keep = specui_q4a8::kept_rows(N, col);
#pragma GCC unroll 16
  for (int u = 0; u < T; ++u) specui_q4a8::store(out + (t0 + u) * N + col, keep, acc[u]);
}

template <typename O>
void tile(int T, const uint8_t* wb, const at::Half* sb, const int8_t* a, const float* da, const float* sa, O* out,
          int64_t t0, int64_t NG, int64_t K, int64_t N, int64_t col) {
  switch (T) {
#define SPECUI_CASE(n) case n: micro<n, O>(wb, sb, a, da, sa, out, t0, NG, K, N, col); break;
    SPECUI_CASE(16) SPECUI_CASE(15) SPECUI_CASE(14) SPECUI_CASE(13) SPECUI_CASE(12) SPECUI_CASE(11)
    SPECUI_CASE(10) SPECUI_CASE(9) SPECUI_CASE(8) SPECUI_CASE(7) SPECUI_CASE(6) SPECUI_CASE(5)
    SPECUI_CASE(4) SPECUI_CASE(3) SPECUI_CASE(2)
#undef SPECUI_CASE
    default: micro<1, O>(wb, sb, a, da, sa, out, t0, NG, K, N, col); break;
  }
}

// This thread's two tile sets for passes of T activation rows: A T rows x 32 bytes, B 8 x 64, C T x 64
// (a tile's instructions cost by its rows: a pass of 3 rows does not pay for 16).
void configure(int T) {
  alignas(64) TileConfig config;
  for (int set = 0; set < 2; ++set) {
    config.rows[3 * set] = static_cast<uint8_t>(T); config.colsb[3 * set] = 32;
    config.rows[3 * set + 1] = 8; config.colsb[3 * set + 1] = 64;
    config.rows[3 * set + 2] = static_cast<uint8_t>(T); config.colsb[3 * set + 2] = 64;
  }
  asm volatile("" : : "r"(&config) : "memory");  // ldtilecfg's asm names 8 of its 64 bytes: store them all first
  _tile_loadconfig(&config);
}

// Blocks [b0, b1) against all M rows, in passes of at most 16 rows as even as can be (20 rows are 10 + 10).
template <typename O>
void blocks(const uint8_t* w, const at::Half* s, const int8_t* a, const float* da, const float* sa, O* out,
            int64_t b0, int64_t b1, int64_t M, int64_t NG, int64_t K, int64_t N) {
  const int64_t passes = (M + 15) / 16;
  for (int64_t p = 0, t = 0; p < passes; ++p) {
    const int T = static_cast<int>((M - t) / (passes - p));
    configure(T);
    for (int64_t b = b0; b < b1; ++b) tile<O>(T, w + b * NG * kBytes, s + b * NG * 32, a, da, sa, out, t, NG, K, N,
                                              b * kRows);
    t += T;
  }
  _tile_release();
}

}  // namespace

bool q4a8_amx_ready() {
  static const bool granted = [] {
    const char* off = std::getenv("SPECUI_AMX");  // "0": VNNI everywhere (to compare, or to rule the tiles out)
    if (off != nullptr && std::string(off) == "0") return false;
    constexpr long kReqPerm = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kReqPerm, kTileData) == 0;
  }();
  return granted;
}

void q4a8_amx_blocks(const uint8_t* w, const at::Half* s, const int8_t* a, const float* da, const float* sa,
                     float* out, int64_t b0, int64_t b1, int64_t M, int64_t NG, int64_t K, int64_t N) {
  blocks<float>(w, s, a, da, sa, out, b0, b1, M, NG, K, N);
}

void q4a8_amx_blocks(const uint8_t* w, const at::Half* s, const int8_t* a, const float* da, const float* sa,
                     double* out, int64_t b0, int64_t b1, int64_t M, int64_t NG, int64_t K, int64_t N) {
  blocks<double>(w, s, a, da, sa, out, b0, b1, M, NG, K, N);
}

#else  // no AMX in this build: q4a8.cpp never calls the rest

bool q4a8_amx_ready() { return false; }
void q4a8_amx_blocks(const uint8_t*, const at::Half*, const int8_t*, const float*, const float*, float*, int64_t,
                     int64_t, int64_t, int64_t, int64_t, int64_t) {}
void q4a8_amx_blocks(const uint8_t*, const at::Half*, const int8_t*, const float*, const float*, double*, int64_t,
                     int64_t, int64_t, int64_t, int64_t, int64_t) {}

#endif
