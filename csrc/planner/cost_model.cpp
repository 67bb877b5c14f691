#include "planner/cost_model.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <iterator>
#include <sstream>
#include <stdexcept>

namespace bytescale {
namespace planner {

double CostModel::shardedTime(double s, int d) const {
  if (d <= 1) return seqTime(s);
  const double shard = s / d;
  const double attn = a1 * s * s / d;  // this rank's share of the (zig-zag balanced) attention
  const double linear = b1 * shard;
  // Forward: d-1 K/V exchanges; backward: K/V again plus their gradients (~2x).
  const double step = ring_latency + kv_bytes_per_token * shard / ring_bw;
  const double comm = 3.0 * (d - 1) * step;
  const double exposed = std::max(0.0, comm - attn);
  return layers * (attn + linear + g + exposed);
}

void CostModel::validate() const {
  auto bad = [](const char* f, double v, const char* need) {
    std::ostringstream os;
    os << "cost model: " << f << " = " << v << " must be " << need;
    throw std::invalid_argument(os.str());
  };
  auto nonneg = [&](const char* f, double v) {
    if (!(v >= 0) || !std::isfinite(v)) bad(f, v, "finite and >= 0");
  };
  auto positive = [&](const char* f, double v) {
    if (!(v > 0) || !std::isfinite(v)) bad(f, v, "finite and > 0");
  };
  nonneg("a1", a1);
  nonneg("b1", b1);
  nonneg("g", g);
  if (a1 == 0 && b1 == 0 && g == 0) bad("a1+b1+g", 0, "> 0 (every sequence would cost nothing)");
  positive("a2", a2);
  nonneg("b2", b2);
  if (layers < 1) bad("layers", layers, ">= 1");
  positive("bw_d2h", bw_d2h);
  positive("bw_h2d", bw_h2d);
  positive("ring_bw", ring_bw);
  nonneg("ring_latency", ring_latency);
  nonneg("kv_bytes_per_token", kv_bytes_per_token);
}

namespace {
// A small reader for the flat JSON objects bytescale.profile() writes: {"key": number|string, ...}.
// Nested values are rejected with a clear message rather than misread.
struct JsonReader {
  const std::string& t;
  size_t i = 0;
  explicit JsonReader(const std::string& text) : t(text) {}
  [[noreturn]] void fail(const std::string& what) const {
    throw std::invalid_argument("cost model JSON: " + what + " at offset " + std::to_string(i));
  }
  void ws() {
    while (i < t.size() && std::isspace(static_cast<unsigned char>(t[i]))) ++i;
  }
  void expect(char c) {
    ws();
    if (i >= t.size() || t[i] != c) fail(std::string("expected '") + c + "'");
    ++i;
  }
  std::string str() {
    ws();
    if (i >= t.size() || t[i] != '"') fail("expected a string");
    ++i;
    std::string out;
    while (i < t.size() && t[i] != '"') {
      if (t[i] == '\\' && i + 1 < t.size()) ++i;
      out += t[i++];
    }
    if (i >= t.size()) fail("unterminated string");
    ++i;
    return out;
  }
  // Returns true and sets v for a number; false (value skipped) for a string/bool/null.
  bool value(double& v) {
    ws();
    if (i >= t.size()) fail("expected a value");
    char c = t[i];
    if (c == '"') {
      str();
      return false;
    }
    if (c == '{' || c == '[') fail("nested objects and arrays are not supported");
    if (t.compare(i, 4, "true") == 0 || t.compare(i, 4, "null") == 0) {
      i += 4;
      return false;
    }
    if (t.compare(i, 5, "false") == 0) {
      i += 5;
      return false;
    }
    const char* start = t.c_str() + i;
    char* end = nullptr;
    v = std::strtod(start, &end);
    if (end == start) fail("expected a number");
    i += static_cast<size_t>(end - start);
    return true;
  }
};
}  // namespace

CostModel CostModel::fromJson(const std::string& text) {
  CostModel m;
  JsonReader r(text);
  r.expect('{');
  r.ws();
  if (r.i < text.size() && text[r.i] == '}') {
    ++r.i;
  } else {
    for (;;) {
      std::string key = r.str();
      r.expect(':');
      double v = 0;
      bool num = r.value(v);
      static const char* const kKeys[] = {"a1", "b1", "g", "a2", "b2", "layers", "bw_d2h", "bw_h2d",
                                          "ring_bw", "ring_latency", "kv_bytes_per_token"};
      if (!num && std::find(std::begin(kKeys), std::end(kKeys), key) != std::end(kKeys))
        throw std::invalid_argument("cost model JSON: " + key + " must be a number");
      if (num) {
        if (key == "a1") m.a1 = v;
        else if (key == "b1") m.b1 = v;
        else if (key == "g") m.g = v;
        else if (key == "a2") m.a2 = v;
        else if (key == "b2") m.b2 = v;
        else if (key == "layers") {
          if (!(v >= 1 && v <= 1e6) || v != std::floor(v)) {
            std::ostringstream os;
            os << "cost model JSON: layers = " << v << " must be an integer in [1, 1e6]";
            throw std::invalid_argument(os.str());
          }
          m.layers = static_cast<int>(v);
        }
        else if (key == "bw_d2h") m.bw_d2h = v;
        else if (key == "bw_h2d") m.bw_h2d = v;
        else if (key == "ring_bw") m.ring_bw = v;
        else if (key == "ring_latency") m.ring_latency = v;
        else if (key == "kv_bytes_per_token") m.kv_bytes_per_token = v;
      }
      r.ws();
      if (r.i < text.size() && text[r.i] == ',') {
        ++r.i;
        continue;
      }
      r.expect('}');
      break;
    }
  }
  m.validate();
  return m;
}

std::string CostModel::toJson() const {
  std::ostringstream os;
  os.precision(17);
  os << "{\"a1\": " << a1 << ", \"b1\": " << b1 << ", \"g\": " << g << ", \"a2\": " << a2
     << ", \"b2\": " << b2 << ", \"layers\": " << layers << ", \"bw_d2h\": " << bw_d2h
     << ", \"bw_h2d\": " << bw_h2d << ", \"ring_bw\": " << ring_bw
     << ", \"ring_latency\": " << ring_latency << ", \"kv_bytes_per_token\": "
     << kv_bytes_per_token << "}";
  return os.str();
}

int ranksWithoutOffload(const CostModel& m, int64_t s, int64_t capacity) {
  if (capacity <= 0) throw std::invalid_argument("capacity must be positive");
  double q = m.act(static_cast<double>(s)) / m.act(static_cast<double>(capacity));
  int64_t d = static_cast<int64_t>(std::ceil(q - 1e-12));
  // Tokens must fit too (Act is affine, so this only matters when b2 > 0).
  d = std::max<int64_t>(d, (s + capacity - 1) / capacity);
  return static_cast<int>(std::max<int64_t>(1, d));
}

OffloadChoice solveOffload(const CostModel& m, int64_t s, int64_t capacity, double hide) {
  const int d0 = ranksWithoutOffload(m, s, capacity);
  const int l = m.layers;
  if (d0 <= 1 || l <= 2) return {d0, 0.0};
  const double act_s = m.act(static_cast<double>(s));
  const double act_c = m.act(static_cast<double>(capacity));
  const double bw = std::min(m.bw_d2h, m.bw_h2d);
  const double r_max = std::min(1.0, hide * m.layerTime(static_cast<double>(s)) * bw / act_s);
  auto ranks_at = [&](double r) {
    double need = (2.0 + (1.0 - r) * (l - 2)) * act_s / (l * act_c);
    int64_t d = static_cast<int64_t>(std::ceil(need - 1e-12));
    return static_cast<int>(std::max<int64_t>(1, d));
  };
  const int d_best = ranks_at(r_max);
  if (d_best >= d0) return {d0, 0.0};
  // Smallest r reaching d_best: (2 + (1-r)(l-2)) act_s <= d_best * l * act_c.
  double r = 1.0 - (d_best * l * act_c / act_s - 2.0) / (l - 2);
  r = std::clamp(r, 0.0, r_max);
  if (ranks_at(r) != d_best) r = r_max;
  return {d_best, r};
}

}  // namespace planner
}  // namespace bytescale
