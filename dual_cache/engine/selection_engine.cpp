// Native host selection engine of dual-cache (the Python side is dual_cache/engine/native.py; the pure-torch
// reference that defines every number computed here is dual_cache/engine/reference.py).
//
// One call selects, for every (sequence, KV head) of one layer's decode step, the `budget` positions of highest
// exact group attention mass:
//   1. optional scan of the 2-bit key index: per 64-token group an int8 copy of (query x channel scale) is dotted
//      with the 2-bit codes in exact integer arithmetic (AVX-512 VNNI, AVX2 or scalar; the same integers on
//      every path), giving approximate logits; each position's score is max over the GQA group of its logit
//      minus that head's largest; the `shortlist` best positions, plus every candidate the index does not cover
//      (the tail), are rescored exactly;
//   2. exact stage: float32 logits of the rescored positions from the host store's keys, softmax per query head
//      over them, summed over the group; the `budget` best (ties: lower position first), returned ascending.
// Floating-point work is written as fixed 16-lane loops with no contraction (-ffp-contract=off), so every build
// variant and thread count returns the same selection.
#include <algorithm>
#include <functional>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t GROUP = 64;  // tokens per index group
constexpr int LANES = 16;
constexpr int64_t PREFETCH = 8;  // rows of the exact stage requested ahead
constexpr int64_t MIN_POSITIONS_PER_THREAD = 16384;  // (sequence, KV head, position) triples per started thread
constexpr int MAX_G = 8;       // query heads per scan pass (larger groups run in passes of 8)

enum KeyType { F32 = 0, BF16 = 1, F16 = 2 };

// float32 -> bfloat16, round to nearest even (torch's conversion; no NaN inputs here)
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float bf16_to_f32(uint16_t v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct Call {
  int64_t batch, kv_heads, group, dim, dim_pad;  // group: query heads per KV head (G)
  int key_type;
  const float* query;      // (batch, kv_heads * group, dim)
  float scaling;
  int64_t end;             // selectable positions [0, end)
  const uint8_t* mask;     // (batch, end)
  int64_t n_segs;
  const int64_t* seg_start;  // (n_segs,) first position of each key segment
  const int64_t* seg_len;    // (n_segs,)
  const int64_t* seg_ptr;    // (batch * kv_heads, n_segs) address of the task's first key row in the segment
  // 2-bit index (codes == nullptr: exact over every candidate)
  const int64_t* codes_ptr;   // (batch * kv_heads,) address of group 0's codes (dim_q * 16 bytes per group)
  const int64_t* params_ptr;  // (batch * kv_heads,) address of group 0's bf16 [min | scale] (2 * dim_q per group)
  const int64_t* group_first; // (batch,)
  const int64_t* n_groups;    // (batch,)
  int64_t dim_q;              // channels of the index (dim rounded up to a multiple of 4)
  int64_t shortlist;
  int64_t budget;
  int64_t* out_indices;  // (batch, kv_heads, budget)
  uint8_t* out_valid;    // (batch, kv_heads, budget)
};

struct Scratch {
  std::vector<float> q, row, logits, approx, score;
  std::vector<int64_t> positions, chosen, pick_boundary, next;
  std::vector<uint32_t> keys;
  std::vector<int32_t> hist;
  std::vector<int8_t> wq;
  std::vector<int32_t> acc;
  std::vector<float> w, low, qh, sample, kept_score, peak;
  std::vector<int32_t> kept_index;
};

// Scratch buffers outlive a call (a fresh multi-MiB buffer per call would be faulted in page by page): a free
// list, one Scratch per concurrently running worker, released by dc_release_scratch().
std::mutex pool_lock;
std::vector<std::unique_ptr<Scratch>> pool;

std::unique_ptr<Scratch> take_scratch() {
  std::lock_guard<std::mutex> guard(pool_lock);
  if (pool.empty()) return std::make_unique<Scratch>();
  std::unique_ptr<Scratch> s = std::move(pool.back());
  pool.pop_back();
  return s;
}

void give_scratch(std::unique_ptr<Scratch> s) {
  std::lock_guard<std::mutex> guard(pool_lock);
  pool.push_back(std::move(s));
}

// --- exact logits -----------------------------------------------------------------------------------------
const void* key_row(const Call& c, int64_t task, int64_t pos, int64_t& seg_hint) {
  int64_t s = seg_hint;
  if (s >= c.n_segs || pos < c.seg_start[s] || pos >= c.seg_start[s] + c.seg_len[s]) {
    s = 0;
    while (s + 1 < c.n_segs && pos >= c.seg_start[s + 1]) ++s;
    seg_hint = s;
  }
  const int64_t elem = c.key_type == F32 ? 4 : 2;
  const char* base = reinterpret_cast<const char*>(c.seg_ptr[task * c.n_segs + s]);
  return base + (pos - c.seg_start[s]) * c.dim * elem;
}

void to_float(const void* src, int key_type, int64_t dim, float* dst) {
  if (key_type == F32) {
    std::memcpy(dst, src, dim * 4);
  } else if (key_type == BF16) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (int64_t d = 0; d < dim; ++d) dst[d] = bf16_to_f32(s[d]);
  } else {
    const _Float16* s = static_cast<const _Float16*>(src);
    for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<float>(s[d]);
  }
}

