#include "train/checksum_manifest.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "io/checksum_store.h"

namespace strata::train {

namespace fs = std::filesystem;

namespace {

constexpr const char* kFormat = "strata-checkpoint-checksums";
constexpr int kVersion = 1;

std::string PartName(int rank) { return fmt::format(".checksums.rank{}.json", rank); }

Result<nlohmann::json> ReadJson(FileSystem& files, const std::string& path) {
  STRATA_ASSIGN_OR_RETURN(const std::string text, ReadFileToString(files, path));
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return InvalidArgumentError(fmt::format("{}: not valid JSON", path));
  return j;
}

nlohmann::json RangesToJson(const std::vector<SafetensorsWriter::WrittenRange>& ranges) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& r : ranges) {
    nlohmann::json e = {r.offset, r.length, io::ChecksumHex(r.checksum), r.what};
    if (r.chunks > 1) {
      e.push_back(r.chunks);
      e.push_back(r.stride);
    }
    out.push_back(std::move(e));
  }
  return out;
}

// [[offset, length, "hex", "what"(, chunks, stride)], ...]
Status RangesFromJson(const nlohmann::json& j, const std::string& where,
                      std::vector<SafetensorsWriter::WrittenRange>* out) {
  if (!j.is_array()) return InvalidArgumentError(fmt::format("{}: ranges: not a list", where));
  for (const auto& e : j) {
    const bool strided = e.is_array() && e.size() == 6;
    if (!e.is_array() || (e.size() != 4 && !strided) || !e[0].is_number_unsigned() ||
        !e[1].is_number_unsigned() || !e[2].is_string() || !e[3].is_string() ||
        (strided && (!e[4].is_number_unsigned() || !e[5].is_number_unsigned() ||
                     e[4].get<uint64_t>() < 2 || e[5].get<uint64_t>() < e[1].get<uint64_t>()))) {
      return InvalidArgumentError(fmt::format(
          "{}: a range is not [offset, length, \"checksum\", \"what\"] or [..., chunks >= 2, "
          "stride >= length]: {}",
          where, e.dump()));
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
    if (strided) {
      r.chunks = e[4].get<uint64_t>();
      r.stride = e[5].get<uint64_t>();
    }
    out->push_back(std::move(r));
  }
  return Status::Ok();
}

// The XXH3 of `length` bytes of `file` from `offset`, and of `chunks` such runs `stride` bytes
// apart, in order.
Result<uint64_t> HashRange(const File& file, uint64_t offset, uint64_t length,
                           std::vector<char>& buffer, uint64_t chunks = 1, uint64_t stride = 0) {
  io::Checksum64Stream hash;
  for (uint64_t c = 0; c < chunks; ++c) {
    for (uint64_t done = 0; done < length;) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(length - done, buffer.size()));
      STRATA_RETURN_IF_ERROR(file.ReadAt(offset + c * stride + done, buffer.data(), n));
      hash.Update(buffer.data(), n);
      done += n;
    }
  }
  return hash.Digest();
}

// Each contiguous run a range covers, as [offset, length) with the range it belongs to: strided
// ranges (a tensor-parallel rank's columns) interleave with other ranks' and are checked run by
// run.
struct ByteRun {
  uint64_t offset, length;
  const SafetensorsWriter::WrittenRange* range;
};
std::vector<ByteRun> RunsOf(const std::vector<SafetensorsWriter::WrittenRange>& ranges) {
  std::vector<ByteRun> runs;
  for (const auto& r : ranges) {
    for (uint64_t c = 0; c < r.chunks; ++c)
      runs.push_back({r.offset + c * r.stride, r.length, &r});
  }
  std::sort(runs.begin(), runs.end(),
            [](const ByteRun& a, const ByteRun& b) { return a.offset < b.offset; });
  return runs;
}

}  // namespace

Status WriteManifestPart(
    const std::string& dir, int rank,
    const std::map<std::string, std::vector<SafetensorsWriter::WrittenRange>>& written,
    FileSystem& file_system) {
  nlohmann::json files = nlohmann::json::object();
  for (const auto& [name, ranges] : written) files[name] = RangesToJson(ranges);
  return WriteFileDurable(file_system, (fs::path(dir) / PartName(rank)).string(),
                     nlohmann::json{{"rank", rank}, {"files", files}}.dump() + "\n");
}

