// DynamicLossScaler: PyTorch's GradScaler update tests replayed, DeepSpeed's hysteresis and floor,
// the f32 arithmetic of the scale, and checkpoint round trips.
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "optim/loss_scaler.h"
#include "tests/core/harness.h"

using namespace microbatch;
using namespace microbatch::testing;
using optim::DynamicLossScaler;
using optim::LossScaleFloorError;
using optim::LossScalerConfig;

TEST_CASE("LossScaler: defaults are torch.amp.GradScaler's") {
  DynamicLossScaler s;
  CHECK(s.scale() == 65536.0);
  CHECK(s.config().growth_factor == 2.0);
  CHECK(s.config().backoff_factor == 0.5);
  CHECK(s.config().growth_interval == 2000);
  CHECK(s.config().hysteresis == 1);
  CHECK(s.growth_tracker() == 0);
  CHECK(s.skipped_steps() == 0);
}

TEST_CASE("LossScaler: torch test_grad_scaling_update_scale") {
  // torch/test/test_cuda.py: two unskipped updates then one with found_inf = 1, growth 2,
  // backoff 0.25, interval 2, scale 4: (scale, tracker) = (4, 1), (8, 0), (2, 0).
  DynamicLossScaler s({.init_scale = 4.0, .growth_factor = 2.0, .backoff_factor = 0.25,
                       .growth_interval = 2});
  CHECK_FALSE(s.update(false));
  CHECK(s.growth_tracker() == 1);
  CHECK(s.scale() == 4.0);
  CHECK_FALSE(s.update(false));
  CHECK(s.growth_tracker() == 0);
  CHECK(s.scale() == 8.0);
  CHECK(s.update(true));  // skip
  CHECK(s.growth_tracker() == 0);
  CHECK(s.scale() == 2.0);
  CHECK(s.skipped_steps() == 1);
}

TEST_CASE("LossScaler: torch _run_scaling_case, scale = 128 * 2^unskipped * 0.5^skipped") {
  // torch's scaling tests: init 128, interval 1, four iterations with an inf injected at the third.
  DynamicLossScaler s({.init_scale = 128.0, .growth_interval = 1});
  const std::vector<bool> found_inf = {false, false, true, false};
  int unskipped = 0, skipped = 0;
  for (bool inf : found_inf) {
    const bool skip = s.update(inf);
    CHECK(skip == inf);
    (skip ? skipped : unskipped) += 1;
  }
  CHECK(unskipped == 3);
  CHECK(skipped == 1);
  CHECK(s.scale() == 128.0 * std::pow(2.0, unskipped) * std::pow(0.5, skipped));  // 512
  CHECK(s.skipped_steps() == 1);
}

TEST_CASE("LossScaler: growth that would overflow f32 leaves the scale unchanged") {
  // 2^126 grows to 2^127 (finite); 2^127 * 2 = 2^128 is inf in f32, so it stays.
  DynamicLossScaler s({.init_scale = std::ldexp(1.0, 126), .growth_interval = 1});
  s.update(false);
  CHECK(s.scale() == std::ldexp(1.0, 127));
  for (int i = 0; i < 3; ++i) {
    CHECK_FALSE(s.update(false));
    CHECK(s.scale() == std::ldexp(1.0, 127));
    CHECK(s.growth_tracker() == 0);  // the tracker restarts even when growth is refused
  }
  // Growth is judged on the f32 result: 2^127 * 1.5 is below FLT_MAX, so it is taken.
  DynamicLossScaler t({.init_scale = std::ldexp(1.0, 127), .growth_factor = 1.5,
                       .growth_interval = 1});
  t.update(false);
  CHECK(t.scale() == 1.5 * std::ldexp(1.0, 127));
}

TEST_CASE("LossScaler: without a floor the scale stops at 2^-126, where its inverse is finite") {
  // PyTorch halves on to 0 (2^-149 after 149 backoffs from 1, then 0), and inv_scale = inf then
  // turns zero gradients into NaN weights. 2^-126 is f32's smallest normal: 126 backoffs from 1.
  DynamicLossScaler s({.init_scale = 1.0});
  for (int i = 0; i < 125; ++i) s.update(true);
  CHECK(s.scale() == std::ldexp(1.0, -125));
  s.update(true);
  CHECK(s.scale() == std::ldexp(1.0, -126));
  for (int i = 0; i < 30; ++i) CHECK(s.update(true));
  CHECK(s.scale() == std::ldexp(1.0, -126));
  CHECK(s.inv_scale() == std::ldexp(1.0f, 126));
  CHECK(s.skipped_steps() == 156);
  // Growth leaves it as usual.
  for (int i = 0; i < 2000; ++i) s.update(false);
  CHECK(s.scale() == std::ldexp(1.0, -125));
}

