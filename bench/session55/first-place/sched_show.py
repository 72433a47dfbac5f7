import json, glob, sys
for f in sorted(glob.glob(sys.argv[1] + "/sched-*.json")):
    d = json.load(open(f))
    if not d:
        continue
    print(f)
    for holder, tasks in d.items():
        tot_run = sum(r for r, w in tasks.values()) / 1e9
        tot_wait = sum(w for r, w in tasks.values()) / 1e9
        print(f" during {holder}'s turns: all tasks on CPU {tot_run:.2f} s, waiting {tot_wait:.2f} s")
        for t, (run, wait) in sorted(tasks.items(), key=lambda kv: -kv[1][0]):
            if run > 5e7 or wait > 5e7:
                print("   %-22s run %8.3f s  wait %7.3f s" % (t, run / 1e9, wait / 1e9))
