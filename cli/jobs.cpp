#include <fcntl.h>
#include <pwd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>

#include <chrono>
#include <ctime>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/cluster_flags.hpp"
#include "cli/commands.hpp"
#include "cli/exit_codes.hpp"
#include "core/cluster/head_link.hpp"
#include "core/job/job.hpp"
#include "core/job/json_value.hpp"
#include "core/job/resources.hpp"
#include "core/job/size.hpp"
#include "core/job/topology.hpp"
#include "core/jobs/archive.hpp"
#include "core/jobs/supervisor.hpp"
#include "twinkle/errors.hpp"

// The job service's commands (docs/ARCHITECTURE.md, Job service): submit, jobs, job show, logs,
// stop, and the supervisor a head runs each submitted driver under.
namespace twinkle::cli {

namespace {

using core::to_json;

namespace fs = std::filesystem;
namespace proto = transport::proto;
using core::cluster::Message;

constexpr auto kRequestTimeout = std::chrono::seconds(30);
constexpr std::size_t kUploadPiece = 4 << 20;
constexpr auto kFollowPoll = std::chrono::milliseconds(100);

// Where the head is: --address, else TWINKLE_ADDRESS, else the head of this machine (a job file's
// address is not used: a submitted job runs where it is sent).
std::string head_address(const ClusterFlags& f) {
  const std::string a = f.resolve();
  return a.empty() ? "tcp://127.0.0.1:7100" : a;
}

std::string local_user() {
  const passwd* pw = getpwuid(getuid());
  return pw ? pw->pw_name : std::to_string(getuid());
}

std::string host_name() {
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  return host;
}

class Client {
 public:
  explicit Client(const ClusterFlags& f) : address_(head_address(f)), link_(connect(f)) {}

  template <class Answer, class Ask>
  Answer ask(Ask body) {
    return link_->request<Answer>(Message{++id_, std::move(body)}, kRequestTimeout);
  }
  const std::string& address() const { return address_; }

 private:
  std::unique_ptr<core::cluster::HeadLink> connect(const ClusterFlags& f) const {
    try {
      return std::make_unique<core::cluster::HeadLink>(
          address_, core::cluster::member_security(f.keys, address_),
          fmt::format("client/{:08x}{:08x}", std::random_device{}(), std::random_device{}()));
    } catch (const TransportError& e) {
      if (!f.resolve().empty()) throw;
      throw TransportError(fmt::format(
          "{} With no --address and no TWINKLE_ADDRESS that is the head of this machine: start "
          "one with `twinkle node start --head`, or give the cluster's address",
          e.what()));
    }
  }

