// The kernels' threads: a parallel loop whose caller never waits for a thread that holds no work.
//
// Why not at::parallel_for: it is an OpenMP region that hands each thread one fixed slice and ends
// at a barrier, so when another process takes one thread's core (the scheduler streaming a token,
// a tokenizer, a compiler) every op of the step waits for that thread to be scheduled again. On two
// cores a batch-1 step with two threads took 2.3x as long beside one busy process, longer than with
// one thread (docs/benchmarks.md, "Threads that coexist").
//
// Here the range is cut into more chunks than threads, and every thread, the caller included,
// claims the next chunk from one shared counter. The caller returns once every chunk is done: a
// helper that has not woken up yet, or lost its core between chunks, costs nothing; one that lost
// it inside a chunk costs that chunk. Helpers spin briefly after each loop (the next op of a step
// comes within microseconds) and then sleep, so between steps they leave the cores to the
// scheduler. Which thread runs a chunk never changes a result: every kernel's loop body computes
// its rows and outputs in a fixed order of its own (the kernels' headers say which).
//
// The pool has `kvserve_cpu::set_num_threads`'s count less the caller; unset (0), torch's
// (`torch.set_num_threads`). The native path sets it and leaves torch one thread: torch's OpenMP
// threads spin for a while after each of torch's own ops, on the cores these loops need (a batch-8
// step measured 17.3 ms with OpenMP's loops, 28.9 ms with these beside spinning OpenMP threads).
// A loop called from inside a loop, or from a second thread while one runs, runs on its caller alone.
#pragma once

#include <ATen/Parallel.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define KVSERVE_CPU_RELAX() _mm_pause()
#else
#define KVSERVE_CPU_RELAX() std::this_thread::yield()
#endif

namespace kvserve_cpu {

namespace work_pool_detail {

constexpr int64_t kChunksPerThread = 4;  // chunks a thread's share is cut into, so an idle thread can take over
constexpr auto kHelperSpin = std::chrono::microseconds(100);  // how long a helper waits awake for the next loop

// One loop: the body, its range and chunking. Written by the caller before the loop is published.
struct Loop {
  void (*call)(const void* body, int64_t first, int64_t last) = nullptr;
  const void* body = nullptr;
  int64_t begin = 0, end = 0, chunk = 1;
};

class Pool {
 public:
  // Run `loop` in `chunks` chunks, on the caller and `helpers` other threads.
  void run(const Loop& loop, int64_t chunks, int helpers) {
    resize(helpers);
    loop_ = loop;
    done_.store(0, std::memory_order_relaxed);
    error_ = nullptr;
    // The claim word: the loop's number in the high half, the chunks not yet claimed in the low
    // half. A helper claims by decrementing it only while the number is still its loop's, so a
    // late helper can never take a chunk of the next loop with the previous loop's body.
    const uint64_t id = ++serial_;
    claim_.store(id << 32 | static_cast<uint64_t>(chunks), std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
    work(id);
    for (int spins = 0; done_.load(std::memory_order_acquire) < chunks; ++spins) {
      if (spins < 4096)
        KVSERVE_CPU_RELAX();
      else
        std::this_thread::yield();  // a helper lost its core inside a chunk: give it ours
    }
    if (error_) std::rethrow_exception(error_);
  }

  // After fork() only the forking thread exists: forget the helpers without touching their state.
  static Pool*& instance() {
    static Pool* pool = [] {
      pthread_atfork(nullptr, nullptr, [] { instance() = new Pool(); });  // the old one is leaked on purpose
      return new Pool();  // never destroyed: helpers may still be asleep in it at exit
    }();
    return pool;
  }

  std::mutex& busy() { return busy_; }

 private:
  // Claim and run chunks of loop `id` until none is left.
  void work(uint64_t id) {
    uint64_t word = claim_.load(std::memory_order_acquire);
    while ((word >> 32) == id && (word & 0xffffffffu) != 0) {
      if (!claim_.compare_exchange_weak(word, word - 1, std::memory_order_acq_rel)) continue;
      // The claim succeeded, so loop `id` is unfinished and loop_ is still its description.
      const int64_t index = static_cast<int64_t>(word & 0xffffffffu) - 1;
      const int64_t first = loop_.begin + index * loop_.chunk;
      const int64_t last = std::min(loop_.end, first + loop_.chunk);
      try {
        loop_.call(loop_.body, first, last);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex_);
        if (!error_) error_ = std::current_exception();
      }
      done_.fetch_add(1, std::memory_order_acq_rel);
      word = claim_.load(std::memory_order_acquire);
    }
  }