Status WriteManifest(const std::string& dir, int world, const std::vector<std::string>& whole_files,
                     FileSystem& file_system) {
  Manifest m;
  for (int r = 0; r < world; ++r) {
    const std::string part = (fs::path(dir) / PartName(r)).string();
    STRATA_ASSIGN_OR_RETURN(nlohmann::json j, ReadJson(file_system, part));
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
    STRATA_ASSIGN_OR_RETURN(const std::unique_ptr<File> file,
                            file_system.Open(path, OpenMode::kRead));
    STRATA_ASSIGN_OR_RETURN(const uint64_t size, file->Size());
    STRATA_ASSIGN_OR_RETURN(const uint64_t h, HashRange(*file, 0, size, buffer));
    m[name].ranges = {{0, size, h, "file"}};
  }
  nlohmann::json files = nlohmann::json::object();
  for (auto& [name, f] : m) {
    const std::string path = (fs::path(dir) / name).string();
    STRATA_ASSIGN_OR_RETURN(const std::unique_ptr<File> file,
                            file_system.Open(path, OpenMode::kRead));
    STRATA_ASSIGN_OR_RETURN(const uint64_t size, file->Size());
    std::sort(f.ranges.begin(), f.ranges.end(),
              [](const auto& a, const auto& b) { return a.offset < b.offset; });
    uint64_t at = 0;
    for (const ByteRun& r : RunsOf(f.ranges)) {
      if (r.offset != at) {
        return InternalError(fmt::format(
            "checkpoint {}: {} bytes [{}, {}) {} (before '{}')", dir, name, std::min(at, r.offset),
            std::max(at, r.offset),
            r.offset > at ? "were written by no rank" : "were written twice", r.range->what));
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
      file_system, (fs::path(dir) / kChecksumsFile).string(),
      nlohmann::json{{"format", kFormat}, {"version", kVersion}, {"algorithm", "xxh3-64"},
                     {"files", files}}
              .dump(1) +
          "\n"));
  for (int r = 0; r < world; ++r) {
    (void)file_system.RemoveAll((fs::path(dir) / PartName(r)).string());
  }
  return Status::Ok();
}

Result<Manifest> ReadManifest(const std::string& dir, FileSystem& file_system) {
  const std::string path = (fs::path(dir) / kChecksumsFile).string();
  if (!file_system.Exists(path)) {
    return NotFoundError(fmt::format("{}: no {} (saved before checkpoints had checksums)", dir,
                                     kChecksumsFile));
  }
  STRATA_ASSIGN_OR_RETURN(nlohmann::json j, ReadJson(file_system, path));
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
                            int shares, FileSystem& file_system) {
  VerifyResult out;
  std::vector<char> buffer(8 << 20);
  size_t index = 0;
  for (const auto& [name, f] : manifest) {
    const std::string path = (fs::path(dir) / name).string();
    Result<std::unique_ptr<File>> file = file_system.Open(path, OpenMode::kRead);
    if (!file.ok()) {
      if (share == 0) out.problems.push_back(fmt::format("{}: {}", name, file.status().message()));
      index += f.ranges.size();
      continue;
    }
    const Result<uint64_t> size = (*file)->Size();
    if (share == 0 && size.ok() && *size != f.size) {
      out.problems.push_back(fmt::format("{}: {} bytes, but {} were written", name, *size, f.size));
    }
    bool read_any = false;
    for (const auto& r : f.ranges) {
      if (static_cast<int>(index++ % static_cast<size_t>(std::max(shares, 1))) != share) continue;
      read_any = true;
      ++out.ranges;
      Result<uint64_t> h = HashRange(**file, r.offset, r.length, buffer, r.chunks, r.stride);
      if (!h.ok()) {
        out.problems.push_back(fmt::format("{}: {}", name, h.status().message()));
        continue;
      }
      out.bytes += r.length * r.chunks;
      if (*h != r.checksum) {
        out.problems.push_back(fmt::format(
            "{}: bytes [{}, {}){} ({}) differ from what was written (XXH3 {} written, {} now)",
            name, r.offset, r.end(),
            r.chunks > 1
                ? fmt::format(" in {} runs of {} bytes every {}", r.chunks, r.length, r.stride)
                : std::string(),
            r.what, io::ChecksumHex(r.checksum), io::ChecksumHex(*h)));
      }
    }
    if (read_any) ++out.files;
  }
  return out;
}

}  // namespace strata::train
