#pragma once

#include <cstdlib>
#include <string>

#include <CLI/CLI.hpp>

#include "core/cluster/security.hpp"

namespace twinkle::cli {

// The flags every command that talks to a cluster shares: where the head is and which keys to use.
struct ClusterFlags {
  std::string address;
  core::cluster::KeyOptions keys;

  // --address, else `job_address` (the job file's), else TWINKLE_ADDRESS; "" when none.
  std::string resolve(const std::string& job_address = "") const {
    if (!address.empty()) return address;
    if (!job_address.empty()) return job_address;
    const char* env = std::getenv("TWINKLE_ADDRESS");
    return env ? env : "";
  }
};

inline void add_cluster_flags(CLI::App* sub, ClusterFlags& f, bool address = true) {
  if (address) {
    sub->add_option("--address", f.address,
                    "The cluster's head, tcp://HOST:PORT (default: the job's address, else "
                    "TWINKLE_ADDRESS)");
  }
  sub->add_option("--key", f.keys.key,
                  "This member's key pair file (default: TWINKLE_KEY, else ~/.twinkle/twinkle.key "
                  "when it exists)");
  sub->add_option("--head-key", f.keys.head_key,
                  "The head's public key, or a file holding it (default: TWINKLE_HEAD_KEY, else "
                  "~/.twinkle/head.pub)");
  sub->add_flag("--insecure", f.keys.insecure,
                "Allow plaintext beyond loopback (anyone who reaches the cluster can run code)");
}

}  // namespace twinkle::cli
