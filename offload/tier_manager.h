// TierManager: where each shard's bytes are, and moving them between device memory, pinned host
// memory and NVMe under hard byte budgets.
//
// A shard is a contiguous byte range of model state (one rank's part of one unit's parameters,
// gradients or optimizer states) with a home tier: the tier that holds it when nobody uses it.
// The manager keeps, per shard and tier, a *copy* with an explicit state:
//
//   kAbsent ──reserve+start transfer──▶ kFilling ──transfer ok──▶ kReady(version v)
//      ▲                                   │ transfer failed                │
//      └──────────── free ◀────────────────┘◀──── drop (clean, unpinned) ───┘
//
// Every write is versioned: Release(lease, dirty=true) gives the shard a new version held only by
// that copy; copies holding an older version are stale and are freed (the home copy is kept and
// overwritten later). A copy is *current* when it is kReady with the shard's version. Moving a
// copy up (nvme -> host -> device) or down (write-back) is the same operation — a transfer from a
// current copy into another tier — so there is one state machine, not one per direction:
//   nvme -> host    BlockStore read into a pinned-pool block
//   host -> device  Device::CopyAsync(kHostToDevice) on the manager's h2d stream
//   device -> host  Device::CopyAsync(kDeviceToHost) on the manager's d2h stream (write-back)
//   host -> nvme    BlockStore write from the pinned block (write-back to the home slot)
// A device copy of an NVMe-homed shard is filled through a host copy (no NVMe <-> device path).
// While a copy is the source of a transfer it is pinned and cannot be evicted.
//
// Shared host memory (TierManagerOptions::share_host_memory, the CPU device only): a device whose
// memory is host memory does not need a second copy of bytes it only reads. A device copy filled
// for reading (Acquire kRead, Prefetch) then *is* the host copy: it reaches kReady as soon as the
// host copy is current, with no transfer, and the host copy stays pinned (as a transfer source
// is) while it exists. The device budget is still charged the shard's bytes, so the device peak
// and every budget mean what they mean with copies. A writer (kReadWrite, kOverwrite) never gets
// a shared copy: an idle shared copy is dropped (freeing nothing but budget) before a writer
// takes either tier, and before the evictor frees the host copy under it.
//
// Budgets (device, host) are hard: bytes reserved for a copy — including copies still in flight
// — never exceed the tier's budget (stats().peak <= budget always holds). To make room the manager
// evicts copies that are not acquired, not in flight and not the home copy:
//   - a copy that another tier also holds current is dropped (freed at once);
//   - the last current copy above the home tier is written back one tier down first (device ->
//     host, host -> nvme) and freed when that completes.
// Victims are chosen by the eviction oracle when one is set (the prefetch scheduler's knowledge
// of the future: the copy whose next use is farthest away goes first; copies that are redundant
// because a higher tier holds the shard current go before anything else), else least recently
// used. When a request cannot be met even after evicting everything evictable, Acquire fails with
// ResourceExhausted naming the tier, its budget, the request, and what is pinned by whom.
//
// Use is explicit. Acquire(shard, tier) returns a Lease once a current copy is in that tier (it
// blocks, and the wait is counted as a stall); the copy cannot be evicted until the lease is
// released. Prefetch(shard, tier) starts the same movement without waiting and without ever
// evicting something needed sooner than the prefetched shard.
//
// Errors: a transfer that fails (an I/O error, a device error) frees the half-filled copy and is
// returned by the next Acquire of that shard (once; a later Acquire retries). A failed write-back
// leaves the data in the copy above (nothing is lost; the stale home copy is never served) and is
// returned to the call that needed the room. The manager stays usable after any of these.
//
// NVMe layout: NVMe-homed shards get 4 KiB-aligned slots in one preallocated file per rank and
// state class, striped over every configured path (see nvme_layout.h).
//
// Threading: every method may be called from any thread. Completions arrive on the BlockStore's
// I/O threads and the Device's stream threads; all state is under one mutex, and transfers are
// issued under it (BlockStore::Submit and the Device's enqueue calls never block). The eviction
// oracle is called with that mutex held: it must not call back into the manager.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/clock.h"
#include "device/pinned_pool.h"
#include "offload/nvme_layout.h"
#include "strata/block_store.h"
#include "strata/device.h"
#include "strata/status.h"
#include "strata/trace.h"

