#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <vector>
#include "exp_kernels.cuh"

std::vector<torch::Tensor> run(torch::Tensor values, int64_t tiles, bool variant_b) {
    const int64_t n = values.numel(), blocks = (n + ZC_BLOCK_VALUES - 1) / ZC_BLOCK_VALUES;
    auto code_of = torch::empty({blocks, ZC_FIELDS}, values.options().dtype(torch::kUInt8));
    auto tables = torch::zeros({blocks * ZC_TABLE_BYTES}, values.options().dtype(torch::kUInt8));
    auto counts = torch::zeros({tiles}, values.options().dtype(torch::kInt64));
    auto sums = torch::zeros({blocks}, values.options().dtype(torch::kInt64));
    auto stream = c10::cuda::getCurrentCUDAStream();
    const uint16_t *v = reinterpret_cast<const uint16_t *>(values.data_ptr<int16_t>());
    if (variant_b)
        zc_tables_kernel_b<<<blocks, ZC_THREADS, 0, stream>>>(v, n, tiles, code_of.data_ptr<uint8_t>(),
            tables.data_ptr<uint8_t>(), counts.data_ptr<int64_t>(), sums.data_ptr<int64_t>());
    else
        zc_tables_kernel<<<blocks, ZC_THREADS, 0, stream>>>(v, n, tiles, code_of.data_ptr<uint8_t>(),
            tables.data_ptr<uint8_t>(), counts.data_ptr<int64_t>(), sums.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return {code_of, tables, counts, sums};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("run", &run, "tables kernel a or b"); }
