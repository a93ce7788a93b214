"""Each row the faster of the `--kv-room model` and `--kv-room 0` runs (ties: model)."""
import json, sys
def rows(fs):
    out = {}
    for f in fs.split(','):
        for r in json.load(open(f))['rows']:
            out[(r['gpus'], r['distribution'], r['model'])] = r
    return out
before, model, zero = rows(sys.argv[1]), rows(sys.argv[2]), rows(sys.argv[3])
out = sys.argv[4] if len(sys.argv) > 4 else None
both = {}
for k in model:
    a, b = model[k], zero[k]
    a.setdefault('kv_room_mb', None); b['kv_room_mb'] = 0.0
    both[k] = a if a['step_s'] <= b['step_s'] else b
def stats(d):
    xs = [r['step_over_bound'] for r in d.values()]
    return sum(xs)/len(xs), max(xs)
keys = sorted(both, key=lambda k: (k[2], k[0], ['arxiv','github','prolong64k','chat'].index(k[1])))
print("| model | GPUs | data | x bound before -> model room -> kept | tok/s/GPU before -> kept | L | K/V room | ckpt | micro |")
print("|---|---:|---|---|---|---:|---|---|---:|")
for k in keys:
    o, m, n = before.get(k), model[k], both[k]
    room = "model" if n['kv_room_mb'] is None else f"{n['kv_room_mb']:g}"
    print(f"| {k[2]} | {k[0]:,} | {k[1]} | {o['step_over_bound']:.3f} -> {m['step_over_bound']:.3f} -> **{n['step_over_bound']:.3f}** | {o['tokens_per_s_per_gpu']:.0f} -> {n['tokens_per_s_per_gpu']:.0f} | {n['tokens_per_rank']:,} | {room} | {n['checkpointing']} | {n['micro_batches']} |")
print("mean/worst before %.3f/%.3f, model room %.3f/%.3f, kept %.3f/%.3f" % (*stats({k: before[k] for k in both}), *stats(model), *stats(both)))
if out:
    json.dump({"rows": [both[k] for k in keys], "note": "each row the faster of --kv-room model and --kv-room 0"}, open(out, 'w'), indent=1)
