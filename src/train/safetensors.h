// Safetensors: Hugging Face's tensor file format, read and written by byte range.
//
// A file is an 8-byte little-endian header length N, N bytes of a JSON object
//   {"__metadata__": {"key": "value", ...},                       (optional, strings only)
//    "<tensor name>": {"dtype": "F32", "shape": [d0, d1, ...], "data_offsets": [begin, end]}, ...}
// and then the data section; offsets are relative to its start (byte 8 + N). Tensors are stored
// row-major, little-endian, without strides.
//
// Every byte goes through the file seam (strata/file_system.h): the local file system unless a
// caller passes another. Reading (SafetensorsFile, SafetensorsModel) validates the whole header
// up front, then reads any element range of any tensor with positioned reads, converting F32 / BF16 / F16 to the caller's dtype. The
// file is never loaded or mapped as a whole, so a rank reads only the slice it owns.
//
// Writing is split so that several processes can fill one file: SafetensorsLayout turns a list of
// tensors into the header bytes and every tensor's file offset, deterministically (every rank that
// computes it from the same list gets the same bytes). One process calls SafetensorsWriter::Create
// (create/truncate, size the file, write the header); after the caller's own barrier the others
// call SafetensorsWriter::Open on the same path; each writes its disjoint element ranges with
// WriteRange and calls Finish (sync). The caller publishes the files (checkpoint.h: a temporary
// directory renamed into place).
//
// Layout choices (what our writer produces; the reader accepts any valid file):
//   - The header JSON is padded with spaces so that the data section starts at a multiple of 8.
//   - Tensors are packed with no gaps (the reference implementation rejects holes), ordered by
//     element size, largest first (a stable sort: the caller's order within one size). So every
//     tensor is aligned to its own element size — enough for torch.frombuffer and for pread into
//     typed buffers — without padding. Tensors are not 8-byte aligned in general.
//   - "__metadata__" comes first, then the tensors in data order. Nothing is added to it:
//     transformers refuses a file whose metadata lacks "format" (one of "pt", "tf", "flax",
//     "mlx"), so a checkpoint writer passes {"format": "pt"}.
//
// Errors name the file (and the tensor): a file that is not valid safetensors is InvalidArgument
// (bad JSON, missing or ill-typed fields, unknown dtype, sizes that disagree with the shape,
// overlapping tensors) or DataLoss (shorter than its header or its data claims: a truncated file).
// OS failures come through ErrnoToStatus.
//
// Thread safety: a SafetensorsFile / SafetensorsModel is immutable after Open; ReadRange may be
// called from any number of threads at once. A SafetensorsWriter's WriteRange may be called from
// several threads for disjoint ranges; Finish must not overlap other calls.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/mutex.h"
#include "strata/device.h"
#include "strata/file_system.h"
#include "strata/status.h"

namespace strata::train {

// The element types safetensors defines. Only F32, BF16 and F16 can be converted (ReadRange /
// WriteRange); the others are listed and validated but reading them is Unimplemented.
enum class SafetensorsDType : uint8_t {
  kBool,
  kU8,
  kI8,
  kF8E5M2,
  kF8E4M3,
  kI16,
  kU16,
  kF16,
  kBF16,
  kI32,
  kU32,
  kF32,
  kF64,
  kI64,
  kU64,
};

// "F32", "BF16", ... as written in the header.
std::string_view SafetensorsDTypeName(SafetensorsDType dtype);
// Bytes per element (1 for BOOL and the F8 types).
size_t SafetensorsDTypeSize(SafetensorsDType dtype);
// The dtype named `name` (case-sensitive, as in the header), or nullopt.
std::optional<SafetensorsDType> ParseSafetensorsDType(std::string_view name);
SafetensorsDType ToSafetensorsDType(device::DType dtype);
// The device dtype for F32 / BF16 / F16, nullopt for the rest.
std::optional<device::DType> ToDeviceDType(SafetensorsDType dtype);

// One tensor of a file.
struct SafetensorsTensor {
  std::string name;
  SafetensorsDType dtype = SafetensorsDType::kF32;
  std::vector<uint64_t> shape;  // empty for a scalar
  uint64_t num_elements = 0;    // product of shape (1 for a scalar)
  uint64_t data_begin = 0;      // byte range within the data section, as in the header
  uint64_t data_end = 0;
  uint64_t file_offset = 0;  // absolute offset of the first byte in the file

