// Fault injection for tests: make chosen or random I/O fail, come back short, or come back late.
//
// A FaultInjector holds rules and decides, for each transfer it is asked about, whether to inject
// a fault. It is used at two levels:
//   * Inside a backend (uring, posix, memory: pass it to the backend's Create function). Each
//     physical transfer is offered to it just before it is issued. An error makes the transfer
//     complete with -errno as if the kernel had returned it; a short transfer really issues fewer
//     bytes, so the backend's resubmission of the remainder runs for real. This is how the error
//     and short-transfer paths of every backend are tested.
//   * Around any BlockStore (FaultInjectingStore below). Each logical request is offered to it at
//     Submit. Errors complete the request with that error without reaching the inner store;
//     latency delays the request before it is passed on. Short-transfer rules do not apply here.
//
// Latency is timed on the injector's Clock (common/clock.h): the real one by default; with a
// test's ManualClock a delayed request stays held until the test advances the clock past its
// deadline — no sleeping, and the order of events is the test's, not the scheduler's.
//
// Thread safety: all methods may be called from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/clock.h"
#include "common/fault_rules.h"
#include "strata/block_store.h"
#include "strata/status.h"

namespace strata::io {

enum class FaultKind : uint8_t {
  kError,          // complete with `error` (an errno value: EIO, ENOSPC, EAGAIN, ...)
  kShortTransfer,  // move only part of the bytes (backend level)
  kLatency,        // delay by `latency` (wrapper level)
  // Reads only, wrapper level: the read succeeds, then bytes of the buffer are changed before the
  // caller's callback runs, as a drive returning bad data would (what checksums must catch).
  kCorrupt,
};

struct FaultRule {
  FaultKind kind = FaultKind::kError;
  int error = 5;  // EIO
  // Which transfers the rule considers (all must hold):
  std::optional<IoOp> op;     // only reads or only writes
  std::string path_contains;  // only paths containing this text ("" = any)
  uint64_t offset_begin = 0;  // only transfers overlapping [offset_begin, offset_end)
  uint64_t offset_end = UINT64_MAX;
  // Among the considered transfers, which ones get the fault: the listed ordinals (0-based, in
  // the order the injector saw them), or, if `ordinals` is empty, each with `probability`.
  std::vector<uint64_t> ordinals;
  double probability = 1.0;
  int64_t max_hits = -1;  // stop after this many injections (-1 = no limit)
  // kShortTransfer: bytes actually moved; 0 means half of the request. Rounded down to the
  // file's alignment; a transfer too small to shorten is left alone.
  uint64_t short_bytes = 0;
  // kLatency:
  std::chrono::microseconds latency{0};
};

struct FaultDecision {
  int error = 0;        // non-zero: fail with this errno
  uint64_t length = 0;  // bytes to actually transfer (== request length unless short)
  std::chrono::microseconds latency{0};
  bool corrupt = false;  // change bytes of the data read
  bool injected() const { return error != 0 || latency.count() > 0 || corrupt; }
};

class FaultInjector {
 public:
  // `clock` times kLatency rules (RealClock() when null); it must outlive every store that uses
  // this injector.
  explicit FaultInjector(uint64_t seed = 1, Clock* clock = nullptr);

  // Adds a rule; returns its index (for hits()).
  size_t AddRule(FaultRule rule);
  void Clear();

  // Asked once per transfer. `alignment` is the file's alignment (a short transfer keeps it).
  FaultDecision Decide(IoOp op, std::string_view path, uint64_t offset, uint64_t length,
                       uint32_t alignment);

  // How many faults rule `index` injected, and in total.
  uint64_t hits(size_t index) const;
  uint64_t total_hits() const;

  Clock& clock() const { return *clock_; }

 private:
  Clock* const clock_;
  mutable std::mutex mu_;
  FaultRules<FaultRule> rules_;
  std::mt19937_64 rng_;
};

// STRATA_FAULT_INJECT, a testing aid (docs/testing.md): a comma-separated list of
// `kind=probability` with kinds eio, enospc (request-level errors, reads and writes), eagain, short
// (backend transfers: resubmitted by the backend) and corrupt (reads whose bytes are changed),
// plus `seed=N`. E.g. "eagain=0.05,short=0.05,eio=0.001,corrupt=0.001,seed=7".
struct FaultPlan {
  std::shared_ptr<FaultInjector> backend;  // eagain, short: pass to CreateBlockStore
  std::shared_ptr<FaultInjector> wrapper;  // eio, enospc, corrupt: CreateFaultInjectingStore
  std::string text;                        // the spec, for logs
  // Hits per kind so far, e.g. "eio 3, enospc 0, eagain 812, short 790, corrupt 2 (1607 in all)".
  std::string Summary() const;
  uint64_t total() const;

 private:
  friend Result<FaultPlan> ParseFaultSpec(std::string_view spec);
  std::vector<std::pair<std::string, std::pair<FaultInjector*, size_t>>> rules_;
};
// InvalidArgument naming the bad part of `spec`.
Result<FaultPlan> ParseFaultSpec(std::string_view spec);

// Wraps a store and injects request-level errors, latency and corrupted reads from `faults`.
// Errors complete the request (on the wrapper's own thread) with a Status that names the path,
// offset and length and says the fault was injected.
std::unique_ptr<BlockStore> CreateFaultInjectingStore(std::unique_ptr<BlockStore> inner,
                                                      std::shared_ptr<FaultInjector> faults);

}  // namespace strata::io
