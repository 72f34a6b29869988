#include "core/runtime/run_dir.hpp"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>
#include <string_view>

#include <fmt/format.h>

#include "transports/zmq/channel.hpp"
#include "twinkle/errors.hpp"

namespace twinkle::core {

namespace {

constexpr std::string_view kPrefix = "twinkle-run.";
// mkdtemp's random part, the last field of the name.
constexpr std::string_view kRandom = "XXXXXX";
// The longest fixed socket name the runtime puts in the folder ("kv").
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

std::filesystem::path temp_parent(std::size_t name_size) {
  const char* tmp = std::getenv("TMPDIR");
  std::filesystem::path parent = tmp && *tmp ? tmp : "/tmp";
  // The folder's name, then "/" and a socket name, must fit a socket address.
  const std::size_t need = parent.string().size() + 1 + name_size + 1 + kLongestSocketName;
  if (need > transport::kMaxSocketPath) return "/tmp";
  return parent;
}

// Cuts the last dot-separated field off `rest` and returns it; nullopt when `rest` has no dot.
std::optional<std::string_view> pop_field(std::string_view& rest) {
  const auto dot = rest.rfind('.');
  if (dot == std::string_view::npos) return std::nullopt;
  const std::string_view field = rest.substr(dot + 1);
  rest = rest.substr(0, dot);
  return field;
}

bool is_number(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

struct Owner {
  pid_t pid = 0;
  std::string_view started;  // in the name it was read from
};

// The driver that a run folder's name, twinkle-run.ID.PID.START.XXXXXX, names; nullopt for a name
// of another form. Read from the right, since only the run id may hold dots.
std::optional<Owner> owner_of(std::string_view name) {
  if (!name.starts_with(kPrefix)) return std::nullopt;
  std::string_view rest = name.substr(kPrefix.size());
  const auto random = pop_field(rest);
  const auto started = pop_field(rest);
  const auto pid = pop_field(rest);
  if (!random || !started || !pid || !is_number(*started) || !is_number(*pid)) return std::nullopt;
  Owner owner{0, *started};
  const auto parsed = std::from_chars(pid->data(), pid->data() + pid->size(), owner.pid);
  if (parsed.ec != std::errc() || owner.pid <= 0) return std::nullopt;
  return owner;
}

}  // namespace

RunDir::RunDir(const std::string& run_id) {
  // The owner is in the name that mkdtemp creates, so that no moment exists in which the folder
  // is there and a later run could not tell whether its driver is gone.
  const std::string name =
      fmt::format("{}{}.{}.{}.{}", kPrefix, run_id, ::getpid(), start_time(::getpid()), kRandom);
  const std::filesystem::path parent = temp_parent(name.size());
  remove_stale(parent);
  std::string templ = (parent / name).string();
  if (!::mkdtemp(templ.data())) {
    throw Error(fmt::format("cannot create the run folder {}: {}; set TMPDIR to a writable folder",
                            templ, std::strerror(errno)));
  }
  path_ = templ;
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
    const std::string name = it->path().filename().string();
    const auto owner = owner_of(name);
    if (!owner || !it->is_directory(ec)) continue;
    const bool alive =
        (::kill(owner->pid, 0) == 0 || errno == EPERM) && start_time(owner->pid) == owner->started;
    if (alive) continue;
    std::error_code rm;
    std::filesystem::remove_all(it->path(), rm);
    removed += !rm;
  }
  return removed;
}

}  // namespace twinkle::core
