#include "core/cluster/agent.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sodium.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <future>
#include <mutex>
#include <thread>
#include <tuple>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/cluster/head_link.hpp"
#include "core/job/digest.hpp"
#include "core/job/resources.hpp"
#include "core/job/size.hpp"
#include "core/job/unix_time.hpp"
#include "core/job/values.hpp"
#include "core/jobs/archive.hpp"
#include "core/jobs/supervisor.hpp"
#include "core/runtime/cgroup.hpp"
#include "core/runtime/spawner.hpp"
#include "transports/zmq/curve.hpp"
#include "twinkle/errors.hpp"

extern char** environ;

namespace twinkle::core::cluster {

namespace {

// One run's workers on this node.
struct Job {
  std::string run, job, owner;
  std::string user;  // the member it runs for (the head's word)
  std::int64_t since = 0;
  std::vector<int> gpus;
  int cpus = 0;
  std::int64_t memory = 0;  // its workers' memory limits, summed
  proto::Launch launch;     // the launch request, kept until its plugin is here
  // Its workers' cgroups (none where cgroups are not usable); declared before the spawner, so
  // that the workers are reaped before their folders go.
  std::shared_ptr<RunCgroup> cgroup;
  std::unique_ptr<Spawner> spawner;
  std::thread stopper;
  std::atomic<bool> done{false};
};

// A submitted job's driver this node runs (docs/ARCHITECTURE.md, Drivers on nodes): its
// supervisor, detached as on the head, keeps its files in `dir`; the agent sends its log and its
// end to the head, which answers each driver_status with a driver_ack.
struct Driver {
  std::int64_t job = 0;
  std::int64_t token = 0;                       // the head's start (driver_start.token)
  std::filesystem::path dir;                    // cache_dir/drivers/ID.STAMP
  proto::DriverStart start;                     // what the head asked, until the supervisor runs
  std::int64_t received = 0;                    // bytes of its working directory's archive so far
  std::future<void> preparing;                  // its working directory being unpacked
  std::chrono::steady_clock::time_point asked;  // the last need_archive
  int pid = 0;                                  // its supervisor
  std::int64_t pid_start = 0;
  std::int64_t shipped = -1;  // the head holds its log up to here (-1: not asked yet)
  bool waiting = false;       // a driver_status is unanswered
  std::chrono::steady_clock::time_point sent;
  int signalled = 0;                 // the last signal its supervisor got from the head
  std::optional<std::string> error;  // it could not be started here
};

// How much of a driver's log one driver_status carries, and how long an unanswered one waits
// before it is sent again.
constexpr std::int64_t kLogPiece = 1 << 20;
constexpr auto kStatusAgain = std::chrono::seconds(3);
// How long a piece of a working directory may take before it is asked for again.
constexpr auto kArchiveAgain = std::chrono::seconds(15);

}  // namespace

std::map<std::string, std::string> parse_labels(const std::string& text, const std::string& flag) {
  std::map<std::string, std::string> out;
  std::size_t at = 0;
  while (at < text.size()) {
    std::size_t end = text.find(',', at);
    if (end == std::string::npos) end = text.size();
    const std::string item = text.substr(at, end - at);
    const auto eq = item.find('=');
    if (eq == std::string::npos || eq == 0) {
      throw ConfigError(
          fmt::format("{} \"{}\": \"{}\" is not KEY=VALUE; write k=v,k2=v2", flag, text, item));
    }
    out[item.substr(0, eq)] = item.substr(eq + 1);
    at = end + 1;
  }
  return out;
}

struct Agent::State {
  AgentOptions o;
  std::string host;
  NodeResources resources;
  GpuMeter meter;         // the GPUs' use for each heartbeat, where NVML is there
  CgroupSupport cgroups;  // how this node keeps runs apart (docs/ARCHITECTURE.md, Isolation)
  std::string users;      // how it keeps users apart (describe_users)
  std::vector<int> gpu_indices;
  std::unique_ptr<HeadLink> link;
  std::mutex mu;  // guards jobs
  std::map<std::string, std::unique_ptr<Job>> jobs;
  std::map<std::int64_t, Driver> drivers;  // by job id; the link's thread's alone
  // Preparations of drivers forgotten meanwhile: their folders go once they have ended.
  std::vector<std::pair<std::future<void>, std::filesystem::path>> leftovers;
  transport::DropLog drops{"the agent's link to the head",
                           [this](const std::string& l) { log(l); }};

  void log(const std::string& line) const {
    if (o.log) o.log(line);
  }

