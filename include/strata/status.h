// Status and Result<T>: how every Strata boundary reports success or failure.
//
// A Status is either OK or an error code plus a human-readable message that names what went wrong
// (a path, an offset, a config key, ...). Library code never throws across its API and never
// calls exit(); it returns a Status, and the CLI turns it into one line and a non-zero exit code.
//
// The codes follow Abseil's canonical set so that their meaning is familiar:
//   InvalidArgument    the caller passed something malformed (bad alignment, bad config value)
//   NotFound           a file, key or object does not exist
//   PermissionDenied   the OS refused (EACCES, EPERM, a read-only filesystem)
//   ResourceExhausted  out of space, memory, budget or a queue limit
//   FailedPrecondition the system is not in a state where the call can run
//   OutOfRange         a read past the end of a file, an index past a bound
//   Unimplemented      the feature or value is recognised but Strata does not do it
//   Unavailable        transient: retrying may succeed (EAGAIN that would not clear, a busy device)
//   DataLoss           data is corrupt or lost (EIO, a checksum mismatch)
//   Internal           a broken invariant in Strata itself
//
// Conversions from foreign error spaces happen in exactly one place each: errno in
// src/common/errno.h (ErrnoToStatus); CUDA, NCCL and MPI codes in their backends.
//
// Thread safety: Status and Result are values; distinct objects may be used from distinct threads.
#pragma once

#include <cassert>
#include <memory>
#include <new>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace strata {

enum class StatusCode : int {
  kOk = 0,
  kCancelled = 1,
  kUnknown = 2,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kNotFound = 5,
  kAlreadyExists = 6,
  kPermissionDenied = 7,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kAborted = 10,
  kOutOfRange = 11,
  kUnimplemented = 12,
  kInternal = 13,
  kUnavailable = 14,
  kDataLoss = 15,
  kUnauthenticated = 16,
};

// "OK", "INVALID_ARGUMENT", ... as in Abseil.
std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  // An OK status. Cheap: holds no allocation.
  Status() noexcept = default;
  // An error (or OK, if code is kOk, in which case the message is dropped).
  Status(StatusCode code, std::string_view message);

  Status(const Status& other);
  Status& operator=(const Status& other);
  Status(Status&&) noexcept = default;
  Status& operator=(Status&&) noexcept = default;
  ~Status() = default;

  static Status Ok() { return Status(); }

  bool ok() const { return rep_ == nullptr; }
  StatusCode code() const { return rep_ ? rep_->code : StatusCode::kOk; }
  // The message without the code name; empty for OK.
  std::string_view message() const { return rep_ ? std::string_view(rep_->message) : ""; }
  // "OK" or "<CODE_NAME>: <message>".
  std::string ToString() const;

  // Returns a copy whose message is "<context>: <old message>"; OK stays OK. Use it to add what the
  // caller knows (the file, the key path) as an error travels up.
  Status WithContext(std::string_view context) const;

  // Marks the status as deliberately ignored (for places where an error truly does not matter).
  void IgnoreError() const {}

  friend bool operator==(const Status& a, const Status& b) {
    return a.code() == b.code() && a.message() == b.message();
  }

 private:
  struct Rep {
    StatusCode code;
    std::string message;
  };
  std::unique_ptr<Rep> rep_;
};

// Constructors for each code, e.g. InvalidArgumentError("stripe unit 1000 is not a multiple of
// 4096").
Status CancelledError(std::string_view message);
Status UnknownError(std::string_view message);
Status InvalidArgumentError(std::string_view message);
Status DeadlineExceededError(std::string_view message);
Status NotFoundError(std::string_view message);
Status AlreadyExistsError(std::string_view message);
Status PermissionDeniedError(std::string_view message);
Status ResourceExhaustedError(std::string_view message);
Status FailedPreconditionError(std::string_view message);
Status AbortedError(std::string_view message);
Status OutOfRangeError(std::string_view message);
Status UnimplementedError(std::string_view message);
Status InternalError(std::string_view message);
Status UnavailableError(std::string_view message);
Status DataLossError(std::string_view message);

// Result<T> holds either a T or a non-OK Status. Accessing the value of an error Result is a
// programming error (asserted in debug builds).
template <typename T>
class [[nodiscard]] Result {
  static_assert(!std::is_same_v<std::remove_cv_t<T>, Status>, "Result<Status> is not meaningful");
  static_assert(!std::is_reference_v<T>, "Result<T&> is not supported; use Result<T*>");

