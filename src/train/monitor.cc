#include "train/monitor.h"

#include <fmt/format.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <map>

#include "common/errno.h"
#include "strata/file_system.h"

namespace strata::train {
namespace {

// ---- CRC32C ---------------------------------------------------------------------------------------
// (No Debian library offers CRC32C without a large dependency; the table form is short.)

constexpr std::array<uint32_t, 256> MakeCrc32cTable() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;  // reflected
    t[i] = c;
  }
  return t;
}
constexpr std::array<uint32_t, 256> kCrc32cTable = MakeCrc32cTable();

// ---- protobuf wire format (the few fields an Event with a scalar needs) -------------------------

void PutVarint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
void PutKey(std::string& out, int field, int wire_type) {
  PutVarint(out, (static_cast<uint64_t>(field) << 3) | static_cast<uint64_t>(wire_type));
}
template <typename T>
void PutFixed(std::string& out, T v) {  // little-endian, as x86-64 and the wire format are
  char bytes[sizeof(T)];
  std::memcpy(bytes, &v, sizeof(T));
  out.append(bytes, sizeof(T));
}
void PutBytes(std::string& out, int field, std::string_view bytes) {
  PutKey(out, field, 2);
  PutVarint(out, bytes.size());
  out.append(bytes);
}

double WallTime() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// tensorflow.Event: wall_time = 1 (double), step = 2 (int64), file_version = 3 (string),
// summary = 5 (Summary { repeated Value value = 1 }, Value { tag = 1, simple_value = 2 (float) }).
std::string ScalarEvent(const MonitorEvent& e) {
  std::string value;
  PutBytes(value, 1, e.tag);
  PutKey(value, 2, 5);
  PutFixed(value, static_cast<float>(e.value));
  std::string summary;
  PutBytes(summary, 1, value);
  std::string event;
  PutKey(event, 1, 1);
  PutFixed(event, WallTime());
  PutKey(event, 2, 0);
  PutVarint(event, static_cast<uint64_t>(e.step));
  PutBytes(event, 5, summary);
  return event;
}

std::string VersionEvent() {
  std::string event;
  PutKey(event, 1, 1);
  PutFixed(event, WallTime());
  PutBytes(event, 3, "brain.Event:2");
  return event;
}

// A TFRecord: length, its masked CRC32C, the data, its masked CRC32C.
std::string Record(std::string_view data) {
  std::string out;
  std::string len;
  PutFixed(len, static_cast<uint64_t>(data.size()));
  out += len;
  PutFixed(out, MaskedCrc32c(len));
  out.append(data);
  PutFixed(out, MaskedCrc32c(data));
  return out;
}

// A file the monitor appends to.
class AppendFile {
 public:
  // Creates `path` anew, or (`append`) keeps what it holds.
  static Result<AppendFile> Open(const std::string& path, bool append) {
    AppendFile f;
    Result<std::unique_ptr<File>> file =
        LocalFileSystem().Open(path, append ? OpenMode::kAppend : OpenMode::kCreate);
    if (!file.ok()) return file.status().WithContext("monitor");
    f.file_ = std::move(file).value();
    STRATA_ASSIGN_OR_RETURN(f.size_, f.file_->Size());
    return f;
  }
  uint64_t size() const { return size_; }
  Status Append(std::string_view data) {
    Status st = file_->WriteAt(size_, data.data(), data.size());
    if (!st.ok()) return st.WithContext("monitor");
    size_ += data.size();
    return Status::Ok();
  }

 private:
  std::unique_ptr<File> file_;
  uint64_t size_ = 0;
};

class TensorBoardWriter final : public MonitorWriter {
 public:
  static Result<std::unique_ptr<MonitorWriter>> Create(const std::filesystem::path& dir) {
    char host[256] = "localhost";
    (void)::gethostname(host, sizeof(host) - 1);
    const auto path =
        dir / fmt::format("events.out.tfevents.{}.{}",
                          static_cast<int64_t>(WallTime()), host);
    auto w = std::unique_ptr<TensorBoardWriter>(new TensorBoardWriter(path.string()));
    STRATA_ASSIGN_OR_RETURN(w->out_, AppendFile::Open(w->path_, /*append=*/false));
    STRATA_RETURN_IF_ERROR(w->Append(VersionEvent()));
    return std::unique_ptr<MonitorWriter>(std::move(w));
  }

