import json, sys
sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)) + "/../../..")
from kvbridge.bench.plot import save_plot

def ab(path, out, title):
    d = json.load(open(path))
    sizes = list(d["sizes"])
    def draw(fig):
        ax = fig.add_subplot(1, 1, 1)
        w = 0.8 / len(d["modes"])
        for i, m in enumerate(d["modes"]):
            ax.bar([x + i * w for x in range(len(sizes))], [d["sizes"][s][m]["median_gbps"] for s in sizes], w, label=m)
        ax.set_xticks([x + 0.4 - w / 2 for x in range(len(sizes))], [f"{int(s) >> 10} KiB" for s in sizes])
        ax.set_ylabel("GB/s (median READ)"); ax.set_ylim(250, 380); ax.legend()
    save_plot(out, draw, title)

ab("bench/results/read7/call3_read_ab.json", "bench/results/read7/read_ab.png", "read7: one cuda_ipc READ of 1 GiB, modes alternated (2x H200)")
ab("bench/results/read8/read_ab2.json", "bench/results/read8/read_ab.png", "read8: equal vs growing parts (2x H200)")
rows = [json.loads(l) for l in open("bench/results/kernel_sweep/run2_h100.jsonl") if l.strip()]
rows = [r for r in rows if r.get("layout") == "uniform" and "gbps" in r]
sizes = sorted({r["fragment_bytes"] for r in rows})
best = {}
for r in rows:
    best.setdefault(r["name"], {})[r["fragment_bytes"]] = r["gbps"]
def draw(fig):
    ax = fig.add_subplot(1, 1, 1)
    for name, v in sorted(best.items()):
        ax.plot([s >> 10 for s in sizes if s in v], [v[s] for s in sizes if s in v], marker="o", lw=1,
                label=name if name in ("base", "memcpy_peer_1GiB") or name.startswith(("tma", "push", "stream")) else None)
    ax.set_xscale("log", base=2); ax.set_xlabel("fragment KiB"); ax.set_ylabel("GB/s (1 GiB, kernel only)")
    ax.legend(fontsize=7)
save_plot("bench/results/kernel_sweep/run2_h100.png", draw, "kernel sweep: every variant vs cudaMemcpyPeer (2x H100)")
