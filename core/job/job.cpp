#include "core/job/job.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <sstream>

#include <fmt/format.h>
#include <toml++/toml.h>

#include "core/job/size.hpp"
#include "twinkle/errors.hpp"
#include "twinkle/fd.hpp"

namespace twinkle::core {

std::string_view to_string(Mode m) { return m == Mode::local ? "local" : "remote"; }
std::string_view to_string(DeviceType d) { return d == DeviceType::cpu ? "cpu" : "cuda"; }

std::string_view to_string(PlacementStrategy s) {
  switch (s) {
    case PlacementStrategy::pack: return "pack";
    case PlacementStrategy::spread: return "spread";
    case PlacementStrategy::strict_pack: return "strict_pack";
    case PlacementStrategy::strict_spread: return "strict_spread";
  }
  return "pack";
}

std::optional<PlacementStrategy> placement_strategy(std::string_view text) {
  for (auto s : {PlacementStrategy::pack, PlacementStrategy::spread, PlacementStrategy::strict_pack,
                 PlacementStrategy::strict_spread}) {
    if (text == to_string(s)) return s;
  }
  return std::nullopt;
}

const GroupSpec* Job::find_group(std::string_view n) const {
  for (const auto& g : groups) {
    if (g.name == n) return &g;
  }
  return nullptr;
}

int Job::world_size() const {
  int top = -1;
  for (const auto& g : groups) {
    for (int r : g.ranks) top = std::max(top, r);
  }
  return top + 1;
}

std::optional<std::string> closest_match(std::string_view word,
                                         const std::vector<std::string>& candidates) {
  auto distance = [](std::string_view a, std::string_view b) {
    std::vector<size_t> row(b.size() + 1);
    for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
    for (size_t i = 1; i <= a.size(); ++i) {
      size_t diag = row[0];
      row[0] = i;
      for (size_t j = 1; j <= b.size(); ++j) {
        size_t up = row[j];
        row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
        diag = up;
      }
    }
    return row[b.size()];
  };
  auto common_prefix = [&](std::string_view c) {
    size_t n = 0;
    while (n < c.size() && n < word.size() && c[n] == word[n]) ++n;
    return n;
  };
  // Ties go to the candidate that shares the longer prefix: "tpp" means "tp", not "pp".
  std::optional<std::string> best;
  size_t best_d = std::max<size_t>(2, word.size() / 3) + 1;
  for (const auto& c : candidates) {
    size_t d = distance(word, c);
    if (d < best_d || (best && d == best_d && common_prefix(c) > common_prefix(*best))) {
      best_d = d;
      best = c;
    }
  }
  return best;
}

Override parse_override(std::string_view text) {
  auto eq = text.find('=');
  if (eq == std::string_view::npos || eq == 0) {
    throw ConfigError(
        fmt::format("--set {}: expected SECTION.KEY=VALUE, for example --set job.seed=7 or --set "
                    "group.model.ranks=8",
                    text));
  }
  return Override{std::string(text.substr(0, eq)), std::string(text.substr(eq + 1))};
}

namespace {

bool is_collectives_backend(std::string_view v) { return v == "auto" || v == "shm" || v == "gloo"; }

// [args] (or any TOML node) as a Value: tables become maps, arrays lists, dates and times their
// TOML text.
Value to_value(const toml::node& node) {
  switch (node.type()) {
    case toml::node_type::table: {
      Value m = Value::map();
      for (auto&& [k, v] : *node.as_table()) m[k.str()] = to_value(v);
      return m;
    }
    case toml::node_type::array: {
      Value l = Value::list();
      for (auto&& v : *node.as_array()) l.push_back(to_value(v));
      return l;
    }
    case toml::node_type::string: return Value(*node.value<std::string>());
    case toml::node_type::integer: return Value(*node.value<std::int64_t>());
    case toml::node_type::floating_point: return Value(*node.value<double>());
    case toml::node_type::boolean: return Value(*node.value<bool>());
    default: {
      std::ostringstream s;
      node.visit([&](auto&& v) { s << v; });
      return Value(s.str());
    }
  }
}

constexpr std::string_view kOverridePrefix = "--set ";

// A name from the file as it can be shown on a terminal: control bytes escaped, long ones cut.
std::string printable(std::string_view s) {
  std::string out;
  for (std::size_t i = 0; i < s.size() && i < 40; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20 || c >= 0x7f) {
      out += fmt::format("\\x{:02x}", c);
    } else {
      out += static_cast<char>(c);
    }
  }
  if (s.size() > 40) out += fmt::format("... ({} bytes)", s.size());
  return out;
}

bool valid_group_name(std::string_view s) {
  if (s.empty() || s.size() > kMaxGroupName) return false;
  return std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
           c == '.' || c == '-';
  });
}