TEST_CASE("LossScaler: consecutive_hysteresis 2 backs off on the second overflow in a row") {
  DynamicLossScaler s({.init_scale = 1024.0, .growth_interval = 3, .hysteresis = 2,
                       .consecutive_hysteresis = true});
  CHECK(s.update(true));  // tolerated: skipped, scale kept
  CHECK(s.scale() == 1024.0);
  CHECK(s.hysteresis_overflows() == 1);
  CHECK_FALSE(s.update(false));  // a finite step restores the hysteresis
  CHECK(s.hysteresis_overflows() == 0);
  CHECK(s.update(true));  // tolerated again
  CHECK(s.scale() == 1024.0);
  CHECK(s.update(true));  // second in a row: back off
  CHECK(s.scale() == 512.0);
  CHECK(s.update(true));  // and every further one in the same run
  CHECK(s.scale() == 256.0);
  CHECK(s.hysteresis_overflows() == 3);
  CHECK(s.skipped_steps() == 4);
  // A tolerated overflow still restarts the growth window: it needs 3 finite steps in a row.
  s.update(false);
  s.update(false);
  CHECK(s.update(true));
  CHECK(s.scale() == 256.0);
  s.update(false);
  s.update(false);
  CHECK(s.scale() == 256.0);
  s.update(false);
  CHECK(s.scale() == 512.0);
}

TEST_CASE("LossScaler: hysteresis 2 (DeepSpeed's default) counts overflows until the scale grows") {
  // Overflows between finite steps: DeepSpeed's default rule backs off on the second one counted
  // and every one after, until a growth restores the hysteresis.
  DynamicLossScaler s({.init_scale = 1024.0, .growth_interval = 3, .hysteresis = 2});
  CHECK_FALSE(s.config().consecutive_hysteresis);
  CHECK(s.update(true));  // counted 1: tolerated
  CHECK(s.scale() == 1024.0);
  CHECK_FALSE(s.update(false));  // a finite step does not restore it
  CHECK(s.hysteresis_overflows() == 1);
  CHECK(s.update(true));  // counted 2: back off
  CHECK(s.scale() == 512.0);
  CHECK_FALSE(s.update(false));
  CHECK(s.update(true));  // counted 3: back off again
  CHECK(s.scale() == 256.0);
  // Three finite steps grow the scale and restore the hysteresis: the next overflow is tolerated.
  for (int i = 0; i < 3; ++i) CHECK_FALSE(s.update(false));
  CHECK(s.scale() == 512.0);
  CHECK(s.hysteresis_overflows() == 0);
  CHECK(s.update(true));
  CHECK(s.scale() == 512.0);
  CHECK(s.skipped_steps() == 4);
}

namespace {

// DeepSpeed's DynamicLossScaler.update_scale (deepspeed/runtime/fp16/loss_scaler.py) in its own
// terms: cur_hysteresis counts down from delayed_shift, growth every scale_window iterations after
// the last overflow, the same factor for growth and backoff, min_scale a floor. In f64: the
// patterns below keep every scale a power of two, exact in f32 too.
struct DeepSpeedScaler {
  double cur_scale;
  double scale_factor;
  std::int64_t scale_window, delayed_shift, cur_hysteresis;
  bool consecutive_hysteresis;
  double min_scale;
  std::int64_t cur_iter = 0, last_overflow_iter = -1;

  void update_scale(bool overflow) {
    if (overflow) {
      if (delayed_shift == 1 || cur_hysteresis == 1) {
        cur_scale = std::max(cur_scale / scale_factor, min_scale);
      } else {
        cur_hysteresis -= 1;
      }
      last_overflow_iter = cur_iter;
    } else {
      if (consecutive_hysteresis) cur_hysteresis = delayed_shift;
      if ((cur_iter - last_overflow_iter) % scale_window == 0) {
        if (!consecutive_hysteresis) cur_hysteresis = delayed_shift;
        cur_scale *= scale_factor;
      }
    }
    cur_iter += 1;
  }
};

}  // namespace

