#include "strata/trace.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "test_support.h"

namespace strata {
namespace {

using nlohmann::json;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::TempDir;

// The "X" events of a parsed document, in document order.
std::vector<json> CompleteEvents(const json& doc) {
  std::vector<json> out;
  for (const json& e : doc.at("traceEvents")) {
    if (e.at("ph") == "X") out.push_back(e);
  }
  return out;
}

// tid -> track name from the "thread_name" metadata events.
std::map<int, std::string> ThreadNames(const json& doc) {
  std::map<int, std::string> out;
  for (const json& e : doc.at("traceEvents")) {
    if (e.at("ph") == "M" && e.at("name") == "thread_name") {
      out[e.at("tid").get<int>()] = e.at("args").at("name").get<std::string>();
    }
  }
  return out;
}

std::string ReadFile(const std::string& path) {
  std::vector<char> bytes = testing::ReadWholeFile(path);
  return std::string(bytes.begin(), bytes.end());
}

TEST(TraceRecorderTest, TracksAreInternedByName) {
  TraceRecorder trace;
  const uint32_t io = trace.Track("io");
  const uint32_t copy = trace.Track("copy");
  EXPECT_EQ(io, 0u);
  EXPECT_EQ(copy, 1u);
  EXPECT_EQ(trace.Track("io"), io);
  EXPECT_EQ(trace.Track(std::string("copy")), copy);
  EXPECT_THAT(trace.TrackNames(), ElementsAre("io", "copy"));
}

TEST(TraceRecorderTest, NowIsMonotonic) {
  const int64_t a = TraceRecorder::NowNs();
  const int64_t b = TraceRecorder::NowNs();
  EXPECT_LE(a, b);
}

TEST(TraceRecorderTest, EventsKeepRecordingOrderAndFields) {
  TraceRecorder trace;
  const uint32_t t = trace.Track("io");
  trace.Complete(t, "read", "io", 2000, 5000, {{"bytes", 4096}, {"offset", 8192}});
  trace.Complete(t, "write", "io", 1000, 1500);
  std::vector<TraceEvent> events = trace.Events();
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].name, "read");
  EXPECT_EQ(events[0].category, "io");
  EXPECT_EQ(events[0].start_ns, 2000);
  EXPECT_EQ(events[0].end_ns, 5000);
  ASSERT_EQ(events[0].args.size(), 2u);
  EXPECT_EQ(events[0].args[0].first, "bytes");
  EXPECT_EQ(events[0].args[0].second, 4096);
  EXPECT_EQ(events[1].name, "write");
  EXPECT_TRUE(events[1].args.empty());
  EXPECT_EQ(trace.dropped(), 0u);
}

TEST(TraceRecorderTest, ChromeJsonHasMetadataAndCompleteEvents) {
  TraceRecorder trace(/*process_id=*/3, "rank 3");
  const uint32_t io = trace.Track("io q0");
  const uint32_t copy = trace.Track("copy");
  // Recorded out of start order; the document lists them by start time.
  trace.Complete(copy, "h2d", "copy", 11'000'000, 11'002'500, {{"bytes", 1 << 20}});
  trace.Complete(io, "read", "io", 10'000'000, 10'004'000, {{"bytes", 4096}, {"offset", 8192}});

  const json doc = json::parse(trace.ToChromeJson());
  EXPECT_EQ(doc.at("displayTimeUnit"), "ms");
  ASSERT_TRUE(doc.at("traceEvents").is_array());

  // Metadata: the process name, and a name and sort index per track with tid = track id + 1.
  int process_names = 0;
  std::map<int, int> sort_index;
  for (const json& e : doc.at("traceEvents")) {
    EXPECT_EQ(e.at("pid"), 3);
    if (e.at("ph") != "M") continue;
    if (e.at("name") == "process_name") {
      ++process_names;
      EXPECT_EQ(e.at("args").at("name"), "rank 3");
    } else if (e.at("name") == "thread_sort_index") {
      sort_index[e.at("tid").get<int>()] = e.at("args").at("sort_index").get<int>();
    }
  }
  EXPECT_EQ(process_names, 1);
  EXPECT_EQ(ThreadNames(doc), (std::map<int, std::string>{{1, "io q0"}, {2, "copy"}}));
  EXPECT_EQ(sort_index, (std::map<int, int>{{1, 0}, {2, 1}}));

  // Complete events: microseconds relative to the earliest start, by start time.
  std::vector<json> x = CompleteEvents(doc);
  ASSERT_EQ(x.size(), 2u);
  EXPECT_EQ(x[0].at("name"), "read");
  EXPECT_EQ(x[0].at("cat"), "io");
  EXPECT_EQ(x[0].at("tid"), io + 1);
  EXPECT_DOUBLE_EQ(x[0].at("ts").get<double>(), 0.0);
  EXPECT_DOUBLE_EQ(x[0].at("dur").get<double>(), 4.0);
  EXPECT_EQ(x[0].at("args").at("bytes"), 4096);
  EXPECT_EQ(x[0].at("args").at("offset"), 8192);
  EXPECT_EQ(x[1].at("name"), "h2d");
  EXPECT_EQ(x[1].at("cat"), "copy");
  EXPECT_EQ(x[1].at("tid"), copy + 1);
  EXPECT_DOUBLE_EQ(x[1].at("ts").get<double>(), 1000.0);
  EXPECT_DOUBLE_EQ(x[1].at("dur").get<double>(), 2.5);
  EXPECT_EQ(x[1].at("args").at("bytes"), 1 << 20);
}

