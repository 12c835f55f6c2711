# The SwiGLU comparison of `dense_ops_match_the_cpu` (bf16, 1 row, 4160 x 40) on the CPU alone:
# the GPU rounds the normed activation to bf16 before its product, the CPU does not. Counts
# draws whose error exceeds 1e-2 over the outputs' largest magnitude (the old metric) and over
# the square of the gate|up product's (compare::check_swiglu). Usage: python3 THIS N
import random, struct, math
def bf16(x):
    b=struct.unpack('<I',struct.pack('<f',x))[0]
    b=((b+0x7FFF+((b>>16)&1))>>16)<<16
    return struct.unpack('<f',struct.pack('<I',b&0xFFFFFFFF))[0]
def vals(rng,n,s): return [rng.uniform(0.05,1.0)*s*(1 if rng.random()<0.5 else -1) for _ in range(n)]
silu=lambda g: g/(1+math.exp(-g))
rng=random.Random(7); N=int(__import__('sys').argv[1]); h,i=4160,40
of=nf=0; wo=wn=0
for t in range(N):
    x=vals(rng,h,2.0); norm=[bf16(v) for v in vals(rng,h,1.5)]
    w=[[bf16(v) for v in vals(rng,h,0.2)] for _ in range(i)]
    rms=math.sqrt(sum(v*v for v in x)/h+1e-5)
    normed=[x[k]/rms*norm[k] for k in range(h)]; nr=[bf16(v) for v in normed]
    pc=[sum(a*b for a,b in zip(wr,normed)) for wr in w]; pg=[sum(a*b for a,b in zip(wr,nr)) for wr in w]
    oc=[silu(pc[j])*pc[j+i//2] for j in range(i//2)]; og=[silu(pg[j])*pg[j+i//2] for j in range(i//2)]
    d=max(abs(a-b) for a,b in zip(og,oc))
    eo=d/max(abs(v) for v in oc); en=d/max(abs(v) for v in pc)**2
    wo=max(wo,eo); wn=max(wn,en); of+=eo>1e-2; nf+=en>1e-2
print(f"{N} draws: old metric over 1e-2 in {of} (worst {wo:.3e}); new in {nf} (worst {wn:.3e})")
