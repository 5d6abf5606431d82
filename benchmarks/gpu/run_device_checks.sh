#!/usr/bin/env bash
# Runs on a lent GPU machine, from the repository root, every GPU check of
# issues 3, 5, 16, 19, 20, 28 and 31 out of .device-bundle/ (made here by scripts/device-bundle.sh):
#   cuda_gpu_issue16 the CUDA backend's hazards on the device (issue 16): a
#                    blocking application stream waiting on the reply while the
#                    send thread copies (10 s deadline), a device fault failing
#                    a copy-engine ready event, no context on device 0 when
#                    using device 1 (skipped with one GPU), both sides' arrival
#                    waits inside captured graphs replayed 100 times
#   cuda_gpu_tests   the rest: allocation, both ready-event modes, stream waits on
#                    host flags, the wait kernel in a captured graph, 1A1F over
#                    TCP with device tensors
#   cuda_latency     record -> send thread sees it (both modes); flag -> stream
#                    resumes (memop, kernel, wait-next); Backend::Copy vs cudaMemcpy
#   model_gpu_tests  every model kernel against the CPU at full width, and the
#                    timing table (decode attention vs HBM, expert GEMMs vs cuBLAS)
#   step5_gpu_tests  the Step-5 kernels (indexer scores, top-k block selection,
#                    sparse decode attention) against the CPU, full and tiny widths
#   afd_gate_c       the Step-3 example disaggregated with its CUDA kernels
#                    (--backend cuda: the "cuda" engine), 1A1F at full width on
#                    this one GPU, attention and FFN processes sharing it; Gate C
#                    against the fp32 CPU reference (bounded, reference fed the
#                    run's tokens) and the report's tokens/s
#   afd_paper_mb     the same at the paper's 128 tokens per micro-batch in decode
#                    (384 requests, 3 micro-batches): tokens/s, no reference
#   issue 31 (ready for the first real NIC and GPU):
#   cuda_gpu_full    the whole cuda_gpu_tests in one run; its log must show
#                    "ExportDmabuf returned fd" (checked: dmabuf_fd)
#   cuda_gpu_conn2   the same under CUDA_DEVICE_MAX_CONNECTIONS=2 (streams share
#   cuda_gpu_conn1   hardware queues; the backend must switch to wait kernels)
#                    and =1 (one queue, Megatron's setting)
#   cuda_probe       GPUDirect write ordering, flush options, dma-buf and memop
#                    support, cuMemGetHandleForAddressRange on cudaMalloc and on
#                    cuMemCreate mappings (expandable_segments), with and
#                    without gpuDirectRDMACapable
#   doctor           stepmesh_doctor --no-rdma (no NIC on the lent machine): the
#                    CUDA attributes as an operator sees them
#   cuda_latency_31  cuda_latency again, beside the probe's numbers
#   issue 28:
#   cuda_graph_trigger one captured CUDA graph [copy in, go increment, wait
#                    done >= go, copy out] replayed 100 times, a stepmesh::Trigger
#                    posting once per replay; bytes checked each replay
#   python_module    the Python package built for the device's python3 (CPython
#                    3.12, torch 2.11) by build_python_module.sh out of the bundle
#   vllm_cuda        the vLLM connector's GPU tests (python/tests/test_vllm_connector.py
#                    -k cuda): the contract with CUDA tensors on backend=cuda, and one
#                    torch.cuda.graph capture of the step's send/receive ops replayed
#                    100 times (eager and replay step times printed: "step_us")
#   gpu_streams      python/tests/gpu_streams.py: the stream= paths with torch CUDA tensors
#   vllm_torch2      the rest of test_vllm_connector.py on torch 2.11 (custom ops,
#                    fake implementations, cpu_mock graph mode; CI has torch 1.13)
# Logs go to $OUT (the device tool brings them back) or .device-bundle/out.
# Each step has its own time limit; one failing does not stop the others.
#
# The limits add up to ~2920 s, more than one device call (600 s) and one
# session's device time (900 s with the start), so the checks come in parts,
# each under 600 s of limits; run the most important first:
#   run_device_checks.sh backend   cuda_gpu_issue16, cuda_gpu_tests, cuda_latency,
#                                  step5_gpu_tests          (limits 500 s)
#   run_device_checks.sh model     model_gpu_tests, afd_paper_mb (600 s)
#   run_device_checks.sh gate-c    afd_gate_c                (420 s)
#   run_device_checks.sh issue31   cuda_gpu_full, cuda_gpu_conn2, cuda_gpu_conn1,
#                                  cuda_probe, doctor, cuda_latency_31 (530 s)
#   run_device_checks.sh graph     cuda_graph_trigger        (60 s)
#   run_device_checks.sh python    python_module, vllm_cuda, gpu_streams (540 s)
#   run_device_checks.sh torch2    python_module, vllm_torch2 (420 s)
#   run_device_checks.sh all       everything (default; only with a long lease)
set -uo pipefail
part=${1:-all}
case $part in
  all | backend | model | gate-c | issue31 | graph | python | torch2) ;;
  *)
    echo "run_device_checks: unknown part '$part'" \
      "(all|backend|model|gate-c|issue31|graph|python|torch2)" >&2
    exit 2
    ;;
esac
want() { [[ $part == all || $part == "$1" ]]; }
cd "$(dirname "$0")/../.."
bundle=.device-bundle
out=${OUT:-$bundle/out}
mkdir -p "$out"
if [[ ! -x $bundle/bin/cuda_gpu_tests ]]; then
  echo "run_device_checks: no $bundle; run scripts/device-bundle.sh first and carry it" >&2
  exit 2
