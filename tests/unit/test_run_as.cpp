// Users apart (core/runtime/run_as): the --run-as text, which account a member runs as and the
// error when it has none, folders others cannot pass, and, as root, giving a tree to an account
// and becoming it for good.
#include <catch2/catch.hpp>

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "core/runtime/run_as.hpp"
#include "twinkle/errors.hpp"

using namespace twinkle;
using namespace twinkle::core;
namespace fs = std::filesystem;

namespace {

std::string parse_error(const std::string& text) {
  try {
    RunAs::parse(text);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

std::string account_error(const RunAs& r, const std::string& user) {
  try {
    r.account_for(user);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

// A fresh folder under the system's temporary folder, removed at the end.
struct TempDir {
  fs::path path;
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "twinkle-run-as.XXXXXX").string();
    path = ::mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

}  // namespace

TEST_CASE("--run-as maps members to accounts, or each to its own name", "[run_as]") {
  CHECK_FALSE(RunAs::parse("").enabled());
  const RunAs map = RunAs::parse("alice=nobody,bob=daemon");
  REQUIRE(map.enabled());
  const Account a = map.account_for("alice");
  CHECK(a.name == "nobody");
  CHECK(a.uid == find_account("nobody").uid);
  CHECK(map.account_for("bob").name == "daemon");
  CHECK(map.describe() == "alice as nobody, bob as daemon");

  const RunAs autos = RunAs::parse("auto");
  REQUIRE(autos.enabled());
  CHECK(autos.account_for("nobody").name == "nobody");
}

TEST_CASE("a malformed --run-as is refused with the fix", "[run_as]") {
  CHECK_THAT(parse_error("alice"), Catch::Contains("\"alice\" is not MEMBER=ACCOUNT") &&
                                       Catch::Contains("alice=alice,bob=tw-bob, or auto"));
  CHECK_THAT(parse_error("alice=nobody,"), Catch::Contains("\"\" is not MEMBER=ACCOUNT"));
  CHECK_THAT(parse_error("=nobody"), Catch::Contains("is not MEMBER=ACCOUNT"));
  CHECK_THAT(parse_error("a=nobody,a=daemon"), Catch::Contains("member a is mapped twice"));
  CHECK_THAT(parse_error("alice=root"), Catch::Contains("alice maps to root, which is root"));
  CHECK_THAT(parse_error("alice=no-such-account-tw"),
             Catch::Contains("no Unix account no-such-account-tw") &&
                 Catch::Contains("useradd no-such-account-tw"));
}

TEST_CASE("a member without an account is refused, naming the fix", "[run_as]") {
  const RunAs map = RunAs::parse("alice=nobody,bob=daemon");
  CHECK(account_error(map, "carol") ==
        "member carol has no Unix account on this node (--run-as maps alice, bob); add "
        "carol=ACCOUNT to the node's --run-as");
  const RunAs autos = RunAs::parse("auto");
  CHECK_THAT(account_error(autos, "root"), Catch::Contains("would run as root, which is root"));
  CHECK_THAT(account_error(autos, "no-such-member-tw"),
             Catch::Contains("runs as the Unix account no-such-member-tw (--run-as auto), which "
                             "this node does not have"));
  // A member name is never a path or an option.
  for (const char* bad : {"../etc", "-x", "a b", "job/5", ""})
    CHECK_THAT(account_error(autos, bad), Catch::Contains("cannot run as an account of that name"));
}

TEST_CASE("a folder others cannot pass is found on the way", "[run_as]") {
  TempDir t;
  const fs::path inner = t.path / "a" / "b";
  fs::create_directories(inner);
  fs::permissions(t.path, fs::perms::owner_all | fs::perms::others_exec);
  fs::permissions(t.path / "a", fs::perms::owner_all);
  const auto closed = closed_to_others(inner);
  REQUIRE(closed);
  CHECK(*closed == t.path / "a");
  fs::permissions(t.path / "a", fs::perms::owner_all | fs::perms::others_exec);
  CHECK_FALSE(closed_to_others(inner));
  // What is not made yet is not closed: it is made with a mode of our choosing.
  CHECK_FALSE(closed_to_others(inner / "not" / "yet"));
}

TEST_CASE("a node says whether it keeps users apart", "[run_as]") {
  const std::string none = describe_users(RunAs::parse(""));
  const std::string mapped = describe_users(RunAs::parse("alice=nobody"));
  if (geteuid() == 0) {
    CHECK(none == "not apart: every job runs as root here (no --run-as)");
    CHECK(mapped == "apart: alice as nobody");
  } else {
    CHECK_THAT(none, Catch::StartsWith("not apart: this node runs as") &&
                         Catch::EndsWith("not root, and so does every job"));
    CHECK(mapped == none);
  }
}

TEST_CASE("as root: a tree is given to an account, without set-user bits", "[run_as]") {
  if (geteuid() != 0) {
    WARN("not root: chown is not possible here");
    return;
  }
  TempDir t;
  const Account nobody = find_account("nobody");
  const fs::path root = t.path / "work";
  fs::create_directories(root / "sub");
  std::ofstream(root / "sub" / "tool") << "x";
  ::chmod((root / "sub" / "tool").c_str(), 04755);
  fs::create_symlink("/etc/hostname", root / "link");
  give_tree(root, nobody);
  struct stat st {};
  REQUIRE(::stat(root.c_str(), &st) == 0);
  CHECK(st.st_uid == nobody.uid);
  CHECK((st.st_mode & 07777) == 0700);
  REQUIRE(::stat((root / "sub" / "tool").c_str(), &st) == 0);
  CHECK(st.st_uid == nobody.uid);
  CHECK((st.st_mode & 07000) == 0);
  // A link is given itself, never what it points at.
  REQUIRE(::lstat((root / "link").c_str(), &st) == 0);
  CHECK(st.st_uid == nobody.uid);
  REQUIRE(::stat("/etc/hostname", &st) == 0);
  CHECK(st.st_uid == 0);
}

TEST_CASE("as root: become turns a process into the account for good", "[run_as]") {
  if (geteuid() != 0) {
    WARN("not root: there is no other account to become");
    return;
  }
  const Account nobody = find_account("nobody");
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    int code = 0;
    try {
      become("nobody");
      if (getuid() != nobody.uid || geteuid() != nobody.uid)
        code = 10;
      else if (getgid() != nobody.gid)
        code = 11;
      else if (setuid(0) == 0)
        code = 12;
      else if (umask(0) != 077)
        code = 13;
      else if (std::string(std::getenv("USER")) != "nobody")
        code = 14;
      else if (std::string(std::getenv("HOME")) != nobody.home.string())
        code = 15;
    } catch (...) {
      code = 20;
    }
    _exit(code);
  }
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}
