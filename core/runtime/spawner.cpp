#include "core/runtime/spawner.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <utility>

#include <fmt/format.h>

#include "twinkle/errors.hpp"

namespace twinkle::core {

std::filesystem::path twinkle_binary() {
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) throw Error("cannot find the twinkle binary (/proc/self/exe) to start workers");
  return p;
}

std::filesystem::path worker_binary(const std::filesystem::path& twinkle) {
  auto p = twinkle.parent_path() / "twinkle-worker";
  if (::access(p.c_str(), X_OK) != 0)
    throw Error(fmt::format(
        "cannot run the worker binary {}: {} (twinkle-worker is installed beside twinkle; "
        "install both from the same build)",
        p.string(), std::strerror(errno)));
  return p;
}

std::string ProcessExit::describe() const {
  if (signal) return fmt::format("was killed by signal {} ({})", signal, strsignal(signal));
  return fmt::format("exited with code {}", exit_code);
}

struct Spawner::Proc {
  std::string name;
  pid_t pid = 0;
  Fd out[2];  // stdout, stderr read ends
  Fd pidfd;   // readable when the process has exited; empty where pidfds are missing
  std::string partial[2];
  std::deque<std::string> tail;
  Fd log;  // close-on-exec, unlike a std::ofstream's: the processes spawned later must not get it
  bool running = false;
  std::shared_ptr<ForkServer> server;  // the fork server that forked it, reaps it, reports its exit
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

// posix_spawn's attribute and file-action objects, destroyed on every path.
struct SpawnAttr {
  posix_spawnattr_t attr;
  posix_spawn_file_actions_t actions;
  SpawnAttr() {
    posix_spawnattr_init(&attr);
    posix_spawn_file_actions_init(&actions);
  }
  ~SpawnAttr() {
    posix_spawn_file_actions_destroy(&actions);
    posix_spawnattr_destroy(&attr);
  }
};

}  // namespace

Spawner::Spawner(SpawnerOptions options, ExitHandler on_exit)
    : options_(std::move(options)), on_exit_(std::move(on_exit)) {
  if (options_.log_dir) logs_.emplace(*options_.log_dir);
  wake_.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake_) throw Error(fmt::format("cannot create an eventfd: {}", std::strerror(errno)));
}

Spawner::~Spawner() { stop(std::chrono::milliseconds(0), std::chrono::milliseconds(0)); }

void Spawner::wake() const noexcept {
  const std::uint64_t one = 1;
  (void)!::write(wake_.get(), &one, sizeof one);
}

pid_t Spawner::spawn(ProcessSpec spec) {
  auto proc = std::make_unique<Proc>();
  proc->name = spec.name;
  if (logs_) proc->log = logs_->open(spec.name);
  FdPair out = FdPair::pipe(spec.name.c_str());
  FdPair err = FdPair::pipe(spec.name.c_str());

  if (!fork_from_server(*proc, spec, out.second.get(), err.second.get()))
    spawn_process(*proc, spec, out.second.get(), err.second.get());
  const pid_t pid = proc->pid;
  proc->out[0] = std::move(out.first);
  proc->out[1] = std::move(err.first);
  fcntl(proc->out[0].get(), F_SETFL, O_NONBLOCK);
  fcntl(proc->out[1].get(), F_SETFL, O_NONBLOCK);
  // out.second, err.second and the inherited descriptors close here: the child has its copies.
  {
    std::lock_guard lock(mu_);
    procs_.push_back(std::move(proc));
  }
  if (!monitor_.joinable()) monitor_ = std::thread([this] { monitor(); });
  wake();
  return pid;
}