fi
own_ld_path=${LD_LIBRARY_PATH:-}  # the machine's: for python3 and torch
export LD_LIBRARY_PATH="$PWD/$bundle/lib:/usr/local/cuda/lib64:/usr/local/cuda/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
  nvcc --version 2>/dev/null | tail -1
} > "$out/machine.txt" 2>&1
cat "$out/machine.txt"

summary=()
step() {  # name, seconds, command...
  local name=$1 seconds=$2
  shift 2
  echo "== $name"
  timeout "$seconds" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  tail -n 40 "$out/$name.log"
  summary+=("$name: exit $rc")
}
# CUDA backend (issue 16 first, so its results come back even if a later step hangs).
if want backend; then
  step cuda_gpu_issue16 100 "$bundle/bin/cuda_gpu_tests" "[issue16]" --durations yes
  step cuda_gpu_tests 100 "$bundle/bin/cuda_gpu_tests" "~[issue16]" --durations yes
  step cuda_latency 60 "$bundle/bin/cuda_latency" 2000 0
  if [[ -x $bundle/bin/step5_gpu_tests ]]; then
    step step5_gpu_tests 240 "$bundle/bin/step5_gpu_tests"
  else
    summary+=("step5_gpu_tests: not in the bundle (rebuild it with scripts/device-bundle.sh)")
  fi
fi
# Issue 31: the full suite once, then under shared hardware queues; the
# attribute probe and the doctor; cuda_latency beside them.
if want issue31; then
  step cuda_gpu_full 150 "$bundle/bin/cuda_gpu_tests" --durations yes
  if grep -q "ExportDmabuf returned fd" "$out/cuda_gpu_full.log"; then
    summary+=("dmabuf_fd: exit 0")
  else
    summary+=("dmabuf_fd: exit 1 (no 'ExportDmabuf returned fd' in cuda_gpu_full.log)")
  fi
  step cuda_gpu_conn2 130 env CUDA_DEVICE_MAX_CONNECTIONS=2 "$bundle/bin/cuda_gpu_tests" \
    --durations yes
  step cuda_gpu_conn1 130 env CUDA_DEVICE_MAX_CONNECTIONS=1 "$bundle/bin/cuda_gpu_tests" \
    --durations yes
  step cuda_probe 30 "$bundle/bin/cuda_probe" 0
  step doctor 30 "$bundle/bin/stepmesh_doctor" --no-rdma
  step cuda_latency_31 60 "$bundle/bin/cuda_latency" 2000 0
fi
if want graph; then
  if [[ -x $bundle/bin/cuda_graph_trigger_gpu_test ]]; then
    step cuda_graph_trigger 60 "$bundle/bin/cuda_graph_trigger_gpu_test" --durations yes
  else
    summary+=("cuda_graph_trigger: not in the bundle (rebuild it with scripts/device-bundle.sh)")
  fi
fi
# Issue 28: the vLLM connector on the device's own python3 (torch 2.11), with
# the package built there (a module built here is for Debian's CPython 3.11).
if want python || want torch2; then
  step python_module 150 benchmarks/gpu/build_python_module.sh python3
  site=$PWD/$bundle/python/site
  # The machine's library path (the module finds the carried libraries by its
  # RPATH; the bundle's first would shadow the CUDA libraries torch brings), and
  # one BLAS / OpenMP thread: fork_runner.py refuses to fork a process with
  # threads, and pip's numpy starts OpenBLAS's pool at import.
  pyenv=(env "LD_LIBRARY_PATH=$own_ld_path" "PYTHONPATH=$site" PYTHONDONTWRITEBYTECODE=1
    PYTHONUNBUFFERED=1 STEPMESH_AUTH=off OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
    MKL_NUM_THREADS=1)
  pytest=(python3 -m pytest -q -s -p no:cacheprovider python/tests/test_vllm_connector.py)
  if [[ -d $site/stepmesh ]] && ls "$site"/stepmesh/_stepmesh*.so > /dev/null 2>&1; then
    if want python; then
      # Longer than the four tests' own deadlines (2 x 60 s, 2 x 90 s), so a hung
      # run's peers are reaped and their output comes back.
      step vllm_cuda 330 "${pyenv[@]}" "${pytest[@]}" -k cuda
      step gpu_streams 60 "${pyenv[@]}" python3 python/tests/gpu_streams.py
    fi
    want torch2 && step vllm_torch2 270 "${pyenv[@]}" "${pytest[@]}" -k "not cuda"
  else
    summary+=("vllm_cuda, gpu_streams, vllm_torch2: not run (python_module failed)")
  fi
fi
want model && step model_gpu_tests 300 "$bundle/bin/model_gpu_tests"
# The CPU reference of full width needs ~56 GB of host memory and a few
# minutes; the run itself seconds. Configs are found from the repository root.
want gate-c && step afd_gate_c 420 "$bundle/bin/afd_launch" --config full --attention 1 --ffn 1 \
  --requests 3 --prompt-len 16 --decode-steps 4 --micro-batches 3 --backend cuda \
  --transport tcp --timeout-ms 120000 --deadline-s 400 --progress-s 30
want model && step afd_paper_mb 300 "$bundle/bin/afd_launch" --config full --attention 1 --ffn 1 \
  --requests 384 --prompt-len 2 --decode-steps 8 --micro-batches 3 --backend cuda \
  --transport tcp --timeout-ms 120000 --deadline-s 280 --no-reference --progress-s 30
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
! grep -qv 'exit 0$' "$out/summary.txt"