  // The beat, with the GPUs' use when NVML can say it (docs/ARCHITECTURE.md, Dashboard).
  proto::Heartbeat heartbeat() {
    proto::Heartbeat b;
    b.node = o.node_id;
    if (auto use = meter.sample(gpu_indices)) {
      b.gpus.emplace();
      for (const auto& u : *use)
        b.gpus->push_back(
            proto::GpuUseEntry{u.index, u.util, static_cast<std::int64_t>(u.memory_used)});
    }
    return b;
  }

  proto::NodeRegister registration() {
    proto::NodeRegister r;
    r.node = o.node_id;
    r.host = host;
    r.address = o.node_ip;
    r.cpus = resources.cpus;
    r.memory = static_cast<std::int64_t>(resources.memory_bytes);
    for (const auto& g : resources.gpus) {
      r.gpus.push_back(proto::GpuEntry{g.index, g.name, static_cast<std::int64_t>(g.memory_bytes),
                                       g.uuid, "", std::nullopt, std::nullopt});
    }
    r.labels = o.labels;
    r.isolation = cgroups.describe();
    r.users = users;
    std::lock_guard lock(mu);
    for (const auto& [run, j] : jobs) {
      if (j->done) continue;
      r.jobs.push_back(
          proto::NodeJob{run, j->job, j->owner, j->user, j->since, j->gpus, j->cpus, j->memory});
    }
    return r;
  }

  template <class Body>
  void post(Body body) {
    link->post(Message{0, std::move(body)});
  }

  void fail_launch(const std::string& run, const std::string& error) {
    log(fmt::format("run {}: cannot start its workers: {}", run, error));
    post(proto::Launched{run, o.node_id, error});
  }

  std::filesystem::path cached(const std::string& sha) const { return o.cache_dir / (sha + ".so"); }

  // The copy of plugin `sha` that `a` may read, and nobody else: cache_dir/accounts/ACCOUNT (the
  // account's, mode 0700)/SHA.so, copied from the cache when it is not there. Throws Error.
  std::filesystem::path account_copy(const Account& a, const std::string& sha) {
    namespace fs = std::filesystem;
    const fs::path accounts = o.cache_dir / "accounts";
    const fs::path dir = accounts / a.name;
    const fs::path copy = dir / (sha + ".so");
    auto sys = [](bool ok, const std::string& what) {
      if (!ok) throw Error(fmt::format("{}: {}", what, std::strerror(errno)));
    };
    if (::mkdir(accounts.c_str(), 0711) != 0 && errno != EEXIST)
      sys(false, "cannot make " + accounts.string());
    if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
      sys(false, "cannot make " + dir.string());
    struct stat st {};
    sys(::lstat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode),
        dir.string() + " is not a folder of the plugin cache");
    sys(::lchown(dir.c_str(), a.uid, a.gid) == 0 && ::chmod(dir.c_str(), 0700) == 0,
        "cannot give " + dir.string() + " to " + a.name);
    if (::lstat(copy.c_str(), &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == a.uid) return copy;
    ::unlink(copy.c_str());
    Fd from(::open(cached(sha).c_str(), O_RDONLY | O_CLOEXEC));
    sys(bool(from), "cannot read " + cached(sha).string());
    const fs::path tmp = dir / fmt::format(".{}.{}.tmp", sha, getpid());
    ::unlink(tmp.c_str());
    Fd to(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0500));
    sys(bool(to), "cannot write " + tmp.string());
    char buf[1 << 16];
    for (;;) {
      const ssize_t n = ::read(from.get(), buf, sizeof buf);
      if (n == 0) break;
      sys(n > 0 && ::write(to.get(), buf, static_cast<std::size_t>(n)) == n,
          "cannot copy the plugin to " + tmp.string());
    }
    sys(::fchown(to.get(), a.uid, a.gid) == 0, "cannot give " + tmp.string() + " to " + a.name);
    to.reset();
    sys(::rename(tmp.c_str(), copy.c_str()) == 0, "cannot store " + copy.string());
    return copy;
  }

