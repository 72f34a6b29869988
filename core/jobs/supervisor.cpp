#include "core/jobs/supervisor.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>

#include <fmt/format.h>

#include "core/runtime/run_as.hpp"
#include "twinkle/errors.hpp"
#include "twinkle/fd.hpp"

extern char** environ;

namespace twinkle::core::jobs {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

bool write_atomic(const fs::path& file, const std::string& text) {
  const fs::path tmp = file.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << text;
    if (!out) return false;
  }
  std::error_code ec;
  fs::rename(tmp, file, ec);
  return !ec;
}

namespace {

// The driver's output into log, rotated into log.1 when it reaches half the cap; log.base says
// where log.1 starts in the whole stream.
class LogWriter {
 public:
  // `owner`: the account the job runs as, which may read its log (nobody else may).
  LogWriter(const fs::path& dir, std::uint64_t cap, const std::optional<Account>& owner)
      : dir_(dir), half_(std::max<std::uint64_t>(cap / 2, 4096)), owner_(owner) {
    std::error_code ec;
    size_ = fs::exists(dir / "log", ec) ? fs::file_size(dir / "log", ec) : 0;
    open();
  }

  void write(const char* p, std::size_t n) {
    // A piece larger than a half (the driver wrote faster than it was read) goes in halves, so
    // that the two files never hold more than the cap.
    while (n > half_) {
      write(p, half_);
      p += half_;
      n -= half_;
    }
    if (size_ + n > half_ && size_ > 0) rotate();
    std::size_t done = 0;
    while (done < n) {
      const ssize_t w = ::write(fd_.get(), p + done, n - done);
      if (w <= 0) return;  // a full disk drops log lines, never the job
      done += static_cast<std::size_t>(w);
    }
    size_ += n;
  }

  void line(const std::string& text) { write(text.data(), text.size()); }

 private:
  void rotate() {
    std::int64_t base = 0;
    {
      std::ifstream in(dir_ / "log.base");
      in >> base;
    }
    std::error_code ec;
    const auto old = fs::exists(dir_ / "log.1", ec) ? fs::file_size(dir_ / "log.1", ec) : 0;
    fs::rename(dir_ / "log", dir_ / "log.1", ec);
    write_atomic(dir_ / "log.base", fmt::format("{}\n", base + static_cast<std::int64_t>(old)));
    open();
    size_ = 0;
  }

  void open() {
    fd_ = Fd(::open((dir_ / "log").c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NOFOLLOW,
                    owner_ ? 0600 : 0640));
    if (fd_ && owner_) (void)!::fchown(fd_.get(), owner_->uid, owner_->gid);
  }

  fs::path dir_;
  std::uint64_t half_;
  std::optional<Account> owner_;
  std::uint64_t size_ = 0;
  Fd fd_;
};

}  // namespace

std::vector<std::string> supervise_command(const DriverCommand& c) {
  std::vector<std::string> argv = {c.exe,           "supervise",
                                   "--job-dir",     c.job_dir.string(),
                                   "--work-dir",    (c.job_dir / "work").string(),
                                   "--max-retries", std::to_string(std::max(0, c.max_retries)),
                                   "--log-cap",     std::to_string(c.log_cap),
                                   "--stop-grace",  fmt::format("{}", c.stop_grace_s)};
  if (c.resume_on_retry) argv.push_back("--resume-on-retry");
  if (!c.account.empty()) argv.insert(argv.end(), {"--user", c.account});
  // The job file by its full path: the driver's command line names the job's folder.
  argv.insert(argv.end(), {"--", c.exe, "run", (c.job_dir / "work" / c.job_file).string(),
                           "--address", c.address});
  for (const auto& x : c.sets) argv.insert(argv.end(), {"--set", x});
  if (!c.head_key.empty()) {
    argv.insert(argv.end(), {"--key", (c.job_dir / "driver" / "twinkle.key").string(), "--head-key",
                             c.head_key});
  }
  return argv;
}

