// The one place where an errno value becomes a Status.
#pragma once

#include <string_view>

#include "strata/status.h"

namespace strata {

// Maps `err` (a positive errno value) to a Status whose message is
// "<context>: <strerror text> (<ERRNO_NAME>)", e.g.
// "open /mnt/nvme0/x: No such file or directory (ENOENT)".
// The code follows the errno: ENOENT -> NotFound, EACCES/EPERM/EROFS -> PermissionDenied,
// ENOSPC/EDQUOT/ENOMEM/EMFILE -> ResourceExhausted, EINVAL -> InvalidArgument, EIO -> DataLoss,
// EAGAIN/EBUSY/EINTR -> Unavailable, EEXIST -> AlreadyExists, ENOSYS/EOPNOTSUPP -> Unimplemented,
// ... err == 0 returns an Internal error (a caller asked to convert success).
Status ErrnoToStatus(int err, std::string_view context);

// The symbolic name of an errno value ("ENOENT"), or "errno <n>" when unknown.
std::string_view ErrnoName(int err);

// Thread-safe strerror text.
std::string ErrnoText(int err);

}  // namespace strata
