#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/jobs/store.hpp"
#include "core/jobs/tenancy.hpp"
#include "core/runtime/run_as.hpp"
#include "transports/zmq/message.hpp"
#include "transports/zmq/protocol.hpp"

// The head's job service (docs/ARCHITECTURE.md, Job service): the queue of submitted jobs, their
// working directories, supervised drivers, logs and history, and the record of interactive runs.
// It runs on the head's thread; the head hands it the job messages and tells it about
// reservations.
namespace twinkle::core::jobs {

namespace proto = transport::proto;
using Message = transport::ClusterMessage;

// Why a job got no hold: the devices are busy now, or it fits the live nodes not even when idle
// (`never`: it waits without holding back the queue).
struct Refusal {
  std::string why;
  bool never = false;
};

using Labels = std::map<std::string, std::string>;

// What the service needs of the head.
struct ClusterView {
  // Holds devices for job `id` until its driver reserves them, and its driver's CPU: on a node
  // with all of `driver_labels` (`driver_node` says which) or, without them, on the head's node
  // when it has one. Returns nullopt when held, else why it does not fit now.
  std::function<std::optional<Refusal>(std::int64_t id,
                                       const std::vector<proto::GroupDemandEntry>& demand,
                                       const Labels& driver_labels, std::string* driver_node)>
      hold;
  std::function<void(std::int64_t id)> unhold;
  // Stops the workers of `run` at once and frees its devices.
  std::function<void(const std::string& run)> release_run;
  // True while the head has a reservation for `run`.
  std::function<bool(const std::string& run)> run_known;
  // The CPU a running job's driver takes on `node` ("": the head's node; nothing when held
  // already, or when the head's machine is no node).
  std::function<void(std::int64_t id, const std::string& node)> hold_driver;
  // Would `demand` (and its driver) fit now were the devices of these jobs (their holds) and
  // these runs free? Nothing is held.
  std::function<bool(const std::vector<proto::GroupDemandEntry>& demand,
                     const Labels& driver_labels, const std::vector<std::int64_t>& jobs,
                     const std::vector<std::string>& runs)>
      fits_without;
  // Sends `m` to the agent of `node`; false when it is not a live node.
  std::function<bool(const std::string& node, const Message& m)> send_node;
  // Whether `node` is a live node now.
  std::function<bool(const std::string& node)> node_alive;
  // Admits the key of job `id`'s driver (its connections are named driver_name(id)) / no more.
  std::function<void(std::int64_t id, const std::string& public_key)> admit_driver;
  std::function<void(const std::string& public_key)> revoke_driver;
};

// The name a submitted job's driver has at the head (its key's): "job/ID"; driver_job() reads
// the id back (nullopt for any other name).
std::string driver_name(std::int64_t job);
std::optional<std::int64_t> driver_job(const std::string& name);

struct ServiceOptions {
  std::filesystem::path state_dir;  // jobs.db, uploads/, jobs/ID/
  int keep_jobs = 10000;
  std::uint64_t log_cap = 64ull << 20;  // per job
  // Bytes of one working directory's archive: a client's 1 GiB of files and tar's headers.
  std::uint64_t max_upload = 5ull << 28;
  std::string head_address;  // what drivers connect to
  // The head's public key, which drivers pin; "" on a cluster without keys. With it, each job's
  // driver gets a key pair of its own (JOB_DIR/driver/twinkle.key), admitted while it runs.
  std::string head_public;
  // Which account each member's jobs run as (docs/ARCHITECTURE.md, Isolation): a job's folder is
  // given to it, and its supervisor and driver become it. Not enabled: as this process.
  RunAs run_as;
  std::filesystem::path exe;  // the twinkle binary
  std::function<void(const std::string&)> log;
  // Teams (docs/ARCHITECTURE.md, Teams and quotas): the quotas (no_quotas() without a file) and
  // the allow-list's members by team, for `twinkle quotas`.
  Quotas quotas = no_quotas();
  std::map<std::string, std::string> member_teams;  // member name -> team
};

// Who sent a message: the name of the key its connection authenticated with ("" on a cluster
// without keys, where the message's own `user` counts).
struct Caller {
  std::string user;
  bool admin = false;
  std::string identity;  // its connection's (for uploads in progress)
  std::string team = "default";
};

class JobService {
 public:
  // Opens (creating) the state folder and its history, and takes up the jobs a previous head left
  // running. Throws Error naming the folder when it cannot.
  JobService(ServiceOptions options, ClusterView cluster);
  JobService(const JobService&) = delete;
  JobService& operator=(const JobService&) = delete;
  ~JobService();

  // A job service message (upload_check, upload_part, submit, jobs_query, logs_query, job_stop,
  // quotas_query): the answer to send back.
  Message handle(const Caller& caller, std::uint64_t request, Message& m);

  // Starts what the queue can start and notices drivers that ended. Call every few hundred ms.
  void tick();

  // The head made a reservation for `run`: a submitted job's driver when `job_id`, else an
  // interactive `twinkle run --address` (recorded as a job of its own).
  void reserved(const std::string& run, std::optional<std::int64_t> job_id, const std::string& name,
                const std::string& user, const std::string& team,
                const std::vector<proto::RankPlace>& placement, int gpus, int cpus, int nodes);
  // `run` ended: released by its driver (`lapsed` false; with how it ended when the driver said)
  // or its lease ran out.
  void released(const std::string& run, bool lapsed,
                const std::optional<std::string>& outcome = std::nullopt);

  // The driver of `run` says that its groups have restarted `count` times so far (after lost
  // workers; max_restarts): its job counts them, and an audit record says so.
  void restarted(const std::string& run, int count);
  // Ranks of `run` moved off a DEAD node (their group restarted): `places` say where they run now.
  void moved(const std::string& run, const std::vector<proto::RankPlace>& places);

  // Drivers on nodes (docs/ARCHITECTURE.md, Drivers on nodes), from the agent of `node`: how the
  // driver of a job it runs goes (its log, its end), answered with what the head holds and
  // wants; and a piece of a job's working directory for it.
  proto::DriverAck driver_status(const std::string& node, const proto::DriverStatus& status);
  proto::ArchivePart archive_part(const std::string& node, const proto::NeedArchive& need);

  // The user of job `id`; nullopt when the history has no such job.
  std::optional<std::string> user_of(std::int64_t id) const;

  // Reads the quotas file again (SIGHUP, `twinkle quotas reload`): what it did, or an Error
  // (ConfigError with file:line:col) that leaves the quotas as they were.
  std::string reload_quotas();

 private:
  struct State;
  std::unique_ptr<State> s_;
};

}  // namespace twinkle::core::jobs
