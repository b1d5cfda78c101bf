#include "strata/trace.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <numeric>

#include "common/errno.h"

namespace strata {

namespace {

using OrderedJson = nlohmann::ordered_json;

// Chrome's trace viewer wants microseconds; fractions keep nanosecond resolution.
double Micros(int64_t ns) {
  return static_cast<double>(ns) / 1e3;
}

// Whole numbers (byte counts, offsets, ids: most arguments) are written without a fraction.
OrderedJson ArgValue(double value) {
  constexpr double kExact = 9007199254740992.0;  // 2^53: integers beyond are not exact anyway
  if (std::isfinite(value) && std::trunc(value) == value && std::fabs(value) < kExact) {
    return static_cast<int64_t>(value);
  }
  return value;
}


// A name for the temporary file next to `path`, unique within this host (pid) and process
// (counter).
std::string TemporaryName(const std::filesystem::path& path) {
  static std::atomic<uint64_t> counter{0};
  std::filesystem::path tmp = path;
  tmp.replace_filename(fmt::format(".{}.tmp-{}-{}", path.filename().string(), ::getpid(),
                                   counter.fetch_add(1, std::memory_order_relaxed)));
  return tmp.string();
}

}  // namespace

TraceRecorder::TraceRecorder(int process_id, std::string process_name, size_t max_events)
    : process_id_(process_id), process_name_(std::move(process_name)), max_events_(max_events) {}

int64_t TraceRecorder::NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

uint32_t TraceRecorder::Track(std::string_view name) {
  std::lock_guard lock(mu_);
  if (auto it = track_ids_.find(name); it != track_ids_.end()) return it->second;
  const auto id = static_cast<uint32_t>(tracks_.size());
  tracks_.emplace_back(name);
  track_ids_.emplace(std::string(name), id);
  return id;
}

void TraceRecorder::Complete(uint32_t track, std::string_view name, std::string_view category,
                             int64_t start_ns, int64_t end_ns,
                             std::vector<std::pair<std::string, double>> args) {
  // Build the event before taking the lock so that the critical section is one push_back. An end
  // before the start (a caller mixing clocks) is clamped to a zero-length event rather than
  // producing a negative duration that viewers reject.
  TraceEvent event;
  event.track = track;
  event.name = std::string(name);
  event.category = std::string(category);
  event.start_ns = start_ns;
  event.end_ns = std::max(start_ns, end_ns);
  event.args = std::move(args);
  std::lock_guard lock(mu_);
  if (events_.size() >= max_events_) {
    ++dropped_;
    return;
  }
  events_.push_back(std::move(event));
}

std::vector<TraceEvent> TraceRecorder::Events() const {
  std::lock_guard lock(mu_);
  return events_;
}

std::vector<std::string> TraceRecorder::TrackNames() const {
  std::lock_guard lock(mu_);
  return tracks_;
}

size_t TraceRecorder::dropped() const {
  std::lock_guard lock(mu_);
  return dropped_;
}

std::string TraceRecorder::ToChromeJson() const {
  std::lock_guard lock(mu_);
  // The document is assembled as text, one event at a time: a DOM of millions of events would
  // take several times the memory of the text.
  std::string out = "{\"traceEvents\":[\n";
  bool first = true;
  auto append = [&](const OrderedJson& event) {
    if (!first) out += ",\n";
    first = false;
    out += event.dump();
  };

  append(OrderedJson{{"name", "process_name"},
                     {"ph", "M"},
                     {"pid", process_id_},
                     {"tid", 0},
                     {"args", {{"name", process_name_}}}});
  for (size_t i = 0; i < tracks_.size(); ++i) {
    // tid 0 is left unused: some viewers treat it as the process itself.
    const uint64_t tid = i + 1;
    append(OrderedJson{{"name", "thread_name"},
                       {"ph", "M"},
                       {"pid", process_id_},
                       {"tid", tid},
                       {"args", {{"name", tracks_[i]}}}});
    append(OrderedJson{{"name", "thread_sort_index"},
                       {"ph", "M"},
                       {"pid", process_id_},
                       {"tid", tid},
                       {"args", {{"sort_index", i}}}});
  }

  // Complete events by start time (recording order among equal starts), so that a reader sees
  // the timeline in order; timestamps are relative to the earliest start.
  std::vector<size_t> order(events_.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [this](size_t a, size_t b) {
    return events_[a].start_ns < events_[b].start_ns;
  });
  const int64_t origin = order.empty() ? 0 : events_[order.front()].start_ns;
  for (size_t index : order) {
    const TraceEvent& e = events_[index];
    OrderedJson args = OrderedJson::object();
    for (const auto& [key, value] : e.args)
      args[key] = ArgValue(value);
    append(OrderedJson{{"name", e.name},
                       {"cat", e.category},
                       {"ph", "X"},
                       {"pid", process_id_},
                       {"tid", uint64_t{e.track} + 1},
                       {"ts", Micros(e.start_ns - origin)},
                       {"dur", Micros(e.end_ns - e.start_ns)},
                       {"args", std::move(args)}});
  }
  out += "\n],\"displayTimeUnit\":\"ms\"}\n";
  return out;
}

Status TraceRecorder::WriteChromeJson(const std::string& path, FileSystem& fs) const {
  if (path.empty()) return InvalidArgumentError("trace file: the path is empty");
  const std::string json = ToChromeJson();
  const std::string context = fmt::format("writing trace {}", path);
  const std::string tmp = TemporaryName(std::filesystem::path(path));
  Status st = WriteFileDurable(fs, tmp, json);
  if (st.ok()) st = fs.Rename(tmp, path);
  if (!st.ok()) {
    (void)fs.RemoveAll(tmp);
    return st.WithContext(context);
  }
  // Make the rename itself durable. Best effort: some file systems refuse to sync a directory,
  // and the file's contents are already safe.
  (void)fs.SyncDir(ParentDir(path));
  return Status::Ok();
}

}  // namespace strata
