#include "offload/tier_manager.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <thread>
#include <utility>

#include "common/log.h"
#include "common/units.h"

namespace strata::offload {

namespace {

constexpr uint64_t kInvalidVersion = std::numeric_limits<uint64_t>::max();

bool IsUp(Tier from, Tier to) { return static_cast<int>(from) > static_cast<int>(to); }

}  // namespace

std::string_view TierName(Tier tier) {
  switch (tier) {
    case Tier::kDevice: return "device";
    case Tier::kHost: return "host";
    case Tier::kNvme: return "nvme";
  }
  return "?";
}

std::string_view PrefetchOutcomeName(PrefetchOutcome outcome) {
  switch (outcome) {
    case PrefetchOutcome::kResident: return "resident";
    case PrefetchOutcome::kInFlight: return "in-flight";
    case PrefetchOutcome::kIssued: return "issued";
    case PrefetchOutcome::kNoRoom: return "no-room";
  }
  return "?";
}

// One tier's copy of a shard. See the state diagram in tier_manager.h.
struct TierManager::Copy {
  enum class State : uint8_t { kAbsent, kFilling, kReady };
  State state = State::kAbsent;
  void* data = nullptr;
  device::PinnedBlock block;  // host copies
  uint64_t reserved = 0;      // bytes charged to the tier
  // kReady: the version held (kInvalidVersion: garbage, e.g. after a failed write into a home
  // copy). kFilling: the version the transfer will deliver.
  uint64_t version = 0;
  // Held by an exclusive (kOverwrite / kReadWrite) lease: the bytes are in flux, so the copy is
  // not current, not a transfer source and not evictable until it is released.
  bool overwrite = false;
  std::thread::id overwriter;     // the thread holding that lease
  int pins = 0;                   // consumer leases
  int source_pins = 0;            // transfers reading from this copy
  struct Holder {
    std::string owner;       // the lease's label, for budget errors
    std::thread::id thread;  // the thread that acquired it
  };
  std::vector<Holder> holders;  // one per consumer lease (pin)
  uint64_t last_use = 0;
  bool transfer_started = false;  // kFilling: issued, or still waiting for its source
  bool writeback = false;         // kFilling: a write-back toward home (not a fill for a consumer)
  Tier source = Tier::kNvme;
  bool free_after_writeback = false;  // evicting: free once the tier below holds it current
  std::shared_ptr<device::Event> in_use;  // recorded on the consumer's stream at release
  bool in_use_pending = false;
  // Shared host memory. A device copy: its memory is (kFilling: will be, once the host copy is
  // current) the host copy's; nothing was allocated on the device. A host copy: a device copy
  // shares it, and holds one of its source_pins for as long as it exists.
  bool shares_host = false;
  bool shared_with_device = false;
};

struct TierManager::Shard {
  ShardId id = 0;
  uint64_t bytes = 0;
  Tier home = Tier::kNvme;
  std::string name;
  std::string state_class;
  uint64_t version = 0;
  Copy copies[kNumTiers];
  const NvmeSlot* slot = nullptr;
  Status fill_error;       // a failed fill (or prefetch); returned by the next Acquire
  Status writeback_error;  // failed write-back started to make room; for that caller
  Copy& at(Tier t) { return copies[static_cast<int>(t)]; }
  const Copy& at(Tier t) const { return copies[static_cast<int>(t)]; }
};

// ---- Lease ---------------------------------------------------------------------------------------

Lease::~Lease() {
  if (manager_ != nullptr) Release();
}

Lease::Lease(Lease&& other) noexcept { *this = std::move(other); }

Lease& Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    if (manager_ != nullptr) Release();
    manager_ = std::exchange(other.manager_, nullptr);
    shard_ = other.shard_;
    tier_ = other.tier_;
    data_ = other.data_;
    bytes_ = other.bytes_;
    overwrite_ = other.overwrite_;
    writer_ = other.writer_;
    owner_ = std::move(other.owner_);
    acquirer_ = other.acquirer_;
  }
  return *this;
}

void Lease::Release(bool dirty, device::Stream* used_on) {
  if (manager_ == nullptr) return;
  TierManager* m = std::exchange(manager_, nullptr);
  m->ReleaseLease(*this, dirty || overwrite_, used_on);
}

// ---- construction --------------------------------------------------------------------------------

TierManager::TierManager(const TierManagerOptions& options)
    : options_(options), clock_(options.clock != nullptr ? *options.clock : RealClock()) {}

Result<std::unique_ptr<TierManager>> TierManager::Create(const TierManagerOptions& options) {
  if (options.device_budget > 0 && options.device == nullptr) {
    return Status(StatusCode::kInvalidArgument, "a device budget was given without a device");
  }
  if (options.pool != nullptr && options.host_budget > options.pool->size()) {
    return Status(StatusCode::kInvalidArgument,
                  "host budget " + FormatBytes(options.host_budget) +
                      " is larger than the pinned pool (" + FormatBytes(options.pool->size()) +
                      "); raise strata.memory.pinned_pool or lower strata.memory.host_budget");
  }
  if (options.share_host_memory) {
    // The device decides whether its memory is host memory (only the CPU device's is).
    Status st = options.device == nullptr
                    ? Status(StatusCode::kFailedPrecondition, "there is no device")
                    : options.device->UseHostMemoryAsDeviceMemory();
    if (!st.ok()) {
      return Status(StatusCode::kInvalidArgument,
                    "share_host_memory needs a device whose memory is host memory (the CPU "
                    "device): " +
                        std::string(st.message()));
    }
  }
  std::unique_ptr<TierManager> m(new TierManager(options));
  m->budget_[0] = options.device != nullptr ? options.device_budget : 0;
  if (options.device != nullptr && m->budget_[0] == 0) {
    m->budget_[0] = options.device->memory_stats().budget;
  }
  m->budget_[1] = options.pool == nullptr ? 0
                  : options.host_budget > 0 ? options.host_budget
                                            : options.pool->size();
  m->budget_[2] = 0;
  for (int t = 0; t < kNumTiers; ++t) m->stats_[t].budget = m->budget_[t];
  if (options.device != nullptr) {
    STRATA_ASSIGN_OR_RETURN(m->h2d_stream_, options.device->CreateStream("offload.h2d"));
    STRATA_ASSIGN_OR_RETURN(m->d2h_stream_, options.device->CreateStream("offload.d2h"));
  }
  if (options.trace != nullptr) {
    m->io_track_read_ = options.trace->Track("offload nvme read");
    m->io_track_write_ = options.trace->Track("offload nvme write");
    m->stall_track_ = options.trace->Track("offload stall");
  }
  return m;
}

TierManager::~TierManager() {
  WaitIdle();
  std::unique_lock lock(mu_);
  for (auto& [id, s] : shards_) {
    for (int t = 0; t < kNumTiers; ++t) {
      Copy& c = s->copies[t];
      if (c.pins > 0) {
        STRATA_LOG(error, offload, "shard '{}' is still acquired in {} at shutdown", s->name,
                   TierName(static_cast<Tier>(t)));
      }
      if (c.in_use_pending && c.in_use && options_.device != nullptr) {
        (void)options_.device->Synchronize(*c.in_use);
      }
      if (c.data != nullptr) FreeCopyLocked(*s, static_cast<Tier>(t));
    }
  }
  lock.unlock();
  // Streams drain in their destructors; the layout closes and removes its files.
  h2d_stream_.reset();
  d2h_stream_.reset();
  layout_.reset();
}

