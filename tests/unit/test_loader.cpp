#include <catch2/catch.hpp>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "plugins/loader.hpp"
#include "twinkle/errors.hpp"
#include "twinkle/value.hpp"

using twinkle::PluginError;
using twinkle::Value;
using twinkle::plugins::Plugin;

namespace {

std::string load_error(const std::string& path) {
  try {
    Plugin::load(path);
  } catch (const PluginError& e) {
    return e.what();
  }
  FAIL("no PluginError for " << path);
  return {};
}

// What a plugin function wrote to its sink.
struct Captured {
  std::optional<Value> value;
  std::string error;
  twk_sink_v1 sink() {
    return {this,
            [](void* t, const twk_value_v1* v) {
              static_cast<Captured*>(t)->value = twinkle::decode(*v);
            },
            [](void* t, const char* m) { static_cast<Captured*>(t)->error = m; }};
  }
};

std::vector<std::string> logged;

twk_host_v1 test_host() {
  twk_host_v1 h{};
  h.size = sizeof h;
  h.abi_version = TWK_ABI_VERSION;
  h.log = [](void*, int32_t, const char* m) { logged.emplace_back(m); };
  return h;
}

twk_context_v1 test_context(int rank) {
  twk_context_v1 c{};
  c.size = sizeof c;
  c.rank = rank;
  c.world_size = 2;
  c.job = "unit";
  c.group = "model";
  c.device = "cpu";
  return c;
}

std::filesystem::path temp_file(const std::string& name, const std::string& bytes) {
  auto p = std::filesystem::temp_directory_path() /
           ("twinkle-loader-" + std::to_string(getpid()) + "-" + name);
  std::ofstream(p, std::ios::binary) << bytes;
  return p;
}

}  // namespace

TEST_CASE("a good plugin's table is read with its metadata", "[loader]") {
  Plugin p = Plugin::load(FIXTURE_GOOD);
  CHECK(p.name() == "good");
  CHECK(p.version() == "1.2.3");
  CHECK(p.abi_version() == 1);
  REQUIRE(p.classes().size() == 2);
  const auto* echo = p.find_class("Echo");
  REQUIRE(echo);
  CHECK(echo->execute == twinkle::Execute::all);
  REQUIRE(echo->methods.size() == 6);
  const auto* m = echo->find_method("echo");
  REQUIRE(m);
  CHECK(m->dispatch == twinkle::Dispatch::slice_dp);
  CHECK(m->collect == twinkle::Collect::flatten);
  CHECK(m->execute == twinkle::Execute::all);
  CHECK(m->execute_from_class);
  CHECK(m->timeout_s == 5);
  CHECK(m->retries == 0);
  CHECK(echo->find_method("whoami")->retries == 3);
  const auto* add = echo->find_method("add");
  CHECK(add->execute == twinkle::Execute::first);
  CHECK_FALSE(add->execute_from_class);
  CHECK(echo->find_method("nothing")->execute == twinkle::Execute::peer);
  const auto* count = echo->find_method("count");
  CHECK(count->dispatch == twinkle::Dispatch::custom);
  CHECK(count->custom_dispatch == "halves");
  CHECK(count->custom_collect == "largest");
  CHECK(p.find_class("Throws")->execute == twinkle::Execute::first);
  CHECK(p.find_class("Nope") == nullptr);
  CHECK(p.drivers().size() == 2);
  CHECK(p.find_driver("main"));
  CHECK(p.find_dispatcher("halves"));
  CHECK(p.find_collector("largest"));
}

