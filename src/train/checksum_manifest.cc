#include "train/checksum_manifest.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/durable_file.h"
#include "common/errno.h"
#include "io/checksum_store.h"

namespace strata::train {

namespace fs = std::filesystem;

namespace {

constexpr const char* kFormat = "strata-checkpoint-checksums";
constexpr int kVersion = 1;

std::string PartName(int rank) { return fmt::format(".checksums.rank{}.json", rank); }

Result<nlohmann::json> ReadJson(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    return Status(errno == ENOENT ? StatusCode::kNotFound : StatusCode::kPermissionDenied,
                  fmt::format("{}: cannot open", path));
  }
  std::stringstream text;
  text << in.rdbuf();
  nlohmann::json j = nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return InvalidArgumentError(fmt::format("{}: not valid JSON", path));
  return j;
}

nlohmann::json RangesToJson(const std::vector<SafetensorsWriter::WrittenRange>& ranges) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& r : ranges) {
    out.push_back({r.offset, r.length, io::ChecksumHex(r.checksum), r.what});
  }
  return out;
}

// [[offset, length, "hex", "what"], ...]
Status RangesFromJson(const nlohmann::json& j, const std::string& where,
                      std::vector<SafetensorsWriter::WrittenRange>* out) {
  if (!j.is_array()) return InvalidArgumentError(fmt::format("{}: ranges: not a list", where));
  for (const auto& e : j) {
    if (!e.is_array() || e.size() != 4 || !e[0].is_number_unsigned() ||
        !e[1].is_number_unsigned() || !e[2].is_string() || !e[3].is_string()) {
      return InvalidArgumentError(fmt::format(
          "{}: a range is not [offset, length, \"checksum\", \"what\"]: {}", where, e.dump()));
    }
    SafetensorsWriter::WrittenRange r;
    r.offset = e[0].get<uint64_t>();
    r.length = e[1].get<uint64_t>();
    const std::string hex = e[2].get<std::string>();
    size_t used = 0;
    try {
      r.checksum = std::stoull(hex, &used, 16);
    } catch (...) {
      used = 0;
    }
    if (hex.size() != 16 || used != hex.size()) {
      return InvalidArgumentError(
          fmt::format("{}: checksum '{}' is not 16 hex digits", where, hex));
    }
    r.what = e[3].get<std::string>();
    out->push_back(std::move(r));
  }
  return Status::Ok();
}

// The XXH3 of `length` bytes of `fd` from `offset`.
Result<uint64_t> HashRange(int fd, uint64_t offset, uint64_t length, const std::string& path,
                           std::vector<char>& buffer) {
  io::Checksum64Stream hash;
  for (uint64_t done = 0; done < length;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(length - done, buffer.size()));
    const ssize_t got = ::pread(fd, buffer.data(), n, static_cast<off_t>(offset + done));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return ErrnoToStatus(errno, fmt::format("read {} at offset {}", path, offset + done));
    if (got == 0) {
      return Status(StatusCode::kDataLoss,
                    fmt::format("{}: ends at {} bytes, inside bytes [{}, {})", path,
                                offset + done, offset, offset + length));
    }
    hash.Update(buffer.data(), static_cast<size_t>(got));
    done += static_cast<uint64_t>(got);
  }
  return hash.Digest();
}

}  // namespace

Status WriteManifestPart(
    const std::string& dir, int rank,
    const std::map<std::string, std::vector<SafetensorsWriter::WrittenRange>>& written) {
  nlohmann::json files = nlohmann::json::object();
  for (const auto& [name, ranges] : written) files[name] = RangesToJson(ranges);
  return WriteFileDurable((fs::path(dir) / PartName(rank)).string(),
                     nlohmann::json{{"rank", rank}, {"files", files}}.dump() + "\n");
}