// dot of two zero-padded rows of dim_pad floats: 16 lane sums (fused multiply-add), then a fixed pairwise tree
inline float tree_sum(const float* acc) {
  float t8[8], t4[4], t2[2];
  for (int j = 0; j < 8; ++j) t8[j] = acc[j] + acc[j + 8];
  for (int j = 0; j < 4; ++j) t4[j] = t8[j] + t8[j + 4];
  for (int j = 0; j < 2; ++j) t2[j] = t4[j] + t4[j + 2];
  return t2[0] + t2[1];
}

inline float dot_lanes(const float* a, const float* b, int64_t dim_pad) {
  float acc[LANES] = {0};
  for (int64_t d = 0; d < dim_pad; d += LANES)
    for (int j = 0; j < LANES; ++j) acc[j] = std::fma(a[d + j], b[d + j], acc[j]);
  return tree_sum(acc);
}

// the G dots of one key row with G query rows (stride dim_pad), each summed exactly as dot_lanes
template <int G>
inline void dots_lanes(const float* q, const float* row, int64_t dim_pad, float scaling, float* out, int64_t stride) {
  float acc[G][LANES] = {};
  for (int64_t d = 0; d < dim_pad; d += LANES)
    for (int h = 0; h < G; ++h)
      for (int j = 0; j < LANES; ++j) acc[h][j] = std::fma(q[h * dim_pad + d + j], row[d + j], acc[h][j]);
  for (int h = 0; h < G; ++h) out[h * stride] = scaling * tree_sum(acc[h]);
}

void dots_dispatch(int64_t g, const float* q, const float* row, int64_t dim_pad, float scaling, float* out,
                   int64_t stride) {
  for (int64_t h0 = 0; h0 < g; h0 += 4) {
    const float* qh = q + h0 * dim_pad;
    float* o = out + h0 * stride;
    switch (std::min<int64_t>(4, g - h0)) {
      case 1: dots_lanes<1>(qh, row, dim_pad, scaling, o, stride); break;
      case 2: dots_lanes<2>(qh, row, dim_pad, scaling, o, stride); break;
      case 3: dots_lanes<3>(qh, row, dim_pad, scaling, o, stride); break;
      default: dots_lanes<4>(qh, row, dim_pad, scaling, o, stride); break;
    }
  }
}

// Scaled logits of one key row (stored type) with G query rows: the dots_lanes arithmetic (16 lanes, fma in channel
// order, the same tree), with SIMD loads converting the stored type in registers. Returns false where this build
// has no SIMD path (the caller then converts the row and calls dots_dispatch).
#if defined(__AVX512F__)
inline float tree_sum16(__m512 acc) {
  const __m256 t8 = _mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1));
  const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
  const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
  return _mm_cvtss_f32(_mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1)));
}

template <int KT>
inline __m512 load16(const void* row, int64_t d, __mmask16 m) {
  if (KT == F32) return _mm512_maskz_loadu_ps(m, static_cast<const float*>(row) + d);
  const __m256i half = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(row) + d);
  if (KT == BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
  return _mm512_cvtph_ps(half);
}

template <int G, int KT>
inline void row_logits(const void* row, const float* q, int64_t dim, int64_t dim_pad, float scaling, float* out,
                       int64_t stride) {
  __m512 acc[G];
  for (int h = 0; h < G; ++h) acc[h] = _mm512_setzero_ps();
  const int64_t full = dim / LANES * LANES;
  for (int64_t d = 0; d < full; d += LANES) {
    const __m512 k = load16<KT>(row, d, static_cast<__mmask16>(0xFFFF));
    for (int h = 0; h < G; ++h) acc[h] = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * dim_pad + d), k, acc[h]);
  }
  if (full < dim_pad) {  // the last, partial block (zero past dim)
    const __m512 k = load16<KT>(row, full, static_cast<__mmask16>((1u << (dim - full)) - 1));
    for (int h = 0; h < G; ++h) acc[h] = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * dim_pad + full), k, acc[h]);
  }
  for (int h = 0; h < G; ++h) out[h * stride] = scaling * tree_sum16(acc[h]);
}

// tree_sum16 of 16 vectors at once (the same additions, shared shuffles): out[i] = tree_sum16(v[i])
inline void reduce16(const __m512* v, float* out) {
  __m512 x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i)  // lanes j + j+8: quarters (0, 2) and (1, 3) of each vector
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)  // j + j+4: the two halves of each t8; y[i] quarter k = vector 4 i + k
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)  // j + j+2 within each quarter
    z[i] = _mm512_add_ps(_mm512_shuffle_ps(y[2 * i], y[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(y[2 * i], y[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 w = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, w);  // lane 4 k + l holds vector 4 l + k
  for (int k = 0; k < 4; ++k)
    for (int l = 0; l < 4; ++l) out[4 * l + k] = lanes[4 * k + l];
}

// scaled logits of R = 16 / G consecutive rows (row r at rows[r]) with G query rows, as row_logits computes them
template <int G, int KT>
inline void block_logits(const void* const* rows, const float* q, int64_t dim, int64_t dim_pad, float scaling,
                         float* out, int64_t stride) {
  constexpr int R = 16 / G;
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  const int64_t full = dim / LANES * LANES;
  for (int64_t d = 0; d < dim_pad; d += LANES) {
    const __mmask16 m = d < full ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (dim - d)) - 1);
    __m512 qv[G];
    for (int h = 0; h < G; ++h) qv[h] = _mm512_loadu_ps(q + h * dim_pad + d);
    for (int r = 0; r < R; ++r) {
      const __m512 k = load16<KT>(rows[r], d, m);
      for (int h = 0; h < G; ++h) acc[r * G + h] = _mm512_fmadd_ps(qv[h], k, acc[r * G + h]);
    }
  }
  alignas(64) float sums[16];
  reduce16(acc, sums);
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < G; ++h) out[h * stride + r] = scaling * sums[r * G + h];
}

