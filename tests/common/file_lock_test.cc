// FileLock: one owner per path, the refusal names the holder, release removes the lock file, and
// a lock whose holder died (killed, no cleanup) is taken over.
#include "common/file_lock.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "test_support.h"

namespace strata {
namespace {

using ::testing::HasSubstr;

TEST(FileLockTest, SecondOwnerIsRefusedNamingTheHolder) {
  testing::TempDir dir;
  const std::string path = dir.file("strata.rank0.optim.swap");
  auto first = FileLock::Acquire(path, "NVMe offload file");
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_TRUE(first->held());
  EXPECT_TRUE(std::filesystem::exists(path + ".lock"));
  // Another open file description (as another process would have): refused.
  auto second = FileLock::Acquire(path, "NVMe offload file");
  ASSERT_EQ(second.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(second.status().message(),
              HasSubstr("the NVMe offload file " + path + " is in use by another process"));
  EXPECT_THAT(second.status().message(), HasSubstr("pid " + std::to_string(::getpid())));
  EXPECT_THAT(second.status().message(), HasSubstr("strata_common_tests"));  // its command
  first->Release();
  EXPECT_FALSE(std::filesystem::exists(path + ".lock"));
  auto third = FileLock::Acquire(path, "NVMe offload file");
  EXPECT_TRUE(third.ok()) << third.status().ToString();
}

TEST(FileLockTest, ALockLeftByAKilledProcessIsTakenOver) {
  testing::TempDir dir;
  const std::string path = dir.file("ck");
  const std::string lock_file = dir.file("ck.custom-lock");
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto lock = FileLock::Acquire(path, "checkpoint directory", lock_file);
    const char c = lock.ok() ? 'y' : 'n';
    (void)!::write(ready[1], &c, 1);
    ::pause();  // killed below, with the lock held and its file in place
    ::_exit(0);
  }
  char c = 0;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  ASSERT_EQ(c, 'y');
  auto refused = FileLock::Acquire(path, "checkpoint directory", lock_file);
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(), HasSubstr("pid " + std::to_string(child)));
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  ::close(ready[0]);
  ::close(ready[1]);
  ASSERT_TRUE(std::filesystem::exists(lock_file));  // no cleanup ran
  auto taken = FileLock::Acquire(path, "checkpoint directory", lock_file);
  ASSERT_TRUE(taken.ok()) << taken.status().ToString();
  std::ifstream in(lock_file);
  std::string holder((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_THAT(holder, HasSubstr("pid " + std::to_string(::getpid())));
}

TEST(FileLockTest, MovedLocksStayHeld) {
  testing::TempDir dir;
  const std::string path = dir.file("x");
  FileLock held;
  {
    auto a = FileLock::Acquire(path, "file");
    ASSERT_TRUE(a.ok());
    held = std::move(*a);
  }
  EXPECT_TRUE(held.held());
  EXPECT_FALSE(FileLock::Acquire(path, "file").ok());
  auto missing = FileLock::Acquire(dir.file("no/such/dir/x"), "file");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr(dir.file("no/such/dir/x.lock")));
}

}  // namespace
}  // namespace strata