TEST_CASE("LossScaler: hysteresis follows DeepSpeed's update_scale, both ways") {
  for (const bool consecutive : {false, true}) {
    for (const std::int64_t h : {1, 2, 3}) {
      CAPTURE(consecutive);
      CAPTURE(h);
      DynamicLossScaler s({.init_scale = 1024.0, .growth_factor = 2.0, .backoff_factor = 0.5,
                           .growth_interval = 4, .hysteresis = h,
                           .consecutive_hysteresis = consecutive, .min_loss_scale = 1.0});
      DeepSpeedScaler ds{.cur_scale = 1024.0, .scale_factor = 2.0, .scale_window = 4,
                         .delayed_shift = h, .cur_hysteresis = h,
                         .consecutive_hysteresis = consecutive, .min_scale = 1.0};
      std::uint64_t state = 12345;  // a fixed pseudo-random pattern, a third of it overflowing
      int backoffs = 0;
      for (int i = 0; i < 400; ++i) {
        state = state * 6364136223846793005ULL + 1442695040888963407ULL;
        const bool overflow = (state >> 33) % 3 == 0;
        const double before = s.scale();
        s.update(overflow);
        ds.update_scale(overflow);
        backoffs += s.scale() < before;
        REQUIRE(s.scale() == ds.cur_scale);
      }
      CHECK(backoffs > 10);  // the pattern exercised the backoffs
    }
  }
}

TEST_CASE("LossScaler: min_loss_scale is a floor the scale never goes below") {
  // 3 * 0.5 = 1.5 is clamped to the floor 2, which then holds.
  DynamicLossScaler s({.init_scale = 3.0, .min_loss_scale = 2.0});
  CHECK(s.update(true));
  CHECK(s.scale() == 2.0);
  for (int i = 0; i < 100; ++i) CHECK(s.update(true));
  CHECK(s.scale() == 2.0);
  CHECK(s.skipped_steps() == 101);
  // Growth leaves the floor as usual.
  DynamicLossScaler g({.init_scale = 2.0, .growth_interval = 1, .min_loss_scale = 2.0});
  g.update(false);
  CHECK(g.scale() == 4.0);
}

TEST_CASE("LossScaler: max_overflows_at_floor stops the run, a finite step resets the count") {
  const LossScalerConfig config{.init_scale = 8.0, .min_loss_scale = 2.0,
                                .max_overflows_at_floor = 3};
  DynamicLossScaler s(config);
  CHECK(s.update(true));  // 8 -> 4: this step ran above the floor
  CHECK(s.update(true));  // 4 -> 2: still above when it ran
  CHECK(s.scale() == 2.0);
  CHECK(s.update(true));  // 1st overflow at the floor
  CHECK(s.update(true));  // 2nd
  CHECK_FALSE(s.update(false));  // finite: the count starts again
  CHECK(s.scale() == 2.0);
  CHECK(s.update(true));  // 1st
  CHECK(s.update(true));  // 2nd
  bool thrown = false;
  try {
    s.update(true);  // 3rd in a row at the floor
  } catch (const LossScaleFloorError& e) {
    thrown = true;
    const std::string msg = e.what();
    CHECK(msg.find("3 consecutive overflowing steps") != std::string::npos);
    CHECK(msg.find("scale 2") != std::string::npos);
    CHECK(msg.find("min_loss_scale 2") != std::string::npos);
  }
  CHECK(thrown);
  CHECK(s.skipped_steps() == 7);
  // The count at the floor survives a checkpoint: two overflows before saving, one after, throws.
  DynamicLossScaler before({.init_scale = 2.0, .min_loss_scale = 2.0,
                            .max_overflows_at_floor = 3});
  before.update(true);
  before.update(true);
  DynamicLossScaler after;
  after.load_state_dict(nlohmann::json::parse(before.state_dict().dump()));
  CHECK_THROWS_AS(after.update(true), LossScaleFloorError);
  // It is a microbatch::Error, so callers catching Error see it too.
  DynamicLossScaler t({.init_scale = 2.0, .min_loss_scale = 2.0, .max_overflows_at_floor = 1});
  check_throws_with([&] { t.update(true); }, "loss-scale floor");
}

