// bf16 matrix products on CPUs whose bf16 GEMM is slow.
//
// LibTorch 2.11 multiplies CPU bf16 matrices through oneDNN where the CPU has
// AVX-512 (BW, VL, DQ); without it (AVX2 machines such as AMD EPYC Milan) it
// falls back to loops that ran at 1-20 GFLOP/s on the 2-core machine where
// fp32 GEMMs ran at 140 (bench/README.md): a bf16 llama-small step took 35 s
// against 0.9 s in fp32, in autotp and in PyTorch autocast alike. There the
// products below run as fp32 GEMMs on bf16 operands widened in slices, and
// round the result once to bf16: what a bf16 GEMM computes (fp32
// accumulation, one rounding), in another summation order.
//
// AUTOTP_CPU_BF16_GEMM picks the path: auto (the default: widened without
// AVX-512), native (LibTorch's bf16 GEMM) or fp32 (always widened).
#pragma once
#include <torch/torch.h>

namespace autotp {

enum class CpuBf16Gemm { kNative, kWidened };

// The path for a value of AUTOTP_CPU_BF16_GEMM (null: auto) on a CPU with or without
// AVX-512; any other value is a user error naming the allowed ones.
CpuBf16Gemm parse_cpu_bf16_gemm(const char* value, bool cpu_has_avx512);

// The path for this process (read once).
CpuBf16Gemm cpu_bf16_gemm();

// Whether a product of these operands takes the widened path: both bf16 on the CPU
// and cpu_bf16_gemm() is kWidened.
bool widens_bf16(const torch::Tensor& a, const torch::Tensor& b);

// a @ b for a [..., K] and b [K, N] (or batched b, widened without slices),
// outside autograd (for custom Functions' own forwards and backwards, and the
// simulator's calibration): torch::matmul unless widens_bf16(a, b).
torch::Tensor matmul_nograd(const torch::Tensor& a, const torch::Tensor& b);

// x @ w^T (+ bias) for x [..., K] and w [N, K], with autograd: F::linear unless
// widens_bf16(x, w); then a Function that keeps the bf16 x and w (what the
// engine's memory model counts) and widens again in the backward.
torch::Tensor linear_product(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& bias = {});

// The widened forms whatever the CPU, for bf16 operands (tests compare them with
// LibTorch's bf16 products): a @ b without autograd, and x @ w^T with it.
torch::Tensor widened_bf16_matmul(const torch::Tensor& a, const torch::Tensor& b);
torch::Tensor widened_bf16_linear(const torch::Tensor& x, const torch::Tensor& w);

}  // namespace autotp
