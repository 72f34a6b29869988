#include "core/launcher.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <utility>

#include <fmt/format.h>

#include "core/error.hpp"

namespace twinkle::core {

std::string WorkerExit::describe() const {
  if (signal) return fmt::format("was killed by signal {} ({})", signal, strsignal(signal));
  return fmt::format("exited with code {}", exit_code);
}

struct LocalLauncher::Proc {
  std::string name;
  pid_t pid = 0;
  int fds[2] = {-1, -1};  // stdout, stderr read ends
  int channel = -1;       // the driver's end of the shared-memory channel
  std::string partial[2];
  std::deque<std::string> tail;
  std::ofstream log;
  bool running = false;
  std::optional<WorkerExit> exit;
};

namespace {

void write_all(int fd, const std::string& s) {
  const char* p = s.data();
  std::size_t left = s.size();
  while (left > 0) {
    ssize_t n = ::write(fd, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    p += n;
    left -= static_cast<std::size_t>(n);
  }
}

}  // namespace

LocalLauncher::LocalLauncher(LaunchOptions options) : options_(std::move(options)) {
  if (options_.log_dir) {
    std::error_code ec;
    std::filesystem::create_directories(*options_.log_dir, ec);
    if (ec) {
      throw ConfigError(fmt::format("--log-dir {}: cannot create it: {}",
                                    options_.log_dir->string(), ec.message()));
    }
  }
}

LocalLauncher::~LocalLauncher() { stop(std::chrono::milliseconds(0)); }

void LocalLauncher::start(const std::vector<WorkerSpec>& workers) {
  const pid_t parent = getpid();
  for (const auto& spec : workers) {
    auto proc = std::make_unique<Proc>();
    proc->name = spec.name;
    if (options_.log_dir) {
      std::string file = spec.name;
      std::replace(file.begin(), file.end(), ':', '-');
      proc->log.open(*options_.log_dir / (file + ".log"), std::ios::app);
    }
    int out[2], err[2], chan[2];
    if (pipe2(out, O_CLOEXEC) != 0 || pipe2(err, O_CLOEXEC) != 0 ||
        socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, chan) != 0) {
      throw Error(
          fmt::format("cannot create pipes for worker {}: {}", spec.name, std::strerror(errno)));
    }
    std::vector<char*> argv, envp;
    for (const auto& a : spec.argv) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    static const std::string kChannelEnv = "TWINKLE_SHM_FD=3";
    for (const auto& e : spec.env) envp.push_back(const_cast<char*>(e.c_str()));
    envp.push_back(const_cast<char*>(kChannelEnv.c_str()));
    envp.push_back(nullptr);
    const pid_t group = pgid_;

    pid_t pid = fork();
    if (pid < 0)
      throw Error(fmt::format("cannot start worker {}: fork: {}", spec.name, std::strerror(errno)));
    if (pid == 0) {
      // Child: only async-signal-safe calls until exec.
      setpgid(0, group);
      prctl(PR_SET_PDEATHSIG, SIGHUP);    // the worker's handler cleans up the run directory
      if (getppid() != parent) _exit(1);  // the driver is already gone
      sigset_t none;
      sigemptyset(&none);
      sigprocmask(SIG_SETMASK, &none, nullptr);
      signal(SIGPIPE, SIG_DFL);
      int devnull = open("/dev/null", O_RDONLY | O_CLOEXEC);
      if (devnull >= 0) dup2(devnull, 0);
      dup2(out[1], 1);
      dup2(err[1], 2);
      dup2(chan[1], 3);  // dup2 clears close-on-exec: the worker keeps it
      execve(argv[0], argv.data(), envp.data());
      const char msg[] = "twinkle: cannot exec the worker binary\n";
      (void)!::write(2, msg, sizeof msg - 1);
      _exit(127);
    }
    setpgid(pid, group ? group : pid);  // also here: whichever runs first wins the race
    if (!pgid_) pgid_ = pid;
    close(out[1]);
    close(err[1]);
    close(chan[1]);
    proc->channel = chan[0];
    fcntl(out[0], F_SETFL, O_NONBLOCK);
    fcntl(err[0], F_SETFL, O_NONBLOCK);
    proc->fds[0] = out[0];
    proc->fds[1] = err[0];
    proc->pid = pid;
    proc->running = true;
    std::lock_guard lock(mu_);
    procs_.push_back(std::move(proc));
  }
  if (!monitor_.joinable()) monitor_ = std::thread([this] { monitor(); });
}

void LocalLauncher::write_line(Proc& p, bool is_stderr, const std::string& line) {
  if (is_stderr) {
    p.tail.push_back(line);
    if (p.tail.size() > options_.stderr_tail) p.tail.pop_front();
  }
  if (p.log.is_open()) p.log << line << '\n' << std::flush;
  if (options_.quiet) return;
  std::lock_guard lock(out_mu_);
  write_all(is_stderr ? 2 : 1, fmt::format("[{}] {}\n", p.name, line));
}

bool LocalLauncher::pump_output(int timeout_ms) {
  std::vector<pollfd> fds;
  std::vector<std::pair<Proc*, int>> owners;
  {
    std::lock_guard lock(mu_);
    for (auto& p : procs_) {
      for (int s = 0; s < 2; ++s) {
        if (p->fds[s] >= 0) {
          fds.push_back({p->fds[s], POLLIN, 0});
          owners.emplace_back(p.get(), s);
        }
      }
    }
  }
  if (fds.empty()) return false;
  if (poll(fds.data(), fds.size(), timeout_ms) <= 0) return true;
  char buf[65536];
  for (std::size_t i = 0; i < fds.size(); ++i) {
    if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
    auto [p, s] = owners[i];
    for (;;) {
      ssize_t n = ::read(p->fds[s], buf, sizeof buf);
      if (n > 0) {
        p->partial[s].append(buf, static_cast<std::size_t>(n));
        std::size_t at;
        while ((at = p->partial[s].find('\n')) != std::string::npos) {
          write_line(*p, s == 1, p->partial[s].substr(0, at));
          p->partial[s].erase(0, at + 1);
        }
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno == EAGAIN) break;
      // End of stream: the worker (and everything that inherited the pipe) closed it.
      if (!p->partial[s].empty()) write_line(*p, s == 1, p->partial[s]);
      p->partial[s].clear();
      close(p->fds[s]);
      p->fds[s] = -1;
      break;
    }
  }
  return true;
}

void LocalLauncher::on_exit(Proc& p, int status) {
  WorkerExit e;
  e.name = p.name;
  e.pid = p.pid;
  if (WIFSIGNALED(status)) {
    e.signal = WTERMSIG(status);
  } else {
    e.exit_code = WEXITSTATUS(status);
  }
  e.last_stderr.assign(p.tail.begin(), p.tail.end());
  bool first_failure = false;
  {
    std::lock_guard lock(mu_);
    p.running = false;
    p.exit = e;
    if (!expecting_exit_ && !failed_) {
      failed_ = true;
      failure_ = e;
      first_failure = true;
    }
  }
  exit_cv_.notify_all();
  if (first_failure) {
    {
      std::lock_guard lock(out_mu_);
      write_all(2, fmt::format("twinkle: worker {} (pid {}) {}; stopping the other workers\n",
                               e.name, e.pid, e.describe()));
    }
    if (pgid_) kill(-pgid_, SIGTERM);  // stop the others
  }
}

void LocalLauncher::reap() {
  std::vector<Proc*> running;
  {
    std::lock_guard lock(mu_);
    for (auto& p : procs_) {
      if (p->running) running.push_back(p.get());
    }
  }
  for (Proc* p : running) {
    int status = 0;
    if (waitpid(p->pid, &status, WNOHANG) == p->pid) {
      // Relay what it wrote before it ended, so the report has its last lines.
      while (pump_output(0) && (p->fds[0] >= 0 || p->fds[1] >= 0)) {
        pollfd probe[2] = {{p->fds[0], POLLIN, 0}, {p->fds[1], POLLIN, 0}};
        if (poll(probe, 2, 0) <= 0) break;  // a grandchild still holds the pipe open
      }
      on_exit(*p, status);
    }
  }
}

void LocalLauncher::monitor() {
  auto kill_at = std::chrono::steady_clock::time_point::max();
  for (;;) {
    const bool has_fds = pump_output(50);
    reap();
    if (failed_ && kill_at == std::chrono::steady_clock::time_point::max()) {
      kill_at = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
    }
    if (running() > 0 && std::chrono::steady_clock::now() > kill_at && pgid_) kill(-pgid_, SIGKILL);
    if (stopping_ && running() == 0) {
      pump_output(0);
      return;
    }
    if (!has_fds) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

std::optional<WorkerExit> LocalLauncher::failure() const {
  std::lock_guard lock(mu_);
  return failure_;
}

std::size_t LocalLauncher::running() const {
  std::lock_guard lock(mu_);
  std::size_t n = 0;
  for (const auto& p : procs_) n += p->running;
  return n;
}

int LocalLauncher::take_channel(std::size_t index) {
  std::lock_guard lock(mu_);
  if (index >= procs_.size()) return -1;
  return std::exchange(procs_[index]->channel, -1);
}

std::vector<pid_t> LocalLauncher::pids() const {
  std::lock_guard lock(mu_);
  std::vector<pid_t> out;
  for (const auto& p : procs_) out.push_back(p->pid);
  return out;
}

void LocalLauncher::kill_all_now() const noexcept {
  if (pgid_) kill(-pgid_, SIGKILL);
}

void LocalLauncher::kill_and_reap() noexcept {
  expecting_exit_ = true;
  kill_all_now();
  for (pid_t pid : pids()) {
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
  }
}

void LocalLauncher::stop(std::chrono::milliseconds grace) {
  expecting_exit_ = true;
  if (!monitor_.joinable()) return;
  auto wait_all = [&](std::chrono::milliseconds d) {
    std::unique_lock lock(mu_);
    exit_cv_.wait_for(lock, d, [&] {
      for (const auto& p : procs_) {
        if (p->running) return false;
      }
      return true;
    });
  };
  wait_all(grace);
  if (running() > 0 && pgid_) {
    kill(-pgid_, SIGTERM);
    wait_all(std::chrono::milliseconds(500));
  }
  if (pgid_) kill(-pgid_, SIGKILL);  // also whatever the workers started
  wait_all(std::chrono::milliseconds(5000));
  stopping_ = true;
  monitor_.join();
  std::lock_guard lock(mu_);
  for (auto& p : procs_) {
    for (int& fd : p->fds) {
      if (fd >= 0) close(fd);
      fd = -1;
    }
    if (p->channel >= 0) close(std::exchange(p->channel, -1));
  }
}

}  // namespace twinkle::core
