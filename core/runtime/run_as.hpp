#pragma once

#include <sys/types.h>

#include <filesystem>
#include <map>
#include <optional>
#include <string>

// Users apart (docs/ARCHITECTURE.md, Isolation): a node agent or head that runs as root starts
// each member's workers and drivers under a Unix account mapped from the member
// (`--run-as alice=alice,bob=tw-bob`, or `--run-as auto` for the account of the member's name),
// so that what a job writes is readable by its account only.
namespace twinkle::core {

// A Unix account.
struct Account {
  std::string name;
  uid_t uid = 0;
  gid_t gid = 0;
  std::filesystem::path home;
};

// The account `name`. Throws ConfigError naming it when this machine has no such account.
Account find_account(const std::string& name);

// Which account each member's processes run as.
class RunAs {
 public:
  // "" (nobody is mapped: everything runs as this process), "auto", or "alice=alice,bob=tw-bob".
  // Throws ConfigError naming the flag and the fix for a malformed text, an account that does not
  // exist, or one that is root.
  static RunAs parse(const std::string& text);

  bool enabled() const { return auto_ || !map_.empty(); }
  // The account of member `user`. Throws ConfigError saying that `user` has none here, and how
  // to give it one.
  Account account_for(const std::string& user) const;
  // "alice as alice, bob as tw-bob", or "each member as the account of its name (auto)".
  std::string describe() const;

 private:
  bool auto_ = false;
  std::map<std::string, std::string> map_;  // member -> account
};

// How this process keeps users apart, for `twinkle nodes`: "apart: alice as alice, ..." when it
// is root with `run_as`, else "not apart: WHY" (not root, or no --run-as).
std::string describe_users(const RunAs& run_as);

// Turns this process into `account` for good: its supplementary groups, gid and uid (root cannot
// be regained, which is checked), umask 077 (what it writes is its own only), HOME, USER and
// LOGNAME, and its home (or /) as the working directory. Call it before any thread starts and
// before anything of a user (a plugin) is loaded. Throws Error naming the step that failed.
void become(const std::string& account);

// The first folder on the way from / to `path` that other accounts cannot pass (no search
// permission for others), or nullopt when they can reach `path`.
std::optional<std::filesystem::path> closed_to_others(const std::filesystem::path& path);

// Gives the tree at `root` to `account` (lchown: links are not followed) and makes `root` mode
// 0700. Throws Error naming the file that could not be changed.
void give_tree(const std::filesystem::path& root, const Account& account);

}  // namespace twinkle::core
