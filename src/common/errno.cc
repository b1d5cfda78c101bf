#include "common/errno.h"

#include <cerrno>
#include <cstring>
#include <string>

namespace strata {

std::string_view ErrnoName(int err) {
  switch (err) {
#define STRATA_ERRNO_CASE_(e) \
  case e:                     \
    return #e;
    STRATA_ERRNO_CASE_(EPERM)
    STRATA_ERRNO_CASE_(ENOENT)
    STRATA_ERRNO_CASE_(EINTR)
    STRATA_ERRNO_CASE_(EIO)
    STRATA_ERRNO_CASE_(ENXIO)
    STRATA_ERRNO_CASE_(EBADF)
    STRATA_ERRNO_CASE_(EAGAIN)
    STRATA_ERRNO_CASE_(ENOMEM)
    STRATA_ERRNO_CASE_(EACCES)
    STRATA_ERRNO_CASE_(EFAULT)
    STRATA_ERRNO_CASE_(EBUSY)
    STRATA_ERRNO_CASE_(EEXIST)
    STRATA_ERRNO_CASE_(EXDEV)
    STRATA_ERRNO_CASE_(ENODEV)
    STRATA_ERRNO_CASE_(ENOTDIR)
    STRATA_ERRNO_CASE_(EISDIR)
    STRATA_ERRNO_CASE_(EINVAL)
    STRATA_ERRNO_CASE_(ENFILE)
    STRATA_ERRNO_CASE_(EMFILE)
    STRATA_ERRNO_CASE_(EFBIG)
    STRATA_ERRNO_CASE_(ENOSPC)
    STRATA_ERRNO_CASE_(ESPIPE)
    STRATA_ERRNO_CASE_(EROFS)
    STRATA_ERRNO_CASE_(ENAMETOOLONG)
    STRATA_ERRNO_CASE_(ENOSYS)
    STRATA_ERRNO_CASE_(ENOTEMPTY)
    STRATA_ERRNO_CASE_(ELOOP)
    STRATA_ERRNO_CASE_(EOVERFLOW)
    STRATA_ERRNO_CASE_(EOPNOTSUPP)
    STRATA_ERRNO_CASE_(ETIMEDOUT)
    STRATA_ERRNO_CASE_(ECANCELED)
    STRATA_ERRNO_CASE_(EDQUOT)
    STRATA_ERRNO_CASE_(ENODATA)
    STRATA_ERRNO_CASE_(ERANGE)
    STRATA_ERRNO_CASE_(ENOTTY)
    STRATA_ERRNO_CASE_(EPIPE)
#undef STRATA_ERRNO_CASE_
    default:
      return "errno";
  }
}

std::string ErrnoText(int err) {
  char buf[256];
  // GNU strerror_r returns a pointer that may or may not be `buf`.
  const char* text = strerror_r(err, buf, sizeof(buf));
  return text;
}

namespace {
StatusCode CodeForErrno(int err) {
  switch (err) {
    case 0:
      return StatusCode::kInternal;
    case ENOENT:
    case ENXIO:
    case ENODEV:
      return StatusCode::kNotFound;
    case EACCES:
    case EPERM:
    case EROFS:
      return StatusCode::kPermissionDenied;
    case ENOSPC:
    case EDQUOT:
    case ENOMEM:
    case EMFILE:
    case ENFILE:
    case EFBIG:
      return StatusCode::kResourceExhausted;
    case EINVAL:
    case EBADF:
    case EFAULT:
    case ENAMETOOLONG:
    case ENOTDIR:
    case EISDIR:
    case ELOOP:
    case ESPIPE:
    case EOVERFLOW:
      return StatusCode::kInvalidArgument;
    case EIO:
    case ENODATA:
      return StatusCode::kDataLoss;
    case EAGAIN:
    case EBUSY:
    case EINTR:
      return StatusCode::kUnavailable;
    case EEXIST:
    case ENOTEMPTY:
      return StatusCode::kAlreadyExists;
    case ENOSYS:
    case EOPNOTSUPP:
      return StatusCode::kUnimplemented;
    case ETIMEDOUT:
      return StatusCode::kDeadlineExceeded;
    case ECANCELED:
      return StatusCode::kCancelled;
    case ERANGE:
      return StatusCode::kOutOfRange;
    default:
      return StatusCode::kUnknown;
  }
}
}  // namespace

Status ErrnoToStatus(int err, std::string_view context) {
  if (err == 0) {
    return InternalError(std::string(context) + ": error reported with errno 0");
  }
  std::string msg(context);
  msg += ": ";
  msg += ErrnoText(err);
  msg += " (";
  std::string_view name = ErrnoName(err);
  if (name == "errno") {
    msg += "errno " + std::to_string(err);
  } else {
    msg += name;
  }
  msg += ")";
  return Status(CodeForErrno(err), msg);
}

}  // namespace strata