namespace strata::offload {

enum class Tier : uint8_t { kDevice = 0, kHost = 1, kNvme = 2 };
inline constexpr int kNumTiers = 3;
std::string_view TierName(Tier tier);  // "device", "host", "nvme"

using ShardId = uint64_t;

struct ShardSpec {
  ShardId id = 0;
  uint64_t bytes = 0;  // > 0
  Tier home = Tier::kNvme;
  std::string name;                    // for errors and traces; default "shard <id>"
  std::string state_class = "param";   // NVMe file per class ("param", "optim", ...)
};

enum class Access : uint8_t {
  kRead,       // the copy must hold the shard's current bytes
  kOverwrite,  // the caller overwrites every byte: no fill; the lease is released dirty
  // The copy is filled and the caller may modify it in place (release it dirty if it did).
  // Like kOverwrite the lease is exclusive: no other lease, and no transfer reads the copy,
  // while it is held. A kRead holder must not modify the bytes.
  kReadWrite,
};

struct TierManagerOptions {
  device::Device* device = nullptr;      // required when any shard lives on or visits kDevice
  device::PinnedPool* pool = nullptr;    // host copies; required for kHost / kNvme shards
  io::BlockStore* store = nullptr;       // required for kNvme shards
  uint64_t device_budget = 0;            // bytes the manager may hold on the device
  uint64_t host_budget = 0;              // bytes of the pool it may hold; 0 = the pool's size
  NvmeLayoutOptions nvme;                // paths, stripe unit, rank, ... for kNvme shards
  TraceRecorder* trace = nullptr;        // I/O transfers and consumer stalls, when set
  // Times consumer stalls (TierStats::stall_ns) and the trace's events; RealClock() when null.
  // Must outlive the manager.
  Clock* clock = nullptr;
  // Device copies read from host memory in place instead of copying it (see the header comment).
  // Only for a device whose memory is host memory (DeviceType::kCpu); InvalidArgument otherwise.
  bool share_host_memory = false;
};

struct TierStats {
  uint64_t budget = 0;
  uint64_t in_use = 0;   // bytes reserved by copies in this tier (ready or in flight)
  uint64_t peak = 0;     // highest in_use
  uint64_t fill_bytes = 0;       // bytes moved into this tier from the tier below
  uint64_t writeback_bytes = 0;  // bytes moved into this tier from the tier above
  uint64_t fills = 0, writebacks = 0;
  uint64_t drops = 0;            // copies freed (clean evictions, stale copies)
  uint64_t evictions = 0;        // copies removed to make room (drops and write-backs)
  uint64_t hits = 0;             // Acquire found a current copy ready
  uint64_t misses = 0;           // Acquire had to wait for a transfer
  uint64_t stalls = 0;           // Acquire calls that waited
  uint64_t stall_ns = 0;         // their total wait
  uint64_t errors = 0;           // failed transfers into this tier
  uint64_t shares = 0;           // device copies that became the host copy (no transfer)
};

class TierManager;

// A copy in use. Move-only; releasing (explicitly or by destruction) lets the manager evict it
// again. `data` is the copy's memory: a device pointer for kDevice, a pinned host pointer for
// kHost. NVMe copies cannot be acquired.
class Lease {
 public:
  Lease() = default;
  ~Lease();
  Lease(Lease&& other) noexcept;
  Lease& operator=(Lease&& other) noexcept;
  Lease(const Lease&) = delete;
  Lease& operator=(const Lease&) = delete;

  explicit operator bool() const { return manager_ != nullptr; }
  ShardId shard() const { return shard_; }
  Tier tier() const { return tier_; }
  void* data() const { return data_; }
  uint64_t bytes() const { return bytes_; }

