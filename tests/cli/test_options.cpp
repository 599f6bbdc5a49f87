// The option declarations and the one parser (core/options.h), without starting a command: both
// spellings, booleans, bare flags, ranges and choices, "did you mean", required options, rules, the
// help showing each default as the field holds it; and every command of the binary taking --key=value
// and naming the nearest option for a typo.
#include <gtest/gtest.h>

#include <cstdio>
#include <functional>
#include <optional>
#include <string>

#include "cli/common_options.h"
#include "core/error.h"
#include "core/options.h"
#include "parallel/launch_test_util.h"
#include "test_util.h"

using namespace mt;
using namespace mt::cli;
using mt::testutil::error_of;

namespace {

struct Fields {
  int64_t steps = 100;
  double lr = 2e-4;
  float temperature = 1.0f;
  bool reference = true, verbose = false;
  std::string device = "auto", run_dir = "runs/x";
  std::optional<double> min_lr;
  int dp = 0;
};

Options declare(Fields& f) {
  Options o("demo", "[options]");
  o.group("training");
  o.add("steps", &f.steps, "optimizer steps").at_least(1);
  o.add("lr", &f.lr, "peak learning rate").above(0);
  o.add("min-lr", &f.min_lr, "cosine decay to it", "constant").at_least(0);
  o.add("temperature", &f.temperature, "sampling temperature").at_least(0).says("0: greedy");
  o.add("reference", &f.reference, "keep a frozen copy");
  o.add("verbose", &f.verbose, "say more");
  o.group("run");
  o.add("device", &f.device, "where").one_of({"auto", "cpu", "cuda"});
  o.add("run-dir|out-dir", &f.run_dir, "the run directory");
  o.add("dp-shard", &f.dp, "FSDP ranks").at_least(0);
  o.rule([&f] {
    if (f.min_lr && *f.min_lr > f.lr) MT_THROW("demo: --min-lr ", *f.min_lr, " > --lr ", f.lr);
  });
  return o;
}

}  // namespace

TEST(CliOptions, BothSpellingsUnderscoresAndTheLastRepeatWin) {
  Fields f;
  Options o = declare(f);
  ASSERT_TRUE(o.parse({"--steps", "7", "--lr=1e-3", "--min_lr", "1e-4", "--out-dir=/tmp/r", "--steps=9"}));
  o.check();
  EXPECT_EQ(f.steps, 9);
  EXPECT_DOUBLE_EQ(f.lr, 1e-3);
  ASSERT_TRUE(f.min_lr.has_value());
  EXPECT_DOUBLE_EQ(*f.min_lr, 1e-4);
  EXPECT_EQ(f.run_dir, "/tmp/r");
  EXPECT_TRUE(o.given("steps"));
  EXPECT_TRUE(o.given("run-dir")) << "an alias counts for its option";
  EXPECT_FALSE(o.given("temperature"));
}

TEST(CliOptions, BooleansInEveryFormAndBare) {
  for (const auto& [args, want] :
       std::vector<std::pair<std::vector<std::string>, bool>>{{{"--reference", "off"}, false},
                                                              {{"--reference=false"}, false},
                                                              {{"--reference", "0"}, false},
                                                              {{"--reference", "no"}, false},
                                                              {{"--reference", "OFF"}, false},
                                                              {{"--reference=on"}, true},
                                                              {{"--reference", "true"}, true},
                                                              {{"--reference", "1"}, true}}) {
    Fields f;
    f.reference = !want;
    Options o = declare(f);
    ASSERT_TRUE(o.parse(args));
    EXPECT_EQ(f.reference, want) << args[0];
  }
  Fields f;
  Options o = declare(f);
  ASSERT_TRUE(o.parse({"--verbose", "--steps", "3"}));
  EXPECT_TRUE(f.verbose) << "a bare boolean is on";
  EXPECT_EQ(f.steps, 3) << "and the next option is parsed as one";
  Fields g;
  Options p = declare(g);
  EXPECT_NE(error_of([&] { p.parse({"--reference=maybe"}); }).find("--reference 'maybe' is not on or off"),
            std::string::npos);
}

