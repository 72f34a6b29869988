#pragma once

#include <string>

#include "core/job/job.hpp"

namespace twinkle::core {

// Posts the first failure of a run to [notify].webhook, once: a JSON body
// {"job", "run_id", "host", "error"} for kind = "json", or a DingTalk markdown message for
// kind = "dingtalk" (with secret: the timestamp and HMAC-SHA256 sign query parameters).
// A notification that cannot be delivered is reported on stderr and never fails the run.
// Blocks for at most 10 seconds. The work is done by the module libtwinkle_notify.so, loaded on
// the first failure, so that runs start without libcurl and its TLS stack.
void notify_failure(const NotifySpec& notify, const std::string& job, const std::string& run_id,
                    const std::string& error);

// DingTalk's signature: base64(HMAC-SHA256(secret, "<timestamp>\n<secret>")), not URL-encoded.
std::string dingtalk_sign(const std::string& secret, long long timestamp_ms);

}  // namespace twinkle::core
