// Native host selection engine of dual-cache (the Python side is dual_cache/engine/native.py; the pure-torch
// reference that defines every number computed here is dual_cache/engine/reference.py).
//
// One call selects, for every (sequence, KV head) of one layer's decode step, the `budget` positions of highest
// exact group attention mass:
//   1. optional scan of the 2-bit key index over a chosen subset of its channel quads (the rest at each group's
//      midpoint): per 64-token group an int8 copy of (query x channel step) is dotted with the 2-bit codes in exact
//      integer arithmetic (AVX2 or scalar; the same integers on every path), giving approximate logits; each
//      position's score is max over the GQA group of its logit minus that head's log-sum-exp over a sample of
//      groups; the `shortlist` best positions, plus every candidate the index does not cover (the tail), are
//      rescored exactly (section "2-bit index scan" below);
//   2. exact stage: float32 logits of the rescored positions from the host store's keys, softmax per query head
//      over them, summed over the group; the `budget` best (ties: lower position first), returned ascending.
// With carried pools (the `carried` selector), a task whose pooled selection is due (`plan_pools`) skips step 1 and
// rescores its pool's positions plus every candidate appended since its last scan; every other task writes the
// pool's size best of its exact stage into its pool, for the steps until its next scan.
// Floating-point work is written as fixed 16-lane loops with no contraction (-ffp-contract=off), so every build
// variant and thread count returns the same selection.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#if defined(__linux__)
#include <dlfcn.h>
#include <link.h>
#endif
#include <memory>
#include <mutex>
#include <pthread.h>
#include <string>
#include <thread>
#include <time.h>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t GROUP = 64;  // tokens per index group
constexpr int LANES = 16;
// Scattered rows are requested twice ahead of their use: into L2 (far) and into L1 (near). Two levels read scattered
// 256-byte rows about twice as fast as one: an L1 request holds one of the core's few L1 miss buffers until its line
// arrives, an L2 request does not.
constexpr int64_t EXACT_FAR = 32, EXACT_NEAR = 8;   // rows of the exact stage
constexpr int64_t GATHER_FAR = 16, GATHER_NEAR = 4;  // value rows of the gather
constexpr int64_t MIN_POSITIONS_PER_THREAD = 16384;  // (sequence, KV head, position) triples per started thread

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
  const int64_t* rows;     // (batch,) the stored sequence of each query row
  // the key (and value) chunks: per chunk SEG_FIELDS int64, see `Seg`
  int64_t n_segs;
  const int64_t* segs;
  // 2-bit index (nullptr: exact over every candidate): INDEX_FIELDS int64, see `Index`
  const int64_t* index;
  const int64_t* group_first; // (stored sequences,) indexed by rows[b]
  const int64_t* n_groups;    // (stored sequences,) complete groups (those below end are used)
  int64_t dim_q;              // channels of the index (dim rounded up to a multiple of 4)
  int64_t quads;              // channel quads the scan reads (1 .. dim_q / 4)
  int64_t shortlist;
  int64_t budget;
  int64_t* out_indices;  // (batch, kv_heads, budget)
  uint8_t* out_valid;    // (batch, kv_heads, budget)
  // optional gather of the selected K/V rows (out_keys == nullptr: none; the chunks' value fields are then unused)
  char* out_keys;            // (batch, kv_heads, out_slots, dim) of the key type: the first budget slots written
  char* out_values;          // (batch, kv_heads, out_slots, dim)
  int64_t out_slots;         // rows per (sequence, KV head) of out_keys / out_values (>= budget)
  int64_t* profile;          // (batch * kv_heads, PHASES) nanoseconds per phase, then the call's wall; or nullptr
  // optional carried pools (pool == nullptr: none), one per (stored sequence, KV head), indexed by rows[b] (see
  // `Pool`); `pooled[task]`: the task rescores its pool this call (decided by `plan_pools` before any work)
  const int64_t* pool;
  const uint8_t* pooled;
};

// fields of the carried pools (`CarriedPool` in engine/__init__.py): addresses of contiguous arrays over (stored
// sequence, KV head) = `at`, and the schedule. A task `at` scanned last with query POOL_QUERY[at] (G x dim floats) at
// the selectable end POOL_FRESH[at], and kept the POOL_COUNTS[at] best positions of that scan's exact stage
// (ascending) in POOL_POSITIONS[at]; POOL_DUE[at] pooled selections remain before its next scan; POOL_TALLY[at]
// counts its scans and its pooled selections.
enum Pool { POOL_POSITIONS = 0, POOL_COUNTS, POOL_SLOTS, POOL_DUE, POOL_FRESH, POOL_QUERY, POOL_TALLY, POOL_INTERVAL,
            POOL_PHASE, POOL_FIELDS };

template <typename T>
inline T* pool_array(const Call& c, int field) { return reinterpret_cast<T*>(c.pool[field]); }

// the carried pool of a task: its stored sequence's, for its KV head
inline int64_t pool_of(const Call& c, int64_t task) {
  return c.rows[task / c.kv_heads] * c.kv_heads + task % c.kv_heads;
}
inline bool pooled(const Call& c, int64_t task) { return c.pool && c.pooled[task]; }

// Before any work: per task, whether it rescores its pool (it has one, a pooled selection is due, no crop went
// below its pool, and its query's cosine to that of its last scan is at least `cosine`, unless cosine is NaN), and
// the schedule's update: a pooled task counts one selection down; a scanning task records its query and end and
// waits POOL_INTERVAL - 1 pooled selections (its first scan since its pool was emptied: (phase + KV head) %
// interval, staggering the layers' and heads' scans). Cosines in double, summed in channel order.
void plan_pools(const Call& c, double cosine, std::vector<uint8_t>& out) {
  const int64_t tasks = c.batch * c.kv_heads, width = c.group * c.dim;
  const int64_t interval = c.pool[POOL_INTERVAL], phase = c.pool[POOL_PHASE];
  int64_t* counts = pool_array<int64_t>(c, POOL_COUNTS);
  int64_t* due = pool_array<int64_t>(c, POOL_DUE);
  int64_t* fresh = pool_array<int64_t>(c, POOL_FRESH);
  int64_t* tally = pool_array<int64_t>(c, POOL_TALLY);
  float* kept = pool_array<float>(c, POOL_QUERY);
  out.assign(tasks, 0);
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t at = pool_of(c, task);
    const float* q = c.query + task * width;
    float* last = kept + at * width;
    bool pool = counts[at] > 0 && due[at] > 0 && fresh[at] <= c.end;
    if (pool && !std::isnan(cosine)) {
      double dot = 0, qq = 0, ll = 0;
      for (int64_t i = 0; i < width; ++i) {
        dot += double(q[i]) * double(last[i]);
        qq += double(q[i]) * double(q[i]);
        ll += double(last[i]) * double(last[i]);
      }
      pool = qq > 0 && ll > 0 && dot / std::sqrt(qq * ll) >= cosine;
    }
    if (pool) {
      due[at] -= 1;
      tally[2 * at + 1] += 1;
    } else {
      due[at] = counts[at] == 0 ? (phase + task % c.kv_heads) % interval : interval - 1;
      fresh[at] = c.end;
      std::memcpy(last, q, width * sizeof(float));
      tally[2 * at] += 1;
    }
    out[task] = pool ? 1 : 0;
  }
}

// fields of one key/value chunk (addresses and strides in bytes; a sequence stride of 0: one sequence's chunk that
// every query row reads, a shared prefix)
enum Seg { SEG_START = 0, SEG_LEN, KEY_BASE, KEY_SEQ_STRIDE, KEY_HEAD_STRIDE, VALUE_BASE, VALUE_SEQ_STRIDE,
           VALUE_HEAD_STRIDE, SEG_FIELDS };
// fields of the index (bytes): codes of (sequence, KV head, quad, group) at CODES_BASE + the strides; the bf16
// parameters of (sequence, KV head) at PARAMS_BASE + the strides, 2 * dim_q per group, groups contiguous
enum Index { CODES_BASE = 0, CODES_SEQ_STRIDE, CODES_HEAD_STRIDE, CODES_QUAD_STRIDE, CODES_GROUP_STRIDE, PARAMS_BASE,
             PARAMS_SEQ_STRIDE, PARAMS_HEAD_STRIDE, INDEX_FIELDS };

// --- profile: thread CPU time per phase of a task (Call.profile; off when nullptr) -----------------------------
enum Phase { SCAN_SETUP = 0, SCAN_SAMPLE, SCAN_MAIN, SHORTLIST, EXACT_READS, EXACT_TOPK, GATHER, PHASES };

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline int64_t thread_ns() {  // CPU time of the calling thread (time it waits for memory included, time off-CPU not)
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec;
}

struct Clock {  // adds the time since the last mark to a phase of one task's row (the parts of a split task add
               // to the same row, atomically)
  int64_t* row;
  int64_t last;
  explicit Clock(int64_t* r) : row(r), last(r ? thread_ns() : 0) {}
  void mark(Phase phase) {
    if (!row) return;
    const int64_t t = thread_ns();
    __atomic_fetch_add(&row[phase], t - last, __ATOMIC_RELAXED);
    last = t;
  }
  void skip() {  // the time since the last mark counts for no phase (a wait at a barrier)
    if (row) last = thread_ns();
  }
};

// One task between its shortlist and its exact stage: a worker scans task t while the rows of task t - 1's shortlist
// are requested (`Pending`), then scores those rows exactly, from cache.
struct Slot {
  int64_t task = -1;
  std::vector<float> q;  // the GQA group's query rows, zero-padded to dim_pad channels and to a multiple of 4 heads
  std::vector<int64_t> positions;  // rescored exactly, ascending
  std::vector<const char*> key_seg, value_seg;  // the task's first key / value row in each chunk
};

// Rows whose reads a scan spreads over its groups (into L2): the previous task's shortlist
struct Pending {
  const char* const* table = nullptr;
  const int64_t* positions = nullptr;
  int64_t n = 0, next = 0, row_bytes = 0, hint = 0;
};

