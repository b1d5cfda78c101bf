// Running the `strata` binary from a test: its exit code, stdout and stderr, with a timeout that
// kills it so a hang fails the test instead of blocking the suite. Header-only; the binary's path
// is the STRATA_BINARY compile definition of strata_cli_tests, or $STRATA_TEST_BINARY when set.
//
//   CommandResult r = RunStrata({"env", "--json"});
//   EXPECT_EQ(r.exit_code, 0) << r.err;
//
// Thread safety: RunStrata may be called from several threads at once (it shares no state), but
// GoogleTest runs tests on one thread anyway.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

extern char** environ;

namespace strata::testing {

struct CommandResult {
  // The exit status; 128 + signal number when the process was killed by a signal; -1 when it
  // could not be started (then `err` says why).
  int exit_code = -1;
  std::string out, err;
  bool timed_out = false;  // killed with SIGKILL after the timeout
};

// Runs in the child between fork and exec (only async-signal-safe calls: prctl, setrlimit, ...);
// returns false to abort the child with exit code 126.
using ChildSetup = bool (*)(const void* arg);

// Runs `binary` with `args` (argv[0] is the binary), stdin from /dev/null, and `extra_env`
// entries ("NAME=value") added to the environment. With `child_setup`, the child is forked and
// runs child_setup(child_arg) before exec (e.g. to install a seccomp filter); otherwise it is
// started with posix_spawn.
// `watch`, when set, is called with the child's pid and its stdout so far each time more output
// arrives (e.g. to send it a signal once it has reached some point).
using OutputWatch = std::function<void(pid_t pid, const std::string& out)>;

inline CommandResult RunCommand(const std::string& binary, const std::vector<std::string>& args,
                                std::chrono::milliseconds timeout = std::chrono::seconds(60),
                                const std::vector<std::string>& extra_env = {},
                                ChildSetup child_setup = nullptr, const void* child_arg = nullptr,
                                const OutputWatch& watch = {}) {
  CommandResult result;
  int out_pipe[2] = {-1, -1};
  int err_pipe[2] = {-1, -1};
  if (pipe2(out_pipe, O_CLOEXEC) != 0 || pipe2(err_pipe, O_CLOEXEC) != 0) {
    result.err = std::string("pipe2: ") + std::strerror(errno);
    return result;
  }

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&actions, out_pipe[1], 1);
  posix_spawn_file_actions_adddup2(&actions, err_pipe[1], 2);

  std::vector<std::string> argv_storage;
  argv_storage.push_back(binary);
  argv_storage.insert(argv_storage.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& a : argv_storage)
    argv.push_back(a.data());
  argv.push_back(nullptr);

  std::vector<std::string> env_storage;
  for (char** e = environ; *e != nullptr; ++e)
    env_storage.emplace_back(*e);
  env_storage.insert(env_storage.end(), extra_env.begin(), extra_env.end());
  std::vector<char*> envp;
  for (std::string& e : env_storage)
    envp.push_back(e.data());
  envp.push_back(nullptr);

  pid_t pid = -1;
  int rc = 0;
  if (child_setup == nullptr) {
    rc = posix_spawn(&pid, binary.c_str(), &actions, nullptr, argv.data(), envp.data());
  } else {
    pid = fork();
    if (pid == 0) {
      int devnull = open("/dev/null", O_RDONLY);
      if (devnull >= 0) dup2(devnull, 0);
      dup2(out_pipe[1], 1);  // dup2 clears O_CLOEXEC on the copies
      dup2(err_pipe[1], 2);
      if (!child_setup(child_arg)) _exit(126);
      execve(binary.c_str(), argv.data(), envp.data());
      _exit(127);
    }
    if (pid < 0) rc = errno;
  }
  posix_spawn_file_actions_destroy(&actions);
  close(out_pipe[1]);
  close(err_pipe[1]);
  if (rc != 0) {
    close(out_pipe[0]);
    close(err_pipe[0]);
    result.err = "starting " + binary + ": " + std::strerror(rc);
    return result;
  }

