#include "train/safetensors.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <span>
#include <utility>

#include "io/checksum_store.h"
#include "common/log.h"

namespace strata::train {

// The data section is copied byte for byte; a big-endian host would need a swap we do not do.
static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian");

namespace {

using Json = nlohmann::json;
using OrderedJson = nlohmann::ordered_json;
using device::DType;

// The reference implementation refuses headers above 100 MB; so do we, before allocating.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;
// Conversions go through a bounce buffer of this many elements at a time.
constexpr uint64_t kBounceElements = 64 * 1024;

struct DTypeEntry {
  SafetensorsDType dtype;
  std::string_view name;
  size_t size;
};
constexpr DTypeEntry kDTypes[] = {
    {SafetensorsDType::kBool, "BOOL", 1},      {SafetensorsDType::kU8, "U8", 1},
    {SafetensorsDType::kI8, "I8", 1},          {SafetensorsDType::kF8E5M2, "F8_E5M2", 1},
    {SafetensorsDType::kF8E4M3, "F8_E4M3", 1}, {SafetensorsDType::kI16, "I16", 2},
    {SafetensorsDType::kU16, "U16", 2},        {SafetensorsDType::kF16, "F16", 2},
    {SafetensorsDType::kBF16, "BF16", 2},      {SafetensorsDType::kI32, "I32", 4},
    {SafetensorsDType::kU32, "U32", 4},        {SafetensorsDType::kF32, "F32", 4},
    {SafetensorsDType::kF64, "F64", 8},        {SafetensorsDType::kI64, "I64", 8},
    {SafetensorsDType::kU64, "U64", 8},
};


// dst[i] = src[i] for n elements, converting through fp32 (exact from 16-bit formats; one
// round-to-nearest-even to them).
void ConvertElements(const void* src, DType from, void* dst, DType to, uint64_t n) {
  device::ConvertHost(src, from, dst, to, static_cast<size_t>(n));
}

// a * b, or nullopt on overflow.
std::optional<uint64_t> CheckedMul(uint64_t a, uint64_t b) {
  uint64_t r;
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}

std::string ShapeString(const std::vector<uint64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

// Checks that [element_offset, element_offset + count) lies within `tensor` and that its dtype
// converts; returns the tensor's device dtype.
Result<DType> CheckRange(const SafetensorsTensor& tensor, uint64_t element_offset, uint64_t count,
                         const std::string& path) {
  if (element_offset > tensor.num_elements || count > tensor.num_elements - element_offset) {
    return OutOfRangeError(
        fmt::format("{}: tensor '{}' has {} elements; elements [{}, {}+{}) are past its end", path,
                    tensor.name, tensor.num_elements, element_offset, element_offset, count));
  }
  std::optional<DType> dtype = ToDeviceDType(tensor.dtype);
  if (!dtype) {
    return UnimplementedError(
        fmt::format("{}: tensor '{}' has dtype {}; only F32, BF16 and F16 can be converted", path,
                    tensor.name, SafetensorsDTypeName(tensor.dtype)));
  }
  return *dtype;
}

// Parses JSON text, rejecting a repeated key in the top-level object (the safetensors spec forbids
// it and nlohmann would silently keep the last one).
Result<Json> ParseHeaderJson(std::string_view text, const std::string& path,
                             std::string_view what) {
  int depth = 0;
  std::set<std::string> top_keys;
  std::string duplicate;
  auto callback = [&](int /*depth*/, Json::parse_event_t event, Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start:
      case Json::parse_event_t::array_start:
        ++depth;
        break;
      case Json::parse_event_t::object_end:
      case Json::parse_event_t::array_end:
        --depth;
        break;
      case Json::parse_event_t::key:
        if (depth == 1 && parsed.is_string() &&
            !top_keys.insert(parsed.get<std::string>()).second && duplicate.empty()) {
          duplicate = parsed.get<std::string>();
        }
        break;
      case Json::parse_event_t::value:
        break;
    }
    return true;
  };
  Json root;
  try {
    root = Json::parse(text.begin(), text.end(), callback);
  } catch (const Json::exception& e) {
    return InvalidArgumentError(fmt::format("{}: {} is not valid JSON: {}", path, what, e.what()));
  }
  if (!duplicate.empty()) {
    return InvalidArgumentError(
        fmt::format("{}: {} has the key '{}' more than once", path, what, duplicate));
  }
  if (!root.is_object()) {
    return InvalidArgumentError(
        fmt::format("{}: {} is a JSON {}, expected an object", path, what, root.type_name()));
  }
  return root;
}

// Validates one tensor entry of a header (offsets not yet checked against each other).
Result<SafetensorsTensor> ParseTensorEntry(const std::string& name, const Json& entry,
                                           uint64_t data_size, uint64_t data_offset,
                                           const std::string& path) {
  auto bad = [&](std::string_view why) {
    return InvalidArgumentError(fmt::format("{}: tensor '{}': {}", path, name, why));
  };
  if (!entry.is_object())
    return bad(fmt::format("entry is a JSON {}, expected an object", entry.type_name()));
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    if (!entry.contains(key)) return bad(fmt::format("entry has no \"{}\"", key));
  }
  SafetensorsTensor tensor;
  tensor.name = name;

