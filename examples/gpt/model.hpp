// The gpt example's model: a small character-level GPT in libtorch (token and position embeddings,
// pre-norm blocks of causal self-attention and an MLP, a final norm, the output tied to the token
// embedding), and the Tiny Shakespeare text as token ids.
#pragma once

#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace gpt {

struct Config {
  std::int64_t vocab = 65;
  std::int64_t context = 64;  // tokens the model sees
  std::int64_t width = 64;    // embedding size
  std::int64_t heads = 4;
  std::int64_t layers = 2;
};

// One pre-norm block: x + attention(norm(x)), then x + mlp(norm(x)).
struct BlockImpl : torch::nn::Module {
  BlockImpl(const Config& c)
      : heads(c.heads),
        norm1(
            register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.width})))),
        qkv(register_module("qkv", torch::nn::Linear(c.width, 3 * c.width))),
        proj(register_module("proj", torch::nn::Linear(c.width, c.width))),
        norm2(
            register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.width})))),
        up(register_module("up", torch::nn::Linear(c.width, 4 * c.width))),
        down(register_module("down", torch::nn::Linear(4 * c.width, c.width))) {
    // -inf above the diagonal: a position sees itself and the positions before it.
    causal = register_buffer(
        "causal",
        torch::full({c.context, c.context}, -INFINITY).triu(1).view({1, 1, c.context, c.context}));
  }

  torch::Tensor forward(torch::Tensor x) {
    const auto b = x.size(0), t = x.size(1), w = x.size(2), hd = w / heads;
    auto parts = qkv(norm1(x)).split(w, 2);
    auto shape = [&](const torch::Tensor& p) { return p.view({b, t, heads, hd}).transpose(1, 2); };
    auto q = shape(parts[0]), k = shape(parts[1]), v = shape(parts[2]);
    auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(double(hd));
    scores = scores + causal.index({torch::indexing::Slice(), torch::indexing::Slice(),
                                    torch::indexing::Slice(0, t), torch::indexing::Slice(0, t)});
    auto y = torch::matmul(torch::softmax(scores, -1), v).transpose(1, 2).reshape({b, t, w});
    x = x + proj(y);
    return x + down(torch::gelu(up(norm2(x))));
  }

  std::int64_t heads;
  torch::nn::LayerNorm norm1;
  torch::nn::Linear qkv, proj;
  torch::nn::LayerNorm norm2;
  torch::nn::Linear up, down;
  torch::Tensor causal;
};
TORCH_MODULE(Block);

struct GptImpl : torch::nn::Module {
  GptImpl(const Config& c)
      : config(c),
        tokens(register_module("tokens", torch::nn::Embedding(c.vocab, c.width))),
        positions(register_module("positions", torch::nn::Embedding(c.context, c.width))),
        norm(
            register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.width})))) {
    for (std::int64_t i = 0; i < c.layers; ++i)
      blocks.push_back(register_module("block" + std::to_string(i), Block(c)));
    // GPT-2's initialisation: N(0, 0.02) weights, zero biases.
    torch::NoGradGuard no_grad;
    for (auto& p : named_parameters()) {
      if (p.key().find("norm") != std::string::npos) continue;
      if (p.key().ends_with("bias"))
        p.value().zero_();
      else
        p.value().normal_(0.0, 0.02);
    }
  }

  // Logits [batch, time, vocab] for token ids [batch, time].
  torch::Tensor forward(const torch::Tensor& ids) {
    const auto t = ids.size(1);
    auto x = tokens(ids) + positions(torch::arange(t, torch::kLong));
    for (auto& b : blocks) x = b->forward(x);
    return torch::matmul(norm(x), tokens->weight.t());
  }

  // The mean cross-entropy (nats per character) of predicting y from x.
  torch::Tensor loss(const torch::Tensor& x, const torch::Tensor& y) {
    auto logits = forward(x);
    return torch::nn::functional::cross_entropy(logits.view({-1, config.vocab}), y.view({-1}));
  }

  Config config;
  torch::nn::Embedding tokens, positions;
  std::vector<Block> blocks;
  torch::nn::LayerNorm norm;
};
TORCH_MODULE(Gpt);

}  // namespace gpt
