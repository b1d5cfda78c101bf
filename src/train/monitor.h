// The training monitors DeepSpeed users configure: "tensorboard" (event files TensorBoard reads)
// and "csv_monitor" (one CSV file per metric), written by rank 0 after every step.
//
//   tensorboard   output_path/job_name/events.out.tfevents.<seconds>.<host>: TFRecord framing
//                 (length, masked CRC32C of the length, an Event protobuf, its masked CRC32C),
//                 one scalar Summary per event.
//   csv_monitor   output_path/job_name/<tag with '/' as '_'>.csv: "step,<last part of the tag>"
//                 then one "step,value" row per event.
//
// The tags follow DeepSpeed's (Train/Samples/train_loss, Train/Samples/lr,
// Train/Samples/loss_scale, their step the number of samples trained) plus Strata's own
// (Train/Strata/..., per optimizer step). Every write is flushed, so a run that dies keeps what it
// logged.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "strata/config.h"
#include "strata/status.h"

namespace strata::train {

// One scalar of one step.
struct MonitorEvent {
  std::string tag;  // e.g. "Train/Samples/train_loss"
  double value = 0.0;
  int64_t step = 0;
};

class MonitorWriter {
 public:
  virtual ~MonitorWriter() = default;
  virtual Status Write(const std::vector<MonitorEvent>& events) = 0;
  // Where it writes (a file or a directory), for the run's log.
  virtual std::string where() const = 0;
};

// The writers the config enables (none when neither section is enabled). Creates their
// directories and files now, so that an unwritable path is an error before the first step.
Result<std::vector<std::unique_ptr<MonitorWriter>>> CreateMonitors(const Config& config);

// CRC32C (Castagnoli), as TFRecord frames use it; and its "masked" form.
uint32_t Crc32c(std::string_view data);
uint32_t MaskedCrc32c(std::string_view data);

}  // namespace strata::train