// rows r0 .. r0 + 16 / g - 1 at once when g divides 16; false otherwise (the caller goes row by row)
inline bool simd_block_logits(const void* const* rows, int key_type, const float* q, int64_t g, int64_t dim,
                              int64_t dim_pad, float scaling, float* out, int64_t stride) {
#define DC_BLOCK(G)                                                                                    \
  case G:                                                                                             \
    if (key_type == BF16) block_logits<G, BF16>(rows, q, dim, dim_pad, scaling, out, stride);         \
    else if (key_type == F32) block_logits<G, F32>(rows, q, dim, dim_pad, scaling, out, stride);      \
    else block_logits<G, F16>(rows, q, dim, dim_pad, scaling, out, stride);                           \
    return true;
  switch (g) {
    DC_BLOCK(1)
    DC_BLOCK(2)
    DC_BLOCK(4)
    default: return false;
  }
#undef DC_BLOCK
}

template <int KT>
inline void heads_logits(const void* row, const float* q, int64_t g, int64_t dim, int64_t dim_pad, float scaling,
                         float* out, int64_t stride) {
  for (int64_t h0 = 0; h0 < g; h0 += 4) {
    const float* qh = q + h0 * dim_pad;
    float* o = out + h0 * stride;
    switch (std::min<int64_t>(4, g - h0)) {
      case 1: row_logits<1, KT>(row, qh, dim, dim_pad, scaling, o, stride); break;
      case 2: row_logits<2, KT>(row, qh, dim, dim_pad, scaling, o, stride); break;
      case 3: row_logits<3, KT>(row, qh, dim, dim_pad, scaling, o, stride); break;
      default: row_logits<4, KT>(row, qh, dim, dim_pad, scaling, o, stride); break;
    }
  }
}

inline bool simd_logits(const void* row, int key_type, const float* q, int64_t g, int64_t dim, int64_t dim_pad,
                        float scaling, float* out, int64_t stride) {
  if (key_type == BF16) heads_logits<BF16>(row, q, g, dim, dim_pad, scaling, out, stride);
  else if (key_type == F32) heads_logits<F32>(row, q, g, dim, dim_pad, scaling, out, stride);
  else heads_logits<F16>(row, q, g, dim, dim_pad, scaling, out, stride);
  return true;
}
#else
inline bool simd_logits(const void*, int, const float*, int64_t, int64_t, int64_t, float, float*, int64_t) {
  return false;
}
inline bool simd_block_logits(const void* const*, int, const float*, int64_t, int64_t, int64_t, float, float*,
                              int64_t) {
  return false;
}
#endif

// lane-parallel sum and maximum of x[0, n) (fixed order: lane j sums x[j], x[j + 16], ..., then the tree)
float sum_lanes(const float* x, int64_t n) {
  float acc[LANES] = {0};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int j = 0; j < LANES; ++j) acc[j] += x[i + j];
  for (int j = 0; i + j < n; ++j) acc[j] += x[i + j];
  return tree_sum(acc);
}

float max_lanes(const float* x, int64_t n) {
  float acc[LANES];
  for (int j = 0; j < LANES; ++j) acc[j] = -INFINITY;
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int j = 0; j < LANES; ++j) acc[j] = acc[j] > x[i + j] ? acc[j] : x[i + j];
  for (int j = 0; i + j < n; ++j) acc[j] = acc[j] > x[i + j] ? acc[j] : x[i + j];
  float best = -INFINITY;
  for (int j = 0; j < LANES; ++j) best = best > acc[j] ? best : acc[j];
  return best;
}

// exp(x) for x <= 0 (Cody-Waite reduction, degree-6 polynomial; 0 below -87), lane-parallel
void exp_nonpositive(float* x, int64_t n) {
  const float log2e = 1.44269504088896341f, c1 = 0.693359375f, c2 = -2.12194440e-4f, magic = 12582912.0f;
  for (int64_t i = 0; i < n; ++i) {
    float v = x[i] < -87.0f ? -87.0f : x[i];
    float t = v * log2e;
    float k = (t + magic) - magic;  // round to nearest
    float r = (v - k * c1) - k * c2;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    x[i] = x[i] < -87.0f ? 0.0f : p * scale;
  }
}

// --- top-m by (score desc, position asc) ----------------------------------------------------------------------
inline uint32_t order_key(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// indices (into [0, n)) of the m best scores, in no particular order; ties broken by lower index (the positions
// are ascending). Radix selection on the order-preserving integer image of the scores: 11 bits per pass, each pass
// over the elements that share the boundary prefix only.
void radix_top_m(const float* score, int64_t n, int64_t m, Scratch& s, std::vector<int64_t>& out);

// the scores >= threshold and their indices, ascending, into s.kept_score / s.kept_index; returns their count
int64_t keep_at_least(const float* score, int64_t n, float threshold, Scratch& s) {
  s.kept_score.resize(n + LANES);  // whole-vector stores past the count (compress to memory is slow on Zen 4)
  s.kept_index.resize(n + LANES);
  float* ks = s.kept_score.data();
  int32_t* ki = s.kept_index.data();
  int64_t count = 0, i = 0;
#if defined(__AVX512F__)
  const __m512 th = _mm512_set1_ps(threshold);
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (; i + LANES <= n; i += LANES) {
    const __m512 v = _mm512_loadu_ps(score + i);
    const __mmask16 hit = _mm512_cmp_ps_mask(v, th, _CMP_GE_OQ);
    if (!hit) continue;
    _mm512_storeu_ps(ks + count, _mm512_maskz_compress_ps(hit, v));
    const __m512i index = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(i)));
    _mm512_storeu_si512(ki + count, _mm512_maskz_compress_epi32(hit, index));
    count += __builtin_popcount(hit);
  }
