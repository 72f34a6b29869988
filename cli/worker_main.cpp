// `twinkle-worker`: the worker process that `twinkle run` and node agents start, one per rank. It
// is its own small binary (docs/ARCHITECTURE.md, Processes) so that a worker maps only the
// libraries a worker uses: starting eight of them is most of a run's launch time.
#include <cstring>

#include "cli/commands.hpp"
#include "core/runtime/fork_server.hpp"
#include "core/runtime/worker.hpp"

namespace {

int worker_main(int argc, char** argv) {
  using namespace twinkle::cli;
  using twinkle::core::run_worker;
  CLI::App app{"twinkle-worker: one rank of a run, started by `twinkle run` or a node agent",
               "twinkle-worker"};
  twinkle::core::WorkerOptions o;
  app.add_option("--endpoint", o.endpoint, "The driver's control channel")->required();
  app.add_option("--plugin", o.plugin, "The plugin to load")->required();
  app.add_option("--run-dir", o.run_dir, "The run's private directory");
  app.add_option("--user", o.user, "The Unix account to run as (a node's --run-as)");
  return parse_and_run(app, argc, argv, [&o] { return run_worker(o) ? kExitOk : kExitJobFailed; });
}

}  // namespace

// `twinkle-worker --fork-server`: the launcher's fork server, whose children run worker_main.
int main(int argc, char** argv) {
  if (argc >= 2 && std::strcmp(argv[1], twinkle::core::kForkServerFlag) == 0)
    return twinkle::core::serve_forks(argc, argv, worker_main);
  return worker_main(argc, argv);
}
