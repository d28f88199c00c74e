// The float64 oracle (src/ref/) against the golden cases computed independently
// from the seed's math (tests/data/block_attn_res_f64.json), then the library's
// float64 path against the same golden values on every backend.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "attnres/attnres.h"
#include "ref/reference.h"
#include "test_util.h"

#ifndef ATTNRES_TEST_DATA_DIR
#error "ATTNRES_TEST_DATA_DIR must name the tests/data directory"
#endif

namespace attnres_test {
namespace {

// A minimal JSON reader: enough for the golden file (objects, arrays, numbers,
// strings without escapes beyond \" \\ \/ \n \t, true/false/null).
struct Json {
  enum Kind { kNull, kBool, kNumber, kString, kArray, kObject } kind = kNull;
  bool boolean = false;
  double number = 0;
  std::string string;
  std::vector<Json> array;
  std::map<std::string, Json> object;

  bool is_null() const { return kind == kNull; }
  const Json& operator[](const std::string& key) const {
    auto it = object.find(key);
    if (kind != kObject || it == object.end()) {
      throw std::runtime_error("missing key " + key);
    }
    return it->second;
  }
  bool has(const std::string& key) const {
    return kind == kObject && object.count(key) > 0;
  }
};

class JsonParser {
 public:
  explicit JsonParser(const std::string& text) : s_(text) {}

  Json Parse() {
    Json v = Value();
    Space();
    if (pos_ != s_.size()) Fail("trailing characters");
    return v;
  }