TEST(TraceRecorderTest, EmptyRecorderIsAValidDocument) {
  TraceRecorder trace;
  const json doc = json::parse(trace.ToChromeJson());
  EXPECT_TRUE(CompleteEvents(doc).empty());
  EXPECT_EQ(doc.at("traceEvents").size(), 1u);  // the process name
}

TEST(TraceRecorderTest, NamesAreEscaped) {
  TraceRecorder trace(0, "proc \"quoted\"\n");
  const uint32_t t = trace.Track("track \\ with \"quotes\"");
  trace.Complete(t, "name\twith\ttabs", "cat", 0, 1);
  const json doc = json::parse(trace.ToChromeJson());
  EXPECT_EQ(ThreadNames(doc).at(1), "track \\ with \"quotes\"");
  EXPECT_EQ(CompleteEvents(doc).at(0).at("name"), "name\twith\ttabs");
}

TEST(TraceRecorderTest, EndBeforeStartBecomesZeroLength) {
  TraceRecorder trace;
  trace.Complete(trace.Track("t"), "backwards", "x", 500, 100);
  ASSERT_EQ(trace.Events().size(), 1u);
  EXPECT_EQ(trace.Events()[0].end_ns, 500);
  const json doc = json::parse(trace.ToChromeJson());
  EXPECT_DOUBLE_EQ(CompleteEvents(doc).at(0).at("dur").get<double>(), 0.0);
}

TEST(TraceRecorderTest, EventsBeyondTheCapAreDropped) {
  TraceRecorder trace(0, "strata", /*max_events=*/3);
  const uint32_t t = trace.Track("t");
  for (int i = 0; i < 10; ++i)
    trace.Complete(t, "e" + std::to_string(i), "c", i, i + 1);
  EXPECT_EQ(trace.Events().size(), 3u);
  EXPECT_EQ(trace.dropped(), 7u);
  // The first events are the ones kept.
  EXPECT_EQ(trace.Events()[2].name, "e2");
  EXPECT_EQ(CompleteEvents(json::parse(trace.ToChromeJson())).size(), 3u);
}

TEST(TraceRecorderTest, ScopedTraceRecordsItsLifetime) {
  TraceRecorder trace;
  const uint32_t t = trace.Track("compute");
  const int64_t before = TraceRecorder::NowNs();
  {
    ScopedTrace scope(&trace, t, "forward", "compute");
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  const int64_t after = TraceRecorder::NowNs();
  { ScopedTrace none(nullptr, t, "ignored", "compute"); }
  std::vector<TraceEvent> events = trace.Events();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].name, "forward");
  EXPECT_GE(events[0].start_ns, before);
  EXPECT_LE(events[0].end_ns, after);
  EXPECT_GE(events[0].end_ns - events[0].start_ns, 1'000'000);
}

