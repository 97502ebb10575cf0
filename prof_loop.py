"""TEMP profiling wrapper (not committed)."""
import cProfile, os, time
def loop(cfg):
    prof = cProfile.Profile()
    t0 = time.process_time()
    prof.enable()
    try:
        from workers.train_loop import train_loop_per_worker
        train_loop_per_worker(cfg)
    finally:
        prof.disable()
        prof.dump_stats(f"/tmp/prof/worker_{os.getpid()}.pstats")
