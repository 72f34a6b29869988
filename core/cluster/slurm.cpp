#include "core/cluster/slurm.hpp"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/cluster/head.hpp"
#include "core/cluster/head_link.hpp"
#include "core/cluster/remote_site.hpp"
#include "core/runtime/spawner.hpp"
#include "transports/zmq/curve.hpp"
#include "twinkle/errors.hpp"

extern char** environ;

namespace twinkle::core::cluster {

namespace {

constexpr auto kJoinTimeout = std::chrono::seconds(60);

std::string command_output(const std::string& cmd) {
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (!p) throw ConfigError(fmt::format("cannot run `{}`", cmd));
  std::string out;
  char buf[4096];
  while (std::size_t n = fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  if (pclose(p) != 0) {
    throw ConfigError(
        fmt::format("`{}` failed: {}; is Slurm's scontrol on PATH and the "
                    "allocation still alive?",
                    cmd, out.substr(0, out.find('\n'))));
  }
  return out;
}

std::vector<std::string> hostnames(const std::string& list) {
  std::vector<std::string> out;
  std::istringstream in(command_output(fmt::format("scontrol show hostnames '{}'", list)));
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) out.push_back(line);
  }
  return out;
}

// "KEY=value" from scontrol's output ("" when absent).
std::string field(const std::string& text, const std::string& key) {
  std::size_t at = 0;
  while ((at = text.find(key + "=", at)) != std::string::npos) {
    if (at == 0 || text[at - 1] == ' ' || text[at - 1] == '\n') {
      const std::size_t start = at + key.size() + 1;
      return text.substr(start, text.find_first_of(" \n", start) - start);
    }
    at += key.size();
  }
  return "";
}

// SLURM_JOB_CPUS_PER_NODE: "4(x2),2" -> {4, 4, 2}.
std::vector<int> cpus_per_node(const std::string& text) {
  std::vector<int> out;
  std::istringstream in(text);
  for (std::string item; std::getline(in, item, ',');) {
    const int cpus = std::atoi(item.c_str());
    int times = 1;
    if (auto x = item.find("(x"); x != std::string::npos) times = std::atoi(item.c_str() + x + 2);
    for (int i = 0; i < times; ++i) out.push_back(cpus);
  }
  return out;
}

// The GPUs of "GRES=gpu:2(IDX:0-1)" or "GRES=gpu:a100:2(IDX:...)"; 0 without.
int gres_gpus(const std::string& gres) {
  const auto g = gres.find("gpu");
  if (g == std::string::npos) return 0;
  const auto paren = gres.find('(', g);
  const std::string spec =
      gres.substr(g, paren == std::string::npos ? std::string::npos : paren - g);
  const auto colon = spec.rfind(':');
  return colon == std::string::npos ? 1 : std::atoi(spec.c_str() + colon + 1);
}

class SlurmSite : public RemoteSite {
 public:
  SlurmSite(const SlurmAllocation& a, const std::filesystem::path& exe) : alloc_(a) {
    const transport::KeyPair head_keys = transport::generate_keypair();
    const transport::KeyPair agent_keys = transport::generate_keypair();
    const transport::KeyPair driver_keys = transport::generate_keypair();
    // This host as the nodes reach it: the source address of the route to the first node.
    const std::string address = route_source_address(a.nodes.front().address);
    HeadOptions ho;
    ho.bind_host = address;
    ho.port = 0;
    ho.security.socket.keys = head_keys;
    ho.security.allowed = {agent_keys.public_key, driver_keys.public_key};
    ho.log = [](const std::string& line) {
      if (line.find("DEAD") != std::string::npos || line.find("refused") != std::string::npos) {
        std::fprintf(stderr, "twinkle: %s\n", line.c_str());
        std::fflush(stderr);
      }
    };
    head_ = std::make_unique<Head>(std::move(ho));
    head_thread_ = std::thread([this] { head_->run(stop_); });
    const std::string endpoint = head_->endpoint();

    // One agent per node, in a job step of its own that may share the allocation's resources.
    SpawnerOptions so;
    so.quiet = true;
    spawner_ = std::make_unique<Spawner>(so, [this](const ProcessExit& e) {
      std::lock_guard lock(mu_);
      srun_exit_ = e.describe();
      for (const auto& l : e.last_stderr) srun_exit_ += "\n    | " + l;
    });
    ProcessSpec spec;
    spec.name = "srun";
    const std::string srun = "/usr/bin/srun";
    spec.argv = {std::filesystem::exists(srun) ? srun : std::string("srun"),
                 fmt::format("--nodes={}", a.nodes.size()),
                 fmt::format("--ntasks={}", a.nodes.size()),
                 "--ntasks-per-node=1",
                 "--overlap",
                 "--kill-on-bad-exit=1",
                 "--job-name=twinkle-agents",
                 exe.string(),
                 "node",
                 "start",
                 "--address",
                 endpoint};
    for (char** e = environ; *e; ++e) spec.env.emplace_back(*e);
    spec.env.push_back(fmt::format("TWINKLE_SESSION_KEYS={} {} {}", agent_keys.public_key,
                                   agent_keys.secret_key, head_keys.public_key));
    spawner_->spawn(std::move(spec));

    transport::SocketSecurity driver;
    driver.keys = driver_keys;
    driver.server_key = head_keys.public_key;
    wait_for_agents(endpoint, driver);
    inner_ = connect_site(endpoint, driver);
  }

  ~SlurmSite() override {
    inner_.reset();  // releases the reservation
    if (spawner_) spawner_->stop(std::chrono::milliseconds(0), std::chrono::seconds(3));
    stop_ = true;
    if (head_thread_.joinable()) head_thread_.join();
  }

