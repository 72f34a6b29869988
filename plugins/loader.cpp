#include "plugins/loader.hpp"

#include <dlfcn.h>
#include <elf.h>

#include <cstddef>
#include <fstream>
#include <set>
#include <utility>

#include <fmt/format.h>

#include "twinkle/errors.hpp"

namespace twinkle::plugins {

const MethodInfo* ClassInfo::find_method(std::string_view n) const {
  for (const auto& m : methods) {
    if (m.name == n) return &m;
  }
  return nullptr;
}

namespace {

// The table fields every version-1 host needs, up to and including n_drivers.
constexpr std::size_t kMinPluginTable = offsetof(twk_plugin_v1, n_drivers) + sizeof(std::uint32_t);
constexpr std::size_t kMinMethod = offsetof(twk_method_v1, invoke) + sizeof(twk_invoke_fn);
constexpr std::size_t kMinClass = offsetof(twk_class_v1, n_methods) + sizeof(std::uint32_t);

#if defined(__x86_64__)
constexpr int kHostMachine = EM_X86_64;
#elif defined(__aarch64__)
constexpr int kHostMachine = EM_AARCH64;
#else
constexpr int kHostMachine = -1;
#endif

std::string machine_name(int m) {
  switch (m) {
    case EM_X86_64: return "x86-64";
    case EM_AARCH64: return "aarch64";
    case EM_386: return "i386";
    case EM_ARM: return "arm";
    case EM_RISCV: return "riscv";
    case EM_PPC64: return "ppc64";
    default: return fmt::format("machine {}", m);
  }
}

// Checks the file before dlopen so that the common mistakes get a precise message instead of
// dlerror's.
void check_elf(const std::filesystem::path& path) {
  const std::string p = path.string();
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    throw PluginError(
        fmt::format("{}: no such plugin file; build the plugin or fix job.plugin", p));
  }
  if (std::filesystem::is_directory(path, ec)) {
    throw PluginError(
        fmt::format("{}: is a directory; job.plugin must name the plugin's .so file", p));
  }
  std::ifstream in(path, std::ios::binary);
  unsigned char h[20] = {};
  in.read(reinterpret_cast<char*>(h), sizeof h);
  if (in.gcount() < 4 || std::memcmp(h, ELFMAG, SELFMAG) != 0) {
    throw PluginError(
        fmt::format("{}: not a shared library (no ELF header); build the plugin as a .so", p));
  }
  if (in.gcount() < static_cast<std::streamsize>(sizeof h)) {
    throw PluginError(fmt::format("{}: a truncated ELF file; rebuild the plugin", p));
  }
  if (h[EI_CLASS] != ELFCLASS64) {
    throw PluginError(
        fmt::format("{}: a 32-bit ELF file; rebuild the plugin as 64-bit for this machine", p));
  }
  const int type = h[16] | (h[17] << 8);
  const int machine = h[18] | (h[19] << 8);
  if (kHostMachine >= 0 && machine != kHostMachine) {
    throw PluginError(fmt::format("{}: built for {}, this machine is {}; rebuild the plugin here",
                                  p, machine_name(machine), machine_name(kHostMachine)));
  }
  if (type != ET_DYN) {
    throw PluginError(fmt::format(
        "{}: an ELF {} rather than a shared object; build it with shared_module()/-shared", p,
        type == ET_EXEC  ? "executable"
        : type == ET_REL ? "object file"
                         : "file"));
  }
}

template <class T>
bool has_field(std::uint32_t size, std::size_t offset) {
  return size >= offset + sizeof(T);
}

Dispatch to_dispatch(std::int32_t v, const std::string& where) {
  if (v < TWK_DISPATCH_ALL || v > TWK_DISPATCH_CUSTOM) {
    throw PluginError(fmt::format(
        "{}: dispatch value {} is unknown (known: 0 all, 1 slice, 2 slice_dp, 3 custom); "
        "rebuild the plugin against this twinkle's SDK",
        where, v));
  }
  return static_cast<Dispatch>(v);
}

Execute to_execute(std::int32_t v, const std::string& where, bool allow_class) {
  if (v < TWK_EXECUTE_ALL || v > (allow_class ? TWK_EXECUTE_CLASS : TWK_EXECUTE_PEER)) {
    throw PluginError(
        fmt::format("{}: execute value {} is unknown (known: 0 all, 1 first, 2 peer{}); "
                    "rebuild the plugin against this twinkle's SDK",
                    where, v, allow_class ? ", 3 as the class" : ""));
  }
  return v == TWK_EXECUTE_CLASS ? Execute::all : static_cast<Execute>(v);
}

Collect to_collect(std::int32_t v, const std::string& where) {
  if (v < TWK_COLLECT_NONE || v > TWK_COLLECT_CUSTOM) {
    throw PluginError(fmt::format(
        "{}: collect value {} is unknown (known: 0 none, 1 mean, 2 sum, 3 first, "
        "4 last_pp, 5 flatten, 6 custom); rebuild the plugin against this twinkle's SDK",
        where, v));
  }
  return static_cast<Collect>(v);
}

std::string name_or_fail(const char* n, const std::string& what) {
  if (!n || !*n) throw PluginError(fmt::format("{} has no name", what));
  return n;
}

template <class Fn, class Entry>
std::vector<NamedFn<Fn>> read_named(const Entry* entries, std::uint32_t n, const std::string& file,
                                    const char* kind) {
  std::vector<NamedFn<Fn>> out;
  std::set<std::string> seen;
  if (n && !entries)
    throw PluginError(fmt::format("{}: the table lists {} {}s but no array", file, n, kind));
  for (std::uint32_t i = 0; i < n; ++i) {
    std::string name = name_or_fail(entries[i].name, fmt::format("{}: {} {}", file, kind, i));
    if (!seen.insert(name).second) {
      throw PluginError(fmt::format("{}: {} \"{}\" is declared twice; give each a unique name",
                                    file, kind, name));
    }
    if (!entries[i].fn)
      throw PluginError(fmt::format("{}: {} \"{}\" has no function", file, kind, name));
    out.push_back({name, entries[i].fn});
  }
  return out;
}

}  // namespace

