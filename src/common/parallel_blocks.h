// ParallelBlocks: fn(b) for every block b in [0, blocks), shared round-robin among up to
// `threads` threads (the calling thread alone when that is 1, or when there are fewer than
// `min_blocks_per_thread` blocks per thread). The blocks' results must not depend on which
// thread runs them: callers that need a deterministic result fix their block size by the data
// alone and combine the blocks' results in index order.
#pragma once

#include <algorithm>
#include <cstddef>
#include <thread>
#include <vector>

namespace strata {

template <typename Fn>
void ParallelBlocks(size_t blocks, size_t threads, size_t min_blocks_per_thread, Fn&& fn) {
  const size_t workers =
      std::min(std::max<size_t>(threads, 1), blocks / std::max<size_t>(min_blocks_per_thread, 1));
  if (workers <= 1) {
    for (size_t b = 0; b < blocks; ++b) fn(b);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(workers);
  for (size_t t = 0; t < workers; ++t) {
    pool.emplace_back([&fn, t, workers, blocks] {
      for (size_t b = t; b < blocks; b += workers) fn(b);
    });
  }
  for (std::thread& th : pool) th.join();
}

}  // namespace strata
