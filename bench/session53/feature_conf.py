"""The feature drafter in lockstep over a run directory's `ar` outputs (as `specactor simulate` gathers its facts),
asked for its drafts' confidence: per sequence and output position, the drafted tokens' probabilities under the
drafter and how many were accepted.

    PYTHONPATH=. .venv/bin/python bench/session53/feature_conf.py bench/session51/D-paired /tmp/D-featconf.json
"""
import json, sys, time
from pathlib import Path
import torch
import benchmark.simulate.facts as F
from specactor_engine.policies.shadow import matched_prefix

OUT = {}

def lockstep(engine, sequences, max_k, params, progress):
    from specactor_engine.drafters import DraftRequest
    n = len(sequences)
    state, slots, max_len = F.lockstep_state(engine, sequences, max_k)
    drafters = engine.drafters
    F._teacher_forced(engine.runner, sequences)
    for d in drafters:
        d.allocate(n, max_len); d.add_rows(state, slots)
    first = torch.tensor([s.output_ids[0] for s in sequences])
    state.append(slots, first[:, None], torch.ones(n, dtype=torch.long))
    for d in drafters: d.observe_commit(state, slots)
    lengths = torch.tensor([len(s.output_ids) for s in sequences])
    outputs = [s.output_ids for s in sequences]
    conf = [[None] * len(s.output_ids) for s in sequences]
    acc = [[0] * len(s.output_ids) for s in sequences]
    position = 1
    while True:
        active = slots[position < lengths]
        if len(active) == 0: break
        caps = (lengths[active] - position - 1).clamp(0, max_k)
        request = DraftRequest(active, caps, params, coupled_noise=True, confidence=True)
        for d in drafters:
            proposal = d.propose(state, request)
            tokens, supplied = proposal.token_ids.tolist(), proposal.num_tokens.tolist()
            c = proposal.confidence
            for row, i in enumerate(active.tolist()):
                got = min(int(supplied[row]), int(caps[row]))
                acc[i][position] = matched_prefix(tokens[row][:got], outputs[i][position: position + got])
                conf[i][position] = [round(float(x), 4) for x in c[row][:got]] if c is not None else None
        nxt = torch.tensor([outputs[i][position] for i in active.tolist()])
        state.append(active, nxt[:, None], torch.ones(len(active), dtype=torch.long))
        for d in drafters: d.observe_commit(state, active)
        position += 1
    OUT["conf"], OUT["acc"] = conf, acc
    raise SystemExit(0)

F._lockstep = lockstep
try:
    F.gather(Path(sys.argv[1]), ["feature"], progress=print)
except SystemExit:
    pass
json.dump(OUT, open(sys.argv[2], "w"))
print("wrote", sys.argv[2])