  std::string address_;
  std::unique_ptr<core::cluster::HeadLink> link_;
  std::uint64_t id_ = 0;
};

std::string when(std::int64_t t) {
  if (t == 0) return "-";
  const std::time_t tt = static_cast<std::time_t>(t);
  char buf[32];
  std::strftime(buf, sizeof buf, "%m-%d %H:%M:%S", std::localtime(&tt));
  return buf;
}

std::string duration(const proto::JobEntry& j) {
  if (j.started == 0) return "-";
  const std::int64_t end = j.ended ? j.ended : static_cast<std::int64_t>(std::time(nullptr));
  const std::int64_t s = std::max<std::int64_t>(0, end - j.started);
  if (s < 3600) return fmt::format("{}:{:02}", s / 60, s % 60);
  return fmt::format("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60);
}

std::int64_t parse_job_id(const std::string& text) {
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || v <= 0)
    throw ConfigError(
        fmt::format("\"{}\" is not a job id (a number, as `twinkle jobs` shows)", text));
  return v;
}

// ----- logs -----------------------------------------------------------------------------------

struct LogsOptions {
  std::string job;
  bool follow = false;
  std::string rank, grep;
  bool driver = false;
  int tail = 0;
  ClusterFlags cluster;
};

// Prints the job's log; with `follow`, until the job ends.
void print_logs(Client& c, const LogsOptions& o, std::int64_t id) {
  proto::LogsQuery q;
  q.job = id;
  q.rank = o.rank;
  q.driver = o.driver;
  q.grep = o.grep;
  q.tail = o.tail;
  for (;;) {
    const auto chunk = c.ask<proto::LogsChunk>(q);
    if (chunk.error) throw Error(*chunk.error);
    std::fwrite(chunk.text.data(), 1, chunk.text.size(), stdout);
    std::fflush(stdout);
    q.offset = chunk.offset;
    q.tail = 0;
    if (chunk.more) continue;
    if (!o.follow || chunk.ended) return;
    std::this_thread::sleep_for(kFollowPoll);
  }
}

int run_logs(const LogsOptions& o) {
  if (!o.rank.empty() && o.rank.find(':') == std::string::npos)
    throw ConfigError(fmt::format("--rank {}: give GROUP:N, e.g. model:2", o.rank));
  if (!o.rank.empty() && o.driver)
    throw ConfigError("--rank and --driver: a line is a worker's or the driver's; give one");
  Client c(o.cluster);
  print_logs(c, o, parse_job_id(o.job));
  return kExitOk;
}

proto::JobEntry show_entry(Client& c, std::int64_t id) {
  proto::JobsQuery q;
  q.job = id;
  auto info = c.ask<proto::JobsInfo>(q);
  if (info.error) throw Error(*info.error);
  if (info.jobs.empty()) throw Error(fmt::format("the head sent no job {}", id));
  return info.jobs.front();
}

// ----- submit ---------------------------------------------------------------------------------

struct SubmitOptions {
  std::string job_file;
  std::vector<std::string> overrides;
  std::string name, working_dir, after;
  int max_retries = 0;
  int priority = 0;
  bool wait = false, json = false;
  std::string max_upload = "1GiB";
  ClusterFlags cluster;
};

// --max-upload: "512MiB", "2GiB", "100M", "4096" (bytes).
std::uint64_t upload_limit(const std::string& text) {
  const auto bytes = core::parse_size(text);
  if (!bytes)
    throw ConfigError(fmt::format("--max-upload {}: give a size such as 512MiB or 2GiB", text));
  return *bytes;
}

int exit_of(const proto::JobEntry& j) {
  if (j.state == "SUCCEEDED") return kExitOk;
  if (j.exit_code && *j.exit_code != 0) return *j.exit_code;
  return kExitJobFailed;
}

int run_submit(const SubmitOptions& o) {
  const fs::path job_file = fs::absolute(o.job_file);
  const fs::path work =
      fs::absolute(o.working_dir.empty() ? job_file.parent_path() : fs::path(o.working_dir))
          .lexically_normal();
  const fs::path rel = job_file.lexically_normal().lexically_relative(work);
  if (rel.empty() || *rel.begin() == "..") {
    throw ConfigError(
        fmt::format("{} is not inside the working directory {}: the job file travels with it; pass "
                    "--working-dir with a folder that holds it",
                    o.job_file, work.string()));
  }
  // Checked here first, so that a mistake is told with its line before anything is uploaded.
  std::vector<core::Override> overrides;
  for (const auto& s : o.overrides) overrides.push_back(core::parse_override(s));
  overrides.push_back(core::Override{"job.mode", "remote"});
  const core::Job job = core::load_job(job_file, overrides);
  std::optional<proto::AfterEntry> after;
  if (!o.after.empty()) {
    const auto colon = o.after.find(':');
    after = proto::AfterEntry{parse_job_id(o.after.substr(0, colon)),
                              colon == std::string::npos ? "ok" : o.after.substr(colon + 1)};
    if (after->condition != "ok" && after->condition != "notok" && after->condition != "any")
      throw ConfigError(fmt::format("--after {}: the condition is ok, notok or any", o.after));
  }
  const fs::path plugin_rel = job.plugin_path.lexically_normal().lexically_relative(work);
  if (plugin_rel.empty() || *plugin_rel.begin() == "..") {
    if (!fs::path(job.plugin).is_absolute()) {
      throw ConfigError(fmt::format(
          "{}: job.plugin \"{}\" leads out of the working directory {}, which is all that "
          "travels with the job; put the plugin inside it, give an absolute path that exists on "
          "the head's machine, or pass --working-dir",
          o.job_file, job.plugin, work.string()));
    }
    fmt::print(stderr,
               "twinkle: note: the plugin {} is outside the working directory {}: it does not "
               "travel with the job, and must be at that path on the head's machine\n",
               job.plugin_path.string(), work.string());
  }
  const auto packed = core::jobs::pack_dir(work, upload_limit(o.max_upload));

  Client c(o.cluster);
  proto::UploadCheck check{packed.sha256, static_cast<std::int64_t>(packed.bytes.size())};
  auto st = c.ask<proto::UploadState>(check);
  if (st.error) throw Error(fmt::format("the head refused the working directory: {}", *st.error));
  const bool uploaded = !st.have;
  for (std::size_t at = 0; !st.have;) {
    proto::UploadPart part = core::jobs::upload_piece(packed, at, kUploadPiece);
    at += part.bytes.data.size();
    st = c.ask<proto::UploadState>(std::move(part));
    if (st.error) throw Error(fmt::format("the upload failed: {}", *st.error));
    if (at == packed.bytes.size() && !st.have)
      throw Error("the head did not take the whole upload; submit again");
  }
  proto::Submit s;
  s.name = o.name;
  s.job_file = rel.string();
  s.sha256 = packed.sha256;
  s.overrides = o.overrides;
  s.max_retries = o.max_retries;
  s.after = after;
  s.priority = o.priority;
  s.user = local_user();
  s.from = host_name();
  const auto answer = c.ask<proto::JobAnswer>(s);
  if (answer.error) throw ConfigError(fmt::format("the head refused the job: {}", *answer.error));
  if (o.json) {
    fmt::print("{}\n", nlohmann::json{{"id", answer.job},
                                      {"name", o.name.empty() ? job.name : o.name},
                                      {"sha256", packed.sha256},
                                      {"bytes", packed.bytes.size()},
                                      {"uploaded", uploaded}}
                           .dump());
  } else {
    fmt::print("{} ({} files, {}, sha256 {}: {})\n", answer.text, packed.files,
               core::format_bytes(packed.bytes.size()), packed.sha256.substr(0, 12),
               uploaded ? "uploaded" : "the head had it already");
    if (!o.wait) {
      fmt::print("follow it with `twinkle logs {0} -f`; stop it with `twinkle stop {0}`\n",
                 answer.job);
    }
  }
  std::fflush(stdout);
  if (!o.wait) return kExitOk;
  LogsOptions lo;
  lo.follow = true;
  print_logs(c, lo, answer.job);
  const auto j = show_entry(c, answer.job);
  fmt::print(stderr, "twinkle: job {} {}: {}\n", j.id, j.state, j.reason);
  return exit_of(j);
}

// ----- jobs, job show, stop ---------------------------------------------------------------------

struct JobsOptions {
  bool all = false, json = false;
  std::string user, state;
  ClusterFlags cluster;
};

int run_jobs(const JobsOptions& o) {
  static const std::vector<std::string> states = {"QUEUED", "RUNNING", "PREEMPTED", "SUCCEEDED",
                                                  "FAILED", "STOPPED", "DROPPED",   "ENDED"};
  std::string state = o.state;
  for (auto& ch : state) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  if (!state.empty() && std::find(states.begin(), states.end(), state) == states.end())
    throw ConfigError(
        fmt::format("--state {}: one of QUEUED, RUNNING, PREEMPTED, SUCCEEDED, FAILED, "
                    "STOPPED, DROPPED, ENDED",
                    o.state));
  Client c(o.cluster);
  proto::JobsQuery q;
  q.all = o.all;
  q.user = o.user;
  q.state = state;
  const auto info = c.ask<proto::JobsInfo>(q);
  if (info.error) throw Error(*info.error);
  if (o.json) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& j : info.jobs) out.push_back(to_json(proto::to_value(j)));
    fmt::print("{}\n", out.dump(2));
    return kExitOk;
  }
  // The TEAM column only where there are teams: a cluster of one team has nothing to show there.
  const bool teams = std::any_of(info.jobs.begin(), info.jobs.end(),
                                 [](const proto::JobEntry& j) { return j.team != "default"; });
  auto user_of = [&](const proto::JobEntry& j) {
    return teams ? fmt::format("{:<12} {:<10}", j.user, j.team) : fmt::format("{:<12}", j.user);
  };
  fmt::print("{:>5}  {:<16} {} {:<10} {:>5} {:>4}  {:<14} {:<14} {:>9} {:>7} {:>4}\n", "ID", "NAME",
             teams ? fmt::format("{:<12} {:<10}", "USER", "TEAM") : "USER        ", "STATE",
             "NODES", "GPUS", "SUBMITTED", "STARTED", "DURATION", "RETRIES", "EXIT");
  for (const auto& j : info.jobs) {
    fmt::print("{:>5}  {:<16} {} {:<10} {:>5} {:>4}  {:<14} {:<14} {:>9} {:>7} {:>4}\n", j.id,
               j.name + (j.kind == "interactive" ? "*" : ""), user_of(j), j.state, j.nodes, j.gpus,
               when(j.submitted), when(j.started), duration(j),
               j.kind == "interactive" ? std::string("-") : std::to_string(j.retries),
               j.exit_code ? std::to_string(*j.exit_code) : std::string("-"));
    // Why it waits; for one that borrows, that it does.
    if ((j.state == "QUEUED" || j.state == "PREEMPTED" || j.state == "RUNNING") &&
        !j.reason.empty())
      fmt::print("       {}\n", j.reason);
  }
  if (std::any_of(info.jobs.begin(), info.jobs.end(),
                  [](const proto::JobEntry& j) { return j.kind == "interactive"; }))
    fmt::print("* an interactive `twinkle run --address`\n");
  if (!o.all) fmt::print("(active jobs and the newest 20 others; --all for the whole history)\n");
  return kExitOk;
}

