// Torch binding of the ZipCCL bfloat16 kernels (zipccl_kernels.cuh), JIT-built by
// ray_zep/collectives/cuda_kernels.py with torch.utils.cpp_extension.load.
//
// The host side (Python) allocates the chunk's static and dynamic parts and writes
// the header and the tile index; `tables` writes the block tables into the static
// part. These functions launch on the current stream. `code_of` is (blocks, 256)
// and `table8` (blocks, 8): one lookup per block of ZC_BLOCK_VALUES values.
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <vector>

#include "zipccl_kernels.cuh"

namespace {

int64_t tiles_of(int64_t n) { return (n + ZC_TILE_VALUES - 1) / ZC_TILE_VALUES; }

int64_t blocks_of(int64_t n) { return (n + ZC_BLOCK_VALUES - 1) / ZC_BLOCK_VALUES; }

void check(const torch::Tensor &t, torch::ScalarType type, const char *name) {
    TORCH_CHECK(t.is_cuda() && t.is_contiguous(), name, " must be a contiguous CUDA tensor");
    TORCH_CHECK(t.scalar_type() == type, name, " has the wrong dtype");
}

}  // namespace

std::vector<torch::Tensor> tables(torch::Tensor values, int64_t tiles, torch::Tensor table_bytes) {
    check(values, torch::kInt16, "values");
    check(table_bytes, torch::kUInt8, "table_bytes");
    const int64_t n = values.numel(), blocks = blocks_of(n);
    TORCH_CHECK(tiles == tiles_of(n), "tile count does not match the values");
    TORCH_CHECK(table_bytes.numel() == ZC_TABLE_BYTES * blocks, "8 table bytes per block expected");
    auto code_of = torch::empty({blocks, ZC_FIELDS}, values.options().dtype(torch::kUInt8));
    // every tile's count and every block's share are written by the kernel
    auto counts = torch::empty({tiles}, values.options().dtype(torch::kInt64));
    auto sums = torch::empty({blocks}, values.options().dtype(torch::kInt64));
    if (blocks > 0) {
        zc_tables_kernel<<<blocks, ZC_THREADS, 0, c10::cuda::getCurrentCUDAStream()>>>(
            reinterpret_cast<const uint16_t *>(values.data_ptr<int16_t>()), n, tiles,
            code_of.data_ptr<uint8_t>(), table_bytes.data_ptr<uint8_t>(),
            counts.data_ptr<int64_t>(), sums.data_ptr<int64_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    return {code_of, counts, sums};
}

void encode(torch::Tensor values, torch::Tensor code_of, torch::Tensor tile_index,
            torch::Tensor static_part, int64_t raw_offset, std::vector<int64_t> code_offsets,
            torch::Tensor dynamic_part) {
    check(values, torch::kInt16, "values");
    check(code_of, torch::kUInt8, "code_of");
    check(tile_index, torch::kInt32, "tile_index");
    check(static_part, torch::kUInt8, "static_part");
    check(dynamic_part, torch::kUInt8, "dynamic_part");
    TORCH_CHECK(code_offsets.size() == 3, "three code planes expected");
    const int64_t n = values.numel(), tiles = tiles_of(n);
    TORCH_CHECK(code_of.numel() == 256 * blocks_of(n), "one code lookup per block expected");
    if (tiles == 0) return;
    uint8_t *base = static_part.data_ptr<uint8_t>();
    zc_encode_kernel<<<tiles, ZC_THREADS, 0, c10::cuda::getCurrentCUDAStream()>>>(
        reinterpret_cast<const uint16_t *>(values.data_ptr<int16_t>()), n,
        code_of.data_ptr<uint8_t>(), tile_index.data_ptr<int32_t>(), base + raw_offset,
        base + code_offsets[0], base + code_offsets[1], base + code_offsets[2],
        dynamic_part.data_ptr<uint8_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void decode(torch::Tensor static_part, int64_t raw_offset, std::vector<int64_t> code_offsets,
            torch::Tensor tile_index, torch::Tensor dynamic_part, torch::Tensor table8,
            torch::Tensor out, torch::Tensor sums) {
    check(static_part, torch::kUInt8, "static_part");
    check(tile_index, torch::kInt32, "tile_index");
    check(dynamic_part, torch::kUInt8, "dynamic_part");
    check(table8, torch::kUInt8, "table8");
    check(out, torch::kInt16, "out");
    check(sums, torch::kInt64, "sums");
    TORCH_CHECK(code_offsets.size() == 3, "three code planes expected");
    const int64_t n = out.numel(), tiles = tiles_of(n);
    TORCH_CHECK(table8.numel() == 8 * blocks_of(n), "one table per block expected");
    TORCH_CHECK(sums.numel() == tiles, "one checksum share per tile expected");
    if (tiles == 0) return;
    const uint8_t *base = static_part.data_ptr<uint8_t>();
    zc_decode_kernel<<<tiles, ZC_THREADS, 0, c10::cuda::getCurrentCUDAStream()>>>(
        base + raw_offset, base + code_offsets[0], base + code_offsets[1], base + code_offsets[2],
        tile_index.data_ptr<int32_t>(), dynamic_part.data_ptr<uint8_t>(),
        table8.data_ptr<uint8_t>(), n, reinterpret_cast<uint16_t *>(out.data_ptr<int16_t>()),
        sums.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("tables", &tables, "block tables, code lookups, escapes per tile, checksum shares");
    m.def("encode", &encode, "write the planes and escapes of a bfloat16 chunk");
    m.def("decode", &decode, "decode a bfloat16 chunk and its checksum shares per tile");
}
