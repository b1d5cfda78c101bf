// TraceRecorder: a timeline of asynchronous work (I/O requests, copies, compute, collectives,
// optimizer work), written as Chrome trace-event JSON that chrome://tracing and ui.perfetto.dev
// open directly.
//
// Each event lies on a track: one per stream, I/O queue or host thread ("io", "copy", "compute",
// ...). Tracks become Chrome "threads" of one process (the rank), so overlap between tracks is
// visible at a glance. Events are "complete" events (start + duration) with a name, a category
// and optional numeric arguments (bytes, shard id, ...).
//
// Cost: recording takes a short lock and appends to a vector; with no recorder attached (a null
// TraceRecorder*), callers skip it entirely. Memory grows with the number of events, so a
// recorder is meant for a bounded run (a few steps), not a whole training job; `max_events`
// caps it (later events are counted as dropped).
//
// Threading: every method may be called from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "strata/file_system.h"
#include "strata/status.h"

namespace strata {

struct TraceEvent {
  uint32_t track = 0;
  std::string name;
  std::string category;
  int64_t start_ns = 0;  // TraceRecorder::NowNs() clock
  int64_t end_ns = 0;
  std::vector<std::pair<std::string, double>> args;
};

class TraceRecorder {
 public:
  // `process_id` is the Chrome pid (the rank); `process_name` labels it ("rank 0").
  explicit TraceRecorder(int process_id = 0, std::string process_name = "strata",
                         size_t max_events = 4'000'000);

  // Monotonic nanoseconds (steady clock). Use it for start/end so events line up.
  static int64_t NowNs();

  // The id of the track called `name`, created on first use. The same name gives the same id.
  uint32_t Track(std::string_view name);

  // Records one finished operation on `track`. end_ns >= start_ns.
  void Complete(uint32_t track, std::string_view name, std::string_view category, int64_t start_ns,
                int64_t end_ns, std::vector<std::pair<std::string, double>> args = {});

  // Copies of what was recorded so far, in recording order.
  std::vector<TraceEvent> Events() const;
  std::vector<std::string> TrackNames() const;  // index = track id
  size_t dropped() const;

  // The Chrome trace-event JSON document ({"traceEvents": [...], "displayTimeUnit": "ms"}), with
  // metadata events naming the process and each track, and timestamps in microseconds relative
  // to the first event.
  std::string ToChromeJson() const;
  // Writes ToChromeJson() to `path` atomically (temporary name, then rename). Errors name the path.
  Status WriteChromeJson(const std::string& path, FileSystem& fs = LocalFileSystem()) const;

 private:
  int process_id_;
  std::string process_name_;
  size_t max_events_;
  mutable std::mutex mu_;
  std::vector<std::string> tracks_;                         // index = track id
  std::map<std::string, uint32_t, std::less<>> track_ids_;  // name -> id
  std::vector<TraceEvent> events_;
  size_t dropped_ = 0;
};

// Records [construction, destruction) as one event when `recorder` is not null.
class ScopedTrace {
 public:
  ScopedTrace(TraceRecorder* recorder, uint32_t track, std::string_view name,
              std::string_view category)
      : recorder_(recorder),
        track_(track),
        name_(name),
        category_(category),
        start_ns_(recorder ? TraceRecorder::NowNs() : 0) {}
  ~ScopedTrace() {
    if (recorder_ != nullptr) {
      recorder_->Complete(track_, name_, category_, start_ns_, TraceRecorder::NowNs());
    }
  }
  ScopedTrace(const ScopedTrace&) = delete;
  ScopedTrace& operator=(const ScopedTrace&) = delete;

 private:
  TraceRecorder* recorder_;
  uint32_t track_;
  std::string_view name_;
  std::string_view category_;
  int64_t start_ns_;
};

}  // namespace strata