  // Ends the lease. `dirty`: the holder changed the bytes (they become the shard's current
  // version). `used_on`: a device stream that still has work using the memory; the copy is not
  // freed or overwritten before that work completes (write-backs wait for it on the device).
  void Release(bool dirty = false, device::Stream* used_on = nullptr);

 private:
  friend class TierManager;
  TierManager* manager_ = nullptr;
  ShardId shard_ = 0;
  Tier tier_ = Tier::kHost;
  void* data_ = nullptr;
  uint64_t bytes_ = 0;
  bool overwrite_ = false;  // kOverwrite: released dirty
  bool writer_ = false;     // kOverwrite or kReadWrite: exclusive
  std::string owner_;
  std::thread::id acquirer_;  // the thread that acquired it
};

// What Prefetch did.
enum class PrefetchOutcome : uint8_t {
  kResident,  // already current in that tier (nothing to do)
  kInFlight,  // already moving there
  kIssued,    // a transfer was started
  kNoRoom,    // the budget is taken by copies needed sooner (or pinned); try again later
};
std::string_view PrefetchOutcomeName(PrefetchOutcome outcome);

// Distance (in any monotone unit, e.g. accesses or bytes) from now to the next use of a shard;
// kNeverUsed when unknown or never.
using EvictionOracle = std::function<uint64_t(ShardId)>;
inline constexpr uint64_t kNeverUsed = std::numeric_limits<uint64_t>::max();

class TierManager {
 public:
  // Checks the options (a device budget needs a device, ...) and creates the manager's streams.
  static Result<std::unique_ptr<TierManager>> Create(const TierManagerOptions& options);
  // Waits for every transfer in flight, then frees all copies. Leases must have been released.
  ~TierManager();
  TierManager(const TierManager&) = delete;
  TierManager& operator=(const TierManager&) = delete;

  // Registers a shard; only before Start. InvalidArgument for a duplicate id, 0 bytes, or a home
  // tier whose backend is missing.
  Status Register(const ShardSpec& spec);
  // Lays out and preallocates the NVMe files and allocates the home copies of device- and
  // host-homed shards (they count against the budgets and are never evicted).
  Status Start();

  // Blocks until a current copy of `shard` is in `tier` (kDevice or kHost) and pins it.
  // `owner` labels the lease in budget errors ("forward block.3"). Errors: NotFound (unknown
  // shard), InvalidArgument (kNvme), ResourceExhausted (no room even after evicting everything
  // evictable), or the error of a failed transfer of this shard.
  Result<Lease> Acquire(ShardId shard, Tier tier, Access access = Access::kRead,
                        std::string_view owner = "");

  // Starts moving a current copy of `shard` into `tier` without waiting. Never evicts a copy the
  // oracle says is needed no later than `shard`. Errors only for unknown shards / bad tiers.
  Result<PrefetchOutcome> Prefetch(ShardId shard, Tier tier);

  // Lets go of `shard`'s copy in `tier` now if nobody holds it: dropped when another tier holds
  // it current, written back (and freed when that completes) when it is the last current copy
  // above home. A no-op for absent, pinned, in-flight or home copies.
  Status Evict(ShardId shard, Tier tier);

  // Writes every shard's current copy back to its home tier and waits (for a checkpoint, or
  // before the process ends). Copies acquired for reading are written too. When the only copy of
  // a shard is acquired with kOverwrite, FlushAll waits for that lease to be released — or
  // returns FailedPrecondition when the calling thread holds it.
  Status FlushAll();

  // Returns (once) a write-back failure that no call has reported yet — one started by a
  // prefetch, or by a call that found room elsewhere before the write failed — then forgets
  // them all (the message counts the others). The data of such a shard is still current in the
  // tier above; the failed home copy is never served. OK when there is none. Callers that must
  // not let an I/O error pass silently (the optimizer's write-behind) call it after their work.
  Status TakeWritebackError();
  // Sets (or clears, with nullptr) the eviction oracle.
  void SetEvictionOracle(EvictionOracle oracle);

