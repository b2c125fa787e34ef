// Every op against PyTorch: tests/fixtures/ops.json (written by scripts/make_fixtures.py) holds
// torch's forward values on fixed inputs; each case is rebuilt here, run through our op, and
// compared at its dtype's tolerance (REFERENCE.md), or exactly where the case says so.
// An op name this file does not know fails the test, so no case is skipped silently.
#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <sstream>

#include "tests/core/harness.h"

using namespace microbatch;
using namespace microbatch::testing;
using json = nlohmann::json;

namespace {

using Inputs = std::vector<Tensor>;
using OpCall = std::function<Tensor(const Inputs&, const json&)>;

double number(const json& v) {
  if (v.is_string()) {
    const std::string s = v.get<std::string>();
    if (s == "inf") return std::numeric_limits<double>::infinity();
    if (s == "-inf") return -std::numeric_limits<double>::infinity();
    if (s == "nan") return std::numeric_limits<double>::quiet_NaN();
    throw std::runtime_error("not a number: '" + s + "'");
  }
  return v.get<double>();
}

std::vector<double> numbers(const json& list) {
  std::vector<double> out;
  out.reserve(list.size());
  for (const auto& v : list) out.push_back(number(v));
  return out;
}

Tensor decode(const json& t) {
  return from_vector(numbers(t.at("data")), t.at("shape").get<Shape>(),
                     {.dtype = parse_dtype(t.at("dtype").get<std::string>())});
}

std::vector<std::int64_t> ints(const json& p, const char* key) { return p.at(key).get<std::vector<std::int64_t>>(); }
std::int64_t integer(const json& p, const char* key) { return p.at(key).get<std::int64_t>(); }

Reduction parse_reduction(const std::string& s) {
  if (s == "none") return Reduction::None;
  if (s == "sum") return Reduction::Sum;
  if (s == "mean") return Reduction::Mean;
  throw std::runtime_error("unknown reduction '" + s + "'");
}

// Op name in the json -> a call of our op. Params are the keyword arguments the script used.
#define MB_OP(name, ...) \
  { name, [](const Inputs& in, const json& p) -> Tensor { (void)in; (void)p; __VA_ARGS__ } }

const std::map<std::string, OpCall>& op_table() {
  static const std::map<std::string, OpCall> table = {
      // element-wise
      MB_OP("add", return add(in[0], in[1]);),
      MB_OP("sub", return sub(in[0], in[1]);),
      MB_OP("mul", return mul(in[0], in[1]);),
      MB_OP("div", return div(in[0], in[1]);),
      MB_OP("pow", return pow(in[0], in[1]);),
      MB_OP("pow_scalar", return pow(in[0], p.at("exponent").get<double>());),
      MB_OP("maximum", return maximum(in[0], in[1]);),
      MB_OP("minimum", return minimum(in[0], in[1]);),
      MB_OP("add_scalar", return in[0] + p.at("scalar").get<double>();),
      MB_OP("sub_scalar", return in[0] - p.at("scalar").get<double>();),
      MB_OP("mul_scalar", return in[0] * p.at("scalar").get<double>();),
      MB_OP("div_scalar", return in[0] / p.at("scalar").get<double>();),
      MB_OP("rsub_scalar", return p.at("scalar").get<double>() - in[0];),
      MB_OP("rdiv_scalar", return p.at("scalar").get<double>() / in[0];),
      MB_OP("neg", return neg(in[0]);),
      MB_OP("exp", return exp(in[0]);),
      MB_OP("log", return log(in[0]);),
      MB_OP("sqrt", return sqrt(in[0]);),
      MB_OP("rsqrt", return rsqrt(in[0]);),
      MB_OP("abs", return abs(in[0]);),
      MB_OP("tanh", return tanh(in[0]);),
      MB_OP("sigmoid", return sigmoid(in[0]);),
      MB_OP("relu", return relu(in[0]);),
      MB_OP("gelu", return gelu(in[0], p.at("approximate") == "tanh" ? GeluApproximate::Tanh
                                                                     : GeluApproximate::None);),
      MB_OP("silu", return silu(in[0]);),
      MB_OP("eq", return eq(in[0], in[1]);),
      MB_OP("ne", return ne(in[0], in[1]);),
      MB_OP("lt", return lt(in[0], in[1]);),
      MB_OP("le", return le(in[0], in[1]);),
      MB_OP("gt", return gt(in[0], in[1]);),
      MB_OP("ge", return ge(in[0], in[1]);),
      MB_OP("where", return where(in[0], in[1], in[2]);),
      MB_OP("masked_fill", return masked_fill(in[0], in[1], number(p.at("value")));),
      MB_OP("cast", return cast(in[0], parse_dtype(p.at("dtype").get<std::string>()));),
      MB_OP("accumulate_", {
        Tensor dst = in[0].clone();
        accumulate_(dst, in[1], p.at("weight").get<double>());
        return dst;
      }),
      // reductions
      MB_OP("sum", return sum(in[0], ints(p, "dims"), {.keepdim = p.at("keepdim").get<bool>()});),
      MB_OP("mean", return mean(in[0], ints(p, "dims"), {.keepdim = p.at("keepdim").get<bool>()});),
      MB_OP("var", return var(in[0], ints(p, "dims"),
                              {.correction = integer(p, "correction"), .keepdim = p.at("keepdim").get<bool>()});),
      MB_OP("max", return max(in[0], integer(p, "dim"), {.keepdim = p.at("keepdim").get<bool>()});),
      MB_OP("max_all", return max(in[0]);),
      MB_OP("argmax", return argmax(in[0], integer(p, "dim"), {.keepdim = p.at("keepdim").get<bool>()});),
      MB_OP("sum_to", return sum_to(in[0], ints(p, "shape"));),
      // linear algebra
      MB_OP("matmul", return matmul(in[0], in[1]);),
      MB_OP("linear", return linear(in[0], in[1], in.size() > 2 ? in[2] : Tensor());),
      // shape and indexing
      MB_OP("cat", return cat(in, integer(p, "dim"));),
      MB_OP("stack", return stack(in, integer(p, "dim"));),
      MB_OP("embedding", return embedding(in[0], in[1]);),
      MB_OP("gather", return gather(in[0], integer(p, "dim"), in[1]);),
      MB_OP("index_select", return index_select(in[0], integer(p, "dim"), in[1]);),
      // views
      MB_OP("reshape", return in[0].reshape(ints(p, "shape"));),
      MB_OP("view", return in[0].view(ints(p, "shape"));),
      MB_OP("transpose", return in[0].transpose(integer(p, "dim0"), integer(p, "dim1"));),
      MB_OP("t", return in[0].t();),
      MB_OP("permute", return in[0].permute(ints(p, "dims"));),
      MB_OP("slice", return in[0].slice(integer(p, "dim"), integer(p, "start"), integer(p, "end"),
                                        integer(p, "step"));),
      MB_OP("select", return in[0].select(integer(p, "dim"), integer(p, "index"));),
      MB_OP("expand", return in[0].expand(ints(p, "shape"));),
      MB_OP("squeeze", return in[0].squeeze(integer(p, "dim"));),
      MB_OP("unsqueeze", return in[0].unsqueeze(integer(p, "dim"));),
      MB_OP("flatten", return in[0].flatten(integer(p, "start_dim"), integer(p, "end_dim"));),
      MB_OP("contiguous", return in[0].contiguous();),
      // neural-network functions
      MB_OP("softmax", return softmax(in[0], integer(p, "dim"));),
      MB_OP("log_softmax", return log_softmax(in[0], integer(p, "dim"));),
      MB_OP("cross_entropy",
            return cross_entropy(in[0], in[1],
                                 {.ignore_index = integer(p, "ignore_index"),
                                  .reduction = parse_reduction(p.at("reduction").get<std::string>()),
                                  .label_smoothing = p.at("label_smoothing").get<double>()});),
      MB_OP("layer_norm", {
        const bool has_weight = p.at("weight").get<bool>(), has_bias = p.at("bias").get<bool>();
        return layer_norm(in[0], ints(p, "normalized_shape"), has_weight ? in[1] : Tensor(),
                          has_bias ? in.back() : Tensor(), p.at("eps").get<double>());
      }),
      MB_OP("scaled_dot_product_attention", {
        AttentionOptions o{.causal = p.at("causal").get<bool>()};
        if (p.contains("scale")) o.scale = p.at("scale").get<double>();
        return scaled_dot_product_attention(in[0], in[1], in[2], o);
      }),
      // convolution and pooling
      MB_OP("conv2d", return conv2d(in[0], in[1], in.size() > 2 ? in[2] : Tensor(),
                                    {.stride = integer(p, "stride"), .padding = integer(p, "padding")});),
      MB_OP("max_pool2d", return max_pool2d(in[0], {.kernel_size = integer(p, "kernel_size"),
                                                    .stride = integer(p, "stride"),
                                                    .padding = integer(p, "padding")});),
  };
  return table;
}

#undef MB_OP

// REFERENCE.md's torch.testing.assert_close tolerances; integers and bools compare exactly.
std::pair<double, double> tolerance(DType dt) {
  switch (dt) {
    case DType::f64: return {1e-7, 1e-7};
    case DType::f32: return {1.3e-6, 1e-5};
    case DType::f16: return {1e-3, 1e-5};
    case DType::bf16: return {1.6e-2, 1e-5};
    default: return {0.0, 0.0};
  }
}

const json& fixtures() {
  static const json doc = [] {
    const std::string path = std::string(MB_FIXTURES_DIR) + "/ops.json";
    std::ifstream file(path);
    if (!file) throw std::runtime_error("cannot open " + path + "; run scripts/make_fixtures.py");
    return json::parse(file);
  }();
  return doc;
}

}  // namespace

