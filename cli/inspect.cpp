#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/commands.hpp"
#include "plugins/loader.hpp"

namespace twinkle::cli {

namespace {

struct InspectOptions {
  std::string plugin;
  bool json = false;
};

std::string timeout_text(double t) { return t > 0 ? fmt::format("{:g}s", t) : "job"; }

std::string dispatch_text(const plugins::MethodInfo& m) {
  return m.dispatch == Dispatch::custom ? fmt::format("custom:{}", m.custom_dispatch)
                                        : std::string(to_string(m.dispatch));
}

std::string collect_text(const plugins::MethodInfo& m) {
  return m.collect == Collect::custom ? fmt::format("custom:{}", m.custom_collect)
                                      : std::string(to_string(m.collect));
}

int run_inspect(const InspectOptions& o) {
  plugins::Plugin p = plugins::Plugin::load(o.plugin);
  if (o.json) {
    nlohmann::json classes = nlohmann::json::array();
    for (const auto& c : p.classes()) {
      nlohmann::json methods = nlohmann::json::array();
      for (const auto& m : c.methods) {
        methods.push_back({{"name", m.name},
                           {"dispatch", std::string(to_string(m.dispatch))},
                           {"custom_dispatch", m.custom_dispatch},
                           {"execute", std::string(to_string(m.execute))},
                           {"execute_from_class", m.execute_from_class},
                           {"collect", std::string(to_string(m.collect))},
                           {"custom_collect", m.custom_collect},
                           {"timeout_s", m.timeout_s}});
      }
      classes.push_back(
          {{"name", c.name}, {"execute", std::string(to_string(c.execute))}, {"methods", methods}});
    }
    auto names = [](const auto& v) {
      nlohmann::json a = nlohmann::json::array();
      for (const auto& e : v) a.push_back(e.name);
      return a;
    };
    nlohmann::json j = {{"file", p.path().string()},
                        {"name", p.name()},
                        {"version", p.version()},
                        {"abi_version", p.abi_version()},
                        {"classes", classes},
                        {"drivers", names(p.drivers())},
                        {"dispatchers", names(p.dispatchers())},
                        {"collectors", names(p.collectors())}};
    fmt::print("{}\n", j.dump(2));
    return 0;
  }
  fmt::print("plugin {} {} ({}, ABI {})\n", p.name(), p.version(), p.path().string(),
             p.abi_version());
  for (const auto& c : p.classes()) {
    fmt::print("\nclass {} (execute {})\n", c.name, to_string(c.execute));
    fmt::print("  {:<20} {:<18} {:<8} {:<18} {}\n", "METHOD", "DISPATCH", "EXECUTE", "COLLECT",
               "TIMEOUT");
    for (const auto& m : c.methods) {
      fmt::print("  {:<20} {:<18} {:<8} {:<18} {}\n", m.name, dispatch_text(m),
                 to_string(m.execute), collect_text(m), timeout_text(m.timeout_s));
    }
    if (c.methods.empty()) fmt::print("  (no remote methods)\n");
  }
  auto list = [](const auto& v) {
    std::string s;
    for (const auto& e : v) s += (s.empty() ? "" : ", ") + e.name;
    return s.empty() ? std::string("(none)") : s;
  };
  fmt::print("\ndrivers: {}\n", list(p.drivers()));
  if (!p.dispatchers().empty()) fmt::print("dispatchers: {}\n", list(p.dispatchers()));
  if (!p.collectors().empty()) fmt::print("collectors: {}\n", list(p.collectors()));
  return 0;
}

}  // namespace

void setup_inspect(CLI::App& app, Action& action) {
  auto o = std::make_shared<InspectOptions>();
  auto* sub =
      app.add_subcommand("inspect", "List a plugin's classes, remote methods and driver entries");
  sub->add_option("plugin", o->plugin, "The plugin .so file")->required();
  sub->add_flag("--json", o->json, "Print as JSON for scripts");
  sub->callback([o, &action] { action = [o] { return run_inspect(*o); }; });
}

}  // namespace twinkle::cli
