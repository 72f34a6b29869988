#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/jobs/service.hpp"
#include "transports/zmq/protocol.hpp"

// The head's web dashboard (docs/ARCHITECTURE.md, Dashboard): the page and its JSON API under
// /api/v1/, served over HTTP on loopback by threads of its own. It keeps the logins and sessions;
// everything it shows or changes it asks of the head's thread, as the member whose session it is.
namespace twinkle::core::cluster {

struct DashboardOptions {
  std::string host = "127.0.0.1";  // another than loopback only with TLS (the CLI refuses it)
  int port = 0;                    // 0: an ephemeral port
  // How long a login link is good for (TWINKLE_TEST_DASHBOARD_LINK_S changes it for the tests).
  double link_s = 60;
  // HTTPS with this certificate and key (PEM files); both empty: HTTP.
  std::filesystem::path tls_cert, tls_key;
  // More names the Host header may give (the certificate's, e.g. an FQDN); the first is the
  // links'.
  std::vector<std::string> names;
  // Bytes of the files of one submit from the page (the job service's limit on an archive).
  std::uint64_t max_upload = 1ull << 30;
  // Where a submit's files are put together ("": the system's temporary folder).
  std::filesystem::path scratch_dir;
  std::function<void(const std::string&)> log;
};

// Runs `m` on the head's thread on behalf of `caller`: the head's answer, or nullopt when the
// head did not answer (it is stopping).
using HeadAsk = std::function<std::optional<transport::ClusterMessage>(
    const jobs::Caller& caller, transport::ClusterMessage m)>;

// The dashboard is the module libtwinkle_dashboard.so (cpp-httplib with OpenSSL and brotli),
// loaded by the head that serves one, so that every other `twinkle` command starts without
// mapping and relocating them (about 4 ms of CPU per process on the development VM).
class Dashboard {
 public:
  virtual ~Dashboard() = default;  // stops serving (waits for requests in flight)

  // "http://127.0.0.1:PORT" ("https://HOST:PORT" with TLS).
  virtual std::string url() const = 0;
  // A login link for `user`: it works once, within link_s.
  virtual std::string grant(const std::string& user, bool admin) = 0;
};

// Loads the module and listens on host:port; throws TransportError naming the address when it
// cannot, ConfigError naming the files when the certificate or key will not do, Error when the
// module cannot be loaded.
std::unique_ptr<Dashboard> open_dashboard(DashboardOptions options, HeadAsk ask);

// The module's entry (twinkle_dashboard_open_v1): 0 and `*out` set, or the kind of error thrown
// (1 ConfigError, 2 TransportError, 3 any other) with its message in `error`. No exception
// crosses the module's edge.
using DashboardOpen = int (*)(DashboardOptions* options, HeadAsk* ask, Dashboard** out,
                              std::string* error);

}  // namespace twinkle::core::cluster
