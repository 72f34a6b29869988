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

class Dashboard {
 public:
  // Listens on host:port; throws TransportError naming the address when it cannot, ConfigError
  // naming the files when the certificate or key will not do.
  Dashboard(DashboardOptions options, HeadAsk ask);
  Dashboard(const Dashboard&) = delete;
  Dashboard& operator=(const Dashboard&) = delete;
  // Stops serving (waits for requests in flight).
  ~Dashboard();

  // "http://127.0.0.1:PORT" ("https://HOST:PORT" with TLS).
  std::string url() const;
  // A login link for `user`: it works once, within link_s.
  std::string grant(const std::string& user, bool admin);

 private:
  struct State;
  std::unique_ptr<State> s_;
};

}  // namespace twinkle::core::cluster
