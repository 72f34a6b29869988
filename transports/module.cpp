#include "transports/module.hpp"

#include <dlfcn.h>

#include <cstdlib>
#include <filesystem>
#include <map>
#include <mutex>
#include <vector>

#include <fmt/format.h>

#include "twinkle/errors.hpp"
#include "twinkle_config.h"

namespace twinkle::transport {

void* module_symbol(const std::string& name, const char* symbol) {
  static std::mutex mu;
  static std::map<std::string, void*> handles;  // never closed: code from them may still run
  std::lock_guard lock(mu);
  void*& handle = handles[name];
  std::string tried;
  if (!handle) {
    std::error_code ec;
    const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
    std::vector<std::filesystem::path> places;
    if (const char* dir = std::getenv("TWINKLE_MODULE_DIR"); dir && *dir)
      places.push_back(std::filesystem::path(dir) / name);
    if (!ec) places.push_back(exe.parent_path() / name);
    places.push_back(std::filesystem::path(TWINKLE_MODULE_DIR) / name);
    std::string reasons;
    for (const auto& p : places) {
      if (!std::filesystem::exists(p, ec)) {
        tried += (tried.empty() ? "" : ", ") + p.string();
        continue;
      }
      handle = ::dlopen(p.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (handle) break;
      const char* e = ::dlerror();
      reasons += fmt::format("; {}: {}", p.string(), e ? e : "dlopen failed");
    }
    if (!handle) {
      handles.erase(name);
      throw TransportError(fmt::format("cannot load {} (looked in {}{}); reinstall twinkle", name,
                                       tried.empty() ? "nothing" : tried, reasons));
    }
  }
  void* s = ::dlsym(handle, symbol);
  if (!s) throw TransportError(fmt::format("{} has no {}; reinstall twinkle", name, symbol));
  return s;
}

}  // namespace twinkle::transport
