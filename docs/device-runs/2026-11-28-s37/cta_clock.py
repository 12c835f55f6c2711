import sys, re, statistics as st
for f in sys.argv[1:]:
    starts={}; ctas=[]
    for l in open(f):
        pass
        m=re.match(r'CTA (\d+) sm (\d+) tokens (\d+) tiles (\d+) start (\d+) tq (\d+) tfirst (\d+) tloop (\d+) tend (\d+)',l)
        if m: ctas.append(dict(b=int(m[1]),sm=int(m[2]),tok=int(m[3]),tiles=int(m[4]),tq=int(m[6]),tf=int(m[7]),tl=int(m[8]),te=int(m[9]))); starts[int(m[1])]=int(m[5])
    t0=min(starts.values())
    def q(xs): xs=sorted(xs); return f"min {xs[0]/1e3:6.2f} med {xs[len(xs)//2]/1e3:6.2f} p90 {xs[int(len(xs)*.9)]/1e3:6.2f} max {xs[-1]/1e3:6.2f}"
    print(f, len(ctas), "CTAs; tokens", sorted(set(c['tok'] for c in ctas)), "tiles", sorted(set(c['tiles'] for c in ctas)))
    print(" start      ", q([starts[c['b']]-t0 for c in ctas]))
    print(" start->q   ", q([c['tq']-starts[c['b']] for c in ctas]))
    print(" q->first   ", q([c['tf']-c['tq'] for c in ctas]))
    print(" first->loop", q([c['tl']-c['tf'] for c in ctas]))
    print(" loop->end  ", q([c['te']-c['tl'] for c in ctas]))
    print(" end        ", q([c['te']-t0 for c in ctas]))
    print(" per tile after first", q([ (c['tl']-c['tf'])/max(1,c['tiles']-1) for c in ctas]))
