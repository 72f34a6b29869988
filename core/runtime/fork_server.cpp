#include "core/runtime/fork_server.hpp"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string_view>
#include <tuple>

#include <fmt/format.h>
#include <msgpack.hpp>

#include "transports/fd.hpp"
#include "twinkle/errors.hpp"

extern char** environ;

namespace twinkle::core {

namespace {

pid_t g_forked_by = 0;  // in a forked child: its server

constexpr int kRequestFd = 3;  // the server's ends of its two sockets
constexpr int kReportFd = 4;
// Argv and environment, packed: one message, within a Unix socket's default send buffer (208 KiB).
constexpr std::size_t kMaxRequest = 192 * 1024;
constexpr std::size_t kMaxFds = 64;       // stdout, stderr and what a process inherits
constexpr std::size_t kTitleRoom = 4095;  // the server's padding argument: room for argv
// How long the launcher waits for the server to answer a request before it is taken for gone.
constexpr int kReplyTimeoutMs = 10000;
// The launcher's last message: stop serving, kill what was forked and still runs, and end. A
// launcher that dies sends none: its socket just ends.
constexpr char kStop[4] = {'s', 't', 'o', 'p'};

// The request: process group, argv, environment, and the numbers in the child of the descriptors
// that come with it (after stdout and stderr).
using Request =
    std::tuple<std::int32_t, std::vector<std::string>, std::vector<std::string>, std::vector<int>>;
struct Reply {
  std::int32_t pid = 0;
  std::int32_t pgid = 0;
  std::int32_t error = 0;  // errno of a failed fork
};
struct Report {
  std::int32_t pid = 0;
  std::int32_t status = 0;  // waitpid's
};

bool startup_key(const std::string& entry) {
  return entry.rfind("LD_", 0) == 0 || entry.rfind("GLIBC_TUNABLES=", 0) == 0 ||
         entry.rfind("MALLOC_", 0) == 0;
}

std::vector<std::string> startup_entries(const std::vector<std::string>& env) {
  std::vector<std::string> out;
  for (const auto& e : env) {
    if (startup_key(e)) out.push_back(e);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// The server's command line memory, [begin, end): argv's strings lie there one after another.
struct TitleArea {
  char* begin = nullptr;
  std::size_t size = 0;
};

// Writes `argv` over the server's command line, NUL-separated as the kernel lays it out, cut to
// the room there is; the rest is zeroed.
void set_command_line(const TitleArea& area, const std::vector<std::string>& argv) {
  if (!area.begin || area.size == 0) return;
  std::size_t at = 0;
  for (const auto& a : argv) {
    if (at >= area.size - 1) break;
    const std::size_t n = std::min(a.size(), area.size - 1 - at);
    std::memcpy(area.begin + at, a.data(), n);
    at += n;
    area.begin[at++] = '\0';
  }
  std::memset(area.begin + at, 0, area.size - at);
}

// Closes every descriptor but `kept` (sorted): close_range, or one by one where the kernel has none
// (before Linux 5.9).
void close_all_but(const std::vector<int>& kept) {
  auto close_between = [](unsigned first, unsigned last) {
    if (first > last || ::close_range(first, last, 0) == 0) return;
    const rlim_t limit = [] {
      rlimit r{};
      return ::getrlimit(RLIMIT_NOFILE, &r) == 0 && r.rlim_cur != RLIM_INFINITY ? r.rlim_cur
                                                                                : 65536;
    }();
    for (rlim_t fd = first; fd <= last && fd < limit; ++fd) ::close(static_cast<int>(fd));
  };
  unsigned from = 0;
  for (int t : kept) {
    if (static_cast<unsigned>(t) > from) close_between(from, static_cast<unsigned>(t) - 1);
    from = static_cast<unsigned>(t) + 1;
  }
  close_between(from, ~0U);
}

// In the forked child: becomes the process the request describes and runs `main`.
[[noreturn]] void become(Request& request, std::vector<Fd>& fds, const TitleArea& title,
                         pid_t server, WorkerMain main) {
  auto& [pgid, argv, env, targets] = request;
  g_forked_by = server;
  if (::setpgid(0, pgid) != 0) ::setpgid(0, 0);  // that group is gone: a new one
  // The server blocks what a worker takes by default: a signal sent before this arrives now.
  ::signal(SIGPIPE, SIG_DFL);
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  set_command_line(title, argv);  // `ps` shows the server's line until here, a moment

  // Descriptors: /dev/null, stdout, stderr, then those of the request, each first to a number
  // above every target (so that no dup2 overwrites one a later one copies), then to its target.
  std::vector<std::pair<int, int>> moves;  // (descriptor here, target)
  Fd null(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  moves.emplace_back(null.get(), 0);
  moves.emplace_back(fds[0].get(), 1);
  moves.emplace_back(fds[1].get(), 2);
  for (std::size_t i = 0; i < targets.size(); ++i) moves.emplace_back(fds[i + 2].get(), targets[i]);
  int above = 2;
  for (const auto& [fd, target] : moves) above = std::max(above, target);
  for (auto& [fd, target] : moves) fd = ::fcntl(fd, F_DUPFD_CLOEXEC, above + 1);
  std::vector<int> kept;
  for (const auto& [fd, target] : moves) {
    if (fd < 0 || ::dup2(fd, target) < 0) ::_exit(127);
    kept.push_back(target);
  }
  std::sort(kept.begin(), kept.end());
  close_all_but(kept);
  for (auto& f : fds) (void)f.release();  // closed above, by number
  (void)null.release();

  // The environment: the request's.
  auto* strings = new std::vector<std::string>(std::move(env));
  auto* envp = new std::vector<char*>;
  for (auto& e : *strings) envp->push_back(e.data());
  envp->push_back(nullptr);
  environ = envp->data();

  auto* args = new std::vector<char*>;
  for (auto& a : argv) args->push_back(a.data());
  args->push_back(nullptr);
  std::exit(main(static_cast<int>(args->size() - 1), args->data()));
}

}  // namespace

pid_t forked_by() { return g_forked_by; }

int serve_forks(int argc, char** argv, WorkerMain main) {
  // Die with the launcher, and not at all if it is gone already.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (const char* parent = std::getenv("TWINKLE_PARENT_PID")) {
    if (getppid() != static_cast<pid_t>(std::atoll(parent))) return 1;
  }
  // The terminal's signals are the launcher's to handle; it stops the server with `stop`. Blocked,
  // not ignored: a child inherits the dispositions (it unblocks, and what was sent to it meanwhile
  // arrives), and SIGCHLD is read from a signalfd.
  ::signal(SIGPIPE, SIG_IGN);
  sigset_t blocked, chld;
  sigemptyset(&blocked);
  for (int s : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGTSTP, SIGCHLD}) sigaddset(&blocked, s);
  ::sigprocmask(SIG_BLOCK, &blocked, nullptr);
  sigemptyset(&chld);
  sigaddset(&chld, SIGCHLD);
  Fd exits(::signalfd(-1, &chld, SFD_CLOEXEC | SFD_NONBLOCK));
  if (!exits) return 1;

  // What every worker does the same way at its start, done once here for all of them: the C
  // library reads nsswitch.conf and looks for the NSS modules of the protocols database when libzmq
  // (its PGM transport) asks for "pgm" in each context it creates.
  (void)::getprotobyname("pgm");

  TitleArea title;
  if (argc > 0) {
    title.begin = argv[0];
    title.size =
        static_cast<std::size_t>(argv[argc - 1] + std::strlen(argv[argc - 1]) + 1 - argv[0]);
  }
  std::vector<char> buf(kMaxRequest);
  std::vector<Fd> fds;
  std::set<pid_t> children;
  bool open = true;
  while (open || !children.empty()) {
    pollfd p[2] = {{exits.get(), POLLIN, 0}, {open ? kRequestFd : -1, POLLIN, 0}};
    if (::poll(p, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return 1;
    }
    if (p[0].revents & POLLIN) {
      signalfd_siginfo info;
      while (::read(exits.get(), &info, sizeof info) > 0) {
      }
      int status = 0;
      pid_t pid;
      while ((pid = ::waitpid(-1, &status, WNOHANG)) > 0) {
        children.erase(pid);
        const Report r{pid, status};
        (void)transport::send_with_fds(kReportFd, &r, sizeof r,
                                       {});  // fails only once the launcher is gone
      }
    }
    if (!(p[1].revents & (POLLIN | POLLHUP | POLLERR))) continue;
    const ssize_t n = transport::receive_with_fds(kRequestFd, buf, fds, kMaxFds);
    if (n == sizeof kStop && std::memcmp(buf.data(), kStop, sizeof kStop) == 0) {
      // The launcher stops serving: what was forked and still runs goes too.
      open = false;
      for (pid_t c : children) ::kill(c, SIGKILL);
      continue;
    }
    if (n <= 0) {
      // The launcher died (its end closed without a stop). The server goes at once, as it would
      // by its parent-death signal a moment later: each worker hears of it and, its driver dead,
      // removes the run's files on its way out (a SIGKILL from here would leave them behind).
      ::_exit(0);
    }
    Reply reply;
    Request request;
    try {
      msgpack::object_handle oh = msgpack::unpack(buf.data(), static_cast<std::size_t>(n));
      oh.get().convert(request);
    } catch (const std::exception&) {
      reply.error = EINVAL;
    }
    if (!reply.error && fds.size() != std::get<3>(request).size() + 2) reply.error = EINVAL;
    if (!reply.error) {
      std::fflush(nullptr);
      const pid_t self = ::getpid();
      const pid_t pid = ::fork();
      if (pid == 0) become(request, fds, title, self, main);
      if (pid < 0) {
        reply.error = errno;
      } else {
        children.insert(pid);
        // Here too, so that the group is set when the launcher hears of the process, whichever
        // of the two runs first. A group that is gone: the process leads a new one.
        pid_t pgid = std::get<0>(request);
        if (pgid != 0 && ::setpgid(pid, pgid) != 0 && errno == EPERM) pgid = 0;
        if (pgid == 0) {
          ::setpgid(pid, pid);
          pgid = pid;
        }
        reply.pid = pid;
        reply.pgid = pgid;
      }
    }
    fds.clear();
    // Where this fails, the launcher is gone or gave up waiting: the next read says which (a
    // stop, or the end), as a reply that never arrives leaves the launcher nothing to know.
    (void)transport::send_with_fds(kRequestFd, &reply, sizeof reply, {});
  }
  // Nothing of the server needs destroying, and the launcher waits for its end: no exit handlers
  // and no library's destructors (each touching its code pages again).
  ::_exit(0);
}

bool fork_server_enabled() {
  const char* v = std::getenv("TWINKLE_FORK_SERVER");
  return !v || std::string_view(v) != "0";
}

std::unique_ptr<ForkServer> ForkServer::start(const std::filesystem::path& exe,
                                              const std::vector<std::string>& env,
                                              std::string& why) {
  int requests[2], reports[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, requests) != 0) {
    why = fmt::format("socketpair: {}", std::strerror(errno));
    return nullptr;
  }
  Fd req_here(requests[0]), req_there(requests[1]);
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, reports) != 0) {
    why = fmt::format("socketpair: {}", std::strerror(errno));
    return nullptr;
  }
  Fd rep_here(reports[0]), rep_there(reports[1]);