TEST(TraceRecorderTest, ConcurrentRecordingFromSeveralThreads) {
  constexpr int kThreads = 8;
  constexpr int kPerThread = 1000;
  TraceRecorder trace(0, "strata", /*max_events=*/kThreads * kPerThread - 100);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&trace, t] {
      // Half the threads share a track name, to race on its creation.
      const uint32_t track = trace.Track(t % 2 == 0 ? "shared" : "t" + std::to_string(t));
      for (int i = 0; i < kPerThread; ++i) {
        const int64_t start = TraceRecorder::NowNs();
        trace.Complete(track, "op", "test", start, TraceRecorder::NowNs(),
                       {{"thread", t}, {"i", i}});
        if (i == kPerThread / 2) (void)trace.ToChromeJson();  // a reader among writers
      }
    });
  }
  for (auto& th : threads)
    th.join();

  EXPECT_EQ(trace.Events().size() + trace.dropped(), size_t{kThreads * kPerThread});
  EXPECT_EQ(trace.dropped(), 100u);
  std::vector<std::string> names = trace.TrackNames();
  EXPECT_EQ(names.size(), 1u + kThreads / 2);
  EXPECT_EQ(std::set<std::string>(names.begin(), names.end()).size(), names.size());

  const json doc = json::parse(trace.ToChromeJson());
  std::vector<json> x = CompleteEvents(doc);
  ASSERT_EQ(x.size(), trace.Events().size());
  const std::map<int, std::string> tids = ThreadNames(doc);
  double last_ts = 0;
  for (const json& e : x) {
    EXPECT_TRUE(tids.count(e.at("tid").get<int>())) << e.dump();
    const double ts = e.at("ts").get<double>();
    EXPECT_GE(ts, last_ts);
    EXPECT_GE(e.at("dur").get<double>(), 0.0);
    last_ts = ts;
  }
}

TEST(TraceRecorderTest, WriteChromeJsonWritesTheDocumentAtomically) {
  TempDir dir;
  const std::string path = dir.file("trace.json");
  TraceRecorder trace;
  trace.Complete(trace.Track("io"), "read", "io", 100, 200, {{"bytes", 4096}});
  ASSERT_TRUE(trace.WriteChromeJson(path).ok());
  const json doc = json::parse(ReadFile(path));
  EXPECT_EQ(CompleteEvents(doc).size(), 1u);
  // Only the file itself: no temporary left behind.
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir.path()),
                          std::filesystem::directory_iterator()),
            1);

  // Overwriting replaces the whole document.
  trace.Complete(trace.Track("io"), "write", "io", 300, 400);
  ASSERT_TRUE(trace.WriteChromeJson(path).ok());
  EXPECT_EQ(CompleteEvents(json::parse(ReadFile(path))).size(), 2u);
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
}

TEST(TraceRecorderTest, WriteErrorsNameThePath) {
  TempDir dir;
  TraceRecorder trace;
  trace.Complete(trace.Track("io"), "read", "io", 0, 1);

  const std::string missing = dir.file("no/such/dir/trace.json");
  Status st = trace.WriteChromeJson(missing);
  EXPECT_EQ(st.code(), StatusCode::kNotFound) << st.ToString();
  EXPECT_THAT(st.message(), HasSubstr(missing));

  // A directory in the way of the file: the rename fails, and the temporary is removed.
  const std::string is_dir = dir.file("taken");
  std::filesystem::create_directory(is_dir);
  st = trace.WriteChromeJson(is_dir);
  EXPECT_FALSE(st.ok());
  EXPECT_THAT(st.message(), HasSubstr(is_dir));
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir.path()),
                          std::filesystem::directory_iterator()),
            1);

  st = trace.WriteChromeJson("");
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
}

TEST(TraceRecorderTest, WriteIntoAReadOnlyDirectoryFails) {
  if (testing::IsRoot()) GTEST_SKIP() << "root ignores directory permissions";
  TempDir dir;
  const std::string ro = dir.file("ro");
  std::filesystem::create_directory(ro);
  ASSERT_EQ(::chmod(ro.c_str(), 0555), 0);
  TraceRecorder trace;
  Status st = trace.WriteChromeJson(ro + "/trace.json");
  ::chmod(ro.c_str(), 0755);
  EXPECT_EQ(st.code(), StatusCode::kPermissionDenied) << st.ToString();
  EXPECT_THAT(st.message(), HasSubstr(ro + "/trace.json"));
}

}  // namespace
}  // namespace strata
