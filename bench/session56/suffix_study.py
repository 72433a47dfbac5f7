"""Offline: the suffix drafter's drafts over a trace's `ar` outputs, and how often each kind is accepted.

Usage (repository root): python bench/session56/suffix_study.py TRACE RUN.json [HISTORY_RUN.json]
RUN.json: a benchmark run of `ar` (its sequences' token ids); HISTORY_RUN.json: the earlier rollout the trace's
history drafters know (C: B's). Every row advances one token a round (all of B's and C's 128 rows start together),
so at position t a group's corpus is its prompt, its history, and each sibling's output up to t (all of it once
finished), as the engine's `SuffixDrafter.corpus` holds it then. A draft's first token is accepted when it is the
token `ar` emitted there (position-keyed sampling: speculation emits what plain decoding does).
`cont`/`follow` are `drafters/suffix.py`'s `suffix_continuation`/`_follow`, instrumented to return each drafted
token's count, its path's occurrences and the match depth. Saves the records for grid.py.
"""
import json, sys, collections
import numpy as np
from transformers import AutoTokenizer
sys.path.insert(0, '.')
from benchmark.traces import get_trace, trace_items
from tasks.prompts import build_prompt
from specactor_engine.drafters.suffix import SEPARATOR

tok = AutoTokenizer.from_pretrained('.cache/specactor/models/smollm2-135m-instruct-float32')
def prompt_ids(q):
    text = tok.apply_chat_template(build_prompt(q), tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)['input_ids']

def load(path):
    d = json.load(open(path))
    return {(s['id'], s['sample']): s['token_ids'] for s in d['sequences']}

def follow(corpus, ends, depth, k, max_depth):
    out = []
    while len(out) < k and depth < max_depth:
        f = corpus[ends + 1]
        keep = f != SEPARATOR
        ends, f = ends[keep], f[keep]
        if not len(f): break
        toks, counts = np.unique(f, return_counts=True)
        i = int(np.argmax(counts))
        out.append((int(toks[i]), int(counts[i]), int(counts.sum()), depth))
        ends, depth = ends[f == toks[i]] + 1, depth + 1
    return out

def cont(corpus, context, k, min_match=2, max_depth=24):
    longest = min(len(context), max_depth - 1)
    if longest < min_match: return []
    ends = np.flatnonzero(corpus[:-1] == context[-1]); ends = ends[corpus[ends + 1] != SEPARATOR]
    matched = 1; best, bd = (None, 0)
    while matched < longest and len(ends):
        ends = ends[corpus[ends - matched] == context[-matched - 1]]; matched += 1
        if len(ends) and matched >= min_match: best, bd = ends, matched
    if best is None: return []
    return follow(corpus, best, bd, k, max_depth)

trace = sys.argv[1]; cur = load(sys.argv[2]); hist = load(sys.argv[3]) if len(sys.argv) > 3 else {}
items = {it['id']: it for it in trace_items(get_trace(trace))}
groups = collections.defaultdict(list)
for sid in cur: groups[sid[0]].append(sid)
K = 4
rec = []  # (ratio, count, total, depth, accepted_first, chain_accepted)
positions = 0
for g, sids in groups.items():
    item = items[sids[0][0]]
    p = prompt_ids(item['question'])
    past = [hist[h] for h in hist if h[0] == g]
    L = max(len(cur[s]) for s in sids)
    for t in range(1, L):
        for s in sids:
            out = cur[s]
            if t >= len(out): continue
            positions += 1
            parts = [np.array([SEPARATOR]), np.array(p), np.array([SEPARATOR])]
            for h in past: parts += [np.array(h), np.array([SEPARATOR])]
            for o in sids:  # siblings in flight (lockstep: up to t) or finished
                parts += [np.array(cur[o][:t] if len(cur[o]) > t else cur[o]), np.array([SEPARATOR])]
            corpus = np.concatenate(parts).astype(np.int64)
            ctx = np.array(out[max(0, t - 24):t])
            d = cont(corpus, ctx, K)
            if not d: continue
            acc = 0
            for j, (tk, c, n, dep) in enumerate(d):
                if t + j < len(out) and out[t + j] == tk: acc += 1
                else: break
            tk, c, n, dep = d[0]
            rec.append((c / n, c, n, dep, int(acc >= 1), acc, len(d), [x[1] / x[2] for x in d]))
print(trace, 'positions', positions, 'drafted', len(rec), 'first acc', np.mean([r[4] for r in rec]))
import pickle; pickle.dump(rec, open(f'/tmp/suffix_study_{trace}.pkl', 'wb'))
for lo, hi in [(0, .5), (.5, .7), (.7, .9), (.9, 1.01)]:
    sel = [r for r in rec if lo <= r[0] < hi]
    if sel: print(f'ratio [{lo},{hi}) n={len(sel)} ({len(sel)/positions:.3f} of positions) first acc {np.mean([r[4] for r in sel]):.3f} mean acc len {np.mean([r[5] for r in sel]):.2f}')
for lo, hi in [(1, 2), (2, 3), (3, 5), (5, 9), (9, 1000)]:
    sel = [r for r in rec if lo <= r[2] < hi]
    if sel: print(f'occurrences [{lo},{hi}) n={len(sel)} first acc {np.mean([r[4] for r in sel]):.3f}')
for lo, hi in [(2, 4), (4, 8), (8, 16), (16, 25)]:
    sel = [r for r in rec if lo <= r[3] < hi]
    if sel: print(f'depth [{lo},{hi}) n={len(sel)} first acc {np.mean([r[4] for r in sel]):.3f}')
