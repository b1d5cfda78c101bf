// In-memory backend: logical files kept in RAM, keyed by their path list, surviving Close and
// re-Open for the life of the store. Requests run on a worker thread (callbacks never run inside
// Submit). Under DirectMode kAuto/kOn it enforces direct-I/O alignment like a real NVMe file, so
// code tested against it is correct on disk. Reads past the end of a file fail with OutOfRange.
#pragma once

#include <memory>

#include "io/fault_injection.h"
#include "strata/block_store.h"

namespace strata::io {

// `faults` (optional) injects errors and short transfers into this backend's transfers.
Result<std::unique_ptr<BlockStore>> CreateMemoryStore(
    const StoreOptions& options, std::shared_ptr<FaultInjector> faults = nullptr);

}  // namespace strata::io