Plugin Plugin::load(const std::filesystem::path& path) {
  check_elf(path);
  const std::string file = path.string();
  Plugin p;
  p.path_ = path;
  // A path without a slash would make dlopen search the library path instead of this file.
  const std::string open_path = path.has_parent_path() ? file : "./" + file;
  p.handle_ = dlopen(open_path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!p.handle_) {
    const char* err = dlerror();
    throw PluginError(
        fmt::format("{}: cannot be loaded: {}", file, err ? err : "unknown dlopen error"));
  }
  dlerror();
  void* sym = dlsym(p.handle_, TWK_ENTRY_SYMBOL);
  if (!sym) {
    throw PluginError(fmt::format(
        "{}: no symbol {}; add TWINKLE_PLUGIN(\"name\", \"version\") to one source file of the "
        "plugin "
        "(or export extern \"C\" const twk_plugin_v1* {}(void) with default visibility)",
        file, TWK_ENTRY_SYMBOL, TWK_ENTRY_SYMBOL));
  }
  auto entry = reinterpret_cast<twk_entry_v1_fn>(sym);
  const twk_plugin_v1* t = entry();
  if (!t) throw PluginError(fmt::format("{}: {}() returned no table", file, TWK_ENTRY_SYMBOL));
  if (t->abi_version != TWK_ABI_VERSION) {
    throw PluginError(
        fmt::format("{}: plugin ABI version {} is not known to this twinkle (it knows {}); rebuild "
                    "the plugin against this "
                    "twinkle's SDK",
                    file, t->abi_version, TWK_ABI_VERSION));
  }
  if (t->size < kMinPluginTable) {
    throw PluginError(
        fmt::format("{}: plugin table is {} bytes, smaller than the {} bytes ABI {} requires; the "
                    "table is corrupt or was built by a broken SDK",
                    file, t->size, kMinPluginTable, TWK_ABI_VERSION));
  }
  p.abi_version_ = t->abi_version;
  p.name_ = name_or_fail(t->name, fmt::format("{}: the plugin", file));
  p.version_ = t->version ? t->version : "";

  if (t->n_classes && !t->classes)
    throw PluginError(fmt::format("{}: the table lists classes but no array", file));
  std::set<std::string> class_names;
  for (std::uint32_t i = 0; i < t->n_classes; ++i) {
    const twk_class_v1& c = t->classes[i];
    if (c.size < kMinClass) {
      throw PluginError(fmt::format("{}: class {} table is {} bytes, smaller than {}", file, i,
                                    c.size, kMinClass));
    }
    ClassInfo ci;
    ci.name = name_or_fail(c.name, fmt::format("{}: class {}", file, i));
    const std::string cw = fmt::format("{}: class {}", file, ci.name);
    if (!class_names.insert(ci.name).second) {
      throw PluginError(fmt::format("{} is declared twice; give each class a unique name", cw));
    }
    ci.execute = to_execute(c.execute, cw, false);
    if (!c.construct || !c.destruct) {
      throw PluginError(
          fmt::format("{} has no constructor or destructor; declare it with TWINKLE_CLASS", cw));
    }
    ci.construct = c.construct;
    ci.destruct = c.destruct;
    if (c.n_methods && !c.methods)
      throw PluginError(fmt::format("{} lists methods but no array", cw));
    std::set<std::string> method_names;
    for (std::uint32_t j = 0; j < c.n_methods; ++j) {
      const twk_method_v1& m = c.methods[j];
      if (m.size < kMinMethod) {
        throw PluginError(fmt::format("{}: method {} table is {} bytes, smaller than {}", cw, j,
                                      m.size, kMinMethod));
      }
      MethodInfo mi;
      mi.name = name_or_fail(m.name, fmt::format("{}: method {}", cw, j));
      const std::string mw = fmt::format("{}: class {} method {}", file, ci.name, mi.name);
      if (!method_names.insert(mi.name).second) {
        throw PluginError(
            fmt::format("{} is declared twice; give each method of a class a unique name", mw));
      }
      mi.dispatch = to_dispatch(m.dispatch, mw);
      mi.execute_from_class = m.execute == TWK_EXECUTE_CLASS;
      mi.execute = mi.execute_from_class ? ci.execute : to_execute(m.execute, mw, true);
      mi.collect = to_collect(m.collect, mw);
      if (!(m.timeout_s >= 0))
        throw PluginError(fmt::format("{}: timeout {} must be >= 0", mw, m.timeout_s));
      mi.timeout_s = m.timeout_s;
      if (mi.dispatch == Dispatch::custom) {
        if (!m.custom_dispatch)
          throw PluginError(fmt::format("{}: custom dispatch names no function", mw));
        mi.custom_dispatch = m.custom_dispatch;
      }
      if (mi.collect == Collect::custom) {
        if (!m.custom_collect)
          throw PluginError(fmt::format("{}: custom collect names no function", mw));
        mi.custom_collect = m.custom_collect;
      }
      if (!m.invoke) throw PluginError(fmt::format("{} has no invoke function", mw));
      mi.invoke = m.invoke;
      ci.methods.push_back(std::move(mi));
    }
    p.classes_.push_back(std::move(ci));
  }
  p.drivers_ = read_named<twk_driver_fn>(t->drivers, t->n_drivers, file, "driver entry");
  if (has_field<std::uint32_t>(t->size, offsetof(twk_plugin_v1, n_dispatchers))) {
    p.dispatchers_ =
        read_named<twk_dispatch_fn>(t->dispatchers, t->n_dispatchers, file, "dispatcher");
  }
  if (has_field<std::uint32_t>(t->size, offsetof(twk_plugin_v1, n_collectors))) {
    p.collectors_ = read_named<twk_collect_fn>(t->collectors, t->n_collectors, file, "collector");
  }
  for (const auto& c : p.classes_) {
    for (const auto& m : c.methods) {
      if (!m.custom_dispatch.empty() && !p.find_dispatcher(m.custom_dispatch)) {
        throw PluginError(fmt::format(
            "{}: class {} method {}: custom dispatch \"{}\" is not registered; declare it "
            "with TWINKLE_DISPATCHER",
            file, c.name, m.name, m.custom_dispatch));
      }
      if (!m.custom_collect.empty() && !p.find_collector(m.custom_collect)) {
        throw PluginError(fmt::format(
            "{}: class {} method {}: custom collect \"{}\" is not registered; declare it "
            "with TWINKLE_COLLECTOR",
            file, c.name, m.name, m.custom_collect));
      }
    }
  }
  return p;
}

