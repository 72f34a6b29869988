#include <catch2/catch.hpp>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/runtime/spawner.hpp"
#include "tests/unit/fixtures.hpp"
#include "twinkle/errors.hpp"

using namespace twinkle::core;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

using twinkle::test::TempDir;

// Collects the exit handler's reports; wait_for blocks until `n` arrived or the deadline passed.
struct Exits {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<ProcessExit> list;

  Spawner::ExitHandler handler() {
    return [this](const ProcessExit& e) {
      std::lock_guard lock(mu);
      list.push_back(e);
      cv.notify_all();
    };
  }
  bool wait_for(std::size_t n, std::chrono::milliseconds timeout = 5s) {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, timeout, [&] { return list.size() >= n; });
  }
  ProcessExit at(std::size_t i) {
    std::lock_guard lock(mu);
    return list.at(i);
  }
};

// Output off the terminal; into `log_dir` when given.
SpawnerOptions quiet(std::optional<fs::path> log_dir = std::nullopt, std::size_t stderr_tail = 20) {
  SpawnerOptions o;
  o.log_dir = std::move(log_dir);
  o.quiet = true;
  o.stderr_tail = stderr_tail;
  return o;
}

ProcessSpec sh(const std::string& name, const std::string& script) {
  ProcessSpec s;
  s.name = name;
  s.argv = {"/bin/sh", "-c", script};
  s.env = {"PATH=/usr/bin:/bin"};
  return s;
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

int open_fds() {
  int n = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

// Reads what arrives on `fd` until end of file, up to a deadline; nullopt when the deadline passed.
std::optional<std::string> read_to_eof(int fd, std::chrono::milliseconds timeout = 5s) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::string out;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return std::nullopt;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    char buf[256];
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return out;
    out.append(buf, static_cast<std::size_t>(n));
  }
}

// Points this process's stdout and stderr at a file for the scope (the spawner relays to fds 1
// and 2), and back at the end, even when the test fails.
struct CaptureOutput {
  fs::path file;
  int saved_out = ::dup(1);
  int saved_err = ::dup(2);
  explicit CaptureOutput(fs::path f) : file(std::move(f)) {
    std::fflush(stdout);
    std::fflush(stderr);
    const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    REQUIRE(fd >= 0);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    ::close(fd);
  }
  ~CaptureOutput() {
    std::fflush(stdout);
    std::fflush(stderr);
    ::dup2(saved_out, 1);
    ::dup2(saved_err, 2);
    ::close(saved_out);
    ::close(saved_err);
  }
};

// No child of this process is left, running or unreaped.
bool no_children() {
  int status = 0;
  return ::waitpid(-1, &status, WNOHANG) < 0 && errno == ECHILD;
}

}  // namespace

TEST_CASE("output lines are relayed with the process name; the exit handler gets the code",
          "[spawner]") {
  TempDir tmp;
  Exits exits;
  {
    CaptureOutput capture(tmp.path / "terminal");
    Spawner spawner({}, exits.handler());
    spawner.spawn(sh("model:1", "echo out; echo err >&2; printf 'no newline'; exit 3"));
    REQUIRE(exits.wait_for(1));
  }
  const std::string terminal = read_file(tmp.path / "terminal");
  CHECK_THAT(terminal, Catch::Contains("[model:1] out\n"));
  CHECK_THAT(terminal, Catch::Contains("[model:1] err\n"));
  CHECK_THAT(terminal, Catch::Contains("[model:1] no newline\n"));
  const ProcessExit e = exits.at(0);
  CHECK(e.name == "model:1");
  CHECK(e.exit_code == 3);
  CHECK(e.signal == 0);
  CHECK(e.describe() == "exited with code 3");
  CHECK(e.last_stderr == std::vector<std::string>{"err"});
}

