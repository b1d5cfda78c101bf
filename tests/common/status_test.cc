#include "strata/status.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>

namespace strata {
namespace {

TEST(StatusTest, OkByDefault) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kOk);
  EXPECT_EQ(s.ToString(), "OK");
  EXPECT_TRUE(Status(StatusCode::kOk, "ignored").ok());
}

TEST(StatusTest, ErrorCarriesCodeAndMessage) {
  Status s = InvalidArgumentError("stripe unit 1000 is not a multiple of 4096");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "stripe unit 1000 is not a multiple of 4096");
  EXPECT_EQ(s.ToString(), "INVALID_ARGUMENT: stripe unit 1000 is not a multiple of 4096");
}

TEST(StatusTest, CopyAndMoveKeepTheError) {
  Status a = NotFoundError("x");
  Status b = a;
  EXPECT_EQ(a, b);
  Status c = std::move(b);
  EXPECT_EQ(c.code(), StatusCode::kNotFound);
  a = Status::Ok();
  EXPECT_TRUE(a.ok());
}

TEST(StatusTest, WithContextPrefixes) {
  EXPECT_EQ(DataLossError("EIO").WithContext("reading /x").message(), "reading /x: EIO");
  EXPECT_TRUE(Status::Ok().WithContext("ctx").ok());
}

Result<int> Half(int x) {
  if (x % 2 != 0) return InvalidArgumentError("odd");
  return x / 2;
}

Result<int> Quarter(int x) {
  STRATA_ASSIGN_OR_RETURN(int h, Half(x));
  STRATA_ASSIGN_OR_RETURN(h, Half(h));
  return h;
}

Status CheckEven(int x) {
  STRATA_RETURN_IF_ERROR(Half(x));
  return Status::Ok();
}

TEST(ResultTest, ValueAndError) {
  Result<int> ok = Half(8);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(*ok, 4);
  Result<int> bad = Half(3);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.value_or(-1), -1);
}

TEST(ResultTest, MacrosPropagate) {
  EXPECT_EQ(*Quarter(8), 2);
  EXPECT_FALSE(Quarter(6).ok());  // 6 -> 3 is odd
  EXPECT_TRUE(CheckEven(2).ok());
  EXPECT_EQ(CheckEven(3).code(), StatusCode::kInvalidArgument);
}

TEST(ResultTest, MoveOnlyValues) {
  Result<std::unique_ptr<int>> r = std::make_unique<int>(7);
  ASSERT_TRUE(r.ok());
  std::unique_ptr<int> p = std::move(r).value();
  EXPECT_EQ(*p, 7);
  Result<std::unique_ptr<int>> moved = std::move(r);
  EXPECT_TRUE(moved.ok());
}

TEST(ResultTest, OkStatusWithoutValueBecomesInternal) {
  Result<int> r = Status::Ok();
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
}

TEST(ResultTest, CopyAssignment) {
  Result<std::string> a = std::string("hello");
  Result<std::string> b = NotFoundError("no");
  b = a;
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(*b, "hello");
  a = NotFoundError("gone");
  EXPECT_FALSE(a.ok());
  EXPECT_EQ(*b, "hello");
}

}  // namespace
}  // namespace strata