namespace {

// What `run` writes to stderr (file descriptor 2, where the scaler prints).
template <class F>
std::string stderr_of(F&& run) {
  std::fflush(stderr);
  std::FILE* file = std::tmpfile();
  REQUIRE(file != nullptr);
  const int saved = dup(2);
  REQUIRE(saved >= 0);
  REQUIRE(dup2(fileno(file), 2) >= 0);
  run();
  std::fflush(stderr);
  dup2(saved, 2);
  close(saved);
  std::rewind(file);
  std::string text;
  for (int c = std::fgetc(file); c != EOF; c = std::fgetc(file))
    text.push_back(static_cast<char>(c));
  std::fclose(file);
  return text;
}

}  // namespace

TEST_CASE("LossScaler: the floor warning prints once, and not at all with ScalerWarnings::kQuiet") {
  // A data-parallel run's other ranks see the same overflows as rank 0, which alone prints.
  for (const optim::ScalerWarnings warnings :
       {optim::ScalerWarnings::kPrint, optim::ScalerWarnings::kQuiet}) {
    CAPTURE(static_cast<int>(warnings));
    const bool print = warnings == optim::ScalerWarnings::kPrint;
    DynamicLossScaler floor({.init_scale = 8.0, .min_loss_scale = 2.0, .warnings = warnings});
    const std::string at_floor = stderr_of([&] {
      for (int i = 0; i < 5; ++i) CHECK(floor.update(true));
    });
    CHECK(floor.scale() == 2.0);
    CHECK((at_floor.find("reached its floor min_loss_scale = 2") != std::string::npos) == print);
    CHECK((at_floor.find("[loss_scaler]") == at_floor.rfind("[loss_scaler]")));  // once at most
    // Without a floor: the warning at 2^-126.
    DynamicLossScaler bottom({.init_scale = 4.0, .warnings = warnings});
    const std::string at_bottom = stderr_of([&] {
      for (int i = 0; i < 140; ++i) CHECK(bottom.update(true));
    });
    CHECK(bottom.scale() == static_cast<double>(kernels::kSmallestLossScale));
    CHECK((at_bottom.find("reached 2^-126") != std::string::npos) == print);
    CHECK(at_bottom.find("[loss_scaler]") == at_bottom.rfind("[loss_scaler]"));
    // The warnings survive a checkpoint's config, which restores the rule only.
    DynamicLossScaler restored({.min_loss_scale = 2.0, .warnings = warnings});
    restored.load_state_dict(floor.state_dict());
    CHECK(restored.config().warnings == warnings);
  }
}

TEST_CASE("LossScaler: inv_scale is (float)(1.0 / (double)scale), bit for bit") {
  CHECK(DynamicLossScaler().inv_scale() == std::ldexp(1.0f, -16));
  // Dividing two f32 values through f64 rounds the same as one correctly rounded f32 division
  // (f64 carries more than 2*24+2 bits), so 1.0f / scale is an independent reference.
  for (double init : {65536.0, 3.0, 0.1, 1e-30, 7.0e37}) {
    DynamicLossScaler s({.init_scale = init, .growth_factor = 1.7, .backoff_factor = 0.3,
                         .growth_interval = 1});
    for (int i = 0; i < 4; ++i) {
      const float scale = static_cast<float>(s.scale());
      CHECK(static_cast<double>(scale) == s.scale());  // the scale is an f32 value
      CHECK(std::bit_cast<std::uint32_t>(s.inv_scale()) ==
            std::bit_cast<std::uint32_t>(1.0f / scale));
      s.update(i % 2 == 0);
    }
  }
  // backoff 0.3 from 1: the f32 rounding of 0.3, not the f64 one.
  DynamicLossScaler s({.init_scale = 1.0, .backoff_factor = 0.3});
  s.update(true);
  CHECK(s.scale() == static_cast<double>(0.3f));
}