TEST_CASE("quiet with a log folder: both streams go to NAME.log, none to the terminal",
          "[spawner]") {
  TempDir tmp;
  Exits exits;
  {
    CaptureOutput capture(tmp.path / "terminal");
    Spawner spawner(quiet(tmp.path / "logs", 2), exits.handler());
    spawner.spawn(sh("model:0", "echo one; echo a >&2; echo b >&2; echo c >&2"));
    REQUIRE(exits.wait_for(1));
  }
  CHECK(read_file(tmp.path / "terminal").empty());
  const std::string log = read_file(tmp.path / "logs" / "model-0.log");
  CHECK_THAT(log, Catch::Contains("one\n"));
  CHECK_THAT(log, Catch::Contains("a\nb\nc\n"));
  CHECK(exits.at(0).exit_code == 0);
  CHECK(exits.at(0).last_stderr == std::vector<std::string>{"b", "c"});  // the last 2
}

TEST_CASE("a log write that fails warns once, naming the file and the error; nothing stops",
          "[spawner]") {
  TempDir tmp;
  const fs::path logs = tmp.path / "logs";
  fs::create_directory(logs);
  // /dev/full fails every write with ENOSPC, as a file system that filled up during the run does.
  fs::create_symlink("/dev/full", logs / "model-0.log");
  Exits exits;
  {
    CaptureOutput capture(tmp.path / "terminal");
    Spawner spawner(quiet(logs), exits.handler());
    spawner.spawn(sh("model:0", "echo one; echo two >&2; echo three"));
    REQUIRE(exits.wait_for(1));
    spawner.spawn(sh("model:1", "echo fine"));
    REQUIRE(exits.wait_for(2));
  }
  // Quiet: the warning is all the terminal got, once for three lines lost.
  CHECK(read_file(tmp.path / "terminal") ==
        "twinkle: warning: --log-dir " + logs.string() +
            ": cannot write model-0.log (No space left on device); the run goes on, and the lines "
            "that cannot be written are lost (this warning is given once)\n");
  CHECK(exits.at(0).exit_code == 0);
  CHECK(exits.at(0).last_stderr == std::vector<std::string>{"two"});
  CHECK(exits.at(1).exit_code == 0);
  CHECK(read_file(logs / "model-1.log") == "fine\n");
}

TEST_CASE("a process killed by a signal", "[spawner]") {
  Exits exits;
  Spawner spawner(quiet(), exits.handler());
  spawner.spawn(sh("w", "kill -9 $$"));
  REQUIRE(exits.wait_for(1));
  CHECK(exits.at(0).signal == 9);
  CHECK(exits.at(0).describe() == "was killed by signal 9 (Killed)");
}

TEST_CASE("stop() kills a process that ignores SIGTERM and names it", "[spawner]") {
  Exits exits;
  Spawner spawner(quiet(), exits.handler());
  FdPair ready = FdPair::pipe("the ready signal");
  ProcessSpec spec = sh("stubborn", "trap '' TERM; echo ready >&5; exec 5>&-; exec sleep 30");
  spec.inherit.emplace_back(std::move(ready.second), 5);
  spawner.spawn(std::move(spec));
  spawner.spawn(sh("polite", "exec sleep 30"));
  // Only once the trap is set can SIGTERM be ignored.
  REQUIRE(read_to_eof(ready.first.get()) == "ready\n");

  const auto signalled = spawner.stop(0ms, 100ms);
  CHECK(signalled == std::vector<std::string>{"stubborn", "polite"});
  CHECK(spawner.running() == 0);
  REQUIRE(exits.wait_for(2));
  for (std::size_t i = 0; i < 2; ++i) {
    const ProcessExit e = exits.at(i);
    INFO(e.name);
    CHECK(e.signal == (e.name == "stubborn" ? SIGKILL : SIGTERM));
  }
  CHECK(spawner.stop(0ms).empty());  // idempotent
  CHECK(no_children());
}

