"""Triton kernels, each checked against its pure-torch reference: placeholder, none yet."""
