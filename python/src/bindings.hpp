// The parts of the attn extension module, each defined in its own translation unit to keep the
// (template-heavy) pybind11 compiles small.
#pragma once

#include "numpy_tensor.hpp"

namespace attn::python {

void bind_context(py::module_& m);      // attn.Context, attn.default_context   (bind_ops.cpp)
void bind_ops(py::module_& m);          // free functions                        (bind_ops.cpp)
void bind_nn(py::module_& m);           // Module and the layer classes          (bind_nn.cpp)
void bind_transformer(py::module_& m);  // the Transformer encoder          (bind_transformer.cpp)
void bind_train(py::module_& m);        // Linear, cross_entropy                 (bind_train.cpp)
void bind_optim(py::module_& m);        // SGD, AdamW, clip_grad_norm            (bind_optim.cpp)
void bind_torch(py::module_& m);        // attn.torch's private entry points     (bind_torch.cpp)
void bind_decoder(py::module_& m);      // TransformerDecoder, EncoderDecoder   (bind_decoder.cpp)
void bind_distributed(py::module_& m);  // Communicator, the DDP reducer     (bind_distributed.cpp)

}  // namespace attn::python
