// RL policy losses under the parallel layouts (the layout test): for the same rollouts (a batch with
// advantages, old, reference log-probs and token weights), `moetrain grads --objective ...` under
// dp_shard 2, ep 2 and tp 2 gives the loss and every gradient of one process (fp32 CPU, DESIGN's layout
// tolerance: 1e-6 all together). PPO clip with clip-higher, dual clip, a k3 KL term and an entropy bonus;
// GSPO (whose sequence ratio needs a sample's tokens on one rank) under dp_shard 2.
#include <gtest/gtest.h>

#include "core/rng.h"
#include "io/safetensors.h"
#include "parallel/equivalence_util.h"
#include "parallel/launch_test_util.h"

using namespace mt;
using namespace mt::test;

namespace {

// make_batch's ids and labels plus the policy inputs: advantages (per row, as a group estimator gives),
// old and reference log-probs around log(1/V) so that ratios land on both sides of the clip range, and
// token weights 1 / (target tokens).
std::string make_policy_batch(const std::string& model, const std::string& path) {
  make_batch(model, path, 4, 12, 7);
  SafetensorsFile f(path);
  const Tensor ids = f.view("input_ids").clone(), labels = f.view("labels").clone();
  const int64_t B = ids.size(0), S = ids.size(1);
  Tensor adv = Tensor::empty({B, S}), old = Tensor::empty({B, S}), ref = Tensor::empty({B, S}),
         w = Tensor::empty({B, S});
  Rng rng(11);
  const float row_adv[] = {1.2f, -0.7f, 0.4f, -1.5f};
  for (int64_t i = 0; i < B * S; ++i) {
    adv.data<float>()[i] = row_adv[i / S];
    old.data<float>()[i] = float(-6.2 + rng.uniform() * 0.8 - 0.4);
    ref.data<float>()[i] = float(-6.2 + rng.uniform() * 0.6 - 0.3);
    w.data<float>()[i] = 1.0f / 40.0f;
  }
  write_safetensors(path, {{"input_ids", ids}, {"labels", labels}, {"advantages", adv}, {"old_logprobs", old},
                           {"ref_logprobs", ref}, {"token_weights", w}});
  return path;
}

}  // namespace

TEST(RlLayouts, PolicyLossGradientsEqualOneProcess) {
  MT_SKIP_WITHOUT_GLOO();
  const std::string model = kGoldens + "/tiny", batch = make_policy_batch(model, tmp_path("rl_layouts", "b.safetensors"));
  struct Case {
    std::string objective, layout;
  };
  const std::string ppo = "ppo --clip-low 0.2 --clip-high 0.28 --dual-clip 3 --kl-coef 0.05 --kl k3 --entropy-coef 0.01";
  for (const Case& c : {Case{ppo, "--dp-shard 2"}, Case{ppo, "--ep 2"}, Case{ppo, "--tp 2"},
                        Case{"gspo --clip-low 0.2 --clip-high 0.2", "--dp-shard 2"}}) {
    const std::string args = " grads --model " + model + " --batch " + batch + " --objective " + c.objective;
    const std::string ref = tmp_path("rl_layouts", "ref.safetensors"), got = tmp_path("rl_layouts", "got.safetensors");
    ShellRun r = sh(kMoetrainBin + args + " --out " + ref);
    ASSERT_EQ(r.code, 0) << r.out;
    r = sh(kMoetrainBin + " launch --nproc-per-node 2 --" + args + " " + c.layout + " --out " + got);
    ASSERT_EQ(r.code, 0) << c.objective << " " << c.layout << "\n" << r.out;
    double worst = 0, all = 0;
    expect_same(got, ref, c.objective.substr(0, 4) + " " + c.layout, &worst, &all);
    EXPECT_LE(all, 1e-6) << c.layout;
    SafetensorsFile f(ref);
    EXPECT_NE(f.read_f32("loss").data<float>()[0], 0.0f);
  }
}

TEST(RlLayouts, MissingPolicyInputsAreAnErrorNamingThem) {
  const std::string model = kGoldens + "/tiny", batch = make_batch(model, tmp_path("rl_missing", "b.safetensors"));
  ShellRun r = sh(kMoetrainBin + " grads --model " + model + " --batch " + batch + " --objective ppo --out " +
                  tmp_path("rl_missing", "o.safetensors"));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("has no tensor 'advantages'"), std::string::npos) << r.out;
  r = sh(kMoetrainBin + " grads --model " + model + " --batch " + batch + " --objective ppo3 --out x");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--objective 'ppo3'; allowed: one of ppo, gspo, pg"), std::string::npos) << r.out;
}

// GSPO's sequence ratio needs each sample's tokens on one rank: under tp (a rank holds a slice of the
// batch's tokens, rows cut where the slice ends) as under sp it is an error naming the layout.
TEST(RlLayouts, GspoUnderTpIsAnErrorNamingIt) {
  MT_SKIP_WITHOUT_GLOO();
  const std::string model = kGoldens + "/tiny", batch = make_policy_batch(model, tmp_path("rl_gspo_tp", "b.safetensors"));
  const ShellRun r = sh(kMoetrainBin + " launch --nproc-per-node 2 -- grads --model " + model + " --batch " + batch +
                        " --objective gspo --tp 2 --out " + tmp_path("rl_gspo_tp", "o.safetensors"));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--objective gspo needs each sample's tokens on one rank; not with --tp 2"), std::string::npos)
      << r.out;
}