struct Scratch {
  Slot slots[2];
  Pending pending;
  std::vector<float> row, logits, score, sample, kept_score;
  std::vector<int64_t> chosen, pick_boundary, next, sample_top;
  std::vector<uint32_t> keys;
  std::vector<int32_t> hist, kept_index;
  // the index scan
  std::vector<float> steps, row_f, importance, low, step, mid, w, sample_a, sample_c, offset, a_buf, b_buf, q_sel,
      step_sel, dmid, tops, sigmas, wa, wc;
  int64_t k_sel = 0;
  std::vector<int32_t> quads, acc, sample_acc, step_offset;
  std::vector<uint8_t> step_mask;
  std::vector<int8_t> w8, w8_spare;
  std::vector<const uint8_t*> quad_base;  // the chosen quads' group-0 lines
  std::vector<const char*> row_ptr;  // the exact stage's key rows
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

// --- threads kept between calls ------------------------------------------------------------------------------
// A call's workers other than the calling thread run on threads kept between calls: starting a thread costs tens of
// microseconds, as much as the work of a small call. One call uses them at a time; a call that finds them busy
// (another thread is in a call), or needs more of them than the CPU has cores, starts its own threads. A fork()ed
// child starts with none (the parent's threads do not exist there). dc_release_scratch() stops them.
class KeptThreads {
 public:
  // job(w) for w = 0 .. n - 1 at once, w = 0 on the calling thread; false (nothing run) when busy or too many
  bool try_run(int n, const std::function<void(int)>& job) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock() || n - 1 > capacity()) return false;
    try {
      while (static_cast<int>(threads_.size()) < n - 1) {
        const int index = static_cast<int>(threads_.size());
        int64_t now;  // the generation before this call's: the new thread waits for the next one
        {
          std::lock_guard<std::mutex> guard(lock_);
          now = generation_;
        }
        threads_.emplace_back([this, index, now] { serve(index, now); });
      }
    } catch (...) {
      return false;  // the threads that did start are kept for later calls
    }
    {
      std::lock_guard<std::mutex> guard(lock_);
      job_ = &job;
      wanted_ = n - 1;
      remaining_ = n - 1;
      ++generation_;
    }
    wake_.notify_all();
    job(0);
    std::unique_lock<std::mutex> guard(lock_);
    done_.wait(guard, [this] { return remaining_ == 0; });
    job_ = nullptr;
    return true;
  }

  void stop() {  // waits for a running call, then joins every kept thread
    std::lock_guard<std::mutex> busy(busy_);
    {
      std::lock_guard<std::mutex> guard(lock_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
    threads_.clear();
    std::lock_guard<std::mutex> guard(lock_);
    stopping_ = false;
  }

 private:
  static int capacity() {
    static const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    return cores;
  }

  void serve(int index, int64_t seen) {  // kept thread `index` runs worker index + 1 of each call that wants it
    std::unique_lock<std::mutex> guard(lock_);
    for (;;) {
      wake_.wait(guard, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
      if (index >= wanted_) continue;
      const std::function<void(int)>* job = job_;
      guard.unlock();
      (*job)(index + 1);  // the job catches its own exceptions
      guard.lock();
      if (--remaining_ == 0) done_.notify_one();
    }
  }

  std::mutex busy_;  // held by the call using the threads
  std::mutex lock_;  // guards the fields below
  std::condition_variable wake_, done_;
  const std::function<void(int)>* job_ = nullptr;
  int wanted_ = 0, remaining_ = 0;
  int64_t generation_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

// never deleted: its threads may be waiting in it until the process ends
KeptThreads* kept_threads_now = new KeptThreads();
// set in a fork()ed child (by the handler below, or by dc_note_fork when the library is loaded after the fork): the
// OpenMP runtime's threads are the parent's there, so the kept threads run the workers
std::atomic<bool> forked_child{false};

KeptThreads& kept_threads() { return *kept_threads_now; }

// fork() handlers, registered when the library is loaded: no other thread may hold the scratch pool's lock while
// the process forks (the child would wait for it forever), and the child starts with no kept threads
void before_fork() { pool_lock.lock(); }
void after_fork_in_parent() { pool_lock.unlock(); }
void after_fork_in_child() {
  pool_lock.unlock();
  kept_threads_now = new KeptThreads();  // the parent's threads (and the locks they held) are not here
  forked_child.store(true);
}
struct ForkHandlers {
  ForkHandlers() { pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child); }
} fork_handlers;

// --- the process's OpenMP threads (torch's) ---------------------------------------------------------------
// torch runs its CPU operations on an OpenMP team (GNU libgomp in its Linux wheels) whose threads keep spinning for
// a while after each operation, on the very cores this engine's own threads then need: right after torch work, a
// call's threads barely ran in parallel. So a call first asks the OpenMP runtime already loaded in the process for a
// team (GOMP_parallel, libgomp's entry for `#pragma omp parallel`, found by name among the loaded libraries; the
// engine is not linked to any OpenMP runtime): the spinning threads take the work at once. Without such a runtime,
// in a fork()ed child (libgomp's threads are the parent's), or when the team comes short (a call from inside an
// OpenMP region gets one thread), the kept threads run it.
struct OpenMP {
  void (*parallel)(void (*)(void*), void*, unsigned, unsigned) = nullptr;
  int (*thread_num)() = nullptr;
  int (*num_threads)() = nullptr;
};

#if defined(__linux__)
int find_libgomp(dl_phdr_info* info, size_t, void* out) {
  if (info->dlpi_name && std::strstr(info->dlpi_name, "libgomp")) {
    *static_cast<std::string*>(out) = info->dlpi_name;
    return 1;
  }
  return 0;
}
#endif

const OpenMP* loaded_openmp() {
  static OpenMP omp;
  static std::once_flag once;
  std::call_once(once, [] {
    if (std::getenv("DUAL_CACHE_ENGINE_OWN_THREADS")) return;  // a switch to measure or rule it out
#if defined(__linux__)
    std::string path;
    dl_iterate_phdr(find_libgomp, &path);
    if (path.empty()) return;
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);  // already loaded: no new library is brought in
    if (!handle) return;
    OpenMP found;
    found.parallel = reinterpret_cast<decltype(found.parallel)>(dlsym(handle, "GOMP_parallel"));
    found.thread_num = reinterpret_cast<decltype(found.thread_num)>(dlsym(handle, "omp_get_thread_num"));
    found.num_threads = reinterpret_cast<decltype(found.num_threads)>(dlsym(handle, "omp_get_num_threads"));
    if (found.parallel && found.thread_num && found.num_threads) omp = found;
#endif  // elsewhere: no lookup (the kept threads run the workers)
  });
  return omp.parallel && !forked_child.load() ? &omp : nullptr;
}

// how the calling thread's last dc_select ran its workers (dc_last_threads)
enum ThreadsUsed { ONE_THREAD = 0, OPENMP_TEAM = 1, KEPT_THREADS = 2, STARTED_THREADS = 3 };
thread_local int last_threads = ONE_THREAD;

struct OpenMPJob {
  const OpenMP* omp;
  const std::function<void(int)>* job;
  int n;
  std::atomic<bool> short_team{false};
};

void openmp_body(void* data) {  // every team member: worker omp_get_thread_num(), when the team has all n
  OpenMPJob& j = *static_cast<OpenMPJob*>(data);
  const int id = j.omp->thread_num(), team = j.omp->num_threads();
  if (team < j.n) {  // every member sees the same team size: none runs a worker (split parts wait for each other)
    j.short_team.store(true);
    return;
  }
  if (id < j.n) (*j.job)(id);
}

// job(w) for w = 0 .. n - 1 at once on an OpenMP team; false (nothing run) without one of n threads
bool try_run_openmp(int n, const std::function<void(int)>& job) {
  const OpenMP* omp = loaded_openmp();
  if (!omp) return false;
  OpenMPJob j{omp, &job, n};
  omp->parallel(openmp_body, &j, static_cast<unsigned>(n), 0);
  return !j.short_team.load();
}

// --- exact logits -----------------------------------------------------------------------------------------
// the row of position `pos` in a task's chunks (table: the task's first row in each chunk, Scratch key_seg/value_seg)
inline const void* row_at(const Call& c, const char* const* table, int64_t pos, int64_t& seg_hint) {
  int64_t s = seg_hint;
  const int64_t* seg = c.segs + s * SEG_FIELDS;
  if (s >= c.n_segs || pos < seg[SEG_START] || pos >= seg[SEG_START] + seg[SEG_LEN]) {
    s = 0;
    while (s + 1 < c.n_segs && pos >= c.segs[(s + 1) * SEG_FIELDS + SEG_START]) ++s;
    seg_hint = s;
    seg = c.segs + s * SEG_FIELDS;
  }
  const int64_t elem = c.key_type == F32 ? 4 : 2;
  return table[s] + (pos - seg[SEG_START]) * c.dim * elem;
}

inline void prefetch_row(const char* row, int64_t row_bytes, bool near) {
  for (int64_t off = 0; off < row_bytes; off += 64) {
    if (near) __builtin_prefetch(row + off, 0, 3);
    else __builtin_prefetch(row + off, 0, 1);
  }
}

// request the next share of the pending rows into L2 (`groups_left` groups of the scan remain to spread them over);
// a row that follows the previous one is left to the hardware prefetcher
inline void issue_pending(const Call& c, Pending& p, int64_t groups_left) {
  const int64_t stop = std::min(p.n, p.next + (p.n - p.next + groups_left - 1) / std::max<int64_t>(1, groups_left));
  for (; p.next < stop; ++p.next) {
    const int64_t r = p.next;
    if (r > 0 && p.positions[r] == p.positions[r - 1] + 1) continue;
    prefetch_row(static_cast<const char*>(row_at(c, p.table, p.positions[r], p.hint)), p.row_bytes, false);
  }
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

// bf16 -> float32 of n values
inline void bf16_row(const uint16_t* src, int64_t n, float* dst) {
  int64_t d = 0;
#if defined(__AVX2__)
  for (; d + 8 <= n; d += 8) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d));
    _mm256_storeu_ps(dst + d, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16)));
  }
#endif
  for (; d < n; ++d) dst[d] = bf16_to_f32(src[d]);
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
#if defined(__AVX2__) && defined(__FMA__)
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();  // lanes 0-7 and 8-15 of the loop below
  for (int64_t d = 0; d < dim_pad; d += LANES) {
    lo = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), lo);
    hi = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), hi);
  }
  alignas(32) float acc[LANES];
  _mm256_store_ps(acc, lo);
  _mm256_store_ps(acc + 8, hi);
  return tree_sum(acc);
#else
  float acc[LANES] = {0};
  for (int64_t d = 0; d < dim_pad; d += LANES)
    for (int j = 0; j < LANES; ++j) acc[j] = std::fma(a[d + j], b[d + j], acc[j]);
  return tree_sum(acc);
#endif
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

#if defined(__AVX2__) && defined(__FMA__)
// tree_sum of 16 lanes held in two 8-lane registers (lanes 0-7 and 8-15): the same additions in the same order
inline float tree_sum8x2(__m256 lo, __m256 hi) {
  const __m256 t8 = _mm256_add_ps(lo, hi);  // lanes j + j+8
  const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
  const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
  return _mm_cvtss_f32(_mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1)));
}
#endif

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

#elif defined(__AVX2__) && defined(__FMA__)
template <int KT>
inline __m256 load8(const void* row, int64_t d) {
  if (KT == F32) return _mm256_loadu_ps(static_cast<const float*>(row) + d);
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(row) + d));
  if (KT == BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
  return _mm256_cvtph_ps(half);
}

template <int G, int KT>
inline void row_logits(const void* row, const float* q, int64_t dim, int64_t dim_pad, float scaling, float* out,
                       int64_t stride) {
  __m256 lo[G], hi[G];
  for (int h = 0; h < G; ++h) lo[h] = hi[h] = _mm256_setzero_ps();
  const int64_t full = dim / LANES * LANES;
  for (int64_t d = 0; d < full; d += LANES) {
    const __m256 k0 = load8<KT>(row, d), k1 = load8<KT>(row, d + 8);
    for (int h = 0; h < G; ++h) {
      lo[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * dim_pad + d), k0, lo[h]);
      hi[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * dim_pad + d + 8), k1, hi[h]);
    }
  }
  if (full < dim_pad) {  // the last, partial block: the row's tail copied into zeros
    alignas(32) uint8_t tail[LANES * 4] = {};
    const int64_t elem = KT == F32 ? 4 : 2;
    std::memcpy(tail, static_cast<const char*>(row) + full * elem, (dim - full) * elem);
    const __m256 k0 = load8<KT>(tail, 0), k1 = load8<KT>(tail, 8);
    for (int h = 0; h < G; ++h) {
      lo[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * dim_pad + full), k0, lo[h]);
      hi[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * dim_pad + full + 8), k1, hi[h]);
    }
  }
  for (int h = 0; h < G; ++h) out[h * stride] = scaling * tree_sum8x2(lo[h], hi[h]);
}


inline bool simd_block_logits(const void* const*, int, const float*, int64_t, int64_t, int64_t, float, float*,
                              int64_t) {
  return false;
}
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// the G heads' logits of one row, four heads per row_logits call (row_logits: this build's SIMD width)
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
  int64_t i = 0;
#if defined(__AVX512F__)
  {  // the loop below, 16 lanes at a time (the same operations, each rounded alike)
    const __m512 lowest = _mm512_set1_ps(-87.0f), vlog2e = _mm512_set1_ps(log2e), vmagic = _mm512_set1_ps(magic);
    const __m512 vc1 = _mm512_set1_ps(c1), vc2 = _mm512_set1_ps(c2), one = _mm512_set1_ps(1.0f);
    const float coef[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                           1.6666665459e-1f, 5.0000001201e-1f};
    for (; i + 16 <= n; i += 16) {
      const __m512 x0 = _mm512_loadu_ps(x + i);
      const __mmask16 under = _mm512_cmp_ps_mask(x0, lowest, _CMP_LT_OQ);
      const __m512 v = _mm512_mask_blend_ps(under, x0, lowest);
      const __m512 k = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(v, vlog2e), vmagic), vmagic);
      const __m512 r = _mm512_sub_ps(_mm512_sub_ps(v, _mm512_mul_ps(k, vc1)), _mm512_mul_ps(k, vc2));
      __m512 p = _mm512_set1_ps(coef[0]);
      for (int j = 1; j < 6; ++j) p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(coef[j]));
      p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r), one);
      const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
      const __m512 e = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
      _mm512_storeu_ps(x + i, _mm512_maskz_mov_ps(static_cast<__mmask16>(~under), e));
    }
  }
#endif
#if defined(__AVX2__)
  {  // the loop below, 8 lanes at a time (the same operations, each rounded alike)
    const __m256 lowest = _mm256_set1_ps(-87.0f), vlog2e = _mm256_set1_ps(log2e), vmagic = _mm256_set1_ps(magic);
    const __m256 vc1 = _mm256_set1_ps(c1), vc2 = _mm256_set1_ps(c2), one = _mm256_set1_ps(1.0f);
    const float coef[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                           1.6666665459e-1f, 5.0000001201e-1f};
    for (; i + 8 <= n; i += 8) {
      const __m256 x0 = _mm256_loadu_ps(x + i);
      const __m256 under = _mm256_cmp_ps(x0, lowest, _CMP_LT_OQ);
      const __m256 v = _mm256_blendv_ps(x0, lowest, under);
      const __m256 k = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(v, vlog2e), vmagic), vmagic);
      const __m256 r = _mm256_sub_ps(_mm256_sub_ps(v, _mm256_mul_ps(k, vc1)), _mm256_mul_ps(k, vc2));
      __m256 p = _mm256_set1_ps(coef[0]);
      for (int j = 1; j < 6; ++j) p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(coef[j]));
      p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), one);
      const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
      const __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
      _mm256_storeu_ps(x + i, _mm256_andnot_ps(under, e));
    }
  }