  void helper() {
    uint64_t seen = serial_seen_at_start_;
    for (;;) {
      uint64_t id = claim_.load(std::memory_order_acquire) >> 32;
      if (id == seen) {
        const auto until = std::chrono::steady_clock::now() + kHelperSpin;
        for (int spins = 0; id == seen; ++spins) {
          KVSERVE_CPU_RELAX();
          id = claim_.load(std::memory_order_acquire) >> 32;
          if ((spins & 63) == 63 && std::chrono::steady_clock::now() > until) break;
        }
      }
      if (id == seen) {
        std::unique_lock<std::mutex> lock(mutex_);
        sleeping_.fetch_add(1, std::memory_order_seq_cst);
        wake_.wait(lock, [&] { return stop_ || (claim_.load(std::memory_order_seq_cst) >> 32) != seen; });
        sleeping_.fetch_sub(1, std::memory_order_seq_cst);
        if (stop_) return;
        id = claim_.load(std::memory_order_acquire) >> 32;
      }
      seen = id;
      work(id);
    }
  }

  void resize(int helpers) {
    if (static_cast<int>(threads_.size()) == helpers) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
      wake_.notify_all();
    }
    // Helpers past their last loop only spin or sleep: each sees stop_ within its spin.
    for (auto& t : threads_) t.join();
    threads_.clear();
    stop_ = false;
    serial_seen_at_start_ = serial_;
    for (int i = 0; i < helpers; ++i) threads_.emplace_back([this] { helper(); });
  }

  Loop loop_;
  std::atomic<uint64_t> claim_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleeping_{0};
  uint64_t serial_ = 0, serial_seen_at_start_ = 0;
  std::exception_ptr error_;
  std::mutex error_mutex_, mutex_, busy_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

inline thread_local bool in_loop = false;

// Marks the running thread as inside a loop body for the body's length, however it ends.
struct InLoop {
  InLoop() { in_loop = true; }
  ~InLoop() { in_loop = false; }
  InLoop(const InLoop&) = delete;
  InLoop& operator=(const InLoop&) = delete;
};
inline std::atomic<int> configured_threads{0};

}  // namespace work_pool_detail

// The loops' thread count, the caller included; 0: torch's. Returns the previous setting.
inline int set_num_threads(int threads) { return work_pool_detail::configured_threads.exchange(threads); }

inline int num_threads() {
  const int configured = work_pool_detail::configured_threads.load(std::memory_order_relaxed);
  return configured > 0 ? configured : at::get_num_threads();
}

// body(first, last) over [begin, end), like at::parallel_for(begin, end, grain, body): no chunk is
// smaller than `grain`, and a range of at most `grain` runs on the caller alone.
template <typename Body>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const Body& body) {
  namespace d = work_pool_detail;
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int threads = num_threads();
  grain = std::max<int64_t>(grain, 1);
  if (threads <= 1 || n <= grain || d::in_loop) {
    body(begin, end);
    return;
  }
  d::Pool* pool = d::Pool::instance();
  std::unique_lock<std::mutex> busy(pool->busy(), std::try_to_lock);
  if (!busy.owns_lock()) {  // another thread's loop is running: this one runs alone
    body(begin, end);
    return;
  }
  const int64_t chunk = std::max(grain, (n + threads * d::kChunksPerThread - 1) / (threads * d::kChunksPerThread));
  const int64_t chunks = (n + chunk - 1) / chunk;
  d::Loop loop;
  loop.call = [](const void* b, int64_t first, int64_t last) {
    const d::InLoop inside;
    (*static_cast<const Body*>(b))(first, last);
  };
  loop.body = &body;
  loop.begin = begin;
  loop.end = end;
  loop.chunk = chunk;
  pool->run(loop, chunks, threads - 1);
}

}  // namespace kvserve_cpu