  uint64_t num_bytes() const { return data_end - data_begin; }
};

// ---------------------------------------------------------------------------------------------
// Reading

// One safetensors file, open for positioned reads.
class SafetensorsFile {
 public:
  // Opens `path` and validates its header against the file's size. Errors name `path`.
  static Result<std::unique_ptr<SafetensorsFile>> Open(const std::string& path,
                                                       FileSystem& fs = LocalFileSystem());

  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  // The tensors in data order (by data_begin; then by name for empty tensors).
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  // The "__metadata__" entries (empty when there are none).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Absolute offset of the data section (8 + header length).
  uint64_t data_offset() const { return data_offset_; }
  uint64_t file_size() const { return file_size_; }

  // The tensor called `name`, or nullptr.
  const SafetensorsTensor* Find(std::string_view name) const;

  // Reads elements [element_offset, element_offset + count) of tensor `name` (in row-major order)
  // into `dst`, which holds `count` elements of `dst_dtype`. The file's dtype must be F32, BF16 or
  // F16 (else Unimplemented); conversion rounds to nearest even (see device::FloatToBf16).
  // NotFound for an unknown name, OutOfRange for a range past the tensor's end, DataLoss when the
  // file has been truncated since Open.
  Status ReadRange(std::string_view name, uint64_t element_offset, uint64_t count, void* dst,
                   device::DType dst_dtype) const;

 private:
  SafetensorsFile() = default;

  std::string path_;
  std::unique_ptr<File> file_;
  uint64_t file_size_ = 0;
  uint64_t data_offset_ = 0;
  std::vector<SafetensorsTensor> tensors_;
  std::map<std::string, size_t, std::less<>> by_name_;  // name -> index into tensors_
  std::map<std::string, std::string> metadata_;
};

// The file name of an unsharded Hugging Face model and of the index of a sharded one.
inline constexpr std::string_view kSafetensorsModelFile = "model.safetensors";
inline constexpr std::string_view kSafetensorsIndexFile = "model.safetensors.index.json";

// A model's weights: one safetensors file, or several shards tied together by an index, seen as
// one namespace of tensors.
class SafetensorsModel {
 public:
  // `path` is a .safetensors file, an index .json file, or a directory holding model.safetensors
  // (preferred when both exist, as transformers does) or model.safetensors.index.json. For an
  // index, every shard it names is opened and every tensor it maps must exist in its shard;
  // tensors a shard holds but the index does not map are not part of the model. Errors name the
  // directory, the index file and the shard.
  static Result<std::unique_ptr<SafetensorsModel>> Open(const std::string& path,
                                                        FileSystem& fs = LocalFileSystem());

  // What was opened: the file or the index.
  const std::string& source() const { return source_; }
  // All tensor names, sorted.
  std::vector<std::string> TensorNames() const;
  // The tensor called `name` (NotFound naming the model otherwise).
  Result<const SafetensorsTensor*> Find(std::string_view name) const;
  // The shard holding `name` (NotFound naming the model otherwise).
  Result<const SafetensorsFile*> FileOf(std::string_view name) const;
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }

  // As SafetensorsFile::ReadRange, in whichever shard holds `name`.
  Status ReadRange(std::string_view name, uint64_t element_offset, uint64_t count, void* dst,
                   device::DType dst_dtype) const;

 private:
  SafetensorsModel() = default;

  std::string source_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const SafetensorsFile*, std::less<>> by_name_;
};

// ---------------------------------------------------------------------------------------------
// Writing

// A tensor to be written.
struct SafetensorsTensorSpec {
  std::string name;
  SafetensorsDType dtype = SafetensorsDType::kF32;
  std::vector<uint64_t> shape;  // empty for a scalar
};

// Where every byte of a file goes. A value type; equal inputs give equal layouts, byte for byte.
class SafetensorsLayout {
 public:
  // InvalidArgument for an empty or repeated name, the name "__metadata__", or a size that
  // overflows 64 bits.
  static Result<SafetensorsLayout> Compute(const std::vector<SafetensorsTensorSpec>& tensors,
                                           const std::map<std::string, std::string>& metadata = {});