TEST_CASE("a failed spawn names the program and leaks neither descriptors nor children",
          "[spawner]") {
  Exits exits;
  Spawner spawner(quiet(), exits.handler());
  const int before = open_fds();
  {
    ProcessSpec spec;
    spec.name = "ghost:0";
    spec.argv = {"/nonexistent/twinkle-worker"};
    FdPair pipe = FdPair::pipe("an inherited descriptor");
    spec.inherit.emplace_back(std::move(pipe.second), 5);
    CHECK_THROWS_AS(spawner.spawn(std::move(spec)), twinkle::Error);
  }
  ProcessSpec again;
  again.name = "ghost:0";
  again.argv = {"/nonexistent/twinkle-worker"};
  CHECK_THROWS_WITH(
      spawner.spawn(std::move(again)),
      "cannot start ghost:0 (/nonexistent/twinkle-worker): No such file or directory");
  CHECK(open_fds() == before);
  CHECK(spawner.running() == 0);
  CHECK(no_children());
}

TEST_CASE("a log folder that cannot be written is a ConfigError", "[spawner]") {
  TempDir tmp;
  std::ofstream(tmp.path / "file") << "not a folder\n";
  const fs::path bad = tmp.path / "file" / "logs";
  CHECK_THROWS_AS(Spawner(quiet(bad), {}), twinkle::ConfigError);
  CHECK_THROWS_WITH(Spawner(quiet(bad), {}),
                    Catch::StartsWith("--log-dir " + bad.string() + ": cannot write there (") &&
                        Catch::EndsWith("); choose a writable folder"));
}

TEST_CASE("an inherited descriptor arrives under its number, and only in the child", "[spawner]") {
  Exits exits;
  Spawner spawner(quiet(), exits.handler());
  FdPair pipe = FdPair::pipe("the test pipe");
  ProcessSpec spec = sh("w", "echo hi >&5");
  spec.inherit.emplace_back(std::move(pipe.second), 5);
  spawner.spawn(std::move(spec));
  // End of file once the child exits: this process closed its copy of the write end.
  CHECK(read_to_eof(pipe.first.get()) == "hi\n");
  REQUIRE(exits.wait_for(1));
  CHECK(exits.at(0).exit_code == 0);
}

TEST_CASE("a child gets only the descriptors of its spec, not the spawner's own", "[spawner]") {
  // Descriptors this test was started with that any child inherits: not the spawner's to close.
  int ambient = 0;
  for (const auto& e : fs::directory_iterator("/proc/self/fd")) {
    const int fd = std::stoi(e.path().filename().string());
    const int flags = ::fcntl(fd, F_GETFD);
    ambient += fd > 2 && flags >= 0 && !(flags & FD_CLOEXEC);
  }
  TempDir tmp;
  Exits exits;
  Spawner spawner(quiet(tmp.path), exits.handler());
  spawner.spawn(sh("first", "exit 0"));  // its log file stays open here
  REQUIRE(exits.wait_for(1));
  // `ls` lists its own descriptors: 0, 1, 2, the folder it reads, and the ambient ones.
  spawner.spawn(sh("w", "ls -l /proc/self/fd"));
  REQUIRE(exits.wait_for(2));
  const std::string listing = read_file(tmp.path / "w.log");
  INFO(listing);
  CHECK(std::count(listing.begin(), listing.end(), '>') == 4 + ambient);
  CHECK_THAT(listing, !Catch::Contains(".log"));
}

TEST_CASE("no child is left once the spawner is destroyed", "[spawner]") {
  std::vector<pid_t> pids;
  {
    Spawner spawner(quiet(), {});
    spawner.spawn(sh("a", "exec sleep 30"));
    spawner.spawn(sh("b", "sleep 30; echo never"));
    pids = spawner.pids();
    CHECK(spawner.running() == 2);
  }
  REQUIRE(pids.size() == 2);
  for (pid_t pid : pids) {
    INFO("pid " << pid);
    CHECK(::kill(pid, 0) == -1);
    CHECK(errno == ESRCH);
  }
  CHECK(no_children());
}