Status TierManager::Register(const ShardSpec& spec) {
  std::lock_guard lock(mu_);
  if (started_) {
    return Status(StatusCode::kFailedPrecondition,
                  "shard " + std::to_string(spec.id) + " registered after Start");
  }
  if (spec.bytes == 0) {
    return Status(StatusCode::kInvalidArgument,
                  "shard " + std::to_string(spec.id) + " has 0 bytes");
  }
  if (shards_.count(spec.id) != 0) {
    return Status(StatusCode::kInvalidArgument,
                  "shard " + std::to_string(spec.id) + " is registered twice");
  }
  if (spec.home == Tier::kDevice && options_.device == nullptr) {
    return Status(StatusCode::kInvalidArgument,
                  "shard " + std::to_string(spec.id) + " is homed on the device, but the tier "
                  "manager has no device");
  }
  if (spec.home != Tier::kDevice && options_.pool == nullptr) {
    return Status(StatusCode::kInvalidArgument,
                  "shard " + std::to_string(spec.id) + " is homed on " +
                      std::string(TierName(spec.home)) + ", which needs the pinned pool");
  }
  if (spec.home == Tier::kNvme && options_.store == nullptr) {
    return Status(StatusCode::kInvalidArgument,
                  "shard " + std::to_string(spec.id) + " is homed on NVMe, but the tier manager "
                  "has no block store");
  }
  auto s = std::make_unique<Shard>();
  s->id = spec.id;
  s->bytes = spec.bytes;
  s->home = spec.home;
  s->name = spec.name.empty() ? "shard " + std::to_string(spec.id) : spec.name;
  s->state_class = spec.state_class.empty() ? "param" : spec.state_class;
  order_.push_back(spec.id);
  shards_.emplace(spec.id, std::move(s));
  return Status::Ok();
}

Status TierManager::Start() {
  std::unique_lock lock(mu_);
  if (started_) return Status(StatusCode::kFailedPrecondition, "tier manager started twice");
  std::vector<NvmeLayoutEntry> entries;
  for (ShardId id : order_) {
    const Shard& s = *shards_.at(id);
    if (s.home == Tier::kNvme) entries.push_back({s.id, s.bytes, s.state_class});
  }
  if (!entries.empty()) {
    STRATA_ASSIGN_OR_RETURN(layout_, NvmeLayout::Create(*options_.store, options_.nvme, entries));
  }
  for (ShardId id : order_) {
    Shard& s = *shards_.at(id);
    Copy& home = s.at(s.home);
    if (s.home == Tier::kNvme) {
      s.slot = layout_->Find(s.id);
      home.state = Copy::State::kReady;
      home.version = 0;  // preallocated files read as zeros
      continue;
    }
    const uint64_t need = AllocBytes(s, s.home);
    const int h = static_cast<int>(s.home);
    if (stats_[h].in_use + need > budget_[h]) {
      return Status(StatusCode::kResourceExhausted,
                    "the home copies of " + std::string(TierName(s.home)) +
                        "-resident shards do not fit the " + std::string(TierName(s.home)) +
                        " budget of " + FormatBytes(budget_[h]) + ": shard '" + s.name +
                        "' needs " + FormatBytes(need) + " with " +
                        FormatBytes(stats_[h].in_use) + " already taken");
    }
    if (s.home == Tier::kHost) {
      Result<device::PinnedBlock> b = options_.pool->Allocate(need);
      if (!b.ok()) return b.status().WithContext("home copy of shard '" + s.name + "'");
      std::memset(b->data, 0, b->capacity);
      home.block = *b;
      home.data = b->data;
    } else {
      Result<void*> p = options_.device->Alloc(need);
      if (!p.ok()) return p.status().WithContext("home copy of shard '" + s.name + "'");
      home.data = *p;
      // Zero it (fp32 zero is all-zero bits); `need` is a multiple of 4 KiB.
      STRATA_RETURN_IF_ERROR(
          options_.device->Fill(home.data, device::DType::kF32, 0.0f, need / 4, *h2d_stream_));
      STRATA_RETURN_IF_ERROR(options_.device->Synchronize(*h2d_stream_));
    }
    home.reserved = need;
    ChargeLocked(s.home, need);
    home.state = Copy::State::kReady;
    home.version = 0;
  }
  started_ = true;
  return Status::Ok();
}

// ---- helpers -------------------------------------------------------------------------------------

TierManager::Shard* TierManager::FindLocked(ShardId id) {
  auto it = shards_.find(id);
  return it == shards_.end() ? nullptr : it->second.get();
}

const TierManager::Shard* TierManager::FindLocked(ShardId id) const {
  auto it = shards_.find(id);
  return it == shards_.end() ? nullptr : it->second.get();
}

bool TierManager::IsCurrentLocked(const Shard& s, Tier t) const {
  const Copy& c = s.at(t);
  return c.state == Copy::State::kReady && !c.overwrite && c.version == s.version;
}

bool TierManager::IsHome(const Shard& s, Tier t) const { return s.home == t; }

uint64_t TierManager::AllocBytes(const Shard& s, Tier t) const {
  const uint64_t rounded = RoundUp(s.bytes, io::kDirectIoAlignment);
  return t == Tier::kHost ? device::PinnedPool::SizeClass(rounded) : rounded;
}

void TierManager::ChargeLocked(Tier t, uint64_t bytes) {
  TierStats& st = stats_[static_cast<int>(t)];
  st.in_use += bytes;
  st.peak = std::max(st.peak, st.in_use);
}

void TierManager::UnchargeLocked(Tier t, uint64_t bytes) {
  stats_[static_cast<int>(t)].in_use -= bytes;
}

void TierManager::FreeCopyLocked(Shard& s, Tier t) {
  Copy& c = s.at(t);
  if (c.shares_host) {
    // Nothing of its own to free; a ready shared copy lets go of the host copy under it.
    Copy& host = s.at(Tier::kHost);
    if (c.state == Copy::State::kReady && host.shared_with_device) {
      host.shared_with_device = false;
      host.source_pins--;
    }
  } else if (t == Tier::kHost && c.block) {
    options_.pool->Free(c.block);
  } else if (t == Tier::kDevice && c.data != nullptr) {
    options_.device->Free(c.data);
  }
  UnchargeLocked(t, c.reserved);
  Copy fresh;
  fresh.last_use = c.last_use;
  fresh.in_use = std::move(c.in_use);  // reuse the event object
  c = std::move(fresh);
  cv_.notify_all();
}

// Whether an unpinned ready copy's consumer work has finished (its release event completed).
static bool DrainedLocked(device::Device* dev, const std::shared_ptr<device::Event>& ev,
                          bool* pending) {
  if (!*pending) return true;
  Result<bool> done = dev->Query(*ev);
  if (!done.ok() || *done) {
    *pending = false;  // a device error is sticky and surfaces elsewhere; do not hold memory
    return true;
  }
  return false;
}

bool TierManager::IdleShareLocked(Shard& s) {
  Copy& dev = s.at(Tier::kDevice);
  return dev.shares_host && dev.state == Copy::State::kReady && dev.pins == 0 &&
         dev.source_pins == 0 && DrainedLocked(options_.device, dev.in_use, &dev.in_use_pending);
}

void TierManager::ShareHostLocked(Shard& s) {
  Copy& dev = s.at(Tier::kDevice);
  Copy& host = s.at(Tier::kHost);
  dev.data = host.data;
  dev.state = Copy::State::kReady;
  dev.version = host.version;
  dev.source = Tier::kHost;
  dev.transfer_started = false;
  host.source_pins++;
  host.shared_with_device = true;
  stats_[static_cast<int>(Tier::kDevice)].shares++;
  cv_.notify_all();
}

Status TierManager::WaitDrainedLocked(std::shared_ptr<device::Event> event,
                                      std::unique_lock<std::mutex>& lock) {
  lock.unlock();
  Status st = options_.device->Synchronize(*event);
  lock.lock();
  for (auto& [id, s] : shards_) {
    for (Copy& c : s->copies) {
      if (c.in_use == event) c.in_use_pending = false;
    }
  }
  return st.WithContext("waiting for consumer work on a released copy");
}