  // The first data_offset() bytes of the file: the 8-byte length, the JSON, the space padding.
  const std::string& header() const { return header_; }
  uint64_t data_offset() const { return header_.size(); }
  // Sum of the tensors' byte sizes (the index's "total_size").
  uint64_t data_size() const { return data_size_; }
  uint64_t file_size() const { return data_offset() + data_size_; }
  // The tensors in data order, with their offsets filled in.
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  const SafetensorsTensor* Find(std::string_view name) const;

 private:
  std::string header_;
  uint64_t data_size_ = 0;
  std::vector<SafetensorsTensor> tensors_;
  std::map<std::string, size_t, std::less<>> by_name_;
};

// Writes element ranges of the tensors of one layout into one file, with positioned writes.
class SafetensorsWriter {
 public:
  // Creates `path` (truncating any existing file), reserves layout.file_size() bytes (fallocate,
  // or a sparse ftruncate where the filesystem cannot; unwritten ranges read as zeros) and
  // writes the header. Exactly one process
  // calls this for a file; the others Open it after it returns.
  static Result<std::unique_ptr<SafetensorsWriter>> Create(const std::string& path,
                                                           const SafetensorsLayout& layout,
                                                           FileSystem& fs = LocalFileSystem());
  // Opens a file made by Create for the same layout. FailedPrecondition when its size or header
  // differ (not created yet, or created from another tensor list).
  static Result<std::unique_ptr<SafetensorsWriter>> Open(const std::string& path,
                                                         const SafetensorsLayout& layout,
                                                         FileSystem& fs = LocalFileSystem());

  // Closes without fsync when Finish was not called.
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  const std::string& path() const { return path_; }
  const SafetensorsLayout& layout() const { return layout_; }

  // Writes `count` elements of `src_dtype` from `src` as elements [element_offset,
  // element_offset + count) of tensor `name`, converting to the tensor's dtype (which must be
  // F32, BF16 or F16; else Unimplemented). NotFound for an unknown name, OutOfRange past the
  // tensor's end, FailedPrecondition after Finish.
  Status WriteRange(std::string_view name, uint64_t element_offset, uint64_t count, const void* src,
                    device::DType src_dtype);
  // `chunks` runs of `chunk` elements each, read one after another from `src`, written at
  // elements element_offset + i * stride of tensor `name` (stride >= chunk): a block of columns
  // of a row-major matrix, as a tensor-parallel rank holds it. One written range (below) covers
  // them all. The same errors as WriteRange; InvalidArgument for stride < chunk.
  Status WriteStrided(std::string_view name, uint64_t element_offset, uint64_t chunk,
                      uint64_t chunks, uint64_t stride, const void* src, device::DType src_dtype);

  // fsyncs and closes the file. Further writes are FailedPrecondition; a second Finish is a no-op.
  Status Finish();

  // The byte ranges this writer wrote (the header for the one that created the file, then each
  // WriteRange or WriteStrided) with the XXH3-64 of the bytes as written: a checkpoint's manifest
  // is made of them. Call after the writes (not while another thread writes).
  struct WrittenRange {
    uint64_t offset = 0;
    uint64_t length = 0;    // bytes: of the range, or of each chunk of a strided one
    uint64_t checksum = 0;  // of every chunk's bytes in order
    std::string what;       // "header" or the tensor's name
    // A strided range (WriteStrided): `chunks` runs of `length` bytes, `stride` bytes apart
    // from `offset`. 1 and 0 for a contiguous one.
    uint64_t chunks = 1;
    uint64_t stride = 0;
    uint64_t end() const { return offset + (chunks - 1) * stride + length; }
  };
  const std::vector<WrittenRange>& written() const NO_THREAD_SAFETY_ANALYSIS { return written_; }

 private:
  SafetensorsWriter(std::string path, SafetensorsLayout layout, std::unique_ptr<File> file);

  std::string path_;
  SafetensorsLayout layout_;
  std::unique_ptr<File> file_;  // null after Finish
  Mutex written_mu_;
  std::vector<WrittenRange> written_ GUARDED_BY(written_mu_);
};

// Writes a Hugging Face index ({"metadata": {"total_size": N}, "weight_map": {tensor: file}}) to
// `path` and syncs it. `total_size` is the sum of the tensors' byte sizes over all shards.
Status WriteSafetensorsIndex(const std::string& path, uint64_t total_size,
                             const std::map<std::string, std::string>& weight_map,
                             FileSystem& fs = LocalFileSystem());

}  // namespace strata::train
