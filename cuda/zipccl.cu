// Torch binding of the ZipCCL bfloat16 kernels (zipccl_kernels.cuh), JIT-built by
// ray_zep/collectives/cuda_kernels.py with torch.utils.cpp_extension.load.
//
// `encode` writes one chunk into a static part and a dynamic room that the caller
// allocated (torch.empty: the kernels write every byte the format defines), `decode`
// decodes one chunk into `out` and its verdict into `status` (one int64). Each is two
// launches on the current stream; neither waits for the device nor copies to or from
// the host. Their scratch (code lookups, tile statuses, checksum shares) comes from
// torch's caching allocator, which reuses it only after this stream's kernels.
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include "zipccl_kernels.cuh"

namespace {

void check(const torch::Tensor &t, torch::ScalarType type, const char *name) {
    TORCH_CHECK(t.is_cuda() && t.is_contiguous(), name, " must be a contiguous CUDA tensor");
    TORCH_CHECK(t.scalar_type() == type, name, " has the wrong dtype");
}

// The header's 32-bit checksum and 64-bit escape count are written as words.
void check_aligned(const torch::Tensor &chunk) {
    TORCH_CHECK(reinterpret_cast<uintptr_t>(chunk.data_ptr()) % 8 == 0,
                "the static part must start on an 8-byte boundary");
}

}  // namespace

void encode(torch::Tensor values, torch::Tensor static_part, torch::Tensor dynamic_room) {
    check(values, torch::kInt16, "values");
    check(static_part, torch::kUInt8, "static_part");
    check(dynamic_room, torch::kUInt8, "dynamic_room");
    check_aligned(static_part);
    const ZcLayout l = zc_layout(values.numel());
    TORCH_CHECK(l.n < (1LL << 31), "a chunk holds fewer than 2^31 values");
    TORCH_CHECK(static_part.numel() == l.static_bytes, "static part of the wrong size");
    TORCH_CHECK(dynamic_room.numel() >= zc_room_bytes(l.n), "dynamic room too small");
    auto bytes = values.options().dtype(torch::kUInt8), words = values.options().dtype(torch::kInt64);
    auto code_of = torch::empty({l.blocks, ZC_FIELDS}, bytes);
    auto status = torch::empty({l.tiles}, words);  // every entry written by zc_tables_kernel
    auto sums = torch::empty({l.blocks}, words);
    const auto stream = c10::cuda::getCurrentCUDAStream();
    const auto *v = reinterpret_cast<const uint16_t *>(values.data_ptr<int16_t>());
    auto *tiles = reinterpret_cast<unsigned long long *>(status.data_ptr<int64_t>());
    uint8_t *chunk = static_part.data_ptr<uint8_t>();
    zc_tables_kernel<<<l.blocks > 0 ? l.blocks : 1, ZC_THREADS, 0, stream>>>(
        v, l, chunk, code_of.data_ptr<uint8_t>(), tiles, sums.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (l.tiles == 0) return;
    zc_encode_kernel<<<l.tiles, ZC_THREADS, 0, stream>>>(
        v, l, code_of.data_ptr<uint8_t>(), sums.data_ptr<int64_t>(), tiles, chunk,
        dynamic_room.data_ptr<uint8_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void decode(torch::Tensor static_part, torch::Tensor dynamic_part, torch::Tensor out,
            torch::Tensor status) {
    check(static_part, torch::kUInt8, "static_part");
    check(dynamic_part, torch::kUInt8, "dynamic_part");
    check(out, torch::kInt16, "out");
    check(status, torch::kInt64, "status");
    TORCH_CHECK(status.numel() == 1, "one status word per chunk");
    const ZcLayout l = zc_layout(out.numel());
    TORCH_CHECK(static_part.numel() >= l.static_bytes, "static part shorter than its layout");
    auto shares = torch::empty({l.tiles}, out.options().dtype(torch::kInt64));  // all written
    auto *tile_shares = reinterpret_cast<unsigned long long *>(shares.data_ptr<int64_t>());
    const auto stream = c10::cuda::getCurrentCUDAStream();
    const uint8_t *chunk = static_part.data_ptr<uint8_t>();
    if (l.tiles > 0) {
        zc_decode_kernel<<<l.tiles, ZC_THREADS, 0, stream>>>(
            chunk, l, dynamic_part.data_ptr<uint8_t>(), dynamic_part.numel(),
            reinterpret_cast<uint16_t *>(out.data_ptr<int16_t>()), tile_shares);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    zc_check_kernel<<<1, ZC_THREADS, 0, stream>>>(chunk, l.n, dynamic_part.numel(), tile_shares,
                                                  l.tiles, status.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("encode", &encode, "write a bfloat16 chunk: static part and dynamic room (2 launches)");
    m.def("decode", &decode, "decode a bfloat16 chunk and write its verdict (2 launches)");
}
