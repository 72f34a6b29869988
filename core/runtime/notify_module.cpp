// The notifier module (libtwinkle_notify.so): libcurl, with its TLS stack, and OpenSSL's HMAC are
// loaded only when a run fails and has a webhook to tell.
#include "core/runtime/notify.hpp"

#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <memory>

#include <curl/curl.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace twinkle::core {

std::string dingtalk_sign(const std::string& secret, long long timestamp_ms) {
  const std::string text = fmt::format("{}\n{}", timestamp_ms, secret);
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int mac_len = 0;
  HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
       reinterpret_cast<const unsigned char*>(text.data()), text.size(), mac, &mac_len);
  std::string b64(4 * ((mac_len + 2) / 3) + 1, '\0');
  const int n =
      EVP_EncodeBlock(reinterpret_cast<unsigned char*>(b64.data()), mac, static_cast<int>(mac_len));
  b64.resize(static_cast<std::size_t>(n));
  return b64;
}

namespace {

void post_failure(const NotifySpec& notify, const std::string& job, const std::string& run_id,
                  const std::string& error) {
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  std::string url = notify.webhook;
  nlohmann::json body;
  if (notify.kind == "dingtalk") {
    const std::string title = fmt::format("twinkle job {} failed", job);
    body = {{"msgtype", "markdown"},
            {"markdown",
             {{"title", title},
              {"text", fmt::format("### {}\n\n- run: {}\n- host: {}\n\n```\n{}\n```", title, run_id,
                                   host, error)}}}};
    if (!notify.secret.empty()) {
      const long long ts = std::chrono::duration_cast<std::chrono::milliseconds>(
                               std::chrono::system_clock::now().time_since_epoch())
                               .count();
      std::unique_ptr<CURL, void (*)(CURL*)> esc(curl_easy_init(), curl_easy_cleanup);
      const std::string sign = dingtalk_sign(notify.secret, ts);
      char* enc = curl_easy_escape(esc.get(), sign.c_str(), static_cast<int>(sign.size()));
      url += fmt::format("{}timestamp={}&sign={}", url.find('?') == std::string::npos ? '?' : '&',
                         ts, enc);
      curl_free(enc);
    }
  } else {
    body = {{"job", job}, {"run_id", run_id}, {"host", host}, {"error", error}};
  }
  const std::string payload = body.dump();

  std::unique_ptr<CURL, void (*)(CURL*)> curl(curl_easy_init(), curl_easy_cleanup);
  if (!curl) {
    std::fprintf(stderr, "twinkle: warning: cannot notify %s: curl did not start\n",
                 notify.webhook.c_str());
    return;
  }
  std::unique_ptr<curl_slist, void (*)(curl_slist*)> headers(
      curl_slist_append(nullptr, "Content-Type: application/json"), curl_slist_free_all);
  char errbuf[CURL_ERROR_SIZE] = {};
  curl_easy_setopt(curl.get(), CURLOPT_URL, url.c_str());
  curl_easy_setopt(curl.get(), CURLOPT_HTTPHEADER, headers.get());
  curl_easy_setopt(curl.get(), CURLOPT_POSTFIELDS, payload.c_str());
  curl_easy_setopt(curl.get(), CURLOPT_POSTFIELDSIZE, static_cast<long>(payload.size()));
  curl_easy_setopt(curl.get(), CURLOPT_TIMEOUT, 10L);
  curl_easy_setopt(curl.get(), CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(curl.get(), CURLOPT_ERRORBUFFER, errbuf);
  curl_easy_setopt(
      curl.get(), CURLOPT_WRITEFUNCTION,
      +[](char*, size_t size, size_t n, void*) { return size * n; });
  const CURLcode rc = curl_easy_perform(curl.get());
  long status = 0;
  curl_easy_getinfo(curl.get(), CURLINFO_RESPONSE_CODE, &status);
  if (rc != CURLE_OK) {
    std::fprintf(stderr, "twinkle: warning: failure notification to %s not delivered: %s\n",
                 notify.webhook.c_str(), errbuf[0] ? errbuf : curl_easy_strerror(rc));
  } else if (status >= 300) {
    std::fprintf(stderr, "twinkle: warning: failure notification to %s answered HTTP %ld\n",
                 notify.webhook.c_str(), status);
  }
}

}  // namespace

}  // namespace twinkle::core

extern "C" __attribute__((visibility("default"))) void twinkle_notify_failure_v1(
    const twinkle::core::NotifySpec* notify, const char* job, const char* run_id,
    const char* error) {
  try {
    twinkle::core::post_failure(*notify, job, run_id, error);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "twinkle: warning: failure notification to %s not sent: %s\n",
                 notify->webhook.c_str(), e.what());
  }
}

extern "C" __attribute__((visibility("default"))) void twinkle_dingtalk_sign_v1(
    const std::string* secret, long long timestamp_ms, std::string* out) {
  *out = twinkle::core::dingtalk_sign(*secret, timestamp_ms);
}
