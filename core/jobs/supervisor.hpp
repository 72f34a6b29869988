#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

// The process that runs a submitted job's driver (docs/ARCHITECTURE.md, Job service). The head
// starts it detached (its own session, not the head's child), so that it and the driver live on
// when the head is killed; it talks to the head through files in the job's folder only:
//   attempt   "N PID": attempt N (0 first) runs as PID
//   exit      "CODE RETRIES": the job's end (CODE: the driver's exit status, 128+signal when
//             killed), written last
//   log, log.1, log.base: the driver's output (which carries its workers' lines), rotated
// SIGTERM asks the driver to stop (it gets SIGTERM, and SIGKILL stop_grace_s + 30 s later);
// SIGUSR2 kills it at once. Neither is retried.
namespace twinkle::core::jobs {

struct SuperviseOptions {
  std::filesystem::path job_dir;   // holds the files above
  std::filesystem::path work_dir;  // the driver's working directory
  std::vector<std::string> argv;   // the driver's command
  int max_retries = 0;
  bool resume_on_retry = false;         // a retry adds --set job.resume=auto
  std::uint64_t log_cap = 64ull << 20;  // bytes kept of the log (two halves)
  double stop_grace_s = 60;
  // The account the driver runs as (the head's --run-as), which alone may read the log; "": as
  // this process.
  std::string user;
};

// A job's driver under its supervisor, as the head and a node's agent start it:
//   EXE supervise --job-dir DIR --work-dir DIR/work --max-retries N --log-cap B --stop-grace S
//     [--resume-on-retry] [--user ACCOUNT] -- EXE run DIR/work/JOB --address HEAD
//     [--set X]... [--key DIR/driver/twinkle.key --head-key HEAD_KEY]
struct DriverCommand {
  std::string exe;
  std::filesystem::path job_dir;
  std::string job_file;  // inside DIR/work
  int max_retries = 0;
  std::uint64_t log_cap = 0;
  double stop_grace_s = 0;
  bool resume_on_retry = false;
  std::string account;  // "": as the supervisor
  std::string address;  // the head
  std::vector<std::string> sets;
  std::string head_key;  // with keys: the head's public key (the driver's pair is in DIR/driver)
};
std::vector<std::string> supervise_command(const DriverCommand& c);

// Starts `argv` (a `twinkle supervise` command) detached: its own session, not this process's
// child, so that it lives on when this process is killed; its environment is this process's with
// TWINKLE_JOB_ID, TWINKLE_JOB_USER and TWINKLE_JOB_NAME of job `id` (and no TWINKLE_ADDRESS).
// Returns its pid; throws Error when it cannot.
int start_supervisor(const std::vector<std::string>& argv, std::int64_t id, const std::string& user,
                     const std::string& name);

// Runs the driver until it succeeds, is stopped, or has failed max_retries + 1 times; returns
// its last exit status.
int supervise(const SuperviseOptions& o);

// Writes `text` to `file` through a temporary name, so that a reader sees all of it or nothing;
// false when it could not.
bool write_atomic(const std::filesystem::path& file, const std::string& text);

// Appends `bytes` to the job's log in `job_dir` (rotated as the supervisor rotates it, within
// `cap`): the head's copy of the log of a driver on a node.
void append_log(const std::filesystem::path& job_dir, std::uint64_t cap, std::string_view bytes);

// The job's log as one byte stream across rotation.
struct LogPiece {
  std::string bytes;
  std::int64_t offset = 0;  // where `bytes` starts (later than asked when that part was rotated)
  std::int64_t end = 0;     // the log's end now
};
LogPiece read_log(const std::filesystem::path& job_dir, std::int64_t offset, std::size_t max);

// A supervisor's state read from its files.
struct AttemptFile {
  int attempt = 0;
  int pid = 0;
};
std::optional<AttemptFile> read_attempt(const std::filesystem::path& job_dir);
struct ExitFile {
  int code = 0;
  int retries = 0;
};
std::optional<ExitFile> read_exit(const std::filesystem::path& job_dir);

// The start time of process `pid` (field 22 of /proc/PID/stat), 0 when it does not run: a pid
// and its start time name one process, whatever pids are reused since.
std::int64_t process_start(int pid);

}  // namespace twinkle::core::jobs
