// io_uring backend: one ring per I/O thread, O_DIRECT, registered (fixed) buffers and files,
// batched submission, every CQE's res checked, short transfers resubmitted, EAGAIN/EINTR retried.
// Setup flags are probed with fallback: SINGLE_ISSUER + DEFER_TASKRUN, then COOP_TASKRUN, then none
// (SQPOLL first when StoreOptions::sqpoll is set). Fails with Unavailable/PermissionDenied/
// Unimplemented when io_uring cannot be set up at all, so that CreateBlockStore can fall back.
#pragma once

#include <memory>

#include "io/fault_injection.h"
#include "strata/block_store.h"

namespace strata::io {

// `faults` (optional) injects errors and short transfers into this backend's transfers.
Result<std::unique_ptr<BlockStore>> CreateUringStore(
    const StoreOptions& options, std::shared_ptr<FaultInjector> faults = nullptr);

}  // namespace strata::io
