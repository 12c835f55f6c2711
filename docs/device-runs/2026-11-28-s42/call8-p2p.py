import torch, time
n = 268435456  # bytes: one rank's K and V at 128K tokens of the Llama shape (P=2)
a0 = torch.empty(n, dtype=torch.uint8, device="cuda:0").random_()
a1 = torch.empty(n, dtype=torch.uint8, device="cuda:1").random_()
b0 = torch.empty_like(a0); b1 = torch.empty_like(a1)
print("peer access 0->1:", torch.cuda.can_device_access_peer(0, 1))
s0 = torch.cuda.Stream(device=0); s1 = torch.cuda.Stream(device=1)
def timed(f, reps=10):
    f(); torch.cuda.synchronize(0); torch.cuda.synchronize(1)
    t = time.perf_counter()
    for _ in range(reps): f()
    torch.cuda.synchronize(0); torch.cuda.synchronize(1)
    return (time.perf_counter() - t) / reps
def one():
    with torch.cuda.stream(s0): b1.copy_(a0, non_blocking=True)
def both():
    with torch.cuda.stream(s0): b1.copy_(a0, non_blocking=True)
    with torch.cuda.stream(s1): b0.copy_(a1, non_blocking=True)
for name, f in (("one way 0->1", one), ("both ways at once", both)):
    t = timed(f)
    print(f"{name}: {t*1e3:.3f} ms for {n/1e6:.0f} MB each way, {n/t/1e9:.0f} GB/s each way")
# 2.15 GB (1M tokens, P=2)
del a0, a1, b0, b1
n = 2147483648
a0 = torch.empty(n, dtype=torch.uint8, device="cuda:0"); a1 = torch.empty(n, dtype=torch.uint8, device="cuda:1")
b0 = torch.empty_like(a0); b1 = torch.empty_like(a1)
t = timed(both, 5)
print(f"both ways, {n/1e9:.2f} GB each: {t*1e3:.3f} ms, {n/t/1e9:.0f} GB/s each way")