namespace {

// The fork server of the test program tests/unit/fork_server_child.cpp, and its processes.
fs::path fork_child() {
  const char* p = std::getenv("TWINKLE_FORK_SERVER_CHILD");
  REQUIRE(p);
  return p;
}

SpawnerOptions forking(std::optional<fs::path> log_dir = std::nullopt) {
  SpawnerOptions o = quiet(std::move(log_dir));
  o.fork_server = fork_child();
  return o;
}

ProcessSpec child(const std::string& name, std::vector<std::string> args,
                  std::vector<std::string> env = {"PATH=/usr/bin:/bin"}) {
  ProcessSpec s;
  s.name = name;
  s.argv = {fork_child().string()};
  s.argv.insert(s.argv.end(), args.begin(), args.end());
  s.env = std::move(env);
  return s;
}

// /proc/PID/cmdline with its NULs as spaces, trailing ones dropped.
std::string cmdline(pid_t pid) {
  std::string s = read_file(fs::path("/proc") / std::to_string(pid) / "cmdline");
  std::replace(s.begin(), s.end(), '\0', ' ');
  while (!s.empty() && s.back() == ' ') s.pop_back();
  return s;
}

// The fork server this process started (a child whose command line has --fork-server); 0: none.
pid_t fork_server_pid() {
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream stat(e.path() / "stat");
    std::string line;
    std::getline(stat, line);
    const auto close = line.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(line.substr(close + 2));
    char state;
    pid_t ppid = 0;
    rest >> state >> ppid;
    const pid_t pid = std::stoi(name);
    if (ppid == ::getpid() && cmdline(pid).find("--fork-server") != std::string::npos) return pid;
  }
  return 0;
}

ProcessExit exit_of(Exits& exits, const std::string& name) {
  std::lock_guard lock(exits.mu);
  for (const auto& e : exits.list) {
    if (e.name == name) return e;
  }
  FAIL("no exit of " << name);
  return {};
}

}  // namespace

TEST_CASE("processes of the fork server's binary are forked, and look and end as spawned ones",
          "[spawner][fork]") {
  TempDir tmp;
  Exits exits;
  Spawner spawner(forking(tmp.path), exits.handler());
  spawner.spawn(child("a", {"say", "hello"}));
  spawner.spawn(child("b", {"env", "RANK"}, {"PATH=/usr/bin:/bin", "RANK=3"}));
  spawner.spawn(child("c", {"exit", "7"}));
  const pid_t w = spawner.spawn(child("w", {"wait"}));
  // The child writes its command line first thing (until then it is the server's).
  const std::string expected = fork_child().string() + " wait";
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (cmdline(w) != expected && std::chrono::steady_clock::now() < deadline) {
    pollfd none{-1, 0, 0};
    ::poll(&none, 0, 1);
  }
  CHECK(cmdline(w) == expected);
  CHECK(fork_server_pid() != 0);
  REQUIRE(exits.wait_for(3));
  CHECK(spawner.signal("w", SIGTERM) == 1);
  REQUIRE(exits.wait_for(4));
  CHECK(spawner.forked() == 4);
  CHECK(exit_of(exits, "a").exit_code == 0);
  CHECK(exit_of(exits, "b").exit_code == 0);
  CHECK(exit_of(exits, "c").exit_code == 7);
  CHECK(exit_of(exits, "w").signal == SIGTERM);
  CHECK(read_file(tmp.path / "a.log") == "hello\n");
  CHECK(read_file(tmp.path / "b.log") == "3\n");
}

TEST_CASE("a forked process has exactly its spec's descriptors, each under its number",
          "[spawner][fork]") {
  TempDir tmp;
  Exits exits;
  Spawner spawner(forking(tmp.path), exits.handler());
  FdPair pipe = FdPair::pipe("the test pipe");
  ProcessSpec spec = child("t", {"tell", "5", "hi"});
  spec.inherit.emplace_back(std::move(pipe.second), 5);
  spawner.spawn(std::move(spec));
  CHECK(read_to_eof(pipe.first.get()) == "hi");
  spawner.spawn(child("n", {"fds"}));  // the log files and the server's sockets stay here
  REQUIRE(exits.wait_for(2));
  CHECK(spawner.forked() == 2);
  const std::string listing = read_file(tmp.path / "n.log");
  INFO(listing);
  CHECK(listing == "3\n");  // 0, 1 and 2
}