Status WriteManifest(const std::string& dir, int world, const std::vector<std::string>& whole_files) {
  Manifest m;
  for (int r = 0; r < world; ++r) {
    const std::string part = (fs::path(dir) / PartName(r)).string();
    STRATA_ASSIGN_OR_RETURN(nlohmann::json j, ReadJson(part));
    if (!j.contains("files") || !j["files"].is_object()) {
      return InvalidArgumentError(fmt::format("{}: no \"files\" object", part));
    }
    for (const auto& [name, ranges] : j["files"].items()) {
      STRATA_RETURN_IF_ERROR(RangesFromJson(ranges, part + ": " + name, &m[name].ranges));
    }
  }
  std::vector<char> buffer(8 << 20);
  for (const std::string& name : whole_files) {
    const std::string path = (fs::path(dir) / name).string();
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ErrnoToStatus(errno, fmt::format("open {}", path));
    struct stat st {};
    Result<uint64_t> h = ::fstat(fd, &st) == 0
                             ? HashRange(fd, 0, static_cast<uint64_t>(st.st_size), path, buffer)
                             : Result<uint64_t>(ErrnoToStatus(errno, "fstat " + path));
    ::close(fd);
    STRATA_RETURN_IF_ERROR(h.status());
    m[name].ranges = {{0, static_cast<uint64_t>(st.st_size), *h, "file"}};
  }
  nlohmann::json files = nlohmann::json::object();
  for (auto& [name, f] : m) {
    const std::string path = (fs::path(dir) / name).string();
    std::error_code ec;
    const uint64_t size = fs::file_size(path, ec);
    if (ec) return ErrnoToStatus(ec.value(), fmt::format("size of {}", path));
    std::sort(f.ranges.begin(), f.ranges.end(),
              [](const auto& a, const auto& b) { return a.offset < b.offset; });
    uint64_t at = 0;
    for (const auto& r : f.ranges) {
      if (r.offset != at) {
        return InternalError(fmt::format(
            "checkpoint {}: {} bytes [{}, {}) {} (before '{}')", dir, name,
            std::min(at, r.offset), std::max(at, r.offset),
            r.offset > at ? "were written by no rank" : "were written twice", r.what));
      }
      at = r.offset + r.length;
    }
    if (at != size) {
      return InternalError(fmt::format("checkpoint {}: {} bytes [{}, {}) were written by no rank",
                                       dir, name, std::min(at, size), std::max(at, size)));
    }
    files[name] = {{"size", size}, {"ranges", RangesToJson(f.ranges)}};
  }
  STRATA_RETURN_IF_ERROR(WriteFileDurable(
      (fs::path(dir) / kChecksumsFile).string(),
      nlohmann::json{{"format", kFormat}, {"version", kVersion}, {"algorithm", "xxh3-64"},
                     {"files", files}}
              .dump(1) +
          "\n"));
  for (int r = 0; r < world; ++r) {
    std::error_code ec;
    fs::remove(fs::path(dir) / PartName(r), ec);
  }
  return Status::Ok();
}

Result<Manifest> ReadManifest(const std::string& dir) {
  const std::string path = (fs::path(dir) / kChecksumsFile).string();
  if (!fs::exists(path)) {
    return NotFoundError(fmt::format("{}: no {} (saved before checkpoints had checksums)", dir,
                                     kChecksumsFile));
  }
  STRATA_ASSIGN_OR_RETURN(nlohmann::json j, ReadJson(path));
  if (!j.is_object() || j.value("format", "") != kFormat || !j.contains("files") ||
      !j["files"].is_object()) {
    return InvalidArgumentError(
        fmt::format("{}: not a Strata checksum manifest (format \"{}\" expected)", path, kFormat));
  }
  if (j.value("version", 0) != kVersion || j.value("algorithm", "") != "xxh3-64") {
    return InvalidArgumentError(fmt::format(
        "{}: version {} / algorithm '{}': this Strata reads version {} with xxh3-64", path,
        j.value("version", 0), j.value("algorithm", ""), kVersion));
  }
  Manifest m;
  for (const auto& [name, f] : j["files"].items()) {
    if (!f.is_object() || !f.contains("size") || !f["size"].is_number_unsigned() ||
        name.find('/') != std::string::npos || name.empty() || name[0] == '.') {
      return InvalidArgumentError(fmt::format("{}: entry '{}' is malformed", path, name));
    }
    ManifestFile& mf = m[name];
    mf.size = f["size"].get<uint64_t>();
    STRATA_RETURN_IF_ERROR(RangesFromJson(f.value("ranges", nlohmann::json()), path + ": " + name,
                                          &mf.ranges));
  }
  return m;
}

VerifyResult VerifyManifest(const std::string& dir, const Manifest& manifest, int share,
                            int shares) {
  VerifyResult out;
  std::vector<char> buffer(8 << 20);
  size_t index = 0;
  for (const auto& [name, f] : manifest) {
    const std::string path = (fs::path(dir) / name).string();
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      if (share == 0) out.problems.push_back(fmt::format("{}: {}", name, ErrnoToStatus(errno, "open").message()));
      index += f.ranges.size();
      continue;
    }
    struct stat st {};
    if (share == 0 && ::fstat(fd, &st) == 0 && static_cast<uint64_t>(st.st_size) != f.size) {
      out.problems.push_back(fmt::format("{}: {} bytes, but {} were written", name,
                                         static_cast<uint64_t>(st.st_size), f.size));
    }
    bool read_any = false;
    for (const auto& r : f.ranges) {
      if (static_cast<int>(index++ % static_cast<size_t>(std::max(shares, 1))) != share) continue;
      read_any = true;
      ++out.ranges;
      Result<uint64_t> h = HashRange(fd, r.offset, r.length, path, buffer);
      if (!h.ok()) {
        out.problems.push_back(fmt::format("{}: {}", name, h.status().message()));
        continue;
      }
      out.bytes += r.length;
      if (*h != r.checksum) {
        out.problems.push_back(fmt::format(
            "{}: bytes [{}, {}) ({}) differ from what was written (XXH3 {} written, {} now)", name,
            r.offset, r.offset + r.length, r.what, io::ChecksumHex(r.checksum),
            io::ChecksumHex(*h)));
      }
    }
    if (read_any) ++out.files;
    ::close(fd);
  }
  return out;
}

}  // namespace strata::train