TEST_CASE("trampolines call the methods and turn exceptions into error codes", "[loader]") {
  Plugin p = Plugin::load(FIXTURE_GOOD);
  const auto* echo = p.find_class("Echo");
  twk_host_v1 host = test_host();
  twk_context_v1 ctx = test_context(1);
  void* self = nullptr;
  Captured err;
  twk_sink_v1 err_sink = err.sink();
  auto no_args = twinkle::encode(Value::list());
  REQUIRE(echo->construct(&host, &ctx, no_args.view(), &self, &err_sink) == TWK_OK);
  REQUIRE(self);

  auto call = [&](const char* method, const Value& args) {
    Captured out;
    twk_sink_v1 sink = out.sink();
    auto e = twinkle::encode(args);
    int32_t rc = echo->find_method(method)->invoke(self, &host, &ctx, e.view(), &sink);
    CHECK(rc == (out.error.empty() ? TWK_OK : TWK_ERROR));
    return out;
  };

  auto who = call("whoami", Value::list());
  REQUIRE(who.value);
  CHECK((*who.value)["rank"].as<int>() == 1);
  CHECK((*who.value)["group"].as<std::string>() == "model");

  auto tensor = twinkle::Tensor::from(std::vector<float>{1, 2, 3, 4, 5, 6}, {3, 2});
  auto echoed = call("echo", Value::list({Value::map({{"t", tensor}, {"s", "x"}})}));
  REQUIRE(echoed.value);
  CHECK((*echoed.value)["t"].tensor().equals(tensor));

  CHECK(call("add", Value::list({1.5, 2})).value->as<double>() == 3.5);
  CHECK(call("count", Value::list({Value::list({1, 2, 3})})).value->as<int>() == 3);
  CHECK(call("nothing", Value::list()).value->is_null());

  auto boom = call("boom", Value::list({"why"}));
  CHECK(boom.error == "boom: why");
  CHECK_FALSE(boom.value);

  auto wrong = call("add", Value::list({1.0}));
  CHECK(wrong.error == "takes 2 argument(s), got 1");
  auto wrong_type = call("add", Value::list({"a", 1}));
  CHECK(wrong_type.error == "value is string, not double");

  // State: save gives the map, load takes it back (and its errors come back as errors).
  REQUIRE(echo->save);
  REQUIRE(echo->load);
  Captured saved;
  twk_sink_v1 save_sink = saved.sink();
  REQUIRE(echo->save(self, &host, &ctx, &save_sink) == TWK_OK);
  REQUIRE(saved.value);
  CHECK((*saved.value)["rank"].as<int>() == 1);
  auto state = twinkle::encode(Value::map({{"rank", 7}}));
  Captured load_err;
  twk_sink_v1 load_sink = load_err.sink();
  REQUIRE(echo->load(self, &host, &ctx, state.view(), &load_sink) == TWK_OK);
  Captured again;
  twk_sink_v1 again_sink = again.sink();
  REQUIRE(echo->save(self, &host, &ctx, &again_sink) == TWK_OK);
  CHECK((*again.value)["rank"].as<int>() == 7);
  auto bad_state = twinkle::encode(Value::list());
  REQUIRE(echo->load(self, &host, &ctx, bad_state.view(), &load_sink) == TWK_ERROR);
  CHECK(load_err.error == "state has no rank");
  CHECK_FALSE(p.find_class("Throws")->save);

  echo->destruct(self);

  const auto* throws = p.find_class("Throws");
  void* bad = nullptr;
  Captured cerr;
  twk_sink_v1 csink = cerr.sink();
  CHECK(throws->construct(&host, &ctx, no_args.view(), &bad, &csink) == TWK_ERROR);
  CHECK(cerr.error == "constructor refuses");
  CHECK(bad == nullptr);
}

TEST_CASE("driver entries, custom dispatch and collect run through the ABI", "[loader]") {
  Plugin p = Plugin::load(FIXTURE_GOOD);
  twk_host_v1 host = test_host();
  twk_context_v1 ctx = test_context(-1);
  Captured err;
  twk_sink_v1 sink = err.sink();
  logged.clear();
  CHECK(p.find_driver("main")(&host, &ctx, &sink) == TWK_OK);
  CHECK(logged == std::vector<std::string>{"hello from unit"});
  CHECK(p.find_driver("fails")(&host, &ctx, &sink) == TWK_ERROR);
  CHECK(err.error == "driver gave up");

  Captured d;
  twk_sink_v1 ds = d.sink();
  auto args = twinkle::encode(Value::list({Value::list({10, 11, 12, 13, 14})}));
  REQUIRE(p.find_dispatcher("halves")(2, 1, nullptr, args.view(), &ds) == TWK_OK);
  CHECK(*d.value == Value::list({Value::list({11, 13})}));

  std::vector<twinkle::EncodedValue> enc;
  for (int v : {3, 9, 4}) enc.push_back(twinkle::encode(Value(v)));
  std::vector<twk_value_v1> views;
  for (auto& e : enc) views.push_back(*e.view());
  Captured c;
  twk_sink_v1 cs = c.sink();
  REQUIRE(p.find_collector("largest")(views.data(), 3, nullptr, &cs) == TWK_OK);
  CHECK(c.value->as<int>() == 9);
}

