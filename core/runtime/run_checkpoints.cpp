#include "core/runtime/run_checkpoints.hpp"

#include <system_error>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "twinkle/errors.hpp"

namespace twinkle::core {

namespace proto = transport::proto;

std::filesystem::path RunCheckpoints::root() const {
  return std::filesystem::absolute(job_.checkpoint_dir).lexically_normal();
}

std::string RunCheckpoints::choose_resume(bool asked_on_command_line) {
  const bool asked = asked_on_command_line || job_.resume_auto;
  if (job_.checkpoint_dir.empty()) {
    if (!asked_on_command_line) return "";
    throw ConfigError(fmt::format(
        "--resume: {} has no job.checkpoint_dir; set it to the folder of its checkpoints",
        job_.file.string()));
  }
  const std::filesystem::path dir = root();
  auto found = checkpoint::newest(dir);
  if (!asked) {
    if (!found) return "";
    return fmt::format(
        "{} holds checkpoints (the newest: step {}); this run starts fresh (twinkle run "
        "--resume continues from the newest)",
        dir.string(), found->manifest.step);
  }
  if (!found) {
    if (!asked_on_command_line)
      return fmt::format("no checkpoint in {} yet; starting fresh", dir.string());
    throw ConfigError(
        fmt::format("--resume: no complete checkpoint in {}; run without --resume to start fresh",
                    dir.string()));
  }
  const auto diffs = checkpoint::differences(found->manifest.groups, checkpoint::shapes_of(job_));
  if (!diffs.empty()) {
    throw ConfigError(fmt::format(
        "--resume: the checkpoint {} does not fit {}: {}; resume with the groups and meshes "
        "it was written with, or start fresh without --resume",
        found->dir.string(), job_.file.string(), fmt::join(diffs, "; ")));
  }
  resume_ = std::move(found);
  return fmt::format("resuming from the checkpoint of step {} ({}, written {} by run {})",
                     resume_->manifest.step, resume_->dir.string(), resume_->manifest.created,
                     resume_->manifest.run_id);
}

Value RunCheckpoints::resumed() const {
  if (!resume_) return Value();
  return Value::map({{"step", resume_->manifest.step}, {"meta", resume_->manifest.meta}});
}

bool RunCheckpoints::write(std::int64_t step, const Value& meta, CallTable& table) {
  if (job_.checkpoint_dir.empty()) return false;
  const std::string what = fmt::format("checkpoint of step {}", step);
  std::filesystem::path tmp;
  try {
    checkpoint::check_meta(meta);
    tmp = checkpoint::begin(root(), step, run_id_);
  } catch (const Error& e) {
    throw CallError(fmt::format("{}: {}", what, e.what()));
  }
  auto part_of = [&table](std::size_t p) {
    const WorkerInfo& w = table.workers()[p];
    return checkpoint::part_name(table.groups()[w.group].name, w.index);
  };
  try {
    const auto parts = table.save(proto::Save{tmp.string(), "", step}, part_of);
    checkpoint::Manifest m;
    m.step = step;
    m.meta = meta;
    m.job = job_.name;
    m.run_id = run_id_;
    m.groups = checkpoint::shapes_of(job_);
    for (std::size_t p = 0; p < parts.size(); ++p) {
      m.parts.push_back({table.workers()[p].name, part_of(p), parts[p].sha256, parts[p].bytes,
                         parts[p].instances});
    }
    last_ = checkpoint::publish(root(), tmp, std::move(m), job_.checkpoint_keep);
    last_step_ = step;
    return true;
  } catch (const Error& e) {
    std::error_code ec;
    std::filesystem::remove_all(tmp, ec);  // nothing published changes
    if (dynamic_cast<const CallError*>(&e)) throw;
    throw CallError(fmt::format("{}: {}", what, e.what()));
  }
}

std::optional<checkpoint::Found> RunCheckpoints::for_restart() const {
  auto n = checkpoint::newest(root());
  if (n && (n->manifest.run_id == run_id_ || (resume_ && n->dir == resume_->dir))) return n;
  return std::nullopt;
}

std::string RunCheckpoints::where() const {
  if (last_step_)
    return fmt::format("after the checkpoint of step {} ({})", *last_step_, last_.string());
  if (auto n = checkpoint::newest(root()))
    return fmt::format("without a new checkpoint (the newest is step {}, {})", n->manifest.step,
                       n->dir.string());
  return "without a checkpoint (--resume will find none)";
}

}  // namespace twinkle::core
