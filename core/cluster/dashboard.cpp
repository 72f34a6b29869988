#include "core/cluster/dashboard.hpp"

#include <httplib.h>
#include <sodium.h>

#include <chrono>
#include <ctime>
#include <map>
#include <mutex>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/cluster/dashboard_assets.hpp"
#include "core/job/digest.hpp"
#include "core/job/json_value.hpp"
#include "twinkle/errors.hpp"

namespace twinkle::core::cluster {

namespace {

namespace proto = transport::proto;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

constexpr auto kSessionIdle = std::chrono::hours(12);  // a session unused this long ends
// The cookie is named after the port (cookies are not scoped by port); the session's key, which
// the page keeps in its origin's localStorage and sends as X-Twinkle-Key, is what another
// server on this machine that receives the cookie does not have.
constexpr const char* kCookie = "twinkle_session_";
constexpr std::size_t kMaxBody = 64 << 10;
constexpr int kPage = 50;  // jobs per page of the list
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

void reply_json(httplib::Response& res, int status, const json& body) {
  res.status = status;
  res.set_header("Cache-Control", "no-store");
  res.set_content(body.dump(), "application/json");
}

void refuse(httplib::Response& res, int status, const std::string& why) {
  reply_json(res, status, json{{"error", why}});
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

}  // namespace

struct Dashboard::State {
  DashboardOptions o;
  HeadAsk ask;
  httplib::Server server;
  std::thread thread;
  int port = 0;

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

  void log(const std::string& line) const {
    if (o.log) o.log(line);
  }

  // The names this server answers to: a Host header of any other name is refused (a page of
  // another site that resolves its name to 127.0.0.1 gets nothing: no DNS rebinding).
  bool known_host(const std::string& host) const {
    for (const char* name : {"127.0.0.1", "localhost", "[::1]"})
      if (host == fmt::format("{}:{}", name, port)) return true;
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
    const jobs::Caller caller{s.user, s.admin, from};
    auto answer = ask(caller, transport::ClusterMessage{0, std::move(body)});
    if (!answer || !std::holds_alternative<Answer>(answer->body)) {
      refuse(res, 502, "the head did not answer (is it stopping?)");
      return std::nullopt;
    }
    return std::get<Answer>(std::move(answer->body));
  }

  void routes() {
    // Every request: a Host of this server's own names; every API request: a session; every
    // request that changes something: the session's CSRF token and an Origin of this server.
    server.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
      if (!known_host(req.get_header_value("Host"))) {
        refuse(res, 421,
               fmt::format("Host \"{}\" is not this dashboard's; open it as "
                           "http://127.0.0.1:{}/",
                           req.get_header_value("Host"), port));
        return httplib::Server::HandlerResponse::Handled;
      }
      const bool api = req.path.rfind("/api/", 0) == 0 || req.path == "/metrics";
      if (!api) {
        // The page: read only; the login's form: from this dashboard's own page.
        if (req.method == "GET" || req.method == "HEAD")
          return httplib::Server::HandlerResponse::Unhandled;
        if (req.method == "POST" && req.path == "/login") {
          if (req.get_header_value("Origin") == "http://" + req.get_header_value("Host"))
            return httplib::Server::HandlerResponse::Unhandled;
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
        const std::string origin = req.get_header_value("Origin");
        if (origin != "http://" + req.get_header_value("Host")) {
          refuse(res, 403, fmt::format("Origin \"{}\" may not change anything here", origin));
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
    server.Get("/login", [this](const httplib::Request& req, httplib::Response& res) {
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

    server.Post("/login", [this](const httplib::Request& req, httplib::Response& res) {
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
      res.set_header("Set-Cookie",
                     fmt::format("{}={}; HttpOnly; SameSite=Strict; Path=/", cookie(), id));
      // The key travels in the fragment: never sent to a server, never in a Referer.
      res.set_header("Referrer-Policy", "no-referrer");
      res.set_redirect("/#key=" + key, 303);
    });

    for (const auto& a : dashboard_assets()) {
      const std::string path = a.path == "/index.html" ? "/" : std::string(a.path);
      server.Get(path, [a](const httplib::Request&, httplib::Response& res) {
        page_headers(res);
        res.set_content(std::string(a.body), std::string(a.type));
      });
    }

    server.Get("/api/v1/session",
               with_session([](const Session& s, const httplib::Request&, httplib::Response& res) {
                 reply_json(res, 200, json{{"user", s.user}, {"admin", s.admin}, {"csrf", s.csrf}});
               }));

    server.Get("/api/v1/cluster", with_session([this](const Session& s, const httplib::Request& req,
                                                      httplib::Response& res) {
                 auto info = head<proto::NodesInfo>(s, req.remote_addr, proto::NodesQuery{}, res);
                 if (info) reply_json(res, 200, core::to_json(proto::to_value(*info)));
               }));

    // The list: active jobs first, then the newest ended; filtered by user, state and name
    // (a part of it), `page` pages of kPage.
    server.Get(
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

    server.Get(
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
    server.Get(
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

    // Prometheus' text format, for a scraper that sends a session's cookie: nodes by state, CPUs
    // and GPUs used and free, jobs by state and user, the longest wait in the queue, GPU-seconds
    // of ended jobs by user. GPU utilisation is not there: the agents do not sample it.
    server.Get("/metrics", with_session([this](const Session& s, const httplib::Request& req,
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
    server.Post(
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
          auto answer = head<proto::JobAnswer>(s, req.remote_addr, stop, res);
          if (!answer) return;
          if (answer->error) {
            const int status = answer->error->find("only your own") != std::string::npos ? 403
                               : answer->error->rfind("no job", 0) == 0                  ? 404
                                                                                         : 400;
            return refuse(res, status, *answer->error);
          }
          reply_json(res, 200, json{{"job", answer->job}, {"text", answer->text}});
        }));
  }
};

Dashboard::Dashboard(DashboardOptions options, HeadAsk ask) : s_(std::make_unique<State>()) {
  if (sodium_init() < 0) throw Error("libsodium failed to initialise (the dashboard's secrets)");
  s_->o = std::move(options);
  s_->ask = std::move(ask);
  s_->routes();
  State& s = *s_;
  s.server.set_payload_max_length(kMaxBody);
  s.server.set_keep_alive_timeout(1);
  if (s.o.port == 0) {
    s.port = s.server.bind_to_any_port(s.o.host);
  } else {
    s.port = s.server.bind_to_port(s.o.host, s.o.port) ? s.o.port : -1;
  }
  if (s.port <= 0) {
    throw TransportError(fmt::format(
        "the dashboard cannot listen on {}:{}: the port is in use or the address is not this "
        "machine's; choose another with --dashboard [ADDR:]PORT",
        s.o.host, s.o.port));
  }
  s.thread = std::thread([&s] { s.server.listen_after_bind(); });
  // stop() does nothing before the server runs: a dashboard destroyed at once must not hang.
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  while (!s.server.is_running() && Clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

Dashboard::~Dashboard() {
  s_->server.stop();
  if (s_->thread.joinable()) s_->thread.join();
}

std::string Dashboard::url() const { return fmt::format("http://{}:{}", s_->o.host, s_->port); }

std::string Dashboard::grant(const std::string& user, bool admin) {
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
