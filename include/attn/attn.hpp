// attn: self-attention, multi-head attention and positional encoding (d2l chapter 11.6).
// Umbrella header.
#pragma once

#include "attn/core/context.hpp"
#include "attn/core/error.hpp"
#include "attn/core/memory.hpp"
#include "attn/core/rng.hpp"
#include "attn/core/safetensors.hpp"
#include "attn/core/tensor.hpp"
#include "attn/nn/attention.hpp"
#include "attn/nn/module.hpp"
#include "attn/nn/positional.hpp"
#include "attn/ops/attention.hpp"
#include "attn/ops/linear.hpp"
#include "attn/ops/masked_softmax.hpp"
#include "attn/ops/positional.hpp"