TEST_CASE("broken plugins are refused with the file and the reason", "[loader]") {
  CHECK(load_error(FIXTURE_WRONG_ABI) == std::string(FIXTURE_WRONG_ABI) +
                                             ": plugin ABI version 99 is not known to this twinkle "
                                             "(it knows 1); rebuild the plugin against this "
                                             "twinkle's SDK");
  CHECK_THAT(load_error(FIXTURE_NO_SYMBOL),
             Catch::StartsWith(std::string(FIXTURE_NO_SYMBOL) +
                               ": no symbol twinkle_plugin_v1; add TWINKLE_PLUGIN"));
  CHECK_THAT(load_error(FIXTURE_SMALL_TABLE),
             Catch::Contains("plugin table is 16 bytes, smaller than"));
  CHECK(load_error(FIXTURE_DUP_METHOD) ==
        std::string(FIXTURE_DUP_METHOD) +
            ": class Model method step is declared twice; give each method of a "
            "class a unique name");
  CHECK(load_error(FIXTURE_DUP_CLASS) ==
        std::string(FIXTURE_DUP_CLASS) +
            ": class Model is declared twice; give each class a unique name");
  CHECK_THAT(
      load_error(FIXTURE_BAD_ENUM),
      Catch::Contains("class Model method step: collect value 42 is unknown (known: 0 none"));
  CHECK_NOTHROW(Plugin::load(FIXTURE_OK));
}

TEST_CASE("a plugin built with the first release's class layout is read entry by entry",
          "[loader]") {
  // Its class entries are 56 bytes, this header's 72: indexing by sizeof(twk_class_v1) would
  // read the second class from the middle of the first.
  Plugin p = Plugin::load(FIXTURE_OLD_CLASSES);
  REQUIRE(p.classes().size() == 2);
  CHECK(p.classes()[0].name == "Model");
  CHECK(p.classes()[1].name == "Other");
  CHECK(p.classes()[1].execute == twinkle::Execute::first);
  CHECK_FALSE(p.classes()[1].save);
}

TEST_CASE("files that are not plugins", "[loader]") {
  CHECK(load_error("/nonexistent/libx.so") ==
        "/nonexistent/libx.so: no such plugin file; build the plugin or fix job.plugin");
  auto text = temp_file("text.so", "this is a text file\n");
  CHECK(load_error(text.string()) ==
        text.string() + ": not a shared library (no ELF header); build the plugin as a .so");
  std::string arm(64, '\0');
  std::memcpy(arm.data(),
              "\x7f"
              "ELF",
              4);
  arm[4] = 2;           // 64-bit
  arm[16] = 3;          // ET_DYN
  arm[18] = char(183);  // EM_AARCH64
  auto foreign = temp_file("arm.so", arm);
#if defined(__x86_64__)
  CHECK(load_error(foreign.string()) ==
        foreign.string() + ": built for aarch64, this machine is x86-64; rebuild the plugin here");
#endif
  auto truncated = temp_file("trunc.so", std::string("\x7f"
                                                     "ELF",
                                                     4) +
                                             std::string(60, '\2'));
  CHECK_THAT(load_error(truncated.string()), Catch::StartsWith(truncated.string() + ": "));
  CHECK_THAT(load_error(std::filesystem::temp_directory_path().string()),
             Catch::Contains("is a directory"));
  std::filesystem::remove(text);
  std::filesystem::remove(foreign);
  std::filesystem::remove(truncated);
}