#endif
  for (; i < n; ++i)
    if (score[i] >= threshold) {
      ks[count] = score[i];
      ki[count++] = static_cast<int32_t>(i);
    }
  return count;
}

void top_m(const float* score, int64_t n, int64_t m, Scratch& s, std::vector<int64_t>& out) {
  if (n >= 8192 && m > 0 && m * 8 <= n) {
    // Most positions lose: a threshold from every 16th score keeps ~1.5 m of them, then the exact selection runs
    // on those (every score at or above the threshold is kept, so when at least m are, the result is the same).
    s.sample.clear();
    for (int64_t i = 0; i < n; i += 16) s.sample.push_back(score[i]);
    const int64_t rank = std::min<int64_t>(static_cast<int64_t>(s.sample.size()) - 1, m * 3 / 32 + 8);
    std::nth_element(s.sample.begin(), s.sample.begin() + rank, s.sample.end(), std::greater<float>());
    const float threshold = s.sample[rank];
    const int64_t kept = keep_at_least(score, n, threshold, s);
    if (kept >= m) {
      radix_top_m(s.kept_score.data(), kept, m, s, out);
      for (int64_t& i : out) i = s.kept_index[i];
      return;
    }
  }
  radix_top_m(score, n, m, s, out);
}

void radix_top_m(const float* score, int64_t n, int64_t m, Scratch& s, std::vector<int64_t>& out) {
  out.clear();
  if (m >= n) {
    for (int64_t i = 0; i < n; ++i) out.push_back(i);
    return;
  }
  if (m <= 0) return;
  s.keys.resize(n);
  for (int64_t i = 0; i < n; ++i) s.keys[i] = order_key(score[i]);
  std::vector<int64_t>& boundary = s.pick_boundary;
  boundary.clear();
  int64_t need = m;
  bool all = true;  // the boundary set is every element (first pass)
  const int shifts[3] = {21, 10, 0}, widths[3] = {11, 11, 10};
  for (int pass = 0; pass < 3; ++pass) {
    const int shift = shifts[pass], bits = widths[pass];
    const uint32_t bins = 1u << bits, low = bins - 1;
    s.hist.assign(bins, 0);
    const int64_t count = all ? n : static_cast<int64_t>(boundary.size());
    for (int64_t j = 0; j < count; ++j) ++s.hist[(s.keys[all ? j : boundary[j]] >> shift) & low];
    int64_t above = 0;
    uint32_t bin = low;
    while (above + s.hist[bin] < need) above += s.hist[bin--];
    s.next.clear();
    for (int64_t j = 0; j < count; ++j) {
      const int64_t i = all ? j : boundary[j];
      const uint32_t b = (s.keys[i] >> shift) & low;
      if (b > bin) out.push_back(i);
      else if (b == bin) s.next.push_back(i);
    }
    boundary.swap(s.next);
    all = false;
    need -= above;
    if (need == static_cast<int64_t>(boundary.size())) break;
  }
  // equal keys (or the whole boundary bin): the lowest indices first (boundary holds ascending indices)
  for (int64_t j = 0; j < need; ++j) out.push_back(boundary[j]);
}

// --- 2-bit index scan ---------------------------------------------------------------------------------------
// integer dot products of one group's 64 tokens with G int8 weight rows: acc[h * 64 + t]
template <int G>
void scan_group(const uint8_t* codes, const int8_t* wq, int64_t dim_q, int32_t* acc) {
  const int64_t quads = dim_q / 4;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const __m512i shifts = _mm512_set_epi16(6, 6, 6, 6, 6, 6, 6, 6, 4, 4, 4, 4, 4, 4, 4, 4,
                                          2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i low2 = _mm512_set1_epi8(3);
  __m512i a[G][4];
  for (int h = 0; h < G; ++h)
    for (int tb = 0; tb < 4; ++tb) a[h][tb] = _mm512_setzero_si512();
  for (int64_t c = 0; c < quads; ++c) {
    __m512i v[4];
    for (int tb = 0; tb < 4; ++tb) {
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + (c * 4 + tb) * 16));
      v[tb] = _mm512_and_si512(_mm512_srlv_epi16(_mm512_broadcast_i32x4(packed), shifts), low2);
    }
    for (int h = 0; h < G; ++h) {
      int32_t w;
      std::memcpy(&w, wq + h * dim_q + c * 4, 4);
      const __m512i wb = _mm512_set1_epi32(w);
      for (int tb = 0; tb < 4; ++tb) a[h][tb] = _mm512_dpbusd_epi32(a[h][tb], v[tb], wb);
    }
  }
  for (int h = 0; h < G; ++h)
    for (int tb = 0; tb < 4; ++tb) _mm512_storeu_si512(acc + h * GROUP + tb * 16, a[h][tb]);
