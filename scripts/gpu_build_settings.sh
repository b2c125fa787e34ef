# The GPU check's build, for scripts/gpu_check.sh and scripts/gpu_prebuild.sh to share (sourced by
# both): its CMake settings beside the folders, its targets and the programs they make, and how
# both find nvcc and read a cuDNN version. Programs prebuilt with these settings are the programs
# the check would build; gpu_prebuild.sh writes them into its manifest, and the check refuses an
# archive whose settings are not its own.
GPU_CMAKE_SETTINGS=(-DCMAKE_BUILD_TYPE=Release -DMB_CUDA=ON -DMB_BUILD_BENCHMARKS=ON -DMB_NATIVE=OFF -DMB_MPI=OFF)
GPU_TARGETS=(microbatch_cli bench_gpt2_cuda bench_attention_cuda bench_kernels_cuda tests_core tests_train)
GPU_PROGRAMS=(microbatch bench_gpt2_cuda bench_attention_cuda bench_kernels_cuda tests_core tests_train)
# One line naming all three, as the manifest records it.
gpu_build_settings_line() { echo "${GPU_CMAKE_SETTINGS[*]}; targets ${GPU_TARGETS[*]}"; }

# Sets NVCC (on PATH, else /usr/local/cuda/bin/nvcc, else empty) and NVCC_VERSION ("13.0", or empty).
find_nvcc() {
  NVCC="$(command -v nvcc || true)"
  [[ -z "$NVCC" && -x /usr/local/cuda/bin/nvcc ]] && NVCC=/usr/local/cuda/bin/nvcc
  NVCC_VERSION=""
  [[ -n "$NVCC" ]] && NVCC_VERSION="$("$NVCC" --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p')"
  return 0
}
# cudnn_version.h: its MAJOR.MINOR.PATCHLEVEL.
cudnn_version() {
  awk '/#define CUDNN_(MAJOR|MINOR|PATCHLEVEL) / { v[$2] = $3 }
       END { print v["CUDNN_MAJOR"] "." v["CUDNN_MINOR"] "." v["CUDNN_PATCHLEVEL"] }' "$1"
}