  std::vector<std::string> server_env;
  for (const auto& e : env) {
    if (e.rfind("TWINKLE_PARENT_PID=", 0) != 0) server_env.push_back(e);
  }
  server_env.push_back(fmt::format("TWINKLE_PARENT_PID={}", getpid()));
  std::vector<std::string> args = {exe.string(), kForkServerFlag, std::string(kTitleRoom, ' ')};
  std::vector<char*> argv, envp;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (auto& e : server_env) envp.push_back(e.data());
  envp.push_back(nullptr);

  posix_spawnattr_t attr;
  posix_spawn_file_actions_t actions;
  posix_spawnattr_init(&attr);
  posix_spawn_file_actions_init(&actions);
  sigset_t none, defaults;
  sigemptyset(&none);
  sigemptyset(&defaults);
  for (int s : {SIGPIPE, SIGINT, SIGTERM, SIGHUP, SIGCHLD}) sigaddset(&defaults, s);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  // It writes nothing and must not hold the launcher's stdout open (a caller reading it to its
  // end); stderr stays, for what the C library may have to say.
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
  // Through numbers above both targets, so that neither dup2 overwrites the other's source.
  const int stage = std::max({req_there.get(), rep_there.get(), kReportFd}) + 1;
  posix_spawn_file_actions_adddup2(&actions, req_there.get(), stage);
  posix_spawn_file_actions_adddup2(&actions, rep_there.get(), stage + 1);
  posix_spawn_file_actions_adddup2(&actions, stage, kRequestFd);
  posix_spawn_file_actions_adddup2(&actions, stage + 1, kReportFd);
  posix_spawn_file_actions_addclose(&actions, stage);
  posix_spawn_file_actions_addclose(&actions, stage + 1);
  pid_t pid = 0;
  const int rc = ::posix_spawn(&pid, argv[0], &actions, &attr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  if (rc != 0) {
    why = fmt::format("cannot start {} {}: {}", exe.string(), kForkServerFlag, std::strerror(rc));
    return nullptr;
  }
  std::unique_ptr<ForkServer> s(new ForkServer);
  s->exe_ = exe;
  s->pid_ = pid;
  s->requests_ = std::move(req_here);
  s->reports_ = std::move(rep_here);
  s->startup_env_ = startup_entries(env);
  return s;
}

void ForkServer::stop_serving() {
  if (requests_) (void)transport::send_with_fds(requests_.get(), kStop, sizeof kStop, {});
  requests_.reset();
}

ForkServer::~ForkServer() {
  stop_serving();  // the server kills what it forked and still runs, reaps it, and exits
  if (pid_ <= 0) return;
  const Fd exited = open_pidfd(pid_);
  pollfd p{exited.get(), POLLIN, 0};
  if (!exited || ::poll(&p, 1, 5000) <= 0) ::kill(pid_, SIGKILL);
  int status;
  while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
  }
}

