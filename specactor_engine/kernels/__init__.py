"""Fused kernels, each checked bit for bit against its pure-torch reference (tests/kernels).

gumbel_argmax: position-keyed Gumbel-max sampling in one pass, compiled by TorchInductor (C++/OpenMP
on CPU, Triton on CUDA).
"""
