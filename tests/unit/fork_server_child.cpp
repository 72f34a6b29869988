// A fork server for the spawner's tests: `fork_server_child --fork-server PAD` serves forks like
// twinkle-worker's, and each forked child (or this program run directly) does what its argv says:
//   say TEXT      prints TEXT on stdout and exits 0
//   env NAME      prints NAME's value (or "unset") and exits 0
//   fds           prints how many descriptors it has open and exits 0
//   exit N        exits with N at once
//   wait          waits until a signal ends it
//   tell FD TEXT  writes TEXT to descriptor FD and exits 0
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "core/runtime/fork_server.hpp"

namespace {

int child_main(int argc, char** argv) {
  if (argc < 2) return 64;
  const std::string what = argv[1];
  if (what == "say" && argc == 3) return std::printf("%s\n", argv[2]) < 0;
  if (what == "env" && argc == 3) {
    const char* v = std::getenv(argv[2]);
    return std::printf("%s\n", v ? v : "unset") < 0;
  }
  if (what == "fds") {
    int n = -1;  // the iterator's own descriptor is not counted
    for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
    return std::printf("%d\n", n) < 0;
  }
  if (what == "exit" && argc == 3) return std::atoi(argv[2]);
  if (what == "wait") {
    for (;;) ::pause();
  }
  if (what == "tell" && argc == 4) {
    const std::size_t n = std::strlen(argv[3]);
    return ::write(std::atoi(argv[2]), argv[3], n) != static_cast<ssize_t>(n);
  }
  return 64;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 2 && std::strcmp(argv[1], twinkle::core::kForkServerFlag) == 0)
    return twinkle::core::serve_forks(argc, argv, child_main);
  return child_main(argc, argv);
}
