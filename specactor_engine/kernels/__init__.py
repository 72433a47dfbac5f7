"""Fused kernels, each checked against its pure-torch reference (tests/engine/kernels).

gumbel_argmax: position-keyed Gumbel-max sampling in one pass, compiled by TorchInductor (C++/OpenMP
on CPU, Triton on CUDA); bit for bit equal to the reference.
paged_attention: decode/verify attention that reads each row's KV slot in place (C++, built on first
use; torch's attention where it cannot be built).
"""
