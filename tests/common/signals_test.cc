// Stop signals: the first one is a request the program polls, the second ends the process.
#include "common/signals.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

namespace strata {
namespace {

TEST(SignalsTest, FirstSignalIsARequestSecondExitsAtOnce) {
  // In a child, so that the handlers stay out of the test runner.
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    signals::InstallStopHandlers("test");
    if (signals::StopSignal() != 0) ::_exit(10);
    ::raise(SIGTERM);
    if (signals::StopSignal() != SIGTERM) ::_exit(11);  // still running, the request recorded
    ::raise(SIGINT);  // the second: exits with 128 + SIGINT
    ::_exit(12);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGINT);
}

}  // namespace
}  // namespace strata