 public:
  // From an error. Passing an OK status is a bug; it is turned into an Internal error.
  Result(Status status) : status_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    if (status_.ok())
      status_ = InternalError("Result constructed from an OK status without a value");
  }
  Result(const T& value) : has_value_(true) {  // NOLINT(google-explicit-constructor)
    new (&storage_) T(value);
  }
  Result(T&& value) : has_value_(true) {  // NOLINT(google-explicit-constructor)
    new (&storage_) T(std::move(value));
  }
  template <typename U>
  requires(std::is_constructible_v<T, U&&> && !std::is_same_v<std::decay_t<U>, T> &&
           !std::is_same_v<std::decay_t<U>, Status> && !std::is_same_v<std::decay_t<U>, Result<T>>)
      Result(U&& value)
      : has_value_(true) {  // NOLINT(google-explicit-constructor)
    new (&storage_) T(std::forward<U>(value));
  }

  Result(const Result& other) : status_(other.status_), has_value_(other.has_value_) {
    if (has_value_) new (&storage_) T(*other.ptr());
  }
  Result(Result&& other) noexcept(std::is_nothrow_move_constructible_v<T>)
      : status_(std::move(other.status_)), has_value_(other.has_value_) {
    if (has_value_) new (&storage_) T(std::move(*other.ptr()));
  }
  Result& operator=(const Result& other) {
    if (this != &other) {
      Reset();
      status_ = other.status_;
      if (other.has_value_) {
        new (&storage_) T(*other.ptr());
        has_value_ = true;
      }
    }
    return *this;
  }
  Result& operator=(Result&& other) noexcept(std::is_nothrow_move_constructible_v<T>) {
    if (this != &other) {
      Reset();
      status_ = std::move(other.status_);
      if (other.has_value_) {
        new (&storage_) T(std::move(*other.ptr()));
        has_value_ = true;
      }
    }
    return *this;
  }
  ~Result() { Reset(); }

  bool ok() const { return has_value_; }
  // OK when a value is held.
  const Status& status() const { return status_; }

  T& value() & {
    assert(has_value_);
    return *ptr();
  }
  const T& value() const& {
    assert(has_value_);
    return *ptr();
  }
  T&& value() && {
    assert(has_value_);
    return std::move(*ptr());
  }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

  // The value, or `fallback` when this holds an error.
  template <typename U>
  T value_or(U&& fallback) const& {
    return has_value_ ? *ptr() : static_cast<T>(std::forward<U>(fallback));
  }

 private:
  T* ptr() { return std::launder(reinterpret_cast<T*>(&storage_)); }
  const T* ptr() const { return std::launder(reinterpret_cast<const T*>(&storage_)); }
  void Reset() {
    if (has_value_) {
      ptr()->~T();
      has_value_ = false;
    }
  }

  Status status_;
  bool has_value_ = false;
  alignas(T) unsigned char storage_[sizeof(T)];
};

namespace internal {
inline const Status& AsStatus(const Status& s) {
  return s;
}
template <typename T>
const Status& AsStatus(const Result<T>& r) {
  return r.status();
}
}  // namespace internal

}  // namespace strata

#define STRATA_STATUS_CONCAT_INNER_(a, b) a##b
#define STRATA_STATUS_CONCAT_(a, b) STRATA_STATUS_CONCAT_INNER_(a, b)

// Evaluates `expr` (a Status or a Result<T>) and returns its Status from the enclosing function if
// it is an error.
#define STRATA_RETURN_IF_ERROR(expr)                                                 \
  do {                                                                               \
    const auto& strata_status_or_result_ = (expr);                                   \
    if (!::strata::internal::AsStatus(strata_status_or_result_).ok()) [[unlikely]] { \
      return ::strata::internal::AsStatus(strata_status_or_result_);                 \
    }                                                                                \
  } while (false)

// `STRATA_ASSIGN_OR_RETURN(auto x, MakeX());` or `STRATA_ASSIGN_OR_RETURN(existing, MakeX());`
// Evaluates a Result<T>; on error returns its Status, otherwise moves the value into `lhs`.
#define STRATA_ASSIGN_OR_RETURN(lhs, expr) \
  STRATA_ASSIGN_OR_RETURN_IMPL_(STRATA_STATUS_CONCAT_(strata_result_, __LINE__), lhs, expr)
#define STRATA_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) [[unlikely]]                         \
    return tmp.status();                              \
  lhs = std::move(tmp).value()
