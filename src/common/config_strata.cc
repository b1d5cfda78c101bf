// The config parser's "strata" section: Strata's own settings (config_parser.h).
#include "common/config_parser.h"

#include "common/log.h"

namespace strata::config_internal {

Status ConfigParser::ParseLora(const Field& f) {
  LoraSettings& l = config_.strata.lora;
  std::vector<KeySpec> specs = {
      {.name = "r",
       .parse = [&](const Field& v) { return ReadInt(v, 0, 65536, "an integer from 0 to 65536", &l.r); }},
      {.name = "lora_alpha",
       .parse =
           [&](const Field& v) {
             return ReadDouble(v, 0, kInf, kNonNegativeNumber, &l.lora_alpha);
           }},
      {.name = "lora_dropout",
       .parse =
           [&](const Field& v) {
             STRATA_RETURN_IF_ERROR(ReadDouble(v, 0, 1, "a number from 0 to 1", &l.lora_dropout));
             if (l.lora_dropout != 0.0) {
               return Status(StatusCode::kUnimplemented,
                             fmt::format("{}: {}: LoRA dropout is not implemented; use 0",
                                         v.path, l.lora_dropout));
             }
             return Status::Ok();
           }},
      {.name = "target_modules",
       .parse =
           [&](const Field& v) {
             return ReadStringList(v, "a list of projection names (\"q_proj\", ..., "
                                      "\"down_proj\") or \"all-linear\"",
                                   &l.target_modules);
           }},
      Ignored("bias"),
      Ignored("task_type"),
  };
  return WalkObject(f, specs);
}

Status ConfigParser::ParseStrata(const Field& f) {
  StrataSettings& s = config_.strata;
  std::vector<KeySpec> specs = {
      {.name = "io", .parse = [this](const Field& v) { return ParseIo(v); }},
      {.name = "memory", .parse = [this](const Field& v) { return ParseMemory(v); }},
      {.name = "prefetch", .parse = [this](const Field& v) { return ParsePrefetch(v); }},
      {.name = "device",
       .parse =
           [&](const Field& v) {
             return ReadEnum<DeviceKind>(v,
                                         {{"auto", DeviceKind::kAuto},
                                          {"cpu", DeviceKind::kCpu},
                                          {"cuda", DeviceKind::kCuda}},
                                         &s.device);
           }},
      {.name = "tf32", .parse = [&](const Field& v) { return ReadBool(v, &s.tf32); }},
      {.name = "activation_checkpointing",
       .parse = [&](const Field& v) { return ReadToggle(v, &s.activation_checkpointing); }},
      {.name = "split_blocks",
       .parse = [&](const Field& v) { return ReadToggle(v, &s.split_blocks); }},
      {.name = "offload_checkpoints",
       .parse = [&](const Field& v) { return ReadToggle(v, &s.offload_checkpoints); }},
      {.name = "on_nonfinite",
       .parse =
           [&](const Field& v) {
             return ReadEnum<NonFinitePolicy>(
                 v, {{"error", NonFinitePolicy::kError}, {"skip", NonFinitePolicy::kSkip}},
                 &s.on_nonfinite);
           }},
      {.name = "cpu_adam_threads",
       .parse =
           [&](const Field& v) {
             return ReadOptional(v, &s.cpu_adam_threads, [&](int* n) {
               return ReadInt(v, 1, 1024, "an integer from 1 to 1024 or \"auto\"", n);
             });
           }},
      {.name = "freeze",
       .parse =
           [&](const Field& v) {
             return ReadStringList(v, "a list of parameter-name patterns", &s.freeze);
           }},
      {.name = "trainable",
       .parse =
           [&](const Field& v) {
             return ReadStringList(v, "a list of parameter-name patterns", &s.trainable);
           }},
      {.name = "lora", .parse = [this](const Field& v) { return ParseLora(v); }},
      {.name = "seed",
       .parse =
           [&](const Field& v) {
             int64_t seed = static_cast<int64_t>(s.seed);
             STRATA_RETURN_IF_ERROR(ReadInt64(v, 0, kInt64Max, kNonNegativeInteger, &seed));
             s.seed = static_cast<uint64_t>(seed);
             return Status::Ok();
           }},
  };
  return WalkObject(f, specs);
}

Status ConfigParser::ParseIo(const Field& f) {
  IoSettings& io = config_.strata.io;
  auto flag = [](bool* out) { return [out](const Field& v) { return ReadBool(v, out); }; };
  std::vector<KeySpec> specs = {
      {.name = "backend",
       .parse =
           [&](const Field& v) {
             return ReadEnum<IoBackend>(v,
                                        {{"auto", IoBackend::kAuto},
                                         {"uring", IoBackend::kUring},
                                         {"posix", IoBackend::kPosix},
                                         {"io_uring", IoBackend::kUring}},
                                        &io.backend);
           }},
      {.name = "direct", .parse = [&](const Field& v) { return ReadToggle(v, &io.direct); }},
      {.name = "threads",
       .parse =
           [&](const Field& v) {
             return ReadOptional(v, &pending_.io_threads, [&](int* n) {
               return ReadInt(v, 1, kIntMax, "a positive integer or \"auto\"", n);
             });
           }},
      {.name = "queue_depth",
       .parse =
           [&](const Field& v) {
             return ReadOptional(v, &pending_.io_queue_depth, [&](int* n) {
               return ReadInt(v, 1, kIntMax, "a positive integer or \"auto\"", n);
             });
           }},
      {.name = "block_size",
       .parse =
           [&](const Field& v) {
             return ReadOptional(v, &pending_.io_block_size, [&](uint64_t* n) {
               return ReadBytes(v, kIoAlignment, kIoAlignment, kAlignedBytes, n);
             });
           }},
      {.name = "stripe_unit",
       .parse =
           [&](const Field& v) {
             return ReadBytes(v, kIoAlignment, kIoAlignment, kAlignedBytes, &io.stripe_unit);
           }},
      {.name = "nvme_paths",
       .parse =
           [&](const Field& v) {
             return ReadOptional(v, &pending_.nvme_paths, [&](std::vector<std::string>* paths) {
               return ReadStringList(v, "a non-empty list of directory paths", paths);
             });
           }},
      {.name = "huge_pages",
       .parse = [&](const Field& v) { return ReadToggle(v, &io.huge_pages); }},
      {.name = "sqpoll", .parse = flag(&io.sqpoll)},
      {.name = "register_buffers", .parse = flag(&io.register_buffers)},
      {.name = "register_files", .parse = flag(&io.register_files)},
      {.name = "durable_writes", .parse = flag(&io.durable_writes)},
      {.name = "checksums", .parse = flag(&io.checksums)},
      {.name = "numa_bind", .parse = flag(&io.numa_bind)},
  };
  return WalkObject(f, specs);
}

Status ConfigParser::ParseMemory(const Field& f) {
  MemorySettings& m = config_.strata.memory;
  static constexpr std::string_view kBudget =
      "a positive byte size (a number of bytes or a string such as \"64GiB\") or \"auto\"";
  auto budget = [](std::optional<uint64_t>* out) {
    return [out](const Field& v) {
      return ReadOptional(v, out, [&](uint64_t* n) { return ReadBytes(v, 1, 1, kBudget, n); });
    };
  };
  std::vector<KeySpec> specs = {
      {.name = "pinned_pool", .parse = budget(&m.pinned_pool)},
      {.name = "device_budget", .parse = budget(&m.device_budget)},
      {.name = "host_budget", .parse = budget(&m.host_budget)},
      {.name = "share_host_memory",
       .parse = [&m](const Field& v) { return ReadToggle(v, &m.share_host_memory); }},
  };
  return WalkObject(f, specs);
}

Status ConfigParser::ParsePrefetch(const Field& f) {
  PrefetchSettings& p = config_.strata.prefetch;
  std::vector<KeySpec> specs = {
      {.name = "host_lookahead",
       .parse =
           [&](const Field& v) {
             return ReadOptional(v, &p.host_lookahead, [&](uint64_t* n) {
               return ReadBytes(v, 0, 1,
                                "a byte size (a number of bytes or a string such as \"8GiB\") "
                                "or \"auto\"",
                                n);
             });
           }},
  };
  return WalkObject(f, specs);
}

}  // namespace strata::config_internal