#endif
  for (; i < n; ++i) {
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

// indices (into [0, n)) of the m best scores, ascending; ties broken by lower index (the positions
// are ascending). Radix selection on the order-preserving integer image of the scores (11 bits per pass, each pass
// over the elements that share the boundary prefix only), then one ordered sweep.
void radix_top_m(const float* score, int64_t n, int64_t m, Scratch& s, std::vector<int64_t>& out);

#if defined(__AVX2__) && !defined(__AVX512F__)
struct CompressTable {  // lanes[mask]: the set lanes of the 8-bit mask in ascending order, then zeros
  alignas(32) int32_t lanes[256][8];
  CompressTable() {
    for (int mask = 0; mask < 256; ++mask) {
      int k = 0;
      for (int lane = 0; lane < 8; ++lane)
        if (mask >> lane & 1) lanes[mask][k++] = lane;
      while (k < 8) lanes[mask][k++] = 0;
    }
  }
};
#endif

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
#elif defined(__AVX2__)
  // branch-free compress: the hit mask picks a lane permutation that moves the hits to the front
  static const CompressTable table;
  const __m256 th = _mm256_set1_ps(threshold);
  __m256i index = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0);
  const __m256i eight = _mm256_set1_epi32(8);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(score + i);
    const unsigned hit = static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(v, th, _CMP_GE_OQ)));
    const __m256i perm = _mm256_load_si256(reinterpret_cast<const __m256i*>(table.lanes[hit]));
    _mm256_storeu_ps(ks + count, _mm256_permutevar8x32_ps(v, perm));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(ki + count), _mm256_permutevar8x32_epi32(index, perm));
    count += __builtin_popcount(hit);
    index = _mm256_add_epi32(index, eight);
  }
#endif
  for (; i < n; ++i)
    if (score[i] >= threshold) {
      ks[count] = score[i];
      ki[count++] = static_cast<int32_t>(i);
    }
  return count;
}

// indices of the m best scores, ascending (radix_top_m, after a sampled threshold filter on long inputs)
void top_m(const float* score, int64_t n, int64_t m, Scratch& s, std::vector<int64_t>& out) {
  if (n >= 8192 && m > 0 && m * 8 <= n) {
    // Most positions lose: a threshold from a strided sample (every 16th score, at most ~2K of them) keeps ~1.5 m
    // of them, then the exact selection runs on those (every score at or above the threshold is kept, so when at
    // least m are, the result is the same).
    const int64_t stride = std::max<int64_t>(16, n / 2048);
    s.sample.clear();
    for (int64_t i = 0; i < n; i += stride) s.sample.push_back(score[i]);
    const int64_t count = static_cast<int64_t>(s.sample.size());
    const int64_t rank = std::min<int64_t>(count - 1, m * 3 * count / (2 * n) + 8);
    radix_top_m(s.sample.data(), count, rank + 1, s, s.sample_top);  // the rank + 1 best samples
    float threshold = INFINITY;
    for (int64_t i : s.sample_top) threshold = std::min(threshold, s.sample[i]);
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
  uint32_t* keys = s.keys.data();
  uint32_t kmin = ~0u, kmax = 0;
  for (int64_t i = 0; i < n; ++i) {
    keys[i] = order_key(score[i]);
    kmin = std::min(kmin, keys[i]);
    kmax = std::max(kmax, keys[i]);
  }
  // Find the boundary: the top bits `prefix` (under `mask`) of the m-th largest key, and how many of the keys that
  // share them are taken (`need`); keys whose top bits are larger are all taken. The bits above the highest one
  // that differs between the keys are shared by all; the digits (11 bits at most) start below them.
  const int top = kmin == kmax ? -1 : 31 - __builtin_clz(kmin ^ kmax);
  uint32_t mask = top < 0 ? ~0u : ~((2u << top) - 1u);  // top == 31: 2u << 31 wraps to 0, mask 0
  uint32_t prefix = kmin & mask;
  int64_t need = m;
  std::vector<int64_t>& boundary = s.pick_boundary;  // indices whose bits under mask equal prefix (ascending)
  bool first = true;
  for (int hi = top + 1; hi > 0;) {
    // digits of about log2(keys) - 1 bits, 4 to 11 (a pass costs the keys it counts plus the bins it scans)
    const int64_t count_now = first ? n : static_cast<int64_t>(boundary.size());
    const int bits = std::max(4, std::min(11, 62 - __builtin_clzll(static_cast<uint64_t>(count_now) | 1)));
    const int width = std::min(hi, bits), shift = hi - width;
    const uint32_t low = (1u << width) - 1;
    s.hist.assign(low + 1, 0);
    int32_t* hist = s.hist.data();
    const int64_t count = first ? n : static_cast<int64_t>(boundary.size());
    if (first)
      for (int64_t i = 0; i < n; ++i) ++hist[(keys[i] >> shift) & low];
    else
      for (int64_t j = 0; j < count; ++j) ++hist[(keys[boundary[j]] >> shift) & low];
    int64_t above = 0;
    uint32_t bin = low;
    while (above + hist[bin] < need) above += hist[bin--];
    need -= above;
    prefix |= bin << shift;
    mask |= low << shift;
    s.next.clear();
    if (first) {
      for (int64_t i = 0; i < n; ++i)
        if ((keys[i] & mask) == prefix) s.next.push_back(i);
    } else {
      for (int64_t j = 0; j < count; ++j)
        if ((keys[boundary[j]] & mask) == prefix) s.next.push_back(boundary[j]);
    }
    boundary.swap(s.next);
    first = false;
    hi = shift;
    if (need == static_cast<int64_t>(boundary.size())) break;  // the whole boundary bin is taken
  }
  // one ordered sweep: every key above the boundary, and the first `need` on it (ties: the lowest indices); written
  // without branches (about as many keys are taken as left, so a branch would be mispredicted often)
  out.resize(n);
  int64_t* o = out.data();
  int64_t taken = 0, ties = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = keys[i] & mask;
    const int64_t on = bits == prefix;
    o[taken] = i;
    taken += (bits > prefix) | (on & (ties < need));
    ties += on;
  }
  out.resize(taken);
}

// --- 2-bit index scan over a subset of channel quads ------------------------------------------------------------
// Per (sequence, KV head) the scan reads the codes of `quads` of the D_q / 4 channel quads only, chosen per call by
// sum_h |q_h| x (the channel's step, summed over the sampled groups): the channels that move the logits most. The
// other channels contribute each group's midpoint (min + 1.5 step) exactly, so a group's approximate logit of head
// h at token t is
//   l_h(t) = fma(A_h, acc_h(t), C_h),  acc_h(t) = sum over chosen channels of w8_c * code_c(t)  (exact integers),
//   A_h = scale * sigma_h,  C_h = scale * (q_h . mid - (1.5 sigma_h) * sum_c w8_c),
// with w = q_h (x) step over the chosen channels, sigma_h = max|w| / 127 and w8 = round(w / sigma_h). A position's
// score is max_h (l_h(t) - LZ_h), where LZ_h is head h's log-sum-exp over the sampled groups (every 16th): a
// head's approximate log-probability, so diffuse and peaked heads compare fairly. reference.py mirrors each step.
//
// Codes in memory (IndexTask): the 64-byte line of quad j of group g (codes.py's byte layout: 16 bytes per block of
// 16 tokens) lies at codes + j * quad_stride + g * group_stride. The selector stores every quad's lines of all groups
// one after another (group_stride 64), so the scan reads `quads` sequential streams instead of a quarter of the lines
// of each group's record, and the hardware prefetchers see plain streams.
//
// Variants: scalar and AVX2 (`vpmaddubsw`, 16-bit sums widened every WIDEN_EVERY quads) take each group's weights
// and dots as below; AVX-512 VNNI (`vpdpbusd`: 16 tokens x 4 channels x one head per instruction into 32-bit sums)
// has its own weights, dots and scores (section "AVX-512 VNNI scan"). Every variant computes the same integers and
// the same float operations in the same order, so the scores are identical.
constexpr int64_t SAMPLE_EVERY = 16;  // groups 0, 16, 32, ... estimate each head's softmax normalizer
constexpr int64_t WIDEN_EVERY = 32;   // quads accumulated in 16 bits before widening (|sum| <= 32 * 768 < 2^15)
constexpr int HEADS_PER_PASS = 4;     // query heads scanned per pass over a group's codes
constexpr int64_t PREFETCH_GROUPS = 4;  // groups whose codes and parameters are requested ahead
constexpr int64_t WEIGHT_BLOCK = 4;     // groups whose weights are computed before their dot products

struct IndexTask {  // one (sequence, KV head)'s index
  const uint8_t* codes;  // quad 0 of group 0
  int64_t quad_stride, group_stride;  // bytes
  const uint16_t* params;  // group g's [min | step] (2 * dim_q bf16) at params + g * 2 * dim_q
};

// acc[h * 64 + t] = sum over the chosen quads j of the 4 codes of token t in quad quads[j] times w8[h * K + 4j ..];
// qb[j] + goff is the group's line of chosen quad j
template <int G>
void scan_quads(const uint8_t* const* qb, int64_t goff, int64_t R, const int8_t* w8, int64_t K, int32_t* acc) {
#if defined(__AVX2__)
  const __m256i shift_lo = _mm256_set_epi32(2, 2, 2, 2, 0, 0, 0, 0);
  const __m256i shift_hi = _mm256_set_epi32(6, 6, 6, 6, 4, 4, 4, 4);
  const __m256i low2 = _mm256_set1_epi8(3), ones = _mm256_set1_epi16(1);
  for (int tb = 0; tb < 4; ++tb) {
    for (int64_t j0 = 0; j0 < R; j0 += WIDEN_EVERY) {
      __m256i lo[G], hi[G];  // 16-bit sums of code pairs; only these stay in registers through the quads
      for (int h = 0; h < G; ++h) lo[h] = hi[h] = _mm256_setzero_si256();
      const int64_t j1 = std::min(R, j0 + WIDEN_EVERY);
      for (int64_t j = j0; j < j1; ++j) {
        const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qb[j] + goff + tb * 16));
        const __m256i v = _mm256_broadcastsi128_si256(packed);
        const __m256i c0 = _mm256_and_si256(_mm256_srlv_epi32(v, shift_lo), low2);  // tokens 0..7 x 4 channels
        const __m256i c1 = _mm256_and_si256(_mm256_srlv_epi32(v, shift_hi), low2);  // tokens 8..15
        for (int h = 0; h < G; ++h) {
          int32_t w;
          std::memcpy(&w, w8 + h * K + 4 * j, 4);
          const __m256i wb = _mm256_set1_epi32(w);
          lo[h] = _mm256_add_epi16(lo[h], _mm256_maddubs_epi16(c0, wb));
          hi[h] = _mm256_add_epi16(hi[h], _mm256_maddubs_epi16(c1, wb));
        }
      }
      for (int h = 0; h < G; ++h) {  // widen to 32-bit token sums into acc
        __m256i* out_lo = reinterpret_cast<__m256i*>(acc + h * GROUP + tb * 16);
        __m256i* out_hi = out_lo + 1;
        const __m256i wide_lo = _mm256_madd_epi16(lo[h], ones), wide_hi = _mm256_madd_epi16(hi[h], ones);
        _mm256_storeu_si256(out_lo, j0 == 0 ? wide_lo : _mm256_add_epi32(_mm256_loadu_si256(out_lo), wide_lo));
        _mm256_storeu_si256(out_hi, j0 == 0 ? wide_hi : _mm256_add_epi32(_mm256_loadu_si256(out_hi), wide_hi));
      }
    }
  }
#else
  for (int h = 0; h < G; ++h)
    for (int t = 0; t < GROUP; ++t) acc[h * GROUP + t] = 0;
  for (int64_t j = 0; j < R; ++j)
    for (int tb = 0; tb < 4; ++tb) {
      const uint8_t* chunk = qb[j] + goff + tb * 16;
      for (int p = 0; p < 64; ++p) {  // element p = 16 i + k: bit pair i of byte k (codes.py)
        const int code = (chunk[p % 16] >> (2 * (p / 16))) & 3;
        const int t = tb * 16 + p / 4;
        for (int h = 0; h < G; ++h) acc[h * GROUP + t] += code * w8[h * K + 4 * j + p % 4];
      }
    }