TEST_CASE("a process whose loader environment is not the server's is spawned, not forked",
          "[spawner][fork]") {
  TempDir tmp;
  Exits exits;
  Spawner spawner(forking(tmp.path), exits.handler());
  spawner.spawn(child("forked", {"exit", "0"}));
  spawner.spawn(child("spawned", {"env", "LD_BIND_NOW"}, {"PATH=/usr/bin:/bin", "LD_BIND_NOW=1"}));
  spawner.spawn(child("other", {"exit", "0"}, {"PATH=/bin", "MALLOC_ARENA_MAX=1"}));
  REQUIRE(exits.wait_for(3));
  CHECK(spawner.forked() == 1);
  CHECK(exit_of(exits, "spawned").exit_code == 0);
  CHECK(read_file(tmp.path / "spawned.log") == "1\n");
}

TEST_CASE("forked processes that exit at once are each reported once, with their code",
          "[spawner][fork]") {
  // The server may report an exit before spawn() has recorded the process.
  Exits exits;
  Spawner spawner(forking(), exits.handler());
  constexpr int kCount = 40;
  for (int i = 0; i < kCount; ++i) spawner.spawn(child(fmt::format("p{}", i), {"exit", "3"}));
  REQUIRE(exits.wait_for(kCount, 20s));
  CHECK(spawner.forked() == kCount);
  CHECK(spawner.running() == 0);
  spawner.stop(0ms);  // the monitor is done: a report twice would be in the list by now
  std::lock_guard lock(exits.mu);
  CHECK(exits.list.size() == kCount);
  std::set<std::string> names;
  for (const auto& e : exits.list) {
    CHECK(e.exit_code == 3);
    names.insert(e.name);
  }
  CHECK(names.size() == kCount);
}

TEST_CASE("stop() and the destructor leave no forked process, no server and no zombie",
          "[spawner][fork]") {
  std::vector<pid_t> pids;
  pid_t server = 0;
  {
    Spawner spawner(forking(), {});
    spawner.spawn(child("a", {"wait"}));
    spawner.spawn(child("b", {"wait"}));
    pids = spawner.pids();
    server = fork_server_pid();
    CHECK(spawner.running() == 2);
    const auto signalled = spawner.stop(0ms, 200ms);
    CHECK(signalled == std::vector<std::string>{"a", "b"});
    CHECK(spawner.running() == 0);
  }
  REQUIRE(server != 0);
  pids.push_back(server);
  for (pid_t pid : pids) {
    INFO("pid " << pid);
    CHECK(::kill(pid, 0) == -1);
    CHECK(errno == ESRCH);
  }
  CHECK(no_children());
}

TEST_CASE("a fork server that dies takes its processes along; later ones are spawned, once warned",
          "[spawner][fork]") {
  TempDir tmp;
  Exits exits;
  Spawner spawner(forking(tmp.path), exits.handler());
  spawner.spawn(child("w", {"wait"}));
  const pid_t server = fork_server_pid();
  REQUIRE(server != 0);
  ::kill(server, SIGKILL);
  REQUIRE(exits.wait_for(1));
  CHECK(exit_of(exits, "w").signal == SIGKILL);
  {
    CaptureOutput capture(tmp.path / "stderr");
    spawner.spawn(child("after", {"say", "spawned"}));
    spawner.spawn(child("again", {"say", "spawned"}));
    REQUIRE(exits.wait_for(3));
  }
  CHECK(spawner.forked() == 1);
  CHECK(exit_of(exits, "after").exit_code == 0);
  CHECK(read_file(tmp.path / "after.log") == "spawned\n");
  const std::string warned = read_file(tmp.path / "stderr");
  INFO(warned);
  CHECK_THAT(warned, Catch::Contains("spawned, not forked"));
  CHECK(warned.find("warning") == warned.rfind("warning"));  // once
}