  Status Write(const std::vector<MonitorEvent>& events) override {
    for (const MonitorEvent& e : events) STRATA_RETURN_IF_ERROR(Append(ScalarEvent(e)));
    return Status::Ok();
  }
  std::string where() const override { return path_; }

 private:
  explicit TensorBoardWriter(std::string path) : path_(std::move(path)) {}
  Status Append(const std::string& event) { return out_.Append(Record(event)); }

  std::string path_;
  AppendFile out_;
};

class CsvWriter final : public MonitorWriter {
 public:
  explicit CsvWriter(std::filesystem::path dir) : dir_(std::move(dir)) {}

  Status Write(const std::vector<MonitorEvent>& events) override {
    for (const MonitorEvent& e : events) {
      auto it = files_.find(e.tag);
      if (it == files_.end()) {
        std::string name = e.tag;
        for (char& c : name) {
          if (c == '/') c = '_';
        }
        const std::string path = (dir_ / (name + ".csv")).string();
        STRATA_ASSIGN_OR_RETURN(AppendFile f, AppendFile::Open(path, /*append=*/true));
        if (f.size() == 0) {  // a new file (a resumed run appends to its own)
          const size_t slash = e.tag.rfind('/');
          STRATA_RETURN_IF_ERROR(f.Append(fmt::format(
              "step,{}\n", slash == std::string::npos ? e.tag : e.tag.substr(slash + 1))));
        }
        it = files_.emplace(e.tag, std::move(f)).first;
      }
      STRATA_RETURN_IF_ERROR(it->second.Append(fmt::format("{},{}\n", e.step, e.value)));
    }
    return Status::Ok();
  }
  std::string where() const override { return dir_.string(); }

 private:
  std::filesystem::path dir_;
  std::map<std::string, AppendFile> files_;
};

Result<std::filesystem::path> MonitorDir(const MonitorConfig& m, std::string_view section) {
  if (m.job_name.empty() || m.job_name.find('/') != std::string::npos || m.job_name == "." ||
      m.job_name == "..") {
    return InvalidArgumentError(fmt::format(
        "{}.job_name \"{}\": must be a plain, non-empty name (it names a directory under "
        "output_path)",
        section, m.job_name));
  }
  const std::filesystem::path dir =
      std::filesystem::path(m.output_path.empty() ? "." : m.output_path) / m.job_name;
  if (Status st = LocalFileSystem().CreateDirs(dir.string()); !st.ok()) {
    return Status(StatusCode::kFailedPrecondition,
                  fmt::format("{}: cannot {}", section, st.message()));
  }
  return dir;
}

}  // namespace

uint32_t Crc32c(std::string_view data) {
  uint32_t c = 0xFFFFFFFFu;
  for (unsigned char b : data) c = kCrc32cTable[(c ^ b) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t MaskedCrc32c(std::string_view data) {
  const uint32_t c = Crc32c(data);
  return ((c >> 15) | (c << 17)) + 0xA282EAD8u;
}

Result<std::vector<std::unique_ptr<MonitorWriter>>> CreateMonitors(const Config& config) {
  std::vector<std::unique_ptr<MonitorWriter>> out;
  if (config.tensorboard.enabled) {
    STRATA_ASSIGN_OR_RETURN(const std::filesystem::path dir,
                            MonitorDir(config.tensorboard, "tensorboard"));
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<MonitorWriter> w, TensorBoardWriter::Create(dir));
    out.push_back(std::move(w));
  }
  if (config.csv_monitor.enabled) {
    STRATA_ASSIGN_OR_RETURN(const std::filesystem::path dir,
                            MonitorDir(config.csv_monitor, "csv_monitor"));
    out.push_back(std::make_unique<CsvWriter>(dir));
  }
  return out;
}

}  // namespace strata::train