#elif defined(__AVX2__)
  const __m256i shift_lo = _mm256_set_epi32(2, 2, 2, 2, 0, 0, 0, 0);
  const __m256i shift_hi = _mm256_set_epi32(6, 6, 6, 6, 4, 4, 4, 4);
  const __m256i low2 = _mm256_set1_epi8(3), ones = _mm256_set1_epi16(1);
  for (int tb = 0; tb < 4; ++tb) {
    __m256i lo[G], hi[G];
    for (int h = 0; h < G; ++h) lo[h] = hi[h] = _mm256_setzero_si256();
    for (int64_t c = 0; c < quads; ++c) {
      __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + (c * 4 + tb) * 16));
      __m256i v = _mm256_broadcastsi128_si256(packed);
      __m256i c0 = _mm256_and_si256(_mm256_srlv_epi32(v, shift_lo), low2);  // tokens 0..7 of the block
      __m256i c1 = _mm256_and_si256(_mm256_srlv_epi32(v, shift_hi), low2);  // tokens 8..15
      for (int h = 0; h < G; ++h) {
        int32_t w;
        std::memcpy(&w, wq + h * dim_q + c * 4, 4);
        __m256i wb = _mm256_set1_epi32(w);
        lo[h] = _mm256_add_epi32(lo[h], _mm256_madd_epi16(_mm256_maddubs_epi16(c0, wb), ones));
        hi[h] = _mm256_add_epi32(hi[h], _mm256_madd_epi16(_mm256_maddubs_epi16(c1, wb), ones));
      }
    }
    for (int h = 0; h < G; ++h) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + h * GROUP + tb * 16), lo[h]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + h * GROUP + tb * 16 + 8), hi[h]);
    }
  }
#else
  for (int h = 0; h < G; ++h)
    for (int t = 0; t < GROUP; ++t) acc[h * GROUP + t] = 0;
  for (int64_t c = 0; c < quads; ++c)
    for (int tb = 0; tb < 4; ++tb) {
      const uint8_t* chunk = codes + (c * 4 + tb) * 16;
      for (int p = 0; p < 64; ++p) {
        const int code = (chunk[p % 16] >> (2 * (p / 16))) & 3;
        const int t = tb * 16 + p / 4;
        for (int h = 0; h < G; ++h) acc[h * GROUP + t] += code * wq[h * dim_q + c * 4 + p % 4];
      }
    }
#endif
}

void scan_dispatch(int g, const uint8_t* codes, const int8_t* wq, int64_t dim_q, int32_t* acc) {
  switch (g) {
    case 1: scan_group<1>(codes, wq, dim_q, acc); break;
    case 2: scan_group<2>(codes, wq, dim_q, acc); break;
    case 3: scan_group<3>(codes, wq, dim_q, acc); break;
    case 4: scan_group<4>(codes, wq, dim_q, acc); break;
    case 5: scan_group<5>(codes, wq, dim_q, acc); break;
    case 6: scan_group<6>(codes, wq, dim_q, acc); break;
    case 7: scan_group<7>(codes, wq, dim_q, acc); break;
    default: scan_group<8>(codes, wq, dim_q, acc); break;
  }
}

// Int8 weights of one (group, query head): w = q * step, sigma = max|w| / 127, w8 = round(w * (1 / sigma)) (0 when
// sigma is 0; |w * (1 / sigma)| <= 127.5 rounds into int8); bias = q . low summed as dot_lanes. All arrays hold
// dim_pad floats (zero past the channels). Returns sigma; writes bias.
float group_weights(const float* __restrict q, const float* __restrict step, const float* __restrict low,
                    int64_t dim_pad, int64_t dq, float* __restrict w, int8_t* __restrict w8, float& bias) {
#if defined(__AVX512F__)
  __m512 peak = _mm512_setzero_ps(), acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim_pad; d += LANES) {
    const __m512 qv = _mm512_loadu_ps(q + d);
    const __m512 wv = _mm512_mul_ps(qv, _mm512_loadu_ps(step + d));
    _mm512_storeu_ps(w + d, wv);
    peak = _mm512_max_ps(peak, _mm512_abs_ps(wv));
    acc = _mm512_fmadd_ps(qv, _mm512_loadu_ps(low + d), acc);
  }
  bias = tree_sum16(acc);
  const float sigma = _mm512_reduce_max_ps(peak) / 127.0f;
  if (!(sigma > 0.0f)) {
    std::memset(w8, 0, dq);
    return sigma;
  }
  const __m512 inv = _mm512_set1_ps(1.0f / sigma);
  int64_t d = 0;
  for (; d + LANES <= dq; d += LANES) {
    const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(w + d), inv),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(w8 + d), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(r)));
  }
  for (; d < dq; ++d) w8[d] = static_cast<int8_t>(static_cast<int32_t>(std::nearbyint(w[d] * (1.0f / sigma))));
  return sigma;
#else
  float peak[LANES] = {0}, acc[LANES] = {0};
  for (int64_t d = 0; d < dim_pad; d += LANES)
    for (int j = 0; j < LANES; ++j) {
      w[d + j] = q[d + j] * step[d + j];
      const float v = std::fabs(w[d + j]);
      peak[j] = peak[j] > v ? peak[j] : v;
      acc[j] = std::fma(q[d + j], low[d + j], acc[j]);
    }
  bias = tree_sum(acc);
  float top = 0.0f;
  for (int j = 0; j < LANES; ++j) top = top > peak[j] ? top : peak[j];
  const float sigma = top / 127.0f;
  if (!(sigma > 0.0f)) {
    for (int64_t d = 0; d < dq; ++d) w8[d] = 0;
    return sigma;
  }
  const float inv = 1.0f / sigma;
  for (int64_t d = 0; d < dq; ++d) w[d] = std::nearbyint(w[d] * inv);
  for (int64_t d = 0; d < dq; ++d) w8[d] = static_cast<int8_t>(static_cast<int32_t>(w[d]));
  return sigma;