Status TierManager::DrainAnyLocked(Shard& s, std::unique_lock<std::mutex>& lock) {
  for (Copy& c : s.copies) {
    if (c.in_use_pending && c.in_use) return WaitDrainedLocked(c.in_use, lock);
  }
  return Status::Ok();
}

// ---- eviction and reservation ----------------------------------------------------------------

bool TierManager::EvictOneLocked(Tier t, uint64_t target_distance, bool future_aware,
                                 ShardId for_shard, std::optional<ShardId>* started_writeback,
                                 Status* failure) {
  started_writeback->reset();
  struct Candidate {
    Shard* shard;
    int cls;  // 3: not needed here (stale, or current in a higher tier), 2: current elsewhere too,
              // 1: the last current copy above home (needs a write-back)
    uint64_t distance;
    uint64_t lru;
    bool unshare;  // an idle device copy shares this host copy: it is dropped first
  };
  std::vector<Candidate> candidates;
  for (auto& [id, sp] : shards_) {
    Shard& s = *sp;
    if (s.id == for_shard || IsHome(s, t)) continue;
    Copy& c = s.at(t);
    // A host copy under an idle shared device copy is evictable: the device copy is no copy of
    // its own, so it neither keeps the host copy nor counts as holding the shard elsewhere.
    const bool unshare = t == Tier::kHost && c.shared_with_device && IdleShareLocked(s);
    if (c.state != Copy::State::kReady || c.pins > 0 || c.source_pins > (unshare ? 1 : 0) ||
        c.free_after_writeback || c.overwrite) {
      continue;
    }
    if (c.in_use_pending && !DrainedLocked(options_.device, c.in_use, &c.in_use_pending)) continue;
    const bool current = IsCurrentLocked(s, t);
    bool elsewhere = false, above = false;
    for (int o = 0; o < kNumTiers; ++o) {
      if (o == static_cast<int>(t) || !IsCurrentLocked(s, static_cast<Tier>(o))) continue;
      if (unshare && o == static_cast<int>(Tier::kDevice)) continue;
      elsewhere = true;
      above |= o < static_cast<int>(t);
    }
    const uint64_t distance = oracle_ ? oracle_(s.id) : kNeverUsed;
    // A prefetch may not evict what is needed no later than the shard it brings in — a copy
    // whose shard is current in a higher tier too: that copy serves the next use, but it is
    // usually let go after it, and then this one is what is left.
    if (future_aware && current && distance <= target_distance) continue;
    const int cls = (!current || above) ? 3 : elsewhere ? 2 : 1;
    if (cls == 1) {
      // A write-back needs its target copy free to overwrite (or absent, for a host copy).
      const Copy& dst = s.at(WritebackTarget(s, t));
      if (dst.state == Copy::State::kFilling || dst.pins > 0 || dst.source_pins > 0) continue;
    }
    candidates.push_back({&s, cls, distance, c.last_use, unshare});
  }
  std::sort(candidates.begin(), candidates.end(), [](const Candidate& a, const Candidate& b) {
    if (a.cls != b.cls) return a.cls > b.cls;
    if (a.distance != b.distance) return a.distance > b.distance;
    return a.lru < b.lru;
  });
  TierStats& st = stats_[static_cast<int>(t)];
  const auto unshare = [&](const Candidate& cand) {
    if (!cand.unshare) return;
    stats_[static_cast<int>(Tier::kDevice)].drops++;
    FreeCopyLocked(*cand.shard, Tier::kDevice);
  };
  for (const Candidate& cand : candidates) {
    if (cand.cls >= 2) {
      unshare(cand);
      st.evictions++;
      st.drops++;
      FreeCopyLocked(*cand.shard, t);
      return true;
    }
    // The last current copy: write it back; its memory returns when that completes. No room
    // below for the write-back right now is not an error: try the next victim.
    Status wb = StartWritebackLocked(*cand.shard, t, /*free_after=*/true);
    if (wb.ok()) {
      // The write-back reads the host copy; once the share is gone, its completion frees it.
      unshare(cand);
      st.evictions++;
      *started_writeback = cand.shard->id;
      return true;
    }
    if (wb.code() != StatusCode::kUnavailable && wb.code() != StatusCode::kResourceExhausted) {
      if (failure != nullptr) *failure = wb;  // a real failure: the caller that needed room reports it
    }
  }
  return false;
}

Tier TierManager::WritebackTarget(const Shard& s, Tier from) {
  // Toward home: down for host- and NVMe-homed shards, up (host -> device) for device-homed ones.
  return static_cast<int>(s.home) > static_cast<int>(from)
             ? static_cast<Tier>(static_cast<int>(from) + 1)
             : static_cast<Tier>(static_cast<int>(from) - 1);
}

Status TierManager::StartWritebackLocked(Shard& s, Tier from, bool free_after) {
  const Tier to = WritebackTarget(s, from);
  Copy& dst = s.at(to);
  Copy& src = s.at(from);
  if (!IsCurrentLocked(s, from)) {
    return Status(StatusCode::kUnavailable, "the " + std::string(TierName(from)) +
                                                " copy of shard '" + s.name + "' is not current");
  }
  // Consumer work still writing the source or reading the destination: device copies wait for
  // it on the device (StartTransferLocked); an NVMe write cannot, so it is not started yet.
  if (to == Tier::kNvme && !DrainedLocked(options_.device, src.in_use, &src.in_use_pending)) {
    return Status(StatusCode::kUnavailable, "the host copy of shard '" + s.name +
                                                "' is still in use by device work");
  }
  if (dst.state == Copy::State::kFilling) {
    return Status(StatusCode::kUnavailable, "a transfer into " + std::string(TierName(to)) +
                                                " is already in flight for shard '" + s.name + "'");
  }
  if (dst.pins > 0 || dst.source_pins > 0) {
    return Status(StatusCode::kUnavailable, "the " + std::string(TierName(to)) +
                                                " copy of shard '" + s.name + "' is in use");
  }
  if (dst.state == Copy::State::kAbsent) {
    // Only a host copy can be absent here (NVMe and home copies always exist). Find room
    // without waiting: this runs inside another tier's eviction.
    std::unique_lock<std::mutex> no_lock;
    bool no_room = false;
    Result<Reservation> r = ReserveLocked(to, AllocBytes(s, to), /*blocking=*/false,
                                          /*future_aware=*/false, s.id, no_lock, &no_room);
    if (!r.ok()) return r.status();
    dst.data = r->data;
    dst.block = r->block;
    dst.reserved = r->reserved;
  }
  dst.state = Copy::State::kFilling;
  dst.version = src.version;
  dst.writeback = true;
  src.free_after_writeback = free_after;
  s.writeback_error = Status::Ok();  // an older failure is superseded by this attempt
  return StartTransferLocked(s, from, to);
}

Result<TierManager::Reservation> TierManager::TryAllocLocked(Tier t, uint64_t need,
                                                             bool allocate) {
  Reservation r;
  if (!allocate) {
    r.reserved = need;
  } else if (t == Tier::kHost) {
    Result<device::PinnedBlock> b = options_.pool->Allocate(need);
    if (!b.ok()) return b.status();
    r.block = *b;
    r.data = b->data;
    r.reserved = b->capacity;
  } else {
    Result<void*> p = options_.device->Alloc(need);
    if (!p.ok()) return p.status();
    r.data = *p;
    r.reserved = need;
  }
  ChargeLocked(t, r.reserved);
  return r;
}