  const Json& dtype = entry["dtype"];
  if (!dtype.is_string()) return bad("\"dtype\" is not a string");
  std::optional<SafetensorsDType> parsed = ParseSafetensorsDType(dtype.get<std::string>());
  if (!parsed) return bad(fmt::format("unknown dtype \"{}\"", dtype.get<std::string>()));
  tensor.dtype = *parsed;

  const Json& shape = entry["shape"];
  if (!shape.is_array()) return bad("\"shape\" is not an array");
  uint64_t elements = 1;
  for (const Json& d : shape) {
    if (!d.is_number_unsigned()) {
      return bad(fmt::format("\"shape\" {} holds something other than non-negative integers",
                             shape.dump()));
    }
    tensor.shape.push_back(d.get<uint64_t>());
    std::optional<uint64_t> product = CheckedMul(elements, tensor.shape.back());
    if (!product) return bad(fmt::format("shape {} overflows 64 bits", shape.dump()));
    elements = *product;
  }
  tensor.num_elements = elements;
  std::optional<uint64_t> bytes = CheckedMul(elements, SafetensorsDTypeSize(tensor.dtype));
  if (!bytes) return bad(fmt::format("shape {} overflows 64 bits", shape.dump()));

  const Json& offsets = entry["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
      !offsets[1].is_number_unsigned()) {
    return bad(fmt::format("\"data_offsets\" {} is not [begin, end] with non-negative integers",
                           offsets.dump()));
  }
  tensor.data_begin = offsets[0].get<uint64_t>();
  tensor.data_end = offsets[1].get<uint64_t>();
  if (tensor.data_begin > tensor.data_end) {
    return bad(fmt::format("\"data_offsets\" [{}, {}] ends before it begins", tensor.data_begin,
                           tensor.data_end));
  }
  if (tensor.data_end > data_size) {
    return DataLossError(fmt::format(
        "{}: tensor '{}': \"data_offsets\" [{}, {}] go past the end of the data section ({} "
        "bytes); the file is truncated or the header is wrong",
        path, name, tensor.data_begin, tensor.data_end, data_size));
  }
  if (tensor.data_end - tensor.data_begin != *bytes) {
    return bad(
        fmt::format("\"data_offsets\" [{}, {}] span {} bytes, but shape {} of {} needs {} bytes",
                    tensor.data_begin, tensor.data_end, tensor.data_end - tensor.data_begin,
                    ShapeString(tensor.shape), SafetensorsDTypeName(tensor.dtype), *bytes));
  }
  tensor.file_offset = data_offset + tensor.data_begin;
  return tensor;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Dtypes

std::string_view SafetensorsDTypeName(SafetensorsDType dtype) {
  for (const DTypeEntry& e : kDTypes) {
    if (e.dtype == dtype) return e.name;
  }
  return "?";
}

size_t SafetensorsDTypeSize(SafetensorsDType dtype) {
  for (const DTypeEntry& e : kDTypes) {
    if (e.dtype == dtype) return e.size;
  }
  return 1;
}

std::optional<SafetensorsDType> ParseSafetensorsDType(std::string_view name) {
  for (const DTypeEntry& e : kDTypes) {
    if (e.name == name) return e.dtype;
  }
  return std::nullopt;
}

SafetensorsDType ToSafetensorsDType(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return SafetensorsDType::kF32;
    case DType::kBF16:
      return SafetensorsDType::kBF16;
    case DType::kF16:
      return SafetensorsDType::kF16;
  }
  return SafetensorsDType::kF32;
}

std::optional<DType> ToDeviceDType(SafetensorsDType dtype) {
  switch (dtype) {
    case SafetensorsDType::kF32:
      return DType::kF32;
    case SafetensorsDType::kBF16:
      return DType::kBF16;
    case SafetensorsDType::kF16:
      return DType::kF16;
    default:
      return std::nullopt;
  }
}

// ---------------------------------------------------------------------------------------------
// SafetensorsFile

Result<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path,
                                                               FileSystem& fs) {
  if (fs.IsDirectory(path)) {
    return InvalidArgumentError(fmt::format("{}: not a regular file", path));
  }
  Result<std::unique_ptr<File>> opened = fs.Open(path, OpenMode::kRead);
  if (!opened.ok()) return opened.status().WithContext("safetensors file");
  std::unique_ptr<File> f = std::move(opened).value();
  STRATA_ASSIGN_OR_RETURN(const uint64_t file_size, f->Size());
  if (file_size < 8) {
    return DataLossError(fmt::format(
        "{}: {} bytes long, shorter than the 8-byte header length of a safetensors file", path,
        file_size));
  }
  unsigned char length_bytes[8];
  STRATA_RETURN_IF_ERROR(f->ReadAt(0, length_bytes, 8));
  uint64_t header_length = 0;
  for (int i = 7; i >= 0; --i)
    header_length = (header_length << 8) | length_bytes[i];
  if (header_length > file_size - 8) {
    return DataLossError(fmt::format(
        "{}: the header is said to be {} bytes long but the file has only {} bytes after the "
        "length; truncated, or not a safetensors file",
        path, header_length, file_size - 8));
  }
  if (header_length > kMaxHeaderBytes) {
    return InvalidArgumentError(
        fmt::format("{}: a {}-byte header is larger than the {} bytes allowed", path, header_length,
                    kMaxHeaderBytes));
  }
  std::string text(header_length, '\0');
  STRATA_RETURN_IF_ERROR(f->ReadAt(8, text.data(), header_length));
  STRATA_ASSIGN_OR_RETURN(Json root, ParseHeaderJson(text, path, "the header"));

  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  file->file_size_ = file_size;
  file->data_offset_ = 8 + header_length;
  const uint64_t data_size = file_size - file->data_offset_;
  for (const auto& [key, value] : root.items()) {
    if (key == "__metadata__") {
      if (!value.is_object()) {
        return InvalidArgumentError(
            fmt::format("{}: \"__metadata__\" is a JSON {}, expected an object of strings", path,
                        value.type_name()));
      }
      for (const auto& [mk, mv] : value.items()) {
        if (!mv.is_string()) {
          return InvalidArgumentError(
              fmt::format("{}: \"__metadata__\" key '{}' is a JSON {}, expected a string", path, mk,
                          mv.type_name()));
        }
        file->metadata_[mk] = mv.get<std::string>();
      }
      continue;
    }
    STRATA_ASSIGN_OR_RETURN(SafetensorsTensor tensor,
                            ParseTensorEntry(key, value, data_size, file->data_offset_, path));
    file->tensors_.push_back(std::move(tensor));
  }
  std::sort(file->tensors_.begin(), file->tensors_.end(),
            [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
              return std::tie(a.data_begin, a.data_end, a.name) <
                     std::tie(b.data_begin, b.data_end, b.name);
            });
  // Sorted by begin, two non-empty ranges overlap exactly when one begins before the furthest
  // end seen so far. Empty tensors own no bytes and overlap nothing.
  const SafetensorsTensor* furthest = nullptr;
  for (const SafetensorsTensor& t : file->tensors_) {
    if (t.num_bytes() == 0) continue;
    if (furthest != nullptr && t.data_begin < furthest->data_end) {
      return InvalidArgumentError(
          fmt::format("{}: tensors '{}' (bytes [{}, {})) and '{}' (bytes [{}, {})) overlap", path,
                      furthest->name, furthest->data_begin, furthest->data_end, t.name,
                      t.data_begin, t.data_end));
    }
    if (furthest == nullptr || t.data_end > furthest->data_end) furthest = &t;
  }
  for (size_t i = 0; i < file->tensors_.size(); ++i)
    file->by_name_.emplace(file->tensors_[i].name, i);
  file->file_ = std::move(f);
  STRATA_LOG(debug, train, "opened {}: {} tensors, data at offset {}", path, file->tensors_.size(),
             file->data_offset_);
  return file;
}