#endif
}

// bf16 -> float32 of n values (n a multiple of 4; dst holds n rounded up to 16, zero past n stays as it was)
inline void bf16_row(const uint16_t* src, int64_t n, float* dst) {
#if defined(__AVX512F__)
  int64_t d = 0;
  for (; d + LANES <= n; d += LANES) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + d));
    _mm512_storeu_ps(dst + d, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)));
  }
  for (; d < n; ++d) dst[d] = bf16_to_f32(src[d]);
#else
  for (int64_t d = 0; d < n; ++d) dst[d] = bf16_to_f32(src[d]);
#endif
}

// approximate scaled logits of every covered position, -inf where the mask is false: approx[h * covered + i],
// i = position - group_first (m the mask from group_first on); peak[h] = the largest of head h's
void scan_index(const Call& c, int64_t task, const float* q, int64_t groups, const uint8_t* m, Scratch& s,
                float* peak) {
  const int64_t G = c.group, dq = c.dim_q, covered = groups * GROUP, dim_pad = c.dim_pad;
  const uint8_t* codes = reinterpret_cast<const uint8_t*>(c.codes_ptr[task]);
  const uint16_t* params = reinterpret_cast<const uint16_t*>(c.params_ptr[task]);
  s.approx.resize(G * covered);
  s.wq.resize(MAX_G * dq);
  s.acc.resize(MAX_G * GROUP);
  s.w.assign(dim_pad, 0.0f);
  s.low.assign(dim_pad, 0.0f);
  s.qh.assign(dim_pad, 0.0f);  // the steps, as floats
  for (int64_t h = 0; h < G; ++h) peak[h] = -INFINITY;
  for (int64_t g = 0; g < groups; ++g) {
    const uint16_t* mins = params + g * 2 * dq;
    bf16_row(mins, dq, s.low.data());
    bf16_row(mins + dq, dq, s.qh.data());
    const uint8_t* gm = m + g * GROUP;
    for (int64_t h0 = 0; h0 < G; h0 += MAX_G) {
      const int gh = static_cast<int>(std::min<int64_t>(MAX_G, G - h0));
      float sigma[MAX_G], bias[MAX_G];
      for (int h = 0; h < gh; ++h)
        sigma[h] = group_weights(q + (h0 + h) * dim_pad, s.qh.data(), s.low.data(), dim_pad, dq, s.w.data(),
                                 &s.wq[h * dq], bias[h]);
      scan_dispatch(gh, codes + g * 16 * dq, s.wq.data(), dq, s.acc.data());
      for (int h = 0; h < gh; ++h) {
        float* out = &s.approx[(h0 + h) * covered + g * GROUP];
        const int32_t* a = &s.acc[h * GROUP];
        const float sg = sigma[h], bs = bias[h];
        float top = peak[h0 + h];
#if defined(__AVX512F__) && defined(__AVX512BW__)
        const __m512 vs = _mm512_set1_ps(sg), vb = _mm512_set1_ps(bs), vc = _mm512_set1_ps(c.scaling);
        const __m512 ninf = _mm512_set1_ps(-INFINITY);
        __m512 vtop = ninf;
        for (int64_t t = 0; t < GROUP; t += LANES) {
          const __m512 prod = _mm512_mul_ps(vs, _mm512_cvtepi32_ps(_mm512_loadu_si512(a + t)));
          const __m512 v = _mm512_mul_ps(vc, _mm512_add_ps(vb, prod));
          const __mmask16 keep = _mm_test_epi8_mask(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gm + t)),
                                                    _mm_set1_epi8(-1));
          const __m512 r = _mm512_mask_blend_ps(keep, ninf, v);
          _mm512_storeu_ps(out + t, r);
          vtop = _mm512_max_ps(vtop, r);
        }
        const float gtop = _mm512_reduce_max_ps(vtop);
        top = top > gtop ? top : gtop;
#else
        for (int64_t t = 0; t < GROUP; ++t) {
          const float v = gm[t] ? c.scaling * (bs + sg * static_cast<float>(a[t])) : -INFINITY;
          out[t] = v;
          top = top > v ? top : v;
        }
#endif
        peak[h0 + h] = top;
      }
    }
  }
}