bool TierManager::AttachLocked(Shard& s, Tier t, Reservation& r, bool ready) {
  Copy& c = s.at(t);
  if (c.state != Copy::State::kAbsent) {
    UnreserveLocked(t, r);
    return false;
  }
  c.data = r.data;
  c.block = r.block;
  c.reserved = r.reserved;
  c.state = ready ? Copy::State::kReady : Copy::State::kFilling;
  return true;
}

void TierManager::UnreserveLocked(Tier t, Reservation& r) {
  if (t == Tier::kHost && r.block) {
    options_.pool->Free(r.block);
  } else if (t == Tier::kDevice && r.data != nullptr) {
    options_.device->Free(r.data);
  }
  UnchargeLocked(t, r.reserved);
  r = Reservation{};
  cv_.notify_all();
}

Result<TierManager::Reservation> TierManager::ReserveLocked(Tier t, uint64_t need, bool blocking,
                                                            bool future_aware, ShardId for_shard,
                                                            std::unique_lock<std::mutex>& lock,
                                                            bool* no_room, bool allocate) {
  const int ti = static_cast<int>(t);
  if (need > budget_[ti]) {
    return Status(StatusCode::kResourceExhausted,
                  std::string(TierName(t)) + " tier budget " + FormatBytes(budget_[ti]) +
                      " is smaller than the request of " + FormatBytes(need));
  }
  const uint64_t target = (future_aware && oracle_) ? oracle_(for_shard) : 0;
  std::vector<ShardId> started;  // write-backs this call started
  Status evict_failure;          // a write-back this call could not issue
  Status last_alloc_error;
  for (;;) {
    if (blocking) {  // the lock may have been dropped while waiting
      const Shard* fs = FindLocked(for_shard);
      if (fs != nullptr && fs->at(t).state != Copy::State::kAbsent) return Reservation{};
    }
    if (stats_[ti].in_use + need <= budget_[ti]) {
      Result<Reservation> r = TryAllocLocked(t, need, allocate);
      if (r.ok()) return r;
      // Within budget but the allocator refused (pool fragmentation, the device's own limit):
      // more evictions help just as for the budget.
      if (r.status().code() != StatusCode::kResourceExhausted) return r.status();
      last_alloc_error = r.status();
    }
    for (ShardId id : started) {
      Shard* s = FindLocked(id);
      if (s != nullptr && !s->writeback_error.ok()) {
        Status e = std::exchange(s->writeback_error, Status::Ok());
        std::erase_if(unreported_writeback_, [id](const auto& entry) { return entry.first == id; });
        return e.WithContext("making room in the " + std::string(TierName(t)) + " tier");
      }
    }
    std::optional<ShardId> wb;
    if (EvictOneLocked(t, target, future_aware && oracle_ != nullptr, for_shard, &wb,
                       &evict_failure)) {
      // Only write-backs this call started report their failures to it.
      if (wb && std::find(started.begin(), started.end(), *wb) == started.end()) {
        started.push_back(*wb);
      }
      continue;
    }
    if (!blocking) {
      *no_room = true;
      return Status(StatusCode::kResourceExhausted,
                    "no room in the " + std::string(TierName(t)) + " tier now");
    }
    // Nothing evictable right now. Consumer work still using a released copy: wait for it.
    // (in this tier, or a write-back target below it).
    std::shared_ptr<device::Event> drain;
    for (auto& [id, s] : shards_) {
      for (const Copy& c : s->copies) {
        if (c.state == Copy::State::kReady && c.pins == 0 && c.in_use_pending) drain = c.in_use;
      }
      if (drain) break;
    }
    if (drain) {
      STRATA_RETURN_IF_ERROR(WaitDrainedLocked(drain, lock));
      continue;
    }
    // Any transfer in flight can make something evictable (a write-back frees its source, a
    // fill becomes an unpinned copy, a host write-back makes room for a device one).
    if (in_flight_ == 0) {
      if (!evict_failure.ok()) {
        return evict_failure.WithContext("making room in the " + std::string(TierName(t)) + " tier");
      }
      if (stats_[ti].in_use + need <= budget_[ti] && !last_alloc_error.ok()) {
        // The budget had room but the allocator did not (pool fragmentation, the device's own
        // limit): say so, and what holds the tier.
        return Status(last_alloc_error.code(),
                      std::string(last_alloc_error.message()) + "; the " +
                          std::string(TierName(t)) + " tier is within its budget of " +
                          FormatBytes(budget_[ti]) + ": " + DescribeHoldersLocked(t));
      }
      return Status(StatusCode::kResourceExhausted, DescribeTierLocked(t));
    }
    cv_.wait(lock);
  }
}

std::string TierManager::DescribeTierLocked(Tier t) const {
  return std::string(TierName(t)) + " tier budget " + FormatBytes(budget_[static_cast<int>(t)]) +
         " is exhausted: " + DescribeHoldersLocked(t);
}

std::string TierManager::DescribeHoldersLocked(Tier t) const {
  const int ti = static_cast<int>(t);
  std::string pinned;
  uint64_t pinned_bytes = 0, home_bytes = 0, flight_bytes = 0, pinned_count = 0, other = 0;
  std::string flight;
  uint64_t flight_count = 0;
  for (ShardId id : order_) {
    const Shard& s = *shards_.at(id);
    const Copy& c = s.at(t);
    if (c.reserved == 0) continue;
    // A host copy under a device lease that shares it is held by that lease's owners.
    const Copy& dev = s.at(Tier::kDevice);
    const bool via_device = t == Tier::kHost && c.pins == 0 && c.shared_with_device &&
                            dev.shares_host && dev.pins > 0;
    if (IsHome(s, t)) {
      home_bytes += c.reserved;
    } else if (c.pins > 0 || via_device) {
      pinned_bytes += c.reserved;
      if (++pinned_count <= 8) {
        if (!pinned.empty()) pinned += ", ";
        std::string owners;
        for (const Copy::Holder& h : (via_device ? dev : c).holders) {
          if (!owners.empty()) owners += "+";
          owners += h.owner.empty() ? "?" : h.owner;
        }
        pinned += "'" + s.name + "' " + FormatBytes(c.reserved) + " by " + owners +
                  (via_device ? " (device lease sharing it)" : "");
      }
    } else if (c.state == Copy::State::kFilling || c.source_pins > 0 || c.free_after_writeback) {
      flight_bytes += c.reserved;
      if (++flight_count <= 4) {
        const char* why = c.state == Copy::State::kFilling
                              ? (c.transfer_started ? "filling" : "waiting for its source")
                          : c.free_after_writeback ? "being written back"
                          : c.shared_with_device   ? "shared by a device copy"
                                                   : "source of a transfer";
        if (!flight.empty()) flight += ", ";
        flight += "'" + s.name + "' " + why;
      }
    } else {
      other += c.reserved;
    }
  }
  if (pinned_count > 8) pinned += ", ... (" + std::to_string(pinned_count - 8) + " more)";
  if (flight_count > 4) flight += ", ... (" + std::to_string(flight_count - 4) + " more)";
  return FormatBytes(stats_[ti].in_use) + " in use — acquired " +
         FormatBytes(pinned_bytes) + (pinned.empty() ? "" : " (" + pinned + ")") +
         ", home copies " + FormatBytes(home_bytes) + ", in flight " + FormatBytes(flight_bytes) +
         (flight.empty() ? "" : " (" + flight + ")") + ", not evictable now " +
         FormatBytes(other);
}

// ---- filling -------------------------------------------------------------------------------------