  // Read both pipes until they close or the deadline passes.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  pollfd fds[2] = {{out_pipe[0], POLLIN, 0}, {err_pipe[0], POLLIN, 0}};
  std::string* sinks[2] = {&result.out, &result.err};
  int open_fds = 2;
  while (open_fds > 0) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      result.timed_out = true;
      kill(pid, SIGKILL);
      break;
    }
    int n = poll(fds, 2, static_cast<int>(left.count()));
    if (n < 0) {
      if (errno == EINTR) continue;
      kill(pid, SIGKILL);
      break;
    }
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      char buf[4096];
      ssize_t got = read(fds[i].fd, buf, sizeof(buf));
      if (got > 0) {
        sinks[i]->append(buf, static_cast<size_t>(got));
        if (watch && i == 0) watch(pid, result.out);
      } else if (got == 0 || errno != EINTR) {
        close(fds[i].fd);
        fds[i].fd = -1;  // poll ignores negative descriptors
        --open_fds;
      }
    }
  }
  for (pollfd& p : fds) {
    if (p.fd >= 0) close(p.fd);
  }

  // The child may close its output and still run: keep enforcing the deadline while reaping.
  int status = 0;
  while (true) {
    pid_t done = waitpid(pid, &status, WNOHANG);
    if (done == pid) break;
    if (done < 0 && errno != EINTR) {
      result.err += std::string("\nwaitpid: ") + std::strerror(errno);
      return result;
    }
    if (done == 0 && std::chrono::steady_clock::now() >= deadline && !result.timed_out) {
      result.timed_out = true;
      kill(pid, SIGKILL);
    }
    if (done == 0) usleep(5000);
  }
  if (WIFEXITED(status)) {
    result.exit_code = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    result.exit_code = 128 + WTERMSIG(status);
  }
  return result;
}

// Runs the strata binary under test.
inline CommandResult RunStrata(const std::vector<std::string>& args,
                               std::chrono::milliseconds timeout = std::chrono::seconds(60),
                               const std::vector<std::string>& extra_env = {},
                               ChildSetup child_setup = nullptr, const void* child_arg = nullptr) {
  // STRATA_TEST_BINARY overrides the build tree's binary (deploy/gpu-check.sh runs these tests
  // on another machine, with the binary beside them).
  const char* binary = std::getenv("STRATA_TEST_BINARY");
  return RunCommand(binary != nullptr && *binary != '\0' ? binary : STRATA_BINARY, args, timeout,
                    extra_env, child_setup, child_arg);
}

// RunStrata with an OutputWatch.
inline CommandResult RunStrataWatching(const std::vector<std::string>& args,
                                       const OutputWatch& watch,
                                       std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  const char* binary = std::getenv("STRATA_TEST_BINARY");
  return RunCommand(binary != nullptr && *binary != '\0' ? binary : STRATA_BINARY, args, timeout,
                    {}, nullptr, nullptr, watch);
}

// A model directory `path` holding only a Hugging Face Llama config.json (untied, 4 heads of
// which 2 for keys and values, silu): strata trains it from random initialisation.
inline std::string WriteLlamaModelDir(const std::string& path, int vocab, int hidden,
                                      int intermediate, int layers, int max_positions) {
  std::filesystem::create_directories(path);
  std::ofstream out(path + "/config.json");
  out << R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": )" << vocab
      << R"(, "hidden_size": )" << hidden << R"(, "intermediate_size": )" << intermediate
      << R"(, "num_hidden_layers": )" << layers
      << R"(, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": )"
      << max_positions << R"(, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
             "tie_word_embeddings": false, "hidden_act": "silu"})";
  return path;
}

// The non-empty lines of `text`.
inline std::vector<std::string> NonEmptyLines(const std::string& text) {
  std::vector<std::string> lines;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t eol = text.find('\n', pos);
    if (eol == std::string::npos) eol = text.size();
    if (eol > pos) lines.push_back(text.substr(pos, eol - pos));
    pos = eol + 1;
  }
  return lines;
}

}  // namespace strata::testing
