#pragma once

#include <filesystem>
#include <string>

namespace twinkle::core {

struct WorkerOptions {
  std::string endpoint;           // the driver's control socket
  std::filesystem::path plugin;   // the plugin to load
  std::filesystem::path run_dir;  // removed if the driver dies without cleaning up
  std::string user;               // the Unix account to become first (a node's --run-as)
};

// The body of `twinkle worker`: connects to the driver, says hello, loads the plugin, then
// serves create/call/shutdown messages one at a time until shutdown. Identity (group, rank, ...)
// comes from the environment the launcher set (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
// TWINKLE_GROUP, TWINKLE_WORKER_NAME). Returns true after an orderly shutdown, false when the
// driver never welcomed it. With `user`, it becomes that account before anything else (become()).
bool run_worker(const WorkerOptions& options);

}  // namespace twinkle::core
