"""What a new row count costs oneDNN's packed fp32 linears (the path of traces B and C): the first call at a row
count creates its primitive, later calls reuse it from oneDNN's process-wide cache. SmolLM2-135M's shapes.

    python bench/session54/primitive_first_call.py
"""
import time, torch
torch.set_num_threads(2)
K, shapes = 576, [(576+2*192, "qkv"), (576, "o"), (2*1536, "gate_up"), (49152, "head")]
ws = {n: torch.ops.mkldnn._reorder_linear_weight(torch.randn(N, K), 128) for N, n in shapes}
ws_down = torch.ops.mkldnn._reorder_linear_weight(torch.randn(576, 1536), 128)
def call(w, M, k=K):
    x = torch.randn(M, k)
    t = time.perf_counter(); torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""); return time.perf_counter() - t
for M in [37, 53, 77, 101]:
    for n, w in list(ws.items()) + [("down", ws_down)]:
        kk = 1536 if n == "down" else K
        a = call(w, M, kk); b = call(w, M, kk); c = call(w, M, kk)
        print(M, n, "first %.2f ms, then %.2f %.2f" % (a*1e3, b*1e3, c*1e3))
