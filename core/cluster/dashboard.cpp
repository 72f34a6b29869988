#include "core/cluster/dashboard.hpp"

#include <httplib.h>
#include <sodium.h>

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <deque>
#include <fstream>
#include <map>
#include <mutex>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/cluster/dashboard_assets.hpp"
#include "core/cluster/remote_site.hpp"
#include "core/job/digest.hpp"
#include "core/job/json_value.hpp"
#include "core/job/topology.hpp"
#include "core/jobs/archive.hpp"
#include "core/jobs/demand.hpp"
#include "twinkle/errors.hpp"

namespace twinkle::core::cluster {

namespace {

namespace fs = std::filesystem;
namespace proto = transport::proto;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

constexpr auto kSessionIdle = std::chrono::hours(12);  // a session unused this long ends
// The cookie is named after the port (cookies are not scoped by port); the session's key, which
// the page keeps in its origin's localStorage and sends as X-Twinkle-Key, is what another
// server on this machine that receives the cookie does not have.
constexpr const char* kCookie = "twinkle_session_";
constexpr std::size_t kMaxBody = 64 << 10;
constexpr int kPage = 50;       // jobs per page of the list
constexpr int kThreads = 16;    // the server's: requests at once, live logs included
constexpr int kMaxStreams = 8;  // live logs at once (each holds a thread while it is open)
constexpr auto kStreamPoll = std::chrono::milliseconds(250);  // a live log asks this often
constexpr std::size_t kUploadSlack = 16 << 20;  // a submit's form fields and multipart headers
constexpr std::size_t kUploadPiece = 8 << 20;   // bytes of one upload_part to the head
constexpr std::size_t kMaxFiles = 1 << 16;      // files of one submit
constexpr std::size_t kMaxSearched = 64 << 20;  // bytes of log one search reads
constexpr std::size_t kMatchedChars = 4096;     // of each line, for the regular expression
constexpr int kMaxShown = 200;                  // matches one search lists
constexpr int kMaxStreamsEach = 4;              // live logs of one user at once
constexpr int kMaxSubmits = 2;                  // submits from the page at once
constexpr int kMaxReads = 4;                    // searches and downloads at once
constexpr const char* kNoAnswer = "the head did not answer (is it stopping?)";
constexpr const char* kBusyReading =
    "the dashboard is reading as many logs as it may at once (searches and downloads): try again "
    "in a moment";
constexpr const char* kNotLoggedIn =
    "not logged in (or this session's key is missing): run `twinkle dashboard` and open the link "
    "it prints";

std::string random_hex(std::size_t bytes) {
  std::vector<unsigned char> b(bytes);
  randombytes_buf(b.data(), b.size());
  return hex(b.data(), b.size());
}

// Constant-time comparison of secrets of the same length.
bool same_secret(const std::string& a, const std::string& b) {
  return a.size() == b.size() && sodium_memcmp(a.data(), b.data(), a.size()) == 0;
}

// JSON text of `v`; a log's bytes that are not UTF-8 become U+FFFD rather than an exception.
std::string dump(const json& v) { return v.dump(-1, ' ', false, json::error_handler_t::replace); }

void reply_json(httplib::Response& res, int status, const json& body) {
  res.status = status;
  res.set_header("Cache-Control", "no-store");
  res.set_content(dump(body), "application/json");
}

void refuse(httplib::Response& res, int status, const std::string& why) {
  reply_json(res, status, json{{"error", why}});
}

// The job service's answer to a stop or a resume: 200 with its text, or its refusal (403 for
// another member's job, 404 for none, 400 otherwise). Nothing when the head did not answer (the
// response says so already).
void reply_answer(const std::optional<proto::JobAnswer>& answer, httplib::Response& res) {
  if (!answer) return;
  if (answer->error) {
    const int status = answer->error->find("only your own") != std::string::npos ? 403
                       : answer->error->rfind("no job", 0) == 0                  ? 404
                                                                                 : 400;
    return refuse(res, status, *answer->error);
  }
  reply_json(res, 200, json{{"job", answer->job}, {"text", answer->text}});
}

std::string cookie_value(const httplib::Request& req, const std::string& name) {
  const std::string all = req.get_header_value("Cookie");
  std::size_t at = 0;
  while (at < all.size()) {
    std::size_t end = all.find(';', at);
    if (end == std::string::npos) end = all.size();
    std::string part = all.substr(at, end - at);
    const auto first = part.find_first_not_of(' ');
    part = first == std::string::npos ? "" : part.substr(first);
    if (part.rfind(name + "=", 0) == 0) return part.substr(name.size() + 1);
    at = end + 1;
  }
  return "";
}

// The headers of every page: no caching, no framing (the login's button cannot be clicked from
// another site's frame), nothing but this server's own files.
void page_headers(httplib::Response& res) {
  res.set_header("Cache-Control", "no-store");
  res.set_header("X-Frame-Options", "DENY");
  res.set_header("Content-Security-Policy",
                 "default-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'");
}

void link_refused(httplib::Response& res) {
  res.status = 403;
  res.set_content(
      "This login link was used already or has expired (a link works once, within a minute). "
      "Run `twinkle dashboard` for a new one.\n",
      "text/plain; charset=utf-8");
}

std::string html_escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

// The value of `name` in a form's urlencoded body (the login's token: hex digits only).
std::string form_value(const std::string& body, const std::string& name) {
  std::size_t at = 0;
  while (at <= body.size()) {
    std::size_t end = body.find('&', at);
    if (end == std::string::npos) end = body.size();
    const std::string part = body.substr(at, end - at);
    if (part.rfind(name + "=", 0) == 0) {
      std::string v = part.substr(name.size() + 1);
      return v.find_first_not_of("0123456789abcdef") == std::string::npos ? v : "";
    }
    at = end + 1;
  }
  return "";
}

std::optional<std::int64_t> positive(const std::string& text) {
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || v <= 0) return std::nullopt;
  return v;
}

// A label value in Prometheus' text format.
std::string label(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

std::string metrics_text(const proto::NodesInfo& nodes, const proto::JobsInfo& jobs) {
  std::string out;
  auto gauge = [&](const char* name, const char* help) {
    out += fmt::format("# HELP {} {}\n# TYPE {} gauge\n", name, help, name);
  };
  int alive = 0, dead = 0, cpus = 0, cpus_free = 0, gpus = 0, gpus_free = 0;
  for (const auto& n : nodes.nodes) {
    if (n.state != "ALIVE") {
      ++dead;
      continue;
    }
    ++alive;
    cpus += n.cpus;
    cpus_free += n.cpus_free;
    gpus += static_cast<int>(n.gpus.size());
    for (const auto& g : n.gpus) gpus_free += g.run.empty() ? 1 : 0;
  }
  gauge("twinkle_nodes", "Nodes of the cluster by state.");
  out += fmt::format("twinkle_nodes{{state=\"ALIVE\"}} {}\ntwinkle_nodes{{state=\"DEAD\"}} {}\n",
                     alive, dead);
  gauge("twinkle_cpus", "CPUs of the live nodes, used by reservations or free.");
  out += fmt::format("twinkle_cpus{{state=\"used\"}} {}\ntwinkle_cpus{{state=\"free\"}} {}\n",
                     cpus - cpus_free, cpus_free);
  gauge("twinkle_gpus", "GPUs of the live nodes, used by reservations or free.");
  out += fmt::format("twinkle_gpus{{state=\"used\"}} {}\ntwinkle_gpus{{state=\"free\"}} {}\n",
                     gpus - gpus_free, gpus_free);
  // Only what an agent sampled through NVML: a GPU without a sample has no line.
  std::string util, memory;
  for (const auto& n : nodes.nodes) {
    for (const auto& g : n.gpus) {
      if (!g.util) continue;
      const std::string labels =
          fmt::format("node=\"{}\",gpu=\"{}\",run=\"{}\"", label(n.id), g.index, label(g.run));
      util += fmt::format("twinkle_gpu_utilization_percent{{{}}} {}\n", labels, *g.util);
      memory += fmt::format("twinkle_gpu_memory_used_bytes{{{}}} {}\n", labels,
                            g.memory_used.value_or(0));
    }
  }
  gauge(
      "twinkle_gpu_utilization_percent",
      "GPU utilisation in the node's last heartbeat (NVML), by node, GPU and the run holding it.");
  out += util;
  gauge("twinkle_gpu_memory_used_bytes",
        "GPU memory in use in the node's last heartbeat (NVML), by node, GPU and run.");
  out += memory;
  std::map<std::pair<std::string, std::string>, int> by;  // (state, user) -> jobs
  std::map<std::string, double> gpu_seconds;              // user -> GPU-seconds of ended jobs
  std::int64_t oldest = 0;
  const auto now = static_cast<std::int64_t>(std::time(nullptr));
  for (const auto& j : jobs.jobs) {
    ++by[{j.state, j.user}];
    if (j.ended) gpu_seconds[j.user] += j.gpu_seconds;
    if (j.state == "QUEUED" && j.submitted && (oldest == 0 || j.submitted < oldest))
      oldest = j.submitted;
  }
  gauge("twinkle_jobs", "Jobs in the history by state and user.");
  for (const auto& [k, n] : by)
    out += fmt::format("twinkle_jobs{{state=\"{}\",user=\"{}\"}} {}\n", label(k.first),
                       label(k.second), n);
  gauge("twinkle_queue_wait_seconds", "How long the longest-waiting queued job has waited.");
  out += fmt::format("twinkle_queue_wait_seconds {}\n",
                     oldest ? std::max<std::int64_t>(0, now - oldest) : 0);
  out +=
      "# HELP twinkle_gpu_seconds GPU-seconds of the ended jobs in the history, by user.\n"
      "# TYPE twinkle_gpu_seconds gauge\n";
  for (const auto& [user, g] : gpu_seconds)
    out += fmt::format("twinkle_gpu_seconds{{user=\"{}\"}} {:.0f}\n", label(user), g);
  return out;
}

// A path the page sent, relative to the working directory: nullopt unless it stays inside it.
std::optional<fs::path> inside(const std::string& text) {
  if (text.empty() || text.size() > 4096 || text.find('\0') != std::string::npos)
    return std::nullopt;
  const fs::path p = fs::path(text).lexically_normal();
  if (p.empty() || p.is_absolute() || p.has_root_name() || p.filename().empty())
    return std::nullopt;
  for (const auto& part : p)
    if (part == ".." || part == ".") return std::nullopt;
  return p;
}

// A folder of one request's own under `under`, removed with everything in it when it goes.
struct ScratchDir {
  fs::path path;
  explicit ScratchDir(const fs::path& under) : path(under / ("web-" + random_hex(8))) {
    fs::create_directories(path);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

// The strings of body[key] (absent: `fallback`); throws ConfigError naming the key otherwise.
std::vector<std::string> strings(const json& body, const char* key,
                                 std::vector<std::string> fallback = {}) {
  if (!body.contains(key)) return fallback;
  const json& v = body[key];
  if (!v.is_array()) throw ConfigError(fmt::format("\"{}\" is a list of strings", key));
  std::vector<std::string> out;
  for (const auto& x : v) {
    if (!x.is_string()) throw ConfigError(fmt::format("\"{}\" is a list of strings", key));
    out.push_back(x.get<std::string>());
  }
  return out;
}

std::string string_of(const json& body, const char* key, const std::string& fallback = "") {
  if (!body.contains(key)) return fallback;
  if (!body[key].is_string()) throw ConfigError(fmt::format("\"{}\" is a string", key));
  return body[key].get<std::string>();
}

// `text` without every occurrence of `prefix` (a scratch folder, which the user never saw).
std::string without(std::string text, const std::string& prefix) {
  for (auto at = text.find(prefix); at != std::string::npos; at = text.find(prefix))
    text.erase(at, prefix.size());
  return text;
}

// What a submit's form brought: its `meta` field and the files, written under `work`.
struct Received {
  json meta;
  std::vector<fs::path> files;  // relative to `work`
  std::uint64_t bytes = 0;
  std::string error;  // why the form is refused; "" when it is whole
};

// Reads the form of a submit: first `meta` (JSON, with "paths": the relative path of each file
// part, in order), then one `file` part per path, each written to work/PATH as it arrives; no
// more than `limit` bytes of files.
Received receive_form(const httplib::ContentReader& reader, const fs::path& work,
                      std::uint64_t limit, const std::atomic<bool>& stopping) {
  Received r;
  std::string meta_text;
  std::vector<std::string> paths;
  bool meta_read = false;
  enum class Part { none, meta, file } part = Part::none;
  std::ofstream out;
  auto fail = [&](std::string why) {
    if (r.error.empty()) r.error = std::move(why);
    return false;
  };
  auto read_meta = [&] {
    if (meta_read) return true;
    meta_read = true;
    try {
      r.meta = json::parse(meta_text);
      if (!r.meta.is_object()) return fail("the form's meta is not a JSON object");
      paths = strings(r.meta, "paths");
    } catch (const std::exception& e) {
      return fail(fmt::format("the form's meta does not read: {}", e.what()));
    }
    return true;
  };
  const bool whole = reader(
      [&](const httplib::MultipartFormData& f) {
        if (out.is_open()) out.close();
        if (f.name == "meta") {
          if (part != Part::none) return fail("meta comes first in the form, once");
          part = Part::meta;
          return true;
        }
        if (f.name != "file")
          return fail(fmt::format("the form has a field \"{}\": only meta and file", f.name));
        if (!read_meta()) return false;
        if (r.files.size() >= paths.size())
          return fail(
              fmt::format("the form has more files than the {} meta.paths names", paths.size()));
        if (r.files.size() >= kMaxFiles)
          return fail(fmt::format("a submit takes at most {} files", kMaxFiles));
        const std::string& name = paths[r.files.size()];
        const auto rel = inside(name);
        if (!rel)
          return fail(fmt::format("\"{}\" is not a path inside the working directory", name));
        std::error_code ec;
        fs::create_directories((work / *rel).parent_path(), ec);
        out.open(work / *rel, std::ios::binary | std::ios::trunc);
        if (!out)
          return fail(
              fmt::format("\"{}\" cannot be written (a file and a folder of "
                          "that name?)",
                          name));
        r.files.push_back(*rel);
        part = Part::file;
        return true;
      },
      [&](const char* data, std::size_t n) {
        if (stopping) return fail("the head is stopping");
        if (part == Part::meta) {
          meta_text.append(data, n);
          return meta_text.size() <= kMaxBody || fail("the form's meta is over 64 KiB");
        }
        if (part != Part::file) return true;
        r.bytes += n;
        if (r.bytes > limit) {
          return fail(fmt::format(
              "the files add up to more than {} bytes, the most one submit takes: leave the "
              "large ones out of the folder",
              limit));
        }
        out.write(data, static_cast<std::streamsize>(n));
        return out.good() || fail("the head could not write the files (is its disk full?)");
      });
  if (out.is_open()) out.close();
  if (!whole) fail("the form did not arrive whole");
  if (r.error.empty() && read_meta() && r.files.size() != paths.size())
    fail(fmt::format("meta.paths names {} files, {} came", paths.size(), r.files.size()));
  return r;
}

// One Server-Sent Event; false when the page has gone.
bool event(httplib::DataSink& sink, const char* name, const json& data) {
  const std::string text = fmt::format("event: {}\ndata: {}\n\n", name, dump(data));
  return sink.write(text.data(), text.size());
}

// The names a server bound to `host` answers to, besides loopback's: the address itself and the
// machine's name, or for 0.0.0.0 every IPv4 address of the machine and its name.
std::string machine_name() {
  char buf[256] = {};
  return ::gethostname(buf, sizeof buf - 1) == 0 && *buf ? std::string(buf) : "localhost";
}

std::vector<std::string> names_of(const std::string& host) {
  std::vector<std::string> names{"127.0.0.1", "localhost", "[::1]", machine_name()};
  if (host != "0.0.0.0") {
    names.push_back(host);
    return names;
  }
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return names;
  for (ifaddrs* i = list; i; i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
    char text[INET_ADDRSTRLEN] = {};
    const auto* in = reinterpret_cast<const sockaddr_in*>(i->ifa_addr);
    if (::inet_ntop(AF_INET, &in->sin_addr, text, sizeof text)) names.push_back(text);
  }
  ::freeifaddrs(list);
  return names;
}
}  // namespace

// The dashboard's server: the module's one class.
class DashboardServer final : public Dashboard {
 public:
  DashboardServer(DashboardOptions options, HeadAsk ask);
  ~DashboardServer() override;
  std::string url() const override;
  std::string grant(const std::string& user, bool admin) override;

  struct State;

 private:
  std::unique_ptr<State> s_;
};

struct DashboardServer::State {
  DashboardOptions o;
  HeadAsk ask;
  std::unique_ptr<httplib::Server> server;  // an SSLServer with TLS
  std::thread thread;
  int port = 0;
  std::string scheme = "http";
  std::vector<std::string> names;         // of this server, for the Host header
  std::atomic<int> streams{0};            // live logs open
  std::map<std::string, int> streams_of;  // by user (under mu)
  std::atomic<int> submits{0}, reads{0};  // submits, searches and downloads under way
  fs::path scratch_root;                  // where submits' files are put together
  bool own_scratch = false;               // made for this dashboard, removed with it
  std::mutex stop_mu;
  std::condition_variable stop_cv;
  std::atomic<bool> stopping{false};  // the live logs end

  struct Login {
    std::string user;
    bool admin = false;
    Clock::time_point until;
  };
  struct Session {
    std::string user;
    bool admin = false;
    std::string key;   // X-Twinkle-Key
    std::string csrf;  // X-CSRF-Token
    Clock::time_point last;
  };
  std::mutex mu;  // logins, sessions (both by the sha256 of their secret: lookups leak no timing)
  std::map<std::string, Login> logins;
  std::map<std::string, Session> sessions;

  static std::string hashed(const std::string& secret) {
    return sha256_hex(secret.data(), secret.size());
  }
  std::string cookie() const { return fmt::format("{}{}", kCookie, port); }

  // The links' address: the first name given, else the bound address (the machine's name when
  // bound to every one).
  std::string url() const {
    const std::string name = !o.names.empty()      ? o.names.front()
                             : o.host == "0.0.0.0" ? machine_name()
                                                   : o.host;
    return fmt::format("{}://{}:{}", scheme, name, port);
  }

  void log(const std::string& line) const {
    if (o.log) o.log(line);
  }

  // The names this server answers to: a Host header of any other name is refused (a page of
  // another site that resolves its name to 127.0.0.1 gets nothing: no DNS rebinding).
  bool known_host(const std::string& host) const {
    for (const auto& name : names)
      if (host == fmt::format("{}:{}", name, port)) return true;
    return false;
  }

  // Only a page of this server sends this Origin.
  bool own_origin(const httplib::Request& req) const {
    return req.get_header_value("Origin") == scheme + "://" + req.get_header_value("Host");
  }

  // The most a request to `path` may send: the files of a submit, else 64 KiB.
  std::uint64_t body_limit(const httplib::Request& req) const {
    return req.method == "POST" && req.path == "/api/v1/submit" ? o.max_upload + kUploadSlack
                                                                : kMaxBody;
  }

  // Takes one of `limit` places of `count`; false (and nothing taken) when all are taken.
  static bool take(std::atomic<int>& count, int limit) {
    if (count.fetch_add(1) < limit) return true;
    --count;
    return false;
  }

  // The session of the request's cookie and key (X-Twinkle-Key, or Authorization: Bearer for a
  // scraper), renewed; nullopt when either is missing or wrong.
  std::optional<Session> session_of(const httplib::Request& req) {
    const std::string id = cookie_value(req, cookie());
    std::string key = req.get_header_value("X-Twinkle-Key");
    const std::string auth = req.get_header_value("Authorization");
    if (key.empty() && auth.rfind("Bearer ", 0) == 0) key = auth.substr(7);
    if (id.empty() || key.empty()) return std::nullopt;
    std::lock_guard<std::mutex> lock(mu);
    auto s = sessions.find(hashed(id));
    if (s == sessions.end() || !same_secret(key, s->second.key)) return std::nullopt;
    if (Clock::now() - s->second.last > kSessionIdle) {
      sessions.erase(s);
      return std::nullopt;
    }
    s->second.last = Clock::now();
    return s->second;
  }

  // A handler of the API: runs `f` with the request's session, or answers 401.
  template <class F>
  httplib::Server::Handler with_session(F f) {
    return [this, f](const httplib::Request& req, httplib::Response& res) {
      auto s = session_of(req);
      if (!s) return refuse(res, 401, kNotLoggedIn);
      f(*s, req, res);
    };
  }

  // Asks the head as the session's user; an error answer (502) when it does not answer.
  template <class Answer>
  std::optional<Answer> head(const Session& s, const std::string& from, proto::Cluster body,
                             httplib::Response& res) {
    auto answer = answer_of<Answer>(s, from, std::move(body));
    if (!answer) refuse(res, 502, kNoAnswer);
    return answer;
  }

  // The head's answer of type Answer, or nullopt when it did not answer.
  template <class Answer>
  std::optional<Answer> answer_of(const Session& s, const std::string& from, proto::Cluster body) {
    auto answer =
        ask(jobs::Caller{s.user, s.admin, from}, transport::ClusterMessage{0, std::move(body)});
    if (!answer || !std::holds_alternative<Answer>(answer->body)) return std::nullopt;
    return std::get<Answer>(std::move(answer->body));
  }

  // The log filters of a request: rank=GROUP:N, driver=1.
  static proto::LogsQuery log_query(const httplib::Request& req) {
    proto::LogsQuery q;
    q.job = positive(req.matches[1]).value_or(0);
    q.offset = std::max<std::int64_t>(0, std::atoll(req.get_param_value("offset").c_str()));
    q.rank = req.get_param_value("rank");
    q.driver = req.get_param_value("driver") == "1";
    return q;
  }

  // One piece of a log; nullopt with `error` saying why there is none.
  std::optional<proto::LogsChunk> log_piece(const Session& s, const std::string& from,
                                            const proto::LogsQuery& q, std::string& error) {
    auto chunk = answer_of<proto::LogsChunk>(s, from, q);
    if (!chunk || chunk->error) {
      error = chunk ? *chunk->error : kNoAnswer;
      return std::nullopt;
    }
    return chunk;
  }

  // Hands the head the archive `packed` in pieces (nothing when it has it); false with `res`
  // the refusal.
  bool upload(const Session& s, const std::string& identity, const jobs::PackedDir& packed,
              httplib::Response& res) {
    const auto size = static_cast<std::int64_t>(packed.bytes.size());
    auto st = head<proto::UploadState>(s, identity, proto::UploadCheck{packed.sha256, size}, res);
    for (std::size_t at = 0; st;) {
      if (st->error) {
        refuse(res, 400, fmt::format("the head refused the working directory: {}", *st->error));
        return false;
      }
      if (st->have) return true;
      if (at == packed.bytes.size()) {
        refuse(res, 502, "the head did not take the whole upload; submit again");
        return false;
      }
      proto::UploadPart part = jobs::upload_piece(packed, at, kUploadPiece);
      at += part.bytes.data.size();
      st = head<proto::UploadState>(s, identity, std::move(part), res);
    }
    return false;
  }

  // Queues `sub` as the session's user and answers the page with the new job's id.
  void submit(const Session& s, const std::string& from, proto::Submit sub,
              httplib::Response& res) {
    sub.user = s.user;
    sub.from = "dashboard " + from;
    auto answer = head<proto::JobAnswer>(s, from, std::move(sub), res);
    if (!answer) return;
    if (answer->error) return refuse(res, 400, *answer->error);
    log(fmt::format("dashboard: {} submitted job {}", s.user, answer->job));
    reply_json(res, 200, json{{"job", answer->job}, {"text", answer->text}});
  }

  // One job in full, or nullopt with `res` the refusal.
  std::optional<proto::JobEntry> job_entry(const Session& s, const std::string& from,
                                           const std::string& id_text, httplib::Response& res) {
    const auto id = positive(id_text);
    if (!id) {
      refuse(res, 404, "no such job");
      return std::nullopt;
    }
    proto::JobsQuery q;
    q.job = *id;
    auto info = head<proto::JobsInfo>(s, from, q, res);
    if (!info) return std::nullopt;
    if (info->error || info->jobs.empty()) {
      refuse(res, 404, info->error.value_or(fmt::format("no job {}", *id)));
      return std::nullopt;
    }
    return std::move(info->jobs.front());
  }

  void routes() {
    // Every request: a Host of this server's own names; every API request: a session; every
    // request that changes something: the session's CSRF token and an Origin of this server->
    server->set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
      if (!known_host(req.get_header_value("Host"))) {
        refuse(res, 421,
               fmt::format("Host \"{}\" is not this dashboard's; open it as {}/",
                           req.get_header_value("Host"), url()));
        return httplib::Server::HandlerResponse::Handled;
      }
      // Bodies: with a length, uncompressed, within the route's limit (checked before any
      // handler runs, and before the body is read).
      const bool reads_body = req.method != "GET" && req.method != "HEAD";
      if (req.has_header("Transfer-Encoding") ||
          (reads_body && !req.has_header("Content-Length"))) {
        refuse(res, 411, "send the body with a Content-Length (not chunked, not without one)");
        return httplib::Server::HandlerResponse::Handled;
      }
      if (req.has_header("Content-Encoding")) {
        refuse(res, 415, "send the body uncompressed (no Content-Encoding)");
        return httplib::Server::HandlerResponse::Handled;
      }
      const auto length = req.get_header_value<std::uint64_t>("Content-Length");
      if (length > body_limit(req)) {
        refuse(res, 413,
               fmt::format("the body is {} bytes; {} {} takes at most {}", length, req.method,
                           req.path, body_limit(req)));
        return httplib::Server::HandlerResponse::Handled;
      }
      const bool api = req.path.rfind("/api/", 0) == 0 || req.path == "/metrics";
      if (!api) {
        // The page: read only; the login's form: from this dashboard's own page.
        if (req.method == "GET" || req.method == "HEAD")
          return httplib::Server::HandlerResponse::Unhandled;
        if (req.method == "POST" && req.path == "/login") {
          if (own_origin(req)) return httplib::Server::HandlerResponse::Unhandled;
          refuse(res, 403, "a login comes from the dashboard's own login page (Origin)");
          return httplib::Server::HandlerResponse::Handled;
        }
        refuse(res, 405, fmt::format("{} {}: only GET here", req.method, req.path));
        return httplib::Server::HandlerResponse::Handled;
      }
      auto s = session_of(req);
      if (!s) {
        refuse(res, 401, kNotLoggedIn);
        return httplib::Server::HandlerResponse::Handled;
      }
      if (req.method != "GET" && req.method != "HEAD") {
        if (!own_origin(req)) {
          refuse(res, 403,
                 fmt::format("Origin \"{}\" may not change anything here",
                             req.get_header_value("Origin")));
          return httplib::Server::HandlerResponse::Handled;
        }
        if (!same_secret(req.get_header_value("X-CSRF-Token"), s->csrf)) {
          refuse(res, 403, "the request lacks this session's CSRF token (X-CSRF-Token)");
          return httplib::Server::HandlerResponse::Handled;
        }
      }
      return httplib::Server::HandlerResponse::Unhandled;
    });

    // GET /login?token=T asks "log in as USER?" and uses nothing up; the form's POST, from this
    // dashboard's own page (Origin), takes the link. So a page of another site that sends a browser
    // to a link of its own gets no session into it (no login CSRF), and a prefetch spends no link.
    server->Get("/login", [this](const httplib::Request& req, httplib::Response& res) {
      const std::string token = req.get_param_value("token");
      std::optional<Login> login;
      {
        std::lock_guard<std::mutex> lock(mu);
        auto l = logins.find(hashed(token));
        if (l != logins.end() && Clock::now() <= l->second.until) login = l->second;
      }
      if (!login) return link_refused(res);
      page_headers(res);
      res.set_content(
          fmt::format("<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
                      "<title>Twinkle: log in</title><link rel=\"stylesheet\" "
                      "href=\"/style.css\"></head>\n<body><main><p>Log in to this cluster's "
                      "dashboard as <strong>{}</strong>{}?</p>\n<form method=\"post\" "
                      "action=\"/login\"><input type=\"hidden\" name=\"token\" value=\"{}\">"
                      "<button type=\"submit\">Log in</button></form></main></body></html>\n",
                      html_escape(login->user), login->admin ? " (admin)" : "", html_escape(token)),
          "text/html; charset=utf-8");
    });

    server->Post("/login", [this](const httplib::Request& req, httplib::Response& res) {
      const std::string token = form_value(req.body, "token");
      std::optional<Login> login;
      {
        std::lock_guard<std::mutex> lock(mu);
        auto l = logins.find(hashed(token));
        if (l != logins.end()) {
          if (Clock::now() <= l->second.until) login = l->second;
          logins.erase(l);  // used or expired: never again
        }
      }
      if (!login) return link_refused(res);
      const std::string id = random_hex(32), key = random_hex(32);
      {
        std::lock_guard<std::mutex> lock(mu);
        sessions[hashed(id)] =
            Session{login->user, login->admin, key, random_hex(32), Clock::now()};
      }
      log(fmt::format("dashboard: {} logged in from {}", login->user, req.remote_addr));
      res.set_header("Set-Cookie", fmt::format("{}={}; HttpOnly; SameSite=Strict; Path=/{}",
                                               cookie(), id, scheme == "https" ? "; Secure" : ""));
      // The key travels in the fragment: never sent to a server, never in a Referer.
      res.set_header("Referrer-Policy", "no-referrer");
      res.set_redirect("/#key=" + key, 303);
    });

    for (const auto& a : dashboard_assets()) {
      const std::string path = a.path == "/index.html" ? "/" : std::string(a.path);
      server->Get(path, [a](const httplib::Request&, httplib::Response& res) {
        page_headers(res);
        res.set_content(std::string(a.body), std::string(a.type));
      });
    }

    server->Get(
        "/api/v1/session",
        with_session([](const Session& s, const httplib::Request&, httplib::Response& res) {
          reply_json(res, 200, json{{"user", s.user}, {"admin", s.admin}, {"csrf", s.csrf}});
        }));

    server->Get(
        "/api/v1/cluster",
        with_session([this](const Session& s, const httplib::Request& req, httplib::Response& res) {
          auto info = head<proto::NodesInfo>(s, req.remote_addr, proto::NodesQuery{}, res);
          if (info) reply_json(res, 200, core::to_json(proto::to_value(*info)));
        }));

    // The list: active jobs first, then the newest ended; filtered by user, state and name
    // (a part of it), `page` pages of kPage.
    server->Get(
        "/api/v1/jobs",
        with_session([this](const Session& s, const httplib::Request& req, httplib::Response& res) {
          proto::JobsQuery q;
          q.all = req.has_param("all");
          q.user = req.get_param_value("user");
          q.state = req.get_param_value("state");
          auto info = head<proto::JobsInfo>(s, req.remote_addr, q, res);
          if (!info) return;
          if (info->error) return refuse(res, 400, *info->error);
          const std::string name = req.get_param_value("name");
          json jobs = json::array();
          std::size_t matching = 0;
          const auto page =
              std::min<std::int64_t>(positive(req.get_param_value("page")).value_or(1), 1 << 24);
          for (const auto& j : info->jobs) {
            if (!name.empty() && j.name.find(name) == std::string::npos) continue;
            ++matching;
            if (matching <= static_cast<std::size_t>((page - 1) * kPage) ||
                matching > static_cast<std::size_t>(page * kPage)) {
              continue;
            }
            jobs.push_back(core::to_json(proto::to_value(j)));
          }
          reply_json(
              res, 200,
              json{{"jobs", jobs}, {"total", matching}, {"page", page}, {"per_page", kPage}});
        }));

    server->Get(
        R"(/api/v1/jobs/(\d+))",
        with_session([this](const Session& s, const httplib::Request& req, httplib::Response& res) {
          const auto id = positive(req.matches[1]);
          if (!id) return refuse(res, 404, "no such job");
          proto::JobsQuery q;
          q.job = *id;
          auto info = head<proto::JobsInfo>(s, req.remote_addr, q, res);
          if (!info) return;
          if (info->error) return refuse(res, 404, *info->error);
          if (info->jobs.empty()) return refuse(res, 404, fmt::format("no job {}", *id));
          reply_json(res, 200, core::to_json(proto::to_value(info->jobs.front())));
        }));

    // The log from `offset`, filtered as `twinkle logs` filters it.
    server->Get(
        R"(/api/v1/jobs/(\d+)/logs)",
        with_session([this](const Session& s, const httplib::Request& req, httplib::Response& res) {
          proto::LogsQuery q;
          q.job = positive(req.matches[1]).value_or(0);
          q.offset = std::max<std::int64_t>(0, std::atoll(req.get_param_value("offset").c_str()));
          q.rank = req.get_param_value("rank");
          q.driver = req.get_param_value("driver") == "1";
          q.grep = req.get_param_value("grep");
          q.tail = std::max(0, std::atoi(req.get_param_value("tail").c_str()));
          auto chunk = head<proto::LogsChunk>(s, req.remote_addr, q, res);
          if (!chunk) return;
          if (chunk->error) return refuse(res, 400, *chunk->error);
          reply_json(res, 200,
                     json{{"text", chunk->text},
                          {"offset", chunk->offset},
                          {"more", chunk->more},
                          {"ended", chunk->ended}});
        }));

    // The log as it comes, as Server-Sent Events ("log": {text, offset}; "end" once the job has
    // ended and all of it was sent; "error"). The page reads it with fetch(), which sends the
    // session's key as EventSource cannot.
    server->Get(
        R"(/api/v1/jobs/(\d+)/events)",
        with_session([this](const Session& s, const httplib::Request& req, httplib::Response& res) {
          {
            std::lock_guard<std::mutex> lock(mu);
            if (streams >= kMaxStreams || streams_of[s.user] >= kMaxStreamsEach) {
              return refuse(res, 503,
                            fmt::format("{} live logs are open already (at most {} at once, {} of "
                                        "one user): close a job's page",
                                        streams.load(), kMaxStreams, kMaxStreamsEach));
            }
            ++streams;
            ++streams_of[s.user];
          }
          auto q = std::make_shared<proto::LogsQuery>(log_query(req));
          auto quiet = std::make_shared<int>(0);  // polls with nothing new
          const std::string from = req.remote_addr;
          res.set_header("Cache-Control", "no-store");
          res.set_chunked_content_provider(
              "text/event-stream",
              [this, s, q, quiet, from](std::size_t, httplib::DataSink& sink) {
                try {
                  std::string error;
                  const auto chunk = log_piece(s, from, *q, error);
                  if (!chunk) {
                    // The head did not answer (it stops, or restarts): the page reconnects.
                    if (error == kNoAnswer) return false;
                    event(sink, "error", json{{"error", error}});
                    sink.done();
                    return true;
                  }
                  q->offset = chunk->offset;
                  if (!chunk->text.empty()) {
                    *quiet = 0;
                    if (!event(sink, "log", json{{"text", chunk->text}, {"offset", chunk->offset}}))
                      return false;
                  }
                  if (chunk->ended && !chunk->more) {
                    event(sink, "end", json{{"offset", chunk->offset}});
                    sink.done();
                    return true;
                  }
                  if (chunk->more) return true;
                  // Nothing new: ask again soon; a comment every 10 s finds a page that has gone.
                  if (++*quiet % 40 == 0 && !sink.write(": idle\n\n", 9)) return false;
                  std::unique_lock<std::mutex> lock(stop_mu);
                  return !stop_cv.wait_for(lock, kStreamPoll, [this] { return stopping.load(); });
                } catch (const std::exception& e) {
                  // Out here nothing would catch it (the server's thread would end the head).
                  log(fmt::format("dashboard: a live log ended: {}", e.what()));
                  return false;
                }
              },
              [this, user = s.user](bool) {
                std::lock_guard<std::mutex> lock(mu);
                --streams;
                if (--streams_of[user] <= 0) streams_of.erase(user);
              });
        }));

    // The whole log (filtered by rank or driver) as a file.
    server->Get(
        R"(/api/v1/jobs/(\d+)/log)",
        with_session([this](const Session& s, const httplib::Request& req, httplib::Response& res) {
          if (!take(reads, kMaxReads)) return refuse(res, 503, kBusyReading);
          auto release = std::shared_ptr<void>(nullptr, [this](void*) { --reads; });
          auto q = std::make_shared<proto::LogsQuery>(log_query(req));
          q->offset = 0;
          std::string error;
          auto first = log_piece(s, req.remote_addr, *q, error);
          if (!first) return refuse(res, 400, error);
          auto pending = std::make_shared<std::optional<proto::LogsChunk>>(std::move(first));
          const std::string from = req.remote_addr;
          res.set_header("Cache-Control", "no-store");
          res.set_header("Content-Disposition",
                         fmt::format("attachment; filename=\"job-{}.log\"", q->job));
          res.set_chunked_content_provider(
              "text/plain; charset=utf-8",
              [this, s, q, pending, from](std::size_t, httplib::DataSink& sink) {
                try {
                  std::string error;
                  if (!*pending) *pending = log_piece(s, from, *q, error);
                  if (!*pending) return false;  // the head went: the file ends short
                  const proto::LogsChunk chunk = std::move(**pending);
                  pending->reset();
                  q->offset = chunk.offset;
                  if (!chunk.text.empty() && !sink.write(chunk.text.data(), chunk.text.size()))
                    return false;
                  if (!chunk.more || stopping) sink.done();
                  return true;
                } catch (const std::exception& e) {
                  log(fmt::format("dashboard: a log download ended: {}", e.what()));
                  return false;
                }
              },
              [release](bool) {});
        }));

    // Lines of the log (filtered by rank or driver) that hold the text q, counted, with
    // `context` lines around each of the first kMaxShown (every line shown cut at
    // kMatchedChars). Plain text, not a regular expression: no pattern can make a search slow.
    server->Get(
        R"(/api/v1/jobs/(\d+)/search)",
        with_session([this](const Session& s, const httplib::Request& req, httplib::Response& res) {
          const std::string needle = req.get_param_value("q");
          if (needle.empty() || needle.size() > 1000)
            return refuse(res, 400, "give q=TEXT (at most 1000 characters)");
          if (!take(reads, kMaxReads)) return refuse(res, 503, kBusyReading);
          const std::shared_ptr<void> release(nullptr, [this](void*) { --reads; });
          const int context =
              req.has_param("context")
                  ? std::clamp(std::atoi(req.get_param_value("context").c_str()), 0, 20)
                  : 2;
          proto::LogsQuery q = log_query(req);
          q.offset = 0;
          std::string text, error;
          bool cut = false;
          for (;;) {
            auto chunk = log_piece(s, req.remote_addr, q, error);
            if (!chunk) return refuse(res, 400, error);
            text += chunk->text;
            q.offset = chunk->offset;
            if (!chunk->more) break;
            if (text.size() >= kMaxSearched) {
              cut = true;
              break;
            }
          }
          auto shown = [](std::string_view line) {
            return std::string(line.substr(0, std::min(line.size(), kMatchedChars)));
          };
          // One pass: the last `context` lines kept for the next match's "before", and the
          // matches still waiting for their "after".
          std::deque<std::string_view> recent;
          std::vector<json> open;
          json matches = json::array();
          std::size_t count = 0, lines = 0;
          for (std::size_t at = 0; at < text.size();) {
            std::size_t nl = text.find('\n', at);
            if (nl == std::string::npos) nl = text.size();
            const std::string_view line(text.data() + at, nl - at);
            at = nl + 1;
            ++lines;
            for (auto& m : open) m["after"].push_back(shown(line));
            while (!open.empty() &&
                   open.front()["after"].size() >= static_cast<std::size_t>(context)) {
              matches.push_back(std::move(open.front()));
              open.erase(open.begin());
            }
            if (line.find(needle) != std::string_view::npos && ++count <= kMaxShown) {
              json before = json::array();
              for (const auto& r : recent) before.push_back(shown(r));
              json m{{"line", lines},
                     {"text", shown(line)},
                     {"before", before},
                     {"after", json::array()}};
              if (context == 0) {
                matches.push_back(std::move(m));
              } else {
                open.push_back(std::move(m));
              }
            }
            recent.push_back(line);
            if (recent.size() > static_cast<std::size_t>(context)) recent.pop_front();
          }
          for (auto& m : open) matches.push_back(std::move(m));
          reply_json(res, 200,
                     json{{"count", count},
                          {"shown", matches.size()},
                          {"lines", lines},
                          {"cut", cut},
                          {"matches", matches}});
        }));

    // Where a job would run now, as `twinkle topology` draws it: the page's job file (its text
    // and path in the working directory) or an earlier job's, with overrides. Nothing is
    // reserved.
    server->Post(
        "/api/v1/topology",
        with_session([this](const Session& s, const httplib::Request& req, httplib::Response& res) {
          try {
            const json body = json::parse(req.body);
            std::vector<std::string> overrides = strings(body, "overrides");
            std::string job_file = string_of(body, "job_file", "job.toml");
            std::string text = string_of(body, "job_text");
            if (body.contains("job")) {
              auto j = job_entry(s, req.remote_addr,
                                 body["job"].is_number_integer()
                                     ? std::to_string(body["job"].get<std::int64_t>())
                                     : std::string(),
                                 res);
              if (!j) return;
              if (!j->job_text)
                return refuse(res, 400,
                              fmt::format("job {} has no job file here (an interactive run's "
                                          "stays with its client)",
                                          j->id));
              text = *j->job_text;
              job_file = j->job_file;
              overrides = strings(body, "overrides", j->overrides);
            }
            const auto rel = inside(job_file);
            if (!rel)
              return refuse(res, 400,
                            fmt::format("\"{}\" is not a path in the working "
                                        "directory",
                                        job_file));
            std::vector<Override> parsed;
            for (const auto& x : overrides) parsed.push_back(parse_override(x));
            parsed.push_back(Override{"job.mode", "remote"});
            const Job job = parse_job(text, *rel, parsed);
            proto::Reserve plan;
            plan.job = job.name;
            plan.dry_run = true;
            plan.groups = jobs::group_demands(job);
            auto r = head<proto::Reservation>(s, req.remote_addr, std::move(plan), res);
            if (!r) return;
            if (!r->ok)
              return refuse(res, 400,
                            fmt::format("{}: the job cannot run on this cluster: {}", rel->string(),
                                        r->message));
            const Placement placement = placement_of(job, *r, true);
            json out{{"text", render_topology(job, placement)},
                     {"topology", topology_json(job, placement)}};
            if (r->kind == "busy")
              out["waits"] =
                  fmt::format("submitted now, it waits: {}; held by {}", r->message, r->holders);
            reply_json(res, 200, out);
          } catch (const json::exception& e) {
            refuse(res, 400, fmt::format("the body is not JSON: {}", e.what()));
          } catch (const ConfigError& e) {
            refuse(res, 400, e.what());
          } catch (const std::exception& e) {
            refuse(res, 502, e.what());
          }
        }));

    // Where a submitted job ran (its placement record), drawn as `twinkle topology` draws a
    // run's: its groups, meshes, and the node and GPUs of every rank.
    server->Get(
        R"(/api/v1/jobs/(\d+)/topology)",
        with_session([this](const Session& s, const httplib::Request& req, httplib::Response& res) {
          auto j = job_entry(s, req.remote_addr, req.matches[1], res);
          if (!j) return;
          if (!j->job_text || j->placement.empty())
            return refuse(res, 404,
                          fmt::format("job {} has no placement to draw: it has not run yet, or it "
                                      "was an interactive run (its job file stays with its client)",
                                      j->id));
          try {
            std::vector<Override> parsed;
            for (const auto& x : j->overrides) parsed.push_back(parse_override(x));
            parsed.push_back(Override{"job.mode", "remote"});
            const Job job = parse_job(*j->job_text, j->job_file, parsed);
            Placement p;
            std::map<std::string, int> node_index;
            for (const auto& g : job.groups) {
              GroupPlacement gp;
              gp.group = &g;
              for (const auto& r : j->placement) {
                if (r.group != g.name) continue;
                if (r.rank < 0 || r.rank >= static_cast<int>(g.ranks.size()))
                  return refuse(res, 409,
                                fmt::format("job {}'s placement names {}:{}, which its job file "
                                            "does not have",
                                            j->id, r.group, r.rank));
                auto [at, fresh] = node_index.emplace(r.node, static_cast<int>(p.nodes.size()));
                if (fresh) {
                  NodeSlot slot;
                  slot.id = r.node;
                  slot.host = r.node;
                  p.nodes.push_back(std::move(slot));
                }
                gp.workers.push_back(WorkerPlacement{g.ranks[static_cast<std::size_t>(r.rank)],
                                                     r.rank, at->second, r.gpus});
              }
              std::sort(gp.workers.begin(), gp.workers.end(),
                        [](const auto& a, const auto& b) { return a.index < b.index; });
              if (gp.workers.size() != g.ranks.size())
                return refuse(res, 409,
                              fmt::format("job {}'s placement has {} of group {}'s {} ranks", j->id,
                                          gp.workers.size(), g.name, g.ranks.size()));
              p.groups.push_back(std::move(gp));
            }
            reply_json(
                res, 200,
                json{{"text", render_topology(job, p)}, {"topology", topology_json(job, p)}});
          } catch (const ConfigError& e) {
            refuse(res, 400, e.what());
          }
        }));

    // A submit from the page: multipart/form-data, `meta` ({job_file, name, overrides,
    // max_retries, paths}) and then the files of the working directory, each written to disk
    // as it arrives; packed, uploaded and queued as `twinkle submit` does.
    server->Post("/api/v1/submit", [this](const httplib::Request& req, httplib::Response& res,
                                          const httplib::ContentReader& reader) {
      auto s = session_of(req);
      if (!s) return refuse(res, 401, kNotLoggedIn);
      if (!req.is_multipart_form_data())
        return refuse(res, 400, "a submit is multipart/form-data: a field meta, then the files");
      if (!take(submits, kMaxSubmits))
        return refuse(res, 503,
                      fmt::format("{} submits from the dashboard are under way: try again in a "
                                  "moment",
                                  kMaxSubmits));
      const std::shared_ptr<void> release(nullptr, [this](void*) { --submits; });
      std::optional<ScratchDir> dir;
      try {
        dir.emplace(scratch_root);
      } catch (const fs::filesystem_error& e) {
        log(fmt::format("dashboard: a submit found no room: {}", e.what()));
        return refuse(
            res, 500,
            fmt::format("the head cannot make a folder for the files: {}", e.code().message()));
      }
      const fs::path work = dir->path / "work";
      const Received got = receive_form(reader, work, o.max_upload, stopping);
      if (!got.error.empty()) return refuse(res, 400, got.error);
      proto::Submit sub;
      jobs::PackedDir packed;
      try {
        const std::string job_file = string_of(got.meta, "job_file", "job.toml");
        const auto rel = inside(job_file);
        if (!rel || !fs::is_regular_file(work / *rel))
          return refuse(res, 400,
                        fmt::format("the job file \"{}\" is not among the files sent", job_file));
        sub.job_file = rel->string();
        sub.name = string_of(got.meta, "name");
        sub.overrides = strings(got.meta, "overrides");
        if (got.meta.contains("max_retries")) {
          if (!got.meta["max_retries"].is_number_integer())
            return refuse(res, 400, "\"max_retries\" is a number from 0 to 100");
          sub.max_retries = got.meta["max_retries"].get<int>();
        }
        packed = jobs::pack_dir(work, o.max_upload);
      } catch (const std::exception& e) {
        return refuse(res, 400, without(without(e.what(), work.string() + "/"), work.string()));
      }
      sub.sha256 = packed.sha256;
      const std::string identity = "dashboard " + random_hex(8);
      if (!upload(*s, identity, packed, res)) return;
      submit(*s, req.remote_addr, std::move(sub), res);
    });

    // Submit an earlier job again: its working directory, job file and (unless the body gives
    // others) overrides; the owner's or, for an admin, anyone's.
    server->Post(
        R"(/api/v1/jobs/(\d+)/rerun)",
        with_session([this](const Session& s, const httplib::Request& req, httplib::Response& res) {
          json body;
          try {
            body = req.body.empty() ? json::object() : json::parse(req.body);
          } catch (const json::exception&) {
            return refuse(res, 400, "the body is not JSON: send {} or {\"overrides\": [...]}");
          }
          auto j = job_entry(s, req.remote_addr, req.matches[1], res);
          if (!j) return;
          if (j->user != s.user && !s.admin)
            return refuse(res, 403,
                          fmt::format("job {} is {}'s: you re-run only your own", j->id, j->user));
          if (j->kind != "submitted" || !j->sha256)
            return refuse(res, 400,
                          fmt::format("job {} cannot run again from here: {}", j->id,
                                      j->kind != "submitted"
                                          ? "it was an interactive run, whose files stay with "
                                            "its client"
                                          : "the head no longer has its working directory"));
          proto::Submit sub;
          try {
            sub.overrides = strings(body, "overrides", j->overrides);
            sub.name = string_of(body, "name");
            if (sub.name.empty()) sub.name = j->name;
          } catch (const ConfigError& e) {
            return refuse(res, 400, e.what());
          }
          sub.job_file = j->job_file;
          sub.sha256 = *j->sha256;
          sub.max_retries = j->max_retries;
          submit(s, req.remote_addr, std::move(sub), res);
        }));

    // Prometheus' text format, for a scraper that sends a session's cookie: nodes by state, CPUs
    // and GPUs used and free, GPU utilisation and memory where the agents sample NVML, jobs by
    // state and user, the longest wait in the queue, GPU-seconds of ended jobs by user.
    server->Get("/metrics", with_session([this](const Session& s, const httplib::Request& req,
                                                httplib::Response& res) {
                  auto info = head<proto::NodesInfo>(s, req.remote_addr, proto::NodesQuery{}, res);
                  if (!info) return;
                  proto::JobsQuery q;
                  q.all = true;
                  auto jobs = head<proto::JobsInfo>(s, req.remote_addr, q, res);
                  if (!jobs) return;
                  res.set_header("Cache-Control", "no-store");
                  res.set_content(metrics_text(*info, *jobs), "text/plain; version=0.0.4");
                }));

    // Stop a job: the owner's or, for an admin, anyone's; body {"now": true} kills at once.
    server->Post(
        R"(/api/v1/jobs/(\d+)/stop)",
        with_session([this](const Session& s, const httplib::Request& req, httplib::Response& res) {
          proto::JobStop stop;
          stop.job = positive(req.matches[1]).value_or(0);
          try {
            const json body = req.body.empty() ? json::object() : json::parse(req.body);
            stop.now = body.value("now", false);
          } catch (const json::exception&) {
            return refuse(res, 400, "the body is not JSON: send {} or {\"now\": true}");
          }
          stop.from = "dashboard " + req.remote_addr;
          reply_answer(head<proto::JobAnswer>(s, req.remote_addr, stop, res), res);
        }));

    // Queue a STOPPED or FAILED job again, to go on from its newest checkpoint (twinkle resume).
    server->Post(
        R"(/api/v1/jobs/(\d+)/resume)",
        with_session([this](const Session& s, const httplib::Request& req, httplib::Response& res) {
          proto::JobResume resume;
          resume.job = positive(req.matches[1]).value_or(0);
          resume.from = "dashboard " + req.remote_addr;
          reply_answer(head<proto::JobAnswer>(s, req.remote_addr, resume, res), res);
        }));
  }
};

DashboardServer::DashboardServer(DashboardOptions options, HeadAsk ask)
    : s_(std::make_unique<State>()) {
  if (sodium_init() < 0) throw Error("libsodium failed to initialise (the dashboard's secrets)");
  s_->o = std::move(options);
  s_->ask = std::move(ask);
  State& s = *s_;
  if (s.o.tls_cert.empty()) {
    s.server = std::make_unique<httplib::Server>();
  } else {
    for (const auto& f : {s.o.tls_cert, s.o.tls_key}) {
      if (!std::ifstream(f))
        throw ConfigError(
            fmt::format("the dashboard cannot read {}: {}", f.string(), std::strerror(errno)));
    }
    s.server = std::make_unique<httplib::SSLServer>(s.o.tls_cert.c_str(), s.o.tls_key.c_str());
    if (!s.server->is_valid()) {
      throw ConfigError(fmt::format(
          "the dashboard cannot serve HTTPS with --tls-cert {} and --tls-key {}: not a PEM "
          "certificate and its private key (make a self-signed pair with: openssl req -x509 "
          "-newkey rsa:2048 -nodes -days 365 -keyout key.pem -out cert.pem -subj /CN=HOST "
          "-addext subjectAltName=DNS:HOST)",
          s.o.tls_cert.string(), s.o.tls_key.string()));
    }
    s.scheme = "https";
  }
  s.names = names_of(s.o.host);
  s.names.insert(s.names.end(), s.o.names.begin(), s.o.names.end());
  // Submits' folders: what a head that was killed left there goes now.
  std::error_code ec;
  if (s.o.scratch_dir.empty()) {
    char name[] = "/tmp/twinkle-dashboard-XXXXXX";  // 0700, of this process only
    if (!::mkdtemp(name))
      throw Error(
          fmt::format("the dashboard cannot make a folder in /tmp: {}", std::strerror(errno)));
    s.scratch_root = name;
    s.own_scratch = true;
  } else {
    s.scratch_root = s.o.scratch_dir;
    fs::remove_all(s.scratch_root, ec);
    fs::create_directories(s.scratch_root, ec);
    fs::permissions(s.scratch_root, fs::perms::owner_all, ec);
  }
  s.server->new_task_queue = [] { return new httplib::ThreadPool(kThreads); };
  s.routes();
  // What a request may send is checked per route before its body is read (pre-routing).
  s.server->set_payload_max_length(s.o.max_upload + kUploadSlack);
  s.server->set_keep_alive_timeout(1);
  if (s.o.port == 0) {
    s.port = s.server->bind_to_any_port(s.o.host);
  } else {
    s.port = s.server->bind_to_port(s.o.host, s.o.port) ? s.o.port : -1;
  }
  if (s.port <= 0) {
    throw TransportError(fmt::format(
        "the dashboard cannot listen on {}:{}: the port is in use or the address is not this "
        "machine's; choose another with --dashboard [ADDR:]PORT",
        s.o.host, s.o.port));
  }
  s.thread = std::thread([&s] { s.server->listen_after_bind(); });
  // stop() does nothing before the server runs: a dashboard destroyed at once must not hang.
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  while (!s.server->is_running() && Clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

DashboardServer::~DashboardServer() {
  {
    std::lock_guard<std::mutex> lock(s_->stop_mu);
    s_->stopping = true;
  }
  s_->stop_cv.notify_all();
  s_->server->stop();
  if (s_->thread.joinable()) s_->thread.join();
  std::error_code ec;
  if (s_->own_scratch) fs::remove_all(s_->scratch_root, ec);
}

std::string DashboardServer::url() const { return s_->url(); }

std::string DashboardServer::grant(const std::string& user, bool admin) {
  const std::string token = random_hex(32);
  const auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                        std::chrono::duration<double>(std::max(0.0, s_->o.link_s)));
  std::lock_guard<std::mutex> lock(s_->mu);
  // Expired links go when a new one is made: at most the few of the last minute stay.
  for (auto l = s_->logins.begin(); l != s_->logins.end();)
    l = Clock::now() > l->second.until ? s_->logins.erase(l) : std::next(l);
  s_->logins[State::hashed(token)] = State::Login{user, admin, until};
  return fmt::format("{}/login?token={}", url(), token);
}

}  // namespace twinkle::core::cluster

extern "C" __attribute__((visibility("default"))) int twinkle_dashboard_open_v1(
    twinkle::core::cluster::DashboardOptions* options, twinkle::core::cluster::HeadAsk* ask,
    twinkle::core::cluster::Dashboard** out, std::string* error) {
  try {
    *out = new twinkle::core::cluster::DashboardServer(std::move(*options), std::move(*ask));
    return 0;
  } catch (const twinkle::ConfigError& e) {
    *error = e.what();
    return 1;
  } catch (const twinkle::TransportError& e) {
    *error = e.what();
    return 2;
  } catch (const std::exception& e) {
    *error = e.what();
    return 3;
  }
}
