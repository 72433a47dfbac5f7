#!/bin/bash
# per-thread: tid, name, utime+stime ticks, last cpu, affinity; for each python process every 15 s
while true; do
  for p in $(pgrep -f "exp1.py|multiprocessing.spawn"); do
    echo "$(date +%T) pid $p $(tr '\0' ' ' < /proc/$p/cmdline | cut -c1-50) anonhugeKB $(grep AnonHugePages /proc/$p/smaps_rollup 2>/dev/null | awk '{print $2}')"
    for t in /proc/$p/task/*; do
      tid=${t##*/}; s=$(cat $t/stat 2>/dev/null) || continue
      echo "   tid $tid $(cat $t/comm) ticks $(echo $s | awk '{print $14+$15}') cpu $(echo $s | awk '{print $39}') aff $(taskset -p $tid 2>/dev/null | awk '{print $NF}')"
    done
  done
  sleep 15
done
