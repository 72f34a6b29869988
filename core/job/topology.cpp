#include "core/job/topology.hpp"

#include <algorithm>

#include <fmt/format.h>

namespace twinkle::core {

size_t display_width(std::string_view s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

std::string format_rank_list(const std::vector<int>& ranks) {
  auto join = [&](size_t from, size_t to) {
    std::string s = "[";
    for (size_t i = from; i < to; ++i) s += (i > from ? ", " : "") + std::to_string(ranks[i]);
    return s + "]";
  };
  if (ranks.size() <= 16) return join(0, ranks.size());
  return fmt::format("{} ... {} ({} total)", join(0, 6), join(ranks.size() - 3, ranks.size()),
                     ranks.size());
}

namespace {

constexpr size_t kWidth = 80;
constexpr size_t kInner = kWidth - 2;
constexpr int kMaxRows = 6;
constexpr int kMaxCols = 10;

struct Glyphs {
  const char *dtl, *dh, *dtr, *dv, *dbl, *dbr;
  const char *tl, *h, *tr, *v, *tee_l, *tee_r, *bl, *br;
  const char *diamond, *rtl, *rtr, *rbl, *rbr, *hdots, *vdots, *arrow, *ellipsis;
};

constexpr Glyphs kUnicode{"╔", "═", "╗", "║", "╚", "╝", "┌", "─", "┐", "│", "├", "┤",
                          "└", "┘", "◈", "╭", "╮", "╰", "╯", "⋯", "⋮", "→", "…"};
constexpr Glyphs kAscii{"+", "=", "+", "|", "+", "+", "+", "-",   "+", "|",  "+",  "+",
                        "+", "+", "*", "+", "+", "+", "+", "...", ":", "->", "..."};

std::string repeat(const char* g, size_t n) {
  std::string s;
  for (size_t i = 0; i < n; ++i) s += g;
  return s;
}

class Canvas {
 public:
  explicit Canvas(const Glyphs& g) : g_(g) {}

  // Cuts `text` to `width` columns, marking the cut.
  std::string fit(std::string text, size_t width) const {
    if (display_width(text) <= width) return text;
    const size_t mark = display_width(g_.ellipsis);
    std::string out;
    size_t cols = 0;
    for (size_t i = 0; i < text.size();) {
      size_t len = 1;
      unsigned char c = static_cast<unsigned char>(text[i]);
      if (c >= 0xF0)
        len = 4;
      else if (c >= 0xE0)
        len = 3;
      else if (c >= 0xC0)
        len = 2;
      if (cols + 1 + mark > width) break;
      out.append(text, i, len);
      ++cols;
      i += len;
    }
    return out + g_.ellipsis;
  }

  void raw(std::string line) { out_ += line + "\n"; }
  void row(const std::string& content) {
    std::string c = fit(content, kInner);
    out_ += std::string(g_.v) + c + std::string(kInner - display_width(c), ' ') + g_.v + "\n";
  }
  void rule(const char* left, const char* right) {
    raw(std::string(left) + repeat(g_.h, kInner) + right);
  }

  const std::string& text() const { return out_; }

 private:
  const Glyphs& g_;
  std::string out_;
};

std::string gpu_text(const WorkerPlacement& w, const NodeResources& local, bool planned) {
  if (w.gpus.empty()) return "cpu";
  std::string ids;
  for (size_t i = 0; i < w.gpus.size(); ++i) ids += (i ? "," : "") + std::to_string(w.gpus[i]);
  std::string s = fmt::format("GPU {}", ids);
  if (!planned && w.gpus.size() == 1) {
    for (const auto& g : local.gpus) {
      if (g.index == w.gpus[0] && !g.name.empty()) {
        s += fmt::format(" ({}{})", g.name,
                         g.memory_bytes ? ", " + format_bytes(g.memory_bytes) : "");
      }
    }
  }
  return s;
}

void render_mesh(Canvas& c, const Glyphs& g, const GroupSpec& group, bool ascii) {
  const DeviceMesh& m = group.mesh;
  const auto& dims = m.dims();
  c.row(fmt::format("   {}{} DeviceMesh: {}", g.tl, g.h, group.name));
  c.row(fmt::format("   {}  Dimensions : {}", g.v, m.dimensions_text(ascii)));
  c.row(fmt::format("   {}  Parallelism: {}", g.v, m.parallelism_text()));
  if (dims.size() > 2) {
    std::string shape;
    for (const auto& d : dims) shape += (shape.empty() ? "" : ", ") + std::to_string(d.size);
    c.row(fmt::format("   {}  Shape      : ({})", g.v, shape));
  }
  c.row(fmt::format("   {}", g.v));

  // Columns run along the innermost dimension; rows along all the others, row-major.
  const int cols = dims.back().size;
  const int rows = m.world_size() / cols;
  std::string row_axis;
  for (size_t i = 0; i + 1 < dims.size(); ++i)
    row_axis += (row_axis.empty() ? "" : ",") + dims[i].name;
  c.row(fmt::format("   {}{} Mesh Layout:{}", g.bl, g.h,
                    row_axis.empty()
                        ? fmt::format(" columns {}", dims.back().name)
                        : fmt::format(" rows {}, columns {}", row_axis, dims.back().name)));

  auto pick = [](int n, int cap) {
    std::vector<int> v;  // -1 marks the elision
    if (n <= cap) {
      for (int i = 0; i < n; ++i) v.push_back(i);
    } else {
      for (int i = 0; i < cap - 1; ++i) v.push_back(i);
      v.push_back(-1);
      v.push_back(n - 1);
    }
    return v;
  };
  size_t w = 2;
  for (int r = 0; r < m.world_size(); ++r) w = std::max(w, std::to_string(r).size());
  const int fit_cols = static_cast<int>((kInner - 12 - 1) / (w + 3));
  auto row_ids = pick(rows, kMaxRows);
  auto col_ids = pick(cols, std::min(kMaxCols, fit_cols));

  auto cell = [&](const std::string& s) {
    return " " + s + std::string(w > display_width(s) ? w - display_width(s) : 0, ' ') + " ";
  };
  std::string header(12, ' ');
  for (int col : col_ids) header += " " + cell(col < 0 ? g.hdots : std::to_string(col)).substr(1);
  c.row(header);
  std::string top = std::string(11, ' ') + g.rtl, bottom = std::string(11, ' ') + g.rbl;
  for (size_t i = 0; i < col_ids.size(); ++i) {
    const bool last = i + 1 == col_ids.size();
    top += repeat(g.h, w + 2) + (last ? g.rtr : g.h);
    bottom += repeat(g.h, w + 2) + (last ? g.rbr : g.h);
  }
  c.row(top);
  for (int r : row_ids) {
    std::string label;
    if (r < 0) {
      label = g.vdots;
    } else if (dims.size() == 1) {
      label = "";
    } else {
      // Coordinates of the row along the outer dimensions.
      auto coords = m.coords(r * cols);
      for (size_t i = 0; i + 1 < coords.size(); ++i)
        label += (i ? "," : "") + std::to_string(coords[i]);
    }
    std::string line =
        std::string(10 - std::min<size_t>(10, display_width(label)), ' ') + label + " " + g.v;
    for (int col : col_ids) {
      std::string v =
          (r < 0 || col < 0) ? (r < 0 ? g.vdots : g.hdots) : std::to_string(r * cols + col);
      line += cell(v) + g.v;
    }
    c.row(line);
  }
  c.row(bottom);
}

void render_group(Canvas& c, const Glyphs& g, const GroupPlacement& gp, const Placement& p,
                  bool ascii) {
  const GroupSpec& group = *gp.group;
  c.rule(g.tl, g.tr);
  c.row(fmt::format(" {} DeviceGroup: {}", g.diamond, group.name));
  c.rule(g.tee_l, g.tee_r);
  c.row(fmt::format("   {}{} Device Type : {}", g.tee_l, g.h, to_string(group.device)));
  c.row(fmt::format("   {}{} Ranks       : {}", g.tee_l, g.h, format_rank_list(group.ranks)));

  std::vector<int> nodes;
  for (const auto& w : gp.workers) {
    if (std::find(nodes.begin(), nodes.end(), w.node) == nodes.end()) nodes.push_back(w.node);
  }
  std::string where;
  for (int n : nodes) where += (where.empty() ? "" : ", ") + p.nodes[n].host;
  std::string summary =
      fmt::format("{} worker{} on {}", gp.workers.size(), gp.workers.size() == 1 ? "" : "s", where);
  if (group.device == DeviceType::cuda) {
    summary += fmt::format(", {} GPU{} each", group.gpus_per_worker,
                           group.gpus_per_worker == 1 ? "" : "s");
  }
  c.row(fmt::format("   {}{} Placement   : {}", g.bl, g.h, summary));
  if (group.device == DeviceType::cuda || nodes.size() > 1) {
    const bool planned = !p.nodes.empty() && p.nodes[0].planned;
    std::vector<int> shown;
    const int n = static_cast<int>(gp.workers.size());
    if (n <= 16) {
      for (int i = 0; i < n; ++i) shown.push_back(i);
    } else {
      for (int i = 0; i < 6; ++i) shown.push_back(i);
      shown.push_back(-1);
      for (int i = n - 3; i < n; ++i) shown.push_back(i);
    }
    size_t rw = std::to_string(group.ranks.empty()
                                   ? 0
                                   : *std::max_element(group.ranks.begin(), group.ranks.end()))
                    .size();
    for (int i : shown) {
      if (i < 0) {
        c.row(fmt::format("        {} ({} more)", g.vdots, n - 9));
        continue;
      }
      const auto& w = gp.workers[i];
      c.row(fmt::format("        rank {:>{}} {} {}  {}", w.rank, rw, g.arrow, p.nodes[w.node].host,
                        gpu_text(w, p.local, planned)));
    }
  }
  c.row("");
  render_mesh(c, g, group, ascii);
  c.rule(g.bl, g.br);
}

}  // namespace

std::string render_topology(const Job& job, const Placement& p, TopologyStyle style) {
  const Glyphs& g = style.ascii ? kAscii : kUnicode;
  Canvas c(g);
  const std::string title = "DEVICE PLACEMENT TOPOLOGY";
  const size_t left = (kInner - title.size()) / 2;
  c.raw(std::string(g.dtl) + repeat(g.dh, kInner) + g.dtr);
  c.raw(std::string(g.dv) + std::string(left, ' ') + title +
        std::string(kInner - left - title.size(), ' ') + g.dv);
  c.raw(std::string(g.dbl) + repeat(g.dh, kInner) + g.dbr);

  int workers = 0;
  for (const auto& gr : job.groups) workers += gr.workers();
  std::string summary = fmt::format(
      " job {} {} mode {} {} {} group{}, {} worker{}", job.name, g.h, to_string(job.mode), g.h,
      job.groups.size(), job.groups.size() == 1 ? "" : "s", workers, workers == 1 ? "" : "s");
  if (job.mode == Mode::local) {
    summary += fmt::format(" {} {}: {} CPUs, {} GPU{}", g.h, p.local.hostname, p.local.cpus,
                           p.local.gpus.size(), p.local.gpus.size() == 1 ? "" : "s");
    if (p.local.gpu_source != GpuSource::none)
      summary += fmt::format(" ({})", to_string(p.local.gpu_source));
  } else {
    summary += fmt::format(" {} {} node{}", g.h, p.nodes.size(), p.nodes.size() == 1 ? "" : "s");
    const bool planned = !p.nodes.empty() && p.nodes[0].planned;
    if (planned && job.nproc_per_node) summary += fmt::format(" of {} GPUs", job.nproc_per_node);
    summary += planned ? " (planned)" : " (reserved)";
  }
  Canvas tmp(g);
  std::string out = c.text() + tmp.fit(summary, kWidth) + "\n";
  for (const auto& gp : p.groups) {
    Canvas box(g);
    render_group(box, g, gp, p, style.ascii);
    out += "\n" + box.text();
  }
  return out;
}

nlohmann::json topology_json(const Job& job, const Placement& p) {
  using nlohmann::json;
  json j;
  j["job"] = job.name;
  j["file"] = job.file.string();
  j["mode"] = std::string(to_string(job.mode));
  j["world_size"] = job.world_size();
  j["gpu_source"] = std::string(to_string(p.local.gpu_source));
  j["nodes"] = json::array();
  for (const auto& n : p.nodes) {
    json node = {{"host", n.host}, {"planned", n.planned}};
    if (!n.id.empty()) {
      node["id"] = n.id;
      node["address"] = n.address;
    }
    j["nodes"].push_back(std::move(node));
  }
  j["groups"] = json::array();
  for (const auto& gp : p.groups) {
    const GroupSpec& g = *gp.group;
    const DeviceMesh& m = g.mesh;
    json dims = json::array();
    for (const auto& d : m.dims()) dims.push_back({{"name", d.name}, {"size", d.size}});
    json workers = json::array();
    for (const auto& w : gp.workers) {
      json coords = json::object();
      for (const auto& d : m.dims()) coords[d.name] = m.coord(w.index, d.name);
      if (m.ep() > 1) coords["ep"] = m.coord(w.index, "ep");
      workers.push_back({{"rank", w.rank},
                         {"index", w.index},
                         {"node", w.node},
                         {"host", p.nodes[w.node].host},
                         {"gpus", w.gpus},
                         {"coords", coords},
                         {"data_rank", m.data_rank(w.index)}});
    }
    j["groups"].push_back({{"name", g.name},
                           {"device", std::string(to_string(g.device))},
                           {"gpus_per_worker", g.gpus_per_worker},
                           {"ranks", g.ranks},
                           {"mesh",
                            {{"dims", dims},
                             {"ep", m.ep()},
                             {"world_size", m.world_size()},
                             {"data_world", m.data_world()},
                             {"last_pp_ranks", m.last_pp_ranks()}}},
                           {"workers", workers}});
  }
  return j;
}

}  // namespace twinkle::core