Status TierManager::EnsureFillLocked(Shard& s, Tier t, bool blocking,
                                     std::unique_lock<std::mutex>& lock, bool* no_room,
                                     bool may_share) {
  const ShardId id = s.id;
  const bool share = t == Tier::kDevice && may_share && options_.share_host_memory;
  // Reserve the memory first: a blocking reservation may drop the lock while it waits. A copy
  // that will share the host copy takes device budget only.
  Result<Reservation> r = ReserveLocked(t, AllocBytes(s, t), blocking, /*future_aware=*/!blocking,
                                        id, lock, no_room, /*allocate=*/!share);
  if (!r.ok()) return r.status().WithContext(std::string(TierName(t)) + " copy of shard '" +
                                             s.name + "'");
  Shard* sp = &s;
  if (!AttachLocked(*sp, t, *r, /*ready=*/false)) return Status::Ok();  // someone was first
  Copy& c = sp->at(t);
  c.version = sp->version;
  c.transfer_started = false;
  c.shares_host = share;

  // Source: a current copy, nearest first; a device copy of an NVMe-homed shard stages on host.
  if (t == Tier::kHost) {
    // A failure to issue is recorded in fill_error and returned by the waiting Acquire.
    if (IsCurrentLocked(*sp, Tier::kDevice)) {
      (void)StartTransferLocked(*sp, Tier::kDevice, Tier::kHost);
    } else if (IsCurrentLocked(*sp, Tier::kNvme)) {
      (void)StartTransferLocked(*sp, Tier::kNvme, Tier::kHost);
    } else {
      FreeCopyLocked(*sp, t);
      return Status(StatusCode::kInternal, "shard '" + sp->name + "' has no current copy");
    }
    return Status::Ok();
  }
  c.source = Tier::kHost;
  if (IsCurrentLocked(*sp, Tier::kHost)) {
    if (share) {
      ShareHostLocked(*sp);
    } else {
      (void)StartTransferLocked(*sp, Tier::kHost, Tier::kDevice);
    }
    return Status::Ok();
  }
  Copy& host = sp->at(Tier::kHost);
  if (host.state == Copy::State::kFilling) return Status::Ok();  // advanced when it lands
  if (host.state == Copy::State::kReady) {
    if (host.pins > 0 || host.source_pins > 0 ||
        !DrainedLocked(options_.device, host.in_use, &host.in_use_pending)) {
      // A stale host copy someone still holds: give the device memory back and let the caller
      // retry once it is released.
      FreeCopyLocked(*sp, Tier::kDevice);
      if (!blocking) {
        *no_room = true;
        return Status(StatusCode::kResourceExhausted, "no room now");
      }
      cv_.wait(lock);
      return Status::Ok();
    }
    FreeCopyLocked(*sp, Tier::kHost);
  }
  Status st = EnsureFillLocked(*sp, Tier::kHost, blocking, lock, no_room);
  sp = FindLocked(id);
  if (!st.ok()) {
    // Give the device memory back. The error (or "not now") goes to our caller only, not also to
    // the next Acquire.
    Copy& dev = sp->at(Tier::kDevice);
    if (dev.state == Copy::State::kFilling && !dev.transfer_started) {
      FreeCopyLocked(*sp, Tier::kDevice);
    }
    return st;
  }
  AdvancePendingLocked(*sp);
  return Status::Ok();
}

Status TierManager::StartTransferLocked(Shard& s, Tier from, Tier to) {
  Copy& src = s.at(from);
  Copy& dst = s.at(to);
  src.source_pins++;
  dst.transfer_started = true;
  dst.source = from;
  dst.version = src.version;
  in_flight_++;
  const ShardId id = s.id;
  const uint64_t version = src.version;
  const int64_t start = options_.trace != nullptr ? clock_.NowNs() : 0;
  Status issued;
  if (from == Tier::kNvme || to == Tier::kNvme) {
    const bool read = from == Tier::kNvme;
    io::IoRequest req;
    req.op = read ? io::IoOp::kRead : io::IoOp::kWrite;
    req.file = s.slot->file;
    req.offset = s.slot->offset;
    req.length = s.slot->length;
    req.buffer = read ? dst.data : src.data;
    req.done = [this, id, to, version, start](const Status& st) {
      TransferDone(id, to, version, start, st);
    };
    issued = options_.store->Submit(req);
  } else {
    device::Device& dev = *options_.device;
    const bool h2d = from == Tier::kHost;
    device::Stream& stream = h2d ? *h2d_stream_ : *d2h_stream_;
    // Consumer work released with a stream: its writes to the source, and its reads of the
    // destination's old bytes, complete before the copy runs.
    for (Copy* c : {&src, &dst}) {
      if (issued.ok() && c->in_use_pending && c->in_use) issued = dev.Wait(stream, *c->in_use);
    }
    if (issued.ok()) {
      issued = dev.CopyAsync(dst.data, src.data, s.bytes,
                             h2d ? device::CopyKind::kHostToDevice : device::CopyKind::kDeviceToHost,
                             stream);
    }
    if (issued.ok()) {
      issued = dev.Notify(stream, [this, id, to, version, start](const Status& st) {
        TransferDone(id, to, version, start, st);
      });
    }
  }
  if (issued.ok()) return Status::Ok();

  // Nothing will call back: finish the transfer as failed now (the caller holds the lock).
  in_flight_--;
  src.source_pins--;
  src.free_after_writeback = false;
  const bool writeback = dst.writeback;
  const Status err = issued.WithContext("moving shard '" + s.name + "' from " +
                                        std::string(TierName(from)) + " to " +
                                        std::string(TierName(to)));
  stats_[static_cast<int>(to)].errors++;
  if (IsHome(s, to)) {
    dst.state = Copy::State::kReady;
    dst.version = kInvalidVersion;
    dst.transfer_started = false;
    dst.writeback = false;
  } else {
    FreeCopyLocked(s, to);
  }
  if (!writeback) {
    // A fill: whoever waits for this shard gets the error from Acquire.
    s.fill_error = err;
    if (to == Tier::kHost) FailPendingLocked(s, Tier::kDevice, err);
  }
  cv_.notify_all();
  return err;
}

void TierManager::TransferDone(ShardId id, Tier to, uint64_t version, int64_t start_ns,
                               const Status& st) {
  std::lock_guard lock(mu_);
  Shard& s = *FindLocked(id);
  Copy& dst = s.at(to);
  const Tier from = dst.source;
  Copy& src = s.at(from);
  src.source_pins--;
  in_flight_--;
  const bool writeback = std::exchange(dst.writeback, false);
  const int ti = static_cast<int>(to);
  if (options_.trace != nullptr && (from == Tier::kNvme || to == Tier::kNvme)) {
    options_.trace->Complete(
        from == Tier::kNvme ? io_track_read_ : io_track_write_, s.name, "io", start_ns,
        clock_.NowNs(),
        {{"bytes", static_cast<double>(s.bytes)}, {"shard", static_cast<double>(id)}});
  }
  if (st.ok()) {
    dst.state = Copy::State::kReady;
    dst.version = version;
    dst.transfer_started = false;
    if (IsUp(from, to)) {
      stats_[ti].fills++;
      stats_[ti].fill_bytes += s.bytes;
    } else {
      stats_[ti].writebacks++;
      stats_[ti].writeback_bytes += s.bytes;
    }
    if (version != s.version && !IsHome(s, to) && dst.pins == 0 && dst.source_pins == 0) {
      FreeCopyLocked(s, to);  // overtaken by a newer write while in flight
    }
    if (src.free_after_writeback) {
      src.free_after_writeback = false;
      if (IsCurrentLocked(s, to) && src.pins == 0 && src.source_pins == 0 &&
          src.state == Copy::State::kReady) {
        stats_[static_cast<int>(from)].drops++;
        FreeCopyLocked(s, from);
      }
    }
    AdvancePendingLocked(s);
  } else {
    stats_[ti].errors++;
    const Status err = st.WithContext("moving shard '" + s.name + "' from " +
                                      std::string(TierName(from)) + " to " +
                                      std::string(TierName(to)));
    STRATA_LOG(debug, offload, "{}", err.ToString());
    src.free_after_writeback = false;
    if (IsHome(s, to)) {
      dst.state = Copy::State::kReady;
      dst.version = kInvalidVersion;  // partly overwritten: never served
      dst.transfer_started = false;
    } else {
      FreeCopyLocked(s, to);
    }
    // A fill's error goes to whoever acquires the shard next; a write-back's to the call that
    // needed the room (the data is still current in the source).
    if (!writeback) {
      s.fill_error = err;
      if (to == Tier::kHost) FailPendingLocked(s, Tier::kDevice, err);
    } else {
      s.writeback_error = err;
      // Kept until a caller hears of it: the call that needed the room, or TakeWritebackError.
      unreported_writeback_.emplace_back(s.id, err);
      STRATA_LOG(warn, offload, "{} (the data is still current in the {} tier)", err.ToString(),
                 TierName(from));
    }
  }
  cv_.notify_all();
}