  // Blocks until no transfer is in flight.
  void WaitIdle();

  TierStats stats(Tier tier) const;
  uint64_t shard_bytes(ShardId shard) const;  // 0 for unknown shards
  Result<Tier> home(ShardId shard) const;     // NotFound for unknown shards
  // True when `shard` has a current copy in `tier` that is ready (not in flight).
  bool IsCurrent(ShardId shard, Tier tier) const;
  const NvmeLayout* nvme_layout() const { return layout_.get(); }

 private:
  friend class Lease;
  struct Copy;
  struct Shard;
  struct Transfer;

  explicit TierManager(const TierManagerOptions& options);

  void ReleaseLease(Lease& lease, bool dirty, device::Stream* used_on);

  Shard* FindLocked(ShardId id);
  const Shard* FindLocked(ShardId id) const;
  bool IsCurrentLocked(const Shard& s, Tier t) const;
  bool IsHome(const Shard& s, Tier t) const;

  // Memory. A reservation is memory charged to a tier but not yet attached to a copy.
  struct Reservation {
    void* data = nullptr;
    device::PinnedBlock block;
    uint64_t reserved = 0;
  };
  // Finds room for `need` bytes in tier t (evicting; waiting when `blocking`, which may drop
  // `lock`) and allocates it. Non-blocking: *no_room and ResourceExhausted when there is none now.
  // `future_aware`: evict only copies the oracle says are needed after `for_shard`.
  // Callers reserve for `for_shard`'s absent copy in tier t. Should another caller create that
  // copy while this one waits (a prefetch filling it), the result is an empty Reservation: the
  // caller finds the copy no longer absent, gives the reservation back and looks again. (Without
  // this the wait could end in a budget error, since the evictor never takes the copy it is
  // making room for.)
  Result<Reservation> ReserveLocked(Tier t, uint64_t need, bool blocking, bool future_aware,
                                    ShardId for_shard, std::unique_lock<std::mutex>& lock,
                                    bool* no_room, bool allocate = true);
  // `allocate` false: charge the budget only (a device copy that will share the host copy).
  Result<Reservation> TryAllocLocked(Tier t, uint64_t need, bool allocate = true);
  void UnreserveLocked(Tier t, Reservation& r);
  // Makes `r` s's copy in t, kReady or kFilling (its version is the caller's to set); false, and
  // `r` given back, when another caller made that copy while this one waited for the room.
  bool AttachLocked(Shard& s, Tier t, Reservation& r, bool ready);
  void FreeCopyLocked(Shard& s, Tier t);
  bool EvictOneLocked(Tier t, uint64_t target_distance, bool future_aware, ShardId for_shard,
                      std::optional<ShardId>* started_writeback, Status* failure = nullptr);
  Status StartWritebackLocked(Shard& s, Tier from, bool free_after);
  static Tier WritebackTarget(const Shard& s, Tier from);
  // "<tier> tier budget B is exhausted: " + DescribeHoldersLocked(t).
  std::string DescribeTierLocked(Tier t) const;
  // What holds the tier's bytes: acquired copies with their owners (up to 8), home copies,
  // transfers in flight, and copies not evictable now.
  std::string DescribeHoldersLocked(Tier t) const;

  // Transfers.
  // `may_share`: a device copy for reading, which shares the host copy under share_host_memory.
  Status EnsureFillLocked(Shard& s, Tier t, bool blocking, std::unique_lock<std::mutex>& lock,
                          bool* no_room, bool may_share = false);
  // Shared host memory: the pending device copy becomes the (current) host copy.
  void ShareHostLocked(Shard& s);
  // Whether s's device copy shares its host copy and nobody uses it (no lease, drained).
  bool IdleShareLocked(Shard& s);
  // Issues the transfer. A failure to issue finishes it as failed at once (a fill's error is
  // left for Acquire) and is returned.
  Status StartTransferLocked(Shard& s, Tier from, Tier to);
  // Drops the lock, waits for consumer work recorded in `event`, re-takes the lock.
  Status WaitDrainedLocked(std::shared_ptr<device::Event> event,
                           std::unique_lock<std::mutex>& lock);
  // Waits for the first copy of `s` with pending consumer work, if any.
  Status DrainAnyLocked(Shard& s, std::unique_lock<std::mutex>& lock);
  void TransferDone(ShardId id, Tier to, uint64_t version, int64_t start_ns, const Status& st);
  void AdvancePendingLocked(Shard& s);
  void FailPendingLocked(Shard& s, Tier t, const Status& st);