  void on_launch(proto::Launch& m) {
    const std::string run = m.run;
    std::lock_guard lock(mu);
    if (auto it = jobs.find(run); it != jobs.end()) {
      Job& j = *it->second;
      // A group's restart: its workers' replacements join the run's others.
      if (!m.restart || !j.spawner || j.stopper.joinable() || j.done)
        return fail_launch(run, "this node already runs workers of that run");
      if (m.user != j.user) return fail_launch(run, "a restart of the run for another member");
      // Workers moved here from a DEAD node: the run holds more of this node now.
      if (m.cpus > j.cpus && j.cgroup) {
        try {
          j.cgroup->set_cpus(m.cpus);
        } catch (const Error& e) {
          log(fmt::format("run {}: {}", run, e.what()));
        }
      }
      j.cpus = std::max(j.cpus, m.cpus);
      for (int g : m.gpus) {
        if (std::find(j.gpus.begin(), j.gpus.end(), g) == j.gpus.end()) j.gpus.push_back(g);
      }
      j.launch = std::move(m);
      return spawn(j);
    }
    if (m.restart)
      return fail_launch(run, "this node runs no workers of that run to restart any of");
    auto j = std::make_unique<Job>();
    j->run = run;
    j->job = m.job;
    j->owner = m.owner;
    j->user = m.user;
    j->since = unix_now();
    j->gpus = m.gpus;
    j->cpus = m.cpus;
    for (const auto& w : m.workers) j->memory += w.memory;
    j->launch = std::move(m);
    const std::string sha = j->launch.sha256;
    Job& job = *j;
    jobs.emplace(run, std::move(j));
    std::error_code ec;
    if (std::filesystem::exists(cached(sha), ec)) {
      spawn(job);
    } else {
      post(proto::NeedPlugin{run, o.node_id, sha});
    }
  }

  void on_plugin(const proto::PluginBytes& m) {
    const std::string& run = m.run;
    const std::string& sha = m.sha256;
    const Tensor& bytes = m.bytes;
    std::lock_guard lock(mu);
    auto it = jobs.find(run);
    if (it == jobs.end()) return;
    if (sha256_hex(bytes.data(), bytes.nbytes()) != sha) {
      return fail_launch(run, fmt::format("the plugin's bytes do not match sha256 {}", sha));
    }
    std::error_code ec;
    std::filesystem::create_directories(o.cache_dir, ec);
    const auto tmp = o.cache_dir / fmt::format(".{}.{}.tmp", sha, getpid());
    {
      std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
      out.write(reinterpret_cast<const char*>(bytes.data()),
                static_cast<std::streamsize>(bytes.nbytes()));
      if (!out) {
        return fail_launch(
            run, fmt::format("cannot write the plugin cache {}: check --cache-dir", tmp.string()));
      }
    }
    ::chmod(tmp.c_str(), 0500);
    std::filesystem::rename(tmp, cached(sha), ec);
    if (ec)
      return fail_launch(run,
                         fmt::format("cannot store {}: {}", cached(sha).string(), ec.message()));
    spawn(*it->second);
  }