void TierManager::AdvancePendingLocked(Shard& s) {
  Copy& dev = s.at(Tier::kDevice);
  if (dev.state == Copy::State::kFilling && !dev.transfer_started &&
      IsCurrentLocked(s, Tier::kHost)) {
    if (dev.shares_host) {
      ShareHostLocked(s);
    } else {
      (void)StartTransferLocked(s, Tier::kHost, Tier::kDevice);  // failure -> fill_error
    }
  }
}

void TierManager::FailPendingLocked(Shard& s, Tier t, const Status& st) {
  Copy& c = s.at(t);
  if (c.state == Copy::State::kFilling && !c.transfer_started) {
    FreeCopyLocked(s, t);
    if (s.fill_error.ok()) s.fill_error = st;
    stats_[static_cast<int>(t)].errors++;
  }
}

// ---- the consumer API ----------------------------------------------------------------------------

// Acquire walks the copy's state diagram (tier_manager.h) until it can grant a lease. Each pass
// looks at the copy once and takes one transition — grant it; wait for the copy to settle; clear
// a shared device copy out of a writer's way; drop or refresh a stale copy; make room and start
// a fill (or, for an overwrite, only make room) — then looks again, since any wait drops the lock.
Result<Lease> TierManager::Acquire(ShardId id, Tier t, Access access, std::string_view owner) {
  std::unique_lock lock(mu_);
  STRATA_RETURN_IF_ERROR(CheckAcquireLocked(id, t));
  AcquireWait wait;
  for (;;) {
    Shard& s = *FindLocked(id);
    if (access != Access::kOverwrite && !s.fill_error.ok()) {
      return std::exchange(s.fill_error, Status::Ok());
    }
    std::shared_ptr<device::Event> drain;
    if (GrantableLocked(s, t, access, &drain)) {
      if (!drain) return GrantLocked(s, t, access, owner, wait);
      STRATA_RETURN_IF_ERROR(WaitDrainedLocked(std::move(drain), lock));
      continue;
    }
    CountMissLocked(t, wait);
    STRATA_ASSIGN_OR_RETURN(const bool unshared, UnshareForWriterLocked(s, t, access, lock));
    if (!unshared) STRATA_RETURN_IF_ERROR(AdvanceCopyLocked(s, t, access, owner, lock));
  }
}

Status TierManager::CheckAcquireLocked(ShardId id, Tier t) const {
  if (t == Tier::kNvme) {
    return Status(StatusCode::kInvalidArgument, "NVMe copies cannot be acquired; use host");
  }
  if (t == Tier::kDevice && options_.device == nullptr) {
    return Status(StatusCode::kFailedPrecondition, "the tier manager has no device");
  }
  if (!started_) return Status(StatusCode::kFailedPrecondition, "tier manager not started");
  if (FindLocked(id) == nullptr) {
    return Status(StatusCode::kNotFound, "shard " + std::to_string(id) + " is not registered");
  }
  if (t == Tier::kHost && options_.pool == nullptr) {
    return Status(StatusCode::kFailedPrecondition, "the tier manager has no pinned pool");
  }
  return Status::Ok();
}

bool TierManager::GrantableLocked(Shard& s, Tier t, Access access,
                                  std::shared_ptr<device::Event>* drain) {
  Copy& c = s.at(t);
  const bool current = IsCurrentLocked(s, t);
  // A writer never gets a device copy that shares the host copy (it would write both).
  const bool idle = c.pins == 0 && c.source_pins == 0 && !c.free_after_writeback &&
                    !(c.shares_host && access != Access::kRead);
  const bool ready_now = current && access == Access::kRead;
  const bool take_over = access == Access::kOverwrite && c.state == Copy::State::kReady && idle;
  const bool exclusive_ready = access == Access::kReadWrite && current && idle;
  if (ready_now && c.shares_host) {
    // The host copy's bytes may still be being written by device work released with a stream
    // (the copy path waits for it on the h2d stream): a reader of the shared bytes waits here.
    Copy& host = s.at(Tier::kHost);
    if (host.in_use_pending && !DrainedLocked(options_.device, host.in_use, &host.in_use_pending)) {
      *drain = host.in_use;
    }
  }
  // Consumer work may still read the bytes a writer is about to overwrite.
  if ((take_over || exclusive_ready) && c.in_use_pending) *drain = c.in_use;
  return ready_now || take_over || exclusive_ready;
}

Lease TierManager::GrantLocked(Shard& s, Tier t, Access access, std::string_view owner,
                               const AcquireWait& wait) {
  Copy& c = s.at(t);
  if (access != Access::kRead) {
    c.overwrite = true;
    c.overwriter = std::this_thread::get_id();
  }
  c.pins++;
  c.holders.push_back({std::string(owner), std::this_thread::get_id()});
  c.last_use = ++tick_;
  CountGrantLocked(s, t, wait);
  Lease lease;
  lease.manager_ = this;
  lease.shard_ = s.id;
  lease.tier_ = t;
  lease.data_ = c.data;
  lease.bytes_ = s.bytes;
  lease.overwrite_ = access == Access::kOverwrite;
  lease.writer_ = access != Access::kRead;
  lease.owner_ = std::string(owner);
  lease.acquirer_ = std::this_thread::get_id();
  return lease;
}

void TierManager::CountGrantLocked(const Shard& s, Tier t, const AcquireWait& wait) {
  const int ti = static_cast<int>(t);
  if (wait.start_ns == 0) {
    if (!wait.counted_miss) stats_[ti].hits++;
    return;
  }
  const int64_t end = clock_.NowNs();
  stats_[ti].stalls++;
  stats_[ti].stall_ns += static_cast<uint64_t>(end - wait.start_ns);
  if (options_.trace != nullptr) {
    options_.trace->Complete(stall_track_, "wait " + s.name, "stall", wait.start_ns, end,
                             {{"tier", static_cast<double>(ti)}});
  }
}

void TierManager::CountMissLocked(Tier t, AcquireWait& wait) {
  if (!wait.counted_miss) {
    wait.counted_miss = true;
    stats_[static_cast<int>(t)].misses++;
  }
  if (wait.start_ns == 0) wait.start_ns = clock_.NowNs();
}