bool ForkServer::suits(const std::vector<std::string>& env) const {
  return startup_entries(env) == startup_env_;
}

std::optional<ForkServer::Forked> ForkServer::fork(
    pid_t pgid, const std::vector<std::string>& argv, const std::vector<std::string>& env, int out,
    int err, const std::vector<std::pair<int, int>>& inherit) {
  Request request;
  std::get<0>(request) = pgid;
  std::get<1>(request) = argv;
  std::get<2>(request) = env;
  std::vector<int> fds = {out, err};
  for (const auto& [fd, target] : inherit) {
    fds.push_back(fd);
    std::get<3>(request).push_back(target);
  }
  msgpack::sbuffer packed;
  msgpack::pack(packed, request);
  if (packed.size() > kMaxRequest || fds.size() > kMaxFds) return std::nullopt;  // spawn this one
  if (!requests_ ||
      transport::send_with_fds(requests_.get(), packed.data(), packed.size(), fds) < 0)
    throw Gone(fmt::format("the fork server (pid {}) is gone: {}", pid_, std::strerror(errno)));
  pollfd p{requests_.get(), POLLIN, 0};
  int ready;
  while ((ready = ::poll(&p, 1, kReplyTimeoutMs)) < 0 && errno == EINTR) {
  }
  Reply reply;
  ssize_t n = -1;
  if (ready > 0) {
    while ((n = ::recv(requests_.get(), &reply, sizeof reply, 0)) < 0 && errno == EINTR) {
    }
  }
  if (n == 0) throw Gone(fmt::format("the fork server (pid {}) is gone", pid_));
  if (n != static_cast<ssize_t>(sizeof reply)) {
    // It may still fork this process: it must not be spawned beside it, and the server serves
    // no more (and kills what it forked).
    stop_serving();
    throw Error(fmt::format("the workers' fork server (pid {}) did not answer in {} s", pid_,
                            kReplyTimeoutMs / 1000));
  }
  if (reply.error) return std::nullopt;  // nothing forked: spawning says why
  ++forks_;
  return Forked{reply.pid, reply.pgid};
}

bool ForkServer::read_reports(const std::function<void(pid_t, int)>& on_exit) {
  for (;;) {
    Report r;
    const ssize_t n = ::recv(reports_.get(), &r, sizeof r, MSG_DONTWAIT);
    if (n == static_cast<ssize_t>(sizeof r)) {
      on_exit(r.pid, r.status);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    reports_open_ = false;
    return false;
  }
}

}  // namespace twinkle::core
