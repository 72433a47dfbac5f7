"""Offline: would a per-position rule, the suffix drafter's draft where its match is deep (and the feature drafter
unsure), else the feature drafter's, beat the feature drafter alone? Lockstep over the `ar` outputs of a facts.json
(siblings at the same position; the suffix drafter's own matching, its depth and its first token's share recomputed).

    python bench/session53/suffix_rules.py bench/session51/D-paired/facts.json [feature-confidence.json]

feature-confidence.json: bench/session53/feature_conf.py's output (the feature drafter's drafted tokens' probabilities).
"""
import json, sys
import numpy as np
from collections import defaultdict
SEP = -1
MAXD, MINM, K = 24, 2, 4

def cont(corpus, context, k):
    longest = min(len(context), MAXD - 1)
    if longest < MINM: return [], 0, 0, 0
    ends = np.flatnonzero(corpus[:-1] == context[-1]); ends = ends[corpus[ends + 1] != SEP]
    matched = 1; best, bd = None, 0
    while matched < longest and len(ends):
        ends = ends[corpus[ends - matched] == context[-matched - 1]]; matched += 1
        if len(ends) and matched >= MINM: best, bd = ends, matched
    if best is None: return [], 0, 0, 0
    ends, depth, draft = best, bd, []
    occ = len(best); first_share = None
    while len(draft) < k and depth < MAXD:
        f = corpus[ends + 1]; ends, f = ends[f != SEP], f[f != SEP]
        if not len(f): break
        t, c = np.unique(f, return_counts=True); j = int(np.argmax(c))
        if first_share is None: first_share = c[j] / c.sum()
        draft.append(int(t[j])); ends, depth = ends[f == t[j]] + 1, depth + 1
    return draft, bd, occ, first_share or 0

d = json.load(open(sys.argv[1])); dr = d["drafters"]; seqs = d["sequences"]
F = dr["feature"]["accepted"]
groups = defaultdict(list)
for i, s in enumerate(seqs): groups[tuple(s["prompt_ids"])].append(i)
recs = []  # (feature acc, suffix acc, depth, occ, share, supplied)
for prompt, members in groups.items():
    L = max(len(seqs[i]["output_ids"]) for i in members)
    for p in range(1, L):
        # corpus: prompt, then every member's output so far (own included: its newest occurrence has no next token)
        parts = [np.array([SEP]), np.array(prompt), np.array([SEP])]
        for m in members:
            parts += [np.array(seqs[m]["output_ids"][:p], dtype=np.int64), np.array([SEP])]
        corpus = np.concatenate(parts).astype(np.int64)
        for i in members:
            out = seqs[i]["output_ids"]
            if p >= len(out): continue
            ctx = np.array(out[max(0, p - MAXD):p], dtype=np.int64)
            draft, depth, occ, share = cont(corpus, ctx, K)
            acc = 0
            for j, t in enumerate(draft):
                if p + j < len(out) and out[p + j] == t: acc += 1
                else: break
            recs.append((F[i][p], acc, depth, occ, share, len(draft)))
r = np.array(recs, dtype=float)
f, s, depth, occ, share, sup = r.T
print(sys.argv[1], "positions", len(r), "feature %.3f suffix %.3f oracle(f,s) %.3f" % (f.mean(), s.mean(), np.maximum(f, s).mean()))
for m in (4, 6, 8, 10, 12, 16):
    for sh in (0.0, 0.6, 0.8, 1.0):
        use = (depth >= m) & (share >= sh) & (sup >= 1)
        v = np.where(use, s, f).mean()
        print("  depth>=%2d share>=%.1f: use %.3f of positions, mean accepted %.3f (%+.1f%%)" % (m, sh, use.mean(), v, 100 * (v / f.mean() - 1)))

if len(sys.argv) > 2:
    fc = json.load(open(sys.argv[2]))
    conf, facc = fc["conf"], fc["acc"]
    # (sequence, position) in the order of `recs`
    order = []
    for prompt, members in groups.items():
        L = max(len(seqs[i]["output_ids"]) for i in members)
        for p in range(1, L):
            for i in members:
                if p < len(seqs[i]["output_ids"]): order.append((i, p))
    c1 = np.array([(conf[i][p][0] if conf[i][p] else 0.0) for i, p in order])
    cprod = np.array([(float(np.prod(conf[i][p][:2])) if conf[i][p] else 0.0) for i, p in order])
    fa = np.array([facc[i][p] for i, p in order], dtype=float)
    print("feature acc check: facts %.3f conf-run %.3f" % (f.mean(), fa.mean()))
    print("feature accepted by first-draft confidence bucket:")
    for lo, hi in ((0, .3), (.3, .5), (.5, .7), (.7, .9), (.9, 1.01)):
        m = (c1 >= lo) & (c1 < hi)
        print("   c1 in [%.1f,%.1f): share %.3f  feature %.2f  suffix %.2f  suffix(depth>=6) %.2f" % (lo, hi, m.mean(), fa[m].mean() if m.any() else 0, s[m].mean() if m.any() else 0, s[m & (depth >= 6)].mean() if (m & (depth >= 6)).any() else 0))
    for cth in (0.3, 0.5, 0.7, 0.9):
        for m in (2, 4, 6, 8):
            use = (c1 < cth) & (depth >= m) & (sup >= 1)
            v = np.where(use, s, fa).mean()
            print("  c1<%.1f depth>=%d: use %.3f, mean accepted %.3f (%+.1f%%)" % (cth, m, use.mean(), v, 100 * (v / fa.mean() - 1)))