// The job's topology as `twinkle topology` draws it, from its job file and where its ranks ran;
// nullopt for an interactive run or one not placed yet.
std::optional<std::string> topology_of(const proto::JobEntry& e) {
  if (!e.job_text || e.placement.empty()) return std::nullopt;
  try {
    std::vector<core::Override> overrides;
    for (const auto& s : e.overrides) overrides.push_back(core::parse_override(s));
    overrides.push_back(core::Override{"job.mode", "remote"});
    const core::Job job = core::parse_job(*e.job_text, e.job_file, overrides);
    core::Placement p;
    std::map<std::string, int> node_index;
    for (const auto& g : job.groups) {
      core::GroupPlacement gp;
      gp.group = &g;
      for (const auto& r : e.placement) {
        if (r.group != g.name) continue;
        if (r.rank < 0 || static_cast<std::size_t>(r.rank) >= g.ranks.size()) return std::nullopt;
        auto [it, fresh] = node_index.emplace(r.node, static_cast<int>(p.nodes.size()));
        if (fresh) {
          core::NodeSlot slot;
          slot.id = slot.host = r.node;
          p.nodes.push_back(std::move(slot));
        }
        gp.workers.push_back(core::WorkerPlacement{g.ranks[static_cast<std::size_t>(r.rank)],
                                                   r.rank, it->second, r.gpus});
      }
      if (gp.workers.size() != g.ranks.size()) return std::nullopt;
      p.groups.push_back(std::move(gp));
    }
    return core::render_topology(job, p);
  } catch (const std::exception&) {
    return std::nullopt;  // a job file this build reads differently: the placement lines remain
  }
}

