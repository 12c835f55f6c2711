"""The copy engines carrying a ring's hand-off: every GPU copies a buffer into the next GPU's
memory at once (torch's copy_ between devices runs on the source's stream, with peer access
on), for the sizes of one layer's K and V at the ring's decode shards; beside it one GPU's
own device-to-device copy of the same bytes. Prints GB/s a GPU sends."""
import sys, time
import torch

g = torch.cuda.device_count()
sizes = [int(float(s) * 2**20) for s in (sys.argv[1:] or ["16", "64", "256"])]
print(f"{g} GPUs; peer access 0->1: {g > 1 and torch.cuda.can_device_access_peer(0, 1)}")


def timed(f, reps):
    f()
    for d in range(g):
        torch.cuda.synchronize(d)
    t = time.perf_counter()
    for _ in range(reps):
        f()
    for d in range(g):
        torch.cuda.synchronize(d)
    return (time.perf_counter() - t) / reps


for n in sizes:
    src = [torch.empty(n, dtype=torch.uint8, device=f"cuda:{d}").random_() for d in range(g)]
    dst = [torch.empty_like(s) for s in src]
    streams = [torch.cuda.Stream(device=d) for d in range(g)]

    def ring(ranks):
        for d in range(ranks):
            with torch.cuda.device(d), torch.cuda.stream(streams[d]):
                dst[(d + 1) % ranks].copy_(src[d], non_blocking=True)

    def local():
        with torch.cuda.device(0), torch.cuda.stream(streams[0]):
            dst[0].copy_(src[0], non_blocking=True)

    reps = max(5, int(2e9 // n))
    t = timed(local, reps)
    print(f"{n / 2**20:7.1f} MiB  local copy on GPU 0: {t * 1e6:8.1f} us, {n / t / 1e9:6.0f} GB/s")
    for ranks in sorted({2, g}):
        if ranks > g or ranks < 2:
            continue
        t = timed(lambda: ring(ranks), reps)
        print(f"{n / 2**20:7.1f} MiB  ring of {ranks}: {t * 1e6:8.1f} us a hop, {n / t / 1e9:6.0f} GB/s a GPU")
    del src, dst