 private:
  [[noreturn]] void Fail(const std::string& what) {
    throw std::runtime_error("JSON: " + what + " at offset " + std::to_string(pos_));
  }
  void Space() {
    while (pos_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[pos_]))) ++pos_;
  }
  bool Eat(char c) {
    Space();
    if (pos_ < s_.size() && s_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  void Expect(char c) {
    if (!Eat(c)) Fail(std::string("expected '") + c + "'");
  }
  bool Literal(const char* word) {
    const size_t n = std::char_traits<char>::length(word);
    if (s_.compare(pos_, n, word) == 0) {
      pos_ += n;
      return true;
    }
    return false;
  }
  std::string String() {
    Expect('"');
    std::string out;
    while (pos_ < s_.size() && s_[pos_] != '"') {
      char c = s_[pos_++];
      if (c == '\\') {
        if (pos_ >= s_.size()) Fail("bad escape");
        const char e = s_[pos_++];
        switch (e) {
          case 'n': c = '\n'; break;
          case 't': c = '\t'; break;
          case '"': case '\\': case '/': c = e; break;
          default: Fail("unsupported escape");
        }
      }
      out += c;
    }
    Expect('"');
    return out;
  }
  Json Value() {
    Space();
    if (pos_ >= s_.size()) Fail("unexpected end");
    Json v;
    const char c = s_[pos_];
    if (c == '{') {
      ++pos_;
      v.kind = Json::kObject;
      if (Eat('}')) return v;
      do {
        Space();
        std::string key = String();
        Expect(':');
        v.object[key] = Value();
      } while (Eat(','));
      Expect('}');
    } else if (c == '[') {
      ++pos_;
      v.kind = Json::kArray;
      if (Eat(']')) return v;
      do {
        v.array.push_back(Value());
      } while (Eat(','));
      Expect(']');
    } else if (c == '"') {
      v.kind = Json::kString;
      v.string = String();
    } else if (Literal("true")) {
      v.kind = Json::kBool;
      v.boolean = true;
    } else if (Literal("false")) {
      v.kind = Json::kBool;
    } else if (Literal("null")) {
      v.kind = Json::kNull;
    } else {
      // strtod reads the full JSON number grammar (and NaN/Infinity, harmlessly).
      const char* begin = s_.c_str() + pos_;
      char* end = nullptr;
      v.number = std::strtod(begin, &end);
      if (end == begin) Fail("bad value");
      v.kind = Json::kNumber;
      pos_ += end - begin;
    }
    return v;
  }

  const std::string& s_;
  size_t pos_ = 0;
};

// Nested lists of numbers, flattened in row-major order.
void Flatten(const Json& v, std::vector<double>* out) {
  if (v.kind == Json::kNumber) {
    out->push_back(v.number);
  } else if (v.kind == Json::kArray) {
    for (const Json& e : v.array) Flatten(e, out);
  } else {
    throw std::runtime_error("expected a number or a list");
  }
}
std::vector<double> Flat(const Json& v) {
  std::vector<double> out;
  Flatten(v, &out);
  return out;
}

struct GoldenCase {
  std::string name;
  attnres::ref::Problem problem;
  std::vector<double> grad_h;
  std::vector<double> out, rms, alpha;  // rms empty when the golden has null
  std::vector<std::vector<double>> grad_sources;
  std::vector<double> grad_w, grad_gamma;  // grad_gamma empty when null
};

std::vector<GoldenCase> LoadGolden() {
  const std::string path = std::string(ATTNRES_TEST_DATA_DIR) + "/block_attn_res_f64.json";
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  const Json root = JsonParser(text).Parse();
  std::vector<GoldenCase> cases;
  for (const Json& c : root["cases"].array) {
    GoldenCase g;
    g.name = c["name"].string;
    attnres::ref::Problem& p = g.problem;
    p.tokens = static_cast<int64_t>(c["B"].number) * static_cast<int64_t>(c["T"].number);
    p.dim = static_cast<int64_t>(c["D"].number);
    p.num_blocks = static_cast<int64_t>(c["N"].number);
    p.has_partial = c["partial"].boolean;
    p.rmsnorm = c["enable_rmsnorm"].boolean;
    p.scale = c["scale"].number;
    p.eps = c["eps"].number;
    for (const Json& b : c["blocks"].array) p.sources.push_back(Flat(b));
    if (p.has_partial) p.sources.push_back(Flat(c["partial_block"]));
    p.w = Flat(c["proj_weight"]);
    if (c.has("rmsnorm_gamma") && !c["rmsnorm_gamma"].is_null()) {
      p.gamma = Flat(c["rmsnorm_gamma"]);
    }
    g.grad_h = Flat(c["grad_h"]);
    const Json& e = c["expected"];
    g.out = Flat(e["out"]);
    if (!e["rms"].is_null()) g.rms = Flat(e["rms"]);
    g.alpha = Flat(e["alpha"]);
    for (const Json& b : e["grad_blocks"].array) g.grad_sources.push_back(Flat(b));
    if (p.has_partial) g.grad_sources.push_back(Flat(e["grad_partial"]));
    g.grad_w = Flat(e["grad_proj_weight"]);
    if (!e["grad_gamma"].is_null()) g.grad_gamma = Flat(e["grad_gamma"]);
    cases.push_back(std::move(g));
  }
  return cases;
}

const std::vector<GoldenCase>& Golden() {
  static const std::vector<GoldenCase> cases = LoadGolden();
  return cases;
}

constexpr double kGoldenTol = 1e-12;

TEST(JsonReader, ParsesTheGrammarTheGoldenFileUses) {
  const std::string text =
      R"({"a": [1, -2.5e-3, [3]], "b": null, "c": true, "d": "x\"y", "e": {}})";
  const Json v = JsonParser(text).Parse();
  EXPECT_EQ(Flat(v["a"]), (std::vector<double>{1, -2.5e-3, 3}));
  EXPECT_TRUE(v["b"].is_null());
  EXPECT_TRUE(v["c"].boolean);
  EXPECT_EQ(v["d"].string, "x\"y");
  EXPECT_EQ(v["e"].kind, Json::kObject);
  EXPECT_THROW(JsonParser("[1, 2").Parse(), std::runtime_error);
}

TEST(Reference, GoldenFileHasTheSixCases) {
  const auto& cases = Golden();
  ASSERT_EQ(cases.size(), 6u);
  for (const GoldenCase& g : cases) {
    SCOPED_TRACE(g.name);
    const auto& p = g.problem;
    ASSERT_EQ(static_cast<int64_t>(p.sources.size()), p.num_sources());
    for (const auto& s : p.sources) EXPECT_EQ(static_cast<int64_t>(s.size()), p.tokens * p.dim);
    EXPECT_EQ(static_cast<int64_t>(p.w.size()), p.dim);
    EXPECT_EQ(static_cast<int64_t>(g.out.size()), p.tokens * p.dim);
    EXPECT_EQ(static_cast<int64_t>(g.alpha.size()), p.tokens * p.num_sources());
    EXPECT_EQ(static_cast<int64_t>(g.grad_h.size()), p.tokens * p.dim);
  }
}

