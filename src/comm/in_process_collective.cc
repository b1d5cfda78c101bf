#include "comm/in_process_collective.h"

#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "comm/op.h"

namespace strata::comm {

namespace {

constexpr std::string_view kBackend = "in-process";

// Where a rank is in one operation.
enum class Stage : uint8_t {
  kTurn,    // waiting for its own previous operation
  kArrive,  // arrived, waiting for the others
  kDepart,  // done reading the others' buffers, waiting for them to be done with its own
};

// Operation k of every rank: the arguments each rank brought, and how far the ranks got.
struct Meeting {
  explicit Meeting(int world)
      : descs(static_cast<size_t>(world)), departed(static_cast<size_t>(world)) {}
  std::vector<std::optional<internal::OpDesc>> descs;  // per rank, once it arrived
  std::vector<char> departed;                          // per rank: finished reading
  int arrived = 0;
  int departures = 0;
  int left = 0;  // ranks past the departure; the last one erases the meeting
};

// Split k of every rank: each rank's (color, key), and the sub-worlds once every rank arrived.
struct SplitMeeting {
  explicit SplitMeeting(int world) : args(static_cast<size_t>(world)) {}
  std::vector<std::optional<std::pair<int, int>>> args;  // per rank, once it arrived
  int arrived = 0;
  std::map<int, std::shared_ptr<InProcessWorld>> worlds;  // by color, made by the first to leave
  int taken = 0;  // ranks that took their sub-world; the last one erases the meeting
};

}  // namespace

struct InProcessWorld::State {
  explicit State(const InProcessOptions& o)
      : options(o), clock(o.clock != nullptr ? o.clock : &RealClock()), world(o.world_size) {
    ranks.resize(static_cast<size_t>(world));
  }

  struct Rank {
    bool joined = false;
    bool left = false;       // its Collective was destroyed
    uint64_t completed = 0;  // the sequence number of its last finished operation
  };

  const InProcessOptions options;
  Clock* const clock;
  const int world;

  std::mutex mu;  // guards everything below
  std::condition_variable cv;
  std::vector<Rank> ranks;
  std::map<uint64_t, Meeting> meetings;
  std::map<uint64_t, SplitMeeting> splits;  // by split number (1, 2, ... per rank)
  Status failure;  // the world's first failure
  int failed_rank = -1;

  // Makes `error` (of rank `rank`) the world's failure unless there is one already.
  void FailLocked(int rank, const Status& error) {
    if (failure.ok()) {
      failure = error;
      failed_rank = rank;
    }
    cv.notify_all();
  }
};

namespace {

// One enqueued operation of one rank.
struct Op {
  internal::OpDesc desc;
  uint64_t seq = 0;
  std::string name;  // "in-process all-reduce #3 (1000 x fp32, sum) on rank 1"
  bool ran = false;  // its host task started (guarded by the world's mutex)
};

bool SameOperation(const internal::OpDesc& a, const internal::OpDesc& b) {
  using internal::OpKind;
  if (a.kind != b.kind || a.count != b.count) return false;
  switch (a.kind) {
    case OpKind::kAllGather:
    case OpKind::kAllToAll:
      return a.dtype == b.dtype;
    case OpKind::kReduceScatter:
    case OpKind::kAllReduce:
      return a.dtype == b.dtype && a.op == b.op;
    case OpKind::kBroadcast:
      return a.root == b.root;
    case OpKind::kBarrier:
      return true;
  }
  return false;
}

class InProcessCollective final : public internal::OpCollective {
 public:
  InProcessCollective(std::shared_ptr<InProcessWorld::State> state, int rank,
                      device::Device& device)
      : s_(std::move(state)), rank_(rank), device_(device) {}

  ~InProcessCollective() override {
    std::lock_guard lock(s_->mu);
    s_->ranks[static_cast<size_t>(rank_)].left = true;
    s_->cv.notify_all();
  }