SafetensorsFile::~SafetensorsFile() = default;

const SafetensorsTensor* SafetensorsFile::Find(std::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

Status SafetensorsFile::ReadRange(std::string_view name, uint64_t element_offset, uint64_t count,
                                  void* dst, DType dst_dtype) const {
  const SafetensorsTensor* tensor = Find(name);
  if (tensor == nullptr) {
    return NotFoundError(fmt::format("{}: no tensor named '{}'", path_, name));
  }
  STRATA_ASSIGN_OR_RETURN(DType src_dtype, CheckRange(*tensor, element_offset, count, path_));
  const uint64_t src_size = device::DTypeSize(src_dtype);
  const uint64_t offset = tensor->file_offset + element_offset * src_size;
  if (src_dtype == dst_dtype) return file_->ReadAt(offset, dst, count * src_size);
  std::vector<char> bounce(std::min(count, kBounceElements) * src_size);
  const uint64_t dst_size = device::DTypeSize(dst_dtype);
  for (uint64_t done = 0; done < count;) {
    const uint64_t n = std::min(count - done, kBounceElements);
    STRATA_RETURN_IF_ERROR(file_->ReadAt(offset + done * src_size, bounce.data(), n * src_size));
    ConvertElements(bounce.data(), src_dtype, static_cast<char*>(dst) + done * dst_size, dst_dtype,
                    n);
    done += n;
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// SafetensorsModel

Result<std::unique_ptr<SafetensorsModel>> SafetensorsModel::Open(const std::string& path,
                                                                 FileSystem& fs) {
  using FsPath = std::filesystem::path;
  FsPath source(path);
  if (fs.IsDirectory(source.string())) {
    if (fs.Exists((source / kSafetensorsModelFile).string())) {
      source /= kSafetensorsModelFile;
    } else if (fs.Exists((source / kSafetensorsIndexFile).string())) {
      source /= kSafetensorsIndexFile;
    } else {
      return NotFoundError(fmt::format("model directory {} holds neither {} nor {}", path,
                                       kSafetensorsModelFile, kSafetensorsIndexFile));
    }
  }
  std::unique_ptr<SafetensorsModel> model(new SafetensorsModel());
  model->source_ = source.string();
  if (source.extension() != ".json") {
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file,
                            SafetensorsFile::Open(model->source_, fs));
    for (const SafetensorsTensor& t : file->tensors())
      model->by_name_.emplace(t.name, file.get());
    model->files_.push_back(std::move(file));
    return model;
  }

  // A sharded model: the index maps each tensor to a file beside it.
  const std::string& index = model->source_;
  Result<std::unique_ptr<File>> opened = fs.Open(index, OpenMode::kRead);
  if (!opened.ok()) return opened.status().WithContext("safetensors index");
  STRATA_ASSIGN_OR_RETURN(const uint64_t index_size, (*opened)->Size());
  if (index_size > kMaxHeaderBytes) {
    return InvalidArgumentError(
        fmt::format("{}: {} bytes is too large for an index", index, index_size));
  }
  std::string text(static_cast<size_t>(index_size), '\0');
  STRATA_RETURN_IF_ERROR((*opened)->ReadAt(0, text.data(), text.size()));
  STRATA_ASSIGN_OR_RETURN(Json root, ParseHeaderJson(text, index, "the index"));
  if (!root.contains("weight_map") || !root["weight_map"].is_object()) {
    return InvalidArgumentError(fmt::format(
        "{}: the index has no \"weight_map\" object (tensor name -> file name)", index));
  }
  std::map<std::string, std::string> weight_map;
  std::set<std::string> shards;
  for (const auto& [tensor, shard] : root["weight_map"].items()) {
    if (!shard.is_string()) {
      return InvalidArgumentError(
          fmt::format("{}: \"weight_map\" maps '{}' to a JSON {}, expected a file name", index,
                      tensor, shard.type_name()));
    }
    std::string name = shard.get<std::string>();
    FsPath shard_path(name);
    bool escapes = name.empty() || shard_path.is_absolute();
    for (const FsPath& part : shard_path)
      escapes = escapes || part == "..";
    if (escapes) {
      return InvalidArgumentError(fmt::format(
          "{}: \"weight_map\" maps '{}' to '{}', expected a file name inside the index's directory",
          index, tensor, name));
    }
    weight_map.emplace(tensor, name);
    shards.insert(name);
  }
  const FsPath dir = source.parent_path();
  std::map<std::string, const SafetensorsFile*> by_shard;
  for (const std::string& shard : shards) {
    Result<std::unique_ptr<SafetensorsFile>> file =
        SafetensorsFile::Open((dir / shard).string(), fs);
    if (!file.ok()) return file.status().WithContext(fmt::format("shard '{}' of {}", shard, index));
    by_shard[shard] = file->get();
    model->files_.push_back(std::move(file).value());
  }
  for (const auto& [tensor, shard] : weight_map) {
    const SafetensorsFile* file = by_shard[shard];
    if (file->Find(tensor) == nullptr) {
      return InvalidArgumentError(fmt::format(
          "{}: \"weight_map\" puts tensor '{}' in shard '{}', but {} has no such tensor", index,
          tensor, shard, file->path()));
    }
    model->by_name_.emplace(tensor, file);
  }
  return model;
}

std::vector<std::string> SafetensorsModel::TensorNames() const {
  std::vector<std::string> names;
  names.reserve(by_name_.size());
  for (const auto& [name, file] : by_name_)
    names.push_back(name);
  return names;
}

Result<const SafetensorsFile*> SafetensorsModel::FileOf(std::string_view name) const {
  auto it = by_name_.find(name);
  if (it == by_name_.end()) {
    return NotFoundError(fmt::format("{}: the model has no tensor named '{}'", source_, name));
  }
  return it->second;
}

Result<const SafetensorsTensor*> SafetensorsModel::Find(std::string_view name) const {
  STRATA_ASSIGN_OR_RETURN(const SafetensorsFile* file, FileOf(name));
  return file->Find(name);
}

Status SafetensorsModel::ReadRange(std::string_view name, uint64_t element_offset, uint64_t count,
                                   void* dst, DType dst_dtype) const {
  STRATA_ASSIGN_OR_RETURN(const SafetensorsFile* file, FileOf(name));
  return file->ReadRange(name, element_offset, count, dst, dst_dtype);
}

// ---------------------------------------------------------------------------------------------
// SafetensorsLayout

Result<SafetensorsLayout> SafetensorsLayout::Compute(
    const std::vector<SafetensorsTensorSpec>& tensors,
    const std::map<std::string, std::string>& metadata) {
  SafetensorsLayout layout;
  std::set<std::string_view> names;
  for (const SafetensorsTensorSpec& spec : tensors) {
    if (spec.name.empty())
      return InvalidArgumentError("safetensors layout: a tensor has an empty name");
    if (spec.name == "__metadata__") {
      return InvalidArgumentError(
          "safetensors layout: \"__metadata__\" is reserved, not a tensor name");
    }
    if (!names.insert(spec.name).second) {
      return InvalidArgumentError(
          fmt::format("safetensors layout: tensor '{}' appears more than once", spec.name));
    }
  }
  // Largest elements first keeps every tensor aligned to its element size without padding.
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i)
    order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return SafetensorsDTypeSize(tensors[a].dtype) > SafetensorsDTypeSize(tensors[b].dtype);
  });

  OrderedJson header = OrderedJson::object();
  if (!metadata.empty()) {
    OrderedJson meta = OrderedJson::object();
    for (const auto& [k, v] : metadata)
      meta[k] = v;
    header["__metadata__"] = std::move(meta);
  }
  uint64_t offset = 0;
  for (size_t i : order) {
    const SafetensorsTensorSpec& spec = tensors[i];
    SafetensorsTensor t;
    t.name = spec.name;
    t.dtype = spec.dtype;
    t.shape = spec.shape;
    std::optional<uint64_t> elements = 1;
    for (uint64_t d : spec.shape)
      if (elements) elements = CheckedMul(*elements, d);
    std::optional<uint64_t> bytes =
        elements ? CheckedMul(*elements, SafetensorsDTypeSize(spec.dtype)) : std::nullopt;
    if (!bytes || offset + *bytes < offset) {
      return InvalidArgumentError(
          fmt::format("safetensors layout: tensor '{}' of shape {} is too large", spec.name,
                      ShapeString(spec.shape)));
    }
    t.num_elements = *elements;
    t.data_begin = offset;
    t.data_end = offset + *bytes;
    offset = t.data_end;
    header[t.name] = OrderedJson{{"dtype", std::string(SafetensorsDTypeName(t.dtype))},
                                 {"shape", t.shape},
                                 {"data_offsets", {t.data_begin, t.data_end}}};
    layout.tensors_.push_back(std::move(t));
  }
  layout.data_size_ = offset;

  std::string json = header.dump();
  // Spaces after the JSON (allowed by JSON and by the reference reader) start the data at a
  // multiple of 8.
  json.append((8 - (8 + json.size()) % 8) % 8, ' ');
  layout.header_.reserve(8 + json.size());
  uint64_t length = json.size();
  for (int i = 0; i < 8; ++i)
    layout.header_.push_back(static_cast<char>((length >> (8 * i)) & 0xff));
  layout.header_ += json;
  for (SafetensorsTensor& t : layout.tensors_)
    t.file_offset = layout.header_.size() + t.data_begin;
  for (size_t i = 0; i < layout.tensors_.size(); ++i)
    layout.by_name_.emplace(layout.tensors_[i].name, i);
  return layout;
}