TEST_CASE("LossScaler: state_dict round trip continues identically") {
  const LossScalerConfig config{.init_scale = 1000.0, .growth_factor = 1.7,
                                .backoff_factor = 0.3, .growth_interval = 3, .hysteresis = 2,
                                .min_loss_scale = 1.0, .max_overflows_at_floor = 0};
  // A fixed pattern of overflows, with runs of two so that hysteresis backs off.
  std::vector<bool> found_inf;
  for (int i = 0; i < 60; ++i) found_inf.push_back(i % 7 == 2 || i % 7 == 3 || i % 11 == 5);
  DynamicLossScaler a(config);
  for (int i = 0; i < 25; ++i) a.update(found_inf[i]);
  // Through text, as a checkpoint file would carry it.
  const auto saved = nlohmann::json::parse(a.state_dict().dump());
  DynamicLossScaler b;  // different config: the checkpoint's wins
  b.load_state_dict(saved);
  CHECK(b.config().growth_factor == 1.7);
  CHECK(b.config().hysteresis == 2);
  CHECK(b.config().min_loss_scale == 1.0);
  for (int i = 25; i < 60; ++i) {
    CHECK(a.update(found_inf[i]) == b.update(found_inf[i]));
    CHECK(std::bit_cast<std::uint64_t>(a.scale()) == std::bit_cast<std::uint64_t>(b.scale()));
    CHECK(a.growth_tracker() == b.growth_tracker());
    CHECK(a.hysteresis_overflows() == b.hysteresis_overflows());
    CHECK(a.skipped_steps() == b.skipped_steps());
  }
  CHECK(a.skipped_steps() > 0);
  CHECK(a.scale() != 1000.0);  // the pattern moved the scale, so the comparison meant something

  auto broken = saved;
  broken.erase("growth_tracker");
  check_throws_with([&] { b.load_state_dict(broken); }, "growth_tracker");
  broken = saved;
  broken["scale"] = 0.5;  // below the floor
  check_throws_with([&] { b.load_state_dict(broken); }, "min_loss_scale");
  broken = saved;
  broken["backoff_factor"] = 2.0;
  check_throws_with([&] { b.load_state_dict(broken); }, "backoff_factor");
  broken = saved;
  broken["consecutive_hysteresis"] = 1;
  check_throws_with([&] { b.load_state_dict(broken); }, "consecutive_hysteresis");
  broken = saved;
  broken["scale"] = 0.0;  // PyTorch's collapsed scale: never reached here, and inv_scale is inf
  broken["min_loss_scale"] = 0.0;
  check_throws_with([&] { b.load_state_dict(broken); }, "2^-126");

  // A state saved before consecutive_hysteresis existed ran with it, its count named
  // consecutive_overflows.
  auto old = saved;
  old.erase("consecutive_hysteresis");
  old["consecutive_overflows"] = old.at("hysteresis_overflows");
  old.erase("hysteresis_overflows");
  DynamicLossScaler c;
  c.load_state_dict(old);
  CHECK(c.config().consecutive_hysteresis);
  CHECK(c.hysteresis_overflows() == a.hysteresis_overflows());
  CHECK_FALSE(b.config().consecutive_hysteresis);  // the saved config's own
}

TEST_CASE("LossScaler: bad configs name the field") {
  auto make = [](LossScalerConfig c) { return [c] { DynamicLossScaler s(c); }; };
  check_throws_with(make({.growth_factor = 1.0}), "growth_factor");
  check_throws_with(make({.growth_factor = 0.5}), "growth_factor");
  check_throws_with(make({.backoff_factor = 0.0}), "backoff_factor");
  check_throws_with(make({.backoff_factor = 1.0}), "backoff_factor");
  check_throws_with(make({.growth_interval = 0}), "growth_interval");
  check_throws_with(make({.hysteresis = 0}), "hysteresis");
  check_throws_with(make({.init_scale = 0.0}), "init_scale");
  check_throws_with(make({.init_scale = -1.0}), "init_scale");
  check_throws_with(make({.init_scale = 1e39}), "init_scale");  // inf in f32
  check_throws_with(make({.init_scale = 1e-39}), "init_scale");  // its inverse is inf in f32
  check_throws_with(make({.init_scale = 1.0, .min_loss_scale = 1e-39}), "min_loss_scale");
  check_throws_with(make({.min_loss_scale = -1.0}), "min_loss_scale");
  check_throws_with(make({.init_scale = 1.0, .min_loss_scale = 2.0}), "min_loss_scale");
  check_throws_with(make({.max_overflows_at_floor = -1}), "max_overflows_at_floor");
  check_throws_with(make({.max_overflows_at_floor = 3}), "needs a floor");
}
