"""Host work of the timed rollout in two py-spy raw profiles (`py-spy record -f raw -F`): samples per call path under
Run.decode, leaving out the verify forward, the feature drafter's drafting and prefills; the warm-up (`_timed`) excluded.

    python bench/session62/spy/host.py A.raw B.raw
"""
import sys, collections, re
def load(path):
    incl = collections.Counter(); total = 0
    for line in open(path):
        stack, _, n = line.rstrip().rpartition(' ')
        n = int(n); frames = [re.sub(r' \(.*\)$', '', f) for f in stack.split(';')]
        if 'Run.decode' not in frames or '_timed' in frames: continue
        if 'Verifier.verify' in frames or 'FeatureDrafter.propose' in frames or 'Run._prefill' in frames: continue
        total += n
        i = frames.index('Run.decode')
        sub = frames[i+1:]
        for depth in (1, 2, 3):
            if len(sub) >= depth:
                incl[' > '.join(sub[:depth])] += n
    return incl, total
a, ta = load(sys.argv[1]); b, tb = load(sys.argv[2])
print('host samples (not verify/feature drafting/prefill)', ta, tb)
for k in sorted(set(a)|set(b), key=lambda k: -(max(a[k], b[k]))):
    if max(a[k], b[k]) >= 8:
        print(f"{a[k]:5d} {b[k]:5d}  {k}")