const SafetensorsTensor* SafetensorsLayout::Find(std::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

// ---------------------------------------------------------------------------------------------
// SafetensorsWriter

SafetensorsWriter::SafetensorsWriter(std::string path, SafetensorsLayout layout,
                                     std::unique_ptr<File> file)
    : path_(std::move(path)), layout_(std::move(layout)), file_(std::move(file)) {}

SafetensorsWriter::~SafetensorsWriter() = default;

Result<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::Create(
    const std::string& path, const SafetensorsLayout& layout, FileSystem& fs) {
  Result<std::unique_ptr<File>> opened = fs.Open(path, OpenMode::kCreate);
  if (!opened.ok()) return opened.status().WithContext("safetensors file");
  std::unique_ptr<File> f = std::move(opened).value();
  // Reserving the blocks now turns a full disk into an error here, before any data is written.
  STRATA_RETURN_IF_ERROR(f->Reserve(layout.file_size()));
  STRATA_RETURN_IF_ERROR(f->WriteAt(0, layout.header().data(), layout.header().size()));
  // On a shared filesystem (NFS: close-to-open consistency) the other writers open the file on
  // other nodes after the caller's barrier; make the size and header durable and visible first.
  STRATA_RETURN_IF_ERROR(f->Sync());
  std::unique_ptr<SafetensorsWriter> w(new SafetensorsWriter(path, layout, std::move(f)));
  {
    MutexLock lock(w->written_mu_);
    w->written_.push_back({0, layout.header().size(),
                           io::Checksum64(std::as_bytes(std::span(layout.header()))), "header"});
  }
  return w;
}

Result<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::Open(
    const std::string& path, const SafetensorsLayout& layout, FileSystem& fs) {
  Result<std::unique_ptr<File>> opened = fs.Open(path, OpenMode::kReadWrite);
  if (!opened.ok()) return opened.status().WithContext("safetensors file, for writing");
  std::unique_ptr<File> f = std::move(opened).value();
  STRATA_ASSIGN_OR_RETURN(const uint64_t size, f->Size());
  if (size != layout.file_size()) {
    return FailedPreconditionError(fmt::format(
        "{}: {} bytes, but the layout needs {}; was it created (SafetensorsWriter::Create) from "
        "the same tensor list?",
        path, size, layout.file_size()));
  }
  std::string header(layout.header().size(), '\0');
  STRATA_RETURN_IF_ERROR(f->ReadAt(0, header.data(), header.size()));
  if (header != layout.header()) {
    return FailedPreconditionError(fmt::format(
        "{}: the header differs from this layout's; the file was created from another tensor list",
        path));
  }
  return std::unique_ptr<SafetensorsWriter>(new SafetensorsWriter(path, layout, std::move(f)));
}

Status SafetensorsWriter::WriteRange(std::string_view name, uint64_t element_offset, uint64_t count,
                                     const void* src, DType src_dtype) {
  return WriteStrided(name, element_offset, count, 1, count, src, src_dtype);
}

Status SafetensorsWriter::WriteStrided(std::string_view name, uint64_t element_offset,
                                       uint64_t chunk, uint64_t chunks, uint64_t stride,
                                       const void* src, DType src_dtype) {
  if (!file_) {
    return FailedPreconditionError(fmt::format("{}: WriteRange after Finish", path_));
  }
  const SafetensorsTensor* tensor = layout_.Find(name);
  if (tensor == nullptr) {
    return NotFoundError(fmt::format("{}: the layout has no tensor named '{}'", path_, name));
  }
  if (chunks > 1 && stride < chunk) {
    return InvalidArgumentError(
        fmt::format("{}: tensor '{}': chunks of {} elements {} apart would overlap", path_, name,
                    chunk, stride));
  }
  const uint64_t span = chunks == 0 ? 0 : (chunks - 1) * stride + chunk;
  STRATA_ASSIGN_OR_RETURN(DType file_dtype, CheckRange(*tensor, element_offset, span, path_));
  if (chunk == 0 || chunks == 0) return Status::Ok();
  const uint64_t file_size = device::DTypeSize(file_dtype);
  const uint64_t src_size = device::DTypeSize(src_dtype);
  const uint64_t offset = tensor->file_offset + element_offset * file_size;
  io::Checksum64Stream hash;
  std::vector<char> bounce;
  if (src_dtype != file_dtype) bounce.resize(std::min(chunk, kBounceElements) * file_size);
  for (uint64_t c = 0; c < chunks; ++c) {
    const char* from = static_cast<const char*>(src) + c * chunk * src_size;
    const uint64_t at = offset + c * stride * file_size;
    if (src_dtype == file_dtype) {
      STRATA_RETURN_IF_ERROR(file_->WriteAt(at, from, chunk * file_size));
      hash.Update(from, chunk * file_size);
      continue;
    }
    for (uint64_t done = 0; done < chunk;) {
      const uint64_t n = std::min(chunk - done, kBounceElements);
      ConvertElements(from + done * src_size, src_dtype, bounce.data(), file_dtype, n);
      STRATA_RETURN_IF_ERROR(file_->WriteAt(at + done * file_size, bounce.data(), n * file_size));
      hash.Update(bounce.data(), n * file_size);
      done += n;
    }
  }
  WrittenRange range{offset,        chunk * file_size,
                     hash.Digest(), std::string(name),
                     chunks,        chunks > 1 ? stride * file_size : 0};
  MutexLock lock(written_mu_);
  written_.push_back(std::move(range));
  return Status::Ok();
}

Status SafetensorsWriter::Finish() {
  if (!file_) return Status::Ok();
  // Closed whatever happens: a failed fsync leaves the page cache state unknown, and retrying
  // on the same descriptor would report success falsely (the error is consumed).
  const std::unique_ptr<File> file = std::move(file_);
  return file->Sync();
}

// ---------------------------------------------------------------------------------------------
// Index and commit

Status WriteSafetensorsIndex(const std::string& path, uint64_t total_size,
                             const std::map<std::string, std::string>& weight_map, FileSystem& fs) {
  OrderedJson index = OrderedJson::object();
  index["metadata"] = OrderedJson{{"total_size", total_size}};
  OrderedJson map = OrderedJson::object();
  for (const auto& [tensor, file] : weight_map)
    map[tensor] = file;
  index["weight_map"] = std::move(map);
  return WriteFileDurable(fs, path, index.dump(2) + "\n");
}

}  // namespace strata::train
