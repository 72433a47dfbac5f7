"""Inclusive samples per function of the timed rollout (under Run.decode, the warm-up excluded) in two py-spy raw
profiles, largest differences first.

    python bench/session62/spy/compare.py A.raw B.raw
"""
import sys, collections, re
def load(path):
    incl = collections.Counter(); total = 0
    for line in open(path):
        stack, _, n = line.rstrip().rpartition(' ')
        n = int(n); frames = [re.sub(r':\d+\)$', ')', f) for f in stack.split(';')]
        if not any(f.startswith('Run.decode ') for f in frames) or any(f.startswith('_timed ') for f in frames):
            continue
        total += n
        for f in set(frames):
            incl[f] += n
    return incl, total
a, ta = load(sys.argv[1]); b, tb = load(sys.argv[2])
print('samples in Run.decode', ta, tb)
names = set(a) | set(b)
rows = sorted(names, key=lambda k: -(a[k] - b[k]))
for k in rows[:45]:
    print(f"{a[k]-b[k]:6d}  {a[k]:6d} {b[k]:6d}  {k}")