TEST(CliOptions, ValuesAreCheckedAndErrorsNameTheOptionTheValueAndTheRange) {
  auto err = [](std::vector<std::string> args) {
    Fields f;
    Options o = declare(f);
    return error_of([&] {
      o.parse(args);
      o.check();
    });
  };
  EXPECT_EQ(err({"--lr", "0"}), "demo: --lr 0; need > 0");
  EXPECT_EQ(err({"--steps", "0"}), "demo: --steps 0; need >= 1");
  EXPECT_EQ(err({"--steps", "3.5"}), "demo: --steps '3.5' is not a whole number");
  EXPECT_EQ(err({"--steps", "12x"}), "demo: --steps '12x' is not a whole number");
  EXPECT_EQ(err({"--lr", "fast"}), "demo: --lr 'fast' is not a number");
  EXPECT_EQ(err({"--lr", "inf"}), "demo: --lr 'inf' is not a number");
  EXPECT_EQ(err({"--temperature", "-1"}), "demo: --temperature -1; need >= 0; 0: greedy");
  EXPECT_EQ(err({"--device", "tpu"}), "demo: --device 'tpu'; allowed: one of auto, cpu, cuda");
  EXPECT_EQ(err({"--steps"}), "demo: --steps needs a value (N: >= 1)");
  EXPECT_EQ(err({"--steps", "--lr", "1"}), "demo: --steps needs a value (N: >= 1)");
  EXPECT_EQ(err({"train.json"}),
            "demo: unexpected argument 'train.json'; options are --key value or --key=value (moetrain demo --help "
            "lists them)");
  EXPECT_EQ(err({"--min-lr", "0.1"}), "demo: --min-lr 0.1 > --lr 0.0002") << "a rule over two options";
}

TEST(CliOptions, UnknownOptionsSuggestTheNearestNames) {
  Fields f;
  Options o = declare(f);
  EXPECT_EQ(error_of([&] {
              o.parse({"--stpes", "3"});
            }),
            "demo: unknown option --stpes; did you mean --steps? (moetrain demo --help lists every option)");
  EXPECT_EQ(error_of([&] { o.parse({"--temprature=1"}); }),
            "demo: unknown option --temprature; did you mean --temperature? (moetrain demo --help lists every "
            "option)");
  EXPECT_EQ(error_of([&] { o.parse({"--zzzzzzzz"}); }),
            "demo: unknown option --zzzzzzzz (moetrain demo --help lists every option)");
}

TEST(CliOptions, HelpShowsEachDefaultAsTheFieldHoldsItAndRequiredOptionsAreChecked) {
  Fields f;
  f.steps = 1500;  // a preset's value, set before the help is printed
  Options o = declare(f);
  EXPECT_FALSE(o.parse({"--steps", "3", "--help"})) << "help stops the parse";
  const std::string h = o.help();
  EXPECT_NE(h.find("training:"), std::string::npos) << h;
  EXPECT_NE(h.find("--steps N"), std::string::npos) << h;
  EXPECT_NE(h.find("(default 3; >= 1)"), std::string::npos) << "the value the field holds now: " << h;
  EXPECT_NE(h.find("(default 0.0002; > 0)"), std::string::npos) << h;
  EXPECT_NE(h.find("(default constant; >= 0)"), std::string::npos) << h;
  EXPECT_NE(h.find("--device auto|cpu|cuda"), std::string::npos) << h;
  EXPECT_NE(h.find("--run-dir, --out-dir TEXT"), std::string::npos) << h;
  std::string model;
  Options r("cmd", "--model DIR");
  r.add("model", &model, "the model").required();
  ASSERT_TRUE(r.parse({}));
  EXPECT_EQ(error_of([&] { r.check(); }),
            "cmd: --model is required\nusage: moetrain cmd --model DIR\n(moetrain cmd --help lists every option)");
  EXPECT_NE(r.help().find("the model (required)"), std::string::npos);
}

// set() is one value as the command line gives it (a config file's values come through it): checked, set,
// counted as given; refusal() is the check alone; get() reads back to the same number.
TEST(CliOptions, SetChecksOneValueAsTheCommandLineDoesAndGetReadsBackExactly) {
  Fields f;
  Options o = declare(f);
  o.set("min_lr", "1e-5");
  ASSERT_TRUE(f.min_lr.has_value());
  EXPECT_DOUBLE_EQ(*f.min_lr, 1e-5);
  EXPECT_TRUE(o.given("min-lr"));
  EXPECT_EQ(error_of([&] { o.set("lr", "0"); }), "demo: --lr 0; need > 0");
  EXPECT_EQ(error_of([&] { o.set("stpes", "3"); }),
            "demo: unknown option --stpes; did you mean --steps? (moetrain demo --help lists every option)");
  EXPECT_EQ(o.find("lr")->refusal("0"), "need > 0");
  EXPECT_EQ(o.find("lr")->refusal("1"), "");
  EXPECT_EQ(o.find("device")->refusal("tpu"), "allowed: one of auto, cpu, cuda");
  EXPECT_EQ(o.find("lr")->get(), "0.0002") << "%g where it is exact";
  f.lr = 0.1 + 0.2;
  EXPECT_EQ(o.find("lr")->get(), "0.30000000000000004") << "else the shortest text that is";
  EXPECT_EQ(o.find("temperature")->get(), "1");
  o.at("run-dir").not_empty();
  EXPECT_EQ(error_of([&] { o.parse({"--out-dir="}); }), "demo: --run-dir ''; must not be empty");
  EXPECT_EQ(o.find("run-dir")->refusal("x"), "");
  o.at("device").required();
  Fields g;
  Options p = declare(g);
  p.at("device").required();
  ASSERT_TRUE(p.parse({}));
  EXPECT_NE(error_of([&] { p.check(); }).find("demo: --device is required"), std::string::npos);
  EXPECT_NE(error_of([&] { p.at("nope"); }).find("no option --nope"), std::string::npos);
}