  std::optional<Placement> reserve(const Job& job, const std::string& run_id,
                                   const Wait& wait) override {
    try {
      return inner_->reserve(job, run_id, wait);
    } catch (const ConfigError& e) {
      throw ConfigError(
          fmt::format("{}; {}: ask Slurm for more (salloc/sbatch -N for nodes, --gpus-per-node, "
                      "--cpus-per-task or --ntasks-per-node for CPUs)",
                      e.what(), alloc_.describe()));
    }
  }
  Placement plan(const Job& job) override { return inner_->plan(job); }
  std::string driver_address() const override { return inner_->driver_address(); }
  bool secure() const override { return true; }
  std::unique_ptr<Launcher> launcher(const Job& job, const Placement& placement, Launch launch,
                                     transport::CallChannel& channel) override {
    return inner_->launcher(job, placement, std::move(launch), channel);
  }

 private:
  void wait_for_agents(const std::string& endpoint, const transport::SocketSecurity& sec) {
    HeadLink probe(endpoint, sec, fmt::format("slurm/{}", getpid()));
    const auto deadline = std::chrono::steady_clock::now() + kJoinTimeout;
    std::uint64_t id = 0;
    for (;;) {
      const auto info = probe.request<proto::NodesInfo>(Message{++id, proto::NodesQuery{}},
                                                        std::chrono::seconds(5));
      std::size_t alive = 0;
      for (const auto& n : info.nodes) alive += n.state == "ALIVE";
      if (alive >= alloc_.nodes.size()) return;
      {
        std::lock_guard lock(mu_);
        if (!srun_exit_.empty()) {
          throw Error(
              fmt::format("srun, which starts the node agents of {}, {} before they all joined",
                          alloc_.describe(), srun_exit_));
        }
      }
      if (std::chrono::steady_clock::now() > deadline) {
        throw Error(fmt::format("only {} of the {} node agents joined within {} s ({})", alive,
                                alloc_.nodes.size(), kJoinTimeout.count(), alloc_.describe()));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }

  SlurmAllocation alloc_;
  std::atomic<bool> stop_{false};
  std::unique_ptr<Head> head_;
  std::thread head_thread_;
  std::mutex mu_;
  std::string srun_exit_;
  std::unique_ptr<Spawner> spawner_;
  std::unique_ptr<RemoteSite> inner_;
};

}  // namespace

std::string SlurmAllocation::describe() const {
  std::vector<std::string> parts;
  for (const auto& n : nodes)
    parts.push_back(fmt::format("{}: {} CPUs, {} GPUs", n.name, n.cpus, n.gpus));
  return fmt::format("the Slurm allocation (job {}) has {} node{} ({})", job_id, nodes.size(),
                     nodes.size() == 1 ? "" : "s", fmt::join(parts, "; "));
}

SlurmAllocation slurm_allocation() {
  SlurmAllocation a;
  const char* id = std::getenv("SLURM_JOB_ID");
  if (!id || !*id) {
    throw ConfigError(
        "launcher = \"slurm\" runs inside a Slurm allocation and SLURM_JOB_ID is not set: use "
        "`salloc -N2 twinkle run job.toml`, or `sbatch deploy/slurm/twinkle.sbatch job.toml`");
  }
  a.job_id = id;
  const char* list = std::getenv("SLURM_JOB_NODELIST");
  if (!list) list = std::getenv("SLURM_NODELIST");
  if (!list) throw ConfigError("SLURM_JOB_NODELIST is not set: is this a Slurm allocation?");
  const std::vector<int> cpus = cpus_per_node(
      std::getenv("SLURM_JOB_CPUS_PER_NODE") ? std::getenv("SLURM_JOB_CPUS_PER_NODE") : "");
  const std::vector<std::string> names = hostnames(list);
  // GPUs per node from the job's detailed view ("Nodes=... GRES=gpu:2(IDX:0-1)").
  std::map<std::string, int> gpus;
  std::istringstream job(command_output(fmt::format("scontrol show job -d {}", a.job_id)));
  for (std::string line; std::getline(job, line);) {
    const std::string nodes = field(line, "Nodes");
    const std::string gres = field(line, "GRES");
    if (nodes.empty() || line.find("CPU_IDs=") == std::string::npos) continue;
    for (const auto& n : hostnames(nodes)) gpus[n] = gres_gpus(gres);
  }
  for (std::size_t i = 0; i < names.size(); ++i) {
    SlurmNode n;
    n.name = names[i];
    const std::string info = command_output(fmt::format("scontrol show node '{}'", n.name));
    n.address = field(info, "NodeAddr");
    if (n.address.empty()) n.address = n.name;
    n.cpus = i < cpus.size() ? cpus[i] : std::atoi(field(info, "CPUTot").c_str());
    n.gpus = gpus.count(n.name) ? gpus[n.name] : 0;
    a.nodes.push_back(std::move(n));
  }
  if (a.nodes.empty()) throw ConfigError(fmt::format("Slurm job {} has no nodes", a.job_id));
  return a;
}

std::vector<NodeCapacity> slurm_capacity(const SlurmAllocation& a) {
  std::vector<NodeCapacity> out;
  for (const auto& n : a.nodes) {
    NodeCapacity c;
    c.id = n.name;
    c.cpus = n.cpus;
    for (int g = 0; g < n.gpus; ++g) c.gpus.push_back(g);
    out.push_back(std::move(c));
  }
  return out;
}

std::unique_ptr<RemoteSite> start_slurm_site(const SlurmAllocation& a,
                                             const std::filesystem::path& exe) {
  return std::make_unique<SlurmSite>(a, exe);
}

}  // namespace twinkle::core::cluster
