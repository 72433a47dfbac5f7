"""ar and decoupled engines in one process, alternating: are decoupled's plain (solo) rounds slower, and does
skipping the 1-thread switch at the start of generate change that?"""
import sys, torch, yaml
from specactor_engine.config import SpecActorConfig, SamplingConfig
from specactor_engine.engine import Engine
from specactor_engine.types import Request


def main():
    torch.set_num_threads(2)
    dec_cfg = SpecActorConfig.model_validate(yaml.safe_load(open("configs/decoupled_qwen.yaml")))
    ar_cfg = dec_cfg.model_copy(update={"rollout": dec_cfg.rollout.model_copy(update={"mode": "ar"})})
    ar = Engine.from_config(ar_cfg)
    dec = Engine.from_config(dec_cfg)
    dec.workers.coordinator.wait_ready(120)
    reqs = [Request(request_id=f"r{i}", prompt=f"Count from {i} to 100 in words, one per line.") for i in range(4)]
    sp = SamplingConfig(n=1, max_new_tokens=80, temperature=1.0, ignore_eos=True)
    for e in (ar, dec):
        e.generate(reqs[:1], sp.model_copy(update={"max_new_tokens": 8}))
    vt = dec.verifier_threads

    def timed(tag, engine):
        r = engine.generate(reqs, sp)
        tl = r.stats.timeline
        d = sorted(b["t"] - a["t"] for a, b in zip(tl[5:], tl[6:]))
        print(tag, "median round ms", round(1000 * d[len(d) // 2], 1), "k", sorted({e["k"] for e in tl}), flush=True)

    for rep in range(int(sys.argv[1])):
        timed("ar", ar)
        dec.verifier_threads = vt
        timed("decoupled", dec)
        dec.verifier_threads = None  # generate no longer drops to 1 thread before the solo arm takes both
        timed("decoupled-no-switch", dec)


if __name__ == "__main__":
    main()
