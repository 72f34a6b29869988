#include "core/runtime/run_dir.hpp"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "transports/zmq/channel.hpp"
#include "twinkle/errors.hpp"

namespace twinkle::core {

namespace {

constexpr const char* kPrefix = "twinkle-run.";
constexpr const char* kOwnerFile = "driver";
// The longest socket name the runtime puts in the folder ("ctl", "kv").
constexpr std::size_t kLongestSocketName = 8;

// Field 22 of /proc/PID/stat: the process's start time, which tells a reused pid apart.
std::string start_time(pid_t pid) {
  std::ifstream in(fmt::format("/proc/{}/stat", pid));
  std::string stat;
  std::getline(in, stat);
  const auto close = stat.rfind(')');
  if (close == std::string::npos) return "";
  std::istringstream rest(stat.substr(close + 2));
  std::string field;
  for (int i = 3; i <= 22 && rest >> field; ++i) {
  }
  return field;
}

std::filesystem::path temp_parent() {
  const char* tmp = std::getenv("TMPDIR");
  std::filesystem::path parent = tmp && *tmp ? tmp : "/tmp";
  // mkdtemp's template, then "/" and a socket name, must fit a socket address.
  const std::size_t need =
      parent.string().size() + 1 + std::strlen(kPrefix) + 8 + 7 + 1 + kLongestSocketName;
  if (need > transport::kMaxSocketPath) return "/tmp";
  return parent;
}

}  // namespace

RunDir::RunDir(const std::string& run_id) {
  const std::filesystem::path parent = temp_parent();
  remove_stale(parent);
  std::string templ = (parent / fmt::format("{}{}.XXXXXX", kPrefix, run_id)).string();
  if (!::mkdtemp(templ.data())) {
    throw Error(fmt::format("cannot create the run folder {}: {}; set TMPDIR to a writable folder",
                            templ, std::strerror(errno)));
  }
  path_ = templ;
  std::ofstream owner(path_ / kOwnerFile);
  owner << ::getpid() << ' ' << start_time(::getpid()) << '\n';
}

RunDir::~RunDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

int RunDir::remove_stale(const std::filesystem::path& parent) {
  int removed = 0;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(parent, ec), end; !ec && it != end;
       it.increment(ec)) {
    const auto name = it->path().filename().string();
    if (!name.starts_with(kPrefix) || !it->is_directory(ec)) continue;
    std::ifstream owner(it->path() / kOwnerFile);
    pid_t pid = 0;
    std::string started;
    if (!(owner >> pid >> started) || pid <= 0) continue;  // not ours, or still being made
    const bool alive = (::kill(pid, 0) == 0 || errno == EPERM) && start_time(pid) == started;
    if (alive) continue;
    std::error_code rm;
    std::filesystem::remove_all(it->path(), rm);
    removed += !rm;
  }
  return removed;
}

}  // namespace twinkle::core