Plugin::Plugin(Plugin&& o) noexcept { *this = std::move(o); }

Plugin& Plugin::operator=(Plugin&& o) noexcept {
  if (this != &o) {
    close();
    handle_ = std::exchange(o.handle_, nullptr);
    path_ = std::move(o.path_);
    name_ = std::move(o.name_);
    version_ = std::move(o.version_);
    abi_version_ = o.abi_version_;
    classes_ = std::move(o.classes_);
    drivers_ = std::move(o.drivers_);
    dispatchers_ = std::move(o.dispatchers_);
    collectors_ = std::move(o.collectors_);
  }
  return *this;
}

Plugin::~Plugin() { close(); }

void Plugin::close() noexcept {
  if (handle_) dlclose(handle_);
  handle_ = nullptr;
}

const ClassInfo* Plugin::find_class(std::string_view n) const {
  for (const auto& c : classes_) {
    if (c.name == n) return &c;
  }
  return nullptr;
}

template <class Fn>
static Fn find_named(const std::vector<NamedFn<Fn>>& v, std::string_view n) {
  for (const auto& e : v) {
    if (e.name == n) return e.fn;
  }
  return nullptr;
}

twk_driver_fn Plugin::find_driver(std::string_view n) const { return find_named(drivers_, n); }
twk_dispatch_fn Plugin::find_dispatcher(std::string_view n) const {
  return find_named(dispatchers_, n);
}
twk_collect_fn Plugin::find_collector(std::string_view n) const {
  return find_named(collectors_, n);
}

}  // namespace twinkle::plugins