struct ShowOptions {
  std::string job;
  bool json = false;
  ClusterFlags cluster;
};

int run_show(const ShowOptions& o) {
  Client c(o.cluster);
  const auto j = show_entry(c, parse_job_id(o.job));
  if (o.json) {
    fmt::print("{}\n", to_json(proto::to_value(j)).dump(2));
    return kExitOk;
  }
  fmt::print("job {} ({}): {}{}\n", j.id, j.name, j.state,
             j.reason.empty() ? "" : " - " + j.reason);
  fmt::print("  kind       {}\n",
             j.kind == "interactive" ? "interactive (twinkle run --address)" : "submitted");
  fmt::print("  user       {}{}\n", j.user, j.from.empty() ? "" : " from " + j.from);
  fmt::print("  team       {}{}{}\n", j.team,
             j.priority ? fmt::format(", priority {}", j.priority) : "",
             j.preemptible ? "" : ", preemptible = false");
  if (j.preemptions) {
    fmt::print("  preempted  {} time{}, last for job {}\n", j.preemptions,
               j.preemptions == 1 ? "" : "s", j.preempted_by);
  }
  if (!j.job_file.empty()) fmt::print("  job file   {}\n", j.job_file);
  for (const auto& s : j.overrides) fmt::print("  --set      {}\n", s);
  if (j.after) fmt::print("  after      job {} ({})\n", j.after->job, j.after->condition);
  fmt::print("  submitted  {}\n  started    {}\n  ended      {}\n  duration   {}\n",
             when(j.submitted), when(j.started), when(j.ended), duration(j));
  if (j.kind == "submitted") {
    fmt::print("  retries    {} of {}\n", j.retries, j.max_retries);
    fmt::print("  driver     {}\n", j.driver_node.empty() ? std::string("on the head's machine")
                                                          : "on node " + j.driver_node);
  }
  if (j.restarts)
    fmt::print("  restarts   {} (groups restarted after a lost worker)\n", j.restarts);
  if (j.exit_code) fmt::print("  exit code  {}\n", *j.exit_code);
  if (!j.stopped_by.empty()) fmt::print("  stopped by {}\n", j.stopped_by);
  fmt::print("  devices    {} node(s), {} CPU(s), {} GPU(s); {:.0f} GPU-seconds\n", j.nodes, j.cpus,
             j.gpus, j.gpu_seconds);
  if (auto topology = topology_of(j)) fmt::print("{}", *topology);
  if (!j.placement.empty()) {
    fmt::print("placement (run {}):\n", j.run);
    for (const auto& p : j.placement) {
      fmt::print("  {:<12} node {}{}\n", fmt::format("{}:{}", p.group, p.rank), p.node,
                 p.gpus.empty() ? "" : fmt::format(", gpu {}", fmt::join(p.gpus, ",")));
    }
  }
  if (!j.audit.empty()) {
    fmt::print("audit:\n");
    for (const auto& a : j.audit) {
      fmt::print("  {}  {:<12} {:<12}{}{}\n", when(a.time), a.user, a.action,
                 a.from.empty() ? "" : " from " + a.from, a.detail.empty() ? "" : "  " + a.detail);
    }
  }
  if (!j.summary.empty()) {
    fmt::print("last lines of its log:\n");
    for (const auto& l : j.summary) fmt::print("  {}\n", l);
  }
  return kExitOk;
}