#endif
}

#if defined(__AVX2__)
// scan_quads<4> with its inner loop written out: gcc keeps the eight 16-bit accumulators of the intrinsic version
// in registers only by copying each one after every add (and spills two), which costs more than the dot products;
// here the loop is the 25 instructions it needs. Same integers as scan_quads<4>.
void scan_quads4(const uint8_t* const* qb, int64_t goff, int64_t R, const int8_t* w8, int64_t K, int32_t* acc) {
  const __m256i shift_lo = _mm256_set_epi32(2, 2, 2, 2, 0, 0, 0, 0);
  const __m256i shift_hi = _mm256_set_epi32(6, 6, 6, 6, 4, 4, 4, 4);
  const __m256i low2 = _mm256_set1_epi8(3), ones = _mm256_set1_epi16(1);
  const int64_t stride = K, stride3 = 3 * K;  // bytes between heads' weights of one quad
  for (int tb = 0; tb < 4; ++tb) {
    for (int64_t j0 = 0; j0 < R; j0 += WIDEN_EVERY) {
      __m256i l0 = _mm256_setzero_si256(), h0 = l0, l1 = l0, h1 = l0, l2 = l0, h2 = l0, l3 = l0, h3 = l0;
      const int64_t j1 = std::min(R, j0 + WIDEN_EVERY);
      for (int64_t j = j0; j < j1; ++j) {
        const uint8_t* src = qb[j] + goff + tb * 16;
        const int8_t* w = w8 + 4 * j;
        __m256i c0, c1, wv, p;
        asm("vbroadcasti128 (%[src]), %[c0]\n\t"
            "vpsrlvd %[shi], %[c0], %[c1]\n\t"
            "vpsrlvd %[slo], %[c0], %[c0]\n\t"
            "vpand %[mask], %[c1], %[c1]\n\t"
            "vpand %[mask], %[c0], %[c0]\n\t"
            "vpbroadcastd (%[w]), %[wv]\n\t"
            "vpmaddubsw %[wv], %[c0], %[p]\n\t"
            "vpaddw %[p], %[l0], %[l0]\n\t"
            "vpmaddubsw %[wv], %[c1], %[p]\n\t"
            "vpaddw %[p], %[h0], %[h0]\n\t"
            "vpbroadcastd (%[w],%[stride]), %[wv]\n\t"
            "vpmaddubsw %[wv], %[c0], %[p]\n\t"
            "vpaddw %[p], %[l1], %[l1]\n\t"
            "vpmaddubsw %[wv], %[c1], %[p]\n\t"
            "vpaddw %[p], %[h1], %[h1]\n\t"
            "vpbroadcastd (%[w],%[stride],2), %[wv]\n\t"
            "vpmaddubsw %[wv], %[c0], %[p]\n\t"
            "vpaddw %[p], %[l2], %[l2]\n\t"
            "vpmaddubsw %[wv], %[c1], %[p]\n\t"
            "vpaddw %[p], %[h2], %[h2]\n\t"
            "vpbroadcastd (%[w],%[stride3]), %[wv]\n\t"
            "vpmaddubsw %[wv], %[c0], %[p]\n\t"
            "vpaddw %[p], %[l3], %[l3]\n\t"
            "vpmaddubsw %[wv], %[c1], %[p]\n\t"
            "vpaddw %[p], %[h3], %[h3]"
            : [l0] "+x"(l0), [h0] "+x"(h0), [l1] "+x"(l1), [h1] "+x"(h1), [l2] "+x"(l2), [h2] "+x"(h2),
              [l3] "+x"(l3), [h3] "+x"(h3), [c0] "=&x"(c0), [c1] "=&x"(c1), [wv] "=&x"(wv), [p] "=&x"(p)
            : [src] "r"(src), [w] "r"(w), [stride] "r"(stride), [stride3] "r"(stride3), [slo] "x"(shift_lo),
              [shi] "x"(shift_hi), [mask] "x"(low2)
            : "memory");
      }
      const __m256i lo[4] = {l0, l1, l2, l3}, hi[4] = {h0, h1, h2, h3};
      for (int h = 0; h < 4; ++h) {  // widen to 32-bit token sums into acc
        __m256i* out_lo = reinterpret_cast<__m256i*>(acc + h * GROUP + tb * 16);
        __m256i* out_hi = out_lo + 1;
        const __m256i wide_lo = _mm256_madd_epi16(lo[h], ones), wide_hi = _mm256_madd_epi16(hi[h], ones);
        _mm256_storeu_si256(out_lo, j0 == 0 ? wide_lo : _mm256_add_epi32(_mm256_loadu_si256(out_lo), wide_lo));
        _mm256_storeu_si256(out_hi, j0 == 0 ? wide_hi : _mm256_add_epi32(_mm256_loadu_si256(out_hi), wide_hi));
      }
    }
  }
}
#endif

#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
// acc (G x 64 int32, token order) of one group for G heads (w8: G rows of K bytes)
void scan_heads(int64_t g, const uint8_t* const* qb, int64_t goff, int64_t R, const int8_t* w8, int64_t K,
                int32_t* acc) {
  for (int64_t h0 = 0; h0 < g; h0 += HEADS_PER_PASS) {
    const int8_t* w = w8 + h0 * K;
    int32_t* a = acc + h0 * GROUP;
    switch (std::min<int64_t>(HEADS_PER_PASS, g - h0)) {
      case 1: scan_quads<1>(qb, goff, R, w, K, a); break;
      case 2: scan_quads<2>(qb, goff, R, w, K, a); break;
      case 3: scan_quads<3>(qb, goff, R, w, K, a); break;
#if defined(__AVX2__)
      default: scan_quads4(qb, goff, R, w, K, a); break;
#else
      default: scan_quads<4>(qb, goff, R, w, K, a); break;
#endif
    }
  }
}
#endif

// The chosen quads (ascending): the `R` of largest importance sum_{c in quad} (sum_h |q_hc|) * (sum over the
// sampled groups of step_c), ties to the lower quad.
void choose_quads(const Call& c, const float* q, const uint16_t* params, int64_t groups, int64_t R, Scratch& s) {
  const int64_t G = c.group, dq = c.dim_q, Q = dq / 4;
  s.steps.assign(dq, 0.0f);
  s.row_f.assign(dq, 0.0f);
  for (int64_t g = 0; g < groups; g += SAMPLE_EVERY) {
    bf16_row(params + g * 2 * dq + dq, dq, s.row_f.data());
    for (int64_t d = 0; d < dq; ++d) s.steps[d] += s.row_f[d];
  }
  s.importance.assign(Q, 0.0f);
  for (int64_t j = 0; j < Q; ++j) {
    float sum = 0.0f;
    for (int64_t d = 4 * j; d < 4 * j + 4; ++d) {
      float a = 0.0f;
      for (int64_t h = 0; h < G; ++h) a += std::fabs(q[h * c.dim_pad + d]);
      sum += a * s.steps[d];
    }
    s.importance[j] = sum;
  }
  s.quads.resize(Q);
  for (int64_t j = 0; j < Q; ++j) s.quads[j] = static_cast<int32_t>(j);
  const float* imp = s.importance.data();
  std::stable_sort(s.quads.begin(), s.quads.end(), [imp](int32_t a, int32_t b) { return imp[a] > imp[b]; });
  s.quads.resize(R);
  std::sort(s.quads.begin(), s.quads.end());
}

// Group g's weights: w8 (G rows of K int8, chosen order, zero past 4R), A[h], C[h] (see the top of this section).
// s.q_sel holds the queries at the chosen channels (G x K floats, K = 4R rounded up to 16, zero past 4R).
#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
#if defined(__AVX2__) && defined(__FMA__)
inline __m256 bf16x8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(
      reinterpret_cast<const __m128i*>(p))), 16));
}

// out[h] = q_h . (low + 1.5 step) for G heads, with mid rounded as in group_weights and each dot summed as dot_lanes
// (16 lanes of fma in channel order, the same tree), converting the bf16 parameters in registers; dq % 16 == 0
template <int G>
inline void mid_dots(const float* q, const uint16_t* low, const uint16_t* step, int64_t dq, int64_t dim_pad,
                     float* out) {
  __m256 lo[G], hi[G];
  for (int h = 0; h < G; ++h) lo[h] = hi[h] = _mm256_setzero_ps();
  const __m256 half3 = _mm256_set1_ps(1.5f);
  for (int64_t d = 0; d < dq; d += LANES) {
    const __m256 m0 = _mm256_add_ps(bf16x8(low + d), _mm256_mul_ps(half3, bf16x8(step + d)));
    const __m256 m1 = _mm256_add_ps(bf16x8(low + d + 8), _mm256_mul_ps(half3, bf16x8(step + d + 8)));
    for (int h = 0; h < G; ++h) {
      lo[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * dim_pad + d), m0, lo[h]);
      hi[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * dim_pad + d + 8), m1, hi[h]);
    }
  }
  for (int h = 0; h < G; ++h) out[h] = tree_sum8x2(lo[h], hi[h]);
}
#endif

void group_weights(const Call& c, const float* q, const uint16_t* params, int64_t g, int64_t R, Scratch& s,
                   int8_t* w8_rows, float* A, float* C) {
  const int64_t G = c.group, dq = c.dim_q, dim_pad = c.dim_pad, K = s.k_sel;
  const uint16_t* mins = params + g * 2 * dq;
  float* step_sel = s.step_sel.data();  // K floats, zero past 4R
  float* dmids = s.dmid.data();  // q_h . mid, each summed as dot_lanes
#if defined(__AVX2__) && defined(__FMA__)
  if (dq == dim_pad) {  // dq a multiple of 16: everything in registers
    for (int64_t j = 0; j < R; ++j) {
      const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(mins + dq + 4 * s.quads[j]));
      _mm_storeu_ps(step_sel + 4 * j, _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(v), 16)));
    }
    for (int64_t h0 = 0; h0 < G; h0 += 4) {
      const float* qh = q + h0 * dim_pad;
      switch (std::min<int64_t>(4, G - h0)) {
        case 1: mid_dots<1>(qh, mins, mins + dq, dq, dim_pad, dmids + h0); break;
        case 2: mid_dots<2>(qh, mins, mins + dq, dq, dim_pad, dmids + h0); break;
        case 3: mid_dots<3>(qh, mins, mins + dq, dq, dim_pad, dmids + h0); break;
        default: mid_dots<4>(qh, mins, mins + dq, dq, dim_pad, dmids + h0); break;
      }
    }
  } else
#endif
  {
    float* low = s.low.data();
    float* step = s.step.data();
    float* mid = s.mid.data();  // dim_pad floats, zero past dq
    bf16_row(mins, dq, low);
    bf16_row(mins + dq, dq, step);
    for (int64_t d = 0; d < dq; ++d) mid[d] = low[d] + 1.5f * step[d];
    for (int64_t j = 0; j < R; ++j) std::memcpy(step_sel + 4 * j, step + 4 * s.quads[j], 4 * sizeof(float));
    dots_dispatch(G, q, mid, dim_pad, 1.0f, dmids, 1);
  }
#if defined(__AVX2__)
  // in phases over the heads, so that the heads' reductions and divisions overlap instead of forming one chain
  float* tops = s.tops.data();
  float* sigmas = s.sigmas.data();
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t h = 0; h < G; ++h) {
    const float* qs = s.q_sel.data() + h * K;
    float* w = s.w.data() + h * K;
    __m256 peak = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
      const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(qs + k), _mm256_loadu_ps(step_sel + k));
      _mm256_storeu_ps(w + k, v);
      peak = _mm256_max_ps(peak, _mm256_and_ps(v, magnitude));
    }
    __m128 p4 = _mm_max_ps(_mm256_castps256_ps128(peak), _mm256_extractf128_ps(peak, 1));
    p4 = _mm_max_ps(p4, _mm_movehl_ps(p4, p4));
    tops[h] = _mm_cvtss_f32(_mm_max_ss(p4, _mm_shuffle_ps(p4, p4, 1)));  // max is exact in any order
  }
  for (int64_t h = 0; h < G; ++h) sigmas[h] = tops[h] / 127.0f;
  for (int64_t h = 0; h < G; ++h) {
    const float sigma = sigmas[h];
    const float* w = s.w.data() + h * K;
    int8_t* w8 = w8_rows + h * K;
    int32_t total = 0;
    if (sigma > 0.0f) {
      const __m256 inv = _mm256_set1_ps(1.0f / sigma);
      __m256i sum = _mm256_setzero_si256();
      for (int64_t k = 0; k < K; k += 8) {
        const __m256i r = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(w + k), inv));  // round to nearest even
        sum = _mm256_add_epi32(sum, r);
        const __m128i p16 = _mm_packs_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(w8 + k), _mm_packs_epi16(p16, p16));
      }
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
      total = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1))));  // zero past 4R
    } else {
      std::memset(w8, 0, 4 * R);
    }
    A[h] = c.scaling * sigma;
    C[h] = c.scaling * (dmids[h] - (1.5f * sigma) * static_cast<float>(total));
  }
