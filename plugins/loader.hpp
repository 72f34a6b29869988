#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "twinkle/metadata.hpp"
#include "twinkle/plugin.h"

namespace twinkle::plugins {

struct MethodInfo {
  std::string name;
  Dispatch dispatch = Dispatch::all;
  Execute execute = Execute::all;  // the class's when the method says "as the class"
  bool execute_from_class = true;
  Collect collect = Collect::none;
  double timeout_s = 0;  // 0: the job's timeout_s
  std::string custom_dispatch;
  std::string custom_collect;
  twk_invoke_fn invoke = nullptr;
};

struct ClassInfo {
  std::string name;
  Execute execute = Execute::all;
  twk_construct_fn construct = nullptr;
  twk_destruct_fn destruct = nullptr;
  std::vector<MethodInfo> methods;

  const MethodInfo* find_method(std::string_view name) const;
};

template <class Fn>
struct NamedFn {
  std::string name;
  Fn fn = nullptr;
};

// A loaded and validated plugin. Owns the dlopen handle: function pointers it hands out are valid
// while it lives. Move-only; not thread-safe to load, safe to read from several threads.
class Plugin {
 public:
  // Loads `path` and validates its table. Throws PluginError (exit code 3) naming the file and
  // the reason: missing file, not an ELF shared object, another architecture, dlopen failure,
  // missing entry symbol, unknown ABI version, too-small table, duplicate names, unknown enum
  // values, missing functions, custom dispatch/collect names that are not registered.
  static Plugin load(const std::filesystem::path& path);

  Plugin(Plugin&& o) noexcept;
  Plugin& operator=(Plugin&& o) noexcept;
  Plugin(const Plugin&) = delete;
  Plugin& operator=(const Plugin&) = delete;
  ~Plugin();

  const std::filesystem::path& path() const { return path_; }
  const std::string& name() const { return name_; }
  const std::string& version() const { return version_; }
  std::uint32_t abi_version() const { return abi_version_; }
  const std::vector<ClassInfo>& classes() const { return classes_; }
  const std::vector<NamedFn<twk_driver_fn>>& drivers() const { return drivers_; }
  const std::vector<NamedFn<twk_dispatch_fn>>& dispatchers() const { return dispatchers_; }
  const std::vector<NamedFn<twk_collect_fn>>& collectors() const { return collectors_; }

  const ClassInfo* find_class(std::string_view name) const;
  twk_driver_fn find_driver(std::string_view name) const;
  twk_dispatch_fn find_dispatcher(std::string_view name) const;
  twk_collect_fn find_collector(std::string_view name) const;

 private:
  Plugin() = default;
  void close() noexcept;

  void* handle_ = nullptr;
  std::filesystem::path path_;
  std::string name_;
  std::string version_;
  std::uint32_t abi_version_ = 0;
  std::vector<ClassInfo> classes_;
  std::vector<NamedFn<twk_driver_fn>> drivers_;
  std::vector<NamedFn<twk_dispatch_fn>> dispatchers_;
  std::vector<NamedFn<twk_collect_fn>> collectors_;
};

}  // namespace twinkle::plugins
