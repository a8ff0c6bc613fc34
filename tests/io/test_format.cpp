// JSON, CRC32C and safetensors: against hand-written bytes, published check values and the
// Python `safetensors` package (when python3 can import it).
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "train/temp_dir.hpp"
#include "trellis/io/checksum.hpp"
#include "trellis/io/json.hpp"
#include "trellis/io/safetensors.hpp"

using namespace trellis;
using namespace trellis::io;

TEST_CASE("json parses and writes every kind of value", "[json]") {
  auto v = json::parse(R"( {"a": [1, -2, 3.5, 1e3, true, false, null], "b": {"c": "x\"\\\n\u00e9\ud83d\ude00"},
                          "big": 9007199254740993} )");
  const auto& a = v.at("a").as_array();
  REQUIRE(a.size() == 7);
  REQUIRE(a[0].as_int() == 1);
  REQUIRE(a[1].as_int() == -2);
  REQUIRE(a[2].as_double() == 3.5);
  REQUIRE(a[3].as_double() == 1000.0);
  REQUIRE(a[4].as_bool());
  REQUIRE_FALSE(a[5].as_bool());
  REQUIRE(a[6].is_null());
  REQUIRE(v.at("b").at("c").as_string() == "x\"\\\n\xc3\xa9\xf0\x9f\x98\x80");
  REQUIRE(v.at("big").as_int() == 9007199254740993LL);  // beyond double precision: kept exact
  // Writing and re-reading gives the same value; keys come out sorted.
  std::string text = json::dump(v);
  REQUIRE(text.starts_with(R"({"a":[1,-2,3.5,1000.0,true,false,null],"b":{"c":"x\"\\\n)"));
  REQUIRE(json::dump(json::parse(text)) == text);
  REQUIRE(json::dump(json::Value(0.1)) == "0.1");  // shortest round-trip form
  REQUIRE(json::dump(json::Value(std::nan(""))) == "null");
  REQUIRE(json::dump(json::Value("\x01")) == "\"\\u0001\"");
  // -0.0 keeps its sign through a write and a read ("-0" would read back as the integer 0; found
  // by fuzz/json.cpp, regression input fuzz/corpus/json/seed-numbers)
  REQUIRE(json::dump(json::Value(-0.0)) == "-0.0");
  const auto z = json::parse(json::dump(json::Value(-0.0)));
  REQUIRE((!z.is_int() && z.as_double() == 0.0 && std::signbit(z.as_double())));
  REQUIRE(json::dump(json::parse("[-0, 0.0]")) == "[0,0.0]");  // a double stays a double
  // Integers beyond int64 read as doubles (as_int then refuses them), as any that do not fit.
  REQUIRE_FALSE(json::parse("18446744073709551615").is_int());
  REQUIRE(json::parse("9223372036854775807").as_int() == INT64_MAX);
  REQUIRE(json::parse("-9223372036854775808").as_int() == INT64_MIN);
  REQUIRE_THROWS_WITH(json::parse("99999999999999999999").as_int("train.step"),
                      Catch::Contains("train.step is not an integer"));
}

TEST_CASE("json keeps the rules our files rely on over nlohmann-json's defaults", "[json]") {
  // Duplicate keys: nlohmann keeps the last silently; we refuse them, naming where.
  REQUIRE_THROWS_WITH(json::parse(R"({"x": [{"a": 1, "a": 2}]})", "index.json"),
                      Catch::Contains("index.json") && Catch::Contains("duplicate key \"a\" in /x/0"));
  // Nesting is capped (64 levels pass, 65 do not), so everything after recurses boundedly.
  REQUIRE_NOTHROW(json::parse(std::string(64, '[') + std::string(64, ']')));
  REQUIRE_THROWS_WITH(json::parse(std::string(65, '[') + std::string(65, ']')), Catch::Contains("nesting deeper than 64"));
  // Comments, ill-formed UTF-8 and a lone surrogate are not JSON.
  for (const char* bad : {"[1] // c", "/* c */ 1", "\"\xff\"", "\"\xc3\"", "\"\\udc00\""}) {
    INFO(bad);
    REQUIRE_THROWS_AS(json::parse(bad), Error);
  }
  // Writing a string that is not UTF-8 is an error, not a file that no reader accepts.
  REQUIRE_THROWS_WITH(json::dump(json::Value("ok\xff")), Catch::Contains("cannot write JSON") && Catch::Contains("UTF-8"));
  // Pretty output reads back to the same value.
  const auto v = json::parse(R"({"b": [1, 2, {"c": [3.5, null]}], "a": "x"})");
  REQUIRE(json::dump(json::parse(json::dump(v, 1))) == json::dump(v));
  REQUIRE(json::dump(v, 1).starts_with("{\n \"a\": \"x\",\n \"b\": ["));
}

