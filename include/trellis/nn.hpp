// trellis::nn: tensor-parallel layers (column/row linear, vocab-parallel embedding and
// cross-entropy, attention, MLP, LayerNorm, transformer block) and the GPT-2 model, with its KV
// cache for decoding.
#pragma once

#include "trellis/nn/attention.hpp"
#include "trellis/nn/block.hpp"
#include "trellis/nn/cross_entropy.hpp"
#include "trellis/nn/dropout.hpp"
#include "trellis/nn/embedding.hpp"
#include "trellis/nn/gpt.hpp"
#include "trellis/nn/kv_cache.hpp"
#include "trellis/nn/layernorm.hpp"
#include "trellis/nn/linear.hpp"
#include "trellis/nn/mlp.hpp"
#include "trellis/nn/moe.hpp"
#include "trellis/nn/operand.hpp"
#include "trellis/nn/parameter.hpp"
#include "trellis/nn/pipeline_stage.hpp"
#include "trellis/nn/tensor_parallel.hpp"