// --- one (sequence, KV head) -------------------------------------------------------------------------------
void run_task(const Call& c, int64_t task, Scratch& s) {
  const int64_t b = task / c.kv_heads, G = c.group, end = c.end;
  const uint8_t* mask = c.mask + b * end;
  s.q.assign(G * c.dim_pad, 0.0f);
  for (int64_t h = 0; h < G; ++h)
    std::memcpy(&s.q[h * c.dim_pad], c.query + (task * G + h) * c.dim, c.dim * 4);

  // the positions rescored exactly, ascending
  s.positions.clear();
  const int64_t first = c.codes_ptr ? c.group_first[b] : end;
  const int64_t groups = c.codes_ptr ? c.n_groups[b] : 0;
  const int64_t covered = groups * GROUP, covered_end = first + covered;
  if (groups > 0) {
    for (int64_t p = 0; p < std::min(first, end); ++p)
      if (mask[p]) s.positions.push_back(p);
    const uint8_t* m = mask + first;
    s.peak.resize(G);
    float* peak = s.peak.data();
    scan_index(c, task, s.q.data(), groups, m, s, peak);
    int64_t usable = 0;
    for (int64_t i = 0; i < covered; ++i) usable += m[i];
    s.score.resize(covered);
    float* score = s.score.data();
    const float* a0 = s.approx.data();
    for (int64_t i = 0; i < covered; ++i) score[i] = a0[i] - peak[0];
    for (int64_t h = 1; h < G; ++h) {
      const float* a = a0 + h * covered;
      const float p = peak[h];
      for (int64_t i = 0; i < covered; ++i) {
        const float v = a[i] - p;
        score[i] = score[i] > v ? score[i] : v;
      }
    }
    top_m(s.score.data(), covered, std::min(c.shortlist, usable), s, s.chosen);
    std::sort(s.chosen.begin(), s.chosen.end());
    for (int64_t i : s.chosen) s.positions.push_back(first + i);
    for (int64_t p = covered_end; p < end; ++p)
      if (mask[p]) s.positions.push_back(p);
  } else {
    for (int64_t p = 0; p < end; ++p)
      if (mask[p]) s.positions.push_back(p);
  }

  // exact stage: logits[h * n + r]
  const int64_t n = static_cast<int64_t>(s.positions.size());
  s.row.assign(c.dim_pad, 0.0f);
  s.logits.resize(G * n);
  int64_t hint = 0;
  int64_t ahead_hint = 0;
  const int64_t row_bytes = c.dim * (c.key_type == F32 ? 4 : 2);
  const int64_t block = 16 % G == 0 && G <= 4 ? 16 / G : 0;  // rows per SIMD block (0: row by row)
  const void* rows[16];
  for (int64_t r = 0; r < n; ++r) {
    if (r + PREFETCH < n && s.positions[r + PREFETCH] != s.positions[r] + PREFETCH) {  // scattered rows: ask ahead
      const char* next = static_cast<const char*>(key_row(c, task, s.positions[r + PREFETCH], ahead_hint));
      for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(next + off);
    }
    if (block && r % block == 0 && r + block <= n) {
      for (int64_t i = 0; i < block; ++i) rows[i] = key_row(c, task, s.positions[r + i], hint);
      if (simd_block_logits(rows, c.key_type, s.q.data(), G, c.dim, c.dim_pad, c.scaling, &s.logits[r], n)) {
        for (int64_t i = 1; i < block; ++i) {  // the block's other rows: prefetch only
          const int64_t ahead = r + i + PREFETCH;
          if (ahead < n && s.positions[ahead] != s.positions[r + i] + PREFETCH) {
            const char* next = static_cast<const char*>(key_row(c, task, s.positions[ahead], ahead_hint));
            for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(next + off);
          }
        }
        r += block - 1;
        continue;
      }
    }
    const void* row = key_row(c, task, s.positions[r], hint);
    if (!simd_logits(row, c.key_type, s.q.data(), G, c.dim, c.dim_pad, c.scaling, &s.logits[r], n)) {
      to_float(row, c.key_type, c.dim, s.row.data());
      dots_dispatch(G, s.q.data(), s.row.data(), c.dim_pad, c.scaling, &s.logits[r], n);
    }
  }
  s.score.assign(n, 0.0f);
  for (int64_t h = 0; h < G; ++h) {
    float* l = &s.logits[h * n];
    const float peak = max_lanes(l, n);
    for (int64_t r = 0; r < n; ++r) l[r] -= peak;
    exp_nonpositive(l, n);
    const float inv = 1.0f / sum_lanes(l, n);
    for (int64_t r = 0; r < n; ++r) s.score[r] += l[r] * inv;
  }
  top_m(s.score.data(), n, c.budget, s, s.chosen);
  std::sort(s.chosen.begin(), s.chosen.end());
  int64_t* out = c.out_indices + task * c.budget;
  uint8_t* valid = c.out_valid + task * c.budget;
  const int64_t k = static_cast<int64_t>(s.chosen.size());
  for (int64_t i = 0; i < c.budget; ++i) {
    out[i] = i < k ? s.positions[s.chosen[i]] : 0;
    valid[i] = i < k ? 1 : 0;
  }
}

}  // namespace

extern "C" {

// Build variant of this library: 2 = AVX-512 VNNI scan, 1 = AVX2, 0 = scalar.
int dc_variant() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return 2;
#elif defined(__AVX2__)
  return 1;
#else
  return 0;
#endif
}

// CPU features of the running machine: bit 0 AVX2 (+FMA, F16C), bit 1 AVX-512 F/BW/VL/DQ + VNNI.
int dc_cpu_features() {
  int f = 0;
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2")) f |= 1;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni"))
    f |= 2;
#endif
  return f;
}

