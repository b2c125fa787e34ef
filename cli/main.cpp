// The `microbatch` command: train, and check-accumulation. Flags carry Hugging Face
// TrainingArguments names, accepted with dashes or underscores.
#include <CLI/CLI.hpp>

#include <filesystem>
#include <iostream>
#include <memory>

#include "nn/models.h"
#include "train/accumulation_check.h"
#include "train/fashion_mnist.h"
#include "train/fit.h"
#include "train/text.h"

namespace mb = microbatch;

namespace {

// "--per-device-train-batch-size,--per_device_train_batch_size"
std::string both_spellings(const std::string& dashed) {
  std::string underscored = dashed;
  for (std::size_t i = 2; i < underscored.size(); ++i)
    if (underscored[i] == '-') underscored[i] = '_';
  return underscored == dashed ? dashed : dashed + "," + underscored;
}

struct TrainOptions {
  std::string model = "mlp";
  std::string data;
  mb::train::TrainingArguments args{.per_device_train_batch_size = 64,
                                    .num_train_epochs = 5,
                                    .learning_rate = 1e-3,
                                    .logging_steps = 100,
                                    .eval_strategy = "epoch"};
  mb::nn::GPTConfig gpt{};
  std::string text_level = "char";
  double dropout = 0.0;
};

void add_train_flags(CLI::App& cmd, TrainOptions& o) {
  auto& a = o.args;
  cmd.add_option("--model", o.model, "mlp, cnn or gpt")->check(CLI::IsMember({"mlp", "cnn", "gpt"}));
  cmd.add_option("--data", o.data,
                 "Fashion-MNIST folder (mlp, cnn; default /usr/share/datasets/fashion-mnist) or a UTF-8 "
                 "text file (gpt)");
  cmd.add_option(both_spellings("--output-dir"), a.output_dir);
  cmd.add_option(both_spellings("--per-device-train-batch-size"), a.per_device_train_batch_size);
  cmd.add_option(both_spellings("--per-device-eval-batch-size"), a.per_device_eval_batch_size);
  cmd.add_option(both_spellings("--gradient-accumulation-steps"), a.gradient_accumulation_steps);
  cmd.add_option(both_spellings("--num-train-epochs"), a.num_train_epochs);
  cmd.add_option(both_spellings("--max-steps"), a.max_steps);
  cmd.add_option(both_spellings("--learning-rate"), a.learning_rate);
  cmd.add_option(both_spellings("--weight-decay"), a.weight_decay);
  cmd.add_option(both_spellings("--adam-beta1"), a.adam_beta1);
  cmd.add_option(both_spellings("--adam-beta2"), a.adam_beta2);
  cmd.add_option(both_spellings("--adam-epsilon"), a.adam_epsilon);
  cmd.add_option(both_spellings("--max-grad-norm"), a.max_grad_norm);
  cmd.add_option(both_spellings("--lr-scheduler-type"), a.lr_scheduler_type);
  cmd.add_option(both_spellings("--warmup-steps"), a.warmup_steps);
  cmd.add_option(both_spellings("--warmup-ratio"), a.warmup_ratio);
  cmd.add_option(both_spellings("--logging-steps"), a.logging_steps);
  cmd.add_option(both_spellings("--eval-strategy"), a.eval_strategy);
  cmd.add_option(both_spellings("--eval-steps"), a.eval_steps);
  cmd.add_option("--seed", a.seed);
  cmd.add_flag("--json", a.json, "print one JSON object per log line");
  cmd.add_option(both_spellings("--block-size"), o.gpt.block_size, "gpt: sequence length");
  cmd.add_option(both_spellings("--n-layer"), o.gpt.n_layer, "gpt: blocks");
  cmd.add_option(both_spellings("--n-head"), o.gpt.n_head, "gpt: attention heads");
  cmd.add_option(both_spellings("--n-embd"), o.gpt.n_embd, "gpt: width");
  cmd.add_option(both_spellings("--text-level"), o.text_level, "gpt: byte or char vocabulary")
      ->check(CLI::IsMember({"byte", "char"}));
  cmd.add_option("--dropout", o.dropout);
}

int run_train(TrainOptions& o) {
  mb::manual_seed(o.args.seed);
  std::unique_ptr<mb::nn::Model> model;
  std::unique_ptr<mb::train::Dataset> train_set, eval_set;
  if (o.model == "gpt") {
    const std::string path = o.data.empty() ? "../shared/data/tinyshakespeare.txt" : o.data;
    mb::train::TextOptions text{.block_size = o.gpt.block_size,
                                .level = o.text_level == "byte" ? mb::train::TextLevel::Byte
                                                                : mb::train::TextLevel::Char};
    auto train_text = std::make_unique<mb::train::TextDataset>(path, text);
    text.split = mb::train::Split::Val;
    eval_set = std::make_unique<mb::train::TextDataset>(path, text);
    o.gpt.vocab_size = train_text->vocab_size();
    o.gpt.dropout = o.dropout;
    model = std::make_unique<mb::nn::GPT>(o.gpt);
    train_set = std::move(train_text);
  } else {
    const std::string root = o.data.empty() ? mb::train::kFashionMnistRoot : o.data;
    train_set = std::make_unique<mb::train::FashionMNIST>(root, mb::train::Split::Train);
    eval_set = std::make_unique<mb::train::FashionMNIST>(root, mb::train::Split::Test);
    if (o.model == "mlp") model = std::make_unique<mb::nn::MLP>(mb::nn::MLPConfig{.dropout = o.dropout});
    else model = std::make_unique<mb::nn::CNN>(mb::nn::CNNConfig{.dropout = o.dropout});
  }
  if (!o.args.json) {
    std::cout << "model " << o.model << ": " << model->num_parameters() << " parameters; "
              << train_set->size() << " training examples; micro-batch "
              << o.args.per_device_train_batch_size << " x " << o.args.gradient_accumulation_steps
              << " accumulation steps\n";
  }
  mb::train::FitResult r = mb::train::fit(*model, *train_set, eval_set.get(), o.args, std::cout);
  std::filesystem::create_directories(o.args.output_dir);
  if (!o.args.json) {
    std::cout << fmt::format("done: {} steps in {:.1f} s", r.steps, r.seconds);
    if (r.eval && r.eval->accuracy) std::cout << fmt::format(", test accuracy {:.2f}%", *r.eval->accuracy * 100);
    else if (r.eval) std::cout << fmt::format(", validation loss {:.4f}", r.eval->loss);
    std::cout << "\n";
  }
  return 0;
}

int run_check_accumulation(const std::string& dtypes, bool json) {
  bool ok = true;
  for (const std::string& name : {std::string("f64"), std::string("f32")}) {
    if (dtypes != "both" && dtypes != name) continue;
    const mb::DType dt = mb::parse_dtype(name);
    const double tol = mb::train::accumulation_tolerance(dt);
    for (const auto& c : mb::train::check_accumulation({.dtype = dt})) {
      const bool pass = c.max_gradient <= tol && c.max_weight <= tol;
      ok = ok && pass;
      if (json) {
        std::cout << fmt::format("{{\"model\": \"{}\", \"dtype\": \"{}\", \"split\": \"{}\", \"max_grad_rel\": {:.3e}, "
                                 "\"max_weight_rel\": {:.3e}, \"naive_max_grad_rel\": {:.3e}, \"pass\": {}}}\n",
                                 c.model, name, c.split, c.max_gradient, c.max_weight, c.naive_max_gradient, pass);
        continue;
      }
      std::cout << fmt::format("{:<4} {:<4} split {:<12} max rel. diff: gradients {:.2e}, weights {:.2e}  [{}]\n",
                               c.model, name, c.split, c.max_gradient, c.max_weight,
                               pass ? "ok" : fmt::format("FAIL > {:.0e}", tol));
      for (std::size_t i = 0; i < c.gradients.size(); ++i) {
        std::cout << fmt::format("       {:<28} grad {:.2e}  weight {:.2e}\n", c.gradients[i].name,
                                 c.gradients[i].max_relative, c.weights[i].max_relative);
      }
      if (c.naive_max_gradient >= 0) {
        std::cout << fmt::format("       for contrast, mean-per-micro-batch / N: gradients off by {:.2e}\n",
                                 c.naive_max_gradient);
      }
    }
  }
  std::cout << (ok ? "accumulation is exact\n" : "accumulation check FAILED\n");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"microbatch: memory-efficient training"};
  app.require_subcommand(1);
  TrainOptions train;
  CLI::App* train_cmd = app.add_subcommand("train", "train a model (mlp, cnn on Fashion-MNIST; gpt on text)");
  add_train_flags(*train_cmd, train);
  std::string dtypes = "both";
  bool json = false;
  CLI::App* check_cmd = app.add_subcommand("check-accumulation",
                                           "one step on a full batch vs. the same batch in micro-batches");
  check_cmd->add_option("--dtype", dtypes, "f64, f32 or both")->check(CLI::IsMember({"f64", "f32", "both"}));
  check_cmd->add_flag("--json", json);
  CLI11_PARSE(app, argc, argv);
  try {
    if (train_cmd->parsed()) return run_train(train);
    if (check_cmd->parsed()) return run_check_accumulation(dtypes, json);
  } catch (const mb::Error& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
