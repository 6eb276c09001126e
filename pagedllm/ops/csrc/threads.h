// How much work a parallel task gets: the intra-op pool's wake-up cost decides what is worth splitting.
#pragma once

#include <strings.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>

namespace pagedllm {

// Whether idle OpenMP threads go to sleep at once (OMP_WAIT_POLICY=PASSIVE and no GOMP_SPINCOUNT, which
// libgomp lets override the policy), so that every parallel region pays for waking them. pagedllm's
// default is a short spin (pagedllm/_runtime.py): a pool still spinning from the matmul before takes a
// batch-64 SiLU-and-mul in 22 us on 2 threads against 44 us on one; a sleeping one in 67 us.
inline bool threads_sleep_at_once() {
  static const bool sleep = [] {
    const char* policy = std::getenv("OMP_WAIT_POLICY");
    const char* spin = std::getenv("GOMP_SPINCOUNT");
    return policy != nullptr && strcasecmp(policy, "passive") == 0 && (spin == nullptr || std::atol(spin) == 0);
  }();
  return sleep;
}

// Rows per parallel task such that each task has about `elements` elements of work: waking the thread
// pool costs tens of microseconds with passive OpenMP threads, more than a decode batch's norm or rotary
// takes on one core, so small work runs inline on the calling thread.
inline int64_t grain(int64_t row_elements, int64_t elements) { return std::max<int64_t>(1, elements / row_elements); }

// grain() for work that spinning threads split well (`elements` a task), sleeping ones at 4x that.
inline int64_t grain_by_wake_cost(int64_t row_elements, int64_t elements) {
  return grain(row_elements, threads_sleep_at_once() ? 4 * elements : elements);
}

}  // namespace pagedllm
