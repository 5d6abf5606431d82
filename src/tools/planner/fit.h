#pragma once
// Ordinary least squares for the planner's linear latency models
// (t = alpha*x + beta), with the coefficient of determination.

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace stepmesh::planner {

struct LinearFit {
  double alpha = 0;     // slope
  double beta = 0;      // intercept
  double r2 = 0;        // 1 - SS_res / SS_tot (1 when every y is equal and fitted exactly)
  double rmse = 0;      // root mean square residual, in y's unit
  size_t n = 0;         // samples in the fit
  size_t rejected = 0;  // outliers (FitLineRobust): not in n, r2, rmse
  double x_min = 0, x_max = 0;
  double At(double x) const { return alpha * x + beta; }
};

// Fails (naming `what`) with fewer than two samples, mismatched lengths,
// non-finite values, or x that does not vary: then no slope can be told apart
// from the intercept.
absl::StatusOr<LinearFit> FitLine(const std::vector<double>& x, const std::vector<double>& y,
                                  const std::string& what);

// A least-absolute-deviations line (the conditional median), for measured
// stage times: on a shared machine they carry rare large delays (a thread
// woken late, a reply sent late) that pull an ordinary fit. Samples beyond 4
// robust standard deviations (1.4826 x the residuals' median absolute
// deviation) count as `rejected`; r2, rmse and n describe the others.
absl::StatusOr<LinearFit> FitLineRobust(const std::vector<double>& x, const std::vector<double>& y,
                                        const std::string& what);

}  // namespace stepmesh::planner