TEST_CASE("json rejects malformed text with the position", "[json]") {
  for (const char* bad : {"", "{", "[1,]", "{\"a\" 1}", "01", "\"abc", "tru", "{\"a\":1,\"a\":2}",
                          "[1] x", "\"\\ud800\"", "\"\\q\"", "-", "1.2.3"}) {
    INFO(bad);
    REQUIRE_THROWS_AS(json::parse(bad, "test text"), Error);
  }
  try {
    json::parse("[1, 2,, 3]", "my.json");
    FAIL("no error");
  } catch (const Error& e) {
    REQUIRE_THAT(e.what(), Catch::Contains("my.json") && Catch::Contains("byte 6"));
  }
  REQUIRE_THROWS_WITH(json::parse("{}").at("k", "the index"), Catch::Contains("missing key \"k\""));
}

TEST_CASE("crc32c matches the RFC 3720 check values", "[crc32c]") {
  const std::string digits = "123456789";
  REQUIRE(crc32c(digits.data(), digits.size()) == 0xE3069283u);
  std::vector<unsigned char> zeros(32, 0), ones(32, 0xff), inc(32);
  std::iota(inc.begin(), inc.end(), 0);
  REQUIRE(crc32c(zeros.data(), 32) == 0x8A9136AAu);
  REQUIRE(crc32c(ones.data(), 32) == 0x62A8AB43u);
  REQUIRE(crc32c(inc.data(), 32) == 0x46DD794Eu);
  // Hardware and table paths agree on every length and alignment; incremental == one shot.
  std::vector<unsigned char> data(1000);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<unsigned char>(i * 7919 % 251);
  for (std::size_t off : {0, 1, 3}) {
    for (std::size_t n : {0, 1, 7, 8, 9, 63, 500, 997}) {
      REQUIRE(crc32c(data.data() + off, n) == crc32c_portable(data.data() + off, n));
    }
  }
  Crc32c c;
  c.update(data.data(), 13);
  c.update(data.data() + 13, 987);
  REQUIRE(c.value() == crc32c(data.data(), 1000));
}

namespace {
std::vector<float> ramp(std::size_t n, float scale, float shift) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<float>(i) * scale + shift;
  return v;
}
bool python_has_safetensors() {
  return std::system("python3 -c 'import safetensors, numpy' >/dev/null 2>&1") == 0;
}
}  // namespace

TEST_CASE("safetensors file layout is the documented one", "[safetensors]") {
  TempDir dir("st-layout");
  auto a = ramp(6, 0.5f, -1.0f);
  std::vector<std::int32_t> b = {7, -8, 9};
  SafetensorsWriter w;
  w.add("a", DType::f32, {2, 3}, a.data());
  w.add("b", DType::i32, {3}, b.data());
  w.set_metadata("note", "hi");
  auto path = dir.path / "x.safetensors";
  w.write(path);

  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), {});
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);  // little-endian
  REQUIRE((8 + n) % 8 == 0);
  REQUIRE(bytes.size() == 8 + n + 6 * 4 + 3 * 4);
  auto header = json::parse(bytes.substr(8, n));
  REQUIRE(header.at("a").at("dtype").as_string() == "F32");
  REQUIRE(header.at("a").at("data_offsets").as_array()[1].as_int() == 24);
  REQUIRE(header.at("b").at("data_offsets").as_array()[0].as_int() == 24);
  REQUIRE(header.at("__metadata__").at("note").as_string() == "hi");
  REQUIRE(header.at("__metadata__").at("crc32c.a").as_string() == crc_hex(crc32c(a.data(), 24)));
  float first;
  std::memcpy(&first, bytes.data() + 8 + n, 4);
  REQUIRE(first == -1.0f);

  SafetensorsFile f(path);
  REQUIRE(f.read_as<float>("a") == a);
  REQUIRE(f.read_as<std::int32_t>("b") == b);
  REQUIRE(f.entry("a").shape == Shape{2, 3});
  REQUIRE(f.metadata().at("note") == "hi");
  REQUIRE_THROWS_WITH(f.read_as<float>("b"), Catch::Contains("is I32"));
  REQUIRE_THROWS_WITH(f.entry("c"), Catch::Contains("no tensor \"c\""));
}

TEST_CASE("safetensors rejects truncated and corrupt files, naming them", "[safetensors]") {
  TempDir dir("st-bad");
  auto a = ramp(100, 1.0f, 0.0f);
  SafetensorsWriter w;
  w.add("a", DType::f32, {100}, a.data());
  auto path = dir.path / "a.safetensors";
  w.write(path);
  auto size = std::filesystem::file_size(path);

  SECTION("truncated data") {
    std::filesystem::resize_file(path, size - 4);
    REQUIRE_THROWS_WITH(SafetensorsFile(path), Catch::Contains("a.safetensors") && Catch::Contains("truncated"));
  }
  SECTION("truncated header") {
    std::filesystem::resize_file(path, 20);
    REQUIRE_THROWS_WITH(SafetensorsFile(path), Catch::Contains("a.safetensors"));
  }
  SECTION("flipped data byte") {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(size - 10));
    f.put('\x55');
    f.close();
    SafetensorsFile st(path);  // the header is fine
    REQUIRE_THROWS_WITH(st.read_as<float>("a"), Catch::Contains("checksum mismatch") && Catch::Contains("\"a\""));
  }
  SECTION("not safetensors") {
    std::ofstream(path) << "hello";
    REQUIRE_THROWS_AS(SafetensorsFile(path), Error);
  }
}