Result<bool> TierManager::UnshareForWriterLocked(Shard& s, Tier t, Access access,
                                                 std::unique_lock<std::mutex>& lock) {
  Copy& c = s.at(t);
  if (access == Access::kRead || t != Tier::kHost || !c.shared_with_device || c.pins != 0 ||
      c.source_pins != 1) {
    return false;
  }
  Copy& dev = s.at(Tier::kDevice);
  if (dev.pins == 0 && dev.source_pins == 0) {
    if (dev.in_use_pending) {
      STRATA_RETURN_IF_ERROR(WaitDrainedLocked(dev.in_use, lock));
      return true;
    }
    stats_[static_cast<int>(Tier::kDevice)].drops++;
    FreeCopyLocked(s, Tier::kDevice);
    return true;
  }
  if (std::any_of(dev.holders.begin(), dev.holders.end(),
                  [](const Copy::Holder& h) { return h.thread == std::this_thread::get_id(); })) {
    // Waiting for the device readers would wait for ourselves.
    return Status(StatusCode::kFailedPrecondition,
                  "shard '" + s.name + "': the calling thread holds a device read lease on " +
                      "it, and that device copy shares the host copy's memory "
                      "(share_host_memory): release the device lease before writing the "
                      "host copy");
  }
  return false;
}

Status TierManager::AdvanceCopyLocked(Shard& s, Tier t, Access access, std::string_view owner,
                                      std::unique_lock<std::mutex>& lock) {
  Copy& c = s.at(t);
  if (c.state == Copy::State::kFilling || c.free_after_writeback || c.pins > 0 ||
      c.source_pins > 0) {
    // In flight, being written back, or (stale and) still held by another lease: wait for it
    // to settle.
    cv_.wait(lock);
    return Status::Ok();
  }
  if (c.state == Copy::State::kReady) return DropStaleLocked(s, t, access, lock);
  if (access == Access::kOverwrite) return ReserveForOverwriteLocked(s, t, owner, lock);
  bool no_room = false;
  Status st = EnsureFillLocked(s, t, /*blocking=*/true, lock, &no_room,
                               /*may_share=*/access == Access::kRead);
  if (!st.ok()) return st.WithContext(AcquireContextLocked(s.id, t, owner));
  return Status::Ok();
}

Status TierManager::DropStaleLocked(Shard& s, Tier t, Access access,
                                    std::unique_lock<std::mutex>& lock) {
  Copy& c = s.at(t);
  // Current, but shared with the host copy, and wanted by a writer: it goes, and the writer
  // fills a copy of its own.
  const bool shared_here = c.shares_host && access != Access::kRead;
  if (!shared_here && IsHome(s, t)) return RefreshHomeLocked(s, t, lock);
  if (c.in_use_pending) return WaitDrainedLocked(c.in_use, lock);
  if (shared_here) stats_[static_cast<int>(t)].drops++;
  FreeCopyLocked(s, t);
  return Status::Ok();
}

Status TierManager::RefreshHomeLocked(Shard& s, Tier t, std::unique_lock<std::mutex>& lock) {
  // Write the current copy of a neighbouring tier back into the home copy (readers of the source
  // may keep reading while it is copied).
  const int ti = static_cast<int>(t);
  int src = -1;
  for (int o : {ti - 1, ti + 1}) {
    if (o >= 0 && o < kNumTiers && WritebackTarget(s, static_cast<Tier>(o)) == t &&
        IsCurrentLocked(s, static_cast<Tier>(o))) {
      src = o;
    }
  }
  if (src >= 0) {
    Status wb = StartWritebackLocked(s, static_cast<Tier>(src), /*free_after=*/false);
    if (wb.ok()) return Status::Ok();
    if (wb.code() != StatusCode::kUnavailable) return wb;
    STRATA_RETURN_IF_ERROR(DrainAnyLocked(s, lock));
  }
  cv_.wait(lock);
  return Status::Ok();
}

Status TierManager::ReserveForOverwriteLocked(Shard& s, Tier t, std::string_view owner,
                                              std::unique_lock<std::mutex>& lock) {
  bool no_room = false;
  Result<Reservation> r = ReserveLocked(t, AllocBytes(s, t), /*blocking=*/true,
                                        /*future_aware=*/false, s.id, lock, &no_room);
  if (!r.ok()) return r.status().WithContext(AcquireContextLocked(s.id, t, owner));
  // (Filled by someone else while this call waited: nothing to do.)
  if (AttachLocked(s, t, *r, /*ready=*/true)) s.at(t).version = kInvalidVersion;
  return Status::Ok();
}

std::string TierManager::AcquireContextLocked(ShardId id, Tier t, std::string_view owner) const {
  const Shard& s = *FindLocked(id);
  return "acquiring shard '" + s.name + "' (" + FormatBytes(s.bytes) + ") in the " +
         std::string(TierName(t)) + " tier for " + std::string(owner.empty() ? "?" : owner);
}

Result<PrefetchOutcome> TierManager::Prefetch(ShardId id, Tier t) {
  if (t == Tier::kNvme) {
    return Status(StatusCode::kInvalidArgument, "cannot prefetch into NVMe");
  }
  std::unique_lock lock(mu_);
  if (!started_) return Status(StatusCode::kFailedPrecondition, "tier manager not started");
  Shard* s = FindLocked(id);
  if (s == nullptr) {
    return Status(StatusCode::kNotFound, "shard " + std::to_string(id) + " is not registered");
  }
  if (t == Tier::kDevice && options_.device == nullptr) {
    return Status(StatusCode::kFailedPrecondition, "the tier manager has no device");
  }
  if (IsCurrentLocked(*s, t)) return PrefetchOutcome::kResident;
  Copy& c = s->at(t);
  if (c.state == Copy::State::kFilling) return PrefetchOutcome::kInFlight;
  if (!s->fill_error.ok()) return PrefetchOutcome::kNoRoom;  // leave the error for the consumer
  if (c.state == Copy::State::kReady) {
    if (IsHome(*s, t) || c.pins > 0 || c.source_pins > 0 || c.free_after_writeback ||
        !DrainedLocked(options_.device, c.in_use, &c.in_use_pending)) {
      return PrefetchOutcome::kNoRoom;
    }
    FreeCopyLocked(*s, t);
  }
  bool no_room = false;
  Status st = EnsureFillLocked(*s, t, /*blocking=*/false, lock, &no_room, /*may_share=*/true);
  if (!st.ok()) {
    if (no_room) return PrefetchOutcome::kNoRoom;
    // A real failure (e.g. the device refused memory): keep it for the consumer's Acquire.
    Shard* s2 = FindLocked(id);
    if (s2->fill_error.ok()) s2->fill_error = st;
    return PrefetchOutcome::kNoRoom;
  }
  return PrefetchOutcome::kIssued;
}

void TierManager::ReleaseLease(Lease& lease, bool dirty, device::Stream* used_on) {
  std::lock_guard lock(mu_);
  Shard& s = *FindLocked(lease.shard_);
  const Tier t = lease.tier_;
  Copy& c = s.at(t);
  c.pins--;
  auto holder = std::find_if(c.holders.begin(), c.holders.end(), [&](const Copy::Holder& h) {
    return h.owner == lease.owner_ && h.thread == lease.acquirer_;
  });
  if (holder != c.holders.end()) c.holders.erase(holder);
  c.last_use = ++tick_;
  if (lease.writer_) c.overwrite = false;
  if (dirty) {
    if (!lease.writer_) {
      STRATA_LOG_ONCE(warn, offload,
                      "shard '{}': a lease acquired for reading (Access::kRead) was released "
                      "dirty; acquire with kReadWrite to modify a copy in place (other readers "
                      "of the copy may have seen its bytes change)",
                      s.name);
    }
    s.version++;
    c.version = s.version;
    // A kRead lease must not be released dirty (see Access). Should a shared one be anyway, the
    // host copy under it holds the same bytes, so it is marked current too; work still writing
    // them on the lease's stream is not tracked for the host copy.
    if (c.shares_host) s.at(Tier::kHost).version = s.version;
    for (int o = 0; o < kNumTiers; ++o) {
      const Tier ot = static_cast<Tier>(o);
      Copy& other = s.copies[o];
      if (ot == t || other.state != Copy::State::kReady || IsHome(s, ot)) continue;
      if (other.pins == 0 && other.source_pins == 0 &&
          DrainedLocked(options_.device, other.in_use, &other.in_use_pending)) {
        FreeCopyLocked(s, ot);
      }
    }
  }
  if (used_on != nullptr && options_.device != nullptr) {
    if (!c.in_use) {
      Result<std::unique_ptr<device::Event>> ev = options_.device->CreateEvent();
      if (ev.ok()) c.in_use = std::shared_ptr<device::Event>(std::move(*ev));
    }
    if (c.in_use && options_.device->Record(*c.in_use, *used_on).ok()) c.in_use_pending = true;
  }
  if (c.pins == 0 && c.source_pins == 0 && !IsHome(s, t) && !IsCurrentLocked(s, t) &&
      c.state == Copy::State::kReady) {
    if (c.in_use_pending && options_.device != nullptr) {
      // Rare: a stale copy with consumer work still running. Keep it until that drains; the
      // evictor frees it (stale copies are the first victims).
    } else {
      FreeCopyLocked(s, t);
    }
  }
  cv_.notify_all();
}