  Backend backend() const override { return Backend::kInProcess; }
  int rank() const override { return rank_; }
  int world_size() const override { return s_->world; }
  // A sub-world of the ranks with this color, over the same threads and devices.
  Result<std::unique_ptr<Collective>> Split(int color, int key) override;

 private:
  using Clock = strata::Clock;

  Status Run(const internal::OpDesc& desc, device::Stream& stream) override;
  // The host task: steps 1-5 of the header, on the stream's thread.
  Status Execute(Op& op);
  // The Notify after it: a task the device skipped (sticky error) fails the world.
  void AfterTask(Op& op, const Status& device_status);

  // Waits (lock held) until `ready()`, the world fails, a rank this one waits for left, or the
  // deadline passes.
  template <typename Ready>
  Status WaitLocked(std::unique_lock<std::mutex>& lock, const Op& op, Stage stage,
                    Clock::TimePoint deadline, Ready&& ready);
  // Whether a rank `op` waits for at `stage` has left the world (it never will arrive).
  bool AwaitedRankLeft(const Op& op, Stage stage) const;
  // What `op` waits for at `stage`, for messages: this rank's previous operation, or the ranks
  // that have not arrived (departed) with why.
  std::string Awaited(const Op& op, Stage stage) const;
  // The world's failure as this rank reports it, for operation `what`: its own error, or Aborted
  // naming the rank that failed.
  Status FailureLocked(std::string_view what) const;
  // Step 4: this rank's result from every rank's arguments. An in-place all-reduce writes
  // `scratch` (copied to recv after the departure).
  void Compute(const std::vector<internal::OpDesc>& descs, std::vector<std::byte>* scratch) const;