TEST_CASE("Python's safetensors package reads our files and we read its files", "[safetensors][python]") {
  if (!python_has_safetensors()) {
    WARN("SKIPPED: python3 with the safetensors and numpy packages is not importable "
         "(pip install safetensors numpy)");
    return;
  }
  TempDir dir("st-python");
  auto a = ramp(24, 0.25f, -3.0f);
  std::vector<std::int32_t> b = {1, -2, 3, -4};
  std::vector<half> h;
  for (int i = 0; i < 5; ++i) h.push_back(half(static_cast<float>(i) * 0.5f));
  SafetensorsWriter w;
  w.add("h.0.attn.c_attn.weight", DType::f32, {2, 3, 4}, a.data());
  w.add("ids", DType::i32, {4}, b.data());
  w.add("half", DType::f16, {5}, h.data());
  w.set_metadata("step", "42");
  auto ours = dir.path / "ours.safetensors";
  w.write(ours);

  std::string script =
      "import numpy as np\n"
      "from safetensors import safe_open\n"
      "from safetensors.numpy import load_file, save_file\n"
      "t = load_file('" + ours.string() + "')\n"
      "assert set(t) == {'h.0.attn.c_attn.weight', 'ids', 'half'}, t.keys()\n"
      "ref = (np.arange(24, dtype=np.float32) * np.float32(0.25) - np.float32(3)).reshape(2, 3, 4)\n"
      "assert t['h.0.attn.c_attn.weight'].dtype == np.float32\n"
      "assert np.array_equal(t['h.0.attn.c_attn.weight'], ref)\n"
      "assert np.array_equal(t['ids'], np.array([1, -2, 3, -4], dtype=np.int32))\n"
      "assert np.array_equal(t['half'], np.arange(5, dtype=np.float16) * np.float16(0.5))\n"
      "with safe_open('" + ours.string() + "', framework='np') as f:\n"
      "    assert f.metadata()['step'] == '42'\n"
      "save_file({'w': np.arange(12, dtype=np.float32).reshape(3, 4) / 8, 'e': np.zeros((0, 2), np.float32)},\n"
      "          '" + (dir.path / "theirs.safetensors").string() + "', metadata={'k': 'v'})\n";
  auto script_path = dir.path / "check.py";
  std::ofstream(script_path) << script;
  int rc = std::system(("python3 " + script_path.string()).c_str());
  REQUIRE(rc == 0);

  SafetensorsFile theirs(dir.path / "theirs.safetensors");
  REQUIRE(theirs.metadata().at("k") == "v");
  REQUIRE(theirs.entry("w").shape == Shape{3, 4});
  REQUIRE(theirs.entry("e").shape == Shape{0, 2});
  auto wv = theirs.read_as<float>("w");
  for (int i = 0; i < 12; ++i) REQUIRE(wv[i] == static_cast<float>(i) / 8);
}

TEST_CASE("damaged safetensors headers give Errors, never crashes", "[safetensors][fuzz]") {
  TempDir dir("st-fuzz");
  auto a = ramp(60, 1.0f, 0.0f);
  std::vector<std::int32_t> b = {1, 2, 3};
  SafetensorsWriter w;
  w.add("h.0.attn.c_attn.weight", DType::f32, {3, 4, 5}, a.data());
  w.add("ids", DType::i32, {3}, b.data());
  w.set_metadata("k", "v");
  const auto good = dir.path / "good.safetensors";
  w.write(good);
  const std::string bytes = read_whole_file(good);
  std::uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  std::mt19937 gen(1234);
  const char alphabet[] = "0123456789[]{},:\"-e. FIU";
  int opened = 0, rejected = 0;
  for (int trial = 0; trial < 400; ++trial) {
    std::string bad = bytes;
    const int edits = 1 + static_cast<int>(gen() % 4);
    for (int e = 0; e < edits; ++e) {
      const std::size_t pos = 8 + gen() % n;
      bad[pos] = gen() % 2 ? alphabet[gen() % (sizeof alphabet - 1)] : static_cast<char>(gen() % 256);
    }
    if (trial % 10 == 0) bad.resize(gen() % bad.size());  // truncations too
    const auto path = dir.path / "bad.safetensors";
    {
      std::ofstream out(path, std::ios::binary | std::ios::trunc);
      out.write(bad.data(), static_cast<std::streamsize>(bad.size()));
    }
    try {
      SafetensorsFile f(path);
      for (const auto& e : f.entries()) (void)f.read(e.name);
      ++opened;
    } catch (const Error&) {
      ++rejected;
    }
  }
  INFO(opened << " opened, " << rejected << " rejected");
  REQUIRE(rejected > 200);  // most edits break the header; the rest were harmless (e.g. in metadata)
}
