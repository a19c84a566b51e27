// The int8 dot products' peak on this CPU (python -m specui.bench.gemm prints it beside w4a8's rows):
// the instructions q4a8.cpp's vector path issues for its products, on registers only (nothing read from
// memory), on every thread at once. A product of many rows costs at least its multiply-adds at this
// rate once its weights are read, which bounds how flat verification can be on this CPU: scoring 16
// tokens costs at least 16 tokens' multiply-adds at the roof, however few bytes the weights are.
#include "tensor.h"
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <tuple>

namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// vpdpbusd on 512 bits: 16 lanes x 4 products each (q4a8's VNNI path).
constexpr int kChains = 24;  // independent sums in registers (of 32): more than the latency times the throughput
constexpr int64_t kMacsPerStep = kChains * 64;

int64_t run(int64_t steps, int seed) {
  __m512i acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_epi32(c + seed);
  __m512i a = _mm512_set1_epi8(static_cast<char>(3 + seed)), b = _mm512_set1_epi8(-2);
  for (int64_t i = 0; i < steps; ++i) {
    asm volatile("" : "+v"(a), "+v"(b));  // unknown to the compiler each time: no product is folded away
#pragma GCC unroll 32
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbusd_epi32(acc[c], a, b);
  }
  __m512i sum = acc[0];
  for (int c = 1; c < kChains; ++c) sum = _mm512_add_epi32(sum, acc[c]);
  return _mm512_reduce_add_epi32(sum);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// AVX2's pairwise products (q4a8's AVX2 path): maddubs (32 unsigned x signed byte products into 16
// int16 pairs) added into int16 sums. 12 sums and the two operands fit AVX2's 16 registers; with 24
// (as for AVX-512) the sums spilled to the stack and the roof read 1.36x low (2-core Zen 3: 62 against
// 84 G multiply-adds/s a thread, so the w4a8 kernel's 16 rows showed as 120% of it).
constexpr int kChains = 12;
constexpr int64_t kMacsPerStep = kChains * 32;

int64_t run(int64_t steps, int seed) {
  __m256i acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm256_set1_epi16(static_cast<int16_t>(c + seed));
  __m256i a = _mm256_set1_epi8(static_cast<char>(3 + seed)), b = _mm256_set1_epi8(-2);
  for (int64_t i = 0; i < steps; ++i) {
    asm volatile("" : "+x"(a), "+x"(b));
#pragma GCC unroll 32
    for (int c = 0; c < kChains; ++c) acc[c] = _mm256_add_epi16(acc[c], _mm256_maddubs_epi16(a, b));
  }
  __m256i sum = acc[0];
  for (int c = 1; c < kChains; ++c) sum = _mm256_add_epi16(sum, acc[c]);
  alignas(32) int16_t lanes[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), sum);
  int64_t total = 0;
  for (int16_t v : lanes) total += v;
  return total;
}
#else
// No vector path: q4a8's portable loop, one product at a time.
constexpr int kChains = 12;
constexpr int64_t kMacsPerStep = kChains;

int64_t run(int64_t steps, int seed) {
  int32_t acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = c + seed;
  volatile int32_t va = 3 + seed, vb = -2;
  const int32_t a = va, b = vb;
  for (int64_t i = 0; i < steps; ++i)
    for (int c = 0; c < kChains; ++c) acc[c] += a * b;
  int64_t total = 0;
  for (int c = 0; c < kChains; ++c) total += acc[c];
  return total;
}
#endif

}  // namespace

// (multiply-adds done, seconds, checksum) of `steps` steps on every thread of torch's pool at once,
// thread t starting its kChains sums at t (the checksum: every thread's sums added, which tests read
// to see that every product was computed).
std::tuple<int64_t, double, int64_t> int8_dot_roof(int64_t steps) {
  TORCH_CHECK(steps > 0, "int8_dot_roof: steps must be positive");
  const int64_t threads = at::get_num_threads();
  std::atomic<int64_t> sum{0};
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) sum += run(steps, static_cast<int>(t));
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return {threads * steps * kMacsPerStep, seconds, sum.load()};
}
