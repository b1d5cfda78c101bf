// A store wrapper that behaves like a disk of fixed bandwidth: requests are served one at a time,
// in submission order, each for `length / bytes_per_second`, and a request's callback runs no
// earlier than the end of its service (nor before the inner store finished it). Service starts at
// the later of the request's submission and the end of the previous request's service, so an idle
// disk does not bank time.
//
// What it is for: measuring a schedule (the prefetch scheduler, the overlap benchmark) against a
// disk that does not speed up and slow down between runs, as a shared or virtual disk does. It is
// a model, not a throttle for production: it has no per-request latency, no queue-depth effects
// and no read/write asymmetry. Data moves through the inner store (typically the memory store)
// as soon as it is submitted; the caller sees it complete at its paced time.
//
// Callbacks run on the wrapper's one timer thread (or on the inner store's thread when the inner
// store finishes after the paced deadline), one at a time: a slow callback delays the ones after
// it past their deadlines, as a slow completion handler would on a real store's I/O thread.
//
// StoreStats come from the inner store, except busy_ns, which is the paced disk's: the time with
// at least one request between Submit and the return of its callback.
//
// Time is read from, and waited on, a Clock (common/clock.h): the real one by default; a test's
// ManualClock makes every deadline exact and lets it move time instead of sleeping.
#pragma once

#include <memory>

#include "common/clock.h"
#include "strata/block_store.h"

namespace strata::io {

// InvalidArgument unless bytes_per_second is finite and at least 1 MiB/s. `clock`: RealClock()
// when null; it must outlive the store.
Result<std::unique_ptr<BlockStore>> CreatePacedStore(std::unique_ptr<BlockStore> inner,
                                                     double bytes_per_second,
                                                     Clock* clock = nullptr);

}  // namespace strata::io
