import time, torch, sys
from transformers import Qwen2Config, Qwen2ForCausalLM
from specactor_engine.model.feature_draft import FeatureDraftModel
from specactor_engine.training.feature_distill import FeatureDistiller
torch.manual_seed(0)
cfg = Qwen2Config(hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2,
                  num_hidden_layers=1, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=4096)
target = Qwen2ForCausalLM(cfg).float()
passes = int(sys.argv[1]) if len(sys.argv) > 1 else 1
vocab = torch.randperm(151936)[:1275]
pairs = [(list(range(100 + i, 220 + i)), list(range(1000 + i, 1230 + i))) for i in range(16)]
feats = [torch.randn(350, 1536, dtype=torch.float16) for _ in range(16)]
ds = {}
for name in ("fp32", "bf16"):
    m = FeatureDraftModel(target)
    ds[name] = FeatureDistiller(m, target, 3e-4, vocab, passes=passes)
times = {"fp32": [], "bf16": []}
for it in range(int(sys.argv[2]) if len(sys.argv) > 2 else 4):
    for name, d in ds.items():
        t = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=(name == "bf16")):
            r = d.step(pairs, feats, 4)
        times[name].append(time.perf_counter() - t)
        print(name, it, round(times[name][-1], 2), round(r["loss"], 3), flush=True)
for k, v in times.items():
    print(k, sorted(v)[len(v)//2])