TEST_CASE("fixtures: every op against PyTorch's forward values") {
  const json& cases = fixtures().at("cases");
  REQUIRE(cases.size() > 0);
  const auto& table = op_table();
  std::size_t ran = 0;
  std::vector<std::string> threw;
  for (const json& c : cases) {
    const std::string name = c.at("name").get<std::string>(), op = c.at("op").get<std::string>();
    INFO("fixture case '" << name << "' (op " << op << ")");
    const auto call = table.find(op);
    if (call == table.end()) {
      FAIL_CHECK("unknown op '" << op << "' in fixture case '" << name << "': map it in test_fixtures.cpp");
      continue;
    }
    ++ran;
    try {
      Inputs inputs;
      for (const json& t : c.at("inputs")) {
        Tensor x = decode(t);
        if (c.value("noncontiguous", false) && is_floating(x.dtype())) x = non_contiguous(x);
        inputs.push_back(x);
      }
      const Tensor expected = decode(c.at("output"));
      const Tensor actual = call->second(inputs, c.at("params"));
      CHECK_MESSAGE(actual.shape() == expected.shape(), name << ": shape " << shape_str(actual.shape())
                                                              << ", torch gives " << shape_str(expected.shape()));
      CHECK_MESSAGE(actual.dtype() == expected.dtype(), name << ": dtype " << std::string(dtype_name(actual.dtype()))
                                                              << ", torch gives "
                                                              << std::string(dtype_name(expected.dtype())));
      const auto [rtol, atol] = c.value("exact", false) ? std::pair{0.0, 0.0} : tolerance(expected.dtype());
      if (actual.shape() == expected.shape()) check_close(actual, expected, rtol, atol, name);
    } catch (const std::exception& e) {
      threw.push_back(name);
      FAIL_CHECK("fixture case '" << name << "' threw: " << e.what());
    }
  }
  std::ostringstream summary;
  summary << ran << " of " << cases.size() << " fixture cases ran; " << threw.size() << " threw";
  for (const auto& n : threw) summary << "\n  " << n;
  MESSAGE(summary.str());
  CHECK(ran == cases.size());
}

TEST_CASE("fixtures: every mapped op has at least one case") {
  // The table above mirrors core/ops.h (dropout excepted: random); a regenerated json that lost an
  // op's cases would otherwise pass unnoticed.
  std::set<std::string> seen;
  for (const json& c : fixtures().at("cases")) seen.insert(c.at("op").get<std::string>());
  for (const auto& [op, call] : op_table()) CHECK_MESSAGE(seen.count(op) == 1, "no fixture case for op '" << op << "'");
}
