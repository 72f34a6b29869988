#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
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
  int retries = 0;  // sent again after a restart of its group (twinkle::retry)
};

struct ClassInfo {
  std::string name;
  Execute execute = Execute::all;
  twk_construct_fn construct = nullptr;
  twk_destruct_fn destruct = nullptr;
  // State (TWINKLE_STATE): both or neither.
  twk_save_fn save = nullptr;
  twk_load_fn load = nullptr;
  std::vector<MethodInfo> methods;

  const MethodInfo* find_method(std::string_view name) const;
};

template <class Fn>
struct NamedFn {
  std::string name;
  Fn fn = nullptr;
};

// Limits on what a plugin file and its table may hold (documented in twinkle-inspect(1)).
inline constexpr std::uint64_t kMaxPluginBytes = std::uint64_t{4} << 30;  // 4 GiB
inline constexpr std::uint32_t kMaxTableEntries = 65536;  // classes, methods, drivers, ...
inline constexpr std::size_t kMaxNameBytes = 256;         // class, method, entry names
inline constexpr double kMaxMethodTimeoutS = 7 * 86400.0;

// How long the load check waits for the child by default; TWINKLE_PLUGIN_LOAD_TIMEOUT_S overrides.
inline constexpr std::chrono::milliseconds kDefaultLoadCheckTimeout{10'000};

// Checks the bytes at the start of a plugin file before anything maps it: an ELF header of a
// 64-bit shared object for this machine whose program and section headers and loadable segments
// lie inside the file. `head` is the first bytes of the file (at least the ELF header and the
// program header table; 64 KiB is plenty), `file_size` the whole file's size, `name` names it in
// messages. Throws PluginError. Pure: reads only `head`, so it is safe on any input (fuzzed).
void check_elf_image(const unsigned char* head, std::size_t head_size, std::uint64_t file_size,
                     const std::string& name);

// Opens `path` without blocking (a FIFO must not hang us), requires a regular file of at most
// kMaxPluginBytes and runs check_elf_image on its start. Throws PluginError naming the file.
void check_plugin_file(const std::filesystem::path& path);

// A loaded and validated plugin. Owns the dlopen handle: function pointers it hands out are valid
// while it lives. Move-only; not thread-safe to load, safe to read from several threads.
class Plugin {
 public:
  // Loads `path` and validates its table. Throws PluginError (exit code 3) naming the file and
  // the reason: missing file, not an ELF shared object, another architecture, dlopen failure,
  // missing entry symbol, unknown ABI version, too-small table, duplicate names, unknown enum
  // values, missing functions, custom dispatch/collect names that are not registered.
  static Plugin load(const std::filesystem::path& path);

  // Loads `path` in a short-lived child process first (fork; the child dlopens, calls the entry
  // and reads every field of the table), waits for it at most `timeout`, and reports what the
  // child saw as a PluginError: a constructor or entry that calls exit(N), aborts, crashes or
  // hangs, a file that makes the loader fault (SIGBUS: truncated), a table with garbage pointers.
  // Only then loads it into this process. Blocks up to `timeout`; leaves no process behind.
  static void check_in_child(const std::filesystem::path& path, std::chrono::milliseconds timeout);
  // check_in_child with the default timeout (or TWINKLE_PLUGIN_LOAD_TIMEOUT_S), then load().
  static Plugin load_checked(const std::filesystem::path& path);

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
  // What a load is doing, reported by the load-check child before each step.
  enum class Stage : char { opening = 'o', entry = 'e', table = 't' };
  static Plugin load_reporting(const std::filesystem::path& path, int report_fd);
  // Every custom dispatch and collect a method names is registered (PluginError otherwise).
  void check_custom_functions() const;

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
