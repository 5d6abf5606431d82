#include "src/tools/planner/fit.h"

#include <algorithm>
#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace stepmesh::planner {

absl::StatusOr<LinearFit> FitLine(const std::vector<double>& x, const std::vector<double>& y,
                                  const std::string& what) {
  if (x.size() != y.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", x.size(), " x values but ", y.size(), " y values"));
  }
  const size_t n = x.size();
  if (n < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": need at least 2 samples to fit a line, have ", n));
  }
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(x[i]) || !std::isfinite(y[i])) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": sample ", i, " is not finite"));
    }
  }
  // Centred sums: stable when x is large (KV tokens run into the millions).
  double mx = 0, my = 0;
  for (size_t i = 0; i < n; ++i) mx += x[i], my += y[i];
  mx /= n;
  my /= n;
  double sxx = 0, sxy = 0, syy = 0;
  for (size_t i = 0; i < n; ++i) {
    const double dx = x[i] - mx, dy = y[i] - my;
    sxx += dx * dx;
    sxy += dx * dy;
    syy += dy * dy;
  }
  const auto [lo, hi] = std::minmax_element(x.begin(), x.end());
  if (!(sxx > 1e-12 * std::max(1.0, mx * mx) * n)) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": x does not vary (all ", n,
                                                   " samples at ", *lo,
                                                   "); calibrate from runs with different sizes"));
  }
  LinearFit fit;
  fit.n = n;
  fit.alpha = sxy / sxx;
  fit.beta = my - fit.alpha * mx;
  double ss_res = 0;
  for (size_t i = 0; i < n; ++i) {
    const double e = y[i] - fit.At(x[i]);
    ss_res += e * e;
  }
  fit.r2 = syy > 0 ? 1.0 - ss_res / syy : 1.0;
  fit.rmse = std::sqrt(ss_res / n);
  fit.x_min = *lo;
  fit.x_max = *hi;
  return fit;
}

}  // namespace stepmesh::planner