#else
  for (int64_t h = 0; h < G; ++h) {
    const float* qs = s.q_sel.data() + h * K;
    float* w = s.w.data();
    int8_t* w8 = w8_rows + h * K;
    float top = 0.0f;
    int32_t total = 0;
    for (int64_t k = 0; k < 4 * R; ++k) {
      const float v = qs[k] * step_sel[k];
      w[k] = v;
      const float a = std::fabs(v);
      top = top > a ? top : a;
    }
    const float sigma = top / 127.0f;
    if (sigma > 0.0f) {
      const float inv = 1.0f / sigma;
      for (int64_t k = 0; k < 4 * R; ++k) {
        const int32_t v = static_cast<int32_t>(std::nearbyint(w[k] * inv));
        w8[k] = static_cast<int8_t>(v);
        total += v;
      }
    } else {
      std::memset(w8, 0, 4 * R);
    }
    A[h] = c.scaling * sigma;
    C[h] = c.scaling * (dmids[h] - (1.5f * sigma) * static_cast<float>(total));
  }
#endif
}

// out[t] = max_h fma(A[h], acc[h * 64 + t], B[h]) where the mask m[t] is set, -inf elsewhere (t < 64)
void group_scores(int64_t G, const int32_t* acc, const float* A, const float* B, const uint8_t* m, float* out) {
#if defined(__AVX2__) && defined(__FMA__)
  for (int64_t t = 0; t < GROUP; t += 8) {
    __m256 best = _mm256_set1_ps(-INFINITY);
    for (int64_t h = 0; h < G; ++h) {
      const __m256 a = _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + h * GROUP + t)));
      best = _mm256_max_ps(best, _mm256_fmadd_ps(_mm256_set1_ps(A[h]), a, _mm256_set1_ps(B[h])));
    }
    const __m256i keep = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(m + t)));
    const __m256 hit = _mm256_castsi256_ps(_mm256_cmpgt_epi32(keep, _mm256_setzero_si256()));
    _mm256_storeu_ps(out + t, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), best, hit));
  }
#else
  for (int64_t t = 0; t < GROUP; ++t) {
    float best = -INFINITY;
    for (int64_t h = 0; h < G; ++h) {
      const float v = std::fma(A[h], static_cast<float>(acc[h * GROUP + t]), B[h]);
      best = best > v ? best : v;
    }
    out[t] = m[t] ? best : -INFINITY;
  }
#endif
}

void block_weights(const Call& c, const float* q, const uint16_t* params, const int64_t* gs, int64_t count,
                   Scratch& s, int8_t* const* w8, float* A, float* C) {
  for (int64_t i = 0; i < count; ++i)
    group_weights(c, q, params, gs[i], std::max<int64_t>(1, std::min(c.quads, c.dim_q / 4)), s, w8[i], A + i * c.group,
                  C + i * c.group);
}
#endif  // not the VNNI variant

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// --- AVX-512 VNNI scan --------------------------------------------------------------------------------------
// A quad's 64-byte line holds the 2-bit codes of the group's 64 tokens x 4 channels: block tb (tokens 16 tb ...) in
// bytes 16 tb .. 16 tb + 15, bit pair i of byte k = token 16 tb + 4 i + k / 4, channel k % 4 (codes.py). The line
// masked with 3 << 2i is a u8 operand of 4^i x the codes of the tokens 16 tb + 4 i + w at dword 4 tb + w, so one
// vpdpbusd per (head, bit pair i) adds 4^i x the dot of 16 tokens with the quad's 4 int8 weights: one load and four
// ANDs per quad, 4 G dot instructions, 32-bit sums (no widening). The sums are exact integers; a shift right by 2i
// restores the dot. Token order inside the sums ("bit-pair order"): sum i, dword 4 tb + w = token 16 tb + 4 i + w;
// scores are transposed back to token order once per group.

// acc[h * 64 + 16 i + 4 tb + w] = dot of token 16 tb + 4 i + w (bit-pair order) for heads h < G of this pass
template <int G>
inline void vnni_quads(const uint8_t* const* qb, int64_t goff, int64_t R, const int8_t* w8, int64_t K, int32_t* acc) {
  const __m512i m0 = _mm512_set1_epi8(0x03), m1 = _mm512_set1_epi8(0x0C), m2 = _mm512_set1_epi8(0x30),
                m3 = _mm512_set1_epi8(static_cast<char>(0xC0));
  __m512i a[G][4];
  for (int h = 0; h < G; ++h)
    for (int i = 0; i < 4; ++i) a[h][i] = _mm512_setzero_si512();
  for (int64_t j = 0; j < R; ++j) {
    const __m512i line = _mm512_loadu_si512(qb[j] + goff);
    const __m512i c0 = _mm512_and_si512(line, m0), c1 = _mm512_and_si512(line, m1);
    const __m512i c2 = _mm512_and_si512(line, m2), c3 = _mm512_and_si512(line, m3);
    for (int h = 0; h < G; ++h) {
      int32_t wv;
      std::memcpy(&wv, w8 + h * K + 4 * j, 4);
      const __m512i w = _mm512_set1_epi32(wv);
      a[h][0] = _mm512_dpbusd_epi32(a[h][0], c0, w);
      a[h][1] = _mm512_dpbusd_epi32(a[h][1], c1, w);
      a[h][2] = _mm512_dpbusd_epi32(a[h][2], c2, w);
      a[h][3] = _mm512_dpbusd_epi32(a[h][3], c3, w);
    }
  }
  for (int h = 0; h < G; ++h) {  // exact: sum i is a multiple of 4^i
    _mm512_storeu_si512(acc + h * GROUP, a[h][0]);
    _mm512_storeu_si512(acc + h * GROUP + 16, _mm512_srai_epi32(a[h][1], 2));
    _mm512_storeu_si512(acc + h * GROUP + 32, _mm512_srai_epi32(a[h][2], 4));
    _mm512_storeu_si512(acc + h * GROUP + 48, _mm512_srai_epi32(a[h][3], 6));
  }
}

// acc (G x 64 int32, bit-pair order) of one group for G heads (w8: G rows of K bytes)
void scan_heads(int64_t g, const uint8_t* const* qb, int64_t goff, int64_t R, const int8_t* w8, int64_t K,
                int32_t* acc) {
  for (int64_t h0 = 0; h0 < g; h0 += HEADS_PER_PASS) {
    const int8_t* w = w8 + h0 * K;
    int32_t* a = acc + h0 * GROUP;
    switch (std::min<int64_t>(HEADS_PER_PASS, g - h0)) {
      case 1: vnni_quads<1>(qb, goff, R, w, K, a); break;
      case 2: vnni_quads<2>(qb, goff, R, w, K, a); break;
      case 3: vnni_quads<3>(qb, goff, R, w, K, a); break;
      default: vnni_quads<4>(qb, goff, R, w, K, a); break;
    }
  }
}

// the 16-lane bf16 -> float32 of 16 parameters (lanes at or past n: zero)
inline __m512 bf16x16(const uint16_t* p, int64_t n) {
  const __mmask16 m = n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// tree_sum16 of four vectors at once (the same additions): out[k] = tree_sum16(v[k])
inline __m128 tree_sum16x4(__m512 v0, __m512 v1, __m512 v2, __m512 v3) {
  // lanes j + j+8: quarters 0 + 2 and 1 + 3 of each vector
  const __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(v0, v1, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(v2, v3, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(v2, v3, _MM_SHUFFLE(3, 2, 3, 2)));
  // j + j+4: quarter k of y holds vector k's four partial sums
  const __m512 y = _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(x01, x23, _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 z = _mm512_add_ps(y, _mm512_permute_ps(y, _MM_SHUFFLE(1, 0, 3, 2)));  // j + j+2
  const __m512 f = _mm512_add_ps(z, _mm512_permute_ps(z, _MM_SHUFFLE(2, 3, 0, 1)));  // 0 + 1
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0), f));
}

