#include "core/runtime/run_as.hpp"

#include <grp.h>
#include <pwd.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <fmt/format.h>

#include "twinkle/errors.hpp"

namespace twinkle::core {

namespace fs = std::filesystem;

namespace {

std::optional<Account> lookup(const std::string& name) {
  std::vector<char> buf(16384);
  passwd pw{};
  passwd* found = nullptr;
  if (getpwnam_r(name.c_str(), &pw, buf.data(), buf.size(), &found) != 0 || !found)
    return std::nullopt;
  return Account{found->pw_name, found->pw_uid, found->pw_gid, found->pw_dir};
}

std::optional<Account> lookup(uid_t uid) {
  std::vector<char> buf(16384);
  passwd pw{};
  passwd* found = nullptr;
  if (getpwuid_r(uid, &pw, buf.data(), buf.size(), &found) != 0 || !found) return std::nullopt;
  return Account{found->pw_name, found->pw_uid, found->pw_gid, found->pw_dir};
}

[[noreturn]] void fail(const std::string& step, const std::string& account) {
  throw Error(fmt::format("cannot run as the account {}: {} failed: {}", account, step,
                          std::strerror(errno)));
}

}  // namespace

Account find_account(const std::string& name) {
  auto a = lookup(name);
  if (!a) {
    throw ConfigError(fmt::format(
        "this machine has no Unix account {} (getent passwd {}): create it (useradd {}) or map "
        "the member to another account",
        name, name, name));
  }
  return *a;
}

RunAs RunAs::parse(const std::string& text) {
  RunAs r;
  if (text.empty()) return r;
  if (text == "auto") {
    r.auto_ = true;
    return r;
  }
  std::size_t at = 0;
  while (at <= text.size()) {
    std::size_t end = text.find(',', at);
    if (end == std::string::npos) end = text.size();
    const std::string item = text.substr(at, end - at);
    const auto eq = item.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == item.size()) {
      throw ConfigError(fmt::format(
          "--run-as \"{}\": \"{}\" is not MEMBER=ACCOUNT; write alice=alice,bob=tw-bob, or auto "
          "(each member as the account of its name)",
          text, item));
    }
    const std::string member = item.substr(0, eq), account = item.substr(eq + 1);
    if (r.map_.count(member)) {
      throw ConfigError(
          fmt::format("--run-as \"{}\": member {} is mapped twice; keep one", text, member));
    }
    const Account a = find_account(account);
    if (a.uid == 0) {
      throw ConfigError(fmt::format(
          "--run-as \"{}\": {} maps to {}, which is root; users apart need accounts of their own",
          text, member, account));
    }
    r.map_[member] = account;
    at = end + 1;
  }
  return r;
}

Account RunAs::account_for(const std::string& user) const {
  std::string account;
  if (auto m = map_.find(user); m != map_.end()) {
    account = m->second;
  } else if (auto_) {
    account = user;
  } else {
    std::vector<std::string> members;
    for (const auto& [member, _] : map_) members.push_back(member);
    throw ConfigError(fmt::format(
        "member {} has no Unix account on this node (--run-as maps {}); add {}=ACCOUNT to the "
        "node's --run-as",
        user.empty() ? "\"\"" : user, fmt::join(members, ", "), user.empty() ? "NAME" : user));
  }
  // A member name is not a path or an option: only what an account name may hold.
  if (account.empty() ||
      account.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRS"
                                "TUVWXYZ0123456789._-") != std::string::npos ||
      account[0] == '-') {
    throw ConfigError(
        fmt::format("member {} cannot run as an account of that name (--run-as auto); map it: "
                    "--run-as {}=ACCOUNT",
                    user, user));
  }
  auto a = lookup(account);
  if (!a) {
    throw ConfigError(fmt::format(
        "member {} runs as the Unix account {} (--run-as {}), which this node does not have: "
        "create it (useradd {}), or map the member to another account",
        user, account, auto_ && !map_.count(user) ? "auto" : user + "=" + account, account));
  }
  if (a->uid == 0) {
    throw ConfigError(
        fmt::format("member {} would run as {}, which is root; map it to an account of its own "
                    "(--run-as {}=ACCOUNT)",
                    user, account, user));
  }
  return *a;
}

std::string RunAs::describe() const {
  std::vector<std::string> parts;
  for (const auto& [member, account] : map_) parts.push_back(member + " as " + account);
  if (auto_) parts.push_back("each other member as the account of its name (auto)");
  return fmt::format("{}", fmt::join(parts, ", "));
}

std::string describe_users(const RunAs& run_as) {
  const uid_t me = geteuid();
  if (me != 0) {
    const auto a = lookup(me);
    const std::string name = a ? a->name : std::to_string(me);
    return fmt::format("not apart: this node runs as {} (uid {}), not root, and so does every job",
                       name, me);
  }
  if (!run_as.enabled()) return "not apart: every job runs as root here (no --run-as)";
  return "apart: " + run_as.describe();
}

void become(const std::string& name) {
  const Account a = find_account(name);
  if (a.uid == 0) throw Error(fmt::format("refusing to run a job as {}: it is root", name));
  if (initgroups(a.name.c_str(), a.gid) != 0) fail("initgroups", name);
  if (setgid(a.gid) != 0) fail("setgid", name);
  if (setuid(a.uid) != 0) fail("setuid", name);
  if (setuid(0) == 0 || geteuid() == 0 || getegid() == 0) {
    throw Error(fmt::format("cannot run as the account {}: root could be regained", name));
  }
  // A changed uid leaves the process undumpable (its /proc files root's, no core, no debugger);
  // nothing of root's is left in it to protect.
  prctl(PR_SET_DUMPABLE, 1);
  umask(077);
  setenv("HOME", a.home.c_str(), 1);
  setenv("USER", a.name.c_str(), 1);
  setenv("LOGNAME", a.name.c_str(), 1);
  if (a.home.empty() || chdir(a.home.c_str()) != 0) {
    if (chdir("/") != 0) fail("chdir /", name);
  }
}

std::optional<fs::path> closed_to_others(const fs::path& path) {
  const fs::path full = fs::absolute(path).lexically_normal();
  fs::path at = full.root_path();
  for (auto it = full.begin(); it != full.end(); ++it) {
    if (it != full.begin()) at /= *it;
    struct stat st {};
    if (::stat(at.c_str(), &st) != 0) break;  // not made yet: made by us, with a mode we choose
    if (S_ISDIR(st.st_mode) && !(st.st_mode & S_IXOTH)) return at;
  }
  return std::nullopt;
}

void give_tree(const fs::path& root, const Account& a) {
  auto give = [&](const fs::path& p) {
    if (::lchown(p.c_str(), a.uid, a.gid) != 0) {
      throw Error(fmt::format("cannot give {} to the account {}: {}", p.string(), a.name,
                              std::strerror(errno)));
    }
    // No set-user or set-group bit survives (the kernel clears them on chown; said here too).
    struct stat st {};
    if (::lstat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode) && (st.st_mode & (S_ISUID | S_ISGID)))
      ::chmod(p.c_str(), st.st_mode & 0777);
  };
  give(root);
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(root, ec); !ec && it != fs::end(it);
       it.increment(ec))
    give(it->path());
  if (ec) throw Error(fmt::format("cannot read {}: {}", root.string(), ec.message()));
  if (::chmod(root.c_str(), 0700) != 0) {
    throw Error(
        fmt::format("cannot make {} private (mode 0700): {}", root.string(), std::strerror(errno)));
  }
}

}  // namespace twinkle::core