  // Acquire's transitions (one pass of its loop takes one; see tier_manager.cc). All hold the
  // lock; those given `lock` may drop it while they wait, after which the caller looks again.
  // An Acquire call's bookkeeping across its waits.
  struct AcquireWait {
    int64_t start_ns = 0;  // when it first had to wait; 0: it has not
    bool counted_miss = false;
  };
  // Acquire's argument and state checks, in the order it reports them.
  Status CheckAcquireLocked(ShardId id, Tier t) const;
  // Whether `access` may take s's copy in t now. *drain is set when consumer work still using
  // the bytes must finish first.
  bool GrantableLocked(Shard& s, Tier t, Access access, std::shared_ptr<device::Event>* drain);
  // Pins the copy for the lease and counts the hit or the stall.
  Lease GrantLocked(Shard& s, Tier t, Access access, std::string_view owner,
                    const AcquireWait& wait);
  void CountGrantLocked(const Shard& s, Tier t, const AcquireWait& wait);
  void CountMissLocked(Tier t, AcquireWait& wait);
  // A writer of a host copy that a device copy shares: drops the device copy once it is idle.
  // True when it dropped or waited (look again); FailedPrecondition when the caller holds the
  // device copy itself.
  Result<bool> UnshareForWriterLocked(Shard& s, Tier t, Access access,
                                      std::unique_lock<std::mutex>& lock);
  // One step toward a grantable copy: waits for a busy copy to settle, drops or refreshes a
  // stale one, or makes room for an absent one and starts its fill (an overwrite: room only).
  Status AdvanceCopyLocked(Shard& s, Tier t, Access access, std::string_view owner,
                           std::unique_lock<std::mutex>& lock);
  // kReady but not grantable: frees it (after its consumer work), or refreshes a home copy.
  Status DropStaleLocked(Shard& s, Tier t, Access access, std::unique_lock<std::mutex>& lock);
  // A stale home copy: writes a neighbouring tier's current copy back into it, or waits.
  Status RefreshHomeLocked(Shard& s, Tier t, std::unique_lock<std::mutex>& lock);
  // kOverwrite of an absent copy: reserves memory and makes it a ready copy of no version.
  Status ReserveForOverwriteLocked(Shard& s, Tier t, std::string_view owner,
                                   std::unique_lock<std::mutex>& lock);
  // "acquiring shard '<name>' (<bytes>) in the <tier> tier for <owner>".
  std::string AcquireContextLocked(ShardId id, Tier t, std::string_view owner) const;

  void ChargeLocked(Tier t, uint64_t bytes);
  void UnchargeLocked(Tier t, uint64_t bytes);
  uint64_t AllocBytes(const Shard& s, Tier t) const;

  TierManagerOptions options_;
  Clock& clock_;
  std::unique_ptr<device::Stream> h2d_stream_, d2h_stream_;
  std::unique_ptr<NvmeLayout> layout_;
  uint32_t io_track_read_ = 0, io_track_write_ = 0, stall_track_ = 0;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool started_ = false;
  std::unordered_map<ShardId, std::unique_ptr<Shard>> shards_;
  std::vector<ShardId> order_;  // registration order
  TierStats stats_[kNumTiers];
  uint64_t budget_[kNumTiers] = {0, 0, 0};
  uint64_t tick_ = 0;
  int in_flight_ = 0;
  EvictionOracle oracle_;
  std::vector<std::pair<ShardId, Status>> unreported_writeback_;  // see TakeWritebackError
};

}  // namespace strata::offload
