// Uses an installed attn the way a downstream project would: the chapter's example shape.
#include <attn/attn.hpp>

#include <cstdio>

int main() {
  attn::Context ctx;
  attn::Tensor P = attn::sinusoidal_encoding(4, 4);
  std::printf("P[1] = %.8f %.8f %.8f %.8f\n", P.at({1, 0}), P.at({1, 1}), P.at({1, 2}),
              P.at({1, 3}));
  attn::nn::MultiHeadAttention mha(100, 5, 0.5);
  mha.eval();
  attn::Tensor X = attn::Tensor::full({2, 4, 100}, 1.0);
  attn::Tensor lens = attn::Tensor::from_vector(std::vector<int64_t>{3, 2}, {2});
  attn::Tensor Y = mha.forward(ctx, X, X, X, lens);
  std::printf("%s\n", attn::shape_str(Y.shape()).c_str());
  return Y.shape() == attn::Shape{2, 4, 100} ? 0 : 1;
}
