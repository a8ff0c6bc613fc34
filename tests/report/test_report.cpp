// Metrics lines, the progress display (terminal and plain) and the SVG loss curve: exact text
// for hand-picked inputs, structure of the SVG (and well-formed XML per Python's parser when
// python3 is present).
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <sstream>

#include "train/temp_dir.hpp"
#include "trellis/report/loss_curve.hpp"
#include "trellis/report/progress.hpp"
#include "trellis/train/metrics.hpp"

using namespace trellis;
using namespace trellis::io;
using namespace trellis::report;
using namespace trellis::train;

namespace {
int count(const std::string& s, const std::string& needle) {
  int n = 0;
  for (std::size_t p = s.find(needle); p != std::string::npos; p = s.find(needle, p + 1)) ++n;
  return n;
}
}  // namespace

TEST_CASE("metrics.jsonl: one object per step, read back exactly", "[metrics]") {
  TempDir dir("metrics");
  const auto path = dir.path / "metrics.jsonl";
  {
    MetricsWriter w(path);
    w.write({.step = 1, .loss = 5.5, .lr = 3e-4, .grad_norm = 1.25, .tokens_per_s = 1000, .mfu = 0.25, .elapsed_s = 0.5});
    StepMetrics m{.step = 2, .loss = NAN, .lr = 3e-4, .val_loss = 4.75};
    m.extra["note"] = json::Value("diverged?");
    w.write(m);
  }
  std::ifstream in(path);
  std::string first;
  std::getline(in, first);
  REQUIRE(first ==
          R"({"elapsed_s":0.5,"grad_norm":1.25,"loss":5.5,"lr":0.0003,"mfu":0.25,"step":1,"tokens_per_s":1000.0})");
  auto rows = read_metrics(path);
  REQUIRE(rows.size() == 2);
  REQUIRE(rows[1].at("step").as_int() == 2);
  REQUIRE(rows[1].at("loss").is_null());  // NaN has no JSON spelling
  REQUIRE(rows[1].at("val_loss").as_double() == 4.75);
  REQUIRE(rows[1].at("note").as_string() == "diverged?");
  {
    MetricsWriter again(path, /*append=*/true);
    again.write({.step = 3});
  }
  REQUIRE(read_metrics(path).size() == 3);
  std::ofstream(path, std::ios::app) << "{\"step\": 4, \"loss\"";  // a torn last line
  REQUIRE_THROWS_WITH(read_metrics(path), Catch::Contains("metrics.jsonl line 4"));

  // GPT-2 small (124M params, 12 layers, d 768, T 1024): 6N + 12 L d T.
  REQUIRE(gpt_flops_per_token(124e6, 12, 768, 1024) == Approx(6 * 124e6 + 12.0 * 12 * 768 * 1024));
  REQUIRE(model_flops_utilization(1e9, 1e5, 4e14) == Approx(0.25));
}

TEST_CASE("progress text: durations, rates, bar and plain lines", "[progress]") {
  REQUIRE(format_duration(59.4) == "59s");
  REQUIRE(format_duration(83) == "1:23");
  REQUIRE(format_duration(7384) == "2:03:04");
  REQUIRE(format_duration(NAN) == "?");
  REQUIRE(format_rate(950) == "950");
  REQUIRE(format_rate(12345) == "12.3k");
  REQUIRE(format_rate(4560000) == "4.56M");

  ProgressInfo p{.step = 120, .total = 500, .loss = 2.34561, .tokens_per_s = 12345, .mfu = 0.3123, .elapsed_s = 12.0};
  // 0.1 s per step, 380 steps left -> 38 s.
  REQUIRE(eta_seconds(p) == Approx(38.0));
  REQUIRE(progress_bar_line(p) == "[####----------------] 120/500  loss 2.3456  12.3k tok/s  MFU 31.2%  ETA 38s");
  REQUIRE(progress_plain_line(p) ==
          "step 120/500 | loss 2.3456 | 12.3k tok/s | MFU 31.2% | elapsed 12s | ETA 38s");
  ProgressInfo with_blas = p;  // train_gpt's second figure: model FLOP/s over the measured sgemm rate
  with_blas.mfu_blas = 0.2456;
  REQUIRE(progress_plain_line(with_blas) ==
          "step 120/500 | loss 2.3456 | 12.3k tok/s | MFU 31.2% (24.6% of sgemm) | elapsed 12s | ETA 38s");
  ProgressInfo moe = p;  // Mixture-of-Experts runs: the auxiliary losses after the loss
  moe.aux_loss = 0.0123;
  REQUIRE(progress_plain_line(moe) == "step 120/500 | loss 2.3456 | aux 0.0123 | 12.3k tok/s | MFU 31.2% | elapsed 12s | ETA 38s");
  ProgressInfo resumed = p;
  resumed.first_step = 100;  // 20 steps in 12 s since the resume
  REQUIRE(eta_seconds(resumed) == Approx(228.0));
  ProgressInfo start{.step = 0, .total = 10};
  REQUIRE(progress_bar_line(start).ends_with("ETA ?"));
}