TEST(Reference, ForwardMatchesGolden) {
  for (const GoldenCase& g : Golden()) {
    SCOPED_TRACE(g.name);
    const attnres::ref::ForwardResult r = attnres::ref::Forward(g.problem);
    EXPECT_TRUE(Close("out", r.out, g.out, kGoldenTol));
    EXPECT_TRUE(Close("alpha", r.alpha, g.alpha, kGoldenTol));
    if (!g.rms.empty()) {
      EXPECT_TRUE(Close("rms", r.rms, g.rms, kGoldenTol));
    } else {
      // rmsnorm off: the oracle reports r = 1.
      EXPECT_FALSE(g.problem.rmsnorm);
      EXPECT_TRUE(Close("rms", r.rms, std::vector<double>(r.rms.size(), 1.0), 0));
    }
  }
}

TEST(Reference, BackwardMatchesGolden) {
  for (const GoldenCase& g : Golden()) {
    SCOPED_TRACE(g.name);
    const attnres::ref::BackwardResult r = attnres::ref::Backward(g.problem, g.grad_h);
    ASSERT_EQ(r.grad_sources.size(), g.grad_sources.size());
    for (size_t i = 0; i < g.grad_sources.size(); ++i) {
      EXPECT_TRUE(Close("grad_source[" + std::to_string(i) + "]", r.grad_sources[i],
                        g.grad_sources[i], kGoldenTol));
    }
    EXPECT_TRUE(Close("grad_w", r.grad_w, g.grad_w, kGoldenTol));
    if (!g.grad_gamma.empty()) {
      EXPECT_TRUE(Close("grad_gamma", r.grad_gamma, g.grad_gamma, kGoldenTol));
    } else {
      EXPECT_TRUE(Close("grad_gamma", r.grad_gamma,
                        std::vector<double>(r.grad_gamma.size(), 0.0), 0));
    }
  }
}

TEST(Reference, AlphaSumsToOneAndSingleSourceIsIdentity) {
  for (const GoldenCase& g : Golden()) {
    SCOPED_TRACE(g.name);
    const auto r = attnres::ref::Forward(g.problem);
    const int64_t L = g.problem.num_sources();
    for (int64_t t = 0; t < g.problem.tokens; ++t) {
      double sum = 0;
      for (int64_t i = 0; i < L; ++i) sum += r.alpha[t * L + i];
      EXPECT_NEAR(sum, 1.0, 1e-14);
    }
    if (L == 1) {
      EXPECT_TRUE(Close("out", r.out, g.problem.sources[0], 0));
    }
  }
}

// The library's float64 path, on every backend (each CPU ISA; CUDA when a
// device is present), against the same golden values (tolerance SPEC §3 for fp64).
TEST(LibraryF64, MatchesGolden) {
  for (const GoldenCase& g : Golden()) {
    SCOPED_TRACE(g.name);
    const auto& p = g.problem;
    Case c;
    c.tokens = p.tokens;
    c.dim = p.dim;
    c.num_blocks = p.num_blocks;
    c.has_partial = p.has_partial;
    c.rmsnorm = p.rmsnorm;
    c.has_gamma = !p.gamma.empty();
    c.scale = p.scale;
    c.eps = p.eps;
    c.dtype = ATTNRES_DTYPE_FLOAT64;
    const double tol = ToleranceFor(c.dtype).out;
    ForEachBackend([&](const Backend& backend) {
      AbiProblem abi(c, p, backend.device);
      const ForwardOutput f = abi.Forward(p.rmsnorm, true);
      ASSERT_EQ(f.status, ATTNRES_OK) << f.error;
      EXPECT_EQ(f.layout_error, "");
      EXPECT_TRUE(Close("out", f.out, g.out, tol));
      EXPECT_TRUE(Close("alpha", f.alpha, g.alpha, tol));
      if (!g.rms.empty()) {
        EXPECT_TRUE(Close("rms", f.rms, g.rms, tol));
      }
      for (bool caches : {false, true}) {
        SCOPED_TRACE(caches ? "with caches" : "without caches");
        BackwardOptions o;
        o.use_rms_cache = o.use_alpha_cache = caches;
        const BackwardOutput b = abi.Backward(g.grad_h, o);
        ASSERT_EQ(b.status, ATTNRES_OK) << b.error;
        EXPECT_EQ(b.layout_error, "");
        for (size_t i = 0; i < g.grad_sources.size(); ++i) {
          EXPECT_TRUE(Close("grad_source[" + std::to_string(i) + "]", b.grad_sources[i],
                            g.grad_sources[i], tol));
        }
        EXPECT_TRUE(Close("grad_w", b.grad_w, g.grad_w, tol));
        if (!g.grad_gamma.empty()) {
          EXPECT_TRUE(Close("grad_gamma", b.grad_gamma, g.grad_gamma, tol));
        }
      }
    });
  }
}

}  // namespace
}  // namespace attnres_test