  const std::shared_ptr<InProcessWorld::State> s_;
  const int rank_;
  device::Device& device_;
  std::mutex submit_mu_;  // serialises Run, so that sequence numbers follow enqueue order
  uint64_t next_seq_ = 0;
  uint64_t next_split_ = 0;  // guarded by the world's mutex
};

Result<std::unique_ptr<Collective>> InProcessCollective::Split(int color, int key) {
  STRATA_RETURN_IF_ERROR(internal::ValidateSplit(kBackend, color));
  InProcessWorld::State& s = *s_;
  std::unique_lock lock(s.mu);
  const uint64_t seq = ++next_split_;
  const std::string name = fmt::format("{} split #{} on rank {}", kBackend, seq, rank_);
  if (!s.failure.ok()) return FailureLocked(name);
  const Clock::TimePoint deadline =
      s.clock->Now() + std::chrono::duration_cast<Clock::Duration>(s.options.timeout);
  SplitMeeting& m = s.splits.try_emplace(seq, s.world).first->second;
  m.args[static_cast<size_t>(rank_)] = std::pair{color, key};
  ++m.arrived;
  s.cv.notify_all();
  for (;;) {
    if (!s.failure.ok()) return FailureLocked(name);
    if (m.arrived == s.world) break;
    std::string missing;
    bool left = false;
    for (int q = 0; q < s.world; ++q) {
      if (m.args[static_cast<size_t>(q)].has_value()) continue;
      left = left || s.ranks[static_cast<size_t>(q)].left;
      missing += fmt::format("{}{}", missing.empty() ? "" : ", ", q);
    }
    Status error;
    if (left) {
      error = AbortedError(fmt::format("{}: rank(s) {} left the world before splitting it", name,
                                       missing));
    } else if (s.clock->Now() >= deadline) {
      error = DeadlineExceededError(fmt::format("{}: rank(s) {} did not split within {} ms", name,
                                                missing, s.options.timeout.count()));
    } else {
      s.clock->WaitUntil(s.cv, lock, deadline);
      continue;
    }
    s.FailLocked(rank_, error);
    return error;
  }
  std::vector<std::pair<int, int>> args;
  for (const auto& a : m.args)
    args.push_back(*a);
  const internal::SplitPlace place = internal::PlaceInSplit(args, rank_);
  if (m.worlds.empty()) {  // the first rank past the meeting makes every color's world
    for (const auto& a : args) {
      const int c = a.first;
      if (m.worlds.contains(c)) continue;
      const auto size = std::count_if(args.begin(), args.end(),
                                      [&](const auto& b) { return b.first == c; });
      InProcessOptions options = s.options;
      options.world_size = static_cast<int>(size);
      STRATA_ASSIGN_OR_RETURN(m.worlds[c], InProcessWorld::Create(options));
    }
  }
  std::shared_ptr<InProcessWorld> sub = m.worlds.at(color);
  if (++m.taken == s.world) s.splits.erase(seq);
  lock.unlock();
  return sub->Join(place.rank, device_);
}

Status InProcessCollective::Run(const internal::OpDesc& desc, device::Stream& stream) {
  STRATA_RETURN_IF_ERROR(internal::ValidateOp(kBackend, desc, rank_, s_->world));
  std::lock_guard submit(submit_mu_);
  {
    std::lock_guard lock(s_->mu);
    if (!s_->failure.ok()) {
      return FailureLocked(
          fmt::format("{} {} on rank {}", kBackend, internal::OpKindName(desc.kind), rank_));
    }
  }
  // An empty operation is empty on every rank (the counts must agree): nothing to run.
  if (internal::IsEmpty(desc)) return Status::Ok();
  auto op = std::make_shared<Op>();
  op->desc = desc;
  op->seq = next_seq_ + 1;
  op->name = fmt::format("{} {} on rank {}", kBackend, internal::DescribeOp(desc, op->seq), rank_);
  STRATA_RETURN_IF_ERROR(device_.HostTask(
      stream, [this, op] { return Execute(*op); }, op->name));
  ++next_seq_;
  // Fails only after a device failure (sticky error); the task will then be skipped too.
  Status notified = device_.Notify(stream, [this, op](const Status& st) { AfterTask(*op, st); });
  if (!notified.ok()) AfterTask(*op, notified);
  return notified;
}

void InProcessCollective::AfterTask(Op& op, const Status& device_status) {
  std::lock_guard lock(s_->mu);
  if (op.ran) return;
  op.ran = true;  // (AfterTask may be called twice: by Run and by the device)
  s_->FailLocked(rank_,
                 AbortedError(fmt::format(
                     "{}: not run: its stream failed first: {}", op.name,
                     device_status.ok() ? "its host task did not run" : device_status.ToString())));
}

Status InProcessCollective::Execute(Op& op) {
  std::unique_lock lock(s_->mu);
  op.ran = true;
  InProcessWorld::State& s = *s_;
  const Clock::TimePoint deadline =
      s.clock->Now() + std::chrono::duration_cast<Clock::Duration>(s.options.timeout);
  const auto r = static_cast<size_t>(rank_);
  // 1. This rank's earlier operation first (it may be on another stream).
  STRATA_RETURN_IF_ERROR(WaitLocked(lock, op, Stage::kTurn, deadline,
                                    [&] { return s.ranks[r].completed + 1 == op.seq; }));
  // 2. Arrive.
  Meeting& m = s.meetings.try_emplace(op.seq, s.world).first->second;
  m.descs[r] = op.desc;
  ++m.arrived;
  s.cv.notify_all();
  STRATA_RETURN_IF_ERROR(
      WaitLocked(lock, op, Stage::kArrive, deadline, [&] { return m.arrived == s.world; }));
  // 3. Agree.
  std::vector<internal::OpDesc> descs;
  for (const auto& d : m.descs)
    descs.push_back(*d);
  for (int q = 1; q < s.world; ++q) {
    if (!SameOperation(descs[0], descs[static_cast<size_t>(q)])) {
      Status error = InvalidArgumentError(fmt::format(
          "{}: the ranks disagree on the operation: rank 0 enqueued {}, rank {} enqueued {}",
          op.name, internal::DescribeOp(descs[0], op.seq), q,
          internal::DescribeOp(descs[static_cast<size_t>(q)], op.seq)));
      s.FailLocked(rank_, error);
      return error;
    }
  }
  // 4. Compute, reading the others' buffers (their writes happened before they arrived).
  lock.unlock();
  std::vector<std::byte> scratch;
  Compute(descs, &scratch);
  lock.lock();
  // 5. Depart once every rank has read what it needs from this one.
  m.departed[r] = 1;
  ++m.departures;
  s.cv.notify_all();
  STRATA_RETURN_IF_ERROR(
      WaitLocked(lock, op, Stage::kDepart, deadline, [&] { return m.departures == s.world; }));
  if (++m.left == s.world) s.meetings.erase(op.seq);
  lock.unlock();
  if (!scratch.empty()) std::memcpy(op.desc.recv, scratch.data(), scratch.size());
  lock.lock();
  s.ranks[r].completed = op.seq;
  s.cv.notify_all();
  return Status::Ok();
}

template <typename Ready>
Status InProcessCollective::WaitLocked(std::unique_lock<std::mutex>& lock, const Op& op,
                                       Stage stage, Clock::TimePoint deadline, Ready&& ready) {
  for (;;) {
    if (!s_->failure.ok()) return FailureLocked(op.name);
    if (ready()) return Status::Ok();
    Status error;
    if (AwaitedRankLeft(op, stage)) {
      error = AbortedError(
          fmt::format("{}: waiting for {}: the ranks did not enqueue the same collectives",
                      op.name, Awaited(op, stage)));
    } else if (s_->clock->Now() >= deadline) {
      error = DeadlineExceededError(fmt::format("{}: no progress within {} ms: waiting for {}",
                                                op.name, s_->options.timeout.count(),
                                                Awaited(op, stage)));
    } else {
      s_->clock->WaitUntil(s_->cv, lock, deadline);
      continue;
    }
    s_->FailLocked(rank_, error);
    return error;
  }
}

bool InProcessCollective::AwaitedRankLeft(const Op& op, Stage stage) const {
  if (stage != Stage::kArrive) return false;  // a rank leaves only after its last operation
  const Meeting& m = s_->meetings.at(op.seq);
  for (int q = 0; q < s_->world; ++q) {
    const auto at = static_cast<size_t>(q);
    if (!m.descs[at].has_value() && s_->ranks[at].left) return true;
  }
  return false;
}

std::string InProcessCollective::Awaited(const Op& op, Stage stage) const {
  if (stage == Stage::kTurn) {
    return fmt::format("this rank's previous operation #{} (its stream has not reached it)",
                       op.seq - 1);
  }
  const Meeting& m = s_->meetings.at(op.seq);
  std::string out;
  for (int q = 0; q < s_->world; ++q) {
    const auto at = static_cast<size_t>(q);
    if (stage == Stage::kArrive ? m.descs[at].has_value() : m.departed[at] != 0) continue;
    const InProcessWorld::State::Rank& peer = s_->ranks[at];
    std::string why;
    if (stage == Stage::kDepart) {
      why = "still reading this rank's buffers";
    } else if (!peer.joined) {
      why = "never joined the world";
    } else if (peer.left) {
      why = fmt::format("left the world after completing #{}", peer.completed);
    } else {
      why = fmt::format("has not reached this operation: it completed #{}", peer.completed);
    }
    out += fmt::format("{}rank {} ({})", out.empty() ? "" : "; ", q, why);
  }
  return out;
}

Status InProcessCollective::FailureLocked(std::string_view what) const {
  if (s_->failed_rank == rank_) return s_->failure;
  return AbortedError(
      fmt::format("{}: rank {} failed: {}", what, s_->failed_rank, s_->failure.ToString()));
}

void InProcessCollective::Compute(const std::vector<internal::OpDesc>& descs,
                                  std::vector<std::byte>* scratch) const {
  using internal::OpKind;
  const internal::OpDesc& mine = descs[static_cast<size_t>(rank_)];
  const auto world = static_cast<size_t>(s_->world);
  const size_t n = mine.count;
  const size_t elem = device::DTypeSize(mine.dtype);
  auto* recv = static_cast<std::byte*>(mine.recv);
  std::vector<const std::byte*> sources(world);
  switch (mine.kind) {
    case OpKind::kAllGather:
      for (size_t q = 0; q < world; ++q) {
        std::byte* to = recv + q * n * elem;
        if (to != descs[q].send) std::memcpy(to, descs[q].send, n * elem);
      }
      return;
    case OpKind::kReduceScatter:
      for (size_t q = 0; q < world; ++q) {
        sources[q] =
            static_cast<const std::byte*>(descs[q].send) + static_cast<size_t>(rank_) * n * elem;
      }
      internal::ReduceInRankOrder(sources.data(), world, mine.dtype, mine.op, recv, n);
      return;
    case OpKind::kAllReduce: {
      for (size_t q = 0; q < world; ++q)
        sources[q] = static_cast<const std::byte*>(descs[q].send);
      std::byte* out = recv;
      if (internal::IsInPlace(mine, rank_)) {  // the others read this buffer until departure
        scratch->resize(n * elem);
        out = scratch->data();
      }
      internal::ReduceInRankOrder(sources.data(), world, mine.dtype, mine.op, out, n);
      return;
    }
    case OpKind::kAllToAll:
      for (size_t q = 0; q < world; ++q) {
        std::memcpy(recv + q * n * elem,
                    static_cast<const std::byte*>(descs[q].send) +
                        static_cast<size_t>(rank_) * n * elem,
                    n * elem);
      }
      return;
    case OpKind::kBroadcast:
      if (rank_ != mine.root) {
        std::memcpy(recv, descs[static_cast<size_t>(mine.root)].recv, mine.count);
      }
      return;
    case OpKind::kBarrier:
      return;
  }
}

}  // namespace

InProcessWorld::InProcessWorld(std::shared_ptr<State> state) : state_(std::move(state)) {}

InProcessWorld::~InProcessWorld() = default;

Result<std::shared_ptr<InProcessWorld>> InProcessWorld::Create(const InProcessOptions& options) {
  if (options.world_size < 1) {
    return InvalidArgumentError(
        fmt::format("in-process world: world size must be at least 1, got {}", options.world_size));
  }
  if (options.timeout.count() <= 0) {
    return InvalidArgumentError(
        fmt::format("in-process world: collective timeout must be positive, got {} ms",
                    options.timeout.count()));
  }
  return std::shared_ptr<InProcessWorld>(new InProcessWorld(std::make_shared<State>(options)));
}

int InProcessWorld::world_size() const {
  return state_->world;
}

Status InProcessWorld::failure() const {
  std::lock_guard lock(state_->mu);
  return state_->failure;
}

Result<std::unique_ptr<Collective>> InProcessWorld::Join(int rank, device::Device& device) {
  if (device.type() != device::DeviceType::kCpu) {
    return InvalidArgumentError(fmt::format(
        "the in-process backend works on the cpu device (ranks read each other's device memory); "
        "'{}' is a {} device",
        device.name(), device::DeviceTypeName(device.type())));
  }
  std::lock_guard lock(state_->mu);
  if (rank < 0 || rank >= state_->world) {
    return InvalidArgumentError(fmt::format(
        "in-process world: rank {} is not a rank of a world of {}", rank, state_->world));
  }
  State::Rank& r = state_->ranks[static_cast<size_t>(rank)];
  if (r.joined) {
    return InvalidArgumentError(fmt::format("in-process world: rank {} joined already", rank));
  }
  r.joined = true;
  return std::unique_ptr<Collective>(std::make_unique<InProcessCollective>(state_, rank, device));
}

}  // namespace strata::comm