struct StopOptions {
  std::string job;
  bool now = false;
  ClusterFlags cluster;
};

int run_stop(const StopOptions& o) {
  Client c(o.cluster);
  proto::JobStop s;
  s.job = parse_job_id(o.job);
  s.now = o.now;
  s.user = local_user();
  s.from = host_name();
  const auto a = c.ask<proto::JobAnswer>(s);
  if (a.error) throw Error(*a.error);
  fmt::print("{}\n", a.text);
  return kExitOk;
}

struct ResumeOptions {
  std::string job;
  ClusterFlags cluster;
};

int run_resume(const ResumeOptions& o) {
  Client c(o.cluster);
  proto::JobResume r;
  r.job = parse_job_id(o.job);
  r.user = local_user();
  r.from = host_name();
  const auto a = c.ask<proto::JobAnswer>(r);
  if (a.error) throw Error(*a.error);
  fmt::print("{}\n", a.text);
  return kExitOk;
}

// ----- quotas -----------------------------------------------------------------------------------

struct QuotasOptions {
  bool json = false;
  bool reload = false;
  ClusterFlags cluster;
};

// "3 / 4": what a team uses of a quota ("3 / -" without a limit).
std::string of_quota(int used, const std::optional<int>& quota) {
  return fmt::format("{} / {}", used, quota ? std::to_string(*quota) : std::string("-"));
}

