// pread/pwrite backend: a pool of StoreOptions::threads threads, each issuing one blocking
// pread/pwrite (pwritev2 with RWF_DSYNC for durable writes) at a time. Used where io_uring is not
// available. Same semantics as the io_uring backend: short transfers resubmitted, EINTR/EAGAIN
// retried, errors with path, offset, length and errno text.
#pragma once

#include <memory>

#include "io/fault_injection.h"
#include "strata/block_store.h"

namespace strata::io {

// `faults` (optional) injects errors and short transfers into this backend's transfers.
Result<std::unique_ptr<BlockStore>> CreatePosixStore(
    const StoreOptions& options, std::shared_ptr<FaultInjector> faults = nullptr);

}  // namespace strata::io
