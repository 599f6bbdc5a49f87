// LoRA against PEFT: goldens made by tools/make_peft_goldens.py (transformers + PEFT, fp32 CPU): a tiny
// Qwen3-MoE with random adapters on attention and the experts (`moe`), and one with a dense layer whose MLP
// is adapted too (`dense`). The PEFT-written adapter loads here; logits, loss and every adapter gradient
// equal PEFT's; our export is PEFT's file again; the merged weights and their logits equal PEFT's merge.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include "data/batch.h"
#include "io/safetensors.h"
#include "model/hf_checkpoint.h"
#include "model/lora.h"
#include "model/lora_peft.h"
#include "model/qwen3_moe.h"
#include "test_util.h"

using namespace mt;
namespace fs = std::filesystem;

namespace {

const std::string kRoot = std::string(MT_SOURCE_DIR) + "/";

double rel_l2(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.numel(), b.numel());
  double num = 0, den = 0;
  for (int64_t i = 0; i < std::min(a.numel(), b.numel()); ++i) {
    const double d = double(a.data<float>()[i]) - double(b.data<float>()[i]);
    if (std::isnan(d)) return INFINITY;
    num += d * d;
    den += double(b.data<float>()[i]) * double(b.data<float>()[i]);
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

struct Case {
  std::string dir, base;
  ModelConfig cfg;
};

Case open_case(const std::string& name) {
  Case c;
  c.dir = kRoot + "tests/assets/goldens/lora/" + name;
  std::ifstream f(c.dir + "/meta.json");
  c.base = kRoot + nlohmann::json::parse(f)["base_dir"].get<std::string>();
  c.cfg = load_model_config(c.base);
  return c;
}

std::unique_ptr<Qwen3MoeModel> frozen_base(const Case& c) {
  auto m = std::make_unique<Qwen3MoeModel>(c.cfg, Device::CPU, nullptr, Weights::Frozen);
  load_hf_weights(c.base, c.cfg, m->table(), m->params());
  return m;
}

MicroBatch batch_of(const Case& c) {
  SafetensorsFile f(c.dir + "/batch.safetensors");
  return MicroBatch{f.view("input_ids").clone(), f.view("labels").clone()};
}

std::string tmp_dir(const std::string& tag) {
  const std::string d = (fs::temp_directory_path() / ("mt_lora_peft_" + tag + "_" + std::to_string(getpid()))).string();
  fs::remove_all(d);
  return d;
}

class LoraPeft : public ::testing::TestWithParam<std::string> {};

}  // namespace

TEST_P(LoraPeft, LogitsLossAndEveryAdapterGradientMatchPeft) {
  const Case c = open_case(GetParam());
  const LoraSpec spec = read_peft_config(c.dir + "/adapter");
  EXPECT_EQ(spec.rank, 4);
  EXPECT_DOUBLE_EQ(spec.scale(), 2.0);
  LoraAdapters a(c.cfg, spec, Device::CPU, 0);
  a.load(read_peft_adapter(c.dir + "/adapter", c.cfg, spec));
  SafetensorsFile exp(c.dir + "/expected.safetensors");
  for (Recompute rc : {Recompute::None, Recompute::Full, Recompute::Moe}) {
    SCOPED_TRACE(recompute_name(rc));
    auto m = frozen_base(c);
    m->attach_lora(&a);
    const MicroBatch mb = batch_of(c);
    const int64_t n = count_target_tokens(mb.labels);
    Tensor logits;
    PassOptions po;
    po.ce_scale = 1.0 / double(n);
    po.recompute = rc;
    po.overwrite_grads = true;
    po.logits_out = &logits;
    const LossParts lp = m->forward_backward(mb, po);
    const double want = exp.read_f32("loss").data<float>()[0];
    EXPECT_LE(std::abs(lp.loss - want), 1e-5 * std::abs(want)) << lp.loss << " vs " << want;
    EXPECT_LE(rel_l2(logits, exp.read_f32("logits").view({-1, c.cfg.vocab_size})), 1e-5);
    // The gradients in PEFT's layout: through the exporter, which the next test checks on the weights.
    const std::string out = tmp_dir("grads");
    write_peft_adapter(out, c.cfg, spec, a.grads(), "");
    SafetensorsFile got(out + "/adapter_model.safetensors");
    size_t compared = 0;
    for (const std::string& key : got.names()) {
      ASSERT_TRUE(exp.has("grad." + key)) << key;
      const double err = rel_l2(got.read_f32(key), exp.read_f32("grad." + key));
      EXPECT_LE(err, 1e-5) << "grad." << key;
      ++compared;
    }
    size_t golden = 0;
    for (const std::string& k : exp.names()) golden += k.rfind("grad.", 0) == 0;
    EXPECT_EQ(compared, golden);
    EXPECT_GE(compared, 24u);
    fs::remove_all(out);
  }
}

TEST_P(LoraPeft, OurExportIsPeftsFileAndMergeEqualsPefts) {
  const Case c = open_case(GetParam());
  const LoraSpec spec = read_peft_config(c.dir + "/adapter");
  const Tensor flat = read_peft_adapter(c.dir + "/adapter", c.cfg, spec);
  const std::string out = tmp_dir("export");
  write_peft_adapter(out, c.cfg, spec, flat, "base");
  // Every tensor of PEFT's file, bit for bit, and no other.
  SafetensorsFile peft(c.dir + "/adapter/adapter_model.safetensors"), ours(out + "/adapter_model.safetensors");
  EXPECT_EQ(ours.names().size(), peft.names().size());
  for (const std::string& key : peft.names()) {
    ASSERT_TRUE(ours.has(key)) << key;
    const Tensor a = ours.read_f32(key), b = peft.read_f32(key);
    ASSERT_EQ(a.shape(), b.shape()) << key;
    EXPECT_EQ(0, std::memcmp(a.data<float>(), b.data<float>(), size_t(a.numel()) * 4)) << key;
  }
  // The config reads back as the same adapter.
  const LoraSpec back = read_peft_config(out);
  EXPECT_EQ(back.rank, spec.rank);
  EXPECT_DOUBLE_EQ(back.scale(), spec.scale());
  EXPECT_EQ(back.targets, spec.targets);
  fs::remove_all(out);

  // Merged weights: each adapted parameter equals PEFT's merge_and_unload, and the merged model's logits
  // equal the adapted model's (PEFT's logits_merged).
  auto m = std::make_unique<Qwen3MoeModel>(c.cfg);
  const LoadReport rep = load_hf_weights(c.base, c.cfg, m->table(), m->params());
  merge_lora(c.cfg, spec, flat, m->table(), m->params());
  SafetensorsFile exp(c.dir + "/expected.safetensors");
  size_t merged = 0;
  for (auto& [name, w] : export_hf_tensors(c.cfg, m->table(), m->params(), rep.layout))
    if (exp.has("merged." + name)) {
      EXPECT_LE(rel_l2(w, exp.read_f32("merged." + name)), 1e-6) << name;
      ++merged;
    }
  EXPECT_GE(merged, 8u);
  Tensor logits;
  m->forward(batch_of(c), &logits);
  EXPECT_LE(rel_l2(logits, exp.read_f32("logits_merged").view({-1, c.cfg.vocab_size})), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Goldens, LoraPeft, ::testing::Values("moe", "dense"));

TEST(LoraPeftFiles, WhatWeCannotReadIsNamed) {
  const Case c = open_case("moe");
  const std::string d = tmp_dir("bad");
  fs::create_directories(d);
  auto write_cfg = [&](const nlohmann::json& j) { std::ofstream(d + "/adapter_config.json") << j.dump(); };
  nlohmann::json base = {{"peft_type", "LORA"}, {"r", 4}, {"lora_alpha", 8}, {"target_modules", {"q_proj"}}};
  write_cfg(base);
  EXPECT_EQ(read_peft_config(d).rank, 4);
  nlohmann::json j = base;
  j["target_modules"] = {"gate_proj"};
  write_cfg(j);
  EXPECT_NE(testutil::error_of([&] { read_peft_config(d); }).find("target_modules entry 'gate_proj'"),
            std::string::npos);
  j = base;
  j["use_dora"] = true;
  write_cfg(j);
  EXPECT_NE(testutil::error_of([&] { read_peft_config(d); }).find("use_dora"), std::string::npos);
  j = base;
  j["rank_pattern"] = {{"q_proj", 8}};
  write_cfg(j);
  EXPECT_NE(testutil::error_of([&] { read_peft_config(d); }).find("rank_pattern"), std::string::npos);
  // A file whose tensors do not fit the config: a missing tensor, then a stray one, are named.
  write_cfg(base);
  LoraSpec s = read_peft_config(d);
  EXPECT_NE(testutil::error_of([&] { read_peft_adapter(d, c.cfg, s); }).find("does not exist"), std::string::npos);
  fs::copy_file(c.dir + "/adapter/adapter_model.safetensors", d + "/adapter_model.safetensors");
  EXPECT_NE(testutil::error_of([&] { read_peft_adapter(d, c.cfg, s); }).find("do not account for"),
            std::string::npos);
  s.targets = parse_lora_targets("attn,experts,router");
  EXPECT_NE(testutil::error_of([&] { read_peft_adapter(d, c.cfg, s); }).find("mlp.gate.lora_A.weight"),
            std::string::npos);
  fs::remove_all(d);
}
