// The schedule text format (round trip, hand-written schedules, parse errors with line/column) and
// the pictures (SVG boxes per action, Chrome trace events per action).
#include <catch2/catch.hpp>
#include <cstdio>
#include <regex>
#include <string>

#include "trellis/pipe/generators.hpp"
#include "trellis/pipe/picture.hpp"
#include "trellis/pipe/simulate.hpp"
#include "trellis/pipe/text.hpp"
#include "trellis/pipe/verify.hpp"

using namespace trellis::pipe;

namespace {
std::string parse_error(const std::string& text) {
  try {
    parse_schedule(text);
  } catch (const trellis::Error& e) {
    return e.what();
  }
  return "";
}
int count_of(const std::string& text, const std::string& part) {
  int n = 0;
  for (std::size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}
}  // namespace

TEST_CASE("to_text round-trips every generator", "[pipe][text]") {
  for (const auto& name : schedule_names())
    for (int p : {1, 2, 3, 4})
      for (int m : {2 * p, 3 * p}) {
        const int v = name == "interleaved_1f1b" ? 2 : 1;
        INFO(name << " p=" << p << " m=" << m);
        Schedule s = make_schedule(name, p, m, v);
        const std::string text = to_text(s);
        Schedule back = parse_schedule(text);
        REQUIRE(same_schedule(back, s));
        REQUIRE(to_text(back) == text);
        // without the communication, parsing re-inserts exactly what the generator inserted
        Schedule compute = parse_schedule(to_text(s, {.with_communication = false}));
        REQUIRE(same_schedule(compute, s));
      }
}

TEST_CASE("a hand-written schedule parses, gets its communication and verifies", "[pipe][text]") {
  const std::string text =
      "# my 1F1B on two ranks\n"
      "@ name=mine backward=full\n"
      "F0 F1 B0 W0 F2 B1 W1 B2 W2   # rank 0\n"
      "\n"
      "F0 B0 W0 F1 B1 W1 F2 B2 W2\n";
  Schedule s = parse_schedule(text);
  REQUIRE(s.name == "mine");
  REQUIRE(s.stages == 2);
  REQUIRE(s.microbatches == 3);
  REQUIRE(s.chunks == 1);
  REQUIRE(s.full_backward);
  REQUIRE_NOTHROW(verify(s));
  // rank 1 receives before each forward; rank 0 sends after each forward
  REQUIRE(s.ranks[1][0] == recv_action(Direction::activation, 0, 0, 0));
  REQUIRE(s.ranks[0][1] == send_action(Direction::activation, 0, 0, 1));
  // the same schedule as the generator makes
  Schedule g = one_f_one_b(2, 3);
  REQUIRE(s.ranks == g.ranks);

  // chunks and explicit communication; vee placement
  Schedule v = parse_schedule(
      "@ placement=vee backward=split\n"
      "F0.0 Sa0.0>1 Ra0.1<1 F0.1 B0.1 Sg0.1>1 W0.1 Rg0.0<1 B0.0 W0.0\n"
      "Ra0.0<0 F0.0 F0.1 Sa0.1>0 Rg0.1<0 B0.1 B0.0 Sg0.0>0 W0.1 W0.0\n");
  REQUIRE(v.chunks == 2);
  REQUIRE(v.placement == Placement::vee);
  REQUIRE_NOTHROW(verify(v));
}

TEST_CASE("parse errors name the line and column", "[pipe][text]") {
  auto e = parse_error("F0 B0 W0\nF0 X1 B0\n");
  INFO(e);
  REQUIRE_THAT(e, Catch::Contains("line 2, column 4: unknown action 'X1'"));
  e = parse_error("F0 B W0\n");
  REQUIRE_THAT(e, Catch::Contains("line 1, column 5: expected a microbatch number"));
  e = parse_error("F0 B0 W0\nRa0 F0 B0 W0\n");
  REQUIRE_THAT(e, Catch::Contains("line 2, column 4: expected '<' and the peer rank after a recv"));
  e = parse_error("F0 B0x W0\n");
  REQUIRE_THAT(e, Catch::Contains("line 1, column 6: unexpected 'x' after action 'B0'"));
  e = parse_error("@ placement=zigzag\nF0 B0 W0\n");
  REQUIRE_THAT(e, Catch::Contains("line 1, column 13: placement must be 'vee' or 'loop', got 'zigzag'"));
  e = parse_error("@ colour=red\nF0 B0 W0\n");
  REQUIRE_THAT(e, Catch::Contains("line 1, column 3: unknown header key 'colour'"));
  e = parse_error("@ stages=3\nF0 B0 W0\nF0 B0 W0\n");
  REQUIRE_THAT(e, Catch::Contains("line 1, column 1: the header says stages=3 but there are 2 rank lines"));
  e = parse_error("# nothing\n\n");
  REQUIRE_THAT(e, Catch::Contains("no rank lines"));
  e = parse_error("F0 B0 W0\n@ name=late\n");
  REQUIRE_THAT(e, Catch::Contains("line 2, column 1: the '@' header must come before the rank lines"));
  // stages x chunks past the int range of virtual stage numbers: an error, not an overflow (found by
  // fuzz/schedule.cpp under UBSan; regression input fuzz/corpus/schedule/seed-big-numbers)
  e = parse_error("@ microbatches=1000000000 chunks=1000000000\nF999999999.999999999\nF0\nF0\n");
  REQUIRE_THAT(e, Catch::Contains("3 stages x 1000000000 chunks is more than 1073741824 virtual stages"));
  Schedule wide = parse_schedule("@ chunks=1000000000\nSa0>1\nF0\nF0\n");  // no insertion: parses
  REQUIRE_THROWS_WITH(verify(wide), Catch::Contains("virtual stages"));
  // a well-formed text with a broken schedule parses, and the verifier names the problem
  Schedule broken = parse_schedule("F0 B1 F1 W1 B0 W0\nF0 B0 W0 F1 B1 W1\n");
  REQUIRE_THROWS_WITH(verify(broken),
                      Catch::Contains("rank 0: backward-input of microbatch 1, chunk 0 (B1.0) runs "
                                      "before its input: it needs forward of microbatch 1"));
}

TEST_CASE("schedules load from and save to files", "[pipe][text]") {
  const std::string path = "pipe_text_test_schedule.txt";
  Schedule s = dualpipe_v(3, 6);
  save_schedule(path, s);
  REQUIRE(same_schedule(load_schedule(path), s));
  write_file(path, "F0 B0 W0\nF0 B0 W0 Q\n");
  REQUIRE_THROWS_WITH(load_schedule(path),
                      Catch::Contains("load_schedule 'pipe_text_test_schedule.txt': schedule text, "
                                      "line 2, column 10: unknown action 'Q'"));
  std::remove(path.c_str());
  REQUIRE_THROWS_WITH(load_schedule("/nonexistent/dir/x.txt"), Catch::Contains("cannot open"));
}

TEST_CASE("SVG: one box per compute action, rows per rank, bubbles visible", "[pipe][picture]") {
  Schedule s = one_f_one_b(3, 4);
  const std::string svg = to_svg(s);
  REQUIRE(svg.rfind("<svg", 0) == 0);
  REQUIRE(svg.find("</svg>") != std::string::npos);
  REQUIRE(count_of(svg, "<rect class=\"F\"") == 3 * 4);
  REQUIRE(count_of(svg, "<rect class=\"B\"") == 3 * 4);
  REQUIRE(count_of(svg, "<rect class=\"W\"") == 3 * 4);
  REQUIRE(count_of(svg, "<rect class=\"idle\"") == 3);
  REQUIRE(count_of(svg, ">rank ") >= 3);
  // title carries the simulated bubble: (p-1)/(m+p-1) = 2/6
  REQUIRE(svg.find("bubble 33.3%") != std::string::npos);
}

TEST_CASE("Chrome trace: one complete event per action, one track per rank", "[pipe][picture]") {
  Schedule s = zero_bubble_v(2, 4);
  auto sim = simulate(s, {1, 1, 1, 0});
  const std::string json = to_chrome_trace(sim.timeline);
  REQUIRE(json.find("\"traceEvents\"") != std::string::npos);
  REQUIRE(count_of(json, "\"ph\": \"X\"") == static_cast<int>(sim.timeline.events.size()));
  REQUIRE(count_of(json, "\"thread_name\"") == 2);
  REQUIRE(count_of(json, "\"cat\": \"F\"") == 2 * 4 * 2);
  // events are well-formed: every "ts" is followed by a "dur" that is not negative
  std::regex dur("\"dur\": (-?[0-9.]+)");
  int checked = 0;
  for (auto it = std::sregex_iterator(json.begin(), json.end(), dur); it != std::sregex_iterator(); ++it) {
    REQUIRE(std::stod((*it)[1]) >= 0);
    ++checked;
  }
  REQUIRE(checked == static_cast<int>(sim.timeline.events.size()));
}