int start_supervisor(const std::vector<std::string>& argv, std::int64_t id, const std::string& user,
                     const std::string& name) {
  std::vector<std::string> argv_text = argv;
  std::vector<char*> args;
  for (auto& a : argv_text) args.push_back(a.data());
  args.push_back(nullptr);
  // The environment is made here: between fork and exec only async-signal-safe calls.
  std::vector<std::string> env_text = {fmt::format("TWINKLE_JOB_ID={}", id),
                                       "TWINKLE_JOB_USER=" + user, "TWINKLE_JOB_NAME=" + name};
  for (char** e = environ; *e; ++e) {
    const std::string_view v(*e);
    if (v.rfind("TWINKLE_JOB_", 0) == 0 || v.rfind("TWINKLE_ADDRESS=", 0) == 0) continue;
    env_text.emplace_back(v);
  }
  std::vector<char*> envp;
  for (auto& e : env_text) envp.push_back(e.data());
  envp.push_back(nullptr);
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) throw Error("cannot create a pipe to start a job");
  Fd from(fds[0]);
  Fd to(fds[1]);
  const pid_t child = fork();
  if (child < 0) throw Error("cannot fork to start a job");
  if (child == 0) {
    setsid();
    const pid_t grandchild = fork();
    if (grandchild == 0) {
      const int null = ::open("/dev/null", O_RDWR);
      dup2(null, 0);
      dup2(null, 1);
      dup2(null, 2);
      execve(args[0], args.data(), envp.data());
      _exit(127);
    }
    (void)!::write(to.get(), &grandchild, sizeof grandchild);
    _exit(0);
  }
  to.reset();
  pid_t pid = -1;
  (void)!::read(from.get(), &pid, sizeof pid);
  waitpid(child, nullptr, 0);
  if (pid <= 0) throw Error("cannot start a job's supervisor");
  return pid;
}

void append_log(const fs::path& job_dir, std::uint64_t cap, std::string_view bytes) {
  LogWriter(job_dir, cap, std::nullopt).write(bytes.data(), bytes.size());
}

namespace {

std::string stamp() {
  const std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", std::localtime(&t));
  return buf;
}

// Starts the driver with its output into `out`; returns its pid.
pid_t start_driver(const SuperviseOptions& o, const std::vector<std::string>& argv, int out,
                   int attempt) {
  // This process has one thread: the child may look the account up (become) before its exec.
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const std::string count = std::to_string(attempt);
  const pid_t pid = fork();
  if (pid < 0) throw Error(fmt::format("cannot fork the driver: {}", std::strerror(errno)));
  if (pid == 0) {
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    const int null = ::open("/dev/null", O_RDONLY);
    dup2(null, 0);
    dup2(out, 1);
    dup2(out, 2);
    setenv("TWINKLE_JOB_ATTEMPT", count.c_str(), 1);
    if (!o.user.empty()) {
      try {
        become(o.user);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "twinkle: cannot start the driver: %s\n", e.what());
        _exit(127);
      }
    }
    if (chdir(o.work_dir.c_str()) != 0) {
      std::fprintf(stderr, "twinkle: cannot enter %s: %s\n", o.work_dir.c_str(),
                   std::strerror(errno));
      _exit(127);
    }
    execv(args[0], args.data());
    std::fprintf(stderr, "twinkle: cannot start the driver %s: %s\n", args[0],
                 std::strerror(errno));
    _exit(127);
  }
  return pid;
}

}  // namespace

