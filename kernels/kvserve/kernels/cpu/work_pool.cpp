// The kernels' thread count as ops (torch.ops.kvserve_cpu.set_num_threads / num_threads), so the
// executor can give kvserve's loops every core while torch keeps one (work_pool.h says why).
#include <torch/library.h>

#include "work_pool.h"

namespace kvserve_cpu {
namespace {

int64_t set_threads(int64_t threads) {
  TORCH_CHECK(threads >= 0, "set_num_threads: threads must be >= 0 (0: torch's count), got ", threads);
  return set_num_threads(static_cast<int>(threads));
}

int64_t threads() { return num_threads(); }

}  // namespace
}  // namespace kvserve_cpu

TORCH_LIBRARY_FRAGMENT(kvserve_cpu, m) {
  m.def("set_num_threads(int threads) -> int", kvserve_cpu::set_threads);
  m.def("num_threads() -> int", kvserve_cpu::threads);
}
