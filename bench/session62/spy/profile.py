"""Two py-spy raw profiles (`py-spy record -f raw -F`) of the timed rollout (frames under Run.decode, the warm-up's
`_timed` call left out), side by side.

    python bench/session62/spy/profile.py compare A.raw B.raw   # inclusive samples per function, largest differences first
    python bench/session62/spy/profile.py host A.raw B.raw      # call paths of the host work: the verify forward, the
                                                                # feature drafter's drafting and prefills left out
"""
import collections
import re
import sys

HOST_EXCLUDED = ("Verifier.verify", "FeatureDrafter.propose", "Run._prefill")


def stacks(path):
    """(frames, samples) of each timed-rollout stack, frames named without their file and line."""
    for line in open(path):
        stack, _, n = line.rstrip().rpartition(" ")
        frames = [re.sub(r" \(.*\)$", "", f) for f in stack.split(";")]
        if "Run.decode" in frames and "_timed" not in frames:
            yield frames, int(n)


def compare(path):
    counts, total = collections.Counter(), 0
    for frames, n in stacks(path):
        total += n
        for name in set(frames):
            counts[name] += n
    return counts, total


def host(path):
    counts, total = collections.Counter(), 0
    for frames, n in stacks(path):
        if any(name in frames for name in HOST_EXCLUDED):
            continue
        total += n
        below = frames[frames.index("Run.decode") + 1:]
        for depth in (1, 2, 3):
            if len(below) >= depth:
                counts[" > ".join(below[:depth])] += n
    return counts, total


mode, first, second = sys.argv[1:4]
(a, ta), (b, tb) = (compare if mode == "compare" else host)(first), (compare if mode == "compare" else host)(second)
print(f"samples: {ta} {tb}")
names = set(a) | set(b)
if mode == "compare":
    for name in sorted(names, key=lambda k: -(a[k] - b[k]))[:45]:
        print(f"{a[name] - b[name]:6d}  {a[name]:6d} {b[name]:6d}  {name}")
else:
    for name in sorted(names, key=lambda k: -max(a[k], b[k])):
        if max(a[name], b[name]) >= 8:
            print(f"{a[name]:5d} {b[name]:5d}  {name}")