int run_quotas(const QuotasOptions& o) {
  Client c(o.cluster);
  proto::QuotasQuery q;
  q.reload = o.reload;
  q.user = local_user();
  q.from = host_name();
  const auto info = c.ask<proto::QuotasInfo>(q);
  if (info.error) throw Error(*info.error);
  if (o.json) {
    fmt::print("{}\n", to_json(proto::to_value(info)).dump(2));
    return kExitOk;
  }
  if (!info.text.empty()) fmt::print("{}\n", info.text);
  if (info.file.empty()) {
    fmt::print(
        "no quotas file (start the head with --quotas FILE): no team has a limit; fair "
        "share still orders the queue\n");
  } else {
    fmt::print("quotas from {}; fair share over a half-life of {:g} h\n", info.file,
               info.half_life_s / 3600);
  }
  fmt::print("{:<14} {:>9} {:>9} {:>9} {:>9} {:>6} {:>8} {:>8} {:>8} {:>8}  {}\n", "TEAM", "GPUS",
             "BORROWED", "CPUS", "BORROWED", "WEIGHT", "GPU-H", "CPU-H", "RUNNING", "WAITING",
             "MEMBERS");
  for (const auto& t : info.teams) {
    fmt::print("{:<14} {:>9} {:>9} {:>9} {:>9} {:>6g} {:>8.2f} {:>8.2f} {:>8} {:>8}  {}{}\n",
               t.name + (t.listed ? "" : "*"), of_quota(t.used_gpus, t.gpus),
               fmt::format("{} / {}", t.borrowed_gpus, t.borrow_gpus),
               of_quota(t.used_cpus, t.cpus),
               fmt::format("{} / {}", t.borrowed_cpus, t.borrow_cpus), t.weight,
               t.gpu_seconds / 3600, t.cpu_seconds / 3600, t.running, t.waiting,
               fmt::join(t.members, ", "), t.members.empty() ? "-" : "");
  }
  fmt::print(
      "(GPUS, CPUS: used / quota, - for no limit; BORROWED: beyond the quota / the most it "
      "may borrow; GPU-H, CPU-H: past use, decayed, that fair share weighs, GPUs first{})\n",
      std::any_of(info.teams.begin(), info.teams.end(),
                  [](const proto::TeamEntry& t) { return !t.listed; })
          ? "; * not in the quotas file: the default team's numbers"
          : "");
  return kExitOk;
}

// ----- dashboard --------------------------------------------------------------------------------

struct DashboardOptionsCli {
  ClusterFlags cluster;
  bool no_open = false;
};