TEST_CASE("progress bar redraws in place on a terminal, prints lines otherwise", "[progress]") {
  std::ostringstream tty, log;
  {
    ProgressBar bar(tty, /*terminal=*/true);
    ProgressBar plain(log, /*terminal=*/false, /*plain_every=*/5);
    REQUIRE(bar.is_terminal());
    REQUIRE_FALSE(plain.is_terminal());
    for (int s = 1; s <= 12; ++s) {
      ProgressInfo p{.step = s, .total = 12, .loss = 3.0, .tokens_per_s = 100, .mfu = 0.1, .elapsed_s = s * 0.5};
      bar.update(p);
      plain.update(p);
      if (s == 6) bar.message("val loss 2.9");
    }
  }
  const std::string t = tty.str();
  REQUIRE(count(t, "\r\x1b[2K") == 13);  // 12 redraws + clearing the line for the message
  REQUIRE(count(t, "\n") == 2);          // the message and the final newline
  REQUIRE(t.find("val loss 2.9\n") != std::string::npos);
  REQUIRE(t.ends_with("[####################] 12/12  loss 3.0000  100 tok/s  MFU 10.0%  ETA 0s\n"));
  const std::string l = log.str();
  REQUIRE(l.find('\r') == std::string::npos);
  REQUIRE(count(l, "\n") == 4);  // steps 1, 5, 10 and the last
  REQUIRE(l.starts_with("step 1/12 | loss 3.0000"));
  REQUIRE(l.find("step 10/12") != std::string::npos);
  REQUIRE(l.find("step 12/12") != std::string::npos);
}

TEST_CASE("loss curve SVG: nice ticks, both series, legend, labels", "[svg]") {
  REQUIRE(report::detail::nice_step(0, 1000) == 200);
  REQUIRE(report::detail::nice_step(2.1, 5.6) == Approx(0.5));
  REQUIRE(report::detail::nice_step(0, 0.07) == Approx(0.01));
  std::vector<CurvePoint> train, val;
  for (int s = 0; s <= 500; s += 5) train.push_back({static_cast<double>(s), 5.5 * std::exp(-s / 150.0) + 1.6});
  for (int s = 0; s <= 500; s += 100) val.push_back({static_cast<double>(s), 5.5 * std::exp(-s / 150.0) + 1.8});
  train.push_back({505, NAN});  // skipped, not drawn
  const std::string svg = loss_curve_svg(train, val, {.title = "tiny <GPT> & co", .baseline = 3.1});
  REQUIRE(svg.starts_with("<?xml"));
  REQUIRE(svg.find("tiny &lt;GPT&gt; &amp; co") != std::string::npos);
  std::smatch m;
  REQUIRE(std::regex_search(svg, m, std::regex("class=\"train\"[^>]*points=\"([^\"]*)\"")));
  REQUIRE(count(m[1].str(), ",") == 101);
  REQUIRE(count(svg, "class=\"val-point\"") == 6);
  REQUIRE(svg.find(">step</text>") != std::string::npos);
  REQUIRE(svg.find(">loss (nats/token)</text>") != std::string::npos);
  REQUIRE(svg.find(">validation</text>") != std::string::npos);
  REQUIRE(svg.find(">unigram baseline</text>") != std::string::npos);
  for (const char* tick : {">0</text>", ">100</text>", ">500</text>", ">2</text>", ">7</text>"}) {
    INFO(tick);
    REQUIRE(svg.find(tick) != std::string::npos);
  }
  // Empty input still makes a valid frame.
  REQUIRE(loss_curve_svg({}, {}).find("</svg>") != std::string::npos);

  TempDir dir("svg");
  const auto metrics = dir.path / "metrics.jsonl";
  {
    MetricsWriter w(metrics);
    for (const auto& p : train)
      if (std::isfinite(p.loss)) w.write({.step = static_cast<std::int64_t>(p.step), .loss = p.loss});
    w.write({.step = 500, .loss = 1.7, .val_loss = 1.9});
  }
  auto curves = loss_curves_from_metrics(metrics);
  REQUIRE(curves.train.size() == 102);
  REQUIRE(curves.val.size() == 1);
  write_loss_curve_svg(dir.path / "loss.svg", curves.train, curves.val);
  if (std::system("python3 -c 'import xml.etree.ElementTree' >/dev/null 2>&1") == 0) {
    REQUIRE(std::system(("python3 -c \"import xml.etree.ElementTree as E; E.parse('" + (dir.path / "loss.svg").string() +
                         "')\"").c_str()) == 0);
  } else {
    WARN("SKIPPED: python3 not available to check the SVG is well-formed XML");
  }
}
