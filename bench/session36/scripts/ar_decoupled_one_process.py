"""ar and decoupled through the benchmark's own systems in ONE process, alternating: per-round medians.
argv: order (e.g. 'ar,decoupled'), repeats, prompts"""
import sys, time, statistics, torch
from benchmark.interface import RunSpec, FinishClock
from benchmark.systems import build_system
from benchmark.traces import get_trace, build_requests, sampling_config

def main():
    order = sys.argv[1].split(","); reps = int(sys.argv[2]); prompts = int(sys.argv[3])
    trace = get_trace("D").with_overrides(num_prompts=prompts)
    torch.set_num_threads(2)
    reqs, samp = build_requests(trace), sampling_config(trace)
    systems = {}
    for name in order:
        spec = RunSpec(system=name, trace=trace, target=trace.model.target, drafter=trace.model.drafter, dtype=trace.dtype,
                       max_batch_size=trace.max_batch_size)
        s = build_system(spec)
        s.generate(reqs[:1], samp.model_copy(update={"n": 1, "max_new_tokens": 8}), FinishClock())
        s.set_history(reqs, None)
        s.prepare(reqs, samp)
        systems[name] = s
        print("built", name, "threads", torch.get_num_threads(), flush=True)

    for rep in range(reps):
        for name in order:
            s = systems[name]
            t0 = time.perf_counter()
            g = s.generate(reqs, samp, FinishClock())
            dt = time.perf_counter() - t0
            tl = g.engine_stats.get("timeline") or []
            ds = [b["t"] - a["t"] for a, b in zip(tl, tl[1:])]
            four = [d for d, a in zip(ds, tl) if a.get("rows", 4) == 4]
            print(f"rep {rep} {name}: {dt:.1f} s, rounds {len(tl)}, median round {1000*statistics.median(ds):.1f} ms, "
                  f"arm_rounds {g.engine_stats.get('arm_rounds')} threads-after {torch.get_num_threads()}", flush=True)
    for s in systems.values():
        s.close()


if __name__ == '__main__':
    main()