// Hands `url` to the desktop's browser (xdg-open) when there is a desktop and xdg-open: true
// when it was handed. xdg-open runs as a grandchild (reparented, never waited for, its output
// dropped): a browser that keeps xdg-open waiting does not keep this command.
bool open_in_browser(const std::string& url) {
  const char* display = std::getenv("DISPLAY");
  const char* wayland = std::getenv("WAYLAND_DISPLAY");
  if ((!display || !*display) && (!wayland || !*wayland)) return false;
  std::string exe;
  const char* path = std::getenv("PATH");
  for (std::string_view rest = path ? path : ""; exe.empty() && !rest.empty();) {
    const auto colon = rest.find(':');
    const std::string dir(rest.substr(0, colon));
    rest = colon == std::string_view::npos ? std::string_view() : rest.substr(colon + 1);
    const std::string candidate = (dir.empty() ? std::string(".") : dir) + "/xdg-open";
    if (::access(candidate.c_str(), X_OK) == 0) exe = candidate;
  }
  if (exe.empty()) return false;
  const pid_t child = ::fork();
  if (child < 0) return false;
  if (child == 0) {
    if (::fork() == 0) {
      ::setsid();
      const int null = ::open("/dev/null", O_RDWR | O_CLOEXEC);
      if (null >= 0) {
        ::dup2(null, 0);
        ::dup2(null, 1);
        ::dup2(null, 2);
      }
      ::execl(exe.c_str(), exe.c_str(), url.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    ::_exit(0);
  }
  int status = 0;
  while (::waitpid(child, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

// Asks the head for a one-time login link to its dashboard, as this member (its key's name).
int run_dashboard(const DashboardOptionsCli& o) {
  Client c(o.cluster);
  proto::DashboardLink l;
  l.user = local_user();
  const auto g = c.ask<proto::DashboardGrant>(l);
  if (g.error) throw Error(*g.error);
  fmt::print(
      "Open this link in a browser on the head's machine (or through `ssh -L`); it logs "
      "you in once, within a minute:\n{}\n",
      g.url);
  // Opening it spends nothing: the link asks before it logs in.
  if (!o.no_open && open_in_browser(g.url))
    fmt::print("(handed to your browser with xdg-open; --no-open does not)\n");
  return kExitOk;
}

// --address (the job service's default: this machine's head) and the keys.
void add_job_flags(CLI::App* sub, ClusterFlags& f) {
  sub->add_option("--address", f.address,
                  "The cluster's head, tcp://HOST:PORT (default: TWINKLE_ADDRESS, else "
                  "tcp://127.0.0.1:7100)");
  add_cluster_flags(sub, f, false);
}

}  // namespace

void setup_jobs(CLI::App& app, Action& action) {
  auto so = std::make_shared<SubmitOptions>();
  auto* submit = app.add_subcommand(
      "submit", "Queue a job on a cluster: it runs there, without this terminal");
  submit->add_option("job", so->job_file, "The job file (TOML)")->required();
  submit->add_option("--set", so->overrides, "Override a job file value: SECTION.KEY=VALUE")
      ->allow_extra_args(false);
  submit->add_option("--name", so->name, "The job's name in `twinkle jobs` (default job.name)");
  submit->add_option("--working-dir", so->working_dir,
                     "The folder that travels with the job (default: the job file's folder; "
                     ".twinkleignore globs are left out)");
  submit
      ->add_option("--max-retries", so->max_retries,
                   "Start a failed driver again up to N times (from its newest checkpoint when "
                   "the job has a checkpoint_dir; exit 2, 3 and 75 are not retried)")
      ->check(CLI::Range(0, 100));
  submit
      ->add_option("--priority", so->priority,
                   "Its place among its team's queued jobs: higher first (default 0; the quotas "
                   "file bounds it per team, 10 by default)")
      ->check(CLI::Range(-1000, 1000));
  submit->add_option("--after", so->after,
                     "Run only after job ID ends: ID[:ok|notok|any] (default ok: succeeded)");
  submit->add_flag("--wait", so->wait, "Follow its log and exit with its exit code");
  submit->add_option("--max-upload", so->max_upload,
                     "Refuse a working directory larger than this (default 1GiB)");
  submit->add_flag("--json", so->json, "Print the job id and upload as JSON");
  add_job_flags(submit, so->cluster);
  submit->callback([so, &action] { action = [so] { return run_submit(*so); }; });

  auto jo = std::make_shared<JobsOptions>();
  auto* jobs = app.add_subcommand("jobs", "List a cluster's jobs: queued, running and ended");
  jobs->add_flag("--all", jo->all, "The whole history, not only active and recent jobs");
  jobs->add_option("--user", jo->user, "Only this member's jobs");
  jobs->add_option("--state", jo->state, "Only jobs in this state (QUEUED, RUNNING, ...)");
  jobs->add_flag("--json", jo->json, "Print JSON");
  add_job_flags(jobs, jo->cluster);
  jobs->callback([jo, &action] { action = [jo] { return run_jobs(*jo); }; });

  auto* job = app.add_subcommand("job", "One job of a cluster");
  job->require_subcommand(1);
  auto sh = std::make_shared<ShowOptions>();
  auto* show = job->add_subcommand("show", "A job's state, placement, audit and last lines");
  show->add_option("id", sh->job, "The job's id")->required();
  show->add_flag("--json", sh->json, "Print JSON");
  add_job_flags(show, sh->cluster);
  show->callback([sh, &action] { action = [sh] { return run_show(*sh); }; });

  auto lo = std::make_shared<LogsOptions>();
  auto* logs = app.add_subcommand("logs", "A submitted job's log: its driver's and workers' lines");
  logs->add_option("id", lo->job, "The job's id")->required();
  logs->add_flag("-f,--follow", lo->follow, "Go on printing until the job ends");
  logs->add_option("--rank", lo->rank, "Only this worker's lines: GROUP:N");
  logs->add_flag("--driver", lo->driver, "Only the driver's own lines");
  logs->add_option("--grep", lo->grep, "Only lines that match this regular expression");
  logs->add_option("--tail", lo->tail, "Only the last N lines")->check(CLI::Range(1, 1000000));
  add_job_flags(logs, lo->cluster);
  logs->callback([lo, &action] { action = [lo] { return run_logs(*lo); }; });

  auto sto = std::make_shared<StopOptions>();
  auto* stop = app.add_subcommand("stop", "Stop a job: the graceful path, or --now");
  stop->add_option("id", sto->job, "The job's id")->required();
  stop->add_flag("--now", sto->now, "Kill its driver and workers at once");
  add_job_flags(stop, sto->cluster);
  stop->callback([sto, &action] { action = [sto] { return run_stop(*sto); }; });

  auto ro = std::make_shared<ResumeOptions>();
  auto* resume = app.add_subcommand(
      "resume", "Queue a STOPPED or FAILED job again, to go on from its newest checkpoint");
  resume->add_option("id", ro->job, "The job's id")->required();
  add_job_flags(resume, ro->cluster);
  resume->callback([ro, &action] { action = [ro] { return run_resume(*ro); }; });

  auto qo = std::make_shared<QuotasOptions>();
  auto* quotas =
      app.add_subcommand("quotas", "Each team's quota, use, borrowing and fair share on a cluster");
  quotas->add_flag("--json", qo->json, "Print JSON");
  add_job_flags(quotas, qo->cluster);
  auto* reload = quotas->add_subcommand(
      "reload", "Read the head's quotas file again (an admin's; as SIGHUP to the head)");
  add_job_flags(reload, qo->cluster);
  reload->add_flag("--json", qo->json, "Print JSON");
  reload->callback([qo] { qo->reload = true; });
  quotas->callback([qo, &action] { action = [qo] { return run_quotas(*qo); }; });

  auto dash = std::make_shared<DashboardOptionsCli>();
  auto* dashboard =
      app.add_subcommand("dashboard", "Log in to the head's web dashboard: prints a one-time link");
  add_job_flags(dashboard, dash->cluster);
  dashboard->add_flag("--no-open", dash->no_open,
                      "Only print the link (by default it also goes to xdg-open where there is "
                      "a desktop: DISPLAY or WAYLAND_DISPLAY)");
  dashboard->callback([dash, &action] { action = [dash] { return run_dashboard(*dash); }; });

  auto sv = std::make_shared<core::jobs::SuperviseOptions>();
  auto* sup = app.add_subcommand("supervise", "Internal: runs a submitted job's driver");
  sup->group("");  // started by the head, never by hand
  sup->add_option("--job-dir", sv->job_dir)->required();
  sup->add_option("--work-dir", sv->work_dir)->required();
  sup->add_option("--max-retries", sv->max_retries);
  sup->add_option("--log-cap", sv->log_cap);
  sup->add_option("--stop-grace", sv->stop_grace_s);
  sup->add_flag("--resume-on-retry", sv->resume_on_retry);
  sup->add_option("--user", sv->user, "The Unix account the driver runs as (the head's --run-as)");
  sup->add_option("command", sv->argv)->required();
  sup->callback([sv, &action] { action = [sv] { return core::jobs::supervise(*sv); }; });
}

}  // namespace twinkle::cli
