import sys, re
def load(f):
    out = {}
    for line in open(f):
        m = re.match(r"(\d+ \S+ \S+) L=(\d+) kv=(\S+): step ([\d.]+) /bound ([\d.]+)", line)
        if m: out[m.group(1)] = float(m.group(5))
    return out
files = sys.argv[1:]
data = [load(f) for f in files]
keys = list(data[0])
print("row", *files)
for k in keys:
    print(k, *["%.4f" % d.get(k, float("nan")) for d in data])
import statistics as st
print("mean", *["%.4f" % st.mean(d.values()) for d in data])
print("worst", *["%.4f" % max(d.values()) for d in data])
print("best-of mean %.4f worst %.4f" % (st.mean(min(d[k] for d in data) for k in keys), max(min(d[k] for d in data) for k in keys)))