void Spawner::spawn_process(Proc& proc, const ProcessSpec& spec, int out, int err) {
  std::vector<char*> argv, envp;
  for (const auto& a : spec.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  for (const auto& e : spec.env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);

  SpawnAttr sa;
  sigset_t none, defaults;
  sigemptyset(&none);
  sigemptyset(&defaults);
  for (int s : {SIGPIPE, SIGINT, SIGTERM, SIGHUP, SIGCHLD}) sigaddset(&defaults, s);
  posix_spawnattr_setsigmask(&sa.attr, &none);
  posix_spawnattr_setsigdefault(&sa.attr, &defaults);
  posix_spawnattr_setpgroup(&sa.attr, pgid_.load());
  posix_spawnattr_setflags(&sa.attr,
                           POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETPGROUP);
  posix_spawn_file_actions_addopen(&sa.actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&sa.actions, out, 1);
  posix_spawn_file_actions_adddup2(&sa.actions, err, 2);
  // dup2 clears close-on-exec on the target: the child keeps exactly these. Each goes first to a
  // number above every source and target, then to its target, so that no dup2 overwrites a
  // descriptor a later one copies (a source that is another's target).
  int above = 2;
  for (const auto& [fd, target] : spec.inherit) above = std::max({above, fd.get(), target});
  for (std::size_t i = 0; i < spec.inherit.size(); ++i)
    posix_spawn_file_actions_adddup2(&sa.actions, spec.inherit[i].first.get(),
                                     above + 1 + static_cast<int>(i));
  for (std::size_t i = 0; i < spec.inherit.size(); ++i) {
    const int staged = above + 1 + static_cast<int>(i);
    posix_spawn_file_actions_adddup2(&sa.actions, staged, spec.inherit[i].second);
    posix_spawn_file_actions_addclose(&sa.actions, staged);
  }

  pid_t pid = 0;
  int rc = posix_spawn(&pid, argv[0], &sa.actions, &sa.attr, argv.data(), envp.data());
  if (rc == EPERM && pgid_.load() != 0) {
    // The group's processes are all gone: start a new group.
    posix_spawnattr_setpgroup(&sa.attr, 0);
    pgid_ = 0;
    rc = posix_spawn(&pid, argv[0], &sa.actions, &sa.attr, argv.data(), envp.data());
  }
  if (rc != 0) {
    throw Error(
        fmt::format("cannot start {} ({}): {}", spec.name, spec.argv.at(0), std::strerror(rc)));
  }
  if (pgid_.load() == 0) pgid_ = pid;
  proc.pid = pid;
  proc.running = true;
  proc.pidfd = open_pidfd(pid);
}

// Forks `spec` from the fork server when it runs the server's binary and may be forked (see
// ForkServer::suits); false when it is to be spawned. A server that cannot start or fails is
// given up with one warning: every later process is spawned.
bool Spawner::fork_from_server(Proc& proc, ProcessSpec& spec, int out, int err) {
  if (!options_.fork_server || server_failed_ || spec.argv.empty() ||
      spec.argv[0] != options_.fork_server->string())
    return false;
  std::string why;
  std::shared_ptr<ForkServer> replaced;  // destroyed outside the lock: it waits for its server
  if (!server_ && options_.started_server && options_.started_server->exe() == spec.argv[0]) {
    std::lock_guard lock(mu_);
    server_ = std::move(options_.started_server);
  }
  if (!server_ || (server_->forks() == 0 && !server_->suits(spec.env))) {
    // None yet, or one started with another environment and not used: one with this process's.
    auto started = ForkServer::start(*options_.fork_server, spec.env, why);
    std::lock_guard lock(mu_);
    replaced = std::exchange(server_, std::move(started));
  }
  if (server_) {
    if (!server_->suits(spec.env)) return false;
    std::vector<std::pair<int, int>> inherit;
    for (const auto& [fd, target] : spec.inherit) inherit.emplace_back(fd.get(), target);
    try {
      const auto f = server_->fork(pgid_.load(), spec.argv, spec.env, out, err, inherit);
      if (!f) return false;  // this one is spawned
      proc.pid = f->pid;
      proc.running = true;
      proc.server = server_;
      proc.pidfd = open_pidfd(f->pid);  // for signals and kill_and_reap; the server reports exits
      pgid_ = f->pgid;
      spec.inherit.clear();  // the child has its copies
      return true;
    } catch (const ForkServer::Gone& e) {
      why = e.what();
    }
  }
  server_failed_ = true;
  std::fprintf(stderr, "twinkle: warning: workers are spawned, not forked, from now on: %s\n",
               why.c_str());
  std::fflush(stderr);
  return false;
}

// Finishes the processes whose exits the fork server reported; keeps the exits of processes
// spawn() has not recorded yet. A server found gone is the monitor's loop to handle.
void Spawner::server_reports(ForkServer& server) {
  std::vector<std::pair<pid_t, int>> exits;
  if (!server.read_reports([&](pid_t pid, int status) { exits.emplace_back(pid, status); })) {
    std::fprintf(stderr,
                 "twinkle: the workers' fork server (pid %d) died; its workers die with it\n",
                 server.pid());
    std::fflush(stderr);
  }
  std::vector<std::pair<Proc*, int>> done;
  {
    std::lock_guard lock(mu_);
    for (const auto& [pid, status] : exits) {
      auto it = std::find_if(procs_.begin(), procs_.end(), [pid = pid](const auto& p) {
        return p->server && p->running && p->pid == pid;
      });
      if (it == procs_.end()) {
        early_exits_.emplace_back(pid, status);
      } else {
        done.emplace_back(it->get(), status);
      }
    }
  }
  for (auto [p, status] : done) finish(*p, status);
}

void Spawner::write_line(Proc& p, bool is_stderr, const std::string& line) {
  if (is_stderr) {
    p.tail.push_back(line);
    if (p.tail.size() > options_.stderr_tail) p.tail.pop_front();
  }
  if (p.log) logs_->append(p.log, p.name, line);
  if (options_.on_line) {
    options_.on_line(p.name, is_stderr, line);
    return;
  }
  if (options_.quiet) return;
  std::lock_guard lock(out_mu_);
  write_all(is_stderr ? 2 : 1, fmt::format("[{}] {}\n", p.name, line));
}

// Reads what stream `s` of `p` has; false once it reached its end (and is closed).
bool Spawner::relay(Proc& p, int s) {
  char buf[65536];
  for (;;) {
    ssize_t n = ::read(p.out[s].get(), buf, sizeof buf);
    if (n > 0) {
      p.partial[s].append(buf, static_cast<std::size_t>(n));
      std::size_t at;
      while ((at = p.partial[s].find('\n')) != std::string::npos) {
        write_line(p, s == 1, p.partial[s].substr(0, at));
        p.partial[s].erase(0, at + 1);
      }
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) return true;
    // End of stream: the process (and everything that inherited the pipe) closed it.
    if (!p.partial[s].empty()) write_line(p, s == 1, p.partial[s]);
    p.partial[s].clear();
    p.out[s].reset();
    return false;
  }
}

void Spawner::finish(Proc& p, int status) {
  // Relay what it wrote before it ended, so that the report has its last lines. A grandchild
  // may hold the pipes open: take only what is there now.
  for (int s = 0; s < 2; ++s) {
    if (p.out[s]) relay(p, s);
  }
  ProcessExit e;
  e.name = p.name;
  e.pid = p.pid;
  if (WIFSIGNALED(status)) {
    e.signal = WTERMSIG(status);
  } else {
    e.exit_code = WEXITSTATUS(status);
  }
  e.last_stderr.assign(p.tail.begin(), p.tail.end());
  {
    std::lock_guard lock(mu_);
    p.running = false;
    p.pidfd.reset();
  }
  exit_cv_.notify_all();
  if (on_exit_) on_exit_(e);
}

void Spawner::monitor() {
  std::vector<pollfd> fds;
  std::shared_ptr<ForkServer> server;         // a copy: spawn() may replace server_ meanwhile
  std::vector<std::pair<Proc*, int>> owners;  // stream 0/1, or 2 for the pidfd
  for (;;) {
    fds.clear();
    owners.clear();
    fds.push_back({wake_.get(), POLLIN, 0});
    owners.emplace_back(nullptr, 0);
    bool unwatched = false;  // a running process without a pidfd: poll waitpid
    {
      std::lock_guard lock(mu_);
      for (auto& p : procs_) {
        for (int s = 0; s < 2; ++s) {
          if (p->out[s]) {
            fds.push_back({p->out[s].get(), POLLIN, 0});
            owners.emplace_back(p.get(), s);
          }
        }
        if (p->running && !p->server && p->pidfd) {
          fds.push_back({p->pidfd.get(), POLLIN, 0});
          owners.emplace_back(p.get(), 2);
        }
        unwatched |= p->running && !p->server && !p->pidfd;
      }
      server = server_;
      if (server && server->reports_open()) {
        fds.push_back({server->reports_fd(), POLLIN, 0});
        owners.emplace_back(nullptr, 3);
      }
    }
    // Exits the fork server reported before spawn() had recorded the process; then the
    // processes of a server that is gone (they die with it: killed here, reported killed).
    std::vector<std::pair<Proc*, int>> early;
    {
      std::lock_guard lock(mu_);
      for (auto it = early_exits_.begin(); it != early_exits_.end();) {
        auto p = std::find_if(procs_.begin(), procs_.end(), [&](const auto& q) {
          return q->server && q->running && q->pid == it->first;
        });
        if (p == procs_.end()) {
          ++it;
          continue;
        }
        early.emplace_back(p->get(), it->second);
        it = early_exits_.erase(it);
      }
      for (auto& p : procs_) {
        if (!p->running || !p->server || p->server->reports_open()) continue;
        if (std::any_of(early.begin(), early.end(),
                        [&](const auto& e) { return e.first == p.get(); }))
          continue;
        send_signal(p->pidfd, p->pid, SIGKILL);
        early.emplace_back(p.get(), SIGKILL);  // a wait status: killed by SIGKILL
      }
    }
    for (auto [p, status] : early) finish(*p, status);
    if (stopping_ && running() == 0) break;
    if (::poll(fds.data(), fds.size(), unwatched ? 20 : -1) < 0 && errno != EINTR) break;
    if (fds[0].revents & POLLIN) {
      std::uint64_t n;
      (void)!::read(wake_.get(), &n, sizeof n);
    }
    for (std::size_t i = 1; i < fds.size(); ++i) {
      auto [p, s] = owners[i];
      if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      if (s == 3) {
        server_reports(*server);
        continue;
      }
      if (s < 2) {
        if (p->out[s]) relay(*p, s);
        continue;
      }
      int status = 0;
      pid_t r;
      while ((r = ::waitpid(p->pid, &status, WNOHANG)) < 0 && errno == EINTR) {
      }
      if (r == p->pid) finish(*p, status);
    }
    if (unwatched) {
      std::vector<Proc*> todo;
      {
        std::lock_guard lock(mu_);
        for (auto& p : procs_) {
          if (p->running && !p->server && !p->pidfd) todo.push_back(p.get());
        }
      }
      for (Proc* p : todo) {
        int status = 0;
        if (::waitpid(p->pid, &status, WNOHANG) == p->pid) finish(*p, status);
      }
    }
  }
  // The last output of processes whose pipes are still open (without blocking on grandchildren).
  std::lock_guard lock(mu_);
  for (auto& p : procs_) {
    for (int s = 0; s < 2; ++s) {
      if (p->out[s]) relay(*p, s);
    }
  }
}

std::size_t Spawner::running() const {
  std::lock_guard lock(mu_);
  std::size_t n = 0;
  for (const auto& p : procs_) n += p->running;
  return n;
}

std::size_t Spawner::forked() const {
  std::lock_guard lock(mu_);
  return static_cast<std::size_t>(std::count_if(
      procs_.begin(), procs_.end(), [](const auto& p) { return p->server != nullptr; }));
}

std::vector<pid_t> Spawner::pids() const {
  std::lock_guard lock(mu_);
  std::vector<pid_t> out;
  for (const auto& p : procs_) out.push_back(p->pid);
  return out;
}

void Spawner::signal_all(int sig) const noexcept {
  if (const pid_t g = pgid_.load(); g > 0) ::kill(-g, sig);
}

int Spawner::signal(const std::string& name, int sig) const {
  std::lock_guard lock(mu_);
  int n = 0;
  for (const auto& p : procs_) {
    if (p->running && p->name == name && send_signal(p->pidfd, p->pid, sig) == 0) ++n;
  }
  return n;
}

bool Spawner::signal_pid(pid_t pid, int sig) const {
  std::lock_guard lock(mu_);
  for (const auto& p : procs_) {
    if (p->running && p->pid == pid) return send_signal(p->pidfd, p->pid, sig) == 0;
  }
  return false;
}

void Spawner::kill_and_reap() noexcept {
  signal_all(SIGKILL);
  std::vector<pid_t> running;
  std::vector<pollfd> forked;  // the fork server reaps these: wait for their pidfds
  {
    std::lock_guard lock(mu_);
    for (const auto& p : procs_) {
      if (!p->running) continue;
      if (!p->server) {
        running.push_back(p->pid);
      } else if (p->pidfd) {
        forked.push_back({p->pidfd.get(), POLLIN, 0});
      }
    }
  }
  for (pid_t pid : running) {
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  for (auto& f : forked) {
    while (std::chrono::steady_clock::now() < deadline) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      const int r = ::poll(&f, 1, static_cast<int>(left.count()) + 1);
      if (r > 0 || (r < 0 && errno != EINTR)) break;
    }
  }
}

std::vector<std::string> Spawner::stop(std::chrono::milliseconds grace,
                                       std::chrono::milliseconds term_grace) {
  std::vector<std::string> signalled;
  if (!monitor_.joinable()) return signalled;
  auto wait_all = [&](std::chrono::milliseconds d) {
    std::unique_lock lock(mu_);
    return exit_cv_.wait_for(lock, d, [&] {
      return std::none_of(procs_.begin(), procs_.end(), [](const auto& p) { return p->running; });
    });
  };
  if (!wait_all(grace)) {
    {
      std::lock_guard lock(mu_);
      for (const auto& p : procs_) {
        if (p->running) signalled.push_back(p->name);
      }
    }
    signal_all(SIGTERM);
    wait_all(term_grace);
  }
  signal_all(SIGKILL);  // also whatever the processes started
  wait_all(std::chrono::seconds(5));
  stopping_ = true;
  wake();
  monitor_.join();
  close_all_pipes();
  return signalled;
}

void Spawner::close_all_pipes() {
  std::lock_guard lock(mu_);
  for (auto& p : procs_) {
    p->out[0].reset();
    p->out[1].reset();
  }
}

}  // namespace twinkle::core
