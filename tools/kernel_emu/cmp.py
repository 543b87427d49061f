# Compares two outputs of driver.cpp (out, state, record): NaNs, largest difference, share of equal bits.
# With a fifth argument TOL, a part passes when it has no NaN and its largest difference is at most TOL times its
# largest magnitude (a rewrite that rounds differently); without it, only equal bits pass.
import struct, sys, math
def load(p): 
    d=open(p,'rb').read(); return struct.unpack('%df'%(len(d)//4), d), d
a, ab = load(sys.argv[1]); b,bb=load(sys.argv[2])
T,H,dk,dv=394,2,int(sys.argv[3]),int(sys.argv[4])
n1=T*H*dv; n2=3*H*dk*dv
bad = False
for name,(lo,hi) in [('out',(0,n1)),('state',(n1,n1+n2)),('rec',(n1+n2,len(a)))]:
    x,y=a[lo:hi],b[lo:hi]
    nan=sum(1 for v in x if v!=v), sum(1 for v in y if v!=v)
    mx=max(abs(v) for v in x if v==v); md=max((abs(p-q) for p,q in zip(x,y) if p==p and q==q), default=0)
    eq=sum(1 for i in range(lo,hi) if ab[4*i:4*i+4]==bb[4*i:4*i+4])
    print(name, hi-lo, 'nan', nan, 'max', mx, 'maxdiff', md, 'bitequal', eq/(hi-lo))
    tol = float(sys.argv[5]) if len(sys.argv) > 5 else None
    if (eq != hi - lo) if tol is None else (nan != (0, 0) or md > tol * mx):
        bad = True
sys.exit(1 if bad else 0)