  // Starts the workers of `j` (mu held).
  void spawn(Job& j) {
    const proto::Launch& l = j.launch;
    const std::string sha = l.sha256;
    auto plugin = cached(sha);
    // Verified before any worker loads it: a cache file changed on disk is not run.
    std::optional<Account> account;
    try {
      if (o.run_as.enabled()) {
        account = o.run_as.account_for(l.user);
        plugin = account_copy(*account, sha);
      }
      if (sha256_file(plugin) != sha) {
        std::error_code ec;
        std::filesystem::remove(plugin, ec);
        return fail_launch(j.run, fmt::format("the cached plugin {} does not match its sha256; "
                                              "removed it, run the job again",
                                              plugin.string()));
      }
    } catch (const Error& e) {
      return fail_launch(j.run, e.what());
    }
    const std::string run = j.run;
    // The run's cgroups: its CPUs as a quota, each worker's memory limit. Where they cannot be
    // made the run goes on without (`twinkle nodes` says isolation is not enforced here).
    std::map<std::string, std::uint64_t> limits;
    for (const auto& w : l.workers) limits[w.name] = static_cast<std::uint64_t>(w.memory);
    const bool limited = std::any_of(l.workers.begin(), l.workers.end(),
                                     [](const proto::LaunchWorker& w) { return w.memory > 0; });
    if (j.spawner) {
      // A restart: the run's cgroup and spawner are there.
    } else if (cgroups.kind != CgroupSupport::Kind::none) {
      try {
        j.cgroup = std::make_shared<RunCgroup>(cgroups, run + "." + o.node_id, j.cpus);
      } catch (const Error& e) {
        if (limited) return fail_launch(run, e.what());
        log(fmt::format("run {}: its workers run without cgroups: {}", run, e.what()));
      }
    } else if (limited) {
      // The head places limited workers only where cgroups are (one of another build may not).
      return fail_launch(run, fmt::format("this node cannot enforce memory limits (isolation {})",
                                          cgroups.describe()));
    }
    SpawnerOptions so;
    so.on_line = [this, run](const std::string& name, bool is_stderr, const std::string& line) {
      post(proto::Output{run, name, is_stderr, line});
    };
    try {
      if (!j.spawner)
        j.spawner = std::make_unique<Spawner>(so, [this, run, cgroup = j.cgroup,
                                                   limits](const ProcessExit& e) {
          std::string how = e.describe();
          // Killed by the kernel for its cgroup's memory limit: said as that, not as a signal.
          const std::uint64_t limit = limits.count(e.name) ? limits.at(e.name) : 0;
          if (cgroup && limit > 0 && e.signal == SIGKILL && cgroup->oom_killed(e.name))
            how = fmt::format("exceeded its memory limit of {} (OOM-killed)", format_size(limit));
          log(fmt::format("run {}: worker {} (pid {}) {}", run, e.name, e.pid, how));
          post(proto::WorkerExit{
              run, o.node_id, e.name, static_cast<int>(e.pid), e.exit_code, e.signal, how,
              std::vector<std::string>(e.last_stderr.begin(), e.last_stderr.end())});
        });
      // The agent's environment, with the driver's variables for the worker on top.
      std::vector<std::string> base;
      for (char** e = environ; *e; ++e) base.emplace_back(*e);
      for (const auto& w : l.workers) {
        std::vector<std::string> env;
        const auto& wenv = w.env;
        for (const auto& b : base) {
          const std::string key = b.substr(0, b.find('='));
          const bool overridden = std::any_of(wenv.begin(), wenv.end(), [&](const std::string& x) {
            return x.compare(0, key.size() + 1, key + "=") == 0;
          });
          if (!overridden && !key.starts_with("TWINKLE_")) env.push_back(b);
        }
        env.insert(env.end(), wenv.begin(), wenv.end());
        env.push_back(fmt::format("TWINKLE_PARENT_PID={}", getpid()));
        env.push_back("TWINKLE_NODE_IP=" + o.node_ip);
        env.push_back("TWINKLE_NODE_ID=" + o.node_id);
        if (l.keys) {
          env.push_back("TWINKLE_CURVE_PUBLIC=" + l.keys->public_key);
          env.push_back("TWINKLE_CURVE_SECRET=" + l.keys->secret_key);
          env.push_back("TWINKLE_CURVE_SERVER=" + l.keys->server_key);
        }
        ProcessSpec spec;
        spec.name = w.name;
        spec.argv = {o.worker_exe.string(), "--endpoint", l.endpoint, "--plugin", plugin.string()};
        if (account) spec.argv.insert(spec.argv.end(), {"--user", account->name});
        spec.env = std::move(env);
        const pid_t pid = j.spawner->spawn(std::move(spec));
        if (j.cgroup) {
          try {
            j.cgroup->add(w.name, pid, static_cast<std::uint64_t>(w.memory));
          } catch (const Error& e) {
            // A limit the job asked for and this node cannot give: the run is refused.
            if (w.memory > 0) throw;
            log(fmt::format("run {}: worker {} runs outside its cgroup: {}", run, w.name,
                            e.what()));
          }
        }
      }
    } catch (const std::exception& e) {
      if (j.spawner) j.spawner->kill_and_reap();
      return fail_launch(j.run, e.what());
    }
    log(fmt::format("run {} (job {}, owner {}): {} {} worker(s){}", j.run, j.job, j.owner,
                    l.restart ? "restarted" : "started", l.workers.size(),
                    account ? " as " + account->name : ""));
    j.launch = proto::Launch{};
    post(proto::Launched{j.run, o.node_id, std::nullopt});
  }

  // Kills some of a run's workers now, for their group's restart: their exits say when.
  void kill_workers(const std::string& run, const std::vector<std::string>& names) {
    std::lock_guard lock(mu);
    auto it = jobs.find(run);
    if (it == jobs.end() || !it->second->spawner) return;
    for (const auto& name : names) it->second->spawner->signal(name, SIGKILL);
    log(fmt::format("run {}: killed {} for their group's restart", run, fmt::join(names, ", ")));
  }

  // Stops a run's workers on a thread of their own (the heartbeats go on meanwhile).
  void stop_job(const std::string& run, std::chrono::milliseconds grace, const char* why) {
    std::lock_guard lock(mu);
    auto it = jobs.find(run);
    if (it == jobs.end()) {
      // Nothing of it runs here (its launch failed, or it was stopped already): say so at once.
      post(proto::Stopped{run, o.node_id, {}});
      return;
    }
    if (it->second->stopper.joinable()) return;
    Job* j = it->second.get();
    log(fmt::format("run {}: stopping its workers ({})", run, why));
    j->stopper = std::thread([this, j, grace] {
      std::vector<std::string> signalled;
      if (j->spawner) signalled = j->spawner->stop(grace);
      post(proto::Stopped{j->run, o.node_id, std::move(signalled)});
      j->done = true;
    });
  }

