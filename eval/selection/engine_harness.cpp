// The selection engine through its C ABI alone (no Python, no torch, no gather): exact vs lowbit per layer on
// random keys of the Llama-3.1-8B shape (8 KV heads x 4 query heads x 128 channels, bf16, budget 256), `layers`
// distinct layers (each its own keys and 2-bit index, so the last-level cache holds none of them between calls),
// the two selectors alternated round by round and the best round of each kept: a ratio that a noisy shared host
// leaves stable. Build and run from the repository root (results/bench/engine-c-harness/README.md has the command).
#include ENGINE
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sys/mman.h>

template <class T>
T* huge(size_t n) {  // as host_store.advise_huge_pages: 2 MiB-aligned, transparent huge pages
  const size_t bytes = (n * sizeof(T) + (2 << 20) - 1) & ~size_t((2 << 20) - 1);
  void* p = aligned_alloc(2 << 20, bytes);
  madvise(p, bytes, MADV_HUGEPAGE);
  return static_cast<T*>(p);
}

struct Layer {
  uint16_t* keys;
  uint8_t* packed;  // quad-major, as the lowbit selector stores it: (KV head, quad, group, 64 bytes)
  uint16_t* params;
};

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: harness TOKENS [ROUNDS=5] [LAYERS=4] [QUADS=8] [FACTOR=8] [THREADS=1]\n");
    return 2;
  }
  const int64_t n = atoll(argv[1]), H = 8, G = 4, D = 128, budget = 256, dq = 128, groups = n / 64;
  const int rounds = argc > 2 ? atoi(argv[2]) : 5, L = argc > 3 ? atoi(argv[3]) : 4;
  const int quads = argc > 4 ? atoi(argv[4]) : 8, factor = argc > 5 ? atoi(argv[5]) : 8;
  const int threads = argc > 6 ? atoi(argv[6]) : 1;
  uint64_t x = 88172645463325252ull;
  auto uniform = [&x]() {  // xorshift64, 24-bit uniform in (0, 1]
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return ((x >> 40) + 1) / 16777217.0f;
  };
  std::vector<Layer> layers(L);
  for (auto& l : layers) {
    l.keys = huge<uint16_t>(H * n * D);
    for (int64_t i = 0; i < H * n * D; ++i)  // standard normal keys (Box-Muller)
      l.keys[i] = f32_to_bf16(std::sqrt(-2 * std::log(uniform())) * std::cos(6.2831853f * uniform()));
    std::vector<uint8_t> grouped(H * groups * 16 * dq);  // dc_quantize's rows: one group's lines together
    l.packed = huge<uint8_t>(H * groups * 16 * dq);
    l.params = huge<uint16_t>(H * groups * 2 * dq);
    dc_quantize(l.keys, BF16, H * groups, D, dq, grouped.data(), l.params, 2);
    for (int64_t h = 0; h < H; ++h)
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t j = 0; j < dq / 4; ++j)
          std::memcpy(l.packed + ((h * (dq / 4) + j) * groups + g) * 64, &grouped[((h * groups + g) * dq / 4 + j) * 64],
                      64);
  }
  std::vector<float> q(H * G * D);
  for (auto& v : q) v = std::sqrt(-2 * std::log(uniform())) * std::cos(6.2831853f * uniform());
  const int64_t end = n - 64;  // the local window is not selectable
  std::vector<uint8_t> mask(end, 1);
  for (int i = 0; i < 4; ++i) mask[i] = 0;  // sink tokens
  int64_t row = 0, first = 0, indexed = end / 64;
  std::vector<int64_t> out(H * budget);
  std::vector<uint8_t> valid(H * budget);
  double best[2] = {1e30, 1e30};
  for (int r = 0; r < rounds; ++r)
    for (int lowbit = 0; lowbit < 2; ++lowbit) {
      const auto t0 = std::chrono::steady_clock::now();
      for (auto& l : layers) {
        // one chunk of every position (`Seg`), the index's addresses and byte strides (`Index`)
        const int64_t seg[SEG_FIELDS] = {0, n, reinterpret_cast<int64_t>(l.keys), 0, n * D * 2, 0, 0, 0};
        const int64_t index[INDEX_FIELDS] = {reinterpret_cast<int64_t>(l.packed), 0, (dq / 4) * groups * 64,
                                             groups * 64, 64, reinterpret_cast<int64_t>(l.params), 0,
                                             groups * 2 * dq * 2};
        if (dc_select(1, H, G, D, BF16, q.data(), 1.0f / std::sqrt(128.0f), end, mask.data(), &row, 1, seg,
                      lowbit ? index : nullptr, &first, &indexed, dq, quads, factor * budget, budget, out.data(),
                      valid.data(), nullptr, nullptr, budget, threads, nullptr, nullptr, 0.0) != 0)
          return 1;
      }
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / L;
      best[lowbit] = std::min(best[lowbit], s);
    }
  std::printf("| %lld | %d | %d | %d | %.2f | %.2f | %.2f |\n", static_cast<long long>(n), quads, factor, threads,
              best[0] * 1e3, best[1] * 1e3, best[0] / best[1]);
  return 0;
}
