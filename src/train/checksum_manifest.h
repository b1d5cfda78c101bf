// A checkpoint's checksums: checksums.json in the step directory lists, for every file of the
// checkpoint, byte ranges that tile the whole file and the XXH3-64 of each range's bytes as they
// were written (docs/formats.md). A range is what one writer wrote in one piece (a safetensors
// header, part of one tensor from one rank, a whole small file), so saving costs no read-back:
// each rank hashes what it writes, leaves its list as .checksums.rank<r>.json, and rank 0 merges
// the lists, checks that they cover every byte of every file exactly once, and writes the
// manifest before the directory is published.
//
// Verifying reads every range back and compares; ranks (or `strata checkpoint verify`) share the
// work by range.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "strata/status.h"
#include "train/safetensors.h"

namespace strata::train {

inline constexpr const char* kChecksumsFile = "checksums.json";

struct ManifestFile {
  uint64_t size = 0;
  std::vector<SafetensorsWriter::WrittenRange> ranges;  // sorted by offset, tiling [0, size)
};
using Manifest = std::map<std::string, ManifestFile>;  // by file name within the directory

// One rank's written ranges, by file name: DIR/.checksums.rank<rank>.json (synced).
Status WriteManifestPart(const std::string& dir, int rank,
                         const std::map<std::string, std::vector<SafetensorsWriter::WrittenRange>>&
                             written,
                         FileSystem& fs = LocalFileSystem());

// Rank 0, once every rank's part is in `dir`: merges the parts of ranks 0..world-1, hashes the
// `whole_files` (small files rank 0 wrote itself), checks that every file's ranges tile it,
// writes DIR/checksums.json (synced) and removes the parts. Internal naming the file and the
// bytes when a range is missing or two overlap: a save that would not cover its own bytes.
Status WriteManifest(const std::string& dir, int world, const std::vector<std::string>& whole_files,
                     FileSystem& fs = LocalFileSystem());

// DIR/checksums.json; NotFound when there is none (a checkpoint from before checksums, or a
// model directory), InvalidArgument naming the file when it is malformed.
Result<Manifest> ReadManifest(const std::string& dir, FileSystem& fs = LocalFileSystem());

struct VerifyResult {
  int files = 0;       // files whose ranges (of this share) were read
  int ranges = 0;
  uint64_t bytes = 0;  // bytes read and hashed
  // One line per problem: a missing file, a size that differs, a range whose bytes differ
  // (naming the file, the bytes and the tensor).
  std::vector<std::string> problems;
};

// Reads back the ranges with index % shares == share (every range when shares is 1) and, for
// share 0, checks every file's size. I/O errors are problems too, not a failed call.
VerifyResult VerifyManifest(const std::string& dir, const Manifest& manifest, int share = 0,
                            int shares = 1, FileSystem& fs = LocalFileSystem());

}  // namespace strata::train