  // Jobs whose workers are all stopped are forgotten (on the link's thread).
  void reap() {
    std::vector<std::unique_ptr<Job>> gone;
    {
      std::lock_guard lock(mu);
      for (auto it = jobs.begin(); it != jobs.end();) {
        if (it->second->done) {
          gone.push_back(std::move(it->second));
          it = jobs.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (auto& j : gone) {
      if (j->stopper.joinable()) j->stopper.join();
    }
  }

  // ----- drivers of submitted jobs (on the link's thread) ------------------------------------

  std::filesystem::path drivers_dir() const { return o.cache_dir / "drivers"; }

  void on_driver_start(proto::DriverStart& m) {
    namespace fs = std::filesystem;
    // A start of a job this node had before (the head took it for lost, and chose this node
    // again): what is left of the earlier one goes first.
    if (auto old = drivers.find(m.job); old != drivers.end()) forget_driver(old);
    Driver& d = drivers[m.job];
    d.job = m.job;
    d.token = m.token;
    // A folder of this start's own (ID.STAMP): an earlier supervisor that is still dying
    // writes nothing into it.
    d.dir =
        drivers_dir() /
        fmt::format("{}.{}", m.job, std::chrono::system_clock::now().time_since_epoch().count());
    d.start = std::move(m);
    d.shipped = 0;  // the head keeps nothing of an earlier start's log position
    try {
      if (o.run_as.enabled()) (void)o.run_as.account_for(d.start.user);  // refused before a byte
      fs::create_directories(drivers_dir());
      fs::permissions(drivers_dir(),
                      fs::perms::owner_all | fs::perms::group_exec | fs::perms::others_exec);
      fs::create_directory(d.dir);
      fs::permissions(d.dir, fs::perms::owner_all);  // its archive is nobody else's to read
      ask_archive(d);
    } catch (const std::exception& e) {
      driver_failed(d, e.what());
    }
  }

  // The next piece of `d`'s working directory; asked again when no answer comes for a while (a
  // head that restarted meanwhile).
  void ask_archive(Driver& d) {
    d.asked = std::chrono::steady_clock::now();
    post(proto::NeedArchive{d.job, d.start.sha256, d.received, d.token});
  }

  static std::filesystem::path archive_of(const Driver& d) { return d.dir / "work.tar"; }

  void on_archive_part(const proto::ArchivePart& m) {
    auto it = drivers.find(m.job);
    if (it == drivers.end() || it->second.pid || it->second.error || it->second.preparing.valid())
      return;
    Driver& d = it->second;
    // Only the piece asked for, of this start.
    if (m.token != d.token || m.sha256 != d.start.sha256 || m.offset != d.received) return;
    try {
      if (m.error) throw Error(*m.error);
      {
        std::ofstream out(archive_of(d), std::ios::binary | std::ios::app);
        out.write(reinterpret_cast<const char*>(m.bytes.data.data()),
                  static_cast<std::streamsize>(m.bytes.data.size()));
        if (!out)
          throw Error(fmt::format("cannot write {}: check --cache-dir", archive_of(d).string()));
      }
      d.received += static_cast<std::int64_t>(m.bytes.data.size());
      if (d.received > d.start.size)
        throw Error("the head sent more of the working directory than it holds");
      if (!m.last) return ask_archive(d);
      prepare_driver(d);
    } catch (const std::exception& e) {
      driver_failed(d, e.what());
    }
  }

  // Checks and unpacks the working directory (with --run-as, given to the account) and writes
  // the driver's key, on a thread of its own: a large one would keep the heartbeats waiting.
  // beat_drivers starts the supervisor once it is done.
  void prepare_driver(Driver& d) {
    namespace fs = std::filesystem;
    const proto::DriverStart& m = d.start;
    std::optional<Account> account;
    if (o.run_as.enabled()) account = o.run_as.account_for(m.user);
    const fs::path rel = fs::path(m.job_file).lexically_normal();
    if (rel.empty() || rel.is_absolute() || *rel.begin() == "..")
      throw Error(
          fmt::format("the job file \"{}\" is not inside its working directory", m.job_file));
    d.preparing = std::async(std::launch::async, [dir = d.dir, tar = archive_of(d), m, account] {
      if (sha256_file(tar) != m.sha256)
        throw Error(fmt::format("its working directory does not match sha256 {}", m.sha256));
      jobs::unpack(tar, dir / "work");
      fs::remove(tar);
      if (m.keys) {
        transport::write_keypair(dir / "driver",
                                 transport::KeyPair{m.keys->public_key, m.keys->secret_key},
                                 fmt::format("the driver of job {}", m.job), false);
      }
      if (account) {
        give_tree(dir / "work", *account);
        if (m.keys) give_tree(dir / "driver", *account);
        fs::permissions(dir, fs::perms::owner_all | fs::perms::group_exec | fs::perms::others_exec);
      }
    });
  }

  // Starts the supervisor of a prepared driver, as the head does for a driver of its own.
  void launch_driver(Driver& d) {
    namespace fs = std::filesystem;
    const proto::DriverStart& m = d.start;
    std::optional<Account> account;
    if (o.run_as.enabled()) account = o.run_as.account_for(m.user);
    const auto argv = jobs::supervise_command(jobs::DriverCommand{
        o.exe.string(), d.dir, fs::path(m.job_file).lexically_normal().string(), m.max_retries,
        static_cast<std::uint64_t>(std::max<std::int64_t>(m.log_cap, 4096)), m.stop_grace_s,
        m.resume_on_retry, account ? account->name : "", o.address, m.sets,
        m.keys ? m.keys->server_key : ""});
    d.pid = jobs::start_supervisor(argv, m.job, m.user, m.name);
    d.pid_start = jobs::process_start(d.pid);
    if (!jobs::write_atomic(d.dir / "supervisor",
                            fmt::format("{} {} {}\n", d.pid, d.pid_start, d.token)))
      log(fmt::format("job {}: cannot write {}", m.job, (d.dir / "supervisor").string()));
    log(fmt::format("job {} ({}) of {}: its driver started here (supervisor pid {}{})", m.job,
                    m.name, m.user, d.pid, account ? ", as " + account->name : ""));
    d.start = proto::DriverStart{};
    send_status(d);
  }

  void driver_failed(Driver& d, const std::string& why) {
    log(fmt::format("job {}: cannot start its driver here: {}", d.job, why));
    d.error = why;
    send_status(d);
  }

  bool supervisor_alive(const Driver& d) const {
    return d.pid > 0 && jobs::process_start(d.pid) == d.pid_start;
  }

  // Tells the head how job `d`'s driver goes: the next piece of its log and, once all of the
  // log is sent, its end. (While its working directory comes, a status with nothing in it: the
  // driver is on its way.)
  void send_status(Driver& d) {
    proto::DriverStatus st;
    st.job = d.job;
    st.token = d.token;
    st.error = d.error;
    if (d.pid && d.shipped >= 0) {
      const bool alive = supervisor_alive(d);
      const auto exit = jobs::read_exit(d.dir);  // after `alive`: one written before its end
      const auto piece = jobs::read_log(d.dir, d.shipped, kLogPiece);
      st.offset = piece.offset;
      st.log.data.assign(piece.bytes.begin(), piece.bytes.end());
      if (auto at = jobs::read_attempt(d.dir)) st.attempt = at->attempt;
      // Its end goes with the last piece of its log, never before.
      const bool all = piece.offset + static_cast<std::int64_t>(piece.bytes.size()) >= piece.end;
      if (exit && all) {
        st.exit = exit->code;
        st.retries = exit->retries;
      } else if (!exit && !alive && all) {
        st.lost = true;
      }
    } else if (d.pid) {
      st.offset = 0;  // asks where the head's copy of the log ends
    }
    d.waiting = true;
    d.sent = std::chrono::steady_clock::now();
    post(std::move(st));
  }

  void on_driver_ack(const proto::DriverAck& a) {
    auto it = drivers.find(a.job);
    if (it == drivers.end() || a.token != it->second.token) return;  // of an earlier start
    Driver& d = it->second;
    d.waiting = false;
    if (a.done) {
      // Ended and recorded, or no longer this node's: what is left of it goes.
      forget_driver(it);
      log(fmt::format("job {}: its driver is done here", a.job));
      return;
    }
    if (a.log_end < 0) return;  // the head could not take it; the next beat tries again
    d.shipped = a.log_end;
    if (a.signal && a.signal != d.signalled && supervisor_alive(d)) {
      ::kill(d.pid, a.signal);
      d.signalled = a.signal;
      log(fmt::format("job {}: sent {} to its supervisor (the head asked)", d.job,
                      a.signal == SIGTERM ? "SIGTERM (stop)" : "SIGUSR2 (kill now)"));
    }
    // More of the log waits, or its end: at once.
    if (d.pid && (jobs::read_log(d.dir, d.shipped, 0).end > d.shipped || jobs::read_exit(d.dir)))
      send_status(d);
  }

  // Kills what is left of a driver (its supervisor kills the driver at once on SIGUSR2) and
  // removes its folder (once its preparation, if any, has ended: beat_drivers).
  void forget_driver(std::map<std::int64_t, Driver>::iterator it) {
    Driver& d = it->second;
    if (supervisor_alive(d)) ::kill(d.pid, SIGUSR2);
    if (d.preparing.valid()) {
      leftovers.emplace_back(std::move(d.preparing), d.dir);
    } else {
      std::error_code ec;
      std::filesystem::remove_all(d.dir, ec);
    }
    drivers.erase(it);
  }

  // Every beat: each driver's news (an unanswered status is sent again after a while), a
  // working directory asked for again, a prepared driver started.
  void beat_drivers() {
    const auto now = std::chrono::steady_clock::now();
    for (auto& [job, d] : drivers) {
      if (d.preparing.valid() &&
          d.preparing.wait_for(std::chrono::seconds(0)) == std::future_status::ready) {
        try {
          d.preparing.get();
          launch_driver(d);
        } catch (const std::exception& e) {
          driver_failed(d, e.what());
        }
        continue;
      }
      if (!d.waiting || now - d.sent >= kStatusAgain) send_status(d);
      if (!d.pid && !d.error && !d.preparing.valid() && now - d.asked >= kArchiveAgain)
        ask_archive(d);
    }
    for (auto l = leftovers.begin(); l != leftovers.end();) {
      if (l->first.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
        ++l;
        continue;
      }
      try {
        l->first.get();
      } catch (const std::exception&) {
        // Its driver is forgotten: how its preparation ended no longer matters.
      }
      std::error_code ec;
      std::filesystem::remove_all(l->second, ec);
      l = leftovers.erase(l);
    }
  }

  // Drivers a previous agent of this node started (it was killed: a stopped agent takes its
  // drivers with it): their supervisors live on; their news goes to the head again.
  void adopt_drivers() {
    namespace fs = std::filesystem;
    // ID.STAMP, oldest first: of two starts of one job (one killed as the other began) the
    // newer is kept.
    std::vector<std::tuple<std::int64_t, std::int64_t, fs::path>> found;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(drivers_dir(), ec)) {
      const std::string name = e.path().filename().string();
      const auto dot = name.find('.');
      if (dot == 0 || dot == std::string::npos || dot > 18 || name.size() - dot > 20 ||
          name.find_first_not_of("0123456789.") != std::string::npos ||
          name.find('.', dot + 1) != std::string::npos)
        continue;
      found.emplace_back(std::stoll(name.substr(dot + 1)), std::stoll(name.substr(0, dot)),
                         e.path());
    }
    std::sort(found.begin(), found.end());
    for (const auto& [stamp, job, dir] : found) {
      if (auto older = drivers.find(job); older != drivers.end()) forget_driver(older);
      std::ifstream in(dir / "supervisor");
      Driver d;
      if (!(in >> d.pid >> d.pid_start >> d.token)) {
        std::error_code rm;
        fs::remove_all(dir, rm);  // never started
        continue;
      }
      d.job = job;
      d.dir = dir;
      log(fmt::format("job {}: took up its driver again (supervisor pid {})", job, d.pid));
      drivers[job] = std::move(d);
    }
  }

  // The agent stops: its drivers go with it (the head, told the node left, starts their jobs
  // again elsewhere while they have retries).
  void stop_drivers() {
    for (auto it = drivers.begin(); it != drivers.end();) forget_driver(it++);
    for (auto& l : leftovers) {
      l.first.wait();
      std::error_code ec;
      std::filesystem::remove_all(l.second, ec);
    }
    leftovers.clear();
  }

  void handle(Message& m) {
    if (auto* start = m.get<proto::DriverStart>()) {
      on_driver_start(*start);
    } else if (auto* part = m.get<proto::ArchivePart>()) {
      on_archive_part(*part);
    } else if (auto* ack = m.get<proto::DriverAck>()) {
      on_driver_ack(*ack);
    } else if (auto* launch = m.get<proto::Launch>()) {
      on_launch(*launch);
    } else if (auto* plugin = m.get<proto::PluginBytes>()) {
      on_plugin(*plugin);
    } else if (auto* stop = m.get<proto::StopJob>()) {
      if (!stop->workers.empty()) return kill_workers(stop->run, stop->workers);
      stop_job(stop->run, std::chrono::milliseconds(stop->grace_ms), "its driver asked");
    } else if (auto* kill = m.get<proto::KillJob>()) {
      stop_job(kill->run, std::chrono::milliseconds(0), "the head says its driver is gone");
    } else if (m.get<proto::Reregister>()) {
      log(
          fmt::format("the head at {} does not know this node (it restarted, or declared the "
                      "node dead); registering again",
                      o.address));
      post(registration());
    } else if (auto* welcome = m.get<proto::NodeWelcome>()) {
      if (welcome->error) log("the head refused this node: " + *welcome->error);
    } else {
      drops.drop(fmt::format("a {} message is not for an agent", transport::to_string(m.type())));
    }
  }
};

Agent::Agent(AgentOptions options) : s_(std::make_unique<State>()) {
  State& s = *s_;
  s.o = std::move(options);
  if (sodium_init() < 0) throw Error("libsodium failed to initialise (needed for sha256)");
  s.resources = discover_local(s.o.gpus);
  if (s.o.gpus && static_cast<int>(s.resources.gpus.size()) != *s.o.gpus) {
    s.resources.gpus.clear();
    for (int i = 0; i < *s.o.gpus; ++i) s.resources.gpus.push_back(GpuInfo{i, "", 0, ""});
  }
  if (s.o.cpus) {
    s.resources.cpus = *s.o.cpus;
  } else if (const char* slurm = std::getenv("SLURM_CPUS_ON_NODE"); slurm && std::atoi(slurm) > 0) {
    s.resources.cpus = std::atoi(slurm);  // what the Slurm allocation holds on this node
  }
  s.host = s.resources.hostname;
  if (s.o.run_as.enabled()) {
    if (geteuid() != 0) {
      throw ConfigError(
          "--run-as: the agent must run as root to start workers as other accounts; start it as "
          "root, or without --run-as (then every worker runs as this account)");
    }
    if (!s.o.security.secure()) {
      throw ConfigError(
          "--run-as needs a cluster with keys: without them the head cannot know who a driver "
          "is, and anyone could claim to be any member; give the head a key and an allow-list "
          "(twinkle keygen)");
    }
    std::filesystem::create_directories(s.o.cache_dir);
    if (auto closed = closed_to_others(s.o.cache_dir.parent_path())) {
      throw ConfigError(fmt::format(
          "--run-as: the accounts cannot reach the plugin cache {}: {} is closed to others; give "
          "--cache-dir a folder they can pass through (e.g. /var/cache/twinkle)",
          s.o.cache_dir.string(), closed->string()));
    }
    ::chmod(s.o.cache_dir.c_str(), 0711);
  }
  s.users = describe_users(s.o.run_as);
  s.cgroups = probe_cgroups();
  s.log(fmt::format("isolation between jobs: {}; users {}", s.cgroups.describe(), s.users));
  // Only GPUs NVML found are sampled (declared ones it does not know).
  if (s.resources.gpu_source == GpuSource::nvml)
    for (const auto& g : s.resources.gpus) s.gpu_indices.push_back(g.index);
  if (s.o.node_id.empty()) s.o.node_id = s.host;
  if (s.o.node_ip.empty()) s.o.node_ip = route_source_address(endpoint_host(s.o.address));
  sweep_cgroups(s.cgroups, "." + s.o.node_id);  // what a killed agent of this node id left
  s.link = std::make_unique<HeadLink>(s.o.address, s.o.security, "agent/" + s.o.node_id);
  const auto welcome =
      s.link->request<proto::NodeWelcome>(Message{0, s.registration()}, std::chrono::seconds(10));
  if (welcome.error) throw ConfigError("the head refused this node: " + *welcome.error);
  s.log(fmt::format("node {} joined the cluster at {} (address {}, {} CPUs, {} GPUs)", s.o.node_id,
                    s.o.address, s.o.node_ip, s.resources.cpus, s.resources.gpus.size()));
  s.adopt_drivers();
  s.link->start([&s](Message& m) { s.handle(m); },
                [&s]() -> std::optional<Message> {
                  s.reap();
                  s.beat_drivers();
                  return Message{0, s.heartbeat()};
                });
}

Agent::~Agent() {
  State& s = *s_;
  {
    std::lock_guard lock(s.mu);
    for (auto& [run, j] : s.jobs) {
      if (j->spawner) j->spawner->signal_all(SIGTERM);
    }
  }
  // Said at once, so that drivers do not wait for the heartbeats to stop.
  s.link->post(Message{0, proto::NodeLeave{s.o.node_id, "its agent was stopped"}});
  s.link->stop(std::chrono::milliseconds(500));
  s.stop_drivers();  // the link's thread has ended: its drivers are this thread's now
  std::lock_guard lock(s.mu);
  for (auto& [run, j] : s.jobs) {
    if (j->stopper.joinable()) j->stopper.join();
    if (j->spawner) j->spawner->stop(std::chrono::milliseconds(0));
  }
  s.jobs.clear();
}

void Agent::run(const std::atomic<bool>& stop) {
  // The link's thread does the work; this one waits for the stop.
  while (!stop) std::this_thread::sleep_for(std::chrono::milliseconds(100));
}

}  // namespace twinkle::core::cluster
