// Reference layer normalisation, forward and backward side by side (see layer_norm.hpp).
#include "kernels/ref/layer_norm.hpp"

#include <cmath>
#include <vector>

namespace attn::ref {

template <typename T>
void layer_norm_forward(const T* x, const T* gamma, const T* beta, T* y, T* mean, T* rstd,
                        int64_t R, int64_t E, double eps) {
  for (int64_t r = 0; r < R; ++r) {
    const T* xr = x + r * E;
    // Two passes in double: the mean, then the biased variance around it (no E[x^2] - E[x]^2
    // cancellation).
    double m = 0.0;
    for (int64_t e = 0; e < E; ++e)
      m += xr[e];
    m /= static_cast<double>(E);
    double var = 0.0;
    for (int64_t e = 0; e < E; ++e) {
      const double c = xr[e] - m;
      var += c * c;
    }
    var /= static_cast<double>(E);
    const double s = 1.0 / std::sqrt(var + eps);
    for (int64_t e = 0; e < E; ++e) {
      double v = (xr[e] - m) * s;
      if (gamma != nullptr) v = v * gamma[e] + beta[e];
      y[r * E + e] = static_cast<T>(v);
    }
    mean[r] = static_cast<T>(m);
    rstd[r] = static_cast<T>(s);
  }
}

template <typename T>
void layer_norm_backward(const T* dy, const T* x, const T* gamma, const T* mean, const T* rstd,
                         T* dx, T* dgamma, T* dbeta, int64_t R, int64_t E) {
  std::vector<double> dg(static_cast<size_t>(E), 0.0), db(static_cast<size_t>(E), 0.0);
  for (int64_t r = 0; r < R; ++r) {
    const T* xr = x + r * E;
    const T* dyr = dy + r * E;
    const double m = mean[r], s = rstd[r];
    // forward: xhat = (x - mean) * rstd;  y = xhat * gamma + beta
    // so:      g = dy * gamma is d loss / d xhat, and through mean and rstd (both functions of
    //          the whole row): dx = rstd * (g - mean_e(g) - xhat * mean_e(g * xhat))
    double g_mean = 0.0, gx_mean = 0.0;
    for (int64_t e = 0; e < E; ++e) {
      const double xhat = (xr[e] - m) * s;
      const double g = gamma != nullptr ? static_cast<double>(dyr[e]) * gamma[e] : dyr[e];
      g_mean += g;
      gx_mean += g * xhat;
      dg[e] += static_cast<double>(dyr[e]) * xhat;  // dgamma = sum_r dy * xhat
      db[e] += dyr[e];                              // dbeta  = sum_r dy
    }
    g_mean /= static_cast<double>(E);
    gx_mean /= static_cast<double>(E);
    for (int64_t e = 0; e < E; ++e) {
      const double xhat = (xr[e] - m) * s;
      const double g = gamma != nullptr ? static_cast<double>(dyr[e]) * gamma[e] : dyr[e];
      dx[r * E + e] = static_cast<T>(s * (g - g_mean - xhat * gx_mean));
    }
  }
  for (int64_t e = 0; e < E; ++e) {
    if (dgamma != nullptr) dgamma[e] = static_cast<T>(dg[e]);
    if (dbeta != nullptr) dbeta[e] = static_cast<T>(db[e]);
  }
}

template void layer_norm_forward<float>(const float*, const float*, const float*, float*, float*,
                                        float*, int64_t, int64_t, double);
template void layer_norm_forward<double>(const double*, const double*, const double*, double*,
                                         double*, double*, int64_t, int64_t, double);
template void layer_norm_backward<float>(const float*, const float*, const float*, const float*,
                                         const float*, float*, float*, float*, int64_t, int64_t);
template void layer_norm_backward<double>(const double*, const double*, const double*,
                                          const double*, const double*, double*, double*, double*,
                                          int64_t, int64_t);

}  // namespace attn::ref
