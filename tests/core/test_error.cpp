// trellis::Error carries the message, file:line and the rank of the raising thread.
#include <catch2/catch.hpp>

#include <string>
#include <thread>

#include "trellis/core/error.hpp"

TEST_CASE("checks throw Error with location and rank", "[error]") {
  int x = 3;
  try {
    TRELLIS_CHECK_EQ(x, 4, "x must be four");
    FAIL("no throw");
  } catch (const trellis::Error& e) {
    std::string what = e.what();
    REQUIRE(what.find("x == 4") != std::string::npos);
    REQUIRE(what.find("(3 vs 4)") != std::string::npos);
    REQUIRE(what.find("x must be four") != std::string::npos);
    REQUIRE(what.find("test_error.cpp") != std::string::npos);
    REQUIRE(e.rank() == -1);
    REQUIRE(what.find("[rank") == std::string::npos);
  }

  std::thread worker([] {
    trellis::RankScope scope(5);
    try {
      TRELLIS_CHECK(false, "on a rank");
    } catch (const trellis::Error& e) {
      CHECK(e.rank() == 5);
      CHECK(std::string(e.what()).find("[rank 5]") != std::string::npos);
    }
  });
  worker.join();
  REQUIRE(trellis::current_rank() == -1);
  REQUIRE_NOTHROW([] { TRELLIS_CHECK(1 + 1 == 2); }());
}
