// metrics.jsonl: one JSON object per line per step, flushed as written, so a crashed run keeps
// everything up to its last step and any tool (jq, pandas.read_json(lines=True)) reads it.
//   {"step":10,"loss":3.2,"lr":0.0003,"grad_norm":1.1,"tokens_per_s":51200,"mfu":0.31,"elapsed_s":12.5}
// plus "val_loss" on the steps that evaluated, and any extra fields the caller adds.
// Also the model-FLOPs helpers behind MFU.
#pragma once

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "trellis/core/error.hpp"
#include "trellis/io/atomic_file.hpp"
#include "trellis/io/json.hpp"
#include "trellis/report/loss_curve.hpp"

namespace trellis::train {

struct StepMetrics {
  std::int64_t step = 0;
  double loss = 0.0;
  double lr = 0.0;
  double grad_norm = 0.0;
  double tokens_per_s = 0.0;
  double mfu = 0.0;  // fraction of peak, 0..1
  double elapsed_s = 0.0;
  std::optional<double> val_loss{};
  io::json::Object extra{};  // anything else worth a column

  io::json::Value to_json() const {
    io::json::Object o = extra;
    o["step"] = io::json::Value(step);
    o["loss"] = io::json::Value(loss);
    o["lr"] = io::json::Value(lr);
    o["grad_norm"] = io::json::Value(grad_norm);
    o["tokens_per_s"] = io::json::Value(tokens_per_s);
    o["mfu"] = io::json::Value(mfu);
    o["elapsed_s"] = io::json::Value(elapsed_s);
    if (val_loss) o["val_loss"] = io::json::Value(*val_loss);
    return io::json::Value(std::move(o));
  }
};

class MetricsWriter {
 public:
  // `append` continues a resumed run's file; otherwise the file starts empty.
  explicit MetricsWriter(const std::filesystem::path& path, bool append = false)
      : path_(path), out_(path, append ? std::ios::app : std::ios::trunc) {
    TRELLIS_CHECK(out_.good(), "cannot open metrics file ", path, " for writing");
  }
  void write(const StepMetrics& m) { write_line(m.to_json()); }
  void write_line(const io::json::Value& object) {
    out_ << io::json::dump(object) << '\n';
    out_.flush();
    TRELLIS_CHECK(out_.good(), "writing metrics file ", path_, " failed");
  }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  std::ofstream out_;
};

// Every line of a metrics.jsonl file (blank lines skipped; a torn last line is an error naming
// the file and line).
inline std::vector<io::json::Value> read_metrics(const std::filesystem::path& path) {
  std::vector<io::json::Value> rows;
  const std::string text = io::read_whole_file(path);
  std::size_t start = 0, line = 1;
  while (start < text.size()) {
    std::size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    std::string_view row(text.data() + start, end - start);
    if (!row.empty()) rows.push_back(io::json::parse(row, path.string() + " line " + std::to_string(line)));
    start = end + 1;
    ++line;
  }
  return rows;
}

// A resumed run continues from its checkpoint's step, so rows a crashed run wrote after that step
// would be written again: removes every row whose "step" is greater than `step` (and a torn last
// line, which a crash while writing leaves), rewriting the file atomically. Returns the number of
// rows removed. A malformed line elsewhere is an error naming the file and line.
inline std::size_t trim_metrics_after(const std::filesystem::path& path, std::int64_t step) {
  const std::string text = io::read_whole_file(path);
  std::string kept;
  std::size_t start = 0, line = 1, removed = 0;
  while (start < text.size()) {
    std::size_t end = text.find('\n', start);
    const bool last = end == std::string::npos || end + 1 == text.size();
    if (end == std::string::npos) end = text.size();
    std::string_view row(text.data() + start, end - start);
    bool keep = true;
    if (!row.empty()) {
      try {
        const io::json::Value v = io::json::parse(row, path.string() + " line " + std::to_string(line));
        const auto* s = v.find("step");
        keep = !(s && s->is_number() && s->as_double() > static_cast<double>(step));
      } catch (const Error&) {
        if (!last) throw;
        keep = false;  // torn by a crash while it was written
      }
    }
    if (keep) {
      kept.append(row);
      kept += '\n';
    } else {
      ++removed;
    }
    start = end + 1;
    ++line;
  }
  if (removed > 0) io::write_file_atomically(path, kept);
  return removed;
}

// Training FLOPs per token of a GPT (forward + backward, PaLM appendix B):
//   6 * n_params + 12 * n_layers * d_model * seq_len  (the second term is attention's QK^T and AV)
// n_params: the parameters a token uses (with MoE blocks: moe_active_parameters).
// seq_len: the keys each token attends to in the formula's convention (the context T; for packed
// documents the mean span, sum of len^2 / sum of len: DataLoader::attention_span).
inline double gpt_flops_per_token(double n_params, int n_layers, int d_model, double seq_len) {
  return 6.0 * n_params + 12.0 * n_layers * static_cast<double>(d_model) * seq_len;
}
// Mixture of Experts (nn/moe.hpp): a token runs each MoE block's router (W x E weights, 2 W E
// FLOPs forward, counted whole) and `topk` of its `experts` experts, each a GPT-2 MLP (c_fc and
// c_proj: 8 W^2 weights, 16 W^2 FLOPs forward, + 5 W biases). So 6N's N is the model's `n_params`
// less, in each of its `moe_layers` MoE blocks, the experts - topk experts the token skips.
// expert_biases: whether n_params counts the experts' biases (a model's parameter count does;
// plan::model_flops counts weight matrices only).
inline double moe_active_parameters(double n_params, double moe_layers, int experts, int topk, int d_model,
                                    bool expert_biases = true) {
  TRELLIS_CHECK(moe_layers >= 0 && topk >= 1 && experts >= topk, "moe_active_parameters: top-", topk, " of ",
                experts, " experts in ", moe_layers, " MoE blocks");
  const double W = d_model, expert = 8 * W * W + (expert_biases ? 5 * W : 0.0);
  return n_params - moe_layers * (experts - topk) * expert;
}
// Model FLOPs utilisation: achieved model FLOP/s over the hardware's peak (all devices used).
inline double model_flops_utilization(double flops_per_token, double tokens_per_s, double peak_flops) {
  TRELLIS_CHECK(peak_flops > 0, "MFU needs a positive peak FLOP/s, got ", peak_flops);
  return flops_per_token * tokens_per_s / peak_flops;
}

// Train points from "loss" and validation points from "val_loss" of every metrics row.
struct LossCurves {
  std::vector<report::CurvePoint> train, val;
};
inline LossCurves loss_curves_from_metrics(const std::filesystem::path& metrics_jsonl) {
  LossCurves c;
  for (const auto& row : read_metrics(metrics_jsonl)) {
    const auto* step = row.find("step");
    if (!step || !step->is_number()) continue;
    if (const auto* l = row.find("loss"); l && l->is_number()) c.train.push_back({step->as_double(), l->as_double()});
    if (const auto* v = row.find("val_loss"); v && v->is_number()) c.val.push_back({step->as_double(), v->as_double()});
  }
  return c;
}

}  // namespace trellis::train