TEST(CliOptions, PositionalArgumentsAndTheRestAfterADoubleDash) {
  Fields f;
  Options o = declare(f);
  o.allow_positional("RUN_DIR");
  ASSERT_TRUE(o.parse({"runs/a", "--steps", "2", "--", "--lr", "x"}));
  EXPECT_EQ(o.positional(), (std::vector<std::string>{"runs/a", "--lr", "x"}));
  EXPECT_EQ(f.steps, 2);
}

TEST(CliOptions, SharedGroupsDeclareTheSameNamesEverywhere) {
  DeviceOptions d;
  MeshSpec m;
  SamplingParams s;
  Options o("cmd", "[options]");
  add_device_options(o, d);
  add_mesh_options(o, m, {.replicate = true, .tp = true, .sp = true, .etp = true});
  add_sampling_options(o, s);
  ASSERT_TRUE(o.parse({"--device=cpu",
                       "--threads",
                       "2",
                       "--dp-shard=2",
                       "--ep",
                       "2",
                       "--tp",
                       "2",
                       "--sp=2",
                       "--etp",
                       "2",
                       "--dp_replicate",
                       "2",
                       "--temperature",
                       "0.7",
                       "--top-p=0.9",
                       "--top-k",
                       "5",
                       "--min-p",
                       "0.05"}));
  EXPECT_EQ(d.device, "cpu");
  EXPECT_EQ(d.threads, 2);
  EXPECT_EQ(m.dp_shard, 2);
  EXPECT_EQ(m.dp_replicate, 2);
  EXPECT_EQ(m.ep, 2);
  EXPECT_EQ(m.tp, 2);
  EXPECT_EQ(m.sp, 2);
  EXPECT_EQ(m.etp, 2);
  EXPECT_FLOAT_EQ(s.temperature, 0.7f);
  EXPECT_FLOAT_EQ(s.top_p, 0.9f);
  EXPECT_EQ(s.top_k, 5);
  EXPECT_FLOAT_EQ(s.min_p, 0.05f);
  EXPECT_NE(error_of([&] { o.parse({"--ep", "0"}); }).find("--ep 0; need >= 1"), std::string::npos);
  EXPECT_NE(error_of([&] { o.parse({"--top-p", "0"}); }).find("--top-p 0; need > 0 and <= 1"), std::string::npos);
}

// Every command of the binary: --key=value is accepted (its error, if any, is about the run, not the
// syntax) and a typo names the nearest option.
TEST(CliOptions, EveryCommandTakesKeyEqualsValueAndNamesTheNearestOptionForATypo) {
  struct Case {
    const char* command;
    const char* typo;
    const char* suggestion;
  };
  for (const Case& c :
       {Case{"generate", "--max-new-token=3", "--max-new-tokens"}, Case{"grpo", "--max-digit=3", "--max-digits"},
        Case{"convert", "--max-shard-sise=1GB", "--max-shard-size"}, Case{"grads", "--recompte=full", "--recompute"},
        Case{"tokenize", "--shard-token=10", "--shard-tokens"}, Case{"plot", "--outt=x.svg", "--out"},
        Case{"launch", "--nproc-per-nod=2", "--nproc-per-node"}, Case{"train", "--max-step=3", "--max-steps"},
        Case{"sft", "--max-step=3", "--max-steps"}}) {
    SCOPED_TRACE(c.command);
    const mt::test::ShellRun r = mt::test::sh(mt::test::kMoetrainBin + " " + c.command + " " + c.typo);
    EXPECT_NE(r.code, 0);
    EXPECT_NE(r.out.find(std::string("did you mean ") + c.suggestion), std::string::npos) << r.out;
    const mt::test::ShellRun h = mt::test::sh(mt::test::kMoetrainBin + " " + c.command + " --help");
    EXPECT_EQ(h.code, 0) << h.out;
    EXPECT_NE(h.out.find("(default"), std::string::npos) << "the help shows the defaults: " << h.out;
  }
}