// the largest lane of each of four vectors (exact in any order): out[k] = max over v[k]
inline __m128 max16x4(__m512 v0, __m512 v1, __m512 v2, __m512 v3) {
  const __m512 x01 = _mm512_max_ps(_mm512_shuffle_f32x4(v0, v1, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(v0, v1, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 x23 = _mm512_max_ps(_mm512_shuffle_f32x4(v2, v3, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(v2, v3, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 y = _mm512_max_ps(_mm512_shuffle_f32x4(x01, x23, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(x01, x23, _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 z = _mm512_max_ps(y, _mm512_permute_ps(y, _MM_SHUFFLE(1, 0, 3, 2)));
  const __m512 f = _mm512_max_ps(z, _mm512_permute_ps(z, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0), f));
}

// the sum of each of four int32 vectors
inline __m128i sum16x4(__m512i v0, __m512i v1, __m512i v2, __m512i v3) {
  const __m512i x01 = _mm512_add_epi32(_mm512_shuffle_i32x4(v0, v1, _MM_SHUFFLE(1, 0, 1, 0)),
                                       _mm512_shuffle_i32x4(v0, v1, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512i x23 = _mm512_add_epi32(_mm512_shuffle_i32x4(v2, v3, _MM_SHUFFLE(1, 0, 1, 0)),
                                       _mm512_shuffle_i32x4(v2, v3, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512i y = _mm512_add_epi32(_mm512_shuffle_i32x4(x01, x23, _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_i32x4(x01, x23, _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i z = _mm512_add_epi32(y, _mm512_shuffle_epi32(y, _MM_PERM_BADC));
  const __m512i f = _mm512_add_epi32(z, _mm512_shuffle_epi32(z, _MM_PERM_CDAB));
  return _mm512_castsi512_si128(_mm512_permutexvar_epi32(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0), f));
}

// The weights of NG groups for four heads (q: 4 rows of dim_pad, q_sel: 4 rows of K, both zero past the call's
// heads): per group i, w8[i] (4 rows of K), A[i][0..3], C[i][0..3], with the arithmetic of the scalar group_weights
// (mid = low + 1.5 step rounded per channel; q . mid summed as dot_lanes; w = q_sel * step_sel; sigma = max|w| / 127;
// w8 = round-to-nearest-even(w * (1 / sigma)), 0 where sigma is 0; the sums of w8 exact), the four heads' reductions
// side by side and the NG groups' chains of reductions and divisions interleaved (each is mostly latency). NB: K / 16
// (16-channel blocks of the chosen quads' channels) when a compile-time constant, 0 otherwise.
template <int NB, int NG>
void weights4(const Call& c, const float* q, const float* q_sel, const uint16_t* const* mins,
              const int32_t* step_offset, const uint8_t* step_mask, int64_t K, int8_t* const* w8, float* const* A,
              float* const* C) {
  constexpr int MAXB = NB > 0 ? NB : 16;  // K <= 256: head dims up to 256
  const int64_t nb = NB > 0 ? NB : K / LANES, dq = c.dim_q, dim_pad = c.dim_pad;
  const __m512 half3 = _mm512_set1_ps(1.5f);
  __m512 acc[NG][4];
  for (int i = 0; i < NG; ++i)
    for (int h = 0; h < 4; ++h) acc[i][h] = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim_pad; d += LANES) {  // q . mid, lanes as dot_lanes (zero past dq)
    const __m512 q0 = _mm512_loadu_ps(q + d), q1 = _mm512_loadu_ps(q + dim_pad + d);
    const __m512 q2 = _mm512_loadu_ps(q + 2 * dim_pad + d), q3 = _mm512_loadu_ps(q + 3 * dim_pad + d);
    for (int i = 0; i < NG; ++i) {
      const __m512 mid = _mm512_add_ps(bf16x16(mins[i] + d, dq - d), _mm512_mul_ps(half3, bf16x16(mins[i] + dq + d, dq - d)));
      acc[i][0] = _mm512_fmadd_ps(q0, mid, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(q1, mid, acc[i][1]);
      acc[i][2] = _mm512_fmadd_ps(q2, mid, acc[i][2]);
      acc[i][3] = _mm512_fmadd_ps(q3, mid, acc[i][3]);
    }
  }
  __m128 dmid[NG];
  for (int i = 0; i < NG; ++i) dmid[i] = tree_sum16x4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
  // w = q_sel * step_sel: 16 channels (4 chosen quads) per vector
  __m512 w[NG][4][MAXB];
  __m512 peak[NG][4];
  for (int i = 0; i < NG; ++i)
    for (int h = 0; h < 4; ++h) peak[i][h] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    for (int i = 0; i < NG; ++i) {
      const char* base = reinterpret_cast<const char*>(mins[i] + dq);
      int64_t lane[4];  // the 4 steps of each of 4 chosen quads (offset 0 past the chosen ones: masked off below)
      for (int k = 0; k < 4; ++k) std::memcpy(&lane[k], base + step_offset[4 * b + k], 8);
      const __m256i picked = _mm256_maskz_mov_epi64(step_mask[b], _mm256_set_epi64x(lane[3], lane[2], lane[1], lane[0]));
      const __m512 step = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(picked), 16));
      for (int h = 0; h < 4; ++h) {
        w[i][h][b] = _mm512_mul_ps(_mm512_loadu_ps(q_sel + h * K + b * LANES), step);
        peak[i][h] = _mm512_max_ps(peak[i][h], _mm512_abs_ps(w[i][h][b]));
      }
    }
  }
  __m128 sigma[NG];
  alignas(16) float inv[NG][4];
  unsigned positive[NG];
  for (int i = 0; i < NG; ++i) {
    sigma[i] = _mm_div_ps(max16x4(peak[i][0], peak[i][1], peak[i][2], peak[i][3]), _mm_set1_ps(127.0f));
    _mm_store_ps(inv[i], _mm_div_ps(_mm_set1_ps(1.0f), sigma[i]));
    positive[i] = _mm_cmp_ps_mask(sigma[i], _mm_setzero_ps(), _CMP_GT_OQ);
  }
  for (int i = 0; i < NG; ++i) {
    __m512i sum[4];
    for (int h = 0; h < 4; ++h) {
      const __mmask16 live = static_cast<__mmask16>(0u - (positive[i] >> h & 1u));  // sigma 0: w8 = 0
      const __m512 scale = _mm512_set1_ps(inv[i][h]);
      sum[h] = _mm512_setzero_si512();
      for (int64_t b = 0; b < nb; ++b) {
        const __m512i r = _mm512_maskz_cvtps_epi32(live, _mm512_mul_ps(w[i][h][b], scale));  // round to nearest even
        sum[h] = _mm512_add_epi32(sum[h], r);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(w8[i] + h * K + b * LANES), _mm512_cvtepi32_epi8(r));  // |r| <= 127
      }
    }
    const __m128 total = _mm_cvtepi32_ps(sum16x4(sum[0], sum[1], sum[2], sum[3]));
    const __m128 scaling = _mm_set1_ps(c.scaling);
    _mm_storeu_ps(A[i], _mm_mul_ps(scaling, sigma[i]));
    _mm_storeu_ps(C[i], _mm_mul_ps(scaling, _mm_sub_ps(dmid[i], _mm_mul_ps(_mm_mul_ps(_mm_set1_ps(1.5f), sigma[i]), total))));
  }
}

template <int NG>
void weights_dispatch(const Call& c, const float* q, const float* q_sel, const uint16_t* const* mins, Scratch& s,
                      int8_t* const* w8, float* const* A, float* const* C) {
  const int64_t K = s.k_sel;
  const int32_t* offsets = s.step_offset.data();
  const uint8_t* masks = s.step_mask.data();
  switch (K / LANES) {
    case 1: weights4<1, NG>(c, q, q_sel, mins, offsets, masks, K, w8, A, C); break;
    case 2: weights4<2, NG>(c, q, q_sel, mins, offsets, masks, K, w8, A, C); break;
    case 3: weights4<3, NG>(c, q, q_sel, mins, offsets, masks, K, w8, A, C); break;
    case 4: weights4<4, NG>(c, q, q_sel, mins, offsets, masks, K, w8, A, C); break;
    default: weights4<0, NG>(c, q, q_sel, mins, offsets, masks, K, w8, A, C); break;
  }
}

// The weights of `count` groups gs[0 ..]: w8[i] (G rows of K), A[i * G + h], C[i * G + h] (s.q and s.q_sel hold
// the heads rounded up to a multiple of 4, zero past G), groups two at a time
void block_weights(const Call& c, const float* q, const uint16_t* params, const int64_t* gs, int64_t count,
                   Scratch& s, int8_t* const* w8, float* A, float* C) {
  const int64_t G = c.group, K = s.k_sel;
  for (int64_t h0 = 0; h0 < G; h0 += 4) {
    const int64_t n = std::min<int64_t>(4, G - h0);
    const float* qh = q + h0 * c.dim_pad;
    const float* qs = s.q_sel.data() + h0 * K;
    for (int64_t i0 = 0; i0 < count; i0 += 2) {
      const int ng = count - i0 >= 2 ? 2 : 1;
      const uint16_t* mins[2];
      int8_t* rows[2];
      float a[2][4], cc[2][4];
      float* ap[2] = {a[0], a[1]};
      float* cp[2] = {cc[0], cc[1]};
      for (int i = 0; i < ng; ++i) {
        mins[i] = params + gs[i0 + i] * 2 * c.dim_q;
        rows[i] = n == 4 ? w8[i0 + i] + h0 * K : s.w8_spare.data() + i * 4 * K;  // a partial set of heads: a spare
      }
      if (ng == 2) weights_dispatch<2>(c, qh, qs, mins, s, rows, ap, cp);
      else weights_dispatch<1>(c, qh, qs, mins, s, rows, ap, cp);
      for (int i = 0; i < ng; ++i) {
        if (n < 4) std::memcpy(w8[i0 + i] + h0 * K, rows[i], n * K);
        for (int64_t h = 0; h < n; ++h) {
          A[(i0 + i) * G + h0 + h] = a[i][h];
          C[(i0 + i) * G + h0 + h] = cc[i][h];
        }
      }
    }
  }
}

// out[t] = max_h fma(A[h], acc[h][t], B[h]) where the mask m[t] is set, -inf elsewhere (t < 64; acc in bit-pair
// order, out in token order; the heads in order, as the scalar group_scores)
void group_scores(int64_t G, const int32_t* acc, const float* A, const float* B, const uint8_t* m, float* out) {
  __m512 best[4];
  for (int i = 0; i < 4; ++i) best[i] = _mm512_set1_ps(-INFINITY);
  for (int64_t h = 0; h < G; ++h) {
    const __m512 a = _mm512_set1_ps(A[h]), b = _mm512_set1_ps(B[h]);
    for (int i = 0; i < 4; ++i) {
      const __m512 v = _mm512_cvtepi32_ps(_mm512_loadu_si512(acc + h * GROUP + 16 * i));
      best[i] = _mm512_max_ps(best[i], _mm512_fmadd_ps(a, v, b));
    }
  }
  // bit-pair order -> token order: block tb = quarter tb of best[0 .. 3]
  const __m512 t0 = _mm512_shuffle_f32x4(best[0], best[1], _MM_SHUFFLE(1, 0, 1, 0));
  const __m512 t1 = _mm512_shuffle_f32x4(best[2], best[3], _MM_SHUFFLE(1, 0, 1, 0));
  const __m512 t2 = _mm512_shuffle_f32x4(best[0], best[1], _MM_SHUFFLE(3, 2, 3, 2));
  const __m512 t3 = _mm512_shuffle_f32x4(best[2], best[3], _MM_SHUFFLE(3, 2, 3, 2));
  const __m512 blocks[4] = {_mm512_shuffle_f32x4(t0, t1, _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_f32x4(t0, t1, _MM_SHUFFLE(3, 1, 3, 1)),
                            _mm512_shuffle_f32x4(t2, t3, _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_f32x4(t2, t3, _MM_SHUFFLE(3, 1, 3, 1))};
  const __m512i bytes = _mm512_loadu_si512(m);
  const __mmask64 keep = _mm512_test_epi8_mask(bytes, bytes);
  const __m512 none = _mm512_set1_ps(-INFINITY);
  for (int tb = 0; tb < 4; ++tb)
    _mm512_storeu_ps(out + 16 * tb, _mm512_mask_blend_ps(static_cast<__mmask16>(keep >> (16 * tb)), none, blocks[tb]));
}
#endif  // the VNNI variant

// the chosen quads' lines and the parameters of group g, requested ahead of the scan
inline void prefetch_group(const IndexTask& ix, const uint8_t* const* qb, int64_t R, int64_t dq, int64_t g) {
  const int64_t goff = g * ix.group_stride;
  for (int64_t j = 0; j < R; ++j) __builtin_prefetch(qb[j] + goff);
  const char* p = reinterpret_cast<const char*>(ix.params + g * 2 * dq);
  for (int64_t off = 0; off < 2 * dq * 2; off += 64) __builtin_prefetch(p + off);
}

// score[i] for the covered positions i = position - group_first of groups [g_lo, g_hi) (m: the mask from
// group_first on). The sampled groups (each head's normalizer) are scanned whatever the range, so every range's
// scores are those of a scan of all groups.
void scan_index(const Call& c, const IndexTask& ix, const float* q, int64_t groups, const uint8_t* m, Scratch& s,
                Clock& clock, int64_t g_lo, int64_t g_hi, float* score) {
  const int64_t G = c.group, dq = c.dim_q, Q = dq / 4;
  const int64_t R = std::max<int64_t>(1, std::min(c.quads, Q));
  const uint16_t* params = ix.params;
  choose_quads(c, q, params, groups, R, s);
  s.quad_base.resize(R);
  for (int64_t j = 0; j < R; ++j) s.quad_base[j] = ix.codes + s.quads[j] * ix.quad_stride;
  const uint8_t* const* qb = s.quad_base.data();
  s.low.assign(dq, 0.0f);
  s.step.assign(dq, 0.0f);
  s.mid.assign(c.dim_pad, 0.0f);
  const int64_t K = s.k_sel = (4 * R + LANES - 1) / LANES * LANES;
  s.q_sel.assign((G + 3) / 4 * 4 * K, 0.0f);  // rows past G: zero (the VNNI weights take heads by four)
  for (int64_t h = 0; h < G; ++h)
    for (int64_t j = 0; j < R; ++j)
      std::memcpy(&s.q_sel[h * K + 4 * j], q + h * c.dim_pad + 4 * s.quads[j], 4 * sizeof(float));
  s.step_sel.assign(K, 0.0f);
  s.step_offset.assign(K / 4, 0);  // byte offset of each chosen quad's 4 steps (the VNNI weights gather them)
  s.step_mask.assign(K / LANES, 0);
  for (int64_t j = 0; j < R; ++j) {
    s.step_offset[j] = s.quads[j] * 4 * 2;
    s.step_mask[j / 4] |= static_cast<uint8_t>(1u << (j % 4));
  }
  s.dmid.resize(G);
  s.w.assign(std::max<int64_t>(G, 4) * K, 0.0f);
  s.tops.resize(G);
  s.sigmas.resize(G);
  s.w8.assign(WEIGHT_BLOCK * G * K, 0);
  s.w8_spare.assign(2 * 4 * K, 0);
  // sampled groups: their integer sums, A and C are kept for the main pass
  const int64_t sampled = (groups + SAMPLE_EVERY - 1) / SAMPLE_EVERY;
  s.sample_acc.resize(sampled * G * GROUP);
  s.sample_a.resize(sampled * G);
  s.sample_c.resize(sampled * G);
  s.logits.resize(sampled * G * GROUP);  // l_h(t), head-major: [h][sample][t]
  clock.mark(SCAN_SETUP);
  for (int64_t i = 0; i < sampled; ++i) {
    const int64_t g = i * SAMPLE_EVERY;
    if (i + PREFETCH_GROUPS < sampled) prefetch_group(ix, qb, R, dq, g + PREFETCH_GROUPS * SAMPLE_EVERY);
    float* A = &s.sample_a[i * G];
    float* C = &s.sample_c[i * G];
    int8_t* w8_rows = s.w8.data();
    block_weights(c, q, params, &g, 1, s, &w8_rows, A, C);
    int32_t* acc = &s.sample_acc[i * G * GROUP];
    scan_heads(G, qb, g * ix.group_stride, R, s.w8.data(), K, acc);
    for (int64_t h = 0; h < G; ++h)
      group_scores(1, acc + h * GROUP, A + h, C + h, m + g * GROUP, &s.logits[(h * sampled + i) * GROUP]);
  }
  s.offset.resize(G);  // LZ_h
  for (int64_t h = 0; h < G; ++h) {
    float* l = &s.logits[h * sampled * GROUP];
    const int64_t n = sampled * GROUP;
    const float peak = max_lanes(l, n);
    if (!(peak > -INFINITY)) {
      s.offset[h] = 0.0f;
      continue;
    }
    for (int64_t i = 0; i < n; ++i) l[i] -= peak;
    exp_nonpositive(l, n);
    s.offset[h] = peak + static_cast<float>(std::log(static_cast<double>(sum_lanes(l, n))));
  }
  clock.mark(SCAN_SAMPLE);
  s.acc.resize(G * GROUP);
  s.a_buf.resize(WEIGHT_BLOCK * G);
  s.b_buf.resize(WEIGHT_BLOCK * G);
  s.wa.resize(WEIGHT_BLOCK * G);
  s.wc.resize(WEIGHT_BLOCK * G);
  for (int64_t g0 = g_lo; g0 < g_hi; g0 += WEIGHT_BLOCK) {
    const int64_t g1 = std::min(g_hi, g0 + WEIGHT_BLOCK);
    // the block's weights first (independent chains of divisions and reductions, overlapped by the CPU), then its
    // dot products and scores
    int64_t gs[WEIGHT_BLOCK];
    int8_t* rows[WEIGHT_BLOCK];
    int64_t count = 0;
    for (int64_t g = g0; g < g1; ++g) {
      float* A = &s.a_buf[(g - g0) * G];
      float* B = &s.b_buf[(g - g0) * G];
      if (g % SAMPLE_EVERY == 0) {
        const int64_t i = g / SAMPLE_EVERY;
        for (int64_t h = 0; h < G; ++h) {
          A[h] = s.sample_a[i * G + h];
          B[h] = s.sample_c[i * G + h] - s.offset[h];
        }
      } else {
        gs[count] = g;
        rows[count++] = &s.w8[(g - g0) * G * K];
      }
    }
    block_weights(c, q, params, gs, count, s, rows, s.wa.data(), s.wc.data());
    for (int64_t i = 0; i < count; ++i)
      for (int64_t h = 0; h < G; ++h) {
        s.a_buf[(gs[i] - g0) * G + h] = s.wa[i * G + h];
        s.b_buf[(gs[i] - g0) * G + h] = s.wc[i * G + h] - s.offset[h];
      }
    for (int64_t g = g0; g < g1; ++g) {
      if (g + PREFETCH_GROUPS < g_hi) prefetch_group(ix, qb, R, dq, g + PREFETCH_GROUPS);
      if (s.pending.next < s.pending.n) issue_pending(c, s.pending, g_hi - g);
      const int32_t* acc;
      if (g % SAMPLE_EVERY == 0) {
        acc = &s.sample_acc[g / SAMPLE_EVERY * G * GROUP];
      } else {
        scan_heads(G, qb, g * ix.group_stride, R, &s.w8[(g - g0) * G * K], K, s.acc.data());
        acc = s.acc.data();
      }
      group_scores(G, acc, &s.a_buf[(g - g0) * G], &s.b_buf[(g - g0) * G], m + g * GROUP, score + g * GROUP);
    }
  }
  clock.mark(SCAN_MAIN);
}


// --- one (sequence, KV head) -------------------------------------------------------------------------------
// prefetch rows [from, min(n, from + count)) (addresses ptr[], positions pos[]) that do not follow the previous row
// (scattered rows; a run of consecutive rows is left to the hardware prefetcher), into L1 (near) or L2
template <bool NEAR>
inline void prefetch_rows(const char* const* ptr, const int64_t* pos, int64_t n, int64_t from, int64_t count,
                          int64_t row_bytes) {
  for (int64_t r = std::max<int64_t>(from, 1); r < std::min(n, from + count); ++r)
    if (pos[r] != pos[r - 1] + 1) prefetch_row(ptr[r], row_bytes, NEAR);
}

// the task's query rows and chunk addresses
void begin_task(const Call& c, int64_t task, Slot& sl) {
  const int64_t b = task / c.kv_heads, head = task % c.kv_heads, G = c.group, seq = c.rows[b];
  sl.task = task;
  sl.q.assign((G + 3) / 4 * 4 * c.dim_pad, 0.0f);  // rows past G: zero (the VNNI weights take heads by four)
  for (int64_t h = 0; h < G; ++h)
    std::memcpy(&sl.q[h * c.dim_pad], c.query + (task * G + h) * c.dim, c.dim * 4);
  sl.key_seg.resize(c.n_segs);
  sl.value_seg.resize(c.n_segs);
  for (int64_t i = 0; i < c.n_segs; ++i) {
    const int64_t* seg = c.segs + i * SEG_FIELDS;
    sl.key_seg[i] = reinterpret_cast<const char*>(seg[KEY_BASE] + seq * seg[KEY_SEQ_STRIDE] + head * seg[KEY_HEAD_STRIDE]);
    sl.value_seg[i] = reinterpret_cast<const char*>(seg[VALUE_BASE] + seq * seg[VALUE_SEQ_STRIDE] +
                                                    head * seg[VALUE_HEAD_STRIDE]);
  }
}

// the part of a task's candidates its index covers: groups [0, groups) from position first (none without an index)
struct TaskIndex {
  int64_t first = 0, groups = 0;
  IndexTask ix{};
  const uint8_t* m = nullptr;  // the mask from first on
};

TaskIndex task_index(const Call& c, int64_t task) {
  const int64_t b = task / c.kv_heads, head = task % c.kv_heads, end = c.end, seq = c.rows[b];
  TaskIndex ti;
  const bool scan = c.index && !pooled(c, task);  // a pooled task reads no code
  ti.first = scan ? c.group_first[seq] : end;  // the groups lying wholly below end:
  ti.groups = scan ? std::min(c.n_groups[seq], end > ti.first ? (end - ti.first) / GROUP : 0) : 0;
  if (ti.groups > 0) {
    const int64_t* x = c.index;
    ti.ix = IndexTask{reinterpret_cast<const uint8_t*>(x[CODES_BASE] + seq * x[CODES_SEQ_STRIDE] +
                                                       head * x[CODES_HEAD_STRIDE]),
                      x[CODES_QUAD_STRIDE], x[CODES_GROUP_STRIDE],
                      reinterpret_cast<const uint16_t*>(x[PARAMS_BASE] + seq * x[PARAMS_SEQ_STRIDE] +
                                                        head * x[PARAMS_HEAD_STRIDE])};
    ti.m = c.mask + b * end + ti.first;
  }
  return ti;
}

// the positions the exact stage rescores, ascending, into sl.positions: the `shortlist` best of the scan's scores
// (score[i]: position first + i) and the candidates the index does not cover, or every candidate without an index
void collect_positions(const Call& c, Slot& sl, const TaskIndex& ti, const float* score, Scratch& s, Clock& clock) {
  const int64_t end = c.end;
  const uint8_t* mask = c.mask + sl.task / c.kv_heads * end;
  std::vector<int64_t>& positions = sl.positions;
  positions.clear();
  if (pooled(c, sl.task)) {  // the pool's positions (ascending, below its end), then every fresh candidate
    const int64_t at = pool_of(c, sl.task), fresh = std::max<int64_t>(0, pool_array<int64_t>(c, POOL_FRESH)[at]);
    const int64_t* pool = pool_array<int64_t>(c, POOL_POSITIONS) + at * c.pool[POOL_SLOTS];
    for (int64_t i = 0; i < pool_array<int64_t>(c, POOL_COUNTS)[at]; ++i)
      if (pool[i] < std::min(fresh, end) && mask[pool[i]]) positions.push_back(pool[i]);
    for (int64_t p = fresh; p < end; ++p)
      if (mask[p]) positions.push_back(p);
    clock.mark(SHORTLIST);
  } else if (ti.groups > 0) {
    const int64_t covered = ti.groups * GROUP, covered_end = ti.first + covered;
    for (int64_t p = 0; p < std::min(ti.first, end); ++p)
      if (mask[p]) positions.push_back(p);
    int64_t usable = 0;  // mask bytes are 0 or 1: each 8-byte word's bit count is its count of selectable positions
    int64_t i = 0;
    for (; i + 8 <= covered; i += 8) {
      uint64_t word;
      std::memcpy(&word, ti.m + i, 8);
      usable += __builtin_popcountll(word);
    }
    for (; i < covered; ++i) usable += ti.m[i] != 0;
    top_m(score, covered, std::min(c.shortlist, usable), s, s.chosen);  // ascending
    for (int64_t k : s.chosen) positions.push_back(ti.first + k);
    for (int64_t p = covered_end; p < end; ++p)
      if (mask[p]) positions.push_back(p);
    clock.mark(SHORTLIST);
  } else {
    for (int64_t p = 0; p < end; ++p)
      if (mask[p]) positions.push_back(p);
  }
}

// scan and shortlist of one task on one worker
void shortlist_task(const Call& c, Slot& sl, Scratch& s, Clock& clock) {
  const TaskIndex ti = task_index(c, sl.task);
  if (ti.groups > 0) {
    s.score.resize(ti.groups * GROUP);
    scan_index(c, ti.ix, sl.q.data(), ti.groups, ti.m, s, clock, 0, ti.groups, s.score.data());
  }
  collect_positions(c, sl, ti, s.score.data(), s, clock);
}

// float32 logits[h * n + r] of rows [r_lo, r_hi) of `positions` (n of them; keys: the task's key chunks), read in
// position order, the scattered ones requested ahead (those a scan requested already come from cache)
void exact_logits(const Call& c, const std::vector<int64_t>& positions, const char* const* keys, const float* q,
                  int64_t r_lo, int64_t r_hi, float* logits, Scratch& s) {
  const int64_t G = c.group, n = static_cast<int64_t>(positions.size());
  s.row.assign(c.dim_pad, 0.0f);
  const int64_t row_bytes = c.dim * (c.key_type == F32 ? 4 : 2);
  const int64_t block = 16 % G == 0 && G <= 4 ? 16 / G : 0;  // rows per SIMD block (0: row by row)
  s.row_ptr.resize(n);
  const char** ptr = s.row_ptr.data();
  const int64_t* pos = positions.data();
  int64_t hint = 0;
  for (int64_t r = r_lo; r < r_hi; ++r) ptr[r] = static_cast<const char*>(row_at(c, keys, pos[r], hint));
  if (r_lo < r_hi) prefetch_row(ptr[r_lo], row_bytes, true);
  prefetch_rows<false>(ptr, pos, r_hi, r_lo, EXACT_FAR, row_bytes);
  prefetch_rows<true>(ptr, pos, r_hi, r_lo, EXACT_NEAR, row_bytes);
  for (int64_t r = r_lo; r < r_hi;) {
    if (block && r + block <= r_hi) {
      prefetch_rows<false>(ptr, pos, r_hi, r + EXACT_FAR, block, row_bytes);
      prefetch_rows<true>(ptr, pos, r_hi, r + EXACT_NEAR, block, row_bytes);
      const void* rows[16];  // a local copy: with the array itself, gcc reloads the pointers in the inner loop
      for (int64_t i = 0; i < block; ++i) rows[i] = ptr[r + i];
      if (simd_block_logits(rows, c.key_type, q, G, c.dim, c.dim_pad, c.scaling, &logits[r], n)) {
        r += block;
        continue;
      }
    }
    prefetch_rows<false>(ptr, pos, r_hi, r + EXACT_FAR, 1, row_bytes);
    prefetch_rows<true>(ptr, pos, r_hi, r + EXACT_NEAR, 1, row_bytes);
    const void* row = ptr[r];
    if (!simd_logits(row, c.key_type, q, G, c.dim, c.dim_pad, c.scaling, &logits[r], n)) {
      to_float(row, c.key_type, c.dim, s.row.data());
      dots_dispatch(G, q, s.row.data(), c.dim_pad, c.scaling, &logits[r], n);
    }
    ++r;
  }
}

// from the exact logits (G x n, overwritten): softmax per head, the budget best, the outputs, then the gather
void pick_and_gather(const Call& c, const Slot& sl, float* logits, Scratch& s, Clock& clock) {
  const int64_t G = c.group, task = sl.task;
  const char* const* keys = sl.key_seg.data();
  const std::vector<int64_t>& positions = sl.positions;
  const int64_t n = static_cast<int64_t>(positions.size());
  const int64_t row_bytes = c.dim * (c.key_type == F32 ? 4 : 2);
  s.score.assign(n, 0.0f);
  for (int64_t h = 0; h < G; ++h) {
    float* l = &logits[h * n];
    const float peak = max_lanes(l, n);
    for (int64_t r = 0; r < n; ++r) l[r] -= peak;
    exp_nonpositive(l, n);
    const float inv = 1.0f / sum_lanes(l, n);
    for (int64_t r = 0; r < n; ++r) s.score[r] += l[r] * inv;
  }
  if (c.pool && !pooled(c, task)) {  // a scanned task carries its pool's size best to its next steps
    const int64_t at = pool_of(c, task), slots = c.pool[POOL_SLOTS];
    top_m(s.score.data(), n, std::min(slots, n), s, s.chosen);  // ascending
    int64_t* pool = pool_array<int64_t>(c, POOL_POSITIONS) + at * slots;
    for (size_t i = 0; i < s.chosen.size(); ++i) pool[i] = positions[s.chosen[i]];
    pool_array<int64_t>(c, POOL_COUNTS)[at] = static_cast<int64_t>(s.chosen.size());
  }
  top_m(s.score.data(), n, c.budget, s, s.chosen);  // ascending
  int64_t* out = c.out_indices + task * c.budget;
  uint8_t* valid = c.out_valid + task * c.budget;
  const int64_t k = static_cast<int64_t>(s.chosen.size());
  for (int64_t i = 0; i < c.budget; ++i) {
    out[i] = i < k ? positions[s.chosen[i]] : 0;
    valid[i] = i < k ? 1 : 0;
  }
  clock.mark(EXACT_TOPK);
  if (c.out_keys) {  // the gather: each slot's key and value rows (an invalid slot's: position 0's)
    const char* const* values = sl.value_seg.data();
    int64_t key_hint = 0, value_hint = 0, far = 0, near = 0;
    for (int64_t i = 0; i < std::min(c.budget, GATHER_FAR); ++i)  // the values are not in cache: ask ahead
      prefetch_row(static_cast<const char*>(row_at(c, values, out[i], far)), row_bytes, false);
    for (int64_t i = 0; i < std::min(c.budget, GATHER_NEAR); ++i)
      prefetch_row(static_cast<const char*>(row_at(c, values, out[i], near)), row_bytes, true);
    for (int64_t i = 0; i < c.budget; ++i) {
      if (i + GATHER_FAR < c.budget)
        prefetch_row(static_cast<const char*>(row_at(c, values, out[i + GATHER_FAR], far)), row_bytes, false);
      if (i + GATHER_NEAR < c.budget)
        prefetch_row(static_cast<const char*>(row_at(c, values, out[i + GATHER_NEAR], near)), row_bytes, true);
      const int64_t at = (task * c.out_slots + i) * row_bytes;
      std::memcpy(c.out_keys + at, row_at(c, keys, out[i], key_hint), row_bytes);
      std::memcpy(c.out_values + at, row_at(c, values, out[i], value_hint), row_bytes);
    }
    clock.mark(GATHER);
  }
}

// exact stage of one task on one worker: its logits, then the pick and the gather
void finish_task(const Call& c, const Slot& sl, Scratch& s, Clock& clock) {
  const int64_t n = static_cast<int64_t>(sl.positions.size());
  s.logits.resize(c.group * n);
  exact_logits(c, sl.positions, sl.key_seg.data(), sl.q.data(), 0, n, s.logits.data(), s);
  clock.mark(EXACT_READS);
  pick_and_gather(c, sl, s.logits.data(), s, clock);
}

// The tasks w, w + workers, ... of one worker, pipelined: the scan of task t requests the rows of task t - 1's
// shortlist (spread over its groups, into L2), then task t - 1's exact stage reads them from cache. A task's
// selection depends on that task alone.
void run_tasks(const Call& c, int64_t w, int64_t workers, Scratch& s) {
  const int64_t tasks = c.batch * c.kv_heads;
  const int64_t row_bytes = c.dim * (c.key_type == F32 ? 4 : 2);
  Slot* waiting = nullptr;
  int current = 0;
  for (int64_t t = w; t < tasks; t += workers) {
    Slot& sl = s.slots[current];
    begin_task(c, t, sl);
    if (waiting) s.pending = Pending{waiting->key_seg.data(), waiting->positions.data(),
                                     static_cast<int64_t>(waiting->positions.size()), 0, row_bytes, 0};
    Clock clock(c.profile ? c.profile + t * PHASES : nullptr);
    shortlist_task(c, sl, s, clock);
    s.pending = Pending{};
    if (waiting) {
      Clock finish(c.profile ? c.profile + waiting->task * PHASES : nullptr);
      finish_task(c, *waiting, s, finish);
    }
    waiting = &sl;
    current ^= 1;
  }
  if (waiting) {
    Clock finish(c.profile ? c.profile + waiting->task * PHASES : nullptr);
    finish_task(c, *waiting, s, finish);
  }
}

// --- one task split over several workers -------------------------------------------------------------------
// When a call has fewer (sequence, KV head) tasks than threads (batch 1 with few KV heads: MQA, a tensor-parallel
// shard), each task is split into `parts` that run at once: part p scans groups [groups p / parts, groups (p + 1) /
// parts) into one score array, part 0 takes the shortlist, part p computes the exact logits of rows [n p / parts,
// n (p + 1) / parts) into one logits array, part 0 takes the budget and gathers. Every number is computed as on one
// worker (each part scans the sampled groups itself; the softmax sums and top-k run on part 0), so the selection
// does not depend on the split.

inline void cpu_pause() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

// A barrier for the parts of one task (each on a thread of its own at once: the OpenMP team's, the kept or the started
// threads, never fewer threads than parts): spins briefly, then yields. It also returns once `failed` is set, so a part that failed never leaves the others waiting.
class PartBarrier {
 public:
  PartBarrier(int64_t parties, const std::atomic<bool>& failed) : parties_(parties), failed_(failed) {}
  void wait() {
    const int64_t gen = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == parties_) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_acq_rel);
      return;
    }
    for (int64_t spins = 0; generation_.load(std::memory_order_acquire) == gen; ++spins) {
      if (failed_.load(std::memory_order_acquire)) return;
      if (spins < 4096) cpu_pause();
      else std::this_thread::yield();
    }
  }

 private:
  const int64_t parties_;
  const std::atomic<bool>& failed_;
  std::atomic<int64_t> arrived_{0}, generation_{0};
};

struct SplitTask {  // what the parts of one task share; the buffers are part 0's scratch
  explicit SplitTask(int64_t parts) : barrier(parts, failed) {}
  std::atomic<bool> failed{false};
  PartBarrier barrier;
  TaskIndex ti;
  const Slot* slot = nullptr;  // part 0's: the positions every part rescores
  float* score = nullptr;
  float* logits = nullptr;
};

void run_part(const Call& c, int64_t task, int64_t part, int64_t parts, SplitTask& st, Scratch& s) {
  Slot& sl = s.slots[0];
  s.pending = Pending{};  // no rows to request during the scan: each part has one task
  Clock clock(c.profile ? c.profile + task * PHASES : nullptr);
  auto step = [&](auto&& work) {  // every part passes every barrier, failed or not
    if (!st.failed.load(std::memory_order_acquire)) {
      try {
        work();
      } catch (...) {
        st.failed.store(true, std::memory_order_release);
      }
    }
    st.barrier.wait();
    clock.skip();
  };
  step([&] {
    begin_task(c, task, sl);
    if (part == 0) {
      st.ti = task_index(c, task);
      s.score.resize(st.ti.groups * GROUP);
      st.score = s.score.data();
      st.slot = &sl;
    }
  });
  step([&] {
    const int64_t groups = st.ti.groups;
    if (groups > 0)
      scan_index(c, st.ti.ix, sl.q.data(), groups, st.ti.m, s, clock, groups * part / parts,
                 groups * (part + 1) / parts, st.score);
  });
  step([&] {
    if (part != 0) return;
    collect_positions(c, sl, st.ti, st.score, s, clock);
    s.logits.resize(c.group * sl.positions.size());
    st.logits = s.logits.data();
  });
  step([&] {
    const int64_t n = static_cast<int64_t>(st.slot->positions.size());
    exact_logits(c, st.slot->positions, sl.key_seg.data(), sl.q.data(), n * part / parts, n * (part + 1) / parts,
                 st.logits, s);
    clock.mark(EXACT_READS);
  });
  if (part == 0 && !st.failed.load(std::memory_order_acquire)) {
    try {
      pick_and_gather(c, sl, st.logits, s, clock);
    } catch (...) {
      st.failed.store(true, std::memory_order_release);
    }
  }
}

}  // namespace

extern "C" {

// Build variant of this library: 2 = AVX-512 (F/BW/VL/DQ + VNNI), 1 = AVX2, 0 = scalar.
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

// Say that this process is a fork()ed child whose parent may have used OpenMP before this library was loaded (the
// Python side calls it in such a child): the kept threads run the workers from then on.
void dc_note_fork() { forked_child.store(true); }

// How the calling thread's last dc_select ran its workers: 0 on the calling thread alone, 1 on the process's OpenMP
// team, 2 on the threads kept between calls, 3 on threads started for it.
int dc_last_threads() { return last_threads; }

// Free the scratch buffers kept between calls and stop the threads kept between calls (idempotent; calls running
// meanwhile keep their scratch; the threads stop when the call using them has returned).
void dc_release_scratch() {
  kept_threads().stop();
  std::lock_guard<std::mutex> guard(pool_lock);
  pool.clear();
}

// Select for every (sequence, KV head) of one call, and gather the selected K/V rows when out_keys is set; see
// `Call`, `Seg`, `Index` and `Pool` for the arguments (pool nullptr: none; rescan_cosine NaN: no cosine check).
// Returns 0, or -1 on an internal error (std::bad_alloc), with the outputs undefined.
int dc_select(int64_t batch, int64_t kv_heads, int64_t group, int64_t dim, int key_type, const float* query,
              float scaling, int64_t end, const uint8_t* mask, const int64_t* rows, int64_t n_segs,
              const int64_t* segs, const int64_t* index, const int64_t* group_first, const int64_t* n_groups,
              int64_t dim_q, int64_t quads, int64_t shortlist, int64_t budget, int64_t* out_indices,
              uint8_t* out_valid, void* out_keys, void* out_values, int64_t out_slots, int threads,
              int64_t* profile, const int64_t* pool, double rescan_cosine) {
  const int64_t started = profile ? now_ns() : 0;
  Call c{batch, kv_heads, group, dim, (dim + LANES - 1) / LANES * LANES, key_type, query, scaling, end, mask, rows,
         n_segs, segs, index, group_first, n_groups, dim_q, quads, shortlist, budget, out_indices, out_valid,
         static_cast<char*>(out_keys), static_cast<char*>(out_values), out_slots, profile, pool, nullptr};
  const int64_t tasks = batch * kv_heads;
  std::vector<uint8_t> decisions;
  if (pool) {
    try {
      plan_pools(c, rescan_cosine, decisions);
    } catch (...) {
      return -1;
    }
    c.pooled = decisions.data();
  }
  // a thread is started per call: only for work that outweighs starting it (the result never depends on it); with
  // more threads than tasks, each task is split into parts of at least that much work
  const int64_t worth = std::max<int64_t>(1, tasks * end / MIN_POSITIONS_PER_THREAD);
  const int64_t parts =
      tasks > 0 && threads > tasks
          ? std::max<int64_t>(1, std::min<int64_t>(threads / tasks, (end + MIN_POSITIONS_PER_THREAD / 2) / MIN_POSITIONS_PER_THREAD))
          : 1;
  const int workers = parts > 1 ? static_cast<int>(tasks * parts)
                                : static_cast<int>(std::max<int64_t>(1, std::min({static_cast<int64_t>(threads), tasks, worth})));
  std::vector<int> failed(workers, 0);
  std::vector<std::unique_ptr<SplitTask>> split;
  try {
    for (int64_t t = 0; parts > 1 && t < tasks; ++t) split.push_back(std::make_unique<SplitTask>(parts));
  } catch (...) {
    return -1;
  }
  auto work = [&](int w) {
    try {
      std::unique_ptr<Scratch> s = take_scratch();
      if (parts > 1) {
        SplitTask& st = *split[w / parts];
        run_part(c, w / parts, w % parts, parts, st, *s);
        if (st.failed.load()) failed[w] = 1;
      } else {
        run_tasks(c, w, workers, *s);
      }
      give_scratch(std::move(s));
    } catch (...) {
      failed[w] = 1;
      if (parts > 1) split[w / parts]->failed.store(true);
    }
  };
  if (workers == 1) {
    last_threads = ONE_THREAD;
    work(0);
  } else if (try_run_openmp(workers, work)) {
    last_threads = OPENMP_TEAM;
  } else if (kept_threads().try_run(workers, work)) {
    last_threads = KEPT_THREADS;
  } else {  // the kept threads busy (a call from another thread) or too few: threads of this call's own
    last_threads = STARTED_THREADS;
    std::vector<std::thread> pool;
    bool all_started = true;
    try {
      for (int w = 1; w < workers; ++w) pool.emplace_back(work, w);
    } catch (...) {
      all_started = false;  // a split task's parts wait for each other: release them, and run none here
      failed[0] = 1;
      for (auto& st : split) st->failed.store(true);
    }
    if (all_started || parts == 1) work(0);
    for (auto& t : pool) t.join();
  }
  if (profile) {
    profile[tasks * PHASES] = now_ns() - started;
    profile[tasks * PHASES + 1] = workers;
  }
  for (int f : failed)
    if (f) return -1;
  return 0;
}

}  // extern "C"
