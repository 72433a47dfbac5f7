"""The 1.5B's decode round at 1 and 2 rows (width 1) with PackedLinear as it is and with inputs of fewer rows than P
zero-padded to P rows; interleaved sweeps in one process, median ms; also: are the padded logits the unpadded ones?"""
import statistics, sys, torch
from benchmark.interface import resolve_local
from specactor_engine.model.runner import ModelRunner, load_hf_model
from specactor_engine.model import packed_linear as pl
from specactor_engine.policies.cost_profile import _timed_round
from specactor_engine.sampling import SamplingParams

torch.set_num_threads(2)
model, dtype = (sys.argv[2], sys.argv[3]) if len(sys.argv) > 3 else ("qwen2.5-coder-1.5b-instruct", "bfloat16")
runner = ModelRunner(load_hf_model(str(resolve_local(model, dtype)), dtype))
runner.allocate(4, 512)
orig = pl.PackedLinear.__call__
def padded(P):
    def call(self, x):
        m = x.numel() // x.shape[-1]
        if m >= P:
            return orig(self, x)
        flat = x.reshape(m, x.shape[-1]); pad = flat.new_zeros(P, x.shape[-1]); pad[:m] = flat
        y = orig(self, pad)[:m]
        return y.reshape(*x.shape[:-1], y.shape[-1])
    return call
params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0)
variants = {"as is": orig, "pad 3": padded(3), "pad 4": padded(4)}
times = {(v, r): [] for v in variants for r in (1, 2, 3, 4)}
g = torch.Generator().manual_seed(0)
for sweep in range(int(sys.argv[1])):
    for v, call in variants.items():
        pl.PackedLinear.__call__ = call
        for r in (1, 2, 3, 4):
            tok = torch.randint(1000, (r, 1), generator=g)
            times[(v, r)].append(_timed_round(runner, tok, torch.arange(r), torch.arange(r), torch.full((r,), 1), 256, params))
for v in variants:
    print(v, "  ".join(f"{r} rows {1000*statistics.median(times[(v, r)][1:]):.1f} ms" for r in (1, 2, 3, 4)))
# exactness: the padded 1-row logits vs the row's logits inside a 4-row forward
tok = torch.randint(1000, (4, 1), generator=g)
res = {}
for v, call in variants.items():
    pl.PackedLinear.__call__ = call
    runner.set_lengths(torch.arange(4), torch.full((4,), 256))
    one = runner.forward(tok[:1], torch.arange(1), torch.ones(1, dtype=torch.long)).clone()
    runner.set_lengths(torch.arange(4), torch.full((4,), 256))
    four = runner.forward(tok, torch.arange(4), torch.ones(4, dtype=torch.long)).clone()
    print(v, "1-row logits == row 0 of the 4-row forward:", torch.equal(one[0], four[0]), "max diff", (one[0].float() - four[0].float()).abs().max().item())