Status TierManager::Evict(ShardId id, Tier t) {
  std::unique_lock lock(mu_);
  Shard* s = FindLocked(id);
  if (s == nullptr) {
    return Status(StatusCode::kNotFound, "shard " + std::to_string(id) + " is not registered");
  }
  if (t == Tier::kNvme || IsHome(*s, t)) return Status::Ok();
  Copy& c = s->at(t);
  if (c.state != Copy::State::kReady || c.pins > 0 || c.source_pins > 0 ||
      c.free_after_writeback) {
    return Status::Ok();
  }
  if (c.in_use_pending && !DrainedLocked(options_.device, c.in_use, &c.in_use_pending)) {
    return Status::Ok();  // consumer work still running; the evictor takes it later
  }
  bool elsewhere = !IsCurrentLocked(*s, t);
  for (int o = 0; o < kNumTiers; ++o) {
    if (o != static_cast<int>(t) && IsCurrentLocked(*s, static_cast<Tier>(o))) elsewhere = true;
  }
  TierStats& st = stats_[static_cast<int>(t)];
  if (elsewhere) {
    st.drops++;
    st.evictions++;
    FreeCopyLocked(*s, t);
    return Status::Ok();
  }
  Status wb = StartWritebackLocked(*s, t, /*free_after=*/true);
  if (wb.code() == StatusCode::kResourceExhausted || wb.code() == StatusCode::kUnavailable) {
    return Status::Ok();  // no room to write it back now; pressure eviction will retry
  }
  if (wb.ok()) st.evictions++;
  return wb;
}

Status TierManager::TakeWritebackError() {
  std::lock_guard lock(mu_);
  if (unreported_writeback_.empty()) return Status::Ok();
  Status first = unreported_writeback_.front().second;
  const size_t more = unreported_writeback_.size() - 1;
  unreported_writeback_.clear();
  if (more > 0) {
    first = Status(first.code(), std::string(first.message()) + " (and " + std::to_string(more) +
                                     " more failed write-back(s))");
  }
  return first;
}

Status TierManager::FlushAll() {
  std::unique_lock lock(mu_);
  Status first_error;
  const auto fail = [&](const Status& st, const Shard& s) {
    if (first_error.ok()) first_error = st.WithContext("flushing '" + s.name + "'");
  };
  for (ShardId id : order_) {
    // Every wait below drops the lock, so each pass re-reads the shard's state from scratch.
    for (;;) {
      Shard& s = *FindLocked(id);
      if (IsCurrentLocked(s, s.home)) break;
      bool filling = false, overwriting = false, mine = false;
      for (const Copy& c : s.copies) {
        filling |= c.state == Copy::State::kFilling;
        overwriting |= c.overwrite;
        mine |= c.overwrite && c.overwriter == std::this_thread::get_id();
      }
      if (filling) {
        cv_.wait(lock);
        continue;
      }
      // The current copy nearest home is written one tier toward it.
      int cur = -1;
      const int home_tier = static_cast<int>(s.home);
      for (int d = 1; d < kNumTiers && cur < 0; ++d) {
        for (int t : {home_tier - d, home_tier + d}) {
          if (t >= 0 && t < kNumTiers && IsCurrentLocked(s, static_cast<Tier>(t))) {
            cur = t;
            break;
          }
        }
      }
      if (cur < 0) {
        if (mine) {
          fail(Status(StatusCode::kFailedPrecondition,
                      "shard '" + s.name + "' is acquired for overwrite by the calling thread; "
                      "release that lease before FlushAll"),
               s);
          break;
        }
        if (overwriting) {  // the only copy is being overwritten: wait for its lease to end
          cv_.wait(lock);
          continue;
        }
        fail(Status(StatusCode::kDataLoss, "shard '" + s.name + "' has no current copy"), s);
        break;
      }
      const Tier from = static_cast<Tier>(cur);
      const Tier target = WritebackTarget(s, from);
      Copy& dst = s.at(target);
      if (target == Tier::kHost && !IsHome(s, target) && dst.state == Copy::State::kAbsent) {
        bool no_room = false;
        Result<Reservation> r =
            ReserveLocked(Tier::kHost, AllocBytes(s, Tier::kHost), true, false, id, lock, &no_room);
        if (!r.ok()) {
          fail(r.status(), s);
          break;
        }
        Copy& h = s.at(Tier::kHost);
        if (h.state != Copy::State::kAbsent) {
          UnreserveLocked(Tier::kHost, *r);
          continue;
        }
        // The write-back's destination: a host copy holding no version yet.
        h.data = r->data;
        h.block = r->block;
        h.reserved = r->reserved;
        h.state = Copy::State::kReady;
        h.version = kInvalidVersion;
        continue;
      }
      Status wb = StartWritebackLocked(s, from, /*free_after=*/false);
      if (wb.code() == StatusCode::kUnavailable) {
        // Consumer work still using a copy, or the destination held by a reader.
        bool pending = false;
        for (const Copy& c : s.copies) pending |= c.in_use_pending;
        if (pending) {
          Status d = DrainAnyLocked(s, lock);
          if (!d.ok()) {
            fail(d, *FindLocked(id));
            break;
          }
        } else {
          cv_.wait(lock);
        }
        continue;
      }
      if (!wb.ok()) {
        fail(wb, s);
        break;
      }
      while (FindLocked(id)->at(target).state == Copy::State::kFilling) cv_.wait(lock);
      Shard& after = *FindLocked(id);
      if (!after.writeback_error.ok()) {
        fail(std::exchange(after.writeback_error, Status::Ok()), after);
        break;
      }
    }
  }
  return first_error;
}

void TierManager::SetEvictionOracle(EvictionOracle oracle) {
  std::lock_guard lock(mu_);
  oracle_ = std::move(oracle);
}

void TierManager::WaitIdle() {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [this] { return in_flight_ == 0; });
}

TierStats TierManager::stats(Tier tier) const {
  std::lock_guard lock(mu_);
  return stats_[static_cast<int>(tier)];
}

uint64_t TierManager::shard_bytes(ShardId id) const {
  std::lock_guard lock(mu_);
  const Shard* s = FindLocked(id);
  return s == nullptr ? 0 : s->bytes;
}

Result<Tier> TierManager::home(ShardId id) const {
  std::lock_guard lock(mu_);
  const Shard* s = FindLocked(id);
  if (s == nullptr) {
    return Status(StatusCode::kNotFound, "shard " + std::to_string(id) + " is not registered");
  }
  return s->home;
}

bool TierManager::IsCurrent(ShardId id, Tier t) const {
  std::lock_guard lock(mu_);
  const Shard* s = FindLocked(id);
  return s != nullptr && IsCurrentLocked(*s, t);
}

}  // namespace strata::offload