// Select for every (sequence, KV head) of one call; see `Call` for the arguments. Returns 0, or -1 on an
// internal error (std::bad_alloc), with the outputs undefined.
// Quantize `count` groups of GROUP contiguous key rows of `dim` channels (codes.py's format; the same numbers as
// codes.quantize): packed (count, 16 * dim_q) uint8, params (count, 2, dim_q) bf16 [minimum | step].
void dc_quantize(const void* keys, int key_type, int64_t count, int64_t dim, int64_t dim_q, uint8_t* packed,
                 uint16_t* params, int threads) {
  const int64_t worth = std::max<int64_t>(1, count * GROUP / MIN_POSITIONS_PER_THREAD);
  const int workers = static_cast<int>(std::max<int64_t>(1, std::min({static_cast<int64_t>(threads), count, worth})));
  auto work = [=](int worker) {  // by value: stores through uint8_t pointers could alias captured references
    std::vector<float> rows(GROUP * dim_q, 0.0f);
    std::vector<uint8_t> code(GROUP * dim_q);
    std::vector<float> lows(dim_q), highs(dim_q), safes(dim_q);
    const int64_t elem = key_type == F32 ? 4 : 2;
    for (int64_t n = worker; n < count; n += workers) {
      const char* base = static_cast<const char*>(keys) + n * GROUP * dim * elem;
      for (int64_t t = 0; t < GROUP; ++t) to_float(base + t * dim * elem, key_type, dim, &rows[t * dim_q]);
      uint16_t* low_out = params + n * 2 * dim_q;
      uint16_t* step_out = low_out + dim_q;
      float* __restrict lo = lows.data();
      float* __restrict hi = highs.data();
      float* __restrict safe = safes.data();
      for (int64_t d = 0; d < dim_q; ++d) lo[d] = hi[d] = rows[d];
      for (int64_t t = 1; t < GROUP; ++t) {
        const float* __restrict v = &rows[t * dim_q];
        for (int64_t d = 0; d < dim_q; ++d) {
          lo[d] = v[d] < lo[d] ? v[d] : lo[d];
          hi[d] = v[d] > hi[d] ? v[d] : hi[d];
        }
      }
      for (int64_t d = 0; d < dim_q; ++d) {
        low_out[d] = f32_to_bf16(lo[d]);
        lo[d] = bf16_to_f32(low_out[d]);
        step_out[d] = f32_to_bf16((hi[d] - lo[d]) / 3.0f);
        const float step = bf16_to_f32(step_out[d]);
        safe[d] = step > 0.0f ? step : 1.0f;
      }
      for (int64_t t = 0; t < GROUP; ++t) {
        const float* __restrict v = &rows[t * dim_q];
        uint8_t* __restrict out_codes = &code[t * dim_q];
        for (int64_t d = 0; d < dim_q; ++d) {
          float c = std::nearbyint((v[d] - lo[d]) / safe[d]);
          c = c < 0.0f ? 0.0f : (c > 3.0f ? 3.0f : c);
          out_codes[d] = static_cast<uint8_t>(static_cast<int32_t>(c));
        }
      }
      // chunk (quad, tb) as 4 words: word t_off gets channels 4 quad .. 4 quad + 3 of token tb * 16 + 4 i + t_off
      // at bit pair i (byte k = 4 t_off + channel holds element p = 16 i + k)
      uint32_t* out = reinterpret_cast<uint32_t*>(packed + n * 16 * dim_q);
      const int64_t quads = dim_q / 4;
      for (int64_t j = 0; j < quads * 16; ++j) out[j] = 0;
      for (int64_t t = 0; t < GROUP; ++t) {
        const int64_t tb = t / 16, i = (t % 16) / 4, t_off = t % 4;
        const uint8_t* row = &code[t * dim_q];
        for (int64_t quad = 0; quad < quads; ++quad) {
          uint32_t word;
          std::memcpy(&word, row + quad * 4, 4);
          out[(quad * 4 + tb) * 4 + t_off] |= word << (2 * i);
        }
      }
    }
  };
  std::vector<std::thread> pool_threads;
  for (int w = 1; w < workers; ++w) pool_threads.emplace_back(work, w);
  work(0);
  for (auto& t : pool_threads) t.join();
}

// Free the scratch buffers kept between calls (idempotent; calls running meanwhile keep theirs).
void dc_release_scratch() {
  std::lock_guard<std::mutex> guard(pool_lock);
  pool.clear();
}

int dc_select(int64_t batch, int64_t kv_heads, int64_t group, int64_t dim, int key_type, const float* query,
              float scaling, int64_t end, const uint8_t* mask, int64_t n_segs, const int64_t* seg_start,
              const int64_t* seg_len, const int64_t* seg_ptr, const int64_t* codes_ptr, const int64_t* params_ptr,
              const int64_t* group_first, const int64_t* n_groups, int64_t dim_q, int64_t shortlist,
              int64_t budget, int64_t* out_indices, uint8_t* out_valid, int threads) {
  Call c{batch, kv_heads, group, dim, (dim + LANES - 1) / LANES * LANES, key_type, query, scaling, end, mask,
         n_segs, seg_start, seg_len, seg_ptr, codes_ptr, params_ptr, group_first, n_groups, dim_q, shortlist,
         budget, out_indices, out_valid};
  const int64_t tasks = batch * kv_heads;
  // a thread is started per call: only for work that outweighs starting it (the result never depends on it)
  const int64_t worth = std::max<int64_t>(1, tasks * end / MIN_POSITIONS_PER_THREAD);
  const int workers = static_cast<int>(std::max<int64_t>(1, std::min({static_cast<int64_t>(threads), tasks, worth})));
  std::vector<int> failed(workers, 0);
  auto work = [&](int w) {
    try {
      std::unique_ptr<Scratch> s = take_scratch();
      for (int64_t t = w; t < tasks; t += workers) run_task(c, t, *s);
      give_scratch(std::move(s));
    } catch (...) {
      failed[w] = 1;
    }
  };
  if (workers == 1) {
    work(0);
  } else {
    std::vector<std::thread> pool;
    try {
      for (int w = 1; w < workers; ++w) pool.emplace_back(work, w);
    } catch (...) {
      failed[0] = 1;
    }
    work(0);
    for (auto& t : pool) t.join();
  }
  for (int f : failed)
    if (f) return -1;
  return 0;
}

}  // extern "C"