// Before parsing: a dotted key of more than kMaxDepth parts on one line (a.a.a... = 1 or
// [a.a.a...]) would build a document so deep that freeing it overflows the stack, even when the
// parse fails. Counts the dots of each key outside strings; values (after '=') are not looked at.
void check_key_depth(std::string_view text, const std::string& file) {
  std::size_t line = 1;
  std::size_t pos = 0;
  bool in_multiline = false;
  std::string_view closer;
  while (pos < text.size()) {
    std::size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    std::string_view l = text.substr(pos, end - pos);
    if (in_multiline) {
      if (l.find(closer) != std::string_view::npos) in_multiline = false;
    } else {
      int dots = 0;
      char quote = 0;
      for (std::size_t i = 0; i < l.size(); ++i) {
        const char c = l[i];
        if (quote) {
          if (c == '\\' && quote == '"')
            ++i;
          else if (c == quote)
            quote = 0;
          continue;
        }
        if (c == '"' || c == '\'')
          quote = c;
        else if (c == '#' || c == '=')
          break;
        else if (c == '.' && ++dots >= kMaxDepth) {
          throw ConfigError(fmt::format(
              "{}:{}:{}: a key nests deeper than {} levels; TOML tables and values may nest at "
              "most {} deep",
              file, line, i + 1, kMaxDepth, kMaxDepth));
        }
      }
      // A multi-line string opened on this line and not closed on it.
      for (std::string_view q : {std::string_view(R"(""")"), std::string_view("'''")}) {
        std::size_t n = 0;
        for (std::size_t at = l.find(q); at != std::string_view::npos; at = l.find(q, at + 3)) ++n;
        if (n % 2 == 1) {
          in_multiline = true;
          closer = q;
          break;
        }
      }
    }
    pos = end + 1;
    ++line;
  }
}

// The deepest node below `root` past kMaxDepth levels, or null. Iterative: the document may be
// deeper than the stack allows recursion.
const toml::node* too_deep(const toml::node& root) {
  std::vector<std::pair<const toml::node*, int>> work{{&root, 0}};
  while (!work.empty()) {
    auto [n, depth] = work.back();
    work.pop_back();
    if (depth > kMaxDepth) return n;
    if (auto t = n->as_table()) {
      for (auto&& [k, v] : *t) work.push_back({&v, depth + 1});
    } else if (auto a = n->as_array()) {
      for (auto&& v : *a) work.push_back({&v, depth + 1});
    }
  }
  return nullptr;
}

// Frees a document without recursion, for one too deep to free the ordinary way.
void free_flat(toml::table&& root) {
  std::vector<std::unique_ptr<toml::node>> work;
  work.push_back(std::make_unique<toml::table>(std::move(root)));
  while (!work.empty()) {
    std::unique_ptr<toml::node> n = std::move(work.back());
    work.pop_back();
    auto take = [&](toml::node& child) {
      if (auto t = child.as_table()) work.push_back(std::make_unique<toml::table>(std::move(*t)));
      if (auto a = child.as_array()) work.push_back(std::make_unique<toml::array>(std::move(*a)));
    };
    if (auto t = n->as_table()) {
      for (auto&& [k, v] : *t) take(v);
    } else if (auto a = n->as_array()) {
      for (auto&& v : *a) take(v);
    }
  }
}

// Validates one parsed document and builds the Job. Every failure throws ConfigError located at
// the offending node.
class JobReader {
 public:
  explicit JobReader(std::string file) : file_(std::move(file)) {}

  std::string where(const toml::node& n, std::string_view path) const {
    const auto& src = n.source();
    if (src.path && src.path->starts_with(kOverridePrefix)) return *src.path;
    if (src.begin.line == 0) return fmt::format("{}{}", kOverridePrefix, path);
    return fmt::format("{}:{}:{}", file_, src.begin.line, src.begin.column);
  }

  [[noreturn]] void fail(const toml::node& n, std::string_view path, const std::string& msg) const {
    throw ConfigError(fmt::format("{}: {}", where(n, path), msg));
  }

  // `section` names the table in messages; `path` is its dotted path for --set locations.
  void check_keys(const toml::table& t, std::string_view section,
                  const std::vector<std::string>& allowed, std::string_view path = {}) const {
    if (path.empty()) path = section;
    for (auto&& [k, v] : t) {
      if (std::find(allowed.begin(), allowed.end(), k.str()) != allowed.end()) continue;
      std::string msg = section.empty() ? fmt::format("unknown section or key \"{}\"", k.str())
                                        : fmt::format("unknown key \"{}\" in {}", k.str(), section);
      if (auto hint = closest_match(k.str(), allowed)) {
        msg += fmt::format("; did you mean \"{}\"?", *hint);
      } else {
        std::string list;
        for (const auto& a : allowed) list += (list.empty() ? "" : ", ") + a;
        msg += fmt::format("; allowed: {}", list);
      }
      fail(v, join(path, k.str()), msg);
    }
  }

  static std::string join(std::string_view a, std::string_view b) {
    return a.empty() ? std::string(b) : fmt::format("{}.{}", a, b);
  }

  static std::string_view type_name(const toml::node& n) {
    switch (n.type()) {
      case toml::node_type::string: return "a string";
      case toml::node_type::integer: return "an integer";
      case toml::node_type::floating_point: return "a number";
      case toml::node_type::boolean: return "a boolean";
      case toml::node_type::array: return "a list";
      case toml::node_type::table: return "a table";
      default: return "a date or time";
    }
  }

  std::string get_string(const toml::node& n, std::string_view path) const {
    if (auto s = n.value<std::string>(); s && n.is_string()) return *s;
    fail(n, path, fmt::format("{} must be a string, not {}", path, type_name(n)));
  }

  std::int64_t get_int(const toml::node& n, std::string_view path) const {
    if (n.is_integer()) return *n.value<std::int64_t>();
    fail(n, path, fmt::format("{} must be an integer, not {}", path, type_name(n)));
  }

  int get_positive_int(const toml::node& n, std::string_view path,
                       std::int64_t max = kMaxRanks) const {
    auto v = get_int(n, path);
    if (v < 1) fail(n, path, fmt::format("{} must be a positive integer, not {}", path, v));
    if (v > max) fail(n, path, fmt::format("{} must be at most {}, not {}", path, max, v));
    return static_cast<int>(v);
  }

  double get_number(const toml::node& n, std::string_view path) const {
    if (n.is_integer()) return static_cast<double>(*n.value<std::int64_t>());
    if (n.is_floating_point()) return *n.value<double>();
    fail(n, path, fmt::format("{} must be a number, not {}", path, type_name(n)));
  }

  const toml::table& get_table(const toml::node& n, std::string_view path) const {
    if (auto t = n.as_table()) return *t;
    fail(n, path, fmt::format("{} must be a table, not {}", path, type_name(n)));
  }

  Job read(const toml::table& root, const std::filesystem::path& file) {
    Job job;
    job.file = file;
    check_keys(root, "", {"job", "group", "args", "notify"});

    const toml::node* job_node = root.get("job");
    if (!job_node) {
      throw ConfigError(fmt::format(
          "{}: missing [job] section; add one with at least plugin = \"libNAME.so\"", file_));
    }
    read_job(get_table(*job_node, "job"), job);

    const toml::node* groups = root.get("group");
    if (!groups) {
      throw ConfigError(fmt::format(
          "{}: no [[group]] defined; add one, e.g. [[group]] name = \"model\" ranks = 2", file_));
    }
    const toml::array* arr = groups->as_array();
    if (!arr || !arr->is_array_of_tables()) {
      fail(*groups, "group", "group must be an array of tables: write each one as [[group]]");
    }
    int next_rank = 0;
    std::map<int, std::string> owner;
    for (size_t i = 0; i < arr->size(); ++i) {
      GroupSpec g = read_group(*(*arr)[i].as_table(), fmt::format("group[{}]", i), next_rank);
      for (const auto& other : job.groups) {
        if (other.name == g.name) {
          throw ConfigError(
              fmt::format("{}: group \"{}\" is defined twice; give each [[group]] a unique name",
                          g.where.text, g.name));
        }
      }
      for (int r : g.ranks) {
        if (auto it = owner.find(r); it != owner.end()) {
          throw ConfigError(
              fmt::format("{}: group \"{}\": ranks overlap group \"{}\" (rank {}); give each group "
                          "its own ranks",
                          g.ranks_where.text, g.name, it->second, r));
        }
        owner[r] = g.name;
        next_rank = std::max(next_rank, r + 1);
      }
      // The default: a live copy from a replica where the lost rank has one and only it is
      // replaced; else the newest checkpoint when there are checkpoints; else a fresh start.
      if (g.recover.empty()) {
        g.recover = g.restart == "worker" && g.mesh.size("dp") > 1 ? "peer"
                    : job.checkpoint_dir.empty()                   ? "none"
                                                                   : "checkpoint";
      }
      if (g.recover == "checkpoint" && job.checkpoint_dir.empty()) {
        throw ConfigError(fmt::format(
            "{}: group \"{}\": recover = \"checkpoint\" needs job.checkpoint_dir (where the "
            "checkpoints are)",
            g.where.text, g.name));
      }
      job.groups.push_back(std::move(g));
    }

    if (const toml::node* args = root.get("args")) job.args = to_value(get_table(*args, "args"));
    if (const toml::node* notify = root.get("notify"))
      job.notify = read_notify(get_table(*notify, "notify"));
    return job;
  }

  void read_job(const toml::table& t, Job& job) {
    check_keys(t, "job",
               {"name", "mode", "plugin", "driver", "seed", "timeout_s", "collectives", "address",
                "nproc_per_node", "queue_timeout_s", "placement", "launcher", "checkpoint_dir",
                "checkpoint_keep", "resume", "stop_grace_s", "preemptible", "driver_labels"});
    job.name = job.file.stem().string();
    if (auto n = t.get("name")) {
      job.name = get_string(*n, "job.name");
      if (job.name.empty()) fail(*n, "job.name", "job.name must not be empty");
    }
    if (auto n = t.get("mode")) {
      auto m = get_string(*n, "job.mode");
      if (m == "local") {
        job.mode = Mode::local;
      } else if (m == "remote") {
        job.mode = Mode::remote;
      } else {
        auto hint = closest_match(m, {"local", "remote"});
        fail(*n, "job.mode",
             fmt::format("job.mode must be \"local\" or \"remote\", not \"{}\"{}", m,
                         hint ? fmt::format("; did you mean \"{}\"?", *hint) : std::string()));
      }
    }
    const toml::node* plugin = t.get("plugin");
    if (!plugin) {
      throw ConfigError(fmt::format(
          "{}: [job] has no plugin; add plugin = \"libNAME.so\" (a path relative to the job file)",
          file_));
    }
    job.plugin = get_string(*plugin, "job.plugin");
    job.plugin_where = SourceRef{where(*plugin, "job.plugin")};
    if (job.plugin.empty())
      fail(*plugin, "job.plugin", "job.plugin must name the plugin's .so file");
    std::filesystem::path p(job.plugin);
    job.plugin_path = p.is_absolute() ? p : (job.file.parent_path() / p).lexically_normal();
    if (auto n = t.get("driver")) {
      job.driver = get_string(*n, "job.driver");
      if (job.driver.empty()) fail(*n, "job.driver", "job.driver must not be empty");
    }
    if (auto n = t.get("seed")) job.seed = get_int(*n, "job.seed");
    if (auto n = t.get("timeout_s")) {
      job.timeout_s = get_number(*n, "job.timeout_s");
      if (!(job.timeout_s > 0 && job.timeout_s <= kMaxTimeoutS)) {
        fail(*n, "job.timeout_s",
             fmt::format("job.timeout_s must be more than 0 and at most {:g} (7 days), not {}",
                         kMaxTimeoutS, job.timeout_s));
      }
    }
    if (auto n = t.get("collectives")) {
      job.collectives = get_string(*n, "job.collectives");
      if (!is_collectives_backend(job.collectives)) {
        auto hint = closest_match(job.collectives, {"auto", "shm", "gloo"});
        fail(*n, "job.collectives",
             fmt::format("job.collectives must be \"auto\", \"shm\" or \"gloo\", not \"{}\"{}",
                         job.collectives,
                         hint ? fmt::format("; did you mean \"{}\"?", *hint) : std::string()));
      }
    }
    if (auto n = t.get("address")) {
      job.address = get_string(*n, "job.address");
      if (!job.address.starts_with("tcp://")) {
        fail(*n, "job.address",
             fmt::format("job.address must look like tcp://HOST:PORT, not \"{}\"", job.address));
      }
    }
    if (auto n = t.get("nproc_per_node"))
      job.nproc_per_node = get_positive_int(*n, "job.nproc_per_node");
    if (auto n = t.get("queue_timeout_s")) {
      job.queue_timeout_s = get_number(*n, "job.queue_timeout_s");
      if (!(job.queue_timeout_s >= 0 && job.queue_timeout_s <= kMaxTimeoutS)) {
        fail(*n, "job.queue_timeout_s",
             fmt::format("job.queue_timeout_s must be at least 0 and at most {:g} (7 days), not {}",
                         kMaxTimeoutS, job.queue_timeout_s));
      }
    }
    if (auto n = t.get("placement")) job.placement = read_strategy(*n, "job.placement");
    if (auto n = t.get("preemptible")) {
      if (!n->is_boolean()) {
        fail(*n, "job.preemptible",
             "job.preemptible must be true (the job may borrow idle capacity and be preempted) or "
             "false (it never borrows)");
      }
      job.preemptible = n->value<bool>().value_or(true);
    }
    if (auto n = t.get("driver_labels")) {
      for (const auto& [k, v] : get_table(*n, "job.driver_labels")) {
        job.driver_labels[std::string(k.str())] =
            get_string(v, "job.driver_labels." + std::string(k.str()));
      }
    }
    read_checkpoints(t, job);
    if (auto n = t.get("launcher")) {
      job.launcher = get_string(*n, "job.launcher");
      if (job.launcher != "slurm" && job.launcher != "local") {
        fail(*n, "job.launcher",
             fmt::format("job.launcher must be \"slurm\" (inside a Slurm allocation) or "
                         "\"local\", not \"{}\"",
                         job.launcher));
      }
      if (job.launcher == "local") job.launcher.clear();
      // Under Slurm the allocation is the cluster: the job runs in remote mode.
      if (job.launcher == "slurm") job.mode = Mode::remote;
    }
  }

  void read_checkpoints(const toml::table& t, Job& job) const {
    if (auto n = t.get("checkpoint_dir")) {
      const std::string dir = get_string(*n, "job.checkpoint_dir");
      if (dir.empty()) {
        fail(*n, "job.checkpoint_dir",
             "job.checkpoint_dir must name a folder (relative to the job file); leave it out for "
             "no checkpoints");
      }
      const std::filesystem::path p(dir);
      job.checkpoint_dir = p.is_absolute() ? p : (job.file.parent_path() / p).lexically_normal();
    }
    if (auto n = t.get("checkpoint_keep")) {
      job.checkpoint_keep = get_positive_int(*n, "job.checkpoint_keep");
      if (job.checkpoint_keep > kMaxCheckpointKeep) {
        fail(*n, "job.checkpoint_keep",
             fmt::format("job.checkpoint_keep must be 1 to {}, not {}", kMaxCheckpointKeep,
                         job.checkpoint_keep));
      }
    }
    if (auto n = t.get("resume")) {
      const std::string v = get_string(*n, "job.resume");
      if (v != "auto" && v != "never") {
        auto hint = closest_match(v, {"auto", "never"});
        fail(*n, "job.resume",
             fmt::format("job.resume must be \"auto\" (resume from the newest checkpoint when "
                         "there is one) or \"never\", not \"{}\"{}",
                         v, hint ? fmt::format("; did you mean \"{}\"?", *hint) : std::string()));
      }
      job.resume_auto = v == "auto";
      if (job.resume_auto && job.checkpoint_dir.empty()) {
        fail(*n, "job.resume",
             "job.resume = \"auto\" needs job.checkpoint_dir: the folder to resume from");
      }
    }
    if (auto n = t.get("stop_grace_s")) {
      job.stop_grace_s = get_number(*n, "job.stop_grace_s");
      if (!(job.stop_grace_s >= 0 && job.stop_grace_s <= kMaxTimeoutS)) {
        fail(*n, "job.stop_grace_s",
             fmt::format("job.stop_grace_s must be at least 0 and at most {:g} (7 days), not {}",
                         kMaxTimeoutS, job.stop_grace_s));
      }
    }
  }

  PlacementStrategy read_strategy(const toml::node& n, const std::string& path) const {
    const std::string v = get_string(n, path);
    if (auto s = placement_strategy(v)) return *s;
    auto hint = closest_match(v, {"pack", "spread", "strict_pack", "strict_spread"});
    fail(n, path,
         fmt::format("{} must be \"pack\", \"spread\", \"strict_pack\" or \"strict_spread\", "
                     "not \"{}\"{}",
                     path, v, hint ? fmt::format("; did you mean \"{}\"?", *hint) : std::string()));
  }

  GroupSpec read_group(const toml::table& t, const std::string& path, int next_rank) {
    GroupSpec g;
    g.where = SourceRef{where(t, path)};
    auto declared_name = t["name"].value<std::string>();
    check_keys(t, "[[group]]",
               {"name", "ranks", "device", "gpus_per_worker", "mesh", "placement", "labels",
                "memory", "max_restarts", "restart", "restart_window_s", "recover"},
               declared_name ? "group." + *declared_name : path);
    const toml::node* name = t.get("name");
    if (!name)
      throw ConfigError(
          fmt::format("{}: [[group]] has no name; add name = \"model\"", g.where.text));
    g.name = get_string(*name, path + ".name");
    if (!valid_group_name(g.name)) {
      fail(*name, path + ".name",
           fmt::format("group name \"{}\" is not allowed: use 1 to {} letters, digits, '_', '.' "
                       "or '-'",
                       printable(g.name), kMaxGroupName));
    }
    const std::string gp = fmt::format("group.{}", g.name);
    const std::string label = fmt::format("group \"{}\"", g.name);

    const toml::node* ranks = t.get("ranks");
    if (!ranks) {
      throw ConfigError(fmt::format(
          "{}: {} has no ranks; add ranks = N (the next N ranks) or a list", g.where.text, label));
    }
    g.ranks_where = SourceRef{where(*ranks, gp + ".ranks")};
    if (ranks->is_integer()) {
      int n = get_positive_int(*ranks, gp + ".ranks");
      if (next_rank + static_cast<std::int64_t>(n) > kMaxRanks) {
        fail(*ranks, gp + ".ranks",
             fmt::format("{}: ranks {} to {} go past the highest rank, {}; a job has at most {} "
                         "ranks",
                         label, next_rank, next_rank + static_cast<std::int64_t>(n) - 1,
                         kMaxRanks - 1, kMaxRanks));
      }
      for (int i = 0; i < n; ++i) g.ranks.push_back(next_rank + i);
    } else if (auto list = ranks->as_array()) {
      if (list->empty())
        fail(*ranks, gp + ".ranks", fmt::format("{}: ranks must not be empty", label));
      if (list->size() > static_cast<std::size_t>(kMaxRanks)) {
        fail(*ranks, gp + ".ranks",
             fmt::format("{}: a job has at most {} ranks", label, kMaxRanks));
      }
      std::set<int> seen;
      for (auto&& item : *list) {
        if (!item.is_integer() || *item.value<std::int64_t>() < 0) {
          fail(item, gp + ".ranks", fmt::format("{}: ranks must be non-negative integers", label));
        }
        if (*item.value<std::int64_t>() >= kMaxRanks) {
          fail(item, gp + ".ranks",
               fmt::format("{}: rank {} is out of range; ranks go from 0 to {}", label,
                           *item.value<std::int64_t>(), kMaxRanks - 1));
        }
        int r = static_cast<int>(*item.value<std::int64_t>());
        if (!seen.insert(r).second) {
          fail(item, gp + ".ranks", fmt::format("{}: rank {} is listed twice", label, r));
        }
        g.ranks.push_back(r);
      }
    } else {
      fail(*ranks, gp + ".ranks",
           fmt::format("{}: ranks must be an integer or a list of integers, not {}", label,
                       type_name(*ranks)));
    }

    if (auto n = t.get("device")) {
      auto d = get_string(*n, gp + ".device");
      if (d == "cpu") {
        g.device = DeviceType::cpu;
      } else if (d == "cuda") {
        g.device = DeviceType::cuda;
      } else if (d == "npu") {
        fail(*n, gp + ".device",
             fmt::format(
                 "{}: device \"npu\" is reserved and not supported yet; use \"cpu\" or \"cuda\"",
                 label));
      } else {
        auto hint = closest_match(d, {"cpu", "cuda"});
        fail(*n, gp + ".device",
             fmt::format("{}: device must be \"cpu\" or \"cuda\", not \"{}\"{}", label, d,
                         hint ? fmt::format("; did you mean \"{}\"?", *hint) : std::string()));
      }
    }
    if (auto n = t.get("gpus_per_worker")) {
      g.gpus_per_worker = get_positive_int(*n, gp + ".gpus_per_worker", kMaxGpusPerWorker);
      if (g.device != DeviceType::cuda) {
        fail(*n, gp + ".gpus_per_worker",
             fmt::format("{}: gpus_per_worker applies to cuda groups only; set device = \"cuda\" "
                         "or remove it",
                         label));
      }
    }
    if (auto n = t.get("memory")) {
      const auto bytes = parse_size(get_string(*n, gp + ".memory"));
      if (!bytes) {
        fail(*n, gp + ".memory",
             fmt::format("{}: memory is each worker's limit as a size such as \"4GiB\" or "
                         "\"512MiB\"",
                         label));
      }
      g.memory = *bytes;
    }
    if (auto n = t.get("placement")) g.placement = read_strategy(*n, gp + ".placement");
    if (auto n = t.get("labels")) {
      for (const auto& [k, v] : get_table(*n, gp + ".labels")) {
        g.labels[std::string(k.str())] = get_string(v, gp + ".labels." + std::string(k.str()));
      }
    }
    if (auto n = t.get("mesh")) {
      g.mesh = read_mesh(get_table(*n, gp + ".mesh"), gp + ".mesh", label, g.workers());
    } else {
      g.mesh = DeviceMesh::data_parallel(g.workers());
    }
    read_restarts(t, gp, label, g);
    return g;
  }

  void read_restarts(const toml::table& t, const std::string& gp, const std::string& label,
                     GroupSpec& g) const {
    if (auto n = t.get("max_restarts")) {
      g.max_restarts = get_int(*n, gp + ".max_restarts");
      if (g.max_restarts < 0 || g.max_restarts > kMaxRestarts) {
        fail(*n, gp + ".max_restarts",
             fmt::format("{}: max_restarts must be 0 to {}, not {}", label, kMaxRestarts,
                         g.max_restarts));
      }
    }
    if (auto n = t.get("restart")) {
      g.restart = get_string(*n, gp + ".restart");
      if (g.restart != "group" && g.restart != "worker") {
        auto hint = closest_match(g.restart, {"group", "worker"});
        fail(*n, gp + ".restart",
             fmt::format("{}: restart must be \"worker\" (only the lost ranks are replaced) or "
                         "\"group\" (every worker of the group), not \"{}\"{}",
                         label, g.restart,
                         hint ? fmt::format("; did you mean \"{}\"?", *hint) : std::string()));
      }
    }
    if (auto n = t.get("restart_window_s")) {
      g.restart_window_s = get_number(*n, gp + ".restart_window_s");
      if (!(g.restart_window_s > 0 && g.restart_window_s <= kMaxTimeoutS)) {
        fail(*n, gp + ".restart_window_s",
             fmt::format("{}: restart_window_s must be more than 0 and at most {:g} (7 days), "
                         "not {}",
                         label, kMaxTimeoutS, g.restart_window_s));
      }
    }
    if (auto n = t.get("recover")) {
      g.recover = get_string(*n, gp + ".recover");
      if (g.recover != "peer" && g.recover != "checkpoint" && g.recover != "none") {
        auto hint = closest_match(g.recover, {"checkpoint", "none", "peer"});
        fail(*n, gp + ".recover",
             fmt::format("{}: recover must be \"peer\", \"checkpoint\" or \"none\", not "
                         "\"{}\"{}",
                         label, g.recover,
                         hint ? fmt::format("; did you mean \"{}\"?", *hint) : std::string()));
      }
      if (g.recover == "peer" && g.restart == "group") {
        fail(*n, gp + ".recover",
             fmt::format("{}: recover = \"peer\" copies the state from a surviving replica, but "
                         "restart = \"group\" replaces every worker of the group; use "
                         "restart = \"worker\", or recover = \"checkpoint\"",
                         label));
      }
      if (g.recover == "peer" && g.mesh.size("dp") < 2) {
        fail(*n, gp + ".recover",
             fmt::format("{}: recover = \"peer\" copies the state from a data-parallel replica, "
                         "but the group's mesh has no dp dimension of 2 or more ({}); use "
                         "recover = \"checkpoint\" or \"none\"",
                         label, g.mesh.dimensions_text(true)));
      }
    }
  }

  DeviceMesh read_mesh(const toml::table& t, const std::string& path, const std::string& label,
                       int workers) {
    std::vector<std::string> allowed = DeviceMesh::canonical_dims();
    allowed.push_back("ep");
    allowed.push_back("order");
    check_keys(t, "mesh", allowed, path);
    std::map<std::string, int> sizes;
    int ep = 1;
    const toml::node* ep_node = nullptr;
    for (const auto& dim : DeviceMesh::canonical_dims()) {
      if (auto n = t.get(dim)) sizes[dim] = get_positive_int(*n, path + "." + dim);
    }
    if ((ep_node = t.get("ep"))) ep = get_positive_int(*ep_node, path + ".ep");
    if (sizes.empty()) {
      fail(t, path,
           fmt::format("{}: mesh has no dimensions; give at least one of pp, dp, fsdp, cp, tp",
                       label));
    }

    std::vector<std::string> order;
    if (auto n = t.get("order")) {
      auto arr = n->as_array();
      if (!arr)
        fail(*n, path + ".order",
             fmt::format("{}: mesh order must be a list of dimension names", label));
      for (auto&& item : *arr) {
        auto name = get_string(item, path + ".order");
        if (!sizes.count(name)) {
          fail(item, path + ".order",
               fmt::format("{}: mesh order names \"{}\", which is not a dimension of this mesh",
                           label, name));
        }
        if (std::find(order.begin(), order.end(), name) != order.end()) {
          fail(item, path + ".order",
               fmt::format("{}: mesh order names \"{}\" twice", label, name));
        }
        order.push_back(name);
      }
      if (order.size() != sizes.size()) {
        fail(*n, path + ".order",
             fmt::format("{}: mesh order must name every dimension of the mesh exactly once",
                         label));
      }
    } else {
      for (const auto& dim : DeviceMesh::canonical_dims()) {
        if (sizes.count(dim)) order.push_back(dim);
      }
    }
    std::vector<MeshDim> dims;
    std::int64_t product = 1;
    for (const auto& name : order) {
      dims.push_back({name, sizes[name]});
      product = std::min<std::int64_t>(product * sizes[name], std::int64_t{1} << 40);
    }
    DeviceMesh probe(dims);
    if (product != workers) {
      fail(t, path,
           fmt::format("{}: mesh {} has {} ranks but the group has {} workers; make the sizes "
                       "multiply to {}",
                       label, probe.dimensions_text(), product, workers, workers));
    }
    if (probe.data_world() % ep != 0) {
      fail(*ep_node, path + ".ep",
           fmt::format("{}: ep={} must divide dp x fsdp = {}", label, ep, probe.data_world()));
    }
    return DeviceMesh(dims, ep);
  }

  NotifySpec read_notify(const toml::table& t) {
    check_keys(t, "notify", {"webhook", "kind", "secret"});
    NotifySpec n;
    const toml::node* hook = t.get("webhook");
    if (!hook)
      fail(t, "notify",
           "[notify] has no webhook; add webhook = \"https://...\" or remove [notify]");
    n.webhook = get_string(*hook, "notify.webhook");
    if (!n.webhook.starts_with("http://") && !n.webhook.starts_with("https://")) {
      fail(*hook, "notify.webhook",
           fmt::format("notify.webhook must be an http:// or https:// URL, not \"{}\"", n.webhook));
    }
    if (auto k = t.get("kind")) {
      n.kind = get_string(*k, "notify.kind");
      if (n.kind != "json" && n.kind != "dingtalk") {
        fail(*k, "notify.kind",
             fmt::format("notify.kind must be \"json\" or \"dingtalk\", not \"{}\"", n.kind));
      }
    }
    if (auto s = t.get("secret")) {
      n.secret = get_string(*s, "notify.secret");
      if (n.kind != "dingtalk")
        fail(*s, "notify.secret",
             "notify.secret signs DingTalk requests; set kind = \"dingtalk\" or remove it");
    }
    return n;
  }

 private:
  std::string file_;
};

// Applies one override to the parsed document before validation, so overridden values are checked
// exactly like the file's own.
void apply_override(toml::table& root, const Override& o, const std::string& file) {
  std::vector<std::string> parts;
  std::stringstream ss(o.key);
  for (std::string part; std::getline(ss, part, '.');) parts.push_back(part);
  const std::string label = fmt::format("{}{}", kOverridePrefix, o.key);
  if (parts.size() < 2 ||
      std::any_of(parts.begin(), parts.end(), [](auto& p) { return p.empty(); })) {
    throw ConfigError(
        fmt::format("{}: expected SECTION.KEY, for example job.seed or group.model.ranks", label));
  }

  toml::table* target = nullptr;
  size_t key_at = 1;
  if (parts[0] == "group") {
    if (parts.size() < 3)
      throw ConfigError(fmt::format("{}: address a group as group.NAME.KEY", label));
    auto* arr = root["group"].as_array();
    std::vector<std::string> names;
    for (size_t i = 0; arr && i < arr->size(); ++i) {
      auto* t = (*arr)[i].as_table();
      auto name = t ? (*t)["name"].value<std::string>() : std::nullopt;
      if (!name) continue;
      names.push_back(*name);
      if (*name == parts[1]) target = t;
    }
    if (!target) {
      auto hint = closest_match(parts[1], names);
      throw ConfigError(
          fmt::format("{}: {} has no group \"{}\"{}", label, file, parts[1],
                      hint ? fmt::format("; did you mean \"{}\"?", *hint) : std::string()));
    }
    key_at = 2;
  } else {
    auto [it, inserted] = root.insert(parts[0], toml::table{});
    target = it->second.as_table();
    if (!target) throw ConfigError(fmt::format("{}: {} is not a section", label, parts[0]));
  }
  for (size_t i = key_at; i + 1 < parts.size(); ++i) {
    auto [it, inserted] = target->insert(parts[i], toml::table{});
    target = it->second.as_table();
    if (!target) throw ConfigError(fmt::format("{}: {} is not a table", label, parts[i]));
  }

  toml::table holder;
  try {
    holder = toml::parse("v = " + o.value, label);
  } catch (const toml::parse_error&) {
    // Not a TOML value: take it as a plain string, still located at the override.
    std::string quoted = "v = \"";
    for (unsigned char ch : o.value) {
      if (ch == '"' || ch == '\\') {
        quoted += '\\';
        quoted += static_cast<char>(ch);
      } else if (ch < 0x20 || ch == 0x7f) {
        quoted += fmt::format("\\u{:04x}", ch);
      } else {
        quoted += static_cast<char>(ch);
      }
    }
    holder = toml::parse(quoted + "\"", label);
  }
  target->insert_or_assign(parts.back(), *holder.get("v"));
}

}  // namespace

Job parse_job(std::string_view text, const std::filesystem::path& file,
              const std::vector<Override>& overrides) {
  const std::string name = file.string();
  check_key_depth(text, name);
  toml::table root;
  try {
    root = toml::parse(text, name);
  } catch (const toml::parse_error& e) {
    throw ConfigError(fmt::format("{}:{}:{}: {}", name, e.source().begin.line,
                                  e.source().begin.column, e.description()));
  }
  auto check_depth = [&](std::string_view after) {
    if (const toml::node* deep = too_deep(root)) {
      const auto& src = deep->source();
      std::string at = src.begin.line
                           ? fmt::format("{}:{}:{}", name, src.begin.line, src.begin.column)
                           : std::string(after);
      free_flat(std::move(root));
      throw ConfigError(fmt::format(
          "{}: a value nests deeper than {} levels; TOML tables and values may nest at most {} "
          "deep",
          at, kMaxDepth, kMaxDepth));
    }
  };
  check_depth(name);
  for (const auto& o : overrides) {
    apply_override(root, o, name);
    check_depth(fmt::format("{}{}", kOverridePrefix, o.key));
  }
  return JobReader(name).read(root, file);
}

Job load_job(const std::filesystem::path& file, const std::vector<Override>& overrides) {
  const std::string p = file.string();
  // O_NONBLOCK: opening a FIFO must not wait for a writer.
  const Fd fd(::open(p.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY));
  if (!fd) {
    const int e = errno;
    throw ConfigError(e == ENOENT || e == ENOTDIR
                          ? fmt::format("{}: no such job file; check the path", p)
                          : fmt::format("{}: cannot read the job file: {}", p, std::strerror(e)));
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0)
    throw ConfigError(fmt::format("{}: cannot read the job file: {}", p, std::strerror(errno)));
  if (!S_ISREG(st.st_mode)) {
    const char* kind = S_ISDIR(st.st_mode)    ? "a directory"
                       : S_ISFIFO(st.st_mode) ? "a FIFO"
                       : S_ISCHR(st.st_mode)  ? "a character device"
                       : S_ISBLK(st.st_mode)  ? "a block device"
                       : S_ISSOCK(st.st_mode) ? "a socket"
                                              : "not a regular file";
    throw ConfigError(
        fmt::format("{}: is {}, not a regular file; give the path of a TOML job file", p, kind));
  }
  if (st.st_size > static_cast<off_t>(kMaxJobFileBytes)) {
    throw ConfigError(fmt::format("{}: the job file is {} bytes, more than the {} allowed", p,
                                  st.st_size, kMaxJobFileBytes));
  }
  // Read to the end, but never more than the limit: the file may grow while we read it.
  std::string text;
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0)
      throw ConfigError(fmt::format("{}: cannot read the job file: {}", p, std::strerror(errno)));
    if (n == 0) break;
    text.append(buf, static_cast<std::size_t>(n));
    if (text.size() > kMaxJobFileBytes) {
      throw ConfigError(
          fmt::format("{}: the job file is more than the {} bytes allowed", p, kMaxJobFileBytes));
    }
  }
  return parse_job(text, file, overrides);
}

std::string collectives_backend(const Job& job, const char* env) {
  if (!env) return job.collectives;
  if (!is_collectives_backend(env)) {
    throw ConfigError(fmt::format(
        "TWINKLE_COLLECTIVES must be \"auto\", \"shm\" or \"gloo\", not \"{}\"; unset it to use "
        "job.collectives (\"{}\")",
        env, job.collectives));
  }
  return env;
}

}  // namespace twinkle::core
