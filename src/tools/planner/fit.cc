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

absl::StatusOr<LinearFit> FitLineRobust(const std::vector<double>& x, const std::vector<double>& y,
                                        const std::string& what) {
  absl::StatusOr<LinearFit> start = FitLine(x, y, what);
  if (!start.ok()) return start;
  // Least absolute deviations by iteratively reweighted least squares: the
  // line through the conditional median, which one-sided delays barely move.
  const size_t n = x.size();
  double alpha = start->alpha, beta = start->beta;
  double scale = 0;
  for (double v : y) scale = std::max(scale, std::abs(v));
  const double eps = 1e-9 * std::max(1.0, scale);
  for (int iter = 0; iter < 200; ++iter) {
    double sw = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
    for (size_t i = 0; i < n; ++i) {
      const double w = 1.0 / std::max(std::abs(y[i] - (alpha * x[i] + beta)), eps);
      sw += w, sx += w * x[i], sy += w * y[i], sxx += w * x[i] * x[i], sxy += w * x[i] * y[i];
    }
    const double det = sw * sxx - sx * sx;
    if (!(std::abs(det) > 0)) break;
    const double a = (sw * sxy - sx * sy) / det;
    const double b = (sy - a * sx) / sw;
    const bool settled = std::abs(a - alpha) <= 1e-10 * std::max(std::abs(a), 1e-30) &&
                         std::abs(b - beta) <= 1e-10 * std::max(std::abs(b), 1.0);
    alpha = a, beta = b;
    if (settled) break;
  }
  // Samples beyond 4 robust standard deviations of the residuals are the
  // outliers; R^2 and rmse describe the others.
  std::vector<double> residuals(n), deviation(n);
  for (size_t i = 0; i < n; ++i) residuals[i] = y[i] - (alpha * x[i] + beta);
  auto median = [](std::vector<double> v) {
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    return v[v.size() / 2];
  };
  const double center = median(residuals);
  for (size_t i = 0; i < n; ++i) deviation[i] = std::abs(residuals[i] - center);
  // (A perfect fit has no spread: only numerical noise is tolerated then.)
  const double limit = std::max(4 * 1.4826 * median(deviation), 1e-9 * std::max(1.0, scale));
  std::vector<double> kx, ky;
  for (size_t i = 0; i < n; ++i) {
    if (deviation[i] <= limit) kx.push_back(x[i]), ky.push_back(y[i]);
  }
  LinearFit fit = *start;
  fit.alpha = alpha;
  fit.beta = beta;
  fit.rejected = n - kx.size();
  fit.n = kx.size();
  double my = 0;
  for (double v : ky) my += v;
  my /= std::max<size_t>(1, ky.size());
  double ss_res = 0, ss_tot = 0;
  for (size_t i = 0; i < kx.size(); ++i) {
    const double e = ky[i] - fit.At(kx[i]);
    ss_res += e * e;
    ss_tot += (ky[i] - my) * (ky[i] - my);
  }
  fit.r2 = ss_tot > 0 ? 1.0 - ss_res / ss_tot : 1.0;
  fit.rmse = kx.empty() ? 0 : std::sqrt(ss_res / kx.size());
  return fit;
}

}  // namespace stepmesh::planner
