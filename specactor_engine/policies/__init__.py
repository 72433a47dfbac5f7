"""Speculation policies: pure decisions over live statistics and measured costs.

`verify_length` (how many draft tokens to verify this round), `cost_profile` (the verify-cost table it
reads), `selector` (Fastest-of-N: which draft method per request), `shadow` (scoring drafts that were
not verified, to keep those statistics fresh).
"""
