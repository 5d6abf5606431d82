#pragma once
// The whole public API.

#include "stepmesh/backend.h"
#include "stepmesh/cuda.h"
#include "stepmesh/handle.h"
#include "stepmesh/options.h"
#include "stepmesh/participant.h"
#include "stepmesh/scheduler.h"
#include "stepmesh/server.h"
#include "stepmesh/stats.h"
#include "stepmesh/status.h"
#include "stepmesh/tensor.h"
#include "stepmesh/trace.h"
#include "stepmesh/types.h"
#include "stepmesh/worker.h"
