#include "common/signals.h"

#include <signal.h>
#include <string.h>
#include <unistd.h>

#include <atomic>
#include <mutex>

namespace strata::signals {

namespace {

std::atomic<int> g_signal{0};
std::atomic<const char*> g_what{"stopping at the next safe point"};
static_assert(std::atomic<int>::is_always_lock_free);

void Write(const char* text) {
  (void)!::write(STDERR_FILENO, text, ::strlen(text));
}

void OnStop(int sig) {
  int expected = 0;
  if (!g_signal.compare_exchange_strong(expected, sig)) {
    Write("\nstrata: second stop signal: exiting now\n");
    ::_exit(128 + sig);
  }
  Write(sig == SIGINT ? "\nstrata: SIGINT received: " : "\nstrata: SIGTERM received: ");
  Write(g_what.load());
  Write(" (send it again to stop at once)\n");
}

}  // namespace

void InstallStopHandlers(const char* what_happens) {
  g_what.store(what_happens);
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa {};
    sa.sa_handler = OnStop;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;  // system calls in progress go on; the program polls StopSignal
    ::sigaction(SIGINT, &sa, nullptr);
    ::sigaction(SIGTERM, &sa, nullptr);
  });
}

int StopSignal() { return g_signal.load(); }

void ResetStopSignal() { g_signal.store(0); }

}  // namespace strata::signals
