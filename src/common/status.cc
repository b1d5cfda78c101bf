#include "strata/status.h"

namespace strata {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "OK";
    case StatusCode::kCancelled:
      return "CANCELLED";
    case StatusCode::kUnknown:
      return "UNKNOWN";
    case StatusCode::kInvalidArgument:
      return "INVALID_ARGUMENT";
    case StatusCode::kDeadlineExceeded:
      return "DEADLINE_EXCEEDED";
    case StatusCode::kNotFound:
      return "NOT_FOUND";
    case StatusCode::kAlreadyExists:
      return "ALREADY_EXISTS";
    case StatusCode::kPermissionDenied:
      return "PERMISSION_DENIED";
    case StatusCode::kResourceExhausted:
      return "RESOURCE_EXHAUSTED";
    case StatusCode::kFailedPrecondition:
      return "FAILED_PRECONDITION";
    case StatusCode::kAborted:
      return "ABORTED";
    case StatusCode::kOutOfRange:
      return "OUT_OF_RANGE";
    case StatusCode::kUnimplemented:
      return "UNIMPLEMENTED";
    case StatusCode::kInternal:
      return "INTERNAL";
    case StatusCode::kUnavailable:
      return "UNAVAILABLE";
    case StatusCode::kDataLoss:
      return "DATA_LOSS";
    case StatusCode::kUnauthenticated:
      return "UNAUTHENTICATED";
  }
  return "UNKNOWN_CODE";
}

Status::Status(StatusCode code, std::string_view message) {
  if (code != StatusCode::kOk) rep_ = std::make_unique<Rep>(Rep{code, std::string(message)});
}

Status::Status(const Status& other)
    : rep_(other.rep_ ? std::make_unique<Rep>(*other.rep_) : nullptr) {}

Status& Status::operator=(const Status& other) {
  if (this != &other) rep_ = other.rep_ ? std::make_unique<Rep>(*other.rep_) : nullptr;
  return *this;
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  std::string out(StatusCodeName(rep_->code));
  out += ": ";
  out += rep_->message;
  return out;
}

Status Status::WithContext(std::string_view context) const {
  if (ok()) return Status();
  std::string msg(context);
  msg += ": ";
  msg += rep_->message;
  return Status(rep_->code, msg);
}

#define STRATA_DEFINE_ERROR_CTOR_(Name, Code) \
  Status Name(std::string_view message) {     \
    return Status(StatusCode::Code, message); \
  }
STRATA_DEFINE_ERROR_CTOR_(CancelledError, kCancelled)
STRATA_DEFINE_ERROR_CTOR_(UnknownError, kUnknown)
STRATA_DEFINE_ERROR_CTOR_(InvalidArgumentError, kInvalidArgument)
STRATA_DEFINE_ERROR_CTOR_(DeadlineExceededError, kDeadlineExceeded)
STRATA_DEFINE_ERROR_CTOR_(NotFoundError, kNotFound)
STRATA_DEFINE_ERROR_CTOR_(AlreadyExistsError, kAlreadyExists)
STRATA_DEFINE_ERROR_CTOR_(PermissionDeniedError, kPermissionDenied)
STRATA_DEFINE_ERROR_CTOR_(ResourceExhaustedError, kResourceExhausted)
STRATA_DEFINE_ERROR_CTOR_(FailedPreconditionError, kFailedPrecondition)
STRATA_DEFINE_ERROR_CTOR_(AbortedError, kAborted)
STRATA_DEFINE_ERROR_CTOR_(OutOfRangeError, kOutOfRange)
STRATA_DEFINE_ERROR_CTOR_(UnimplementedError, kUnimplemented)
STRATA_DEFINE_ERROR_CTOR_(InternalError, kInternal)
STRATA_DEFINE_ERROR_CTOR_(UnavailableError, kUnavailable)
STRATA_DEFINE_ERROR_CTOR_(DataLossError, kDataLoss)
#undef STRATA_DEFINE_ERROR_CTOR_

}  // namespace strata