int supervise(const SuperviseOptions& o) {
  sigset_t set;
  sigemptyset(&set);
  for (int s : {SIGTERM, SIGINT, SIGHUP, SIGUSR2, SIGCHLD}) sigaddset(&set, s);
  sigprocmask(SIG_BLOCK, &set, nullptr);
  Fd sigs(signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK));
  std::optional<Account> owner;
  if (!o.user.empty()) {
    owner = find_account(o.user);
    umask(077);  // the job's files here are nobody else's
  }
  LogWriter log(o.job_dir, o.log_cap, owner);

  bool stopping = false;  // asked to stop: no retry
  int code = 0;
  int attempt = 0;
  for (;; ++attempt) {
    std::vector<std::string> argv = o.argv;
    // job.resume=auto, not --resume: a driver that died before its first checkpoint starts
    // afresh instead of failing for want of one.
    if (attempt > 0 && o.resume_on_retry) {
      argv.push_back("--set");
      argv.push_back("job.resume=auto");
    }
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0) throw Error("cannot create the driver's output pipe");
    Fd from(fds[0]);
    Fd to(fds[1]);
    const pid_t pid = start_driver(o, argv, to.get(), attempt);
    to.reset();
    write_atomic(o.job_dir / "attempt", fmt::format("{} {}\n", attempt, pid));
    std::optional<Clock::time_point> kill_at;
    bool open = true, exited = false;
    int status = 0;
    char buf[65536];
    while (open || !exited) {
      int timeout = -1;
      if (kill_at) {
        timeout = static_cast<int>(std::max<std::int64_t>(
            0, std::chrono::duration_cast<std::chrono::milliseconds>(*kill_at - Clock::now())
                   .count()));
      }
      pollfd p[2] = {{sigs.get(), POLLIN, 0}, {open ? from.get() : -1, POLLIN, 0}};
      ::poll(p, 2, exited ? 100 : timeout);
      if (kill_at && Clock::now() >= *kill_at) {
        ::kill(pid, SIGKILL);
        kill_at.reset();
      }
      if (p[1].revents & (POLLIN | POLLHUP | POLLERR)) {
        const ssize_t n = ::read(from.get(), buf, sizeof buf);
        if (n > 0) {
          log.write(buf, static_cast<std::size_t>(n));
        } else {
          open = false;
        }
      }
      signalfd_siginfo si{};
      while (::read(sigs.get(), &si, sizeof si) == sizeof si) {
        if (si.ssi_signo == SIGCHLD) continue;
        if (si.ssi_signo == SIGUSR2) {
          stopping = true;
          ::kill(pid, SIGKILL);
        } else if (!stopping) {
          stopping = true;
          ::kill(pid, SIGTERM);
          kill_at = Clock::now() + std::chrono::milliseconds(
                                       static_cast<std::int64_t>(o.stop_grace_s * 1000) + 30000);
        }
      }
      if (!exited && waitpid(pid, &status, WNOHANG) == pid) exited = true;
      // A driver's child that keeps the pipe open must not keep the job running.
      if (exited && open && !(p[1].revents & POLLIN)) open = false;
    }
    code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    // Not retried: success, a stop (75, or asked), and what would fail the same way again: a bad
    // job file or flag (2) and a plugin that does not load (3).
    const bool retry =
        code != 0 && code != 75 && code != 2 && code != 3 && !stopping && attempt < o.max_retries;
    log.line(fmt::format(
        "{} twinkle job: the driver (attempt {}, pid {}) {}{}\n", stamp(), attempt + 1, pid,
        WIFEXITED(status) ? fmt::format("exited with code {}", code)
                          : fmt::format("was killed by signal {}", WTERMSIG(status)),
        retry ? fmt::format("; starting it again ({} of {} retries{})", attempt + 1, o.max_retries,
                            o.resume_on_retry ? ", resuming from its newest checkpoint" : "")
              : ""));
    if (!retry) break;
  }
  write_atomic(o.job_dir / "exit", fmt::format("{} {}\n", code, attempt));
  return code;
}

LogPiece read_log(const fs::path& dir, std::int64_t offset, std::size_t max) {
  LogPiece out;
  std::int64_t base = 0;
  {
    std::ifstream in(dir / "log.base");
    in >> base;
  }
  std::error_code ec;
  const auto size1 = static_cast<std::int64_t>(
      fs::exists(dir / "log.1", ec) ? fs::file_size(dir / "log.1", ec) : 0);
  const auto size0 =
      static_cast<std::int64_t>(fs::exists(dir / "log", ec) ? fs::file_size(dir / "log", ec) : 0);
  const std::int64_t start1 = base;  // log.1 (empty before the first rotation)
  const std::int64_t start0 = base + size1;
  out.end = start0 + size0;
  offset = std::max(offset, start1);
  out.offset = offset;
  auto read_from = [&](const fs::path& f, std::int64_t at, std::int64_t limit) {
    std::ifstream in(f, std::ios::binary);
    in.seekg(at);
    std::string b(static_cast<std::size_t>(limit), '\0');
    in.read(b.data(), limit);
    b.resize(static_cast<std::size_t>(in.gcount()));
    return b;
  };
  if (offset < start0) {
    out.bytes = read_from(dir / "log.1", offset - start1,
                          std::min<std::int64_t>(start0 - offset, static_cast<std::int64_t>(max)));
  } else if (offset < out.end) {
    out.bytes = read_from(dir / "log", offset - start0,
                          std::min<std::int64_t>(out.end - offset, static_cast<std::int64_t>(max)));
  }
  return out;
}

std::optional<AttemptFile> read_attempt(const fs::path& dir) {
  std::ifstream in(dir / "attempt");
  AttemptFile a;
  if (!(in >> a.attempt >> a.pid)) return std::nullopt;
  return a;
}

std::optional<ExitFile> read_exit(const fs::path& dir) {
  std::ifstream in(dir / "exit");
  ExitFile e;
  if (!(in >> e.code >> e.retries)) return std::nullopt;
  return e;
}

std::int64_t process_start(int pid) {
  if (pid <= 0) return 0;
  std::ifstream in(fmt::format("/proc/{}/stat", pid));
  std::string text;
  if (!std::getline(in, text)) return 0;
  // After the command name in parentheses (which may hold spaces): field 3 on.
  const auto close = text.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream rest(text.substr(close + 2));
  std::string f;
  char state = 0;
  rest >> state;
  if (state == 'Z' || state == 'X') return 0;
  for (int i = 4; i <= 22 && rest >> f; ++i) {
    if (i == 22) return std::stoll(f);
  }
  return 0;
}

}  // namespace twinkle::core::jobs
